"""The memory store after a stall of its own process: leases are not all ended at once.

Why: in a fleet benchmark the control plane answered nothing for 9.6 s; on resuming, the
store ended every engine's liveness lease before the queued refreshes were served, all
four engines' registrations lapsed at once, and a router answered ``503 no prefill engine
available``. The holders had done nothing wrong: the server had not run. A stall (no look
at the leases for ``stall_after_s``; the reaper looks every 50 ms) moves every deadline
later by its length. The clock is injected; the reaper is kept from looking on its own by
making every step explicit (``_expire_leases`` runs on each read)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from kvbaton.services.store.memory import MemoryStore


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@contextlib.asynccontextmanager
async def _leased(clock: Clock, ttl_s: float, key: bytes, **kw: float) -> AsyncIterator[tuple[MemoryStore, int]]:
    """A store on ``clock`` holding ``key`` under a fresh lease of ``ttl_s``."""
    store = MemoryStore(clock=clock, **kw)
    try:
        lease = await store.grant_lease(ttl_s)
        await store.put(key, b"rank", lease=lease)
        yield store, lease
    finally:
        await store.close()


async def _run(store: MemoryStore, clock: Clock, seconds: float, key: bytes) -> None:
    """The process running normally for ``seconds``: a look every 0.25 s (no stall), the
    key alive throughout."""
    end = clock.t + seconds
    while clock.t < end - 1e-9:
        clock.t = min(end, clock.t + 0.25)
        assert await store.get(key) is not None, clock.t


async def test_a_stall_longer_than_the_ttl_does_not_end_a_lease_whose_holder_kept_it_alive() -> None:
    clock = Clock()
    async with _leased(clock, 10.0, b"kvb/e/p0", stall_after_s=1.0) as (store, lease):
        await _run(store, clock, 8.0, b"kvb/e/p0")
        await store.keepalive(lease)  # the holder's last refresh served before the stall: deadline 118
        clock.t += 12.0  # the process does not run for 12 s (past the deadline)
        assert await store.get(b"kvb/e/p0") is not None, "ended on resuming: the stall was charged to the holder"
        assert store.stalled_s == pytest.approx(12.0)
        await store.keepalive(lease)  # the queued refresh, served after the stall
        await _run(store, clock, 9.75, b"kvb/e/p0")


async def test_a_holder_that_is_really_gone_still_ends_one_stall_late() -> None:
    clock = Clock()
    async with _leased(clock, 10.0, b"kvb/e/d1", stall_after_s=1.0) as (store, _):
        clock.t += 5.0  # a 5 s stall at once; the holder never refreshes: deadline 110 + 5
        assert await store.get(b"kvb/e/d1") is not None
        await _run(store, clock, 9.75, b"kvb/e/d1")  # to 114.75
        clock.t += 0.25
        assert await store.get(b"kvb/e/d1") is None  # at 115: one stall late, not later
        assert store.stalled_s == pytest.approx(5.0)


async def test_an_injected_clock_that_jumps_is_no_stall_unless_asked() -> None:
    """Tests advance their clock past a TTL on purpose: without ``stall_after_s`` the jump
    ends the lease as before (only the real clock turns compensation on by default)."""
    clock = Clock()
    async with _leased(clock, 10.0, b"kvb/e/p1") as (store, _):
        clock.t += 10.5
        assert await store.get(b"kvb/e/p1") is None
        assert store.stalled_s == 0.0


async def test_idle_time_before_the_first_lease_is_not_a_stall() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock, stall_after_s=1.0)
    try:
        clock.t += 60.0  # no lease existed: nobody had to look
        await store.put(b"k", b"v", lease=await store.grant_lease(2.0))
        await _run(store, clock, 1.75, b"k")
        clock.t += 0.25
        assert await store.get(b"k") is None  # ended on time: the idle minute was not added
        assert store.stalled_s == 0.0
    finally:
        await store.close()
