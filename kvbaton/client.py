"""Asyncio client for routers, engines and agent frameworks, and ``LeaseKeeper``.

Every call has a deadline (``timeout_s``); streams resume from the last revision they saw
when the connection drops, so a replica failover loses nothing.

    async with KvbatonClient("127.0.0.1:50051") as kv:
        lease = (await kv.lease.Grant(GrantRequest(...), timeout=kv.timeout_s)).lease
        async with LeaseKeeper(kv, "conv-1") as keeper:
            ...   # the agent thinks, calls tools; the lease is renewed in the background
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import random
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import grpc
import structlog

from kvbaton.match_inbox import MatchInbox
from kvbaton.v1 import (
    lease_pb2,
    lease_pb2_grpc,
    registrar_pb2,
    registrar_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
)

log = structlog.get_logger(__name__)

# Initial metadata of the control plane's streams (services/api/incarnation.py).
STORE_INCARNATION_METADATA = "kvbaton-store-incarnation"
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
              grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


# A RESOURCE_EXHAUSTED answer's trailing metadata: ms to wait before sending the call again
# (services/api/status.py; a session result carries it as ``retry_after_ms``).
RETRY_AFTER_METADATA = "kvbaton-retry-after-ms"


def retry_after_s(exc: grpc.aio.AioRpcError) -> float | None:
    """The server's retry hint of a refused call, in seconds (None: it sent none)."""
    trailing = exc.trailing_metadata()
    value = trailing.get(RETRY_AFTER_METADATA) if isinstance(trailing, grpc.aio.Metadata) else None
    if value is None:
        return None
    try:
        return max(0.0, int(value) / 1000)
    except (TypeError, ValueError):
        return None


class ShedBackoff:
    """When to send again a call the server shed (RESOURCE_EXHAUSTED), within the call's
    deadline.

    A shed call is retried after ``max(hint, delay)`` times a jitter in [1, 1.5), the
    delay doubling from ``base_s`` up to ``cap_s`` with each refusal, so that clients shed
    together do not come back together and a refusal that keeps coming is asked about
    less and less often. ``hint`` is the server's (overload, rate limit, full queue: it
    knows roughly when capacity returns). Without a hint (an older server, or a limit that
    waiting does not lift soon, e.g. too many pins) only ``unhinted`` retries are made. A
    wait that would end past the deadline is not started: the refusal is the answer.
    INVALID_ARGUMENT, PERMISSION_DENIED and other refusals never come here: they are final.
    """

    def __init__(self, budget_s: float, *, base_s: float = 0.02, cap_s: float = 1.0, unhinted: int = 2,
                 clock: Callable[[], float] = time.monotonic, rng: Callable[[], float] = random.random) -> None:
        self.clock = clock
        self.rng = rng
        self.deadline = clock() + budget_s
        self.delay = base_s
        self.cap_s = cap_s
        self.unhinted = unhinted
        self.retries = 0  # waits handed out so far

    def next_wait(self, hint_s: float | None) -> float | None:
        """Seconds to wait before the next try, or None: give up (answer the refusal)."""
        if hint_s is None:
            if self.unhinted <= 0:
                return None
            self.unhinted -= 1
            hint_s = 0.0
        wait = max(hint_s, self.delay) * (1 + 0.5 * self.rng())
        self.delay = min(self.delay * 2, self.cap_s)
        if self.clock() + wait >= self.deadline:
            return None
        self.retries += 1
        return wait

    def remaining(self, default_s: float) -> float:
        """The timeout of the next try: what is left of the deadline once a call was shed."""
        if not self.retries:
            return default_s
        return max(0.001, min(default_s, self.deadline - self.clock()))


@dataclasses.dataclass(frozen=True)
class ClientTls:
    """Files for a TLS channel: the CA that signed the server, and for mutual TLS this
    client's certificate and key."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        read = lambda p: open(p, "rb").read() if p else None  # noqa: E731
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_file), private_key=read(self.key_file),
                                            certificate_chain=read(self.cert_file))


class _BearerToken:
    """Adds ``authorization: Bearer <token>`` to every call (grpc.aio files an interceptor
    under one call type only, hence one subclass per type below)."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, d):
        return d._replace(metadata=list(d.metadata or ()) + [self.header])

    @staticmethod
    def all(token: str) -> list:
        return [_TokenUnary(token), _TokenServerStream(token), _TokenBidi(token)]


class _TokenUnary(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, d, request):
        return await continuation(self._details(d), request)


class _TokenServerStream(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, d, request):
        return await continuation(self._details(d), request)


class _TokenBidi(_BearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, d, request_iterator):
        return await continuation(self._details(d), request_iterator)


class KvbatonClient:
    """Stubs for the three services over one channel per address list.

    ``addresses`` may name several replicas ("h1:p,h2:p"); the channel is pinned to one
    and moves to the next on ``reconnect()`` (streams do it for you).
    """

    def __init__(self, addresses: str | Sequence[str], *, timeout_s: float = 5.0, tls: ClientTls | None = None,
                 token: str | None = None) -> None:
        self.addresses = [a for a in (addresses.split(",") if isinstance(addresses, str) else addresses) if a]
        if not self.addresses:
            raise ValueError("no control-plane address")
        self.timeout_s = timeout_s
        self.tls = tls
        self.token = token
        self._index = 0
        self._renewer: _RenewalBatcher | None = None
        self._session: RendezvousSession | None = None
        # engine_id -> the events of that engine's sole subscriber (subscribe(sole_subscriber=True)).
        self.match_inboxes: dict[str, MatchInbox] = {}
        self.shed_retries = 0  # calls sent again after a RESOURCE_EXHAUSTED (ShedBackoff)
        # The store incarnation the control plane announced last (stream initial metadata):
        # a change means the embedded store restarted and everything it held is gone.
        self.store_incarnation = ""
        self.incarnation_changes = 0
        self._incarnation_event: asyncio.Event | None = None
        self._connect()

    async def wait_incarnation_change(self, timeout_s: float | None = None) -> bool:
        """True once the control plane announces a new store incarnation (registrations,
        leases and transfers made before are gone); False after ``timeout_s``."""
        if self._incarnation_event is None:
            self._incarnation_event = asyncio.Event()
        event = self._incarnation_event
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _note_incarnation(self, incarnation: str) -> None:
        if not incarnation or incarnation == self.store_incarnation:
            return
        previous, self.store_incarnation = self.store_incarnation, incarnation
        if previous:
            self.incarnation_changes += 1
            log.warning("client.new_store_incarnation", previous=previous, incarnation=incarnation, address=self.address)
            event, self._incarnation_event = self._incarnation_event, None
            if event is not None:
                event.set()

    def _connect(self) -> None:
        addr = self.addresses[self._index % len(self.addresses)]
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ("grpc.max_send_message_length", 16 * 1024 * 1024),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        from kvbaton.services import tracing

        # Only while tracing is on: otherwise the channel has no interceptor at all.
        interceptors = [*(_BearerToken.all(self.token) if self.token else []), *tracing.client_interceptors()] or None
        if self.tls is not None:
            if self.tls.server_name:
                options.append(("grpc.ssl_target_name_override", self.tls.server_name))
            self.channel = grpc.aio.secure_channel(addr, self.tls.credentials(), options=options,
                                                   interceptors=interceptors)
        else:
            self.channel = grpc.aio.insecure_channel(addr, options=options, interceptors=interceptors)
        self.address = addr
        self.registrar = registrar_pb2_grpc.RegistrarStub(self.channel)
        self.rendezvous = rendezvous_pb2_grpc.RendezvousStub(self.channel)
        self.lease = lease_pb2_grpc.LeaseStub(self.channel)

    async def reconnect(self, *, if_channel: grpc.aio.Channel | None = None) -> None:
        """Moves to the next address. ``if_channel``: only if that channel (the one a
        failed call used) is still the current one, so that several streams noticing the
        same failure move once, not once each."""
        if if_channel is not None and if_channel is not self.channel:
            return
        old = self.channel
        self._index += 1
        self._connect()
        with contextlib.suppress(Exception):
            await old.close(grace=0)

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        await asyncio.wait_for(self.channel.channel_ready(), timeout_s)

    async def close(self) -> None:
        if self._renewer is not None:
            await self._renewer.close()
        if self._session is not None:
            await self._session.close()
        await self.channel.close(grace=0)

    async def __aenter__(self) -> KvbatonClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- conveniences --------------------------------------------------------
    async def call(self, method, request, *, retries: int = 3, metadata: Sequence[tuple[str, str]] | None = None):
        """A unary call with a deadline, retried on transport errors across replicas.

        Safe because every kvbaton mutation is idempotent for the same message.
        ``metadata``: extra call metadata, e.g. a request's ``traceparent``
        (``kvbaton.services.tracing.grpc_metadata``).

        A call whose channel another call or stream closed under it (``reconnect``: the
        client moved replica) is sent again on the new channel: gRPC ends it with
        ``CancelledError``, which used to end the caller's task as if it had been cancelled
        (the connector's registration keeper stopped for good, and its engine's
        registration lapsed one TTL later: the fleet e2e's "a router sees one prefill of
        two"). Out of attempts, it raises UNAVAILABLE, not ``CancelledError``."""
        delay = 0.05
        service, name = self._route(method)
        shed = ShedBackoff(self.timeout_s)
        attempt = 0
        while True:
            channel = self.channel
            try:
                # Resolved on every attempt: a reconnect replaces the stubs.
                return await getattr(getattr(self, service), name)(request, timeout=shed.remaining(self.timeout_s),
                                                                   metadata=metadata)
            except asyncio.CancelledError:
                if not channel_closed_under(channel, self.channel):
                    raise
                if attempt == retries:
                    raise _status_error(grpc.StatusCode.UNAVAILABLE.value[0],
                                        f"{name}: the client moved to another replica during the call") from None
                log.info("client.retry", code="CHANNEL_REPLACED", address=self.address, attempt=attempt)
                attempt += 1
                continue  # at once: nothing failed on the server side
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    wait = shed.next_wait(retry_after_s(exc))
                    if wait is None:
                        raise
                    self.shed_retries += 1
                    log.debug("client.shed_retry", method=name, wait_ms=round(wait * 1000), reason=(exc.details() or "")[:200])
                    await asyncio.sleep(wait)
                    continue
                if exc.code() not in _RETRYABLE or attempt == retries or (shed.retries and shed.remaining(1.0) <= 0.001):
                    raise
                log.info("client.retry", code=exc.code().name, address=self.address, attempt=attempt)
                if exc.code() == grpc.StatusCode.UNAVAILABLE and len(self.addresses) > 1:
                    await self.reconnect()
                await asyncio.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 1.0)
                attempt += 1

    _STUBS = {"Registrar": "registrar", "Rendezvous": "rendezvous", "Lease": "lease"}

    def _route(self, method) -> tuple[str, str]:
        """(stub attribute, method name) of a bound stub method, e.g. ("lease", "Renew")."""
        path = method._method.decode() if isinstance(method._method, bytes) else method._method
        service, name = path.rsplit("/", 1)
        return self._STUBS[service.rsplit(".", 1)[-1].lstrip("/")], name

    async def _resumable(self, open_stream, on_event, state: dict[str, Any] | None = None) -> AsyncGenerator[Any, None]:
        """Runs a server stream and re-opens it after a transport failure (on the next
        replica, with jittered backoff). ``open_stream()`` builds the call from the
        caller's resume state; ``on_event(event)`` updates that state and says whether to
        yield the event. ``state["inc"]`` is the store incarnation its ``state["last"]``
        revision belongs to: under a new one the server started from scratch, and so does
        the state (``last`` = 0), so no new event is mistaken for an old one."""
        backoff = 0.05
        while True:
            channel = self.channel
            stream = open_stream()
            first = True
            try:
                async for event in stream:
                    backoff = 0.05
                    if first:
                        first = False
                        await self._stream_incarnation(stream, state)
                    if on_event(event):
                        yield event
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise
                log.info("client.stream_reconnect", code=exc.code().name, address=self.address)
            except asyncio.CancelledError:
                if not channel_closed_under(channel, self.channel):
                    raise
                # Another call moved the client to the next replica and closed this
                # channel: gRPC ends the stream with CancelledError. Resume on the new one.
                log.info("client.stream_reconnect", code="CHANNEL_REPLACED", address=self.address)
            finally:
                stream.cancel()
            if len(self.addresses) > 1:
                await self.reconnect(if_channel=channel)
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, 2.0)

    async def _stream_incarnation(self, stream, state: dict | None) -> None:
        try:
            md = await stream.initial_metadata()
        except grpc.aio.AioRpcError:
            return
        inc = next((v for k, v in (md or ()) if k == STORE_INCARNATION_METADATA), "")
        if not inc:
            return
        if state is not None:
            if state.get("inc") and state["inc"] != inc:
                log.warning("client.stream_restarted_from_scratch", previous=state["inc"], incarnation=inc,
                            last_revision=state.get("last"))
                state["last"] = 0
            state["inc"] = inc
        self._note_incarnation(inc)

    def subscribe(self, engine_id: str, tp_rank: int = 0, *, after_revision: int = 0,
                  heartbeats: bool = False, sole_subscriber: bool = False
                  ) -> AsyncGenerator[rendezvous_pb2.RendezvousEvent, None]:
        """Rendezvous events for an engine rank, resumed across disconnects from the last
        revision seen, so nothing is lost or repeated.

        ``sole_subscriber``: this is the only subscription to the engine's events anywhere
        (a prefill engine of one rank, subscribing as rank 0). Completions this client
        sends for the engine on its session then ask for their answer to be the MATCH
        (``CompleteRequest.match_in_answer``, kvbaton/match_inbox.py): one message fewer
        per match on the server. Such a MATCH has revision 0."""
        if sole_subscriber and tp_rank == 0:
            inbox = self.match_inboxes.setdefault(engine_id, MatchInbox())
            return inbox.merge(self._subscribe(engine_id, tp_rank, after_revision, heartbeats))
        return self._subscribe(engine_id, tp_rank, after_revision, heartbeats)

    def _subscribe(self, engine_id: str, tp_rank: int, after_revision: int,
                   heartbeats: bool) -> AsyncGenerator[rendezvous_pb2.RendezvousEvent, None]:
        Ev = rendezvous_pb2.RendezvousEvent
        state: dict[str, Any] = {"last": after_revision, "inc": ""}

        def open_stream():
            return self.rendezvous.Subscribe(rendezvous_pb2.SubscribeRequest(
                engine_id=engine_id, tp_rank=tp_rank, after_revision=state["last"], incarnation=state["inc"]))

        def on_event(event) -> bool:
            if event.type == Ev.TYPE_HEARTBEAT:
                state["last"] = state["last"] or event.revision
                return heartbeats
            # A fresh subscription replays pending matches at older revisions: keep those.
            if event.revision and event.revision <= state["last"] and event.type != Ev.TYPE_MATCH:
                return False
            state["last"] = max(state["last"], event.revision)
            return True

        return self._resumable(open_stream, on_event, state)

    def watch_leases(self, engine_id: str = "", *, snapshot: bool = True) -> AsyncGenerator[lease_pb2.LeaseEvent, None]:
        """Lease events for an engine (or all), resumed across disconnects; the snapshot
        of live leases comes first when ``snapshot`` is set."""
        state: dict[str, Any] = {"last": 0, "inc": ""}

        def open_stream():
            return self.lease.Watch(lease_pb2.WatchLeasesRequest(
                engine_id=engine_id, snapshot=snapshot and state["last"] == 0, after_revision=state["last"],
                incarnation=state["inc"]))

        def on_event(event) -> bool:
            if event.type == lease_pb2.LeaseEvent.TYPE_HEARTBEAT:
                state["last"] = state["last"] or event.revision
                return False
            state["last"] = max(state["last"], event.revision)
            return True

        return self._resumable(open_stream, on_event, state)

    async def _all_pages(self, method, request, field: str, limit: int = 0, retries: int = 3) -> list:
        """Every item of a paged List (``limit``: stop after that many), one call per page."""
        out: list = []
        while True:
            resp = await self.call(method, request, retries=retries)
            out.extend(getattr(resp, field))
            if not resp.next_page_token or (limit and len(out) >= limit):
                return out[:limit] if limit else out
            request.page_token = resp.next_page_token

    async def list_leases(self, *, engine_id: str = "", states: Sequence[Any] = (), expiring_within_ms: int = 0,
                          limit: int = 0, page_size: int = 0, retries: int = 3) -> list[lease_pb2.LeaseInfo]:
        """Every matching lease, following pages (by deadline)."""
        req = lease_pb2.ListLeasesRequest(engine_id=engine_id, states=states, expiring_within_ms=expiring_within_ms,
                                          page_size=page_size)
        return await self._all_pages(self.lease.List, req, "leases", limit, retries)

    async def list_engines(self, role: Any = 0, *, page_size: int = 0) -> list:
        """Every registered engine rank, following pages."""
        return (await self.list_engines_at(role, page_size=page_size))[0]

    async def list_engines_at(self, role: Any = 0, *, page_size: int = 0) -> tuple[list, int, str]:
        """Every registered engine rank, and the store revision and incarnation to watch
        after (``WatchEnginesRequest.after_revision`` / ``incarnation``): the first page's,
        so that no change made while the later pages were read is missed (0 from a server
        that does not say)."""
        from kvbaton.v1 import registrar_pb2

        request = registrar_pb2.ListEnginesRequest(role=role, page_size=page_size)
        out: list = []
        revision, incarnation = 0, ""
        while True:
            resp = await self.call(self.registrar.ListEngines, request)
            if not request.page_token:
                revision, incarnation = resp.revision, resp.incarnation
            out.extend(resp.ranks)
            if not resp.next_page_token:
                return out, revision, incarnation
            request.page_token = resp.next_page_token

    async def list_transfers(self, *, phases: Sequence[Any] = (), engine_id: str = "", limit: int = 0,
                             page_size: int = 0) -> list:
        """Every matching transfer, following pages (oldest change first)."""
        req = rendezvous_pb2.ListTransfersRequest(phases=phases, engine_id=engine_id, page_size=page_size)
        return await self._all_pages(self.rendezvous.ListTransfers, req, "transfers", limit)

    async def renew(self, conversation_id: str, *, lease_id: str = "", ttl_ms: int = 0) -> lease_pb2.RenewResult:
        """Renews over the client's one KeepAlive stream, batched with every other renewal
        in flight (an agent framework with a thousand conversations sends a few messages
        a second, not a thousand calls)."""
        if self._renewer is None:
            self._renewer = _RenewalBatcher(self)
        return await self._renewer.renew(lease_pb2.RenewRequest(conversation_id=conversation_id, lease_id=lease_id,
                                                                ttl_ms=ttl_ms))


    @property
    def session(self) -> RendezvousSession:
        """The client's engine session: offers, completions, outcomes and cancels over one
        Rendezvous/Session stream instead of one unary call each (opened on first use)."""
        if self._session is None:
            self._session = RendezvousSession(self)
        return self._session


def channel_closed_under(stream_channel: object, current: object) -> bool:
    """True when a ``CancelledError`` out of a stream opened on ``stream_channel`` means
    that the client replaced (and closed) that channel, not that the task is cancelled."""
    task = asyncio.current_task()
    return stream_channel is not current and not (task is not None and task.cancelling())


def _status_error(code: int, reason: str) -> grpc.aio.AioRpcError:
    """A session message's refusal, as the same exception a unary call raises."""
    try:
        status = next(s for s in grpc.StatusCode if s.value[0] == code)
    except StopIteration:
        status = grpc.StatusCode.UNKNOWN
    return grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), details=reason, debug_error_string=None)


class _StuckWatch:
    """Cancels a bidirectional stream that leaves a message unanswered for longer than the
    client's timeout, and says so (``stuck``): a replica that hangs, or a half-open
    connection, must not hold calls or renewals until what they protect has lapsed. The
    stream's owner then treats it as broken and moves to another replica."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.sent_at: dict[int, float] = {}
        self.stuck = False
        self._task: asyncio.Task | None = None

    def start(self, call) -> None:
        async def watch() -> None:
            while True:
                await asyncio.sleep(min(0.25, self.timeout_s / 4))
                if self.sent_at and time.monotonic() - min(self.sent_at.values()) > self.timeout_s:
                    self.stuck = True
                    call.cancel()
                    return
        self._task = asyncio.get_running_loop().create_task(watch())

    def sent(self, key: int) -> None:
        self.sent_at[key] = time.monotonic()

    def answered(self, key: int) -> None:
        self.sent_at.pop(key, None)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def owns_cancel(self) -> bool:
        """True when a CancelledError out of the stream is this watch's doing, not the task's."""
        task = asyncio.current_task()
        return self.stuck and not (task is not None and task.cancelling())


class RendezvousSession:
    """Multiplexes an engine's rendezvous calls onto one ``Rendezvous/Session`` stream.

    ``offer``/``complete``/``report_outcome``/``cancel`` take the unary RPCs' requests and
    return (or raise) what those return: the same response messages, and a refusal as
    ``grpc.aio.AioRpcError`` with the same status code and reason. Answers are matched by
    sequence number.

    Batching is Nagle's without a timer (``max_in_flight`` messages, default 1): a call
    made while nothing is in flight goes out at once; calls made while a message is in
    flight (some of its calls unanswered) wait for it to be answered and then go out
    together in one message. At low load nothing waits; under load each message carries
    more calls, and the server's CPU goes per message, not per call (about 110 µs a
    message here, ``benchmarks/grpc_floor.py``). 0: no limit (a message per loop turn).
    A call never waits longer than ``max_hold_s`` for the window: one slow call (a store
    write that hangs) must not hold every other call back.

    A broken stream is re-opened (on the next replica when several are configured) and
    the unanswered calls are sent again: every rendezvous call is idempotent, so one the
    old replica had already applied is answered as a duplicate (the match, if it made
    one, is delivered once, on the subscribers' streams). Per-call UNAVAILABLE/ABORTED
    answers are retried like ``KvbatonClient.call`` retries them. A server without
    sessions (UNIMPLEMENTED) is spoken to with unary calls instead.
    """

    _UNARY = {"offer": "Offer", "complete": "Complete", "report_outcome": "ReportOutcome", "cancel": "Cancel",
              "begin_read": "BeginRead"}
    # What a server answers to a session call type it does not know (an older one, for
    # begin_read): "session call has no body (...)". That type then goes as unary calls.
    _NO_BODY = "session call has no body"
    _RETRYABLE_CODES = frozenset(c.value[0] for c in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED))

    def __init__(self, client: KvbatonClient, *, retries: int = 3, max_batch: int = 512,
                 max_in_flight: int = 1, max_hold_s: float = 0.005) -> None:
        self.client = client
        self.retries = retries
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self.max_hold_s = max_hold_s
        self.unary_fallback = False
        self.unary_bodies: set[str] = set()  # call types this server's sessions do not know
        self.reconnects = 0
        # Batches and calls each way (how well calls are being batched).
        self.stats = {"sent_batches": 0, "sent_calls": 0, "received_batches": 0, "received_results": 0,
                      "shed_retries": 0}
        self._seq = 0
        self._queue: collections.deque[rendezvous_pb2.SessionCall] = collections.deque()
        self._waiting: dict[int, asyncio.Future] = {}
        self._wakeup = asyncio.Event()
        self._generation = 0  # one per stream opened; an older stream's request iterator stops
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvbaton-session")

    async def offer(self, req: rendezvous_pb2.OfferRequest) -> rendezvous_pb2.RendezvousResponse:
        return await self._call("offer", req)

    async def complete(self, req: rendezvous_pb2.CompleteRequest) -> rendezvous_pb2.RendezvousResponse:
        return await self._call("complete", req)

    async def report_outcome(self, req: rendezvous_pb2.ReportOutcomeRequest) -> rendezvous_pb2.TransferState:
        return await self._call("report_outcome", req)

    async def cancel(self, req: rendezvous_pb2.CancelRequest) -> rendezvous_pb2.TransferState:
        return await self._call("cancel", req)

    async def begin_read(self, req: rendezvous_pb2.BeginReadRequest) -> rendezvous_pb2.TransferState:
        """A pull or reuse READ's ledger entry (``Rendezvous/BeginRead``) on the session."""
        return await self._call("begin_read", req)

    async def _call(self, body: str, req):
        if self.unary_fallback or body in self.unary_bodies:
            return await self.client.call(getattr(self.client.rendezvous, self._UNARY[body]), req)
        inbox = None
        sent_req = req
        if body == "complete":
            inbox = self.client.match_inboxes.get(req.prefill_engine_id)
            if inbox is not None and inbox.subscribed and not req.match_in_answer:
                # The engine's sole subscriber is on this client: its answer may be the MATCH.
                sent_req = rendezvous_pb2.CompleteRequest()
                sent_req.CopyFrom(req)
                sent_req.match_in_answer = True
        loop = asyncio.get_running_loop()
        delay = 0.05
        shed = ShedBackoff(self.client.timeout_s)
        attempt = 0
        while True:
            self._seq += 1
            seq = self._seq
            fut = loop.create_future()
            self._waiting[seq] = fut
            self._queue.append(rendezvous_pb2.SessionCall(seq=seq, **{body: sent_req}))
            self._wakeup.set()
            timer = loop.call_later(self.client.timeout_s * 2, _expire, fut, self.client.timeout_s * 2)
            try:
                result = await fut
            except grpc.aio.AioRpcError as exc:
                # The stream itself was refused (the rate limit charges opening it too):
                # waited for and sent again like a refused call.
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                wait = shed.next_wait(retry_after_s(exc))
                if wait is None:
                    raise
                self.stats["shed_retries"] += 1
                await asyncio.sleep(wait)
                continue
            finally:
                timer.cancel()
                self._waiting.pop(seq, None)
            if result is None:  # the server has no sessions: unary calls from now on
                return await self.client.call(getattr(self.client.rendezvous, self._UNARY[body]), req)
            if result.code == 0:
                if inbox is not None and result.rendezvous.match_delivered:
                    inbox.answered(result.rendezvous.state)
                return result.rendezvous if body in ("offer", "complete") else result.state
            if result.code == _INVALID and result.reason.startswith(self._NO_BODY):
                # An older server: it has sessions but not this call type.
                log.info("client.session_call_unknown", call=body, address=self.client.address)
                self.unary_bodies.add(body)
                return await self.client.call(getattr(self.client.rendezvous, self._UNARY[body]), req)
            if result.code == _EXHAUSTED:
                wait = shed.next_wait(result.retry_after_ms / 1000 if result.retry_after_ms else None)
                if wait is None:
                    raise _status_error(result.code, result.reason)
                self.stats["shed_retries"] += 1
                log.debug("client.session_shed_retry", call=body, wait_ms=round(wait * 1000), reason=result.reason[:200])
                await asyncio.sleep(wait)
                continue
            if result.code not in self._RETRYABLE_CODES or attempt == self.retries:
                raise _status_error(result.code, result.reason)
            log.info("client.session_retry", code=result.code, reason=result.reason[:200], attempt=attempt)
            await asyncio.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 1.0)
            attempt += 1

    def _settle_all(self, seqs, value=None, exc: BaseException | None = None) -> None:
        for seq in seqs:
            fut = self._waiting.get(seq)
            if fut is not None and not fut.done():
                if exc is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(value)

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            self._generation += 1
            sent: dict[int, rendezvous_pb2.SessionCall] = {}
            watch = _StuckWatch(self.client.timeout_s)
            # Messages in flight: seq -> the message it went in; message -> its unanswered calls.
            flight = _InFlight()

            async def requests(mine: int = self._generation, sent: dict[int, rendezvous_pb2.SessionCall] = sent,
                               watch: _StuckWatch = watch, flight: _InFlight = flight):
                while True:
                    await self._wakeup.wait()
                    if mine != self._generation:
                        return  # a broken stream's iterator must not take the new stream's work
                    self._wakeup.clear()
                    while self._queue and mine == self._generation:
                        if self.max_in_flight and flight.full(self.max_in_flight, self.max_hold_s):
                            # Nagle: what comes meanwhile goes in the next message, together.
                            await flight.room(self.max_hold_s)
                            continue
                        batch: list[rendezvous_pb2.SessionCall] = []
                        while self._queue and len(batch) < self.max_batch:
                            call = self._queue.popleft()
                            fut = self._waiting.get(call.seq)
                            if fut is None or fut.done():
                                continue  # its caller gave up
                            sent[call.seq] = call
                            watch.sent(call.seq)
                            batch.append(call)
                        if batch:
                            self.stats["sent_batches"] += 1
                            self.stats["sent_calls"] += len(batch)
                            flight.sent([c.seq for c in batch])
                            yield rendezvous_pb2.SessionRequest(calls=batch)

            channel = self.client.channel
            call = self.client.rendezvous.Session(requests())
            watch.start(call)
            try:
                async for resp in call:
                    backoff = 0.05
                    self.stats["received_batches"] += 1
                    self.stats["received_results"] += len(resp.results)
                    for result in resp.results:
                        sent.pop(result.seq, None)
                        flight.answered(result.seq)
                        watch.answered(result.seq)
                        fut = self._waiting.get(result.seq)
                        if fut is not None and not fut.done():
                            fut.set_result(result)
            except asyncio.CancelledError:
                if watch.owns_cancel():
                    log.warning("client.session_stuck", timeout_s=self.client.timeout_s, address=self.client.address)
                    if len(self.client.addresses) > 1:
                        await self.client.reconnect(if_channel=channel)
                elif channel_closed_under(channel, self.client.channel):
                    # Another stream of this client moved it to the next replica and closed
                    # this channel: gRPC ends our stream with CancelledError. Re-open there.
                    log.info("client.session_reconnect", code="CHANNEL_REPLACED", address=self.client.address)
                else:
                    call.cancel()
                    raise
            except grpc.aio.AioRpcError as exc:
                call.cancel()
                code = exc.code()
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("client.session_unimplemented", address=self.client.address)
                    self.unary_fallback = True
                    self._settle_all([*sent, *(c.seq for c in self._queue)], None)
                    self._queue.clear()
                    return
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.RESOURCE_EXHAUSTED):
                    # The stream itself was refused: every waiting call gets that answer.
                    self._settle_all([*sent, *(c.seq for c in self._queue)], exc=exc)
                    sent.clear()
                    self._queue.clear()
                log.info("client.session_reconnect", code=code.name, address=self.client.address)
                if len(self.client.addresses) > 1 and code in _RETRYABLE:
                    await self.client.reconnect(if_channel=channel)
            except Exception as exc:  # noqa: BLE001 - the stream broke; whatever the cause, open another
                call.cancel()
                log.info("client.session_reconnect", error=repr(exc)[:200])
                if len(self.client.addresses) > 1:
                    await self.client.reconnect(if_channel=channel)
            else:  # the server ended the stream (shutting down): go elsewhere too
                call.cancel()
                if len(self.client.addresses) > 1:
                    await self.client.reconnect(if_channel=channel)
            finally:
                watch.stop()
                # This stream is over: its request iterator (gRPC may still be waiting on
                # it) must not take calls made during the backoff below into a dead stream.
                self._generation += 1
            self.reconnects += 1
            # Unanswered calls go out again, in their order, on the new stream.
            self._queue.extendleft(c for _, c in sorted(sent.items(), reverse=True))
            if self._queue:
                self._wakeup.set()
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, 2.0)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._settle_all(list(self._waiting), exc=_status_error(grpc.StatusCode.CANCELLED.value[0], "session closed"))


class _InFlight:
    """A session stream's messages that have unanswered calls (its Nagle window)."""

    def __init__(self) -> None:
        self.messages: dict[int, set[int]] = {}  # message number -> its unanswered seqs
        self._sent_at: dict[int, float] = {}  # message number -> when it was sent (monotonic)
        self._of: dict[int, int] = {}  # seq -> its message number
        self._n = 0
        self._room = asyncio.Event()

    def sent(self, seqs: list[int]) -> None:
        self._n += 1
        self.messages[self._n] = set(seqs)
        self._sent_at[self._n] = time.monotonic()
        for seq in seqs:
            self._of[seq] = self._n

    def full(self, window: int, max_hold_s: float) -> bool:
        """Whether ``window`` messages are in flight, not counting those in flight for
        longer than ``max_hold_s`` (slow ones do not hold the next)."""
        if len(self.messages) < window:
            return False
        young = time.monotonic() - max_hold_s
        return sum(1 for t in self._sent_at.values() if t > young) >= window

    def answered(self, seq: int) -> None:
        n = self._of.pop(seq, None)
        if n is None:
            return
        left = self.messages[n]
        left.discard(seq)
        if not left:
            del self.messages[n]
            del self._sent_at[n]
            self._room.set()

    async def room(self, max_hold_s: float) -> None:
        """Returns once a message in flight has been answered in full, or one more has
        been in flight for ``max_hold_s``."""
        self._room.clear()
        now = time.monotonic()
        young = [t for t in self._sent_at.values() if t > now - max_hold_s]
        wait = max(min(young, default=now) + max_hold_s - now, 0.0)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._room.wait(), wait)


def _expire(fut: asyncio.Future, after_s: float) -> None:
    if not fut.done():
        fut.set_exception(_status_error(grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
                                        f"no answer on the session within {after_s:g} s"))


class _RenewalBatcher:
    """Multiplexes renewals onto one KeepAlive stream: requests queued while a batch is
    being sent go out together in the next one; a broken stream is re-opened and the
    unanswered renewals are sent again (renewing twice is harmless).

    Renewals naming only a conversation (what a LeaseKeeper sends) go packed, as
    ``KeepAliveRequest.conversation_ids``: the server then parses and checks no message
    per renewal. A server that predates the field ignores it (an unknown field) and
    answers only ``renewals``, so an answer covering fewer renewals than were sent means
    that: the rest go again as ``renewals``, and this stream sends no packed ids any more
    (a new stream, perhaps to an upgraded replica, tries again)."""

    def __init__(self, client: KvbatonClient, max_batch: int = 1000) -> None:
        self.client = client
        self.max_batch = max_batch
        self._queue: list[tuple[lease_pb2.RenewRequest, asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._generation = 0  # one per stream opened; an older stream's request iterator stops
        # Plain renewals go packed (KeepAliveRequest.conversation_ids) while this is set;
        # cleared for the rest of a stream whose server ignores them (``fallbacks`` counts).
        self.packed = True
        self.fallbacks = 0
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvbaton-keepalive")

    async def renew(self, req: lease_pb2.RenewRequest) -> lease_pb2.RenewResult:
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((req, fut))
        self._wakeup.set()
        return await asyncio.wait_for(fut, self.client.timeout_s * 2)

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            inflight: dict[int, list[tuple[lease_pb2.RenewRequest, asyncio.Future]]] = {}
            seq = 0
            self._generation += 1
            self.packed = True  # until this stream's server shows it ignores packed ids
            packed_seqs: set[int] = set()  # this stream's messages that carried packed ids
            watch = _StuckWatch(self.client.timeout_s)

            async def requests(mine: int = self._generation, inflight: dict[int, list[tuple[lease_pb2.RenewRequest,
                               asyncio.Future]]] = inflight, watch: _StuckWatch = watch,
                               packed_seqs: set[int] = packed_seqs):
                nonlocal seq
                while True:
                    await self._wakeup.wait()
                    if mine != self._generation:
                        return  # a broken stream's iterator must not take the new stream's work
                    self._wakeup.clear()
                    while self._queue and mine == self._generation:
                        batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                        batch = [(r, f) for r, f in batch if not f.done()]
                        if not batch:
                            continue
                        seq += 1
                        watch.sent(seq)
                        msg, inflight[seq] = self._message(seq, batch)
                        if msg.conversation_ids:
                            packed_seqs.add(seq)
                        yield msg

            channel = self.client.channel
            call = self.client.lease.KeepAlive(requests())
            watch.start(call)
            # The server announces its store's incarnation as the stream opens: learn it
            # without waiting for a renewal (keepers then renew at once after a restart).
            noted = asyncio.ensure_future(self.client._stream_incarnation(call, None))
            try:
                async for resp in call:
                    backoff = 0.05
                    watch.answered(resp.seq)
                    batch = self._answered(resp, inflight.pop(resp.seq, []), packed_seqs)
                    for (_, fut), result in zip(batch, renew_results(resp, [r for r, _ in batch])):
                        if not fut.done():
                            fut.set_result(result)
            except asyncio.CancelledError:
                if not watch.owns_cancel() and not channel_closed_under(channel, self.client.channel):
                    call.cancel()
                    raise
                # Stuck (handled below), or another stream moved the client and closed this
                # channel (gRPC ends our stream with CancelledError): re-open on the current one.
            except Exception as exc:  # noqa: BLE001 - the stream broke; whatever the cause, open another
                call.cancel()
                log.info("client.keepalive_reconnect", error=repr(exc)[:200])
                if len(self.client.addresses) > 1:
                    await self.client.reconnect(if_channel=channel)
            finally:
                watch.stop()
                noted.cancel()
                self._generation += 1  # (as in RendezvousSession: renewals made during the backoff wait for the next stream)
            if watch.stuck:
                log.warning("client.keepalive_stuck", timeout_s=self.client.timeout_s, address=self.client.address)
                if len(self.client.addresses) > 1:
                    await self.client.reconnect(if_channel=channel)
            # Unanswered renewals go out again on the new stream.
            self._queue[:0] = [item for batch in inflight.values() for item in batch]
            if self._queue:
                self._wakeup.set()
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, 2.0)

    def _message(self, seq: int, batch: list[tuple[lease_pb2.RenewRequest, asyncio.Future]]
                 ) -> tuple[lease_pb2.KeepAliveRequest, list[tuple[lease_pb2.RenewRequest, asyncio.Future]]]:
        """The message for ``batch``, and the batch in the answer's order: renewals with a
        lease id or a TTL as ``renewals``, then those naming only a conversation packed as
        ``conversation_ids`` (while this stream's server takes them)."""
        if not self.packed:
            return lease_pb2.KeepAliveRequest(seq=seq, renewals=[r for r, _ in batch], compact=True), batch
        spelled = [item for item in batch if item[0].lease_id or item[0].ttl_ms]
        plain = [item for item in batch if not (item[0].lease_id or item[0].ttl_ms)] if spelled else batch
        msg = lease_pb2.KeepAliveRequest(seq=seq, renewals=[r for r, _ in spelled],
                                         conversation_ids=[r.conversation_id for r, _ in plain], compact=True)
        return msg, spelled + plain

    def _answered(self, resp: lease_pb2.KeepAliveResponse, batch: list[tuple[lease_pb2.RenewRequest, asyncio.Future]],
                  packed_seqs: set[int]) -> list[tuple[lease_pb2.RenewRequest, asyncio.Future]]:
        """The part of ``batch`` that ``resp`` answers. An answer to a message with packed
        ids covering fewer renewals than were sent comes from a server that ignored them:
        they are queued again, to go as ``renewals``. (A short answer to a message without
        any is not resent: that server would answer it short again.)"""
        answered = len(resp.lease_ids) if resp.compact else len(resp.results)
        had_packed = resp.seq in packed_seqs
        packed_seqs.discard(resp.seq)
        if answered >= len(batch) or not had_packed:
            return batch[:answered] if answered < len(batch) else batch
        if self.packed:
            self.packed = False
            self.fallbacks += 1
            log.info("client.keepalive_unpacked", answered=answered, sent=len(batch),
                     reason="the server ignored KeepAliveRequest.conversation_ids (it predates them)")
        self._queue[:0] = batch[answered:]
        self._wakeup.set()
        return batch[:answered]

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def renew_results(resp: lease_pb2.KeepAliveResponse, renewals: Sequence[lease_pb2.RenewRequest]) -> list[lease_pb2.RenewResult]:
    """One result per renewal of the request, in order, from a full answer or a compact
    one (where a renewal that succeeded has no result of its own: it is rebuilt from the
    packed lease id, deadline and TTL)."""
    if not resp.compact:
        return list(resp.results)
    out: list[lease_pb2.RenewResult] = []
    failed = dict(zip(resp.result_index, resp.results))
    for i, (req, lease_id, expires, ttl) in enumerate(zip(renewals, resp.lease_ids, resp.expires_at_ms, resp.ttl_ms)):
        res = failed.get(i)
        if res is None:
            res = lease_pb2.RenewResult(conversation_id=req.conversation_id, status=lease_pb2.RENEW_STATUS_OK,
                                        lease=lease_pb2.LeaseInfo(lease_id=lease_id, conversation_id=req.conversation_id,
                                                                  state=lease_pb2.LEASE_STATE_ACTIVE, ttl_ms=ttl,
                                                                  expires_at_ms=expires,
                                                                  remaining_ms=max(0, expires - resp.now_ms)))
        out.append(res)
    return out


class LeaseLost(Exception):
    """A LeaseKeeper's lease is gone (expired, revoked, or lost with the control plane's store)."""

    def __init__(self, conversation_id: str, result: lease_pb2.RenewResult) -> None:
        super().__init__(f"lease of conversation {conversation_id} is gone: "
                         f"{lease_pb2.RenewStatus.Name(result.status)} {result.error}")
        self.conversation_id = conversation_id
        self.result = result


class LeaseKeeper:
    """Renews a conversation's lease in the background while the ``async with`` block runs.

    On exit it stops renewing (the lease then expires after its TTL, so the KV stays
    reusable for the next turn if one comes soon); ``release()`` revokes it at once, for
    an agent that knows the conversation is over. Renewals go over one KeepAlive stream
    shared by every keeper of the same client.
    """

    def __init__(self, client: KvbatonClient, conversation_id: str, *, interval_s: float | None = None,
                 ttl_ms: int = 0, on_lost: Callable[[lease_pb2.RenewResult], None] | None = None) -> None:
        self.client = client
        # Called (once per loss) when the lease is gone: NOT_FOUND (e.g. the control plane's
        # store restarted and lost it) or ENDED (expired or revoked). ``lost`` holds the
        # answer that said so until a renewal succeeds again; ``check()`` raises LeaseLost.
        self.on_lost = on_lost
        self.lost: lease_pb2.RenewResult | None = None
        self.conversation_id = conversation_id
        self.ttl_ms = ttl_ms
        self.interval_s = interval_s
        self.last: lease_pb2.RenewResult | None = None
        self.renewals = 0
        self.failures = 0
        self._task: asyncio.Task | None = None
        self._stopped = asyncio.Event()
        self._attempt_s = 1.0  # per-renewal bound, set from the TTL on entry

    async def __aenter__(self) -> LeaseKeeper:
        first = await self.renew_once()
        if first.status == lease_pb2.RENEW_STATUS_OK and self.interval_s is None:
            # A third of the TTL: two renewals can be lost before the lease is at risk.
            self.interval_s = max(first.lease.ttl_ms / 3000, 0.05)
        self.interval_s = self.interval_s or 1.0
        ttl_s = (first.lease.ttl_ms or self.ttl_ms or 0) / 1000
        self._attempt_s = max(self.interval_s, ttl_s / 3) if ttl_s else max(self.interval_s, 1.0)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"lease-keeper-{self.conversation_id}")
        return self

    async def renew_once(self) -> lease_pb2.RenewResult:
        result = await self.client.renew(self.conversation_id, ttl_ms=self.ttl_ms)
        self.last = result
        if result.status == lease_pb2.RENEW_STATUS_OK:
            self.renewals += 1
            self.lost = None
        else:
            self.failures += 1
            if result.status in (lease_pb2.RENEW_STATUS_NOT_FOUND, lease_pb2.RENEW_STATUS_ENDED) and self.lost is None:
                self.lost = result
                log.warning("lease_keeper.lost", conversation_id=self.conversation_id,
                            status=lease_pb2.RenewStatus.Name(result.status), error=result.error)
                if self.on_lost is not None:
                    self.on_lost(result)
        return result

    def check(self) -> None:
        """Raises ``LeaseLost`` if the lease is gone (its blocks may be freed at any time)."""
        if self.lost is not None:
            raise LeaseLost(self.conversation_id, self.lost)

    async def _run(self) -> None:
        while not self._stopped.is_set():
            # Renew every interval, and at once when the control plane announces a new
            # store incarnation (the lease is then probably gone: say so now).
            stop = asyncio.ensure_future(self._stopped.wait())
            new_store = asyncio.ensure_future(self.client.wait_incarnation_change())
            try:
                done, _ = await asyncio.wait({stop, new_store}, timeout=self.interval_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                new_store.cancel()
            if stop in done:
                return
            try:
                # Bounded well inside the TTL: one renewal stuck behind a failing replica
                # must not keep the next ones from going out before the lease lapses.
                result = await asyncio.wait_for(self.renew_once(), self._attempt_s)
                if result.status in (lease_pb2.RENEW_STATUS_ENDED, lease_pb2.RENEW_STATUS_SUPERSEDED):
                    # A newer turn's lease replaces this one; keep renewing whatever is current.
                    if result.status == lease_pb2.RENEW_STATUS_ENDED:
                        log.info("lease_keeper.ended", conversation_id=self.conversation_id, error=result.error)
            except (grpc.aio.AioRpcError, TimeoutError) as exc:
                self.failures += 1
                log.warning("lease_keeper.renew_failed", conversation_id=self.conversation_id, error=repr(exc))

    async def release(self, reason: str = "conversation finished") -> lease_pb2.LeaseInfo:
        await self.stop()
        return await self.client.call(self.client.lease.Revoke, lease_pb2.RevokeRequest(
            conversation_id=self.conversation_id, reason=reason))

    async def stop(self) -> None:
        self._stopped.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def __aexit__(self, *exc) -> None:
        await self.stop()


class EngineKeeper:
    """Keeps one engine rank registered: registers, refreshes its liveness every TTL/3,
    and registers again (new incarnation) when the control plane says the liveness lapsed
    — after a store failover or a long pause — so the engine never stays invisible.
    Transport failures back off with jitter and never end the loop.

        keeper = EngineKeeper(client, rank, ttl_ms=10_000)
        await keeper.start()            # returns after the first registration
        ...
        await keeper.stop(deregister=True)
    """

    def __init__(self, client: KvbatonClient, rank, *, ttl_ms: int = 10_000) -> None:
        self.client = client
        self.rank = rank
        self.ttl_ms = ttl_ms
        self.registered: registrar_pb2.EngineRank | None = None  # the EngineRank as the registrar holds it
        self.registrations = 0
        self._task: asyncio.Task | None = None

    async def _register(self) -> None:
        resp = await self.client.call(self.client.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(
            rank=self.rank, ttl_ms=self.ttl_ms))
        self.registered = resp.rank
        self.ttl_ms = resp.ttl_ms
        self.registrations += 1
        log.info("engine_keeper.registered", engine_id=self.rank.engine_id, tp_rank=self.rank.tp_rank,
                 incarnation=resp.rank.incarnation)

    async def start(self) -> None:
        await self._register()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-keeper-{self.rank.engine_id}")

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            incarnation = self.registered.incarnation if self.registered is not None else ""
            try:
                await self.client.call(self.client.registrar.RefreshEngine, registrar_pb2.RefreshEngineRequest(
                    engine_id=self.rank.engine_id, tp_rank=self.rank.tp_rank, incarnation=incarnation))
                backoff = 0.1
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("engine_keeper.lapsed", engine_id=self.rank.engine_id, detail=exc.details())
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self._register()
                    continue
                log.warning("engine_keeper.refresh_failed", engine_id=self.rank.engine_id, code=exc.code().name)
                await asyncio.sleep(backoff * (1 + random.random()))
                backoff = min(backoff * 2, 5.0)

    async def stop(self, *, deregister: bool = False) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if deregister:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.client.call(self.client.registrar.DeregisterEngine, registrar_pb2.DeregisterEngineRequest(
                    engine_id=self.rank.engine_id, tp_rank=self.rank.tp_rank))
