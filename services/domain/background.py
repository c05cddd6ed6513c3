"""Background machinery the domain services share: the leader-gated tick loop, the
shared tombstone store lease, and task cancellation that cannot hang."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

import structlog

from ..store.base import Store

log = structlog.get_logger(__name__)


async def leader_ticks(name: str, tick_s: float, is_leader: Callable[[], bool], work: Callable[[], Awaitable[object]]) -> None:
    """Runs ``work()`` every ``tick_s`` while this replica leads; a failing tick (the
    store may be failing over) is logged and the loop goes on."""
    while True:
        await asyncio.sleep(tick_s)
        if not is_leader():
            continue
        try:
            await work()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed tick is logged; the next tick tries again
            log.warning(f"{name}.tick_failed", error=str(exc))


class Tombstones:
    """One store TTL lease shared by every record ended within ``rotate_s``: ended
    records stay readable for ``ttl_s`` (late duplicates, operators) and then vanish,
    without a store round trip per record."""

    def __init__(self, store: Store, ttl_s: float, rotate_s: float = 30.0) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.rotate_s = rotate_s
        self._current: tuple[int, float] | None = None

    async def lease(self) -> int:
        now = asyncio.get_running_loop().time()
        if self._current is None or now - self._current[1] > self.rotate_s:
            self._current = (await self.store.grant_lease(self.ttl_s), now)
        return self._current[0]


async def cancel_all(tasks: Iterable[asyncio.Task]) -> None:
    """Cancels and waits; a task that survives one cancel (Python 3.11's ``wait_for`` can
    swallow a cancellation racing its inner future) gets another, so stopping never hangs."""
    pending = {t for t in tasks if t is not None}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)
