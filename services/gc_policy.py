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
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

_installed: list[Any] = []


def install(loop: asyncio.AbstractEventLoop, *, unfreeze_every: int = 1_000) -> None:
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
