"""A conversational answer is held until decode's retention of the turn is leased
(``services/router/retention.py``): the race behind the session-20 e2e regression, made
deterministic. Real router app and real control plane (in-process gRPC, memory store);
stand-in engines whose decode answers like the connector (``retained`` with a pending
lease) while the test plays decode's control thread (RegisterRetained, then Grant) at the
moments it chooses.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from kvbaton.v1 import lease_pb2, registrar_pb2
from tests.router.test_router_fleet import _register as _register_engine
from tests.router.test_router_fleet import _serve, _until, fleet, plane  # noqa: F401 - fixtures

CONV = "agent-r"


class Decode:
    """A stand-in decode engine: each answer reports ``retained`` (lease pending) for the
    blocks the test names, as the connector's ``request_finished`` does."""

    def __init__(self) -> None:
        self.block_ids = [3, 4]
        self.answered = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        ret = {"conversation_id": body["kv_transfer_params"].get("conversation_id", ""), "engine_id": "d0",
               "hold_id": "h", "block_ids": self.block_ids, "num_tokens": 16 * len(self.block_ids),
               "tokens_per_block": 16, "lease": "pending"}
        self.answered.set()
        return web.json_response({"id": "c", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": "d0", "finish_reason": "length"}],
                                  "kv_transfer_params": {"retained": ret}})


async def _prefill(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                              "kv_transfer_params": {"remote_engine_id": "p0", "remote_block_ids": [1],
                                                     "transfer_id": "x"}})


async def _rig(fleet, plane, **router_kw) -> tuple[str, Decode]:  # noqa: F811
    dec = Decode()
    apps = []
    for handler in (_prefill, dec.handle):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        apps.append(app)
    urls = []
    for app in apps:
        runner, url = await _serve(app)
        fleet.runners.append(runner)
        urls.append(url)
    await _register_engine(plane.kv, "d0", urls[1])  # decode registers its retained blocks as itself
    router = await fleet.router(f"p0={urls[0]}", f"d0={urls[1]}", mode="pull", control_plane=plane.address,
                                discover=False, **router_kw)
    return router, dec


async def _stats(fleet, router: str) -> dict:  # noqa: F811
    async with fleet.session.get(router + "/kvbaton/stats") as r:
        return await r.json()


async def _register(kv, block_ids: list[int]) -> registrar_pb2.RetainedBlocks:
    reg = await kv.call(kv.registrar.RegisterRetained, registrar_pb2.RegisterRetainedRequest(
        retained=registrar_pb2.RetainedBlocks(conversation_id=CONV, engine_id="d0", block_ids=block_ids,
                                              num_tokens=16 * len(block_ids), tokens_per_block=16)))
    return reg.retained


async def _grant(kv, retained: registrar_pb2.RetainedBlocks) -> lease_pb2.LeaseInfo:
    resp = await kv.call(kv.lease.Grant, lease_pb2.GrantRequest(
        conversation_id=CONV, engine_id="d0", ttl_ms=30_000, num_blocks=len(retained.block_ids),
        retention_id=retained.retention_id))
    return resp.lease


async def test_answer_waits_for_the_turns_lease_then_names_it(fleet, plane):  # noqa: F811
    """Turn 2 of a conversation whose turn 1 is leased: the answer is not sent while decode's
    new registration is missing, nor while it is registered but not yet leased (the old lease
    protects the old registration only); once leased, the answer names that lease, so the
    client's next lookup or revoke finds it."""
    kv = plane.kv
    router, dec = await _rig(fleet, plane)
    await _grant(kv, await _register(kv, [1]))  # turn 1, leased
    turn = asyncio.create_task(fleet.post(router, {"prompt": "t2", "max_tokens": 1, "conversation_id": CONV}))
    await asyncio.wait_for(dec.answered.wait(), 10)
    await _until(lambda: _waiting(fleet, router, 1))  # the router holds decode's answer
    new = await _register(kv, [3, 4])  # decode's RegisterRetained landed; its Grant not yet
    seen = (await _stats(fleet, router))["retention_granted"]
    assert not turn.done() and seen == 0
    lease = await _grant(kv, new)
    status, headers, raw = await asyncio.wait_for(turn, 10)
    assert status == 200
    ret = json.loads(raw)["kv_transfer_params"]["retained"]
    assert (ret["lease"], ret["lease_id"], ret["retention_id"]) == ("granted", lease.lease_id, new.retention_id)
    assert "retain;dur=" in headers["Server-Timing"]
    stats = await _stats(fleet, router)
    assert (stats["retention_granted"], stats["retention_not_visible"], stats["retention_waiting"]) == (1, 0, 0)


async def test_a_retention_never_leased_costs_the_bound_not_the_answer(fleet, plane):  # noqa: F811
    """Decode never leases the turn (its Grant failed): the answer still goes out, as decode
    gave it (lease pending), after ``retain_wait_s``, and is counted."""
    router, dec = await _rig(fleet, plane, retain_wait_s=0.3)
    t0 = time.monotonic()
    status, _, raw = await fleet.post(router, {"prompt": "t1", "max_tokens": 1, "conversation_id": CONV})
    took = time.monotonic() - t0
    assert status == 200 and json.loads(raw)["kv_transfer_params"]["retained"]["lease"] == "pending"
    assert 0.3 <= took < 5.0, took
    stats = await _stats(fleet, router)
    assert (stats["retention_granted"], stats["retention_not_visible"]) == (0, 1)


async def test_an_answer_without_a_conversation_is_not_held(fleet, plane):  # noqa: F811
    router, dec = await _rig(fleet, plane, retain_wait_s=30.0)
    status, headers, raw = await asyncio.wait_for(fleet.post(router, {"prompt": "x", "max_tokens": 1}), 10)
    assert status == 200 and "retain;" not in headers.get("Server-Timing", "")
    assert (await _stats(fleet, router))["retention_not_visible"] == 0


async def _waiting(fleet, router: str, n: int) -> bool:  # noqa: F811
    return (await _stats(fleet, router))["retention_waiting"] == n
