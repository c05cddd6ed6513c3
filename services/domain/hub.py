"""A replica's view of one key prefix: a cache fed by a single store watch, fanned out
to any number of subscribers.

Each service keeps one ``PrefixHub`` per prefix it serves. Parsing and routing an event
happens once per replica, not once per subscriber, which is what lets one replica feed
hundreds of streams. A subscriber that reconnects with ``after_revision`` first gets the
history it missed (replayed from the store, which both backends keep for a while), then
joins the live feed with no gap and no duplicate.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator, Callable, Container, Hashable, Iterable, Sequence
from typing import Generic, TypeVar, cast

import structlog

from ..store.base import (
    CompactedError,
    Compare,
    EventType,
    KeyValue,
    Op,
    Store,
    StoreError,
    TxnResult,
    WatchEvent,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")  # parsed record type
E = TypeVar("E")  # derived event type

Route = Hashable
# Turns one store event (with the previous value) into (route, event) pairs.
Deriver = Callable[[WatchEvent], Iterable[tuple[Route, E]]]

_SUBSCRIBER_QUEUE = 100_000
# Events one subscriber may hold unsent, in bytes: a stream whose client stops reading
# is ended (it resumes from its last revision) instead of growing server memory.
SUBSCRIBER_BYTES = 8 * 1024 * 1024


class SubscriberOverflow(Exception):
    """A subscriber fell too far behind; it must reconnect with its last revision."""


def _size(event: object) -> int:
    size = getattr(event, "ByteSize", None)
    return size() if size is not None else 64


# Put in a subscriber's queue when it had nothing to deliver for its ``idle_s``: the
# stream sends a heartbeat then (``PrefixHub.subscribe(idle_s=...)``).
IDLE = object()


class _Subscriber(Generic[E]):
    def __init__(self, route: Route, max_bytes: int = SUBSCRIBER_BYTES) -> None:
        self.route = route
        self.queue: asyncio.Queue[tuple[int, E] | object | None] = asyncio.Queue(_SUBSCRIBER_QUEUE)
        self.overflowed = False
        self.bytes = 0
        self.max_bytes = max_bytes
        self.taken_count = 0  # items handed to the stream (what the idle timer compares)
        self._timer: asyncio.TimerHandle | None = None

    def watch_idle(self, idle_s: float, seen: int = -1) -> None:
        """Every ``idle_s``: an ``IDLE`` marker if nothing was taken since the last check.
        One timer per subscriber every few seconds, rather than a timeout per event (a task
        and a wait for each event of a busy stream)."""
        if seen == self.taken_count and self.queue.empty() and not self.overflowed:
            self.queue.put_nowait(IDLE)
        self._timer = asyncio.get_running_loop().call_later(idle_s, self.watch_idle, idle_s, self.taken_count)

    def stop_idle(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def offer(self, revision: int, event: E, size: int) -> None:
        if self.overflowed:
            return
        if self.bytes + size > self.max_bytes and self.bytes:
            self.overflowed = True
            self._wake()
            return
        try:
            self.queue.put_nowait((revision, event))
            self.bytes += size
        except asyncio.QueueFull:
            self.overflowed = True
            self._wake()

    def _wake(self) -> None:
        # What it holds is dropped now (it must resume anyway); the sentinel ends its stream.
        while not self.queue.empty():
            self.queue.get_nowait()
        self.bytes = 0
        self.queue.put_nowait(None)

    def taken(self, event: E) -> None:
        self.bytes = max(0, self.bytes - _size(event))


class PrefixHub(Generic[T, E]):
    """Cache + fan-out for the keys under ``prefix``.

    ``parse`` turns a value into a record; ``keep`` says which records the cache holds
    (e.g. only pending transfers); ``derive`` turns store events into routed events.
    """

    def __init__(
        self,
        store: Store,
        prefix: bytes,
        *,
        parse: Callable[[bytes], T],
        derive: Deriver,
        keep: Callable[[T], bool] = lambda _: True,
        name: str = "hub",
        sync: bool = False,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self._parse = parse
        self._derive = derive
        self._keep = keep
        self.name = name
        self.records: dict[bytes, tuple[T, int]] = {}  # key -> (record, mod_revision)
        self.revision = 0
        # Newest revision at which a key under the prefix changed (what replays run up to).
        self.last_event_revision = 0
        self._subs: dict[Route, set[_Subscriber[E]]] = {}
        self._task: asyncio.Task | None = None
        # wait_for() callers, by the revision they wait for: each applied batch wakes only
        # those it satisfies (a condition's notify_all would wake every waiter per batch,
        # quadratic when a KeepAlive batch commits 150 chunks at once).
        self._waiters: list[tuple[int, int, asyncio.Future]] = []
        self._waiter_seq = itertools.count()
        self._ready = asyncio.Event()
        self.listeners: list[Callable[[WatchEvent], None]] = []
        # Called after the cache was reloaded without events (a compacted watch): whatever
        # listeners derived from events must be rebuilt from ``records``.
        self.on_reload: list[Callable[[], None]] = []
        # Records a writer of this replica already holds parsed, by the exact value it
        # wrote: the event of that write is cached without parsing it again (a KeepAlive
        # batch writes thousands). The writer drops its entries if the write fails.
        self.preparsed: dict[bytes, T] = {}
        # The cached record a DELETE event just removed (None: it held none), for listeners
        # that index live records by something other than the key.
        self.removed: tuple[T, int] | None = None
        # On a store that can (the memory store's ``watch_sync``), apply each write's events
        # inside the write rather than in this hub's watch task: same order, no task wake-up
        # per write. Then the cache is never behind this process's own writes. Opt-in per hub
        # (its listeners must not write to the store; see ``MemoryStore.watch_sync``).
        self.sync = sync

    @property
    def routes(self) -> Container[Route]:
        """The routes that have a subscriber now (a deriver may skip building events for
        the others: the hub drops those anyway)."""
        return self._subs

    async def start(self) -> None:
        await self._load()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"{self.name}-watch")
        self._ready.set()

    async def stop(self) -> None:
        if self._task:
            from .background import cancel_all

            await cancel_all([self._task])
        for subs in self._subs.values():
            for s in subs:
                s.queue.put_nowait(None)

    async def _load(self) -> None:
        kvs, rev = await self.store.range(self.prefix)
        self.records = {}
        self.preparsed.clear()  # their events may never come (history gone): parse afresh
        for kv in kvs:
            self._cache(kv)
            self.last_event_revision = max(self.last_event_revision, kv.mod_revision)
        self.revision = rev

    def _cache(self, kv: KeyValue) -> None:
        rec = self.preparsed.pop(kv.value, None) if self.preparsed else None
        if rec is None:
            rec = self._parse(kv.value)
        if self._keep(rec):
            self.records[kv.key] = (rec, kv.mod_revision)
        else:
            self.records.pop(kv.key, None)

    def note_write(self, key: bytes, record: T, revision: int) -> None:
        """Write-through: a record this replica has just written at ``revision``, cached
        now rather than when the watch brings it back. The next message for the same key
        (the other side of a transfer, often a moment later) then finds it instead of
        losing a compare-and-swap on a stale cache (one more store round trip). Only
        ahead of the watch: what the watch has applied (``revision`` or later) is at least
        as new, and anything written after ``revision`` still comes through the watch,
        which overwrites this entry. ``record`` must not be changed afterwards."""
        if revision <= self.revision:
            return
        if self._keep(record):
            self.records[key] = (record, revision)
        else:
            self.records.pop(key, None)

    async def txn_preparsed(self, parsed: dict[bytes, T], compares: Sequence[Compare], success: Sequence[Op],
                            failure: Sequence[Op] = ()) -> TxnResult:
        """``store.txn`` for writes whose records this replica already holds parsed
        (``parsed``: written value -> record): offered in ``preparsed`` while the write is
        in flight, so its event is cached without a parse, and dropped again if the write
        fails or raises (no event will take them)."""
        self.preparsed.update(parsed)
        result: TxnResult | None = None
        try:
            result = await self.store.txn(compares, success, failure)
        finally:
            if result is None or not result.succeeded:
                for value in parsed:
                    self.preparsed.pop(value, None)
        return result

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                watch_sync = getattr(self.store, "watch_sync", None) if self.sync else None
                if watch_sync is not None:  # batches go to _apply inside each write: the loop below only waits
                    watch = await watch_sync(self.prefix, self._apply, start_revision=self.revision + 1, prev_kv=True)
                else:
                    watch = await self.store.watch(self.prefix, start_revision=self.revision + 1, prev_kv=True)
                try:
                    async for batch in watch:
                        self._apply(batch)
                        backoff = 0.05
                finally:
                    await watch.close()
            except asyncio.CancelledError:
                raise
            except CompactedError:
                log.warning("hub.compacted", hub=self.name, revision=self.revision)
                await self._resync()
            except (StoreError, OSError) as exc:
                log.warning("hub.watch_failed", hub=self.name, error=str(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _resync(self) -> None:
        """History is gone: reload the cache; subscribers must resync from a snapshot."""
        await self._load()
        for rebuild in self.on_reload:
            rebuild()
        self._wake_waiters()
        for subs in self._subs.values():
            for s in subs:
                if not s.overflowed:
                    s.overflowed = True
                    s._wake()

    def _apply(self, batch: list[WatchEvent]) -> None:
        for ev in batch:
            if ev.type is EventType.PUT:
                self._cache(ev.kv)
            else:
                self.removed = self.records.pop(ev.kv.key, None)
            for listener in self.listeners:
                listener(ev)
            if self._subs:
                for route, event in self._derive(ev):
                    subs = self._subs.get(route)
                    if subs:
                        size = _size(event)
                        for sub in subs:
                            sub.offer(ev.revision, event, size)
            if ev.revision > self.revision:
                self.revision = ev.revision
            self.last_event_revision = self.revision
        if self._waiters:
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= self.revision:
            fut = heapq.heappop(waiters)[2]
            if not fut.done():
                fut.set_result(None)

    async def wait_for(self, revision: int, timeout_s: float = 5.0) -> bool:
        """Waits until the cache has applied ``revision`` (read-your-writes)."""
        if self.revision >= revision:
            return True
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (revision, next(self._waiter_seq), fut))
        try:
            await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            return self.revision >= revision
        return True

    def subscribe(self, route: Route, after_revision: int = 0) -> AsyncIterator[tuple[int, E]]:
        """Events for ``route``: those after ``after_revision`` (if non-zero), then live ones."""
        return cast(AsyncIterator[tuple[int, E]], self._subscribe(route, after_revision, 0.0))

    def subscribe_idle(self, route: Route, after_revision: int, idle_s: float) -> AsyncIterator[tuple[int, E | None]]:
        """``subscribe``, plus ``(revision, None)`` whenever the stream stayed silent for
        ``idle_s`` (the caller sends a heartbeat then)."""
        return self._subscribe(route, after_revision, idle_s)

    async def _subscribe(self, route: Route, after_revision: int, idle_s: float) -> AsyncIterator[tuple[int, E | None]]:
        await self._ready.wait()
        sub: _Subscriber[E] = _Subscriber(route)
        self._subs.setdefault(route, set()).add(sub)
        joined_at = self.last_event_revision
        if idle_s > 0:
            sub.watch_idle(idle_s)
        try:
            if after_revision and after_revision < joined_at:
                async with asyncio.timeout(30):
                    replayed = [item async for item in self._replay(route, after_revision, joined_at)]
                for replayed_item in replayed:
                    yield replayed_item
            while True:
                # Drain whatever is queued in one go: under load a stream then pays one
                # wake-up per batch rather than per event.
                items = [await sub.queue.get()]
                while not sub.queue.empty() and len(items) < 256:
                    items.append(sub.queue.get_nowait())
                for item in items:
                    if item is None or sub.overflowed:
                        raise SubscriberOverflow(f"{self.name}: subscriber for {route!r} fell behind; resubscribe")
                    sub.taken_count += 1
                    if item is IDLE:
                        yield self.revision, None
                        continue
                    sub.taken(item[1])  # type: ignore[index]
                    if item[0] <= joined_at and after_revision:  # type: ignore[index]
                        continue  # already replayed
                    yield item  # type: ignore[misc]
        finally:
            sub.stop_idle()
            subs = self._subs.get(route)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[route]

    async def _replay(self, route: Route, after: int, until: int) -> AsyncIterator[tuple[int, E]]:
        watch = await self.store.watch(self.prefix, start_revision=after + 1, prev_kv=True)
        try:
            async for batch in watch:
                for ev in batch:
                    if ev.revision > until:
                        return
                    for r, event in self._derive(ev):
                        if r == route:
                            yield ev.revision, event
                if batch[-1].revision >= until:
                    return
        finally:
            await watch.close()
