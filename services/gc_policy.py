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
minus frees), not 700 allocations — a call's short-lived objects die by reference
counting and never count, so a raised generation-0 threshold saves little. The open-loop
benchmark (``benchmarks/results/control_plane_cpu4_rounds.json``, its collections timed
by ``benchmarks/gc_probe.py``; ``benchmarks/README.md`` has the tables) showed the
collector's CPU during the measured points at 2-14 µs per match with every threshold
tried, about 1 % of the server's CPU per match — not where a match's CPU goes — and a
full pass as the stall it had blamed: with CPython's thresholds one full pass of 59-76
ms at the same moment every round (the first one after start-up, which walks everything
promoted since; the "a quarter of the long-lived heap" rule holds it back that long),
p99 117-248 ms in that point. A full pass after every 2 middle passes instead of 10
walks less each time (in that point: longest pass 9.7-19.3 ms, p99 8.7-19.3 ms); a
generation-0 threshold of 50,000 only moved the stall into one young pass over that many
objects (23-35 ms), and its rare middle and full passes would walk millions of objects
at 100,000 leases. Full passes being more frequent, ``unfreeze_every`` is 5× larger, so
the whole-heap pass comes about as seldom as before. A rerun
(``control_plane_cpu4_rerun.json``) showed the same, and a full pass after every middle
one (``700,10,1``) no better.
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
