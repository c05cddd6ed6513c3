"""Load shedding: past capacity, new work is refused with RESOURCE_EXHAUSTED and a reason.

Why this exists. ``grpc.aio`` takes calls from gRPC core one per turn of the Python event
loop. When the loop falls behind, incoming calls wait in core's pending list, and core's
backlog protection (``grpc.server.max_pending_requests``, 1,000 by default, random early
drop up to ``grpc.server.max_pending_requests_hard_limit``, 3,000) answers the overflow
``CANCELLED`` ("CANCELLED") before any handler has run: overload that looks like a client
error, and one that kvbaton's clients retry as a transport failure, adding load.

So the server (1) raises core's limits (``CORE_BACKLOG_OPTIONS``) so that core queues
instead of dropping, and (2) watches how late its event loop runs (``LoopLag``): while it
runs more than ``max_lag_ms`` behind, a message that would open a *new* transfer is
refused at once with RESOURCE_EXHAUSTED and a reason (cheap: no store access), which
keeps the loop turning fast enough to drain core's queue; a few new transfers per tick are
still admitted, so a flood that keeps the loop saturated throughout still gets some
through. Messages that finish work the
server has already accepted (the second side of a transfer, outcomes, cancels) are always
admitted, so an accepted transfer is matched or expires by its deadline with an outcome.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

# Core queues (rather than drops) calls the Python loop has not taken yet; shedding
# happens in Python, with a reason. The hard limit still bounds memory in a flood far
# past what shedding can answer.
CORE_BACKLOG_OPTIONS = [
    ("grpc.server.max_pending_requests", 50_000),
    ("grpc.server.max_pending_requests_hard_limit", 50_000),
]


_SCHEDSTAT = "/proc/thread-self/schedstat"


def thread_cpu_and_wait(fd: int | None = None) -> tuple[float, float]:
    """(seconds this thread ran on a CPU, seconds it waited runnable on a run queue), from
    Linux's schedstat; (thread CPU time, 0) where that cannot be read. ``fd``: the file
    already open (``open_schedstat``) in this thread, read again from its start (the
    loop reads it 100 times a second: an open and close each time cost more than the read)."""
    try:
        if fd is not None:
            fields = os.pread(fd, 128, 0).split()
        else:
            with open(_SCHEDSTAT, "rb") as f:
                fields = f.read().split()
        return int(fields[0]) / 1e9, int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return time.thread_time(), 0.0


def open_schedstat() -> int | None:
    """This thread's schedstat, open for ``thread_cpu_and_wait``; None where it cannot be."""
    try:
        return os.open(_SCHEDSTAT, os.O_RDONLY)
    except OSError:
        return None


class LoopLag:
    """Whether the event loop is past capacity, from two signals measured every ``tick_s``:

    - *busy*: the share of wall time the loop spent outside its selector's wait (measured
      by wrapping the selector's ``select``). While calls queue in core, the loop takes
      them back to back and never waits, so a busy loop means "behind" even when each
      turn is short; once it has caught up it waits again and admits again.
    - *lag*: how late its own timer fires (a long turn, or a starved process).

    ``overloaded``: busy ≥ ``max_busy`` over the last ``window`` ticks, or lag above
    ``max_lag_ms`` while the loop was also at least ``lag_busy`` busy. Lag on an idle loop
    means the process was starved by others (engines sharing the cores), not that calls
    arrive faster than it takes them: refusing then only turns a few late milliseconds into
    a failed transfer, so it is not shed on. Without a selector to wrap (uvloop), *busy* is the loop thread's CPU
    time over the wall time it was not waiting for a CPU (``/proc/thread-self/schedstat``:
    time on a CPU, time runnable on a run queue): a loop that has work all the time is
    100 % busy however little of a core the machine lets it have, and a starved loop with
    little to do reads as little busy, as with the selector's measure. Where schedstat
    cannot be read, CPU time over wall time (lower where other processes take the core).
    """

    def __init__(self, *, max_lag_ms: float, max_busy: float = 0.95, lag_busy: float = 0.5,
                 tick_s: float = 0.01, window: int = 5,
                 admit_per_tick: int = 2, clock: Callable[[], float] = time.monotonic,
                 on_shed: Callable[[], None] | None = None) -> None:
        self.max_lag_ms = max_lag_ms
        self.max_busy = max_busy
        self.lag_busy = lag_busy
        self.tick_s = tick_s
        self.clock = clock
        self._lags = [0.0] * window
        self._busy = [0.0] * window
        self._i = 0
        self.lag_ms = 0.0
        self._busy_lag_ms = 0.0
        self.busy = 0.0
        self.shed = 0
        self.on_shed = on_shed  # told of every refusal (the server's shed counter)
        # Even while overloaded, this many new transfers per tick are admitted: a burst that
        # keeps the loop saturated from start to end still makes progress (200/s by default).
        self.admit_per_tick = admit_per_tick
        self._admitted = 0
        self._idle_s = 0.0
        self._task: asyncio.Task | None = None

    def observe(self, late_ms: float, busy: float) -> None:
        self._lags[self._i] = late_ms
        self._busy[self._i] = busy
        self._i = (self._i + 1) % len(self._lags)
        self.lag_ms = max(self._lags)
        self.busy = min(self._busy)
        # Lag that counts: of ticks whose loop was also busy (see the class docstring).
        self._busy_lag_ms = max((lag for lag, b in zip(self._lags, self._busy, strict=True) if b >= self.lag_busy),
                                default=0.0)
        self._admitted = 0

    @property
    def overloaded(self) -> bool:
        if self.max_lag_ms <= 0:
            return False
        return self.busy >= self.max_busy or self._busy_lag_ms > self.max_lag_ms

    def retry_after_ms(self) -> int:
        """The retry hint sent with a shed call: about how long the loop has been behind
        (twice the lag), at least 20 ms and at most a second, jittered by the client."""
        return int(min(1000.0, max(20.0, 2 * self.lag_ms)))

    def refuse(self) -> str | None:
        """None (admit), or the reason to refuse a new transfer with."""
        if not self.overloaded:
            return None
        if self._admitted < self.admit_per_tick:
            self._admitted += 1
            return None
        self.shed += 1
        if self.on_shed is not None:
            self.on_shed()
        return (f"server overloaded (event loop {self.busy:.0%} busy, {self.lag_ms:.0f} ms behind; limits "
                f"{self.max_busy:.0%}, {self.max_lag_ms:g} ms): new transfers are refused until it catches up; "
                "retry with backoff or use another replica")

    def _wrap_selector(self, loop: asyncio.AbstractEventLoop) -> bool:
        selector = getattr(loop, "_selector", None)
        if selector is None or not hasattr(selector, "select"):
            return False
        inner = selector.select
        clock = self.clock
        me = self

        def select(timeout=None):
            if timeout is not None and timeout <= 0:
                return inner(timeout)
            t0 = clock()
            try:
                return inner(timeout)
            finally:
                me._idle_s += clock() - t0

        selector.select = select
        return True

    async def run(self) -> None:
        measured = self._wrap_selector(asyncio.get_running_loop())
        fd = open_schedstat()  # in the loop's thread: /proc/thread-self resolves at open
        try:
            await self._ticks(measured, fd)
        finally:
            if fd is not None:
                os.close(fd)

    async def _ticks(self, measured: bool, fd: int | None) -> None:
        last, idle0 = self.clock(), self._idle_s
        cpu0, wait0 = thread_cpu_and_wait(fd)
        while True:
            due = self.clock() + self.tick_s
            await asyncio.sleep(self.tick_s)
            now = self.clock()
            cpu, wait = thread_cpu_and_wait(fd)
            span = max(now - last, 1e-9)
            if measured:
                busy = 1.0 - (self._idle_s - idle0) / span
            else:  # time it could have run: the span less its wait for a CPU
                busy = min(1.0, (cpu - cpu0) / max(span - (wait - wait0), 1e-9))
            self.observe(max(now - due, 0.0) * 1000, busy)
            last, idle0, cpu0, wait0 = now, self._idle_s, cpu, wait

    def start(self) -> None:
        if self.max_lag_ms > 0 and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
