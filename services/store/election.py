"""Leader election on any ``Store`` (memory or etcd): one leader per name, lease-bound.

How it works, and why:

- A candidate grants a TTL lease and tries ``txn(absent(key) -> put(key, id, lease))`` on
  ``election/<name>``. The key being *absent* is the only condition, so exactly one
  candidate wins each vacancy (linearizable compare-and-swap on etcd).
- Losers read the key and watch it from the read's revision + 1, so a deletion that happens
  between the read and the watch is not missed; on DELETE they try again. Leader death
  means its lease expires (after ``ttl``), the key is deleted, and a waiting candidate takes
  over within about ``ttl`` (+ etcd's 0.5 s expiry check).
- The leader renews the lease every ``ttl/3``. Leadership is *lost* (``lost`` is set,
  ``on_lost`` runs) when the lease is gone, when the key is deleted or taken over, or when
  no renewal has succeeded for long enough that the server may already have expired the
  lease. The local bound is computed from the time a successful renewal was *sent*, so the
  leader gives up before (never after) the store could hand leadership to someone else,
  up to ``safety_s`` of clock-rate slack. Leader-only work must stop when ``lost`` fires.
- ``resign()`` revokes the lease: the key goes at once and the next candidate wins
  immediately, without waiting for the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from .base import CompactedError, Compare, EventType, LeaseNotFoundError, Put, Store, StoreError, Watch

log = structlog.get_logger(__name__)

ELECTION_PREFIX = b"election/"


class Election:
    """Campaign for leadership of ``name``; ``async with`` campaigns and resigns.

    >>> async with Election(store, "rendezvous", ttl_s=5) as e:   # returns when leader
    ...     await do_leader_work_until(e.lost)
    """

    def __init__(
        self,
        store: Store,
        name: str,
        *,
        ttl_s: float = 5.0,
        identity: bytes | None = None,
        on_lost: Callable[[], Any] | None = None,
        safety_s: float | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.store = store
        self.name = name
        self.key = ELECTION_PREFIX + name.encode()
        self.ttl_s = ttl_s
        self.identity = identity or f"{os.getpid()}-{uuid.uuid4().hex[:12]}".encode()
        self.on_lost = on_lost
        # Give up this long before the lease could expire on the server (clock-rate slack,
        # time for leader-only work to notice).
        self.safety_s = safety_s if safety_s is not None else min(0.5, ttl_s / 10)
        self.lost = asyncio.Event()
        self.lease_id = 0
        self.revision = 0  # the store revision at which we became leader
        self._leader = False
        self._valid_until = 0.0  # monotonic: our lease is certainly alive before this
        self._tasks: list[asyncio.Task[None]] = []
        self._watch: Watch | None = None

    @property
    def is_leader(self) -> bool:
        """True while this candidate holds leadership and its lease is surely valid."""
        return self._leader and not self.lost.is_set() and time.monotonic() < self._valid_until - self.safety_s

    async def leader(self) -> bytes | None:
        """The identity of the current leader (any candidate's view), or None."""
        kv = await self.store.get(self.key)
        return kv.value if kv else None

    # -- campaigning ------------------------------------------------------------
    async def campaign(self, *, timeout_s: float | None = None) -> None:
        """Returns once this candidate is leader; raises TimeoutError after ``timeout_s``.

        On timeout or cancellation the lease is revoked, so no stale candidacy lingers.
        """
        if self._leader:
            return
        if self.lost.is_set():
            self.lost = asyncio.Event()  # a new term after resign()/loss
        try:
            async with asyncio.timeout(timeout_s):
                await self._campaign()
        except BaseException:
            await self._release()
            raise

    async def _campaign(self) -> None:
        loop = asyncio.get_running_loop()
        if not self.lease_id:
            t0 = time.monotonic()
            self.lease_id = await self.store.grant_lease(self.ttl_s)
            self._valid_until = t0 + self.ttl_s
            # Renew while we wait too: a candidate that wins must hold a live lease.
            self._tasks.append(loop.create_task(self._keepalive_loop(), name=f"election-ka-{self.name}"))
        while True:
            if self.lost.is_set():
                raise StoreError(f"election {self.name}: lease lost while campaigning")
            res = await self.store.txn(
                [Compare.absent(self.key)], [Put(self.key, self.identity, lease=self.lease_id)]
            )
            if res.succeeded:
                self.revision = res.revision
                break
            kvs, rev = await self.store.range(self.key, limit=1)
            current = next((kv for kv in kvs if kv.key == self.key), None)
            if current is None:
                continue  # vacated between our txn and our read
            if current.lease == self.lease_id:
                self.revision = current.create_revision  # ours already (re-campaign)
                break
            try:
                await self._wait_deleted(rev + 1)
            except CompactedError:
                continue  # history gone: just re-read and try again
        self._leader = True
        # Watch our own key: anyone deleting it (or an expiry we did not see) ends our term.
        self._watch = await self.store.watch(self.key, start_revision=self.revision + 1)
        self._tasks.append(loop.create_task(self._watch_own_key(self._watch), name=f"election-watch-{self.name}"))
        log.info("elected", election=self.name, identity=self.identity, revision=self.revision)

    async def _wait_deleted(self, from_rev: int) -> None:
        """Returns when the key is deleted at/after ``from_rev`` or our own lease is lost."""
        w = await self.store.watch(self.key, start_revision=from_rev)

        async def deleted() -> None:
            async for batch in w:
                if any(e.kv.key == self.key and e.type is EventType.DELETE for e in batch):
                    return

        waiters = {asyncio.ensure_future(deleted()), asyncio.ensure_future(self.lost.wait())}
        try:
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # surfaces CompactedError/StoreError from the watch
        finally:
            for t in waiters:
                t.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
            await w.close()

    # -- holding --------------------------------------------------------------
    async def _keepalive_loop(self) -> None:
        period = self.ttl_s / 3
        try:
            while True:
                await asyncio.sleep(period)
                while True:
                    budget = self._valid_until - self.safety_s - time.monotonic()
                    if budget <= 0:
                        self._lose("lease renewal did not succeed in time")
                        return
                    t0 = time.monotonic()
                    try:
                        ttl = await asyncio.wait_for(self.store.keepalive(self.lease_id), budget)
                    except LeaseNotFoundError:
                        self._lose("lease expired or revoked")
                        return
                    except (StoreError, TimeoutError) as e:
                        log.warning("election keepalive failed", election=self.name, error=str(e))
                        await asyncio.sleep(min(period / 4, max(0.0, budget)))
                        continue
                    # The server refreshed the lease after t0, so it lives at least until t0+ttl.
                    self._valid_until = t0 + min(ttl, self.ttl_s) if ttl else t0 + self.ttl_s
                    break
        except asyncio.CancelledError:
            raise

    async def _watch_own_key(self, w: Watch) -> None:
        try:
            async for batch in w:
                for e in batch:
                    if e.kv.key != self.key:
                        continue
                    if e.type is EventType.DELETE or e.kv.lease != self.lease_id:
                        self._lose("leader key deleted or replaced")
                        return
        except StoreError as e:
            # The watch could not be kept; the keepalive bound still protects us, but be
            # conservative: without it we would not see a forced deletion.
            self._lose(f"leader key watch failed: {e}")

    def _lose(self, reason: str) -> None:
        if self.lost.is_set():
            return
        was_leader = self._leader
        self._leader = False
        self.lost.set()
        log.warning("leadership lost" if was_leader else "candidacy lost", election=self.name, reason=reason)
        if was_leader and self.on_lost is not None:
            try:
                res = self.on_lost()
                if asyncio.iscoroutine(res):
                    asyncio.get_running_loop().create_task(res, name=f"election-on-lost-{self.name}")
            except Exception:  # a broken callback must not keep us "leader"
                log.exception("on_lost callback failed", election=self.name)

    # -- leaving --------------------------------------------------------------
    async def _stop_tasks(self) -> None:
        me = asyncio.current_task()
        tasks, self._tasks = [t for t in self._tasks if t is not me], []
        pending = set(tasks)
        while pending:
            for t in pending:
                t.cancel()
            # Python 3.11's wait_for can swallow a cancellation that races its inner
            # future's completion; a task that survived one cancel gets another.
            _, pending = await asyncio.wait(pending, timeout=1.0)
        if self._watch is not None:
            await self._watch.close()
            self._watch = None

    async def _release(self) -> None:
        await self._stop_tasks()
        lease, self.lease_id = self.lease_id, 0
        self._leader = False
        if lease:
            with contextlib.suppress(StoreError):
                await self.store.revoke_lease(lease)

    async def resign(self) -> None:
        """Gives leadership up now: the key is deleted, the next candidate wins at once."""
        await self._release()
        if not self.lost.is_set():
            self.lost.set()

    async def abandon(self) -> None:
        """Stops renewing without revoking: what a crashed leader looks like to others
        (they take over after the TTL). For tests and for hand-over drills."""
        await self._stop_tasks()
        self._leader = False
        self.lease_id = 0

    async def run(
        self,
        on_elected: Callable[[], Awaitable[None]],
        *,
        timeout_s: float | None = None,
    ) -> bool:
        """Campaigns, then runs ``on_elected()`` as leader until it returns or leadership is
        lost (it is then cancelled). Resigns at the end. Returns True if the work finished
        while still leader, False if leadership was lost first."""
        await self.campaign(timeout_s=timeout_s)
        work = asyncio.ensure_future(on_elected())
        lost = asyncio.ensure_future(self.lost.wait())
        try:
            await asyncio.wait({work, lost}, return_when=asyncio.FIRST_COMPLETED)
            finished = work.done() and not self.lost.is_set()
            if not work.done():
                work.cancel()
            await asyncio.gather(work, return_exceptions=not finished)
            return finished
        finally:
            lost.cancel()
            if not work.done():
                work.cancel()
            await self.resign()

    async def __aenter__(self) -> Election:
        await self.campaign()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.resign()
