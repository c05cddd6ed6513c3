"""The etcd backend: the ``Store`` contract over etcd's v3 gRPC API (asyncio, grpc.aio).

Why a hand-written client: the PyPI ``etcd3`` package is sync-only and does not work with
protobuf 7, so we generate stubs from ``proto/kvbaton/etcd/rpc.proto`` (the subset of
etcd's API we use, with upstream field numbers) and speak the wire protocol directly.

Behaviour that matters to callers:

- **Failover.** The client holds one channel per endpoint and sends to a *current* one.
  On UNAVAILABLE / DEADLINE_EXCEEDED it moves to the next endpoint and, with jittered
  backoff, retries until the operation's deadline (``timeout_s``) is spent; then it raises
  ``StoreError``. Every attempt has its own deadline (``attempt_timeout_s``).
- **Mutations are retried only when they cannot have been applied** (the connection was
  never made, or etcd answered "no leader" before proposing). A Put/Delete/Txn that fails
  after it may have reached the server raises ``StoreError`` ("outcome unknown"), because
  blindly re-sending a compare-and-swap could apply it twice or report a false failure.
  Reads, lease grants/revokes and keepalives are always retried.
- **Require leader.** Every call carries etcd's ``hasleader`` metadata, so a member cut off
  from its cluster refuses requests and cancels streams instead of serving stale data; the
  client then fails over.
- **Keepalive** uses ONE persistent ``LeaseKeepAlive`` stream per client, shared by every
  lease; responses are matched to callers by lease id in FIFO order (etcd answers each
  request once, in order). The stream is re-opened (on the next endpoint) when it breaks.
- **Watch** uses one ``Watch`` stream per watch. It remembers the next revision it owes the
  caller and, after a disconnect, re-creates the watch from there on the next endpoint, so
  nothing is lost and nothing is delivered twice. Compaction raises ``CompactedError``.
- **Server limits.** etcd 3.4 rejects a txn with more than ``--max-txn-ops`` (default 128)
  compares or ops per branch, and any request over ``--max-request-bytes`` (default 1.5 MiB).
  Both surface as ``StoreError`` with a hint; the test clusters run with
  ``--max-txn-ops 10000``. A prefix delete counts as one op.
- **Leases.** etcd rounds TTLs up to whole seconds and enforces a minimum TTL of
  1.5 x election timeout (1 s with ``--election-timeout 500``, 2 s with defaults). The
  leader checks for expiry every 500 ms, so keys vanish up to ~0.5 s after the TTL. On
  leader change etcd extends every lease (never expires one early).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
import structlog

from kvbaton.etcd import rpc_pb2 as pb
from kvbaton.etcd import rpc_pb2_grpc as pb_grpc

from .base import (
    CompactedError,
    Compare,
    CompareOp,
    CompareTarget,
    Delete,
    EventType,
    Get,
    KeyValue,
    LeaseNotFoundError,
    Op,
    Put,
    RequestTooLargeError,
    Store,
    StoreError,
    TxnResult,
    Watch,
    WatchEvent,
    prefix_end,
)

# What a stream call's read() returns at its end (missing from grpc-stubs 1.53's grpc.aio).
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]
log = structlog.get_logger(__name__)

# etcd's rpctypes.MetadataRequireLeaderKey: refuse (and cancel streams) without a leader.
_METADATA = (("hasleader", "true"),)
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# Failures that prove the request was not applied: no connection was ever made, or
# etcd refused it before proposing it to raft.
_NOT_APPLIED_HINTS = (
    "failed to connect",
    "connection refused",
    "connections to all backends failing",
    "dns resolution failed",
    "no leader",
    "not yet ready",
    "too many requests",
)
_CHANNEL_OPTIONS = [
    # Responses (ranges, watch catch-up batches) can exceed gRPC's 4 MiB default.
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.max_send_message_length", 2**31 - 1),
    # A restarted member must be found again quickly (gRPC's default backoff reaches 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # Detect a half-open connection (partition) on long-lived streams. etcd's server
    # enforces --grpc-keepalive-min-time (5 s) and forbids pings without active calls.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
]

_COMPARE_TARGET = {
    CompareTarget.VALUE: pb.Compare.VALUE,
    CompareTarget.MOD_REVISION: pb.Compare.MOD,
    CompareTarget.CREATE_REVISION: pb.Compare.CREATE,
    CompareTarget.VERSION: pb.Compare.VERSION,
}
_COMPARE_FIELD = {
    CompareTarget.VALUE: "value",
    CompareTarget.MOD_REVISION: "mod_revision",
    CompareTarget.CREATE_REVISION: "create_revision",
    CompareTarget.VERSION: "version",
}
_COMPARE_RESULT = {
    CompareOp.EQUAL: pb.Compare.EQUAL,
    CompareOp.NOT_EQUAL: pb.Compare.NOT_EQUAL,
    CompareOp.GREATER: pb.Compare.GREATER,
    CompareOp.LESS: pb.Compare.LESS,
}


def _key_range(prefix: bytes) -> tuple[bytes, bytes]:
    """(key, range_end) covering every key that starts with ``prefix``.

    etcd rejects an empty key; "every key" is spelled key=0x00, range_end=0x00.
    """
    if not prefix:
        return b"\x00", b"\x00"
    return prefix, prefix_end(prefix)


def _kv(m: pb.KeyValue) -> KeyValue:
    return KeyValue(
        key=m.key,
        value=m.value,
        create_revision=m.create_revision,
        mod_revision=m.mod_revision,
        version=m.version,
        lease=m.lease,
    )


def _not_applied(err: grpc.aio.AioRpcError) -> bool:
    details = (err.details() or "").lower()
    return err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED) and any(
        h in details for h in _NOT_APPLIED_HINTS
    )


def _map_error(method: str, target: str, err: grpc.aio.AioRpcError) -> StoreError:
    details = err.details() or ""
    lowered = details.lower()
    if "lease not found" in lowered:
        return LeaseNotFoundError(f"etcd {method}: {details}")
    if "too many operations in txn" in lowered:
        return StoreError(
            f"etcd {method}: {details} (etcd's --max-txn-ops, 128 by default, limits compares and "
            f"ops per branch; split the txn or raise the server limit)"
        )
    if "request is too large" in lowered or err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return StoreError(
            f"etcd {method}: {details} (etcd's --max-request-bytes is 1.5 MiB by default)"
        )
    return StoreError(f"etcd {method} on {target}: {err.code().name}: {details}")


def _backoff(round_: int) -> float:
    """Full-jitter exponential backoff: spreads many clients' retries after an outage."""
    return random.uniform(0.5, 1.0) * min(1.0, 0.05 * (2**round_))


@dataclasses.dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd (``etcds://``): the CA that signed etcd's certificate and, for etcd's
    ``--client-cert-auth``, the control plane's client certificate and key."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        read = lambda p: open(p, "rb").read() if p else None  # noqa: E731
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_file), private_key=read(self.key_file),
                                            certificate_chain=read(self.cert_file))


@dataclasses.dataclass(eq=False)
class _Endpoint:
    target: str
    channel: grpc.aio.Channel
    kv: pb_grpc.KVStub
    watch: pb_grpc.WatchStub
    lease: pb_grpc.LeaseStub
    maintenance: pb_grpc.MaintenanceStub

    @classmethod
    def open(cls, target: str, tls: EtcdTls | None = None) -> _Endpoint:
        if tls is not None:
            ch = grpc.aio.secure_channel(target, tls.credentials(), options=_CHANNEL_OPTIONS)
        else:
            ch = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        return cls(
            target, ch, pb_grpc.KVStub(ch), pb_grpc.WatchStub(ch), pb_grpc.LeaseStub(ch),
            pb_grpc.MaintenanceStub(ch),
        )


class _StreamBroken(Exception):
    """The shared keepalive stream ended; the caller retries on a fresh stream."""


class _KeepAliveStream:
    """One open LeaseKeepAlive stream and the callers waiting on it, per lease id (FIFO)."""

    def __init__(self, ep: _Endpoint) -> None:
        self.ep = ep
        self.call = ep.lease.LeaseKeepAlive(metadata=_METADATA)
        self.waiters: dict[int, collections.deque[asyncio.Future[int]]] = {}
        self.write_lock = asyncio.Lock()  # grpc.aio allows one write in flight per call
        self.broken = False
        self.reader = asyncio.get_running_loop().create_task(
            self._read(), name=f"etcd-keepalive-reader-{ep.target}"
        )

    async def _read(self) -> None:
        reason: str = "closed"
        try:
            while True:
                resp = await self.call.read()
                if resp is _EOF:
                    reason = "closed by server"
                    break
                queue = self.waiters.get(resp.ID)
                if not queue:
                    continue
                fut = queue.popleft()
                if not queue:
                    del self.waiters[resp.ID]
                if not fut.done():  # a caller that timed out still owns its place in line
                    fut.set_result(resp.TTL)
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name}: {e.details()}"
        except asyncio.CancelledError:
            reason = "cancelled"
        finally:
            self.fail(reason)

    def fail(self, reason: str) -> None:
        self.broken = True
        waiters, self.waiters = self.waiters, {}
        for queue in waiters.values():
            for fut in queue:
                if not fut.done():
                    fut.set_exception(_StreamBroken(reason))

    async def close(self) -> None:
        self.broken = True
        self.call.cancel()
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


class _EtcdWatch(Watch):
    """One etcd watch on its own stream, re-created from ``next_rev`` after a disconnect."""

    def __init__(self, store: EtcdStore, prefix: bytes, start_revision: int, prev_kv: bool) -> None:
        self._store = store
        self._prefix = prefix
        self._prev_kv = prev_kv
        # The first revision not yet handed to the caller (0: "from now", until created).
        self.next_rev = start_revision
        self._queue: asyncio.Queue[list[WatchEvent] | BaseException | None] = asyncio.Queue()
        self._call: Any = None
        self._ep: _Endpoint | None = None
        self._pump: asyncio.Task[None] | None = None
        self._closed = False
        self.compacted: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.reconnects = 0

    async def _create(self, deadline: float) -> None:
        """Opens a stream on the current endpoint and waits for etcd's ``created``."""
        loop = asyncio.get_running_loop()
        attempt = 0
        last = "no attempt"
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise StoreError(f"etcd watch {self._prefix!r}: could not (re)establish: {last}")
            ep = self._store._current
            call = ep.watch.Watch(metadata=_METADATA)
            key, end = _key_range(self._prefix)
            req = pb.WatchRequest(
                create_request=pb.WatchCreateRequest(
                    key=key, range_end=end, start_revision=self.next_rev, prev_kv=self._prev_kv
                )
            )
            try:
                t = min(remaining, self._store._attempt_timeout_s)
                await asyncio.wait_for(call.write(req), t)
                resp = await asyncio.wait_for(call.read(), t)
                if resp is _EOF or not resp.created:
                    raise StoreError(f"unexpected watch reply {resp!r}")
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError, StoreError) as e:
                call.cancel()
                last = f"{ep.target}: {e}"
                self._store._failover(ep, last)
                await asyncio.sleep(min(max(0.0, deadline - loop.time()), _backoff(attempt // len(self._store._endpoints))))
                attempt += 1
                continue
            if self.next_rev == 0:
                # "From now" is pinned on the first creation, so a reconnect resumes from it.
                self.next_rev = resp.header.revision + 1
            if resp.canceled:
                self._on_cancel(resp)
            self._call, self._ep = call, ep
            return

    def _on_cancel(self, resp: pb.WatchResponse) -> None:
        if resp.compact_revision:
            err = CompactedError(resp.compact_revision)
            if not self.compacted.done():
                self.compacted.set_result(resp.compact_revision)
            self._queue.put_nowait(err)
            self._closed = True
        else:
            raise StoreError(f"watch cancelled by etcd: {resp.cancel_reason or 'no reason'}")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await self._create(loop.time() + self._store._timeout_s)
        self._pump = loop.create_task(self._run(), name=f"etcd-watch-{self._prefix!r}")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._closed:
                try:
                    await self._drain()
                    if self._closed:
                        return
                    reason = "stream closed by server"
                except (grpc.aio.AioRpcError, StoreError) as e:
                    reason = str(e)
                if self._ep is not None:
                    self._store._failover(self._ep, reason)
                self._call.cancel()
                self.reconnects += 1
                log.info("etcd watch reconnecting", prefix=self._prefix, next_rev=self.next_rev, reason=reason)
                await self._create(loop.time() + self._store._watch_retry_s)
        except asyncio.CancelledError:
            raise
        except StoreError as e:
            self._queue.put_nowait(e)
        finally:
            if self._call is not None:
                self._call.cancel()

    async def _drain(self) -> None:
        """Delivers responses until the stream ends (returns) or fails (raises)."""
        while True:
            resp = await self._call.read()
            if resp is _EOF:
                return
            if resp.canceled:
                self._on_cancel(resp)
                return
            batch: list[WatchEvent] = []
            for ev in resp.events:
                kv = _kv(ev.kv)
                if kv.mod_revision < self.next_rev:
                    continue  # already delivered before a reconnect
                prev = _kv(ev.prev_kv) if ev.HasField("prev_kv") else None
                etype = EventType.PUT if ev.type == pb.Event.PUT else EventType.DELETE
                batch.append(WatchEvent(etype, kv, prev))
            if batch:
                # etcd never splits one revision's events across responses (no fragments).
                self.next_rev = batch[-1].kv.mod_revision + 1
                self._queue.put_nowait(batch)

    async def _iter(self) -> AsyncIterator[list[WatchEvent]]:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def __aiter__(self) -> AsyncIterator[list[WatchEvent]]:
        return self._iter()

    async def close(self) -> None:
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
        if self._call is not None:
            self._call.cancel()
        if not self._closed or self._queue.empty():
            self._queue.put_nowait(None)
        self._closed = True
        self._store._watches.discard(self)


class EtcdStore(Store):
    """``Store`` on an etcd v3 cluster (3.4+), with endpoint failover."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 10.0,
        attempt_timeout_s: float = 3.0,
        watch_retry_s: float = 60.0,
        tls: EtcdTls | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        targets = [e.split("://", 1)[-1].rstrip("/") for e in endpoints]
        self.tls = tls
        self._endpoints = [_Endpoint.open(t, tls) for t in targets]
        self._idx = 0
        self._timeout_s = timeout_s
        self._attempt_timeout_s = attempt_timeout_s
        self._watch_retry_s = watch_retry_s
        self._ka: _KeepAliveStream | None = None
        self._ka_open_lock = asyncio.Lock()
        self._watches: set[_EtcdWatch] = set()
        self._closed = False
        # txn_batched(): (keys written, nested request, success ops, failure ops, future) waiting
        # for the one batch in flight to come back.
        self._batch: list[tuple[frozenset[bytes], pb.TxnRequest, Sequence[Op], Sequence[Op], asyncio.Future]] = []
        self._batching = False

    @classmethod
    async def connect(
        cls,
        endpoints: Sequence[str],
        *,
        timeout_s: float = 10.0,
        attempt_timeout_s: float = 3.0,
        watch_retry_s: float = 60.0,
        tls: EtcdTls | None = None,
    ) -> EtcdStore:
        """Opens channels and returns once one endpoint answers ``Status`` with a leader.

        ``timeout_s`` bounds every operation including its failover retries;
        ``attempt_timeout_s`` bounds each single RPC; ``watch_retry_s`` is how long a
        watch keeps trying to re-establish itself before it raises ``StoreError``.
        """
        store = cls(endpoints, timeout_s=timeout_s, attempt_timeout_s=attempt_timeout_s, watch_retry_s=watch_retry_s,
                    tls=tls)
        try:
            status = await store.status()
        except BaseException:
            await store.close()
            raise
        # One etcd cluster keeps one revision history across its members and restarts.
        store.incarnation = f"etcd-{status.header.cluster_id:x}" if status.header.cluster_id else ""
        return store

    # -- plumbing -------------------------------------------------------------
    @property
    def _current(self) -> _Endpoint:
        return self._endpoints[self._idx]

    @property
    def current_endpoint(self) -> str:
        """The ``host:port`` requests go to now (tests kill exactly that member)."""
        return self._current.target

    def _failover(self, ep: _Endpoint, reason: str) -> None:
        """Moves to the next endpoint unless another caller already moved off ``ep``."""
        if self._current is ep and len(self._endpoints) > 1:
            self._idx = (self._idx + 1) % len(self._endpoints)
            log.info("etcd failover", from_=ep.target, to=self._current.target, reason=reason)

    async def _unary(self, service: str, method: str, request: Any, *, mutation: bool) -> Any:
        if self._closed:
            raise StoreError("etcd store is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        attempt = 0
        last = "no attempt"
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise StoreError(f"etcd {method}: gave up after {self._timeout_s}s: {last}")
            ep = self._current
            fn = getattr(getattr(ep, service), method)
            try:
                return await fn(request, timeout=min(remaining, self._attempt_timeout_s), metadata=_METADATA)
            except grpc.aio.AioRpcError as e:
                if e.code() not in _RETRYABLE:
                    raise _map_error(method, ep.target, e) from None
                last = f"{ep.target}: {e.code().name}: {e.details()}"
                self._failover(ep, last)
                if mutation and not _not_applied(e):
                    raise StoreError(
                        f"etcd {method}: outcome unknown (the request may have been applied): {last}"
                    ) from None
            attempt += 1
            # No pause while other endpoints are untried; back off per full round.
            rounds = attempt // len(self._endpoints)
            await asyncio.sleep(min(max(0.0, deadline - loop.time()), _backoff(rounds) if rounds else 0.01))

    async def status(self) -> pb.StatusResponse:
        """etcd's Maintenance.Status of the current endpoint, requiring a known leader."""
        resp = await self._unary("maintenance", "Status", pb.StatusRequest(), mutation=False)
        return resp

    # -- reads ----------------------------------------------------------------
    async def get(self, key: bytes) -> KeyValue | None:
        resp = await self._unary("kv", "Range", pb.RangeRequest(key=key), mutation=False)
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def range(self, prefix: bytes, *, limit: int = 0) -> tuple[list[KeyValue], int]:
        key, end = _key_range(prefix)
        resp = await self._unary("kv", "Range", pb.RangeRequest(key=key, range_end=end, limit=limit), mutation=False)
        return [_kv(m) for m in resp.kvs], resp.header.revision

    async def current_revision(self) -> int:
        resp = await self._unary(
            "kv", "Range", pb.RangeRequest(key=b"\x00__revision_probe__", count_only=True), mutation=False
        )
        return resp.header.revision

    # -- writes ---------------------------------------------------------------
    # etcd's --max-request-bytes default; a cluster started with a larger one may raise it.
    max_request_bytes = 1_572_864

    def _check_size(self, method: str, req) -> None:
        size = req.ByteSize()
        if self.max_request_bytes and size > self.max_request_bytes:
            raise RequestTooLargeError(
                f"etcd {method} of {size} bytes is over etcd's request limit of {self.max_request_bytes} bytes "
                "(--max-request-bytes, 1.5 MiB by default)")

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        req = pb.PutRequest(key=key, value=value, lease=lease)
        self._check_size("Put", req)
        resp = await self._unary("kv", "Put", req, mutation=True)
        return resp.header.revision

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        k, end = _key_range(key) if prefix else (key, b"")
        resp = await self._unary("kv", "DeleteRange", pb.DeleteRangeRequest(key=k, range_end=end), mutation=True)
        return resp.deleted

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        req = pb.TxnRequest(
            compare=[self._compare(c) for c in compares],
            success=[self._op(o) for o in success],
            failure=[self._op(o) for o in failure],
        )
        self._check_size("Txn", req)
        resp = await self._unary("kv", "Txn", req, mutation=True)
        return self._txn_result(resp.succeeded, resp.header.revision, resp.responses, success, failure)

    @staticmethod
    def _txn_result(succeeded: bool, revision: int, responses, success: Sequence[Op], failure: Sequence[Op]) -> TxnResult:
        ran = success if succeeded else failure
        if not any(isinstance(o, Get) for o in ran):
            return TxnResult(succeeded, revision)
        values = tuple(
            (_kv(r.response_range.kvs[0]) if r.response_range.kvs else None)
            for o, r in zip(ran, responses) if isinstance(o, Get))
        return TxnResult(succeeded, revision, values)

    # Nested transactions per batch: each counts its ops against etcd's --max-txn-ops
    # (default 128), and a rendezvous write has 2 (put; get on failure).
    MAX_BATCH = 32

    async def txn_batched(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """Writes queued while a batch is in flight go out together as nested transactions
        of one etcd Txn (one raft proposal): no added wait when idle, far fewer proposals
        under load. Writes to the same key never share a batch (etcd refuses that)."""
        req = pb.TxnRequest(
            compare=[self._compare(c) for c in compares],
            success=[self._op(o) for o in success],
            failure=[self._op(o) for o in failure],
        )
        self._check_size("Txn", req)
        keys = frozenset(o.key for o in (*success, *failure) if not isinstance(o, Get))
        fut = asyncio.get_running_loop().create_future()
        self._batch.append((keys, req, success, failure, fut))
        if not self._batching:
            self._batching = True
            asyncio.get_running_loop().create_task(self._send_batches(), name="etcd-txn-batch")
        return await fut

    async def _send_batches(self) -> None:
        taken: list = []
        try:
            while self._batch:
                taken = []
                rest: list = []
                keys: set[bytes] = set()
                size = 0
                for item in self._batch:
                    n = item[1].ByteSize() + 8
                    fits = not taken or not self.max_request_bytes or size + n <= self.max_request_bytes
                    if len(taken) < self.MAX_BATCH and fits and not (item[0] & keys) and not item[4].done():
                        taken.append(item)
                        keys |= item[0]
                        size += n
                    elif not item[4].done():
                        rest.append(item)
                self._batch = rest
                if not taken:
                    continue
                try:
                    if len(taken) == 1:
                        _, req, success, failure, fut = taken[0]
                        resp = await self._unary("kv", "Txn", req, mutation=True)
                        results = [self._txn_result(resp.succeeded, resp.header.revision, resp.responses, success, failure)]
                    else:
                        outer = pb.TxnRequest(success=[pb.RequestOp(request_txn=item[1]) for item in taken])
                        resp = await self._unary("kv", "Txn", outer, mutation=True)
                        rev = resp.header.revision
                        results = [
                            self._txn_result(r.response_txn.succeeded, rev, r.response_txn.responses, item[2], item[3])
                            for item, r in zip(taken, resp.responses)]
                except Exception as exc:  # noqa: BLE001 - every write of the batch shares its fate
                    for item in taken:
                        if not item[4].done():
                            item[4].set_exception(exc)
                    continue
                for item, result in zip(taken, results):
                    if not item[4].done():
                        item[4].set_result(result)
            taken = []
        finally:
            self._batching = False
            # Cancelled (the loop is closing) or closed: nobody may wait forever.
            for item in [*taken, *self._batch] if (taken or self._closed) else ():
                if not item[4].done():
                    item[4].set_exception(StoreError("etcd store is closed or the batch was cancelled"))

    async def compact(self, revision: int, *, physical: bool = True) -> None:
        """Drops history before ``revision`` (etcd-only; tests use it to provoke compaction)."""
        await self._unary("kv", "Compact", pb.CompactionRequest(revision=revision, physical=physical), mutation=False)

    @staticmethod
    def _compare(c: Compare) -> pb.Compare:
        operand = c.operand
        if c.target is CompareTarget.VALUE:
            if not isinstance(operand, bytes):
                raise TypeError(f"value compare needs bytes, got {operand!r}")
        elif not isinstance(operand, int):
            raise TypeError(f"{c.target.value} compare needs int, got {operand!r}")
        msg = pb.Compare(result=_COMPARE_RESULT[c.op], target=_COMPARE_TARGET[c.target], key=c.key)
        setattr(msg, _COMPARE_FIELD[c.target], operand)  # the oneof member for this target
        return msg

    @staticmethod
    def _op(op: Op) -> pb.RequestOp:
        if isinstance(op, Put):
            return pb.RequestOp(request_put=pb.PutRequest(key=op.key, value=op.value, lease=op.lease))
        if isinstance(op, Delete):
            k, end = _key_range(op.key) if op.prefix else (op.key, b"")
            return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=k, range_end=end))
        if isinstance(op, Get):
            return pb.RequestOp(request_range=pb.RangeRequest(key=op.key))
        raise TypeError(f"unknown txn op {op!r}")

    # -- leases ---------------------------------------------------------------
    async def grant_lease(self, ttl_s: float) -> int:
        ttl = max(1, math.ceil(ttl_s))
        # A retried grant may leave an orphan lease behind; it expires on its own.
        resp = await self._unary("lease", "LeaseGrant", pb.LeaseGrantRequest(TTL=ttl), mutation=False)
        if resp.error:
            raise StoreError(f"etcd LeaseGrant: {resp.error}")
        return resp.ID

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._unary("lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease_id), mutation=False)
        except LeaseNotFoundError:
            pass

    async def _keepalive_stream(self) -> _KeepAliveStream:
        async with self._ka_open_lock:
            if self._ka is None or self._ka.broken:
                if self._ka is not None:
                    await self._ka.close()
                self._ka = _KeepAliveStream(self._current)
            return self._ka

    async def keepalive(self, lease_id: int) -> float:
        if self._closed:
            raise StoreError("etcd store is closed")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        attempt = 0
        last = "no attempt"
        req = pb.LeaseKeepAliveRequest(ID=lease_id)
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise StoreError(f"etcd keepalive {lease_id:#x}: gave up after {self._timeout_s}s: {last}")
            stream = await self._keepalive_stream()
            fut: asyncio.Future[int] = loop.create_future()
            stream.waiters.setdefault(lease_id, collections.deque()).append(fut)
            t = min(remaining, self._attempt_timeout_s)
            try:
                async with stream.write_lock:
                    await asyncio.wait_for(stream.call.write(req), t)
                ttl = await asyncio.wait_for(fut, t)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError, _StreamBroken) as e:
                last = f"{stream.ep.target}: {type(e).__name__}: {e}"
                stream.fail(last)
                stream.call.cancel()
                self._failover(stream.ep, last)
                attempt += 1
                rounds = attempt // len(self._endpoints)
                await asyncio.sleep(min(max(0.0, deadline - loop.time()), _backoff(rounds) if rounds else 0.01))
                continue
            if ttl <= 0:
                raise LeaseNotFoundError(f"lease {lease_id:#x} not found")
            return float(ttl)

    # -- watches --------------------------------------------------------------
    async def watch(self, prefix: bytes, *, start_revision: int = 0, prev_kv: bool = False) -> Watch:
        if self._closed:
            raise StoreError("etcd store is closed")
        w = _EtcdWatch(self, prefix, start_revision, prev_kv)
        await w.start()
        self._watches.add(w)
        if start_revision:
            # MemoryStore raises CompactedError here; etcd reports it on the stream after
            # "created", so probe the revision and, if it is gone, wait for that report.
            try:
                await self._unary(
                    "kv", "Range",
                    # A key inside the watched prefix: with etcd auth, the watcher may read only there.
                    pb.RangeRequest(key=prefix + b"\x00__revision_probe__", revision=start_revision, count_only=True),
                    mutation=False,
                )
            except StoreError as e:
                if "compacted" in str(e):
                    try:
                        rev = await asyncio.wait_for(asyncio.shield(w.compacted), self._attempt_timeout_s)
                    except TimeoutError:
                        rev = 0
                    await w.close()
                    raise CompactedError(rev) from None
                if "future revision" not in str(e):
                    await w.close()
                    raise
        return w

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in list(self._watches):
            await w.close()
        if self._ka is not None:
            await self._ka.close()
        for ep in self._endpoints:
            await ep.channel.close(None)
