"""Run a coroutine inline until it first suspends; a task only if it does.

Why: on the memory store a session call (offer, complete, outcome) finishes without ever
waiting, yet ``loop.create_task`` per call costs a task object, a scheduling round, a
done callback and a slot in the session's in-flight bound — about as much CPU as the
rendezvous work itself at hundreds of calls a second. Python 3.12's eager task factory
does this; the servers here run 3.11, so this is the same idea for the one place that
needs it. A coroutine that does suspend (an etcd round trip) is driven to the end by a
task exactly as ``create_task`` would, so its semantics (cancellation included) hold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Suspended:
    """A coroutine that suspended at its first step; ``drive()`` finishes it in a task."""

    __slots__ = ("coro", "yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self.coro = coro
        self.yielded = yielded

    async def drive(self) -> Any:
        """Finishes the coroutine, awaiting each future it yields as its task would."""
        coro, yielded = self.coro, self.yielded
        while True:
            exc: BaseException | None = None
            try:
                if yielded is None:  # a bare yield (asyncio.sleep(0)): one loop turn
                    await asyncio.sleep(0)
                else:
                    # The coroutine awaits this future; it reads the outcome itself when
                    # resumed (fut.result() raises inside it on failure), as under a task.
                    yielded._asyncio_future_blocking = False
                    await asyncio.wait([yielded])
            except asyncio.CancelledError as cancelled:  # this task was cancelled: so is the call
                yielded.cancel() if yielded is not None else None
                exc = cancelled
            try:
                yielded = coro.throw(exc) if exc is not None else coro.send(None)
            except StopIteration as done:
                return done.value


def start(coro: Coroutine[Any, Any, T]) -> tuple[bool, T | Suspended]:
    """(True, result) if ``coro`` finished without suspending, else (False, Suspended).
    Exceptions it raises before suspending propagate here."""
    try:
        yielded = coro.send(None)
    except StopIteration as done:
        return True, done.value
    return False, Suspended(coro, yielded)
