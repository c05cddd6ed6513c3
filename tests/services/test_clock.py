"""The service clock under system-clock steps (the 'clock jumps' fault): forward steps
never end leases early, backward steps never move time back."""

from __future__ import annotations

import asyncio

from kvbaton.services.domain.clock import WallClock
from kvbaton.services.server import ControlPlane
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import lease_pb2
from tests.services.conftest import fast_config


class HandClocks:
    """The two readings a ``WallClock`` takes, moved by hand: the system clock (which an
    operator or NTP can step) and the monotonic clock (which only counts elapsed time)."""

    def __init__(self) -> None:
        self.wall = 1_700_000_000_000
        self.mono = 0

    def elapse(self, ms: int) -> None:
        self.wall += ms
        self.mono += ms

    def clock(self) -> WallClock:
        return WallClock(wall_ms=lambda: self.wall, mono_ms=lambda: self.mono)


def test_clock_ignores_forward_steps_and_never_goes_back():
    t = {"wall": 1_000_000, "mono": 5_000}
    clock = WallClock(wall_ms=lambda: t["wall"], mono_ms=lambda: t["mono"])
    assert clock.now_ms() == 1_000_000
    t["wall"] += 100
    t["mono"] += 100
    assert clock.now_ms() == 1_000_100
    t["wall"] += 3_600_000  # an hour's step forward during 50 ms
    t["mono"] += 50
    assert clock.now_ms() == 1_000_150
    t["wall"] -= 7_200_000  # two hours back
    t["mono"] += 50
    assert clock.now_ms() == 1_000_150  # holds still
    assert clock.steps_ignored_ms >= 3_600_000 - 50


async def test_forward_step_of_the_service_clock_does_not_expire_leases_early():
    hands = HandClocks()
    cp = ControlPlane(fast_config(), store=MemoryStore(), clock=hands.clock())
    await cp.start()
    try:
        lease, _ = await cp.lease.grant("jumpy", "dec", ttl_ms=1500)
        hands.wall += 3_600_000  # the system clock steps an hour ahead
        hands.elapse(800)
        assert await cp.lease.expire_due() == 0
        assert (await cp.lease.get("jumpy")).state == lease_pb2.LEASE_STATE_ACTIVE
        hands.elapse(700)  # the TTL has really elapsed
        for _ in range(60):
            if (await cp.lease.get("jumpy")).state == lease_pb2.LEASE_STATE_EXPIRED:
                break
            await asyncio.sleep(0.05)  # the expiry loop's next tick (bounded: 3 s)
        assert (await cp.lease.get("jumpy")).state == lease_pb2.LEASE_STATE_EXPIRED  # and it still ends
    finally:
        await cp.stop()
