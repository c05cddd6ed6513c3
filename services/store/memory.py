"""The in-memory store: the embedded default (one process, no setup).

It keeps etcd's semantics (revisions, compare-and-swap transactions, TTL leases,
resumable prefix watches) so that the domain modules run unchanged on either
backend. Everything happens on the event loop, so every operation is atomic by
construction. A bounded history of recent events lets a watch resume from a past
revision, as an etcd watch does, until that revision falls out of the window.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence

import structlog

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
    Store,
    StoreError,
    TxnResult,
    Watch,
    WatchEvent,
)

log = structlog.get_logger(__name__)

_HISTORY = 100_000
# History kept for resuming watches, bounded in bytes (keys and values, previous values
# included), not only in events: 150 re-registrations of a 4 MiB engine must not hold
# 600 MiB. A watch from before the window gets CompactedError, as from etcd.
HISTORY_BYTES = 64 * 1024 * 1024
_WATCH_QUEUE = 1_000_000
# Events one watch may hold undelivered; past it the watch ends with StoreError and its
# owner re-watches from its last revision (the hub does; a gRPC stream ends UNAVAILABLE).
WATCH_BYTES = 64 * 1024 * 1024


def _event_bytes(ev: WatchEvent) -> int:
    return 64 + len(ev.kv.key) + len(ev.kv.value) + (len(ev.prev_kv.value) if ev.prev_kv is not None else 0)


class _MemoryWatch(Watch):
    def __init__(self, store: MemoryStore, prefix: bytes, start_revision: int = 0,
                 deliver: Callable[[list[WatchEvent]], None] | None = None) -> None:
        self._store = store
        self._prefix = prefix
        # A watch from a future revision must not see the revisions before it (etcd).
        self._min_rev = start_revision
        self._queue: asyncio.Queue[tuple[list[WatchEvent], int] | None] = asyncio.Queue(_WATCH_QUEUE)
        self._closed = False
        self._bytes = 0
        self._overflowed = False
        # ``MemoryStore.watch_sync``: events go to this callback inside the write, not
        # through the queue (which then only carries the watch's end).
        self._deliver = deliver
        self._failed: BaseException | None = None

    def matches(self, key: bytes) -> bool:
        return key.startswith(self._prefix)

    def push(self, events: list[WatchEvent]) -> None:
        if self._closed or self._overflowed:
            return
        if len(events) == 1:
            # Most writes are one key, offered to every watch of the store (a server has
            # several): decided without building a list for the watches it is not for.
            e = events[0]
            if not e.kv.key.startswith(self._prefix) or e.revision < self._min_rev:
                return
            mine = [e]
        else:
            mine = [e for e in events if e.kv.key.startswith(self._prefix) and e.revision >= self._min_rev]
            if not mine:
                return
        if self._deliver is not None:
            try:
                self._deliver(mine)
            except Exception as exc:  # the write is committed: never fail the writer
                # Its owner's bug must not turn a committed write into an error for the
                # writer (who would retry it): the watch ends instead, with this error,
                # and its owner re-watches from the last revision it applied.
                log.exception("store.watch_callback_failed", prefix=self._prefix)
                self._failed = exc
                self._closed = True
                self._store._watches.discard(self)
                self._queue.put_nowait(None)
            return
        size = sum(_event_bytes(e) for e in mine)
        if (self._bytes and self._bytes + size > self._store.watch_bytes) or self._queue.full():
            # Its reader fell behind: drop what it holds and end it (it re-watches).
            self._overflowed = True
            while not self._queue.empty():
                self._queue.get_nowait()
            self._bytes = 0
            self._store._watches.discard(self)
            self._queue.put_nowait(None)
            return
        self._bytes += size
        self._queue.put_nowait((mine, size))

    async def _iter(self) -> AsyncIterator[list[WatchEvent]]:
        queue = self._queue
        while True:
            item = await queue.get()
            if item is None:
                if self._failed is not None:
                    raise StoreError(f"watch of {self._prefix!r}: its callback failed: {self._failed!r}")
                if self._overflowed:
                    raise StoreError(f"watch of {self._prefix!r} fell behind by over {self._store.watch_bytes} bytes; "
                                     "re-watch from the last revision")
                return
            self._bytes -= item[1]
            batch = item[0]
            # Writes queued since the reader last ran go out as one batch, in revision
            # order (as etcd sends several revisions in one response): one pass of the
            # reader's loop for them rather than one each.
            if not queue.empty():
                batch = list(batch)
                while not queue.empty():
                    nxt = queue.get_nowait()
                    if nxt is None:
                        queue.put_nowait(None)  # the end comes after this batch
                        break
                    self._bytes -= nxt[1]
                    batch.extend(nxt[0])
            yield batch

    def __aiter__(self) -> AsyncIterator[list[WatchEvent]]:
        return self._iter()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._store._watches.discard(self)
            self._queue.put_nowait(None)


#: A gap this long between two looks at the leases (the reaper looks every 50 ms while any
#: lease lives) means the process did not run: see ``MemoryStore._expire_leases``.
STALL_AFTER_S = 1.0


class MemoryStore(Store):
    """A single-process store with etcd's semantics."""

    def __init__(self, *, clock=time.monotonic, history_bytes: int = HISTORY_BYTES, watch_bytes: int = WATCH_BYTES,
                 stall_after_s: float | None = None) -> None:
        self._clock = clock
        # Stall compensation is measured on the store's own clock: on by default with the
        # real one; a test's injected clock jumps on purpose, so it must ask for it.
        self._stall_after_s = stall_after_s if stall_after_s is not None else (
            STALL_AFTER_S if clock is time.monotonic else float("inf"))
        self._last_look = clock()
        #: Seconds of stalls added to lease deadlines so far (tests read it; each stall is logged).
        self.stalled_s = 0.0
        self.incarnation = "mem-" + secrets.token_hex(8)
        self.history_bytes = history_bytes
        self.watch_bytes = watch_bytes
        self._history_size = 0
        # Newest revision dropped from the history (a watch from at or before it is compacted).
        self._compacted = 0
        self._data: dict[bytes, KeyValue] = {}
        self._keys: list[bytes] = []  # sorted, for prefix ranges
        self._revision = 1
        self._leases: dict[int, tuple[float, float]] = {}  # id -> (ttl_s, deadline)
        # No lease ends before this (a lower bound: renewals only move deadlines later), so
        # most operations skip the scan of every lease.
        self._earliest_deadline = float("inf")
        self._lease_keys: dict[int, set[bytes]] = collections.defaultdict(set)
        self._lease_ids = itertools.count(0x1000)
        self._history: collections.deque[WatchEvent] = collections.deque()
        self._watches: set[_MemoryWatch] = set()
        self._reaper: asyncio.Task | None = None
        self._closed = False

    # -- reads -------------------------------------------------------------
    async def get(self, key: bytes) -> KeyValue | None:
        self._expire_leases()
        return self._data.get(key)

    async def range(self, prefix: bytes, *, limit: int = 0) -> tuple[list[KeyValue], int]:
        self._expire_leases()
        lo = bisect.bisect_left(self._keys, prefix)
        out: list[KeyValue] = []
        for key in itertools.islice(self._keys, lo, None):
            if not key.startswith(prefix):
                break
            out.append(self._data[key])
            if limit and len(out) >= limit:
                break
        return out, self._revision

    async def current_revision(self) -> int:
        return self._revision

    # -- writes ------------------------------------------------------------
    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        result = await self.txn((), (Put(key, value, lease),))
        return result.revision

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        self._expire_leases()
        victims = self._prefixed(key) if prefix else ([key] if key in self._data else [])
        if victims:
            self._apply([Delete(k) for k in victims])
        return len(victims)

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        self._expire_leases()
        # Plain loops, no generator per call: a rendezvous match is two of these.
        ok = True
        for c in compares:
            if not self._holds(c):
                ok = False
                break
        ops = success if ok else failure
        expanded: list[Op] = []
        gets: list[bytes] = []
        for op in ops:  # every lease is checked before anything is written
            if isinstance(op, Put):
                if op.lease and op.lease not in self._leases:
                    raise LeaseNotFoundError(f"lease {op.lease:#x} not found")
                expanded.append(op)
            elif isinstance(op, Get):
                gets.append(op.key)
            elif isinstance(op, Delete) and op.prefix:
                expanded.extend(Delete(k) for k in self._prefixed(op.key))
            else:
                expanded.append(op)
        if expanded:
            self._apply(expanded)
        data = self._data
        return TxnResult(ok, self._revision, tuple([data.get(k) for k in gets]) if gets else ())

    def _prefixed(self, prefix: bytes) -> list[bytes]:
        lo = bisect.bisect_left(self._keys, prefix)
        return list(itertools.takewhile(lambda k: k.startswith(prefix), itertools.islice(self._keys, lo, None)))

    def _holds(self, c: Compare) -> bool:
        kv = self._data.get(c.key)
        if c.target is CompareTarget.VALUE:
            if kv is None:
                # etcd: a value compare on a missing key always fails, whatever the op
                # (there is no way to tell a missing value from an empty one).
                return False
            actual: int | bytes = kv.value
        elif c.target is CompareTarget.MOD_REVISION:
            actual = kv.mod_revision if kv else 0
        elif c.target is CompareTarget.CREATE_REVISION:
            actual = kv.create_revision if kv else 0
        else:
            actual = kv.version if kv else 0
        if c.op is CompareOp.EQUAL:
            return actual == c.operand
        if c.op is CompareOp.NOT_EQUAL:
            return actual != c.operand
        if c.op is CompareOp.GREATER:
            return actual > c.operand  # type: ignore[operator]
        return actual < c.operand  # type: ignore[operator]

    def _apply(self, ops: Sequence[Op]) -> None:
        """Applies ops at one new revision and notifies watchers.

        As in etcd, the revision only moves if something changed: deleting missing keys
        writes nothing.
        """
        rev = self._revision + 1
        events: list[WatchEvent] = []
        for op in ops:
            prev = self._data.get(op.key)
            if isinstance(op, Put):
                # (key, value, create_revision, mod_revision, version, lease)
                kv = KeyValue(op.key, op.value, prev.create_revision if prev else rev, rev,
                              (prev.version + 1) if prev else 1, op.lease)
                if prev is None:
                    bisect.insort(self._keys, op.key)
                elif prev.lease and prev.lease != op.lease:
                    self._lease_keys[prev.lease].discard(op.key)
                if op.lease:
                    self._lease_keys[op.lease].add(op.key)
                self._data[op.key] = kv
                events.append(WatchEvent(EventType.PUT, kv, prev))
            else:
                if prev is None:
                    continue
                del self._data[op.key]
                self._keys.pop(bisect.bisect_left(self._keys, op.key))
                if prev.lease:
                    self._lease_keys[prev.lease].discard(op.key)
                tomb = KeyValue(op.key, b"", 0, rev, 0, 0)
                events.append(WatchEvent(EventType.DELETE, tomb, prev))
        if events:
            self._revision = rev
            for ev in events:
                if len(self._history) == _HISTORY:
                    self._forget_oldest()
                self._history.append(ev)
                self._history_size += _event_bytes(ev)
            while self._history_size > self.history_bytes and len(self._history) > 1:
                self._forget_oldest()
            if len(events) == 1:
                # Most writes are one key: a watch not under its prefix is skipped here,
                # without a call (a server holds several watches, one per hub and election).
                key = events[0].kv.key
                for w in [w for w in self._watches if key.startswith(w._prefix)]:
                    w.push(events)
            else:
                for w in list(self._watches):
                    w.push(events)

    def _forget_oldest(self) -> None:
        old = self._history.popleft()
        self._history_size -= _event_bytes(old)
        self._compacted = max(self._compacted, old.revision)

    # -- leases ------------------------------------------------------------
    async def grant_lease(self, ttl_s: float) -> int:
        if not self._leases:  # the reaper was idle: the time since its last look was no stall
            self._last_look = self._clock()
        lease_id = next(self._lease_ids)
        deadline = self._clock() + ttl_s
        self._leases[lease_id] = (ttl_s, deadline)
        self._earliest_deadline = min(self._earliest_deadline, deadline)
        self._ensure_reaper()
        return lease_id

    async def keepalive(self, lease_id: int) -> float:
        self._expire_leases()
        entry = self._leases.get(lease_id)
        if entry is None:
            raise LeaseNotFoundError(f"lease {lease_id:#x} not found")
        ttl = entry[0]
        self._leases[lease_id] = (ttl, self._clock() + ttl)
        return ttl

    async def revoke_lease(self, lease_id: int) -> None:
        if self._leases.pop(lease_id, None) is not None:
            self._drop_lease_keys(lease_id)

    def _drop_lease_keys(self, lease_id: int) -> None:
        keys = sorted(self._lease_keys.pop(lease_id, ()))
        if keys:
            self._apply([Delete(k) for k in keys])

    def _expire_leases(self) -> None:
        """End every lease past its deadline. After a stall of this process (no look at
        the leases for ``stall_after_s``: starved of CPU, or its loop blocked), every
        deadline first moves later by the stall: the holders' keepalives could not be
        served meanwhile (they are queued, to be answered next), and ending every lease at
        once on resuming would unregister a healthy fleet (seen: a 9.6 s stall lapsed all
        four engines' registrations and a router answered 503). etcd does the same when a
        new leader takes over its leases. A holder that is really gone ends one stall late."""
        if not self._leases:
            return
        now = self._clock()
        gap, self._last_look = now - self._last_look, now
        if gap >= self._stall_after_s:
            self.stalled_s += gap
            self._leases = {lid: (ttl, deadline + gap) for lid, (ttl, deadline) in self._leases.items()}
            self._earliest_deadline += gap
            log.warning("store.stall_compensated", stalled_s=round(gap, 3), leases=len(self._leases),
                        why="no look at the leases meanwhile (the process stalled): deadlines moved as much later")
        if now < self._earliest_deadline:
            return
        dead = [lid for lid, (_, deadline) in self._leases.items() if deadline <= now]
        for lid in dead:
            del self._leases[lid]
            self._drop_lease_keys(lid)
        self._earliest_deadline = min((deadline for _, deadline in self._leases.values()), default=float("inf"))

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="memory-store-reaper")

    async def _reap(self) -> None:
        # Leases must end (and their keys' DELETE events fire) even if nobody reads.
        while not self._closed and self._leases:
            await asyncio.sleep(0.05)
            self._expire_leases()

    # -- watches -----------------------------------------------------------
    async def watch(self, prefix: bytes, *, start_revision: int = 0, prev_kv: bool = False) -> Watch:
        return self._watch(prefix, start_revision, None)

    async def watch_sync(self, prefix: bytes, deliver: Callable[[list[WatchEvent]], None], *,
                         start_revision: int = 0, prev_kv: bool = False) -> Watch:
        """A watch whose events are handed to ``deliver`` inside the write that makes them
        (in revision order, as every write happens on the loop one at a time), instead of
        being queued for a reader task: no queue, no task wake-up and no loop turn per write
        (a rendezvous match is two writes; at 500 matches/s those turns were a measurable
        share of the server's CPU per match). History from ``start_revision`` is delivered
        before this returns. ``deliver`` must not write to the store and should not raise:
        if it does, the write still stands, and the watch ends with ``StoreError`` for its
        owner to re-watch from the last revision it applied. Iterating the returned watch
        yields nothing; it ends when the watch does (``close()``, or that error). Only this
        backend has it (``PrefixHub(sync=True)`` falls back to ``watch`` elsewhere)."""
        return self._watch(prefix, start_revision, deliver)

    def _watch(self, prefix: bytes, start_revision: int,
               deliver: Callable[[list[WatchEvent]], None] | None) -> _MemoryWatch:
        self._expire_leases()
        w = _MemoryWatch(self, prefix, start_revision, deliver)
        if start_revision:
            if start_revision <= self._compacted:
                # (A revision dropped whole; the window starts after it.)
                raise CompactedError(self._compacted + 1)
            past = [e for e in self._history if e.revision >= start_revision]
            if past:
                w.push(past)
        if not w._closed:  # (a callback that failed on the history ended it already)
            self._watches.add(w)
        return w

    async def close(self) -> None:
        self._closed = True
        for w in list(self._watches):
            await w.close()
        if self._reaper is not None:
            self._reaper.cancel()
