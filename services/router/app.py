"""A small OpenAI-compatible P/D proxy (aiohttp) over a fleet of engines.

Engines: static lists (``--prefill [ID=]URL`` any number of times, same for ``--decode``)
and/or every engine the registrar lists with a ``serve_url`` (``WatchEngines``: an engine
whose registration ends gets nothing new as soon as the event arrives; a draining one gets
nothing new). Per request the router chooses a prefill and a decode engine with
``choice.Fleet`` (least prefill work in tokens, counting that the prefill which served a
conversation's last turn holds its history in its prefix cache; the decode holding the
conversation's KV unless it is overloaded beyond the slack, else the least loaded).

Pull: the prompt goes to the chosen prefill with ``max_tokens=1`` and ``kv_transfer_params =
{"do_remote_decode": true, "transfer_id": ...}``; prefill's response carries the
``kv_transfer_params`` (its engine id and held block ids) which the router forwards with
the original request to the chosen decode, streaming or not. Upstream status codes and
error bodies are relayed as they are, so a client sees vLLM's own errors.

Push: both legs are sent at once with one fresh ``transfer_id`` (the decode leg carries
``do_remote_prefill`` + ``transfer_mode=push``); the engines meet at the control plane.

Failures: an engine that fails at the transport level (connection refused or dropped,
timeout) before any byte of the answer reached the client is marked suspect and the
request is sent once more, as a new transfer (new ``transfer_id``), to other engines; the
client sees one answer. The failed leg's partner is cancelled (push) so it frees its blocks.
A request that finds no routable engine of a role (every engine of it re-registering at
once) waits for one, woken by the fleet view changing, at most ``role_wait_s``, then gets a
503 with ``Retry-After``; at most ``role_wait_max`` wait at once (``role_wait.py``).

Conversations (bidirectional reuse): a request names a conversation with ``conversation_id``
in the body or the ``X-Conversation-Id`` / ``X-Session-ID`` header (all the same thing; two
that disagree are a 400). Its decode leg carries the id, so decode keeps the turn's KV
under a lease. On the next turn the router renews that lease and looks up the retained
blocks (``Lease.Renew`` + ``Registrar.LookupRetained``, at once, bounded by
``lookup_timeout_s``); when the lease is live and protects that registration, the holding
decode is preferred and the blocks go to the chosen prefill as ``kv_transfer_params.reuse``
(prefill decides whether to READ). All of this lives in the control plane, so two router
replicas serve one conversation alternately with reuse intact. A control plane that is slow
or down only costs the reuse: the request goes on without it. A turn's (non-streaming) answer
is held until decode's retention of that turn is leased, at most ``retain_wait_s``, and then
names the lease (``retention.py``): a client's next turn, or its revoke, comes after the Grant.

Observability: ``/metrics`` (Prometheus text) exports ``kvbaton_router_*``
(``kvbaton.services.metrics.RouterMetrics``); ``/kvbaton/stats`` counts; ``/kvbaton/fleet``
the engines (role, URL, draining, suspect, outstanding load) and the decision cost. Every
answer carries ``X-Kvbaton-Prefill`` / ``X-Kvbaton-Decode`` (engine ids) and
``X-Kvbaton-Reuse-Tokens`` (tokens offered to prefill from decode's retained KV), a
``Server-Timing`` header (``lookup``, ``prefill``, ``decode`` to first bytes, ms: where the
time to first token went) and, when prefill engines run with ``--enable-prompt-tokens-details``,
``X-Kvbaton-Prefill-Cached-Tokens`` (prompt tokens prefill did not compute). With
tracing on (``kvbaton.services.tracing``) each request is a ``kvbaton.router.request`` span
with a child per engine leg, whose ``traceparent`` goes to the engine as an HTTP header and
as ``kv_transfer_params["traceparent"]`` (the connector forwards it on its gRPC calls).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from kvbaton import params
from kvbaton.services import tracing
from kvbaton.services.metrics import RouterMetrics, router_metrics

from .choice import (
    ROLE_DECODE,
    ROLE_PREFILL,
    Choice,
    Engine,
    Fleet,
    PrefillHint,
    estimate_prompt_tokens,
)
from .role_wait import CLIENT_GONE, SHED, Refusal, RoleWaits

log = logging.getLogger("kvbaton.router")

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
#: How long an idle pooled connection to an engine is kept (s). vLLM's server closes idle
#: connections after ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s); aiohttp's default (15 s) let the
#: router reuse one the engine was closing, and the leg failed with ``ServerDisconnectedError``
#: — taken for a dead engine: marked suspect, retried elsewhere, the conversation's reuse lost
#: (seen once in ``benchmarks/results/fleet_rounds_split.json``, round 5). Below 5 s the router
#: closes first.
UPSTREAM_KEEPALIVE_S = 4.0
# Status label of a streamed response cut short after its headers went out (the client
# saw the upstream's status, then a broken stream), and of a client that went away.
STATUS_ABORTED = "aborted"
STATUS_CLIENT_GONE = "499"
#: Headers that name the conversation, besides the body's ``conversation_id``.
CONVERSATION_HEADERS = ("X-Conversation-Id", "X-Session-ID")
#: How many decision times ``/kvbaton/fleet`` summarises (p50/p99).
_DECISIONS_KEPT = 4096
#: Conversations whose last prefill this router remembers (least recently used forgotten).
PREFILL_HINTS_KEPT = 65536


class _StreamBroken(Exception):
    """The upstream failed after the response headers were sent: only dropping the
    connection (what aiohttp does with a handler's exception) can tell the client."""


class _BadRequest(Exception):
    pass


@dataclasses.dataclass
class _Retry:
    """An attempt that failed at an engine before anything reached the client."""

    engine: Engine
    leg: str
    response: web.Response  # what the client gets if no retry is possible


@dataclasses.dataclass
class _Opened:
    """A decode response whose first bytes (all of it, unless streaming) have arrived."""

    r: aiohttp.ClientResponse
    first: bytes
    complete: bool
    engine: Engine
    t0: float  # perf_counter at the leg's start
    first_s: float = 0.0  # seconds from the leg's start to its first bytes


def parse_engine_spec(spec: str) -> tuple[str, str]:
    """``ID=URL`` or ``URL`` (the URL is then also the id) → (id, url)."""
    spec = spec.strip()
    eid, sep, url = spec.partition("=")
    if not sep or "://" in eid:
        eid, url = spec.rstrip("/"), spec
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"engine {spec!r}: expected [ID=]http(s)://host:port")
    return eid, url.rstrip("/")


def named(engine: Engine) -> bool:
    """Whether ``engine`` carries its registered engine id (a static engine given by URL
    alone is known by its URL, which the control plane does not know)."""
    return "://" not in engine.engine_id


def bind_engine_ids(specs: Sequence[str], engine_id: str, flag: str) -> list[str]:
    """``--prefill-engine-id ID`` with one ``--prefill URL``: the same as ``--prefill ID=URL``."""
    if not engine_id:
        return list(specs)
    if len(specs) != 1 or "=" in specs[0].split("://", 1)[0]:
        raise ValueError(f"--{flag}-engine-id names the one --{flag} URL given without an id; "
                         f"with several engines write --{flag} ID=URL")
    return [f"{engine_id}={specs[0]}"]


def conversation_of(body: dict[str, Any], headers: Any) -> str:
    """The conversation id from the body and the headers agent frameworks send; they
    name one thing, so two different ids are a client error."""
    named = {}
    raw = body.pop("conversation_id", None)
    if raw not in (None, ""):
        named["body conversation_id"] = str(raw)
    for h in CONVERSATION_HEADERS:
        v = headers.get(h)
        if v:
            named[f"header {h}"] = v
    if len(set(named.values())) > 1:
        raise _BadRequest("conversation named differently by " + ", ".join(f"{k}={v!r}" for k, v in named.items()))
    return next(iter(named.values()), "")


def add_timing(headers: dict[str, str], name: str, seconds: float) -> None:
    """Append ``name;dur=<ms>`` to the answer's ``Server-Timing`` header (the standard
    header browsers and proxies show): where a request's time to first token went
    (``lookup`` of the conversation's KV, the ``prefill`` leg, ``decode`` to first bytes)."""
    entry = f"{name};dur={seconds * 1000:.1f}"
    prev = headers.get("Server-Timing")
    headers["Server-Timing"] = f"{prev}, {entry}" if prev else entry


def prefill_cached_tokens(answer: Any) -> int | None:
    """Prompt tokens prefill did not compute (its prefix-cache hit plus tokens READ from a
    decode), from vLLM's ``usage.prompt_tokens_details.cached_tokens``; None when the
    engine does not report it (``--enable-prompt-tokens-details`` is off)."""
    try:
        n = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (KeyError, TypeError):
        return None
    return int(n) if isinstance(n, int) else None


def _client_gone(request: web.Request) -> bool:
    """Whether the client's connection is closed (aiohttp does not cancel the handler)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class Router:
    """The fleet, one shared HTTP session, and the control-plane client (when given)."""

    def __init__(self, prefill_url: str | Sequence[str] = (), decode_url: str | Sequence[str] = (),
                 mode: str = "pull", *, timeout_s: float = 300.0, control_plane: str = "",
                 lookup_timeout_s: float = 1.0, metrics: RouterMetrics | None = None,
                 discover: bool | None = None, slack: int = 4, suspect_s: float = 5.0,
                 retry: bool = True, security: Any = None, load_poll_s: float = 0.0,
                 retain_wait_s: float = 5.0, role_wait_s: float = 5.0, role_wait_max: int = 256) -> None:
        if mode not in ("pull", "push"):
            raise ValueError(f"mode must be pull or push, got {mode!r}")
        prefills = [prefill_url] if isinstance(prefill_url, str) else list(prefill_url)
        decodes = [decode_url] if isinstance(decode_url, str) else list(decode_url)
        self.discover = bool(control_plane) if discover is None else discover
        if self.discover and not control_plane:
            raise ValueError("discovery needs a control plane")
        if not self.discover and not (prefills and decodes):
            raise ValueError("no engines: give --prefill and --decode URLs, or a control plane to discover them")
        self.fleet = Fleet(slack=slack, suspect_s=suspect_s, discovering=self.discover)
        for role, specs in ((ROLE_PREFILL, prefills), (ROLE_DECODE, decodes)):
            for spec in specs:
                self.fleet.add_static(*parse_engine_spec(spec), role)
        self.mode = mode
        self.retry = retry
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self._session: aiohttp.ClientSession | None = None
        self.control_plane = control_plane
        self.lookup_timeout_s = lookup_timeout_s
        #: hold a conversational answer until decode's retention of the turn is leased, at
        #: most this long (``retention.py``: what the client does next is ordered after it)
        self.retain_wait_s = retain_wait_s
        self._kv: Any = None  # KvbatonClient, made on the app's loop
        # kvbaton.security.ClientSecurity for the control plane (None: from the environment).
        self.security = security
        self._watch: asyncio.Task[None] | None = None
        # Every this many seconds, the engines' own request counts (0: this router's only).
        self.load_poll_s = load_poll_s
        self._poll: asyncio.Task[None] | None = None
        self.discovered = asyncio.Event()
        self.discovery: Any = None  # discovery.DiscoveryState while following the registrar
        self.stats: dict[str, Any] = {
            "conversation_turns": 0, "reuse_offered": 0, "reuse_unavailable": 0, "reuse_holder_unusable": 0,
            "retention_granted": 0, "retention_not_visible": 0, "retention_waiting": 0,
            "retries": 0, "no_engine": 0, "decode_affinity": 0, "decode_no_history": 0,
            "decode_holder_overloaded": 0, "decode_holder_unavailable": 0,
            "prefill_cached": 0, "prefill_least_work": 0,
            "served": collections.Counter()}
        # Wall time (what a request waits) and this thread's CPU time (the work itself: on a
        # loaded machine the wall time also holds the moments the process was not running).
        # Conversation -> the prefill that served its last turn here (a cache hint, so it may
        # live in one router: another replica without it only loses the hint, see choice.py).
        self.prefill_hints: collections.OrderedDict[str, PrefillHint] = collections.OrderedDict()
        self.decisions_ns: collections.deque[int] = collections.deque(maxlen=_DECISIONS_KEPT)
        self.decisions_cpu_ns: collections.deque[int] = collections.deque(maxlen=_DECISIONS_KEPT)
        self.metrics = metrics or router_metrics()
        #: requests that find no routable engine of a role wait for one (``role_wait.py``)
        self.role_waits = RoleWaits(role_wait_s, role_wait_max, self.metrics)
        # Series that exist from the first scrape (rate() sees 0 rather than "no data").
        for leg in ("prefill", "decode"):
            self.metrics.upstream_errors.labels(leg)
            self.metrics.retries.labels(leg)
        for leg in ("prefill", "decode", "total"):
            self.metrics.request_seconds.labels(mode, leg)

    # Backwards-compatible views: the single engine of a one-pair router.
    @property
    def prefill_url(self) -> str:
        return next((e.url for e in self.fleet.routable(ROLE_PREFILL, time.monotonic())), "")

    @property
    def decode_url(self) -> str:
        return next((e.url for e in self.fleet.routable(ROLE_DECODE, time.monotonic())), "")

    async def start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout,
                                              connector=aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_KEEPALIVE_S))
        if self.load_poll_s > 0:
            from .engine_load import poll_engine_loads

            self._poll = asyncio.create_task(poll_engine_loads(self.fleet, self._session, self.load_poll_s))
        if self.control_plane:
            from kvbaton.security import ClientSecurity

            creds = self.security if self.security is not None else ClientSecurity.resolve()
            self._kv = creds.client(self.control_plane, timeout_s=self.lookup_timeout_s)
            log.info("control plane %s (%s)", self.control_plane, creds.describe())
            if self.discover:
                from .discovery import DiscoveryState, follow_registrar

                self.discovery = DiscoveryState()
                self._watch = asyncio.create_task(follow_registrar(self._kv, self.fleet, ready=self.discovered,
                                                                   on_change=self.role_waits.changed,
                                                                   state=self.discovery))
                try:  # the first listing, so that the first request has engines to go to
                    await asyncio.wait_for(self.discovered.wait(), 5.0)
                except TimeoutError:
                    log.warning("no engine listing from the control plane yet; serving on static engines only")

    async def stop(self, app: web.Application) -> None:
        for task in (self._watch, self._poll):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
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
        """200 when at least one prefill and one decode engine answer /health."""
        async def ok(url: str) -> bool:
            try:
                async with self.session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return r.status == 200
            except (TimeoutError, aiohttp.ClientError):
                return False
        now = time.monotonic()
        engines = {e.engine_id: e for role in (ROLE_PREFILL, ROLE_DECODE) for e in self.fleet.routable(role, now)}
        answers = dict(zip(engines, await asyncio.gather(*(ok(e.url) for e in engines.values()))))
        p = any(answers[i] for i, e in engines.items() if e.serves(ROLE_PREFILL))
        d = any(answers[i] for i, e in engines.items() if e.serves(ROLE_DECODE))
        return web.json_response({"prefill": p, "decode": d, "engines": answers}, status=200 if p and d else 503)

    async def models(self, request: web.Request) -> web.StreamResponse:
        url = self.decode_url
        if not url:
            return _error(503, "no decode engine available", "ServiceUnavailable")
        async with self.session.get(f"{url}/v1/models") as r:
            return web.Response(status=r.status, body=await r.read(), content_type="application/json")

    async def fleet_endpoint(self, request: web.Request) -> web.Response:
        """The engines this router routes over and its decision cost (µs, p50/p99; wall
        time and CPU time)."""
        def summary(xs: collections.deque[int]) -> dict[str, float | int | None]:
            ds = sorted(xs)

            def pct(q: float) -> float | None:
                return ds[min(len(ds) - 1, int(q * len(ds)))] / 1000 if ds else None
            return {"n": len(ds), "p50": pct(0.5), "p99": pct(0.99)}

        return web.json_response({"mode": self.mode, "discover": self.discover,
                                  "discovery": self.discovery.json() if self.discovery is not None else None,
                                  "engines": self.fleet.snapshot(time.monotonic()),
                                  "role_wait": self.role_waits.json(),
                                  "decision_us": summary(self.decisions_ns),
                                  "decision_cpu_us": summary(self.decisions_cpu_ns)})

    async def stats_endpoint(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats_json())

    def stats_json(self) -> dict[str, Any]:
        return {**self.stats, "served": {f"{p}>{d}": n for (p, d), n in self.stats["served"].items()},
                "role_wait": self.role_waits.json()}

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
        return _error(502, f"{leg} engine unreachable: {type(exc).__name__}: {exc}", "BadGateway")

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

    def _hint(self, conv: str) -> PrefillHint | None:
        return self.prefill_hints.get(conv) if conv else None

    def _remember_prefill(self, conv: str, engine: Engine, tokens: int) -> None:
        """After a turn's prefill answered: its prefix cache now holds this prompt."""
        if not conv:
            return
        self.prefill_hints[conv] = PrefillHint(engine.engine_id, tokens)
        self.prefill_hints.move_to_end(conv)
        while len(self.prefill_hints) > PREFILL_HINTS_KEPT:
            self.prefill_hints.popitem(last=False)

    def _choose(self, holder: str, exclude: set[str], hint: PrefillHint | None = None, tokens: int = 0,
                reuse_tokens: int = 0) -> Choice:
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        choice = self.fleet.choose(time.monotonic(), holder, exclude, hint=hint, prompt_tokens=tokens,
                                   reuse_tokens=reuse_tokens)
        dt = time.perf_counter_ns() - t0
        self.decisions_ns.append(dt)
        self.decisions_cpu_ns.append(time.thread_time_ns() - c0)
        self.metrics.decision_seconds.observe(dt / 1e9)
        if choice.reason is not None and choice.prefill is not None and choice.decode is not None:
            self.metrics.decode_choices.labels(choice.reason.value).inc()
        return choice

    def _no_engine(self, refusal: Refusal) -> web.Response:
        """503 for a request that got no engine of ``refusal.role``, saying why and when to retry."""
        self.stats["no_engine"] += 1
        role = refusal.role
        if refusal.outcome == "off":
            message = f"no {role} engine available"
        elif refusal.outcome == SHED:
            message = (f"no {role} engine available, and the router is not waiting for one: "
                       f"{self.role_waits.max_waiting} requests already wait for engines (--role-wait-max)")
        else:
            message = f"no {role} engine available: waited {refusal.waited_s:.1f} s for one (--role-wait-s)"
        resp = _error(503, message, "ServiceUnavailable")
        resp.headers["Retry-After"] = str(self.role_waits.retry_after_s)
        return resp

    async def _dispatch_body(self, request: web.Request, path: str, sp: Any) -> web.StreamResponse:
        try:
            body: dict[str, Any] = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "body is not JSON", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, f"body must be a JSON object, not {type(body).__name__}", "BadRequestError")
        try:
            conv = conversation_of(body, request.headers)
        except _BadRequest as exc:
            return _error(400, str(exc), "BadRequestError")
        tracing.set_attributes(sp, **{tracing.ATTR_CONVERSATION_ID: conv})
        reuse = None
        lookup_s = 0.0
        if conv:
            self.stats["conversation_turns"] += 1
            t_lookup = time.perf_counter()
            reuse = await self._reuse_for(conv)
            lookup_s = time.perf_counter() - t_lookup
        holder = str(reuse["engine_id"]) if reuse else ""
        tokens = estimate_prompt_tokens(body)
        exclude: set[str] = set()
        attempts = 2 if self.retry else 1
        for attempt in range(attempts):
            # A role with no routable engine: wait (bounded) for the fleet view to change.
            with self.role_waits.ticket(lambda: _client_gone(request)) as waiting:
                while True:
                    if reuse and not self.fleet.holder_usable(holder, time.monotonic()):
                        # Its holder is gone, draining or failing: a READ would only fail and recompute.
                        self.stats["reuse_holder_unusable"] += 1
                        reuse = None
                    choice = self._choose(holder, exclude, self._hint(conv), tokens,
                                          int(reuse["num_tokens"]) if reuse else 0)
                    if choice.prefill is not None and choice.decode is not None:
                        waiting.served()
                        break
                    refusal = await waiting.wait(ROLE_PREFILL if choice.prefill is None else ROLE_DECODE)
                    if refusal is not None:
                        if refusal.outcome == CLIENT_GONE:  # nobody to answer (counted as 499)
                            return web.Response(status=int(STATUS_CLIENT_GONE))
                        return self._no_engine(refusal)
            assert choice.prefill is not None and choice.decode is not None
            if attempt == 0:
                if choice.reason is not None:
                    self.stats[f"decode_{choice.reason.value}"] += 1
                self.stats[f"prefill_{choice.prefill_reason.value}"] += 1
                if conv:
                    self.stats["reuse_offered" if reuse else "reuse_unavailable"] += 1
            transfer_id = uuid.uuid4().hex  # fresh per dispatch: a retry is a new transfer
            tracing.set_attributes(sp, **{tracing.ATTR_TRANSFER_ID: transfer_id,
                                          "kvbaton.reuse_offered": bool(reuse),
                                          "kvbaton.prefill_engine": choice.prefill.engine_id,
                                          "kvbaton.decode_engine": choice.decode.engine_id})
            headers = {"X-Kvbaton-Prefill": choice.prefill.engine_id, "X-Kvbaton-Decode": choice.decode.engine_id,
                       "X-Kvbaton-Reuse-Tokens": str(reuse["num_tokens"] if reuse else 0),
                       "X-Kvbaton-Attempts": str(attempt + 1), "X-Kvbaton-Transfer-Id": transfer_id}
            if conv:
                add_timing(headers, "lookup", lookup_s)
            run = self._pull if self.mode == "pull" else self._push
            out = await run(request, path, body, transfer_id, conv, reuse, choice, tokens, headers)
            if isinstance(out, _Retry):
                self.fleet.mark_suspect(out.engine.engine_id, time.monotonic())
                exclude.add(out.engine.engine_id)
                others = [e for e in self.fleet.routable(out.leg, time.monotonic()) if e.engine_id not in exclude]
                if attempt + 1 >= attempts or not others:
                    return out.response
                self.stats["retries"] += 1
                self.metrics.retries.labels(out.leg).inc()
                log.warning("%s engine %s failed before answering %s; retrying on another engine",
                            out.leg, out.engine.engine_id, transfer_id)
                continue
            if out.status == 200:
                self.stats["served"][(choice.prefill.engine_id, choice.decode.engine_id)] += 1
            return out
        raise AssertionError("unreachable")

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

    async def _post_prefill(self, engine: Engine, path: str, pb: dict[str, Any], transfer_id: str,
                            tokens: int, conv: str = "") -> tuple[int, bytes, str]:
        """The prefill leg (raises the transport error); counted as outstanding work on ``engine``."""
        url = f"{engine.url}{path}"
        t0 = time.perf_counter()
        self.fleet.start_prefill(engine, tokens)
        # A task copies the current context: this span is a child of the request's.
        with self._leg_span("prefill", transfer_id, url) as sp:
            try:
                async with self.session.post(url, json=pb, headers=self._trace_leg(pb)) as r:
                    tracing.set_attributes(sp, **{"http.response.status_code": r.status})
                    raw = await r.read()
                    if r.status == 200:
                        self._remember_prefill(conv, engine, tokens)
                    return r.status, raw, r.content_type or "application/json"
            finally:
                self.fleet.end_prefill(engine, tokens)
                self.metrics.request_seconds.labels(self.mode, "prefill").observe(time.perf_counter() - t0)

    async def _pull(self, request: web.Request, path: str, body: dict[str, Any], transfer_id: str, conv: str,
                    reuse: dict[str, Any] | None, choice: Choice, tokens: int,
                    headers: dict[str, str]) -> web.StreamResponse | _Retry:
        assert choice.prefill is not None and choice.decode is not None
        pb = self._prefill_body(body, transfer_id, "", reuse)
        if named(choice.decode):  # the pull hold is bound to the decode that will read it
            pb["kv_transfer_params"][params.DECODE_ENGINE_ID] = choice.decode.engine_id
        t_prefill = time.perf_counter()
        try:
            status, raw, ctype = await self._post_prefill(choice.prefill, path, pb, transfer_id, tokens, conv)
        except _UPSTREAM_ERRORS as exc:
            return _Retry(choice.prefill, ROLE_PREFILL, self._upstream_failed("prefill", transfer_id, exc))
        add_timing(headers, "prefill", time.perf_counter() - t_prefill)
        if status != 200:
            self.metrics.upstream_errors.labels("prefill").inc()
            return web.Response(status=status, body=raw, content_type=ctype, headers=headers)
        try:
            answer = json.loads(raw)
            ktp = answer.get("kv_transfer_params")
        except (json.JSONDecodeError, AttributeError):
            answer, ktp = None, None
        cached = prefill_cached_tokens(answer)
        if cached is not None:
            headers["X-Kvbaton-Prefill-Cached-Tokens"] = str(cached)
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
        return await self._decode(request, choice.decode, path, db, transfer_id, headers, conv)

    async def _push(self, request: web.Request, path: str, body: dict[str, Any], transfer_id: str, conv: str,
                    reuse: dict[str, Any] | None, choice: Choice, tokens: int,
                    headers: dict[str, str]) -> web.StreamResponse | _Retry:
        assert choice.prefill is not None and choice.decode is not None
        pb = self._prefill_body(body, transfer_id, "push", reuse)
        db = copy.deepcopy(body)
        db["kv_transfer_params"] = params.decode_push_request(transfer_id)
        # Bind the transfer to the chosen pair (README "Security"): each side names the other,
        # when the router knows the engines' registered ids (discovered, or static ``ID=URL``).
        if named(choice.decode):
            pb["kv_transfer_params"][params.DECODE_ENGINE_ID] = choice.decode.engine_id
        if named(choice.prefill):
            db["kv_transfer_params"][params.PREFILL_ENGINE_ID] = choice.prefill.engine_id
        if conv:
            db["kv_transfer_params"][params.CONVERSATION_ID] = conv
        ptask = asyncio.create_task(self._post_prefill(choice.prefill, path, pb, transfer_id, tokens, conv))
        dtask = asyncio.create_task(self._open_decode(choice.decode, path, db, transfer_id))
        prefill_counted = False
        try:
            await asyncio.wait({ptask, dtask}, return_when=asyncio.FIRST_COMPLETED)
            if not dtask.done() and isinstance(ptask.exception(), _UPSTREAM_ERRORS):
                # Prefill died before decode answered: decode would only wait for KV that
                # never comes. Drop the decode leg (vLLM aborts it, freeing its blocks).
                dtask.cancel()
                await asyncio.gather(dtask, return_exceptions=True)
                exc = ptask.exception()
                assert exc is not None
                prefill_counted = True
                return _Retry(choice.prefill, ROLE_PREFILL, self._upstream_failed("prefill", transfer_id, exc))
            try:
                opened = await dtask
            except _UPSTREAM_ERRORS as exc:
                return _Retry(choice.decode, ROLE_DECODE, self._upstream_failed("decode", transfer_id, exc))
            return await self._relay(request, opened, body, transfer_id, headers, conv)
        finally:
            if not dtask.done():
                dtask.cancel()
            await self._settle_prefill(ptask, transfer_id, counted=prefill_counted)

    async def _settle_prefill(self, ptask: asyncio.Task[tuple[int, bytes, str]], transfer_id: str, *,
                              counted: bool) -> None:
        try:
            status, raw, _ = await asyncio.wait_for(ptask, self.timeout.total or 300)
            if status != 200:
                self.metrics.upstream_errors.labels("prefill").inc()
                log.warning("push prefill leg for %s failed: %d %s", transfer_id, status, raw[:500])
        except _UPSTREAM_ERRORS as exc:
            if not counted:
                self.metrics.upstream_errors.labels("prefill").inc()
            log.warning("push prefill leg for %s failed: %r", transfer_id, exc)

    async def _open_decode(self, engine: Engine, path: str, body: dict[str, Any], transfer_id: str) -> _Opened:
        """POST the decode leg and wait for the answer's first bytes (all of it unless
        streaming): a failure up to here is retryable, nothing reached the client yet."""
        url = f"{engine.url}{path}"
        t0 = time.perf_counter()
        self.fleet.start_decode(engine)
        ok = False
        try:
            with self._leg_span("decode", transfer_id, url) as sp:
                r = await self.session.post(url, json=body, headers=self._trace_leg(body))
                try:
                    tracing.set_attributes(sp, **{"http.response.status_code": r.status})
                    if r.status != 200:
                        self.metrics.upstream_errors.labels("decode").inc()
                    if not body.get("stream") or r.status != 200:
                        opened = _Opened(r, await r.read(), True, engine, t0)
                    else:
                        opened = _Opened(r, await r.content.readany(), False, engine, t0)
                    opened.first_s = time.perf_counter() - t0
                    ok = True
                    return opened
                finally:
                    if not ok:
                        r.release()
        finally:
            if not ok:
                self.fleet.end_decode(engine)
                self.metrics.request_seconds.labels(self.mode, "decode").observe(time.perf_counter() - t0)

    async def _decode(self, request: web.Request, engine: Engine, path: str, body: dict[str, Any],
                      transfer_id: str, headers: dict[str, str], conv: str = "") -> web.StreamResponse | _Retry:
        try:
            opened = await self._open_decode(engine, path, body, transfer_id)
        except _UPSTREAM_ERRORS as exc:
            return _Retry(engine, ROLE_DECODE, self._upstream_failed("decode", transfer_id, exc))
        return await self._relay(request, opened, body, transfer_id, headers, conv)

    async def _settle_retention(self, answer: bytes, headers: dict[str, str]) -> bytes:
        """A conversational answer goes out once decode's retention of the turn is leased
        (bounded; ``retention.py`` says why), naming the lease; ``retain`` in Server-Timing."""
        from .retention import settle

        t0 = time.perf_counter()
        self.stats["retention_waiting"] += 1
        try:
            out, what = await settle(self._kv, answer, self.retain_wait_s, self.lookup_timeout_s)
        finally:
            self.stats["retention_waiting"] -= 1
        if what:
            self.stats[f"retention_{what}"] += 1
            add_timing(headers, "retain", time.perf_counter() - t0)
            if what == "not_visible":
                log.warning("decode's retention of a turn was not leased within %.1f s: answered without it",
                            self.retain_wait_s)
        return out

    async def _relay(self, request: web.Request, opened: _Opened, body: dict[str, Any], transfer_id: str,
                     headers: dict[str, str], conv: str = "") -> web.StreamResponse:
        """Pass the decode answer's status, headers and body (streamed chunk by chunk) back."""
        r, engine = opened.r, opened.engine
        resp: web.StreamResponse | None = None
        headers = dict(headers)
        add_timing(headers, "decode", opened.first_s)
        if opened.complete:
            try:
                status, first, ctype = r.status, opened.first, r.content_type or "application/json"
            finally:
                r.release()
                self.fleet.end_decode(engine)
                self.metrics.request_seconds.labels(self.mode, "decode").observe(time.perf_counter() - opened.t0)
            # decode's part is done: the wait is the control plane's. A draining decode's
            # RegisterRetained is refused (it frees the blocks): nothing will become visible.
            if conv and status == 200 and not engine.draining:
                first = await self._settle_retention(first, headers)
            return web.Response(status=status, body=first, content_type=ctype, headers=headers)
        try:
            resp = web.StreamResponse(status=r.status, headers={
                **{k: v for k, v in r.headers.items() if k.lower() not in _HOP_HEADERS}, **headers})
            await resp.prepare(request)
            if opened.first:
                await resp.write(opened.first)
            chunks = r.content.iter_any().__aiter__()
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except _UPSTREAM_ERRORS as exc:
                    # Tokens are out: only a dropped connection tells the client.
                    self.metrics.upstream_errors.labels("decode").inc()
                    self.fleet.mark_suspect(engine.engine_id, time.monotonic())
                    log.warning("decode leg for %s broke mid-stream: %r", transfer_id, exc)
                    raise _StreamBroken(f"decode stream for {transfer_id} broke: {exc!r}") from exc
                await resp.write(chunk)  # a client that went away raises here: not upstream's fault
            await resp.write_eof()
            return resp
        finally:
            r.release()
            self.fleet.end_decode(engine)
            self.metrics.request_seconds.labels(self.mode, "decode").observe(time.perf_counter() - opened.t0)


#: the :class:`Router` of an app made by :func:`build_app` (for embedders and tests)
ROUTER_KEY = web.AppKey("kvbaton_router", Router)


def build_app(prefill_url: str | Sequence[str] = (), decode_url: str | Sequence[str] = (), mode: str = "pull", *,
              control_plane: str | None = None, **router_kw: Any) -> web.Application:
    """``control_plane`` (default: ``$KVBATON_CONTROL_PLANE``) enables conversation reuse
    and, unless ``discover=False``, discovery of engines from the registrar."""
    if control_plane is None:
        control_plane = os.environ.get("KVBATON_CONTROL_PLANE", "")
    prefills = [prefill_url] if isinstance(prefill_url, str) else list(prefill_url)
    decodes = [decode_url] if isinstance(decode_url, str) else list(decode_url)
    prefills = bind_engine_ids(prefills, router_kw.pop("prefill_engine_id", None)
                               or os.environ.get("KVBATON_PREFILL_ENGINE_ID", ""), "prefill")
    decodes = bind_engine_ids(decodes, router_kw.pop("decode_engine_id", None)
                              or os.environ.get("KVBATON_DECODE_ENGINE_ID", ""), "decode")
    router = Router(prefills, decodes, mode, control_plane=control_plane, **router_kw)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.router.add_get("/health", router.health)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/kvbaton/stats", router.stats_endpoint)
    app.router.add_get("/kvbaton/fleet", router.fleet_endpoint)
    app.router.add_get("/metrics", router.metrics_endpoint)
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_post("/v1/chat/completions", router.chat)
    app[ROUTER_KEY] = router
    return app
