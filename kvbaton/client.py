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
import contextlib
import random
from collections.abc import AsyncIterator, Sequence

import grpc
import structlog

from kvbaton.v1 import lease_pb2, lease_pb2_grpc, registrar_pb2, registrar_pb2_grpc, rendezvous_pb2, rendezvous_pb2_grpc

log = structlog.get_logger(__name__)

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
              grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


class KvbatonClient:
    """Stubs for the three services over one channel per address list.

    ``addresses`` may name several replicas ("h1:p,h2:p"); the channel is pinned to one
    and moves to the next on ``reconnect()`` (streams do it for you).
    """

    def __init__(self, addresses: str | Sequence[str], *, timeout_s: float = 5.0) -> None:
        self.addresses = [a for a in (addresses.split(",") if isinstance(addresses, str) else addresses) if a]
        if not self.addresses:
            raise ValueError("no control-plane address")
        self.timeout_s = timeout_s
        self._index = 0
        self._connect()

    def _connect(self) -> None:
        addr = self.addresses[self._index % len(self.addresses)]
        self.channel = grpc.aio.insecure_channel(addr, options=[
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ("grpc.max_send_message_length", 16 * 1024 * 1024),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ])
        self.address = addr
        self.registrar = registrar_pb2_grpc.RegistrarStub(self.channel)
        self.rendezvous = rendezvous_pb2_grpc.RendezvousStub(self.channel)
        self.lease = lease_pb2_grpc.LeaseStub(self.channel)

    async def reconnect(self) -> None:
        old = self.channel
        self._index += 1
        self._connect()
        with contextlib.suppress(Exception):
            await old.close(grace=0)

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        await asyncio.wait_for(self.channel.channel_ready(), timeout_s)

    async def close(self) -> None:
        await self.channel.close(grace=0)

    async def __aenter__(self) -> "KvbatonClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- conveniences --------------------------------------------------------
    async def call(self, method, request, *, retries: int = 3):
        """A unary call with a deadline, retried on transport errors across replicas.

        Safe because every kvbaton mutation is idempotent for the same message."""
        delay = 0.05
        service, name = self._route(method)
        for attempt in range(retries + 1):
            try:
                # Resolved on every attempt: a reconnect replaces the stubs.
                return await getattr(getattr(self, service), name)(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE or attempt == retries:
                    raise
                log.info("client.retry", code=exc.code().name, address=self.address, attempt=attempt)
                if exc.code() == grpc.StatusCode.UNAVAILABLE and len(self.addresses) > 1:
                    await self.reconnect()
                await asyncio.sleep(delay * (1 + random.random()))
                delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")

    _STUBS = {"Registrar": "registrar", "Rendezvous": "rendezvous", "Lease": "lease"}

    def _route(self, method) -> tuple[str, str]:
        """(stub attribute, method name) of a bound stub method, e.g. ("lease", "Renew")."""
        path = method._method.decode() if isinstance(method._method, bytes) else method._method
        service, name = path.rsplit("/", 1)
        return self._STUBS[service.rsplit(".", 1)[-1].lstrip("/")], name

    async def subscribe(self, engine_id: str, tp_rank: int = 0, *, after_revision: int = 0,
                        heartbeats: bool = False) -> AsyncIterator[rendezvous_pb2.RendezvousEvent]:
        """Rendezvous events for an engine rank, resumed across disconnects without loss
        or duplicates (events are de-duplicated by revision)."""
        last = after_revision
        backoff = 0.05
        while True:
            stream = self.rendezvous.Subscribe(rendezvous_pb2.SubscribeRequest(
                engine_id=engine_id, tp_rank=tp_rank, after_revision=last))
            try:
                async for event in stream:
                    backoff = 0.05
                    if event.type == rendezvous_pb2.RendezvousEvent.TYPE_HEARTBEAT:
                        if last == 0:
                            last = event.revision
                        if heartbeats:
                            yield event
                        continue
                    if event.revision and event.revision <= last and event.type != rendezvous_pb2.RendezvousEvent.TYPE_MATCH:
                        continue
                    last = max(last, event.revision)
                    yield event
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise
                log.info("client.subscribe_reconnect", code=exc.code().name, after_revision=last)
            finally:
                stream.cancel()
            if len(self.addresses) > 1:
                await self.reconnect()
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, 2.0)

    async def watch_leases(self, engine_id: str = "", *, snapshot: bool = True) -> AsyncIterator[lease_pb2.LeaseEvent]:
        """Lease events for an engine (or all), resumed across disconnects."""
        last = 0
        first = snapshot
        backoff = 0.05
        while True:
            stream = self.lease.Watch(lease_pb2.WatchLeasesRequest(engine_id=engine_id, snapshot=first, after_revision=last))
            try:
                async for event in stream:
                    backoff = 0.05
                    if event.type == lease_pb2.LeaseEvent.TYPE_HEARTBEAT:
                        last = max(last, event.revision) if last == 0 else last
                        continue
                    last = max(last, event.revision)
                    yield event
                first = False
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE:
                    raise
                first = last == 0 and snapshot
            finally:
                stream.cancel()
            if len(self.addresses) > 1:
                await self.reconnect()
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, 2.0)


class LeaseKeeper:
    """Renews a conversation's lease in the background while the ``async with`` block runs.

    On exit it stops renewing (the lease then expires after its TTL, so the KV stays
    reusable for the next turn if one comes soon); ``release()`` revokes it at once, for
    an agent that knows the conversation is over. Renewals go over one KeepAlive stream
    shared by every keeper of the same client.
    """

    def __init__(self, client: KvbatonClient, conversation_id: str, *, interval_s: float | None = None,
                 ttl_ms: int = 0) -> None:
        self.client = client
        self.conversation_id = conversation_id
        self.ttl_ms = ttl_ms
        self.interval_s = interval_s
        self.last: lease_pb2.RenewResult | None = None
        self.renewals = 0
        self.failures = 0
        self._task: asyncio.Task | None = None
        self._stopped = asyncio.Event()

    async def __aenter__(self) -> "LeaseKeeper":
        first = await self.renew_once()
        if first.status == lease_pb2.RENEW_STATUS_OK and self.interval_s is None:
            # A third of the TTL: two renewals can be lost before the lease is at risk.
            self.interval_s = max(first.lease.ttl_ms / 3000, 0.05)
        self.interval_s = self.interval_s or 1.0
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"lease-keeper-{self.conversation_id}")
        return self

    async def renew_once(self) -> lease_pb2.RenewResult:
        req = lease_pb2.RenewRequest(conversation_id=self.conversation_id, ttl_ms=self.ttl_ms)
        result = await self.client.call(self.client.lease.Renew, req)
        self.last = result
        if result.status == lease_pb2.RENEW_STATUS_OK:
            self.renewals += 1
        else:
            self.failures += 1
        return result

    async def _run(self) -> None:
        while not self._stopped.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), self.interval_s)
                return
            try:
                result = await self.renew_once()
                if result.status in (lease_pb2.RENEW_STATUS_ENDED, lease_pb2.RENEW_STATUS_SUPERSEDED):
                    # A newer turn's lease replaces this one; keep renewing whatever is current.
                    if result.status == lease_pb2.RENEW_STATUS_ENDED:
                        log.info("lease_keeper.ended", conversation_id=self.conversation_id, error=result.error)
            except grpc.aio.AioRpcError as exc:
                self.failures += 1
                log.warning("lease_keeper.renew_failed", conversation_id=self.conversation_id, code=exc.code().name)

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
        self.registered = None  # the EngineRank as the registrar holds it
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
            try:
                await self.client.call(self.client.registrar.RefreshEngine, registrar_pb2.RefreshEngineRequest(
                    engine_id=self.rank.engine_id, tp_rank=self.rank.tp_rank, incarnation=self.registered.incarnation))
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
