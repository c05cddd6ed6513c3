"""Keeps Python's full garbage collections proportional to what changed, not to the heap.

Why: a replica holding 100,000 leases has ~500,000 long-lived objects tracked by the
cyclic collector (records, cache tuples, history events). CPython runs a full
(generation 2) collection whenever the survivors since the last one reach a quarter of
the long-lived heap, and a full pass walks *every* tracked object: 1-4 s here at 100,000
leases, charged to whichever call happened to allocate — a KeepAlive batch of 10,000
renewal writes paid several of them. ``serve()`` already freezes what start-up loaded;
this moves the survivors of each full collection into the permanent generation too
(``gc.freeze()``), so the next full pass walks only objects created since.

The cost: an object frozen while alive that later becomes part of a reference *cycle*
of garbage is not reclaimed by the collector (reference counting still frees everything
acyclic, which is nearly all of a replica's state: protobuf records, bytes, tuples).
``unfreeze_every`` full collections, everything is unfrozen so the next full pass walks
the whole heap once and reclaims such cycles.

Thresholds (``SERVE_THRESHOLD``, set by ``serve()``; ``kvbaton serve --gc-threshold``):
a generation-0 pass runs after 700 *net* allocations of tracked objects (allocations
minus frees), not 700 allocations — the short-lived objects of a call die by reference
counting and never count. Measured on the open-loop benchmark's server (session-answer,
500 matches/s, four points, ~17,000 live transfers; CPU time of the collector itself,
from ``gc.callbacks``, an ad-hoc run on a loaded machine): ~5 net allocations per match,
so with CPython's thresholds 126 young, 11 middle and 1 full pass in ~20,000 matches,
98 ms in all (~5 µs per match, ~1.5 % of the server's CPU) — the collector is not where
a match's CPU goes, and no threshold can save more than that. What the thresholds do
decide is the longest pause: the full pass took 39 ms alone (all that was promoted since
start-up, the first time the "a quarter of the long-lived heap" rule let one run), which
is what the benchmark's p99 showed as a stall at a fixed moment. A full pass after every
2 middle passes instead of 10 walks ~1/5 as much each time (largest pause 8.7 ms in the
same run, 75 ms in all); a large generation-0 threshold (50,000) only moves the pause
into one young pass over 50,000 objects (23 ms), and its rare middle and full passes
would walk millions of objects at 100,000 leases. Since full passes are ~5× as frequent,
``unfreeze_every`` is 5× larger, so the whole-heap pass comes as seldom as before.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

_installed: list[Any] = []

# CPython's own thresholds (gen 0, gen 1, gen 2): what ``kvbaton serve --gc-threshold``
# set before it had the option.
CPYTHON_THRESHOLD = (700, 10, 10)
# What ``serve()`` sets (``ServerConfig.gc_threshold``); why: the module's docstring.
SERVE_THRESHOLD = (700, 10, 2)


def parse_threshold(text: str) -> tuple[int, int, int]:
    """``"700,10,10"`` -> (700, 10, 10), for ``--gc-threshold``; ValueError if it is not
    three whole numbers, each at least 1 (a 0 would turn that part of the collector off,
    and reference cycles would then never be reclaimed: unbounded memory)."""
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 3 or min(values) < 1:
        raise ValueError(f"gc threshold {text!r}: three whole numbers >= 1, gen0,gen1,gen2 (e.g. 700,10,10)")
    return values[0], values[1], values[2]


def set_threshold(threshold: tuple[int, int, int]) -> None:
    """The collector's thresholds for a server process (``gc.set_threshold``)."""
    parse_threshold(",".join(map(str, threshold)))  # the same checks as the flag
    gc.set_threshold(*threshold)


def install(loop: asyncio.AbstractEventLoop, *, unfreeze_every: int = 5_000) -> None:
    """After every full collection (in any thread), freeze its survivors on ``loop``."""
    uninstall()
    state = {"pending": False, "full": 0}

    def freeze() -> None:
        state["pending"] = False
        state["full"] += 1
        if unfreeze_every and state["full"] % unfreeze_every == 0:
            gc.unfreeze()  # the next full pass walks everything once, reclaiming frozen cycles
        else:
            gc.freeze()

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase != "stop" or info.get("generation") != 2 or state["pending"] or loop.is_closed():
            return
        state["pending"] = True
        try:
            loop.call_soon_threadsafe(freeze)
        except RuntimeError:  # the loop closed meanwhile
            state["pending"] = False

    gc.callbacks.append(on_gc)
    _installed.append(on_gc)


def uninstall() -> None:
    while _installed:
        cb = _installed.pop()
        if cb in gc.callbacks:
            gc.callbacks.remove(cb)
