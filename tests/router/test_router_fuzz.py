"""Fuzzing the router's HTTP body parsing (hypothesis), against the real router app and
stand-in upstream engines that record what reached them.

Whatever the body — not JSON, JSON that is not an object, wrong types, odd conversation
ids, huge values — the router answers: either a 4xx with a message (and nothing reaches
an engine) or the upstream's own answer relayed. Never a 5xx of its own, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest
from aiohttp import web

from kvbaton.services.router.app import build_app

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


class _Stack:
    """Router + a stand-in prefill and decode engine on one background loop."""

    def __init__(self, mode: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.seen: list[tuple[str, object]] = []
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._start(mode))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True, name=f"router-fuzz-{mode}")
        self.thread.start()
        assert ready.wait(20)

    async def _start(self, mode: str) -> None:
        async def engine(request: web.Request) -> web.Response:
            body = await request.json()
            self.seen.append((request.path, body))
            ktp = {"remote_engine_id": "p0", "remote_block_ids": [1], "transfer_id": "x"}
            return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": "m",
                                      "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                                      "kv_transfer_params": ktp})

        self.runners = []
        urls = []
        for _ in range(2):
            app = web.Application()
            app.router.add_post("/v1/completions", engine)
            app.router.add_post("/v1/chat/completions", engine)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        router = web.AppRunner(build_app(urls[0], urls[1], mode, control_plane=""))
        await router.setup()
        site = web.TCPSite(router, "127.0.0.1", 0)
        await site.start()
        self.runners.append(router)
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    def post(self, path: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        async def go():
            async with self.session.post(self.url + path, data=data, headers=headers or {}) as r:
                return r.status, await r.read()
        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(15)

    def close(self) -> None:
        async def stop():
            await self.session.close()
            for r in self.runners:
                await r.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module", params=["pull", "push"])
def stack(request):
    s = _Stack(request.param)
    yield s
    s.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
bodies = st.one_of(
    st.binary(max_size=200),  # not JSON at all
    json_values.map(lambda v: json.dumps(v).encode()),  # JSON, any shape
    st.fixed_dictionaries({"prompt": json_values}, optional={
        "max_tokens": json_values, "stream": json_values, "conversation_id": json_values,
        "model": json_values, "messages": json_values, "kv_transfer_params": json_values,
    }).map(lambda d: json.dumps(d).encode()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       conv_header=st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=40)))
def test_router_answers_every_body_without_crashing(stack, body, path, conv_header):
    before = len(stack.seen)
    status, payload = stack.post(path, body, {"X-Conversation-Id": conv_header} if conv_header else None)
    assert status < 500, (status, payload[:300], body[:200])
    if 400 <= status < 500:
        assert b"message" in payload, payload[:300]  # a 4xx says why
        assert len(stack.seen) == before  # a refused body reaches no engine
    else:
        assert len(stack.seen) > before
