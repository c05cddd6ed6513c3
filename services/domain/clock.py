"""The service's clock. Lease expiry is decided here, never by comparing engines' clocks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...


class WallClock:
    """Milliseconds since the epoch, so that replicas sharing a store agree (NTP-synced),
    guarded against steps of the system clock:

    - it never runs faster than the monotonic clock: a forward step (an operator, a bad NTP
      step) cannot make leases on this replica end early — after such a step this clock
      keeps counting real elapsed time from where it was;
    - it never goes backward: after a backward step it holds still until the system clock
      catches up, so deadlines only ever move later (the safe direction).

    Across replicas the usual bound applies: leases are safe within the clock skew between
    replicas, which NTP keeps to milliseconds.
    """

    def __init__(self, wall_ms: Callable[[], int] | None = None, mono_ms: Callable[[], int] | None = None) -> None:
        self._real = wall_ms is None and mono_ms is None
        self._wall = wall_ms or (lambda: time.time_ns() // 1_000_000)
        self._mono = mono_ms or (lambda: time.monotonic_ns() // 1_000_000)
        self._lock = threading.Lock()
        self._last_out = self._wall()
        self._last_mono = self._mono()
        self.steps_ignored_ms = 0  # how far the system clock ran ahead of real time, in total

    def now_ms(self) -> int:
        # (Read per message on the rendezvous path: the system clocks are read directly
        # unless a test injected its own, and min/max are comparisons, not calls.)
        with self._lock:
            if self._real:
                wall, mono = time.time_ns() // 1_000_000, time.monotonic_ns() // 1_000_000
            else:
                wall, mono = self._wall(), self._mono()
            last = self._last_out
            elapsed = mono - self._last_mono
            ceiling = last + elapsed if elapsed > 0 else last  # real time elapsed since last read
            out = wall if wall < ceiling else ceiling
            if out < last:
                out = last
            if wall > ceiling:
                self.steps_ignored_ms += wall - ceiling
            self._last_out, self._last_mono = out, mono
            return out


class ManualClock:
    """A clock tests move by hand."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.t = start_ms

    def now_ms(self) -> int:
        return self.t

    def advance(self, ms: int) -> None:
        self.t += ms
