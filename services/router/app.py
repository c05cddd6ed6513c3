"""A small OpenAI-compatible P/D proxy (aiohttp).

Pull: the prompt goes to prefill with ``max_tokens=1`` and ``kv_transfer_params =
{"do_remote_decode": true, "transfer_id": ...}``; prefill's response carries the
``kv_transfer_params`` (its engine id and held block ids) which the router forwards with
the original request to decode, streaming or not. Upstream status codes and error bodies
are relayed as they are, so a client sees vLLM's own errors.

Push: both legs are sent at once with one fresh ``transfer_id`` (the decode leg carries
``do_remote_prefill`` + ``transfer_mode=push``); the engines meet at the control plane.

Conversations (bidirectional reuse): a request naming a conversation (``conversation_id``
in the body, or the ``X-Conversation-Id`` header) has its decode leg carry the id, so
decode keeps the turn's KV under a lease. On the next turn the router renews that lease
and looks up the retained blocks (``Lease.Renew`` + ``Registrar.LookupRetained``, at once,
bounded by ``lookup_timeout_s``); when the lease is live and protects that registration it
hands them to prefill as ``kv_transfer_params.reuse`` (prefill decides whether to READ).
A control plane that is slow or down only costs the reuse: the request goes on without it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import uuid
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("kvbaton.router")

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


class Router:
    """Holds the upstream URLs and one shared HTTP session."""

    def __init__(self, prefill_url: str, decode_url: str, mode: str = "pull", *,
                 timeout_s: float = 300.0, control_plane: str = "", lookup_timeout_s: float = 1.0) -> None:
        if mode not in ("pull", "push"):
            raise ValueError(f"mode must be pull or push, got {mode!r}")
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.mode = mode
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self._session: aiohttp.ClientSession | None = None
        self.control_plane = control_plane
        self.lookup_timeout_s = lookup_timeout_s
        self._kv: Any = None  # KvbatonClient, made on the app's loop
        self.stats: dict[str, int] = {"conversation_turns": 0, "reuse_offered": 0, "reuse_unavailable": 0}

    async def start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        if self.control_plane:
            from kvbaton.client import KvbatonClient

            self._kv = KvbatonClient(self.control_plane, timeout_s=self.lookup_timeout_s)

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
        if self._kv is not None:
            await self._kv.close()

    async def _reuse_for(self, conversation_id: str) -> dict[str, Any] | None:
        """Renew the conversation's lease and look up its retained blocks (both bounded).

        Returns prefill's ``reuse`` params, or None when there is nothing safe to offer:
        no lease, a lease not ACTIVE, or a registration the lease does not protect (a turn
        registered but not yet leased). Prefill pins the lease before reading anyway.
        """
        if self._kv is None:
            return None
        from kvbaton.v1 import lease_pb2, registrar_pb2

        kv = self._kv
        renew = kv.lease.Renew(lease_pb2.RenewRequest(conversation_id=conversation_id),
                               timeout=self.lookup_timeout_s)
        lookup = kv.registrar.LookupRetained(registrar_pb2.LookupRetainedRequest(conversation_id=conversation_id),
                                             timeout=self.lookup_timeout_s)
        results = await asyncio.gather(renew, lookup, return_exceptions=True)
        renewed, found = results
        if isinstance(renewed, BaseException) or isinstance(found, BaseException):
            err = renewed if isinstance(renewed, BaseException) else found
            log.info("conversation %s: no reuse (%s)", conversation_id,
                     getattr(err, "code", lambda: err)() if hasattr(err, "code") else err)
            return None
        lease, ret = renewed.lease, found.retained
        if (renewed.status != lease_pb2.RENEW_STATUS_OK or lease.state != lease_pb2.LEASE_STATE_ACTIVE
                or lease.retention_id != ret.retention_id or lease.engine_id != ret.engine_id):
            log.info("conversation %s: retained KV not reusable (renew %s, lease %s, retention %s/%s)",
                     conversation_id, lease_pb2.RenewStatus.Name(renewed.status),
                     lease_pb2.LeaseState.Name(lease.state), lease.retention_id, ret.retention_id)
            return None
        return {"conversation_id": conversation_id, "engine_id": ret.engine_id, "lease_id": lease.lease_id,
                "retention_id": ret.retention_id, "block_ids": list(ret.block_ids),
                "num_tokens": ret.num_tokens, "tokens_per_block": ret.tokens_per_block,
                "block_hashes": [h.hex() for h in ret.block_hashes]}

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
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": f"body must be a JSON object, not {type(body).__name__}",
                                                "type": "BadRequestError", "code": 400}}, status=400)
        transfer_id = uuid.uuid4().hex  # fresh per dispatch: a retry is a new transfer
        conv = body.pop("conversation_id", None) or request.headers.get("X-Conversation-Id")
        conv = str(conv) if conv else ""
        reuse = None
        if conv:
            self.stats["conversation_turns"] += 1
            reuse = await self._reuse_for(conv)
            self.stats["reuse_offered" if reuse else "reuse_unavailable"] += 1
        if self.mode == "pull":
            return await self._pull(request, path, body, transfer_id, conv, reuse)
        return await self._push(request, path, body, transfer_id, conv, reuse)

    def _prefill_body(self, body: dict[str, Any], transfer_id: str, extra: dict[str, Any],
                      reuse: dict[str, Any] | None = None) -> dict[str, Any]:
        if reuse:
            extra = {**extra, "reuse": reuse}
        pb = copy.deepcopy(body)
        pb["max_tokens"] = 1
        pb.pop("max_completion_tokens", None)
        pb["stream"] = False
        pb.pop("stream_options", None)
        pb["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                    "transfer_id": transfer_id, **extra}
        return pb

    async def _pull(self, request: web.Request, path: str, body: dict[str, Any],
                    transfer_id: str, conv: str = "", reuse: dict[str, Any] | None = None) -> web.StreamResponse:
        async with self.session.post(f"{self.prefill_url}{path}",
                                     json=self._prefill_body(body, transfer_id, {}, reuse)) as r:
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
        if conv:
            db["kv_transfer_params"] = {**(db.get("kv_transfer_params") or {}), "conversation_id": conv}
        return await self._relay(request, f"{self.decode_url}{path}", db)

    async def _push(self, request: web.Request, path: str, body: dict[str, Any],
                    transfer_id: str, conv: str = "", reuse: dict[str, Any] | None = None) -> web.StreamResponse:
        pb = self._prefill_body(body, transfer_id, {"transfer_mode": "push"}, reuse)
        db = copy.deepcopy(body)
        db["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                    "transfer_id": transfer_id, "transfer_mode": "push"}
        if conv:
            db["kv_transfer_params"]["conversation_id"] = conv

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


def build_app(prefill_url: str, decode_url: str, mode: str = "pull", *,
              control_plane: str | None = None) -> web.Application:
    """``control_plane`` (default: ``$KVBATON_CONTROL_PLANE``) enables conversation reuse."""
    if control_plane is None:
        control_plane = os.environ.get("KVBATON_CONTROL_PLANE", "")
    router = Router(prefill_url, decode_url, mode, control_plane=control_plane)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_get("/health", router.health)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/kvbaton/stats", lambda r: web.json_response(router.stats))
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat)
    app["router"] = router
    return app
