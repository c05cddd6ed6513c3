"""The router's Prometheus metrics (``kvbaton_router_*``), read from its own /metrics,
against the real router app and stand-in upstream engines (as in test_router_fuzz.py):
each request is counted by mode and status, legs are timed, upstream failures and pull
dispatches without ``kv_transfer_params`` are counted.
"""

from __future__ import annotations

import socket

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvbaton.services.router.app import build_app


class _Engine:
    """A stand-in engine: answers like vLLM; ``status`` / ``ktp`` / ``stream`` set what it returns."""

    def __init__(self) -> None:
        self.status = 200
        self.ktp: dict | None = {"remote_engine_id": "p0", "remote_block_ids": [1], "transfer_id": "x"}
        self.requests: list[dict] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": "boom", "code": self.status}}, status=self.status)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"choices": [{"text": "ok"}]}\n\n')
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        out = {"id": "cmpl-1", "object": "text_completion", "model": "m",
               "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
        if self.ktp is not None:
            out["kv_transfer_params"] = self.ktp
        return web.json_response(out)


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


class _Stack:
    def __init__(self) -> None:
        self.prefill, self.decode = _Engine(), _Engine()
        self.runners: list[web.AppRunner] = []

    async def start(self, mode: str, *, prefill_url: str | None = None) -> None:
        urls = []
        for eng in (self.prefill, self.decode):
            app = web.Application()
            app.router.add_post("/v1/completions", eng.handle)
            app.router.add_post("/v1/chat/completions", eng.handle)
            runner, url = await _serve(app)
            self.runners.append(runner)
            urls.append(url)
        runner, self.url = await _serve(build_app(prefill_url or urls[0], urls[1], mode, control_plane=""))
        self.runners.append(runner)
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    async def post(self, body: dict | bytes, path: str = "/v1/completions") -> tuple[int, bytes]:
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with self.session.post(self.url + path, **kw) as r:
            return r.status, await r.read()

    async def metrics(self) -> dict[tuple[str, tuple], float]:
        async with self.session.get(self.url + "/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    async def close(self) -> None:
        await self.session.close()
        for r in self.runners:
            await r.cleanup()


def _get(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    return _get(after, name, **labels) - _get(before, name, **labels)


@pytest.fixture
async def stack():
    s = _Stack()
    yield s
    await s.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_requests_are_counted_by_mode_and_status(stack, mode):
    await stack.start(mode)
    before = await stack.metrics()
    for _ in range(3):
        status, _ = await stack.post({"prompt": "hello", "max_tokens": 4})
        assert status == 200
    status, _ = await stack.post({"prompt": "hello", "max_tokens": 4, "stream": True})
    assert status == 200
    status, _ = await stack.post(b"not json")
    assert status == 400
    after = await stack.metrics()

    assert _delta(before, after, "kvbaton_router_requests_total", mode=mode, status="200") == 4
    assert _delta(before, after, "kvbaton_router_requests_total", mode=mode, status="400") == 1
    assert _delta(before, after, "kvbaton_router_request_seconds_count", mode=mode, leg="total") == 5
    assert _delta(before, after, "kvbaton_router_request_seconds_count", mode=mode, leg="decode") == 4
    assert _delta(before, after, "kvbaton_router_request_seconds_count", mode=mode, leg="prefill") == 4
    assert _delta(before, after, "kvbaton_router_upstream_errors_total", leg="decode") == 0
    assert _delta(before, after, "kvbaton_router_upstream_errors_total", leg="prefill") == 0
    # The series exist before any error happens (rate() sees 0, not "no data").
    assert ("kvbaton_router_upstream_errors_total", (("leg", "prefill"),)) in after


async def test_upstream_errors_and_missing_transfer_params(stack):
    await stack.start("pull")
    before = await stack.metrics()

    stack.prefill.status = 503  # prefill refuses: its status is relayed, decode is never called
    status, body = await stack.post({"prompt": "hi", "max_tokens": 2})
    assert status == 503 and b"boom" in body
    stack.prefill.status = 200

    stack.prefill.ktp = None  # prefill held nothing: decode recomputes
    status, _ = await stack.post({"prompt": "hi", "max_tokens": 2})
    assert status == 200
    assert "kv_transfer_params" not in stack.decode.requests[-1]
    stack.prefill.ktp = {"remote_engine_id": "p0", "remote_block_ids": [1], "transfer_id": "x"}

    stack.decode.status = 500
    status, _ = await stack.post({"prompt": "hi", "max_tokens": 2})
    assert status == 500
    after = await stack.metrics()

    assert _delta(before, after, "kvbaton_router_upstream_errors_total", leg="prefill") == 1
    assert _delta(before, after, "kvbaton_router_upstream_errors_total", leg="decode") == 1
    assert _delta(before, after, "kvbaton_router_missing_transfer_params_total") == 1
    assert _delta(before, after, "kvbaton_router_requests_total", mode="pull", status="503") == 1
    assert _delta(before, after, "kvbaton_router_requests_total", mode="pull", status="200") == 1
    assert _delta(before, after, "kvbaton_router_requests_total", mode="pull", status="500") == 1


async def test_unreachable_engine_is_a_502_and_an_upstream_error(stack):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    await stack.start("pull", prefill_url=dead)
    before = await stack.metrics()
    status, body = await stack.post({"prompt": "hi", "max_tokens": 2})
    after = await stack.metrics()
    assert status == 502 and b"prefill engine unreachable" in body
    assert _delta(before, after, "kvbaton_router_upstream_errors_total", leg="prefill") == 1
    assert _delta(before, after, "kvbaton_router_requests_total", mode="pull", status="502") == 1
    assert stack.decode.requests == []


async def test_prefill_params_of_another_version_are_refused_with_a_502(stack):
    await stack.start("pull")
    stack.prefill.ktp = {"kvbaton_params_version": 99, "remote_engine_id": "p0", "remote_block_ids": [1],
                         "transfer_id": "x"}
    status, body = await stack.post({"prompt": "hi", "max_tokens": 2})
    assert status == 502 and b"kv_transfer_params version 99 is not supported" in body
    assert stack.decode.requests == []  # never handed on to decode
    assert stack.prefill.requests[-1]["kv_transfer_params"]["kvbaton_params_version"] == 1
