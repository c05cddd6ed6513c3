"""Push dispatch names both engines (``--prefill-engine-id`` / ``--decode-engine-id``), so
the control plane binds the transfer to the pair (tests/services/test_ownership.py); the
connector reads them from ``kv_transfer_params``. Against the real router app and
stand-in engines."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from kvbaton.services.router.app import build_app
from tests.router.test_router_metrics import _Engine, _serve


async def _dispatch(mode: str, **ids: str) -> tuple[dict, dict]:
    prefill, decode = _Engine(), _Engine()
    runners, urls = [], []
    for eng in (prefill, decode):
        app = web.Application()
        app.router.add_post("/v1/completions", eng.handle)
        runner, url = await _serve(app)
        runners.append(runner)
        urls.append(url)
    runner, url = await _serve(build_app(urls[0], urls[1], mode, control_plane="", **ids))
    runners.append(runner)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4}) as r:
                assert r.status == 200, await r.text()
        return prefill.requests[0]["kv_transfer_params"], decode.requests[0]["kv_transfer_params"]
    finally:
        for r in reversed(runners):
            await r.cleanup()


async def test_push_names_the_pair_on_both_legs():
    p, d = await _dispatch("push", prefill_engine_id="prefill-0", decode_engine_id="decode-0")
    assert p["decode_engine_id"] == "decode-0" and d["prefill_engine_id"] == "prefill-0"
    assert p["transfer_id"] == d["transfer_id"]


async def test_unconfigured_router_names_nobody(monkeypatch):
    monkeypatch.delenv("KVBATON_PREFILL_ENGINE_ID", raising=False)
    monkeypatch.delenv("KVBATON_DECODE_ENGINE_ID", raising=False)
    p, d = await _dispatch("push")
    assert "decode_engine_id" not in p and "prefill_engine_id" not in d


async def test_engine_ids_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVBATON_PREFILL_ENGINE_ID", "p-env")
    monkeypatch.setenv("KVBATON_DECODE_ENGINE_ID", "d-env")
    p, d = await _dispatch("push")
    assert p["decode_engine_id"] == "d-env" and d["prefill_engine_id"] == "p-env"
