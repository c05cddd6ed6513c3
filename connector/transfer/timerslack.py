"""A thread's timer slack: how late Linux may wake it from a timed sleep or wait.

Why: the default slack is 50 µs, so ``time.sleep(0)`` and a ``queue.get(timeout=50e-6)``
on the transfer thread take ~60–100 µs. A staged GPU transfer's thread polls between
chunks that each cross the GPU in ~50–100 µs; measured on an H200 (one fragmented 4 GiB
staged WRITE under cProfile, ``benchmarks/results/datapath_gpu_h200x1_profile_before_sender.txt``), 208
``sleep(0)`` calls took 12 ms of a 52 ms transfer. A 1 µs slack makes those waits as
short as asked. It only affects the calling thread (the transfer thread), and only how
precisely it wakes up, not how long it asks to sleep.
"""

from __future__ import annotations

import ctypes
import sys

PR_SET_TIMERSLACK = 29
PR_GET_TIMERSLACK = 30


def _prctl(option: int, arg: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                          ctypes.c_ulong(0)))


def set_timer_slack(ns: int = 1000) -> bool:
    """Set the calling thread's timer slack to ``ns`` (> 0) nanoseconds; False where the
    platform has none (not Linux) or refuses."""
    if ns <= 0:
        raise ValueError("timer slack must be positive (0 would reset it to the default)")
    if not sys.platform.startswith("linux"):
        return False
    try:
        return _prctl(PR_SET_TIMERSLACK, ns) == 0
    except (OSError, AttributeError):
        return False


def timer_slack() -> int | None:
    """The calling thread's timer slack in ns (None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return _prctl(PR_GET_TIMERSLACK, 0)
    except (OSError, AttributeError):
        return None
