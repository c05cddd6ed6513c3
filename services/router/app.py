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

Observability: ``/metrics`` (Prometheus text) exports ``kvbaton_router_*``
(``kvbaton.services.metrics.RouterMetrics``): requests by mode and status returned, leg
latencies, upstream errors, pull dispatches without ``kv_transfer_params``. With tracing
on (``kvbaton.services.tracing``) each request is a ``kvbaton.router.request`` span with
a child per engine leg, whose ``traceparent`` goes to the engine as an HTTP header and as
``kv_transfer_params["traceparent"]`` (the connector forwards it on its gRPC calls).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from kvbaton import params
from kvbaton.services import tracing
from kvbaton.services.metrics import RouterMetrics, router_metrics

log = logging.getLogger("kvbaton.router")

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
# Status label of a streamed response cut short after its headers went out (the client
# saw the upstream's status, then a broken stream), and of a client that went away.
STATUS_ABORTED = "aborted"
STATUS_CLIENT_GONE = "499"


class _StreamBroken(Exception):
    """The upstream failed after the response headers were sent: only dropping the
    connection (what aiohttp does with a handler's exception) can tell the client."""


class Router:
    """Holds the upstream URLs and one shared HTTP session."""

    def __init__(self, prefill_url: str, decode_url: str, mode: str = "pull", *,
                 timeout_s: float = 300.0, control_plane: str = "", lookup_timeout_s: float = 1.0,
                 metrics: RouterMetrics | None = None, security: Any = None,
                 prefill_engine_id: str = "", decode_engine_id: str = "") -> None:
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
        # kvbaton.security.ClientSecurity for the control plane (None: from the environment).
        self.security = security
        # Push transfers name both sides (kv_transfer_params), so the control plane matches
        # them only between this pair; empty: unbound (refused where tokens require binding).
        self.prefill_engine_id = prefill_engine_id
        self.decode_engine_id = decode_engine_id
        self.stats: dict[str, int] = {"conversation_turns": 0, "reuse_offered": 0, "reuse_unavailable": 0}
        self.metrics = metrics or router_metrics()
        # Series that exist from the first scrape (rate() sees 0 rather than "no data").
        for leg in ("prefill", "decode"):
            self.metrics.upstream_errors.labels(leg)
        for leg in ("prefill", "decode", "total"):
            self.metrics.request_seconds.labels(mode, leg)

    async def start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)
        if self.control_plane:
            from kvbaton.security import ClientSecurity

            creds = self.security if self.security is not None else ClientSecurity.resolve()
            self._kv = creds.client(self.control_plane, timeout_s=self.lookup_timeout_s)
            log.info("control plane %s (%s)", self.control_plane, creds.describe())

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
        return params.ReuseOffer(conversation_id, ret.engine_id, lease.lease_id, ret.retention_id,
                                 tuple(ret.block_ids), ret.num_tokens, ret.tokens_per_block,
                                 tuple(ret.block_hashes)).to_params()

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
            except (TimeoutError, aiohttp.ClientError):
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

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        """Prometheus text format: the router's metrics (and the process's defaults)."""
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _dispatch(self, request: web.Request, path: str) -> web.StreamResponse:
        """One client request: counted by the status returned and timed end to end."""
        start = time.perf_counter()
        status = "500"
        with tracing.span("kvbaton.router.request", kind="server",
                          attributes={tracing.ATTR_MODE: self.mode, "http.request.method": request.method,
                                      "url.path": path}) as sp:
            try:
                resp = await self._dispatch_body(request, path, sp)
                status = str(resp.status)
                tracing.set_attributes(sp, **{"http.response.status_code": resp.status})
                return resp
            except _StreamBroken:
                status = STATUS_ABORTED
                raise  # aiohttp drops the connection
            except (asyncio.CancelledError, ConnectionResetError):  # the client went away
                status = STATUS_CLIENT_GONE
                raise
            finally:
                self.metrics.requests.labels(self.mode, status).inc()
                self.metrics.request_seconds.labels(self.mode, "total").observe(time.perf_counter() - start)

    def _upstream_failed(self, leg: str, transfer_id: str, exc: BaseException) -> web.Response:
        """A transport error or timeout talking to an engine: 502 with the reason."""
        self.metrics.upstream_errors.labels(leg).inc()
        log.warning("%s leg for %s failed: %r", leg, transfer_id, exc)
        return web.json_response({"error": {"message": f"{leg} engine unreachable: {type(exc).__name__}: {exc}",
                                            "type": "BadGateway", "code": 502}}, status=502)

    @staticmethod
    def _trace_leg(body: dict[str, Any]) -> dict[str, str] | None:
        """The current (leg) span's ``traceparent``: into the body's ``kv_transfer_params``
        (when it has them) and as headers for the engine. None when tracing is off."""
        tp = tracing.current_traceparent()
        if not tp:
            return None
        if isinstance(body.get("kv_transfer_params"), dict):
            body["kv_transfer_params"][params.TRACEPARENT] = tp
        return {tracing.TRACEPARENT: tp}

    async def _dispatch_body(self, request: web.Request, path: str, sp: Any) -> web.StreamResponse:
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
        tracing.set_attributes(sp, **{tracing.ATTR_TRANSFER_ID: transfer_id, tracing.ATTR_CONVERSATION_ID: conv})
        reuse = None
        if conv:
            self.stats["conversation_turns"] += 1
            reuse = await self._reuse_for(conv)
            self.stats["reuse_offered" if reuse else "reuse_unavailable"] += 1
            tracing.set_attributes(sp, **{"kvbaton.reuse_offered": bool(reuse)})
        if self.mode == "pull":
            return await self._pull(request, path, body, transfer_id, conv, reuse)
        return await self._push(request, path, body, transfer_id, conv, reuse)

    def _prefill_body(self, body: dict[str, Any], transfer_id: str, mode: str,
                      reuse: dict[str, Any] | None = None) -> dict[str, Any]:
        pb = copy.deepcopy(body)
        pb["max_tokens"] = 1
        pb.pop("max_completion_tokens", None)
        pb["stream"] = False
        pb.pop("stream_options", None)
        pb["kv_transfer_params"] = params.prefill_request(transfer_id, mode=mode, reuse=reuse)
        return pb

    def _leg_span(self, leg: str, transfer_id: str, url: str):
        return tracing.span(f"kvbaton.router.{leg}", kind="client", attributes={
            tracing.ATTR_TRANSFER_ID: transfer_id, tracing.ATTR_MODE: self.mode, "url.full": url})

    async def _pull(self, request: web.Request, path: str, body: dict[str, Any],
                    transfer_id: str, conv: str = "", reuse: dict[str, Any] | None = None) -> web.StreamResponse:
        url = f"{self.prefill_url}{path}"
        t0 = time.perf_counter()
        with self._leg_span("prefill", transfer_id, url) as sp:
            pb = self._prefill_body(body, transfer_id, "", reuse)
            try:
                async with self.session.post(url, json=pb, headers=self._trace_leg(pb)) as r:
                    raw = await r.read()
            except _UPSTREAM_ERRORS as exc:
                return self._upstream_failed("prefill", transfer_id, exc)
            finally:
                self.metrics.request_seconds.labels(self.mode, "prefill").observe(time.perf_counter() - t0)
            tracing.set_attributes(sp, **{"http.response.status_code": r.status})
            if r.status != 200:
                self.metrics.upstream_errors.labels("prefill").inc()
                return web.Response(status=r.status, body=raw,
                                    content_type=r.content_type or "application/json")
        try:
            ktp = json.loads(raw).get("kv_transfer_params")
        except json.JSONDecodeError:
            ktp = None
        if (refused := params.version_error(ktp)):
            log.error("prefill's kv_transfer_params refused for %s: %s", transfer_id, refused)
            self.metrics.upstream_errors.labels("prefill").inc()
            return web.json_response({"error": {"message": f"prefill engine answered: {refused}",
                                                "type": "kvbaton_params_version"}}, status=502)
        db = copy.deepcopy(body)
        if ktp:
            db["kv_transfer_params"] = ktp
        else:
            # Prefill held nothing (e.g. an empty prompt): decode computes it all itself.
            log.warning("prefill returned no kv_transfer_params for %s; decode recomputes", transfer_id)
            self.metrics.missing_transfer_params.inc()
            db.pop("kv_transfer_params", None)
        if conv:
            db["kv_transfer_params"] = {**(db.get("kv_transfer_params") or {}), params.CONVERSATION_ID: conv}
        return await self._relay(request, f"{self.decode_url}{path}", db, transfer_id)

    async def _push(self, request: web.Request, path: str, body: dict[str, Any],
                    transfer_id: str, conv: str = "", reuse: dict[str, Any] | None = None) -> web.StreamResponse:
        pb = self._prefill_body(body, transfer_id, "push", reuse)
        db = copy.deepcopy(body)
        db["kv_transfer_params"] = params.decode_push_request(transfer_id)
        # Bind the transfer to the pair (README "Security"): each side names the other.
        if self.decode_engine_id:
            pb["kv_transfer_params"][params.DECODE_ENGINE_ID] = self.decode_engine_id
        if self.prefill_engine_id:
            db["kv_transfer_params"][params.PREFILL_ENGINE_ID] = self.prefill_engine_id
        if conv:
            db["kv_transfer_params"][params.CONVERSATION_ID] = conv

        async def prefill() -> tuple[int, bytes]:
            url = f"{self.prefill_url}{path}"
            t0 = time.perf_counter()
            # A task copies the current context: this span is a child of the request's.
            with self._leg_span("prefill", transfer_id, url) as sp:
                try:
                    async with self.session.post(url, json=pb, headers=self._trace_leg(pb)) as r:
                        tracing.set_attributes(sp, **{"http.response.status_code": r.status})
                        return r.status, await r.read()
                finally:
                    self.metrics.request_seconds.labels(self.mode, "prefill").observe(time.perf_counter() - t0)

        ptask = asyncio.create_task(prefill())
        try:
            return await self._relay(request, f"{self.decode_url}{path}", db, transfer_id)
        finally:
            try:
                status, raw = await asyncio.wait_for(ptask, self.timeout.total or 300)
                if status != 200:
                    self.metrics.upstream_errors.labels("prefill").inc()
                    log.warning("push prefill leg for %s failed: %d %s", transfer_id, status, raw[:500])
            except _UPSTREAM_ERRORS as exc:
                self.metrics.upstream_errors.labels("prefill").inc()
                log.warning("push prefill leg for %s failed: %r", transfer_id, exc)

    async def _relay(self, request: web.Request, url: str, body: dict[str, Any],
                     transfer_id: str = "") -> web.StreamResponse:
        """POST to ``url`` (the decode leg) and pass status, headers and body (streamed
        chunk by chunk) back."""
        t0 = time.perf_counter()
        resp: web.StreamResponse | None = None
        with self._leg_span("decode", transfer_id, url) as sp:
            try:
                async with self.session.post(url, json=body, headers=self._trace_leg(body)) as r:
                    tracing.set_attributes(sp, **{"http.response.status_code": r.status})
                    if r.status != 200:
                        self.metrics.upstream_errors.labels("decode").inc()
                    if not body.get("stream"):
                        return web.Response(status=r.status, body=await r.read(),
                                            content_type=r.content_type or "application/json")
                    resp = web.StreamResponse(status=r.status, headers={
                        k: v for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS})
                    await resp.prepare(request)
                    chunks = r.content.iter_any().__aiter__()
                    while True:
                        try:
                            chunk = await chunks.__anext__()
                        except StopAsyncIteration:
                            break
                        except _UPSTREAM_ERRORS as exc:
                            # Headers are out: only a dropped connection tells the client.
                            self.metrics.upstream_errors.labels("decode").inc()
                            log.warning("decode leg for %s broke mid-stream: %r", transfer_id, exc)
                            raise _StreamBroken(f"decode stream for {transfer_id} broke: {exc!r}") from exc
                        await resp.write(chunk)  # a client that went away raises here: not upstream's fault
                    await resp.write_eof()
                    return resp
            except _UPSTREAM_ERRORS as exc:
                if resp is not None:
                    raise  # writing to the client failed after the headers: nothing to answer
                return self._upstream_failed("decode", transfer_id, exc)
            finally:
                self.metrics.request_seconds.labels(self.mode, "decode").observe(time.perf_counter() - t0)


def build_app(prefill_url: str, decode_url: str, mode: str = "pull", *,
              control_plane: str | None = None, security: Any = None, prefill_engine_id: str | None = None,
              decode_engine_id: str | None = None) -> web.Application:
    """``control_plane`` (default: ``$KVBATON_CONTROL_PLANE``) enables conversation reuse;
    ``security`` (a ``ClientSecurity``; default: from ``$KVBATON_TLS_*``/``$KVBATON_TOKEN``)
    is how to reach it; the engine ids (default ``$KVBATON_PREFILL_ENGINE_ID`` /
    ``$KVBATON_DECODE_ENGINE_ID``) bind push transfers to the pair."""
    if control_plane is None:
        control_plane = os.environ.get("KVBATON_CONTROL_PLANE", "")
    if prefill_engine_id is None:
        prefill_engine_id = os.environ.get("KVBATON_PREFILL_ENGINE_ID", "")
    if decode_engine_id is None:
        decode_engine_id = os.environ.get("KVBATON_DECODE_ENGINE_ID", "")
    router = Router(prefill_url, decode_url, mode, control_plane=control_plane, security=security,
                    prefill_engine_id=prefill_engine_id, decode_engine_id=decode_engine_id)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_get("/health", router.health)
    app.router.add_get("/v1/models", router.models)

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(router.stats)

    app.router.add_get("/kvbaton/stats", stats)
    app.router.add_get("/metrics", router.metrics_endpoint)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat)
    app["router"] = router
    return app
