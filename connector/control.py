"""The worker's control-plane thread: one asyncio loop + :class:`KvbatonClient`.

Why a thread of its own: gRPC calls must never run on vLLM's model-runner thread (an
unreachable control plane would stall the engine) nor on the NIXL transfer thread (which
must keep polling UCX). Other threads submit coroutines with :meth:`ControlThread.submit`
and get a ``concurrent.futures.Future`` they can poll without blocking.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvbaton.client import KvbatonClient
from kvbaton.security import ClientSecurity
from kvbaton.services.tracing import grpc_metadata
from kvbaton.v1 import common_pb2, registrar_pb2, rendezvous_pb2

from .affinity import unpin_this_thread
from .settings import KvbatonSettings

log = logging.getLogger("kvbaton.connector.control")
T = TypeVar("T")


# One control thread and client per process and control plane (``ControlThread.shared``):
# key -> the holder that started it.
_SHARED: dict[tuple[Any, ...], ControlThread] = {}
_SHARED_LOCK = threading.Lock()


class ControlThread:
    """Owns an event loop on a named daemon thread; registers and refreshes the engine rank.

    ``ControlThread.shared(...)`` gives every part of one engine process (the scheduler's
    connector and the rank-0 worker's at TP 1) a holder of the same thread, loop and
    :class:`KvbatonClient`, so its completions go out on the client that holds the
    engine's sole subscription and get the MATCH on their answer (kvbaton/match_inbox.py)
    instead of one more message on the stream. Each holder's tasks (registration refresh,
    subscriptions) are its own; the thread stops when the last holder closes.
    """

    def __init__(self, address: str, *, timeout_s: float = 5.0, name: str = "kvbaton-control",
                 security: ClientSecurity | None = None, unpin: bool = True) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.unpin = unpin  # widen this thread's CPU mask first (connector/affinity.py)
        self.cpus: set[int] | None = None  # the mask the thread runs on (None: not widened)
        # TLS + token (settings or $KVBATON_TLS_* / $KVBATON_TOKEN); resolved here so a
        # half-configured engine fails at start, not on its first call.
        self.security = security if security is not None else ClientSecurity.resolve()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._client: KvbatonClient | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(10.0):
            raise RuntimeError("kvbaton control thread did not start")
        self._refresh_task: concurrent.futures.Future[None] | None = None
        self._tasks: list[concurrent.futures.Future[None]] = []
        self._holders = [1]  # holders of this thread and client (shared by them all)
        self._shared_key: tuple[Any, ...] | None = None
        self._closed = False

    @classmethod
    def shared(cls, address: str, *, timeout_s: float = 5.0, name: str = "kvbaton-control",
               security: ClientSecurity | None = None, unpin: bool = True) -> ControlThread:
        """A holder of this process's control thread for ``address`` (started by the first
        caller with the same settings); close each holder once."""
        security = security if security is not None else ClientSecurity.resolve()
        key = (address, timeout_s, security, unpin)
        with _SHARED_LOCK:
            first = _SHARED.get(key)
            if first is not None and first._holders[0] > 0:
                holder = cls.__new__(cls)
                holder.__dict__.update({k: v for k, v in first.__dict__.items()
                                        if k not in ("_refresh_task", "_tasks", "_closed")})
                holder._refresh_task, holder._tasks, holder._closed = None, [], False
                first._holders[0] += 1
                return holder
            ct = cls(address, timeout_s=timeout_s, name=name, security=security, unpin=unpin)
            ct._shared_key = key
            _SHARED[key] = ct
            return ct

    @property
    def holders(self) -> int:
        """Holders of this thread and client not yet closed."""
        return self._holders[0]

    def _run(self) -> None:
        if self.unpin:  # before the gRPC channel: gRPC's own threads inherit the mask
            self.cpus = unpin_this_thread()
        asyncio.set_event_loop(self._loop)
        self._client = self.security.client(self.address, timeout_s=self.timeout_s)
        self._ready.set()
        self._loop.run_forever()

    @property
    def client(self) -> KvbatonClient:
        assert self._client is not None
        return self._client

    def submit(self, fn: Callable[[KvbatonClient], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run ``fn(client)`` on the loop; returns at once."""
        async def _call() -> T:
            return await fn(self.client)
        return asyncio.run_coroutine_threadsafe(_call(), self._loop)

    # ------------------------------------------------------------------ registration
    def register_rank(self, rank: registrar_pb2.EngineRank, ttl_ms: int) -> concurrent.futures.Future[None]:
        """Register ``rank`` and keep it alive (re-registering after NOT_FOUND) until close."""
        async def _keep() -> None:
            client = self.client
            incarnation = ""
            delay = 0.2
            while True:
                try:
                    if not incarnation:
                        resp = await client.call(client.registrar.RegisterEngine,
                                                 registrar_pb2.RegisterEngineRequest(rank=rank, ttl_ms=ttl_ms))
                        incarnation = resp.rank.incarnation
                        log.info("kvbaton: registered engine %s rank %d (incarnation %s)",
                                 rank.engine_id, rank.tp_rank, incarnation)
                    else:
                        await client.call(client.registrar.RefreshEngine, registrar_pb2.RefreshEngineRequest(
                            engine_id=rank.engine_id, tp_rank=rank.tp_rank, incarnation=incarnation))
                    delay = 0.2
                    # Refresh every TTL/3, or at once when the control plane announces a new
                    # store incarnation (its store restarted: this registration is gone).
                    if await client.wait_incarnation_change(max(ttl_ms / 3000, 0.2)):
                        log.warning("kvbaton: control plane store restarted; re-registering engine %s rank %d",
                                    rank.engine_id, rank.tp_rank)
                        incarnation = ""
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        # Refused for what it is (e.g. metadata over the store's size limit):
                        # the same registration can never succeed, so don't retry it forever.
                        log.error("kvbaton: registration of engine %s rank %d refused: %s",
                                  rank.engine_id, rank.tp_rank, exc.details())
                        raise
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        incarnation = ""  # lease lapsed: register again
                    log.warning("kvbaton: registrar call failed (%s); retrying in %.1fs",
                                exc.code().name, delay)
                except Exception:
                    # Never stop for anything else: a keeper that ends leaves the engine
                    # unregistered for good one TTL later (no router sends it anything),
                    # and nothing said why (its future is never awaited).
                    log.warning("kvbaton: registration of engine %s rank %d failed unexpectedly; retrying in %.1fs",
                                rank.engine_id, rank.tp_rank, delay, exc_info=True)
                else:
                    continue
                await asyncio.sleep(delay)
                # At most 1 s between tries: a restarted control plane sees engines back
                # within a second or two.
                delay = min(delay * 2, 1.0)
        fut = asyncio.run_coroutine_threadsafe(_keep(), self._loop)
        self._refresh_task = fut
        return fut

    def subscribe(self, engine_id: str, tp_rank: int,
                  on_event: Callable[[Any], None], *, sole_subscriber: bool = False) -> concurrent.futures.Future[None]:
        """Forward this rank's rendezvous events (not heartbeats) to ``on_event`` until close.

        ``KvbatonClient.subscribe`` resumes across disconnects; anything else it raises is
        logged and the subscription restarted after a pause, so events are never silently
        lost for the life of the engine. ``sole_subscriber``: no other rank or process
        subscribes to this engine's events (a one-rank engine), so completions sent from
        this thread get their MATCH on their answer (``KvbatonClient.subscribe``).
        """
        async def _loop() -> None:
            while True:
                try:
                    async for ev in self.client.subscribe(engine_id, tp_rank, sole_subscriber=sole_subscriber):
                        on_event(ev)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.warning("kvbaton: rendezvous subscription failed; restarting", exc_info=True)
                    await asyncio.sleep(1.0)
        fut = asyncio.run_coroutine_threadsafe(_loop(), self._loop)
        self._tasks.append(fut)
        return fut

    def get_engine(self, engine_id: str) -> concurrent.futures.Future[registrar_pb2.GetEngineResponse]:
        return self.submit(lambda c: c.call(c.registrar.GetEngine, registrar_pb2.GetEngineRequest(engine_id=engine_id),
                                            retries=1))

    def close(self) -> None:
        """Stop refreshing and subscribing, close the client and stop the loop (bounded).

        Nothing is deregistered: the rank's registration lapses with its TTL (``ttl_ms``).
        A holder from ``shared`` stops its own tasks; the thread stops with the last one."""
        if self._closed:
            return
        self._closed = True
        if self._refresh_task is not None:
            self._refresh_task.cancel()
        for t in self._tasks:
            t.cancel()
        with _SHARED_LOCK:
            self._holders[0] -= 1
            if self._holders[0] > 0:
                return
            key = self._shared_key
            if key is not None and _SHARED.get(key) is not None and _SHARED[key]._holders is self._holders:
                del _SHARED[key]
        if self._loop.is_closed():
            return
        async def _shutdown() -> None:
            if self._client is not None:
                await self._client.close()
        try:
            asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(timeout=2.0)
        except Exception:  # shutdown is best effort
            log.debug("kvbaton: control client close failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2.0)


# Rendezvous RPC name -> the session method that sends the same request (kvbaton.client).
_SESSION_METHODS = {"Offer": "offer", "Complete": "complete", "ReportOutcome": "report_outcome", "Cancel": "cancel",
                    "BeginRead": "begin_read"}


def rendezvous_call(method: str, req: Any, traceparent: str | None = None,
                    *, retries: int = 3) -> Callable[[KvbatonClient], Awaitable[Any]]:
    """``fn`` for :meth:`ControlThread.submit` sending one offer/completion/outcome/cancel/BeginRead.

    Untraced calls go over the client's ``Rendezvous/Session`` stream (one per engine
    process, batched; the client falls back to unary calls where the server has no
    sessions). A call that carries a request's ``traceparent`` is sent as its own unary
    call instead, because session messages have no per-call metadata and the trace's span
    for that RPC would otherwise be lost.
    """
    if method not in _SESSION_METHODS:
        raise ValueError(f"not a session call: {method!r}")
    md = grpc_metadata(traceparent)
    if md:
        return lambda c: c.call(getattr(c.rendezvous, method), req, retries=retries, metadata=md)
    return lambda c: getattr(c.session, _SESSION_METHODS[method])(req)


def retry_while_unregistered(fn: Callable[[KvbatonClient], Awaitable[T]], budget_s: float, *,
                             first_delay_s: float = 0.5, max_delay_s: float = 2.0,
                             sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                             clock: Callable[[], float] = time.monotonic) -> Callable[[KvbatonClient], Awaitable[T]]:
    """``fn`` again while the control plane answers ``NOT_FOUND: engine ... is not registered``,
    within ``budget_s`` (delays 0.5 s doubling to 2 s).

    Why: an engine's registration lapses when its refresh comes late (10 s TTL) and its
    worker registers again at its next refresh (``register_rank``, every third of the TTL).
    A push ``Complete`` refused in that gap was lost (fire-and-forget), so decode waited out
    its whole timeout for a WRITE that never came and recomputed (issue 14: TP-1 prefill ->
    TP-2 decode on the overloaded 2-core VM, ``Complete`` refused after 8.4 s). Nothing was
    recorded by the refused call, so sending it again is safe; any other error is final."""
    async def call(c: KvbatonClient) -> T:
        deadline = clock() + budget_s
        delay = first_delay_s
        while True:
            try:
                return await fn(c)
            except grpc.aio.AioRpcError as exc:
                if not unregistered(exc) or clock() + delay > deadline:
                    raise
            log.info("kvbaton: engine not registered (lapsed?): call again in %.1f s", delay)
            await sleep(delay)
            delay = min(delay * 2, max_delay_s)
    return call


def unregistered(exc: BaseException) -> bool:
    """The control plane's refusal of a call from an engine it does not know (now)."""
    return (isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.NOT_FOUND
            and "is not registered" in (exc.details() or ""))


def security_of(settings: KvbatonSettings) -> ClientSecurity:
    """The engine's TLS files and token: its ``control_tls_*`` / ``control_token*``
    settings, each falling back to its ``$KVBATON_*`` variable (kvbaton/security.py)."""
    return ClientSecurity.resolve(tls_ca=settings.control_tls_ca, tls_cert=settings.control_tls_cert,
                                  tls_key=settings.control_tls_key, token=settings.control_token,
                                  token_file=settings.control_token_file)


def complete_request(engine_id: str, timeout_s: float, transfer_id: str, block_ids: tuple[int, ...],
                     num_tokens: int, request_id: str, decode_engine_id: str = "") -> rendezvous_pb2.CompleteRequest:
    """Prefill's ``Rendezvous.Complete`` for a push (sent by the scheduler, or by the worker
    with ``complete_from_worker``). ``decode_engine_id``: the decode the router paired this
    request with; the control plane then lets only that engine offer (README "Security")."""
    return rendezvous_pb2.CompleteRequest(transfer_id=transfer_id, prefill_engine_id=engine_id,
                                          block_ids=block_ids, num_tokens=num_tokens,
                                          timeout_ms=int(timeout_s * 1000), request_id=request_id, writers=1,
                                          decode_engine_id=decode_engine_id)


def role_of(kv_role: str) -> common_pb2.EngineRole:
    """vLLM kv_role → registrar EngineRole."""
    return {"kv_producer": common_pb2.ENGINE_ROLE_PREFILL, "kv_consumer": common_pb2.ENGINE_ROLE_DECODE,
            "kv_both": common_pb2.ENGINE_ROLE_BOTH}.get(kv_role, common_pb2.ENGINE_ROLE_UNSPECIFIED)


def geometry_fields(rank: registrar_pb2.EngineRank) -> dict[str, Any]:
    """KvGeometry proto → kwargs for ``KvLayout.from_proto_fields``."""
    g = rank.geometry
    return {"region_base_addrs": list(g.region_base_addrs), "bytes_per_block": g.bytes_per_block,
            "num_blocks": g.num_blocks, "tokens_per_block": g.tokens_per_block, "dtype": g.dtype,
            "layout": g.layout, "fingerprint": g.fingerprint, "device": g.device,
            "device_id": g.device_id, "block_stride_bytes": g.block_stride_bytes}
