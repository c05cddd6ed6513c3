"""The service clock under system-clock steps (the 'clock jumps' fault): forward steps
never end leases early, backward steps never move time back."""

from __future__ import annotations

import asyncio

from kvbaton.services.domain.clock import WallClock
from kvbaton.services.server import ControlPlane
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import lease_pb2
from tests.services.conftest import fast_config


class SteppableWall:
    def __init__(self) -> None:
        import time

        self.offset = 0
        self._time = time

    def __call__(self) -> int:
        return self._time.time_ns() // 1_000_000 + self.offset


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
    wall = SteppableWall()
    cp = ControlPlane(fast_config(), store=MemoryStore(), clock=WallClock(wall_ms=wall))
    await cp.start()
    try:
        lease, _ = await cp.lease.grant("jumpy", "dec", ttl_ms=1500)
        wall.offset += 3_600_000  # the system clock steps an hour ahead
        await asyncio.sleep(0.8)
        assert (await cp.lease.get("jumpy")).state == lease_pb2.LEASE_STATE_ACTIVE
        for _ in range(60):
            if (await cp.lease.get("jumpy")).state == lease_pb2.LEASE_STATE_EXPIRED:
                break
            await asyncio.sleep(0.05)
        assert (await cp.lease.get("jumpy")).state == lease_pb2.LEASE_STATE_EXPIRED  # and it still ends
    finally:
        await cp.stop()
