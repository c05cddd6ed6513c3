"""One deadline index for everything a service ends on its clock (leases, unmatched
transfer sides, matches nobody reported on).

Why an index: an expiry tick must cost what is due, not a scan of every live record
(100,000 leases at 20 Hz is most of a core). Why this shape: records change far more
often than they end (a lease is renewed many times, a transfer moves through phases), and
removing an entry from the middle of a heap is O(n). So every change *arms* a new entry
``(due_ms, key, version)`` and the old one is left in the heap, made stale by the newer
version; ``pop_due`` skips stale entries, and the heap is rebuilt from the current entries
whenever stale ones outnumber them (bounded memory: at most ``2 * live + slack`` entries).

``version`` is the record's store ``mod_revision``: it only grows, so an arm with an
older version than the one held (a late re-arm after a store error) is ignored.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

DEFAULT_SLACK = 4096
#: a tick that ends what fell due gives the event loop a turn after this many entries: on the
#: memory store nothing in ending one suspends, so a burst of thousands falling due together
#: would otherwise hold the loop (and every call waiting on it) for the whole burst
END_YIELD_EVERY = 128


class DeadlineIndex(Generic[K]):
    """A min-heap of deadlines with lazy deletion; the current entry of each key is kept
    beside it so stale heap entries can be recognised and the heap rebuilt."""

    def __init__(self, *, slack: int = DEFAULT_SLACK) -> None:
        self._heap: list[tuple[int, K, int]] = []
        self._current: dict[K, tuple[int, int]] = {}  # key -> (due_ms, version)
        self.slack = slack

    def __len__(self) -> int:
        """Keys with a live deadline."""
        return len(self._current)

    @property
    def heap_size(self) -> int:
        """Heap entries, stale ones included (what the bound is on)."""
        return len(self._heap)

    def due_of(self, key: K) -> int | None:
        entry = self._current.get(key)
        return entry[0] if entry is not None else None

    def arm(self, key: K, due_ms: int, version: int) -> bool:
        """Sets ``key``'s deadline (replacing any earlier one of an older or equal
        version). Returns False, changing nothing, if a newer version is already held."""
        held = self._current.get(key)
        if held is not None and held[1] > version:
            return False
        if held == (due_ms, version):
            return True  # already armed exactly so: no duplicate entry
        self._current[key] = (due_ms, version)
        heapq.heappush(self._heap, (due_ms, key, version))
        if len(self._heap) > 2 * len(self._current) + self.slack:
            self._rebuild()
        return True

    def drop(self, key: K, version: int | None = None) -> None:
        """Forgets ``key``'s deadline (its record ended or left the cache); with
        ``version``, only if no newer version is held."""
        held = self._current.get(key)
        if held is not None and (version is None or held[1] <= version):
            del self._current[key]
            if len(self._heap) > 2 * len(self._current) + self.slack:
                self._rebuild()

    def clear(self) -> None:
        self._heap.clear()
        self._current.clear()

    def next_due(self) -> int | None:
        """The earliest current deadline (stale heap tops are discarded on the way)."""
        self._skip_stale()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_ms: int) -> Iterator[tuple[K, int]]:
        """Pops every current entry due at ``now_ms`` (``due <= now``), earliest first, as
        ``(key, version)``. A popped key has no deadline until it is armed again: the
        caller re-arms what it finds not yet ready to end, or what it failed to end."""
        heap, current = self._heap, self._current
        while heap and heap[0][0] <= now_ms:
            due, key, version = heapq.heappop(heap)
            if current.get(key) != (due, version):
                continue  # stale: changed or dropped since
            del current[key]
            yield key, version

    def _skip_stale(self) -> None:
        heap, current = self._heap, self._current
        while heap and current.get(heap[0][1]) != (heap[0][0], heap[0][2]):
            heapq.heappop(heap)

    def _rebuild(self) -> None:
        self._heap = [(due, key, version) for key, (due, version) in self._current.items()]
        heapq.heapify(self._heap)
