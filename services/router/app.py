"""A small OpenAI-compatible P/D proxy (aiohttp).

Pull: the prompt goes to prefill with ``max_tokens=1`` and ``kv_transfer_params =
{"do_remote_decode": true, "transfer_id": ...}``; prefill's response carries the
``kv_transfer_params`` (its engine id and held block ids) which the router forwards with
the original request to decode, streaming or not. Upstream status codes and error bodies
are relayed as they are, so a client sees vLLM's own errors.

Push: both legs are sent at once with one fresh ``transfer_id`` (the decode leg carries
``do_remote_prefill`` + ``transfer_mode=push``); the engines meet at the control plane.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import uuid
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("kvbaton.router")

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


class Router:
    """Holds the upstream URLs and one shared HTTP session."""

    def __init__(self, prefill_url: str, decode_url: str, mode: str = "pull", *,
                 timeout_s: float = 300.0) -> None:
        if mode not in ("pull", "push"):
            raise ValueError(f"mode must be pull or push, got {mode!r}")
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.mode = mode
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self._session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None
        return self._session

    # ------------------------------------------------------------------ handlers
    async def health(self, request: web.Request) -> web.Response:
        """200 only when both engines answer /health (a router in front of a dead engine is not healthy)."""
        async def ok(url: str) -> bool:
            try:
                async with self.session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False
        p, d = await asyncio.gather(ok(self.prefill_url), ok(self.decode_url))
        return web.json_response({"prefill": p, "decode": d}, status=200 if p and d else 503)

    async def models(self, request: web.Request) -> web.StreamResponse:
        async with self.session.get(f"{self.decode_url}/v1/models") as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._dispatch(request, "/v1/completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._dispatch(request, "/v1/chat/completions")

    async def _dispatch(self, request: web.Request, path: str) -> web.StreamResponse:
        try:
            body: dict[str, Any] = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "body is not JSON", "type": "BadRequestError",
                                                "code": 400}}, status=400)
        transfer_id = uuid.uuid4().hex  # fresh per dispatch: a retry is a new transfer
        if self.mode == "pull":
            return await self._pull(request, path, body, transfer_id)
        return await self._push(request, path, body, transfer_id)

    def _prefill_body(self, body: dict[str, Any], transfer_id: str, extra: dict[str, Any]) -> dict[str, Any]:
        pb = copy.deepcopy(body)
        pb["max_tokens"] = 1
        pb.pop("max_completion_tokens", None)
        pb["stream"] = False
        pb.pop("stream_options", None)
        pb["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                    "transfer_id": transfer_id, **extra}
        return pb

    async def _pull(self, request: web.Request, path: str, body: dict[str, Any],
                    transfer_id: str) -> web.StreamResponse:
        async with self.session.post(f"{self.prefill_url}{path}",
                                     json=self._prefill_body(body, transfer_id, {})) as r:
            raw = await r.read()
            if r.status != 200:
                return web.Response(status=r.status, body=raw,
                                    content_type=r.content_type or "application/json")
        try:
            ktp = json.loads(raw).get("kv_transfer_params")
        except json.JSONDecodeError:
            ktp = None
        db = copy.deepcopy(body)
        if ktp:
            db["kv_transfer_params"] = ktp
        else:
            # Prefill held nothing (e.g. an empty prompt): decode computes it all itself.
            log.warning("prefill returned no kv_transfer_params for %s; decode recomputes", transfer_id)
            db.pop("kv_transfer_params", None)
        return await self._relay(request, f"{self.decode_url}{path}", db)

    async def _push(self, request: web.Request, path: str, body: dict[str, Any],
                    transfer_id: str) -> web.StreamResponse:
        pb = self._prefill_body(body, transfer_id, {"transfer_mode": "push"})
        db = copy.deepcopy(body)
        db["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                    "transfer_id": transfer_id, "transfer_mode": "push"}

        async def prefill() -> tuple[int, bytes]:
            async with self.session.post(f"{self.prefill_url}{path}", json=pb) as r:
                return r.status, await r.read()

        ptask = asyncio.create_task(prefill())
        try:
            return await self._relay(request, f"{self.decode_url}{path}", db)
        finally:
            try:
                status, raw = await asyncio.wait_for(ptask, self.timeout.total or 300)
                if status != 200:
                    log.warning("push prefill leg for %s failed: %d %s", transfer_id, status, raw[:500])
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                log.warning("push prefill leg for %s failed: %r", transfer_id, exc)

    async def _relay(self, request: web.Request, url: str, body: dict[str, Any]) -> web.StreamResponse:
        """POST to ``url`` and pass status, headers and body (streamed chunk by chunk) back."""
        async with self.session.post(url, json=body) as r:
            if not body.get("stream"):
                return web.Response(status=r.status, body=await r.read(),
                                    content_type=r.content_type or "application/json")
            resp = web.StreamResponse(status=r.status, headers={
                k: v for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS})
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp


def build_app(prefill_url: str, decode_url: str, mode: str = "pull") -> web.Application:
    router = Router(prefill_url, decode_url, mode)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_get("/health", router.health)
    app.router.add_get("/v1/models", router.models)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat)
    app["router"] = router
    return app
