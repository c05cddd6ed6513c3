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
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from typing import Generic, TypeVar

import structlog

from ..store.base import CompactedError, EventType, KeyValue, Store, StoreError, WatchEvent

log = structlog.get_logger(__name__)

T = TypeVar("T")  # parsed record type
E = TypeVar("E")  # derived event type

Route = Hashable
# Turns one store event (with the previous value) into (route, event) pairs.
Deriver = Callable[[WatchEvent], Iterable[tuple[Route, E]]]

_SUBSCRIBER_QUEUE = 100_000


class SubscriberOverflow(Exception):
    """A subscriber fell too far behind; it must reconnect with its last revision."""


class _Subscriber(Generic[E]):
    def __init__(self, route: Route) -> None:
        self.route = route
        self.queue: asyncio.Queue[tuple[int, E] | None] = asyncio.Queue(_SUBSCRIBER_QUEUE)
        self.overflowed = False

    def offer(self, revision: int, event: E) -> None:
        try:
            self.queue.put_nowait((revision, event))
        except asyncio.QueueFull:
            self.overflowed = True


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
        self._progress = asyncio.Condition()
        self._progress_waiters = 0  # wait_for() callers: no wake-up task per batch without them
        self._ready = asyncio.Event()
        self.listeners: list[Callable[[WatchEvent], None]] = []

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
        for kv in kvs:
            self._cache(kv)
            self.last_event_revision = max(self.last_event_revision, kv.mod_revision)
        self.revision = rev

    def _cache(self, kv: KeyValue) -> None:
        rec = self._parse(kv.value)
        if self._keep(rec):
            self.records[kv.key] = (rec, kv.mod_revision)
        else:
            self.records.pop(kv.key, None)

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
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
        for subs in self._subs.values():
            for s in subs:
                s.overflowed = True
                s.queue.put_nowait(None)

    def _apply(self, batch: list[WatchEvent]) -> None:
        for ev in batch:
            if ev.type is EventType.PUT:
                self._cache(ev.kv)
            else:
                self.records.pop(ev.kv.key, None)
            for listener in self.listeners:
                listener(ev)
            if self._subs:
                for route, event in self._derive(ev):
                    for sub in self._subs.get(route, ()):
                        sub.offer(ev.revision, event)
            self.revision = max(self.revision, ev.revision)
            self.last_event_revision = self.revision
        if self._progress_waiters:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    async def wait_for(self, revision: int, timeout_s: float = 5.0) -> bool:
        """Waits until the cache has applied ``revision`` (read-your-writes)."""
        if self.revision >= revision:
            return True
        self._progress_waiters += 1
        try:
            async with self._progress:
                try:
                    await asyncio.wait_for(self._progress.wait_for(lambda: self.revision >= revision), timeout_s)
                except TimeoutError:
                    return False
        finally:
            self._progress_waiters -= 1
        return True

    async def subscribe(self, route: Route, after_revision: int = 0) -> AsyncIterator[tuple[int, E]]:
        """Events for ``route``: those after ``after_revision`` (if non-zero), then live ones."""
        await self._ready.wait()
        sub: _Subscriber[E] = _Subscriber(route)
        self._subs.setdefault(route, set()).add(sub)
        joined_at = self.last_event_revision
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
                    if item[0] <= joined_at and after_revision:
                        continue  # already replayed
                    yield item
        finally:
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
