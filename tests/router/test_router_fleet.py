"""The router over a fleet (issue 13), against the real router app, stand-in engines that
answer like vLLM and record what reached them, and — for discovery, affinity and drain — a
real control plane (in-process gRPC server, memory store).

What the stand-ins cannot show (real KV moving, answers equal to a single engine's) is in
``tests/e2e/test_fleet_vllm.py``.
"""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from kvbaton.client import KvbatonClient
from kvbaton.services.domain.clock import WallClock
from kvbaton.services.router.app import build_app, conversation_of, parse_engine_spec
from kvbaton.services.server import ControlPlane, ServerConfig
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import common_pb2, lease_pb2, registrar_pb2
from tests.services.helpers import engine_rank


class Engine:
    """A stand-in engine: records request bodies; ``die`` drops the connection before
    answering (what a SIGKILLed engine looks like to the router)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict] = []
        self.die = False
        self.hold: asyncio.Event | None = None  # answer only once set (an engine still working)
        self.running = 0  # what its /metrics says (requests another router put on it)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.running}.0\n'
                                 f'vllm:num_requests_waiting{{engine="0",model_name="m"}} 0.0\n'
                                 f'vllm:num_requests_waiting_by_reason{{reason="capacity"}} 9.0\n')

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.die:
            request.transport.close()  # type: ignore[union-attr]
            await asyncio.sleep(1)
            raise ConnectionResetError
        if self.hold is not None:
            await self.hold.wait()
        ktp = {"remote_engine_id": self.name, "remote_block_ids": [1], "transfer_id": "x"}
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(f'data: {{"choices": [{{"text": "{self.name}"}}]}}\n\n'.encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response({"id": "c", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": self.name, "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}},
                                  "kv_transfer_params": ktp})


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


class Fleet:
    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}
        self.urls: dict[str, str] = {}
        self.runners: list[web.AppRunner] = []
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))

    async def engine(self, name: str) -> str:
        eng = self.engines[name] = Engine(name)
        app = web.Application()
        app.router.add_post("/v1/completions", eng.handle)
        app.router.add_post("/v1/chat/completions", eng.handle)
        app.router.add_get("/metrics", eng.metrics)
        runner, url = await _serve(app)
        self.runners.append(runner)
        self.urls[name] = url
        return url

    async def router(self, *args, **kw) -> str:
        runner, url = await _serve(build_app(*args, **kw))
        self.runners.append(runner)
        return url

    async def post(self, router: str, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
        async with self.session.post(router + "/v1/completions", json=body, headers=headers or {}) as r:
            return r.status, dict(r.headers), await r.read()

    async def close(self) -> None:
        await self.session.close()
        for r in reversed(self.runners):
            await r.cleanup()


@pytest.fixture
async def fleet():
    f = Fleet()
    yield f
    await f.close()


@pytest.fixture
async def plane():
    cp = ControlPlane(ServerConfig(address="127.0.0.1:0", grace_s=0.5, insecure=True), store=MemoryStore(),
                      clock=WallClock())
    await cp.start()
    kv = KvbatonClient(cp.address, timeout_s=5.0)
    await kv.wait_ready()
    cp.kv = kv
    yield cp
    await kv.close()
    await cp.stop()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def _register(kv, name: str, url: str, role=common_pb2.ENGINE_ROLE_DECODE) -> None:
    rank = engine_rank(name, role)
    rank.serve_url = url
    await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(rank=rank, ttl_ms=10_000))


async def _fleet_of(fleet: Fleet, router: str) -> dict[str, dict]:
    async with fleet.session.get(router + "/kvbaton/fleet") as r:
        return {e["engine_id"]: e for e in (await r.json())["engines"]}


async def _until(pred, timeout_s: float = 5.0) -> float:
    """Waits (bounded) for an async predicate; returns the seconds it took."""
    t0 = time.monotonic()
    while not await pred():
        assert time.monotonic() - t0 < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_engine_specs_and_conversation_names():
    assert parse_engine_spec("decode-0=http://h:1/") == ("decode-0", "http://h:1")
    assert parse_engine_spec("http://h:1") == ("http://h:1", "http://h:1")
    with pytest.raises(ValueError):
        parse_engine_spec("h:1")
    assert conversation_of({"conversation_id": "a"}, {"X-Session-ID": "a"}) == "a"
    assert conversation_of({}, {"X-Session-ID": "s"}) == "s"
    body = {"conversation_id": 7}
    assert conversation_of(body, {}) == "7" and "conversation_id" not in body


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_static_fleet_spreads_load_and_names_engines(fleet, mode):
    p = [await fleet.engine(n) for n in ("p0", "p1")]
    d = [await fleet.engine(n) for n in ("d0", "d1")]
    router = await fleet.router([f"p0={p[0]}", f"p1={p[1]}"], [f"d0={d[0]}", f"d1={d[1]}"], mode, control_plane="")
    served = []
    for _ in range(4):
        status, headers, _ = await fleet.post(router, {"prompt": "hello", "max_tokens": 2})
        assert status == 200
        served.append((headers["X-Kvbaton-Prefill"], headers["X-Kvbaton-Decode"]))
    assert sorted(served) == [("p0", "d0"), ("p0", "d0"), ("p1", "d1"), ("p1", "d1")]
    assert all(len(fleet.engines[n].bodies) == 2 for n in ("p0", "p1", "d0", "d1"))


async def test_a_conversation_stays_on_its_prefill_and_answers_say_where_time_went(fleet):
    p = [await fleet.engine(n) for n in ("p0", "p1")]
    d = await fleet.engine("d0")
    router = await fleet.router([f"p0={p[0]}", f"p1={p[1]}"], [f"d0={d}"], "pull", control_plane="")
    served: dict[str, list[str]] = {"a": [], "b": [], "": []}
    for _ in range(3):
        for conv in ("a", "b", "", ""):
            status, headers, _ = await fleet.post(router, {"prompt": [5] * 400, "max_tokens": 2},
                                                  {"X-Session-ID": conv} if conv else {})
            assert status == 200
            served[conv].append(headers["X-Kvbaton-Prefill"])
            timing = headers["Server-Timing"]
            assert "prefill;dur=" in timing and "decode;dur=" in timing
            assert ("lookup;dur=" in timing) == bool(conv)
            assert headers["X-Kvbaton-Prefill-Cached-Tokens"] == "7"
    # Each conversation keeps the prefill whose prefix cache holds its history; requests
    # without a conversation still go by load alone (they alternate).
    assert len(set(served["a"])) == 1 and len(set(served["b"])) == 1 and served["a"] != served["b"]
    assert set(served[""]) == {"p0", "p1"}
    async with fleet.session.get(router + "/kvbaton/stats") as r:
        stats = await r.json()
    assert stats["prefill_cached"] == 4 and stats["prefill_least_work"] == 2 + 6


async def test_engines_own_counts_steer_around_another_routers_load(fleet):
    p = await fleet.engine("p0")
    d = [await fleet.engine(n) for n in ("d0", "d1")]
    fleet.engines["d0"].running = 3  # busy with another router's requests
    router = await fleet.router([f"p0={p}"], [f"d0={d[0]}", f"d1={d[1]}"], "pull", control_plane="",
                                load_poll_s=0.05)

    async def polled() -> bool:
        return (await _fleet_of(fleet, router))["d0"]["reported_requests"] == 3
    await _until(polled)
    for _ in range(3):
        status, headers, _ = await fleet.post(router, {"prompt": "x", "max_tokens": 1})
        assert status == 200 and headers["X-Kvbaton-Decode"] == "d1"
        await _until(polled)  # the poll after the answer (a finished request voids the last report)


async def test_conversation_headers_reach_decode_and_conflicts_are_400(fleet):
    p, d = await fleet.engine("p0"), await fleet.engine("d0")
    router = await fleet.router(p, d, "pull", control_plane="")
    for headers, body in (({"X-Conversation-Id": "c-1"}, {}), ({"X-Session-ID": "c-1"}, {}),
                          ({}, {"conversation_id": "c-1"})):
        status, _, _ = await fleet.post(router, {"prompt": "x", "max_tokens": 1, **body}, headers)
        assert status == 200
        assert fleet.engines["d0"].bodies[-1]["kv_transfer_params"]["conversation_id"] == "c-1"
        assert "conversation_id" not in fleet.engines["p0"].bodies[-1]
    n = len(fleet.engines["p0"].bodies)
    status, _, raw = await fleet.post(router, {"prompt": "x", "conversation_id": "a"}, {"X-Session-ID": "b"})
    assert status == 400 and b"conversation named differently" in raw
    assert len(fleet.engines["p0"].bodies) == n  # nothing reached an engine


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("stream", [False, True])
async def test_decode_dying_before_any_token_is_retried_once_elsewhere(fleet, mode, stream):
    p = await fleet.engine("p0")
    d = [await fleet.engine(n) for n in ("d0", "d1")]
    fleet.engines["d0"].die = True
    router = await fleet.router([f"p0={p}"], [f"d0={d[0]}", f"d1={d[1]}"], mode, control_plane="")
    status, headers, raw = await fleet.post(router, {"prompt": "hi", "max_tokens": 2, "stream": stream})
    assert status == 200 and headers["X-Kvbaton-Decode"] == "d1" and headers["X-Kvbaton-Attempts"] == "2"
    assert b"d1" in raw
    tids = [b["kv_transfer_params"]["transfer_id"] for b in fleet.engines["p0"].bodies]
    assert len(tids) == 2 and tids[0] != tids[1]  # a new transfer attempt
    assert headers["X-Kvbaton-Transfer-Id"] == tids[1]  # the one that answered (the engines' stats lines name it)
    # d0 is suspect now: the next request goes straight to d1.
    status, headers, _ = await fleet.post(router, {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and headers["X-Kvbaton-Attempts"] == "1" and headers["X-Kvbaton-Decode"] == "d1"
    async with fleet.session.get(router + "/kvbaton/stats") as r:
        assert (await r.json())["retries"] == 1


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_prefill_dying_is_retried_on_the_other_prefill(fleet, mode):
    p = [await fleet.engine(n) for n in ("p0", "p1")]
    d = await fleet.engine("d0")
    fleet.engines["p0"].die = True
    if mode == "push":  # decode waits for pushed KV: it must be dropped, not awaited
        fleet.engines["d0"].hold = asyncio.Event()

        async def release_when_retried():
            while len(fleet.engines["p1"].bodies) < 1:
                await asyncio.sleep(0.01)
            fleet.engines["d0"].hold.set()
        releaser = asyncio.ensure_future(release_when_retried())
    router = await fleet.router([f"p0={p[0]}", f"p1={p[1]}"], [f"d0={d}"], mode, control_plane="")
    status, headers, _ = await fleet.post(router, {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and headers["X-Kvbaton-Prefill"] == "p1" and headers["X-Kvbaton-Attempts"] == "2"
    if mode == "push":
        await releaser


async def test_no_other_engine_means_one_502(fleet):
    d = await fleet.engine("d0")
    router = await fleet.router([_dead_url()], [d], "pull", control_plane="")
    status, _, raw = await fleet.post(router, {"prompt": "hi", "max_tokens": 2})
    assert status == 502 and b"prefill engine unreachable" in raw
    assert fleet.engines["d0"].bodies == []


async def test_discovery_follows_registrations_drain_and_affinity_across_two_routers(fleet, plane):
    kv = plane.kv
    for name, role in (("p0", common_pb2.ENGINE_ROLE_PREFILL), ("p1", common_pb2.ENGINE_ROLE_PREFILL),
                       ("d0", common_pb2.ENGINE_ROLE_DECODE), ("d1", common_pb2.ENGINE_ROLE_DECODE)):
        await _register(kv, name, await fleet.engine(name), role)
    routers = [await fleet.router(mode="pull", control_plane=plane.address) for _ in range(2)]
    assert set(await _fleet_of(fleet, routers[0])) == {"p0", "p1", "d0", "d1"}

    # A conversation whose KV d1 holds under a live lease goes to d1 from either router,
    # and the chosen prefill is offered d1's blocks.
    reg = await kv.call(kv.registrar.RegisterRetained, registrar_pb2.RegisterRetainedRequest(
        retained=registrar_pb2.RetainedBlocks(conversation_id="agent-1", engine_id="d1", block_ids=[4, 5],
                                              num_tokens=32, tokens_per_block=16)))
    await kv.call(kv.lease.Grant, lease_pb2.GrantRequest(conversation_id="agent-1", engine_id="d1", ttl_ms=30_000,
                                                         num_blocks=2, retention_id=reg.retained.retention_id))
    # One request without a conversation on router 1: its next choice is the other prefill.
    # Each router then keeps the conversation on the prefill it chose (its own cache hint),
    # so the two routers serve it from different prefills, each offered d1's blocks.
    assert (await fleet.post(routers[1], {"prompt": "x", "max_tokens": 1}))[1]["X-Kvbaton-Prefill"] == "p0"
    prefills = set()
    for i in range(6):
        status, headers, _ = await fleet.post(routers[i % 2], {"prompt": "turn", "max_tokens": 1},
                                              {"X-Session-ID": "agent-1"})
        assert status == 200 and headers["X-Kvbaton-Decode"] == "d1" and headers["X-Kvbaton-Reuse-Tokens"] == "32"
        prefills.add(headers["X-Kvbaton-Prefill"])
        reuse = fleet.engines[headers["X-Kvbaton-Prefill"]].bodies[-1]["kv_transfer_params"]["reuse"]
        assert reuse["engine_id"] == "d1" and reuse["block_ids"] == [4, 5]
    assert prefills == {"p0", "p1"}  # the READ goes onto whichever prefill was chosen

    # Drain d1: both routers stop sending to it, and stop offering its KV.
    await kv.call(kv.registrar.DrainEngine, registrar_pb2.DrainEngineRequest(engine_id="d1"))
    for r in routers:
        await _until(lambda r=r: _drained(fleet, r, "d1"), 1.0)
    before = len(fleet.engines["d1"].bodies)
    for i in range(4):
        status, headers, _ = await fleet.post(routers[i % 2], {"prompt": "turn", "max_tokens": 1},
                                              {"X-Conversation-Id": "agent-1"})
        assert status == 200 and headers["X-Kvbaton-Decode"] == "d0" and headers["X-Kvbaton-Reuse-Tokens"] == "0"
    assert len(fleet.engines["d1"].bodies) == before

    # A registration that ends: gone from both routers within 1 s of the event.
    await kv.call(kv.registrar.DeregisterEngine, registrar_pb2.DeregisterEngineRequest(engine_id="p0"))
    for r in routers:
        took = await _until(lambda r=r: _gone(fleet, r, "p0"), 1.0)
        assert took < 1.0
    for i in range(3):
        status, headers, _ = await fleet.post(routers[i % 2], {"prompt": "x", "max_tokens": 1})
        assert status == 200 and headers["X-Kvbaton-Prefill"] == "p1"
    # A new engine joins without restarting anything.
    await _register(kv, "p2", await fleet.engine("p2"), common_pb2.ENGINE_ROLE_PREFILL)
    await _until(lambda: _present(fleet, routers[0], "p2"), 1.0)


async def _drained(fleet, router, name) -> bool:
    return (await _fleet_of(fleet, router)).get(name, {}).get("draining", False)


async def _gone(fleet, router, name) -> bool:
    return name not in await _fleet_of(fleet, router)


async def _present(fleet, router, name) -> bool:
    return name in await _fleet_of(fleet, router)


async def test_decision_cost_is_measured(fleet):
    p, d = await fleet.engine("p0"), await fleet.engine("d0")
    router = await fleet.router(p, d, "pull", control_plane="")
    for _ in range(3):
        await fleet.post(router, {"prompt": "x", "max_tokens": 1})
    async with fleet.session.get(router + "/kvbaton/fleet") as r:
        view = await r.json()
    cost, cpu = view["decision_us"], view["decision_cpu_us"]
    assert cost["n"] == cpu["n"] == 3 and 0 < cost["p50"] <= cost["p99"] < 1000
    assert 0 < cpu["p50"] <= cpu["p99"] < 1000


async def test_idle_upstream_connections_are_closed_before_the_engines_close_them(fleet, monkeypatch):
    """vLLM closes idle connections after 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a router that
    keeps them longer may send a leg on one the engine is closing, and the leg fails as if
    the engine were dead. The router closes its idle pooled connections first."""
    from kvbaton.services.router import app as router_app

    assert router_app.UPSTREAM_KEEPALIVE_S < 5.0
    monkeypatch.setattr(router_app, "UPSTREAM_KEEPALIVE_S", 0.3)  # the mechanism, quickly
    p = await fleet.engine("p0")
    p_server = fleet.runners[-1].server
    d = await fleet.engine("d0")
    d_server = fleet.runners[-1].server
    router = await fleet.router([f"p0={p}"], [f"d0={d}"], "pull", control_plane="")
    status, _, _ = await fleet.post(router, {"prompt": "hi", "max_tokens": 2})
    assert status == 200
    # Both engines saw the router's connection; it goes once idle (the stand-ins' own
    # keep-alive is aiohttp's 75 s, so only the router can have closed it).
    async def closed() -> bool:
        return not p_server.connections and not d_server.connections
    await _until(closed, timeout_s=3.0)
