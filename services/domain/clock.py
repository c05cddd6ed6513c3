"""The service's clock. Lease expiry is decided here, never by comparing engines' clocks."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...


class WallClock:
    """Milliseconds since the epoch, so that replicas sharing a store agree (NTP-synced)."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class ManualClock:
    """A clock tests move by hand."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.t = start_ms

    def now_ms(self) -> int:
        return self.t

    def advance(self, ms: int) -> None:
        self.t += ms
