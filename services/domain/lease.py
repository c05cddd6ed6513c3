"""Decode-side leases on retained KV blocks: grant, renew, pin, revoke, expire.

Rules (the lease invariants this service keeps):

- Expiry is decided by this service's clock. A lease ends when ``now >= expires_at``
  and no pin is live; a pin is never granted on an ended lease or one past its deadline.
- Revoking (or replacing, by a new grant for the same conversation) a pinned lease makes
  it DRAINING: no new pins, blocks kept; it becomes REVOKED when the last pin goes.
- A renewal is acknowledged only once the store holds a deadline at least as late as the
  one promised, so a replica failover can never expire a lease early. To keep renewals
  cheap, a written deadline carries ``slack`` beyond the TTL: renewals that arrive while
  the stored deadline still covers ``now + ttl`` are answered without a write, so a lease
  is written at most once per ``slack`` (1 s by default) however often it is renewed.
  Writes that are due are group-committed by one flusher.
- Only the elected expiry leader ends leases; every transition is a compare-and-swap on
  the lease's record, so a stale cache can never end a lease that was just renewed.

Records: ``<prefix>l/<lease_id>`` holds ``LeaseInfo``; ``<prefix>c/<conversation_id>``
holds the current lease id. Ended records stay (for ``get``/operators) under a shared
tombstone store lease for ``tombstone_s``. Renewals are written as one journal record per
batch (``<prefix>j/``, fenced by ``<prefix>f/``; see ``lease_journal``): a lease's
deadline is the later of its record's and the journal's.
"""

from __future__ import annotations

import array
import asyncio
import builtins
import dataclasses
import secrets
from collections.abc import AsyncIterator, Iterable, Sequence
from itertools import compress
from operator import itemgetter, not_

import structlog

from kvbaton.v1 import lease_pb2 as pb

from ..metrics import ServiceMetrics
from ..store.base import (
    Compare,
    CompareOp,
    CompareTarget,
    Delete,
    EventType,
    Get,
    KeyValue,
    Put,
    Store,
    TxnResult,
    WatchEvent,
)
from . import lease_journal, limits, paging, renewal_scan
from .background import Tombstones, cancel_all, leader_ticks
from .clock import Clock, WallClock
from .deadlines import END_YIELD_EVERY, DeadlineIndex
from .errors import Code, DomainError, exhausted, invalid, not_found, precondition
from .hub import PrefixHub

log = structlog.get_logger(__name__)

ACTIVE = pb.LEASE_STATE_ACTIVE
DRAINING = pb.LEASE_STATE_DRAINING
EXPIRED = pb.LEASE_STATE_EXPIRED
REVOKED = pb.LEASE_STATE_REVOKED
LIVE_STATES = (ACTIVE, DRAINING)
TERMINAL_STATES = (EXPIRED, REVOKED)
MAX_PINS = 64
_CAS_RETRIES = 32
# Journal writes that lost their "ends" fence (a lease ended meanwhile) before the batch
# falls back to one compare-and-swap per lease.
_FENCE_RETRIES = 4
# Journal records the expiry leader deletes per tick.
_JOURNAL_DELETES = 64
_REPLACED_PREFIX = "replaced by lease "
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_RENEW_STATUS = {pb.RENEW_STATUS_OK: "ok", pb.RENEW_STATUS_NOT_FOUND: "not_found", pb.RENEW_STATUS_SUPERSEDED: "superseded",
                 pb.RENEW_STATUS_ENDED: "ended", pb.RENEW_STATUS_INVALID: "invalid"}


def end_reason(state: int, reason: str) -> str:
    """The ``kvbaton_lease_ends_total`` label for a lease ending in ``state`` with ``reason``:
    a replacement (a newer turn's grant) is told apart from an explicit revoke, because
    operators read the first as healthy reuse and a burst of the second as churn."""
    if state == EXPIRED:
        return "expired"
    return "replaced" if reason.startswith(_REPLACED_PREFIX) else "revoked"


@dataclasses.dataclass
class LeaseConfig:
    default_ttl_ms: int = 30_000
    # Extra deadline written with a renewal; at most one write per lease per slack.
    max_slack_ms: int = 1_000
    expiry_tick_s: float = 0.05
    tombstone_s: float = 600.0
    flush_batch: int = 64
    # Bounded memory: a grant that would add a live lease beyond this is refused
    # (RESOURCE_EXHAUSTED); re-grants of an existing conversation are always accepted.
    max_live_leases: int = 1_000_000


def _key(prefix: bytes, kind: str, ident: str) -> bytes:
    return prefix + kind.encode() + b"/" + ident.encode()


def _parse(value: bytes) -> pb.LeaseInfo:
    return pb.LeaseInfo.FromString(value)


def _live_pins(info: pb.LeaseInfo, now: int) -> list[pb.PinInfo]:
    return [p for p in info.pins if p.expires_at_ms > now]


def _due_ms(info: pb.LeaseInfo, deadline: int | None = None) -> int:
    """When a live lease may end: its deadline (ACTIVE; the record's unless given) or now
    (DRAINING), and in either case not before its last pin lapses."""
    pinned = max((p.expires_at_ms for p in info.pins), default=0) if info.pins else 0
    if info.state != ACTIVE:
        return pinned
    return max(pinned, info.expires_at_ms if deadline is None else deadline)


def _mod_revision(result: TxnResult) -> int:
    """The revision of the fence a failed txn's failure branch read (0: never written)."""
    kv = result.values[0] if result.values else None
    return kv.mod_revision if kv is not None else 0


def derive_events(ev: WatchEvent) -> Iterable[tuple[str, pb.LeaseEvent]]:
    """GRANTED on creation, DRAINING/EXPIRED/REVOKED on those transitions; routed to
    the lease's engine and to "*" (every engine)."""
    if ev.type is not EventType.PUT or b"/l/" not in ev.kv.key:
        return ()
    new = _parse(ev.kv.value)
    old_state = _parse(ev.prev_kv.value).state if ev.prev_kv is not None and ev.prev_kv.value else None
    if old_state == new.state:
        return ()
    if new.state == ACTIVE and old_state is None:
        kind = pb.LeaseEvent.TYPE_GRANTED
    elif new.state == DRAINING:
        kind = pb.LeaseEvent.TYPE_DRAINING
    elif new.state == EXPIRED:
        kind = pb.LeaseEvent.TYPE_EXPIRED
    elif new.state == REVOKED:
        kind = pb.LeaseEvent.TYPE_REVOKED
    else:
        return ()
    event = pb.LeaseEvent(type=kind, lease=new, revision=ev.revision)
    return ((new.engine_id, event), ("*", event))


class LeaseService:
    """The lease domain, over any ``Store``. Start it with ``start()``."""

    def __init__(
        self,
        store: Store,
        *,
        clock: Clock | None = None,
        config: LeaseConfig | None = None,
        prefix: bytes = b"kvb/lease/",
        metrics: ServiceMetrics | None = None,
        engine_alive=None,
        pair_check=None,
        on_refused=None,
        retention_revision=None,
    ) -> None:
        self.store = store
        self.metrics = metrics or ServiceMetrics()
        self.clock = clock or WallClock()
        self.config = config or LeaseConfig()
        # Optional async predicate (the registrar's): pins are refused on a lease whose
        # decode engine's liveness lapsed, because that engine may free on its hard cap.
        self.engine_alive = engine_alive
        # Optional async (owner_engine_id, reader_engine_id) -> verdict | None (the
        # registrar's pair_verdict): a reuse READ whose KV cannot be mapped is refused at
        # the pin, before any byte moves; on_refused(transfer_id, owner, reader, reason)
        # records it where operators look (the rendezvous' transfers).
        self.pair_check = pair_check
        self.on_refused = on_refused
        # Optional async (conversation_id, retention_id) -> store revision of that retained
        # registration, or None (the registrar's): a Grant for blocks registered before the
        # conversation's lease was revoked is refused (see :meth:`_refuse_if_revoked_since`).
        self.retention_revision = retention_revision
        self.prefix = prefix
        self._lprefix = prefix + b"l/"  # _lkey runs per renewal: no per-call formatting
        self.hub: PrefixHub[pb.LeaseInfo, pb.LeaseEvent] = PrefixHub(
            store, prefix + b"l/", parse=_parse, derive=derive_events, name="leases",
            keep=lambda info: info.state in LIVE_STATES,
        )
        # Renewal batches' deadlines (lease_journal): one watch of the journal records,
        # merged into every read of a deadline.
        self.journal = lease_journal.LeaseJournal()
        self.journal_hub: PrefixHub[lease_journal.JournalBatch, None] = PrefixHub(
            store, prefix + b"j/", parse=lease_journal.decode, derive=lambda _ev: (), name="lease-journal")
        self.journal_hub.listeners.append(self._on_journal)
        self.journal_hub.on_reload.append(self._rebuild_journal)
        self._fence_ends = prefix + b"f/ends"
        self._fence_renewals = prefix + b"f/renewals"
        self._jprefix = prefix + b"j/" + secrets.token_hex(6).encode() + b"-"
        self._jseq = 0
        # Deadlines to write (lease id, deadline), as two columns: a 10,000-renewal batch
        # is appended in C, not 10,000 pairs.
        self._pending_ids: list[str] = []
        self._pending_dls: list[int] = []
        self._groups: list[tuple[list[str], asyncio.Future[set[str]]]] = []  # callers waiting on the flusher
        # Leases that left ACTIVE in the cache (so far): a batch checked against the cache
        # at the same count needs no second check before its journal write.
        self._ends = 0
        self._unchecked = False  # something pending was not checked against the cache (or at another count)
        self._checked_at: int | None = None  # the count the pending writes were checked at
        self._flush_wakeup = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._tombstones = Tombstones(store, self.config.tombstone_s, rotate_s=60.0)
        # conversation -> (lease id, ttl_ms, record deadline) of its ACTIVE lease in the
        # cache: the KeepAlive fast path reads plain tuples, not protobuf fields, per renewal.
        self._active: dict[str, tuple[str, int, int]] = {}
        # When each live record may end, so expiry pops what is due instead of scanning
        # every lease on each tick (kept in step with the cache by _index).
        self._deadlines: DeadlineIndex[bytes] = DeadlineIndex()
        self.hub.listeners.append(self._index)
        self.hub.on_reload.append(self._rebuild_deadlines)
        self.is_leader = lambda: True
        self.stats = {"renewals": 0, "renewal_writes": 0, "journal_writes": 0, "fence_conflicts": 0,
                      "expired": 0, "revoked": 0, "pins": 0}

    # -- lifecycle ---------------------------------------------------------
    async def start(self, *, run_expiry: bool = True) -> None:
        await self.hub.start()
        self._rebuild_active()
        # The journal is loaded before any expiry runs: a replica taking over (or a
        # restart) sees every acknowledged renewal, so it never ends a lease early.
        await self.journal_hub.start()
        self._rebuild_journal()
        self._rebuild_deadlines()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._flusher(), name="lease-flusher"))
        if run_expiry:
            self._tasks.append(loop.create_task(
                leader_ticks("lease.expiry", self.config.expiry_tick_s, lambda: self.is_leader(), self.expire_due),
                name="lease-expiry"))

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        await self.journal_hub.stop()
        await self.hub.stop()

    # -- helpers -----------------------------------------------------------
    def _lkey(self, lease_id: str) -> bytes:
        return self._lprefix + lease_id.encode()

    def _ckey(self, conversation_id: str) -> bytes:
        return _key(self.prefix, "c", conversation_id)

    def _rkey(self, conversation_id: str) -> bytes:
        """A revoke that found no lease (see :meth:`revoke`): what a late first Grant is ordered against."""
        return _key(self.prefix, "r", conversation_id)

    def deadline(self, info: pb.LeaseInfo) -> int:
        """A lease's deadline: its record's, or the journal's when later."""
        journal = self.journal.deadline.get(info.lease_id)
        return journal if journal is not None and journal > info.expires_at_ms else info.expires_at_ms

    def _due(self, info: pb.LeaseInfo) -> int:
        """``_due_ms`` with the journal's deadline."""
        return _due_ms(info, self.deadline(info))

    def _view(self, info: pb.LeaseInfo, now: int | None = None) -> pb.LeaseInfo:
        now = self.clock.now_ms() if now is None else now
        out = pb.LeaseInfo()
        out.CopyFrom(info)
        if info.state in LIVE_STATES:
            out.expires_at_ms = self.deadline(info)
            out.remaining_ms = max(0, out.expires_at_ms - now)
            out.deadline_journaled = info.deadline_journaled or out.expires_at_ms > info.expires_at_ms
        else:
            out.remaining_ms = 0
        return out

    def _folded(self, info: pb.LeaseInfo) -> pb.LeaseInfo:
        """``info`` with the journal's deadline written into the record (a write of the
        record anyway: the record catches up, the journal entry becomes redundant)."""
        out = pb.LeaseInfo()
        out.CopyFrom(info)
        out.expires_at_ms = self.deadline(info)
        return out

    def _ends_put(self) -> Put:
        """Bumps the "ends" fence: a journal write checked against an older cache fails."""
        return Put(self._fence_ends, b"")

    async def _catch_up_renewals(self, result: TxnResult) -> None:
        """After a txn that lost the renewals fence (its failure branch read the fence):
        waits until the journal view holds the journal write that moved it."""
        await self.journal_hub.wait_for(_mod_revision(result))

    def _renewals_fence(self, seen: int | None = None) -> Compare:
        """No journal write after what this replica's journal view had applied when it
        judged the lease due (``seen``; default: now). Take it BEFORE any await between the
        judgement and the write: a view that moves on meanwhile (a renewal arriving) must
        not lend its newer revision to a decision made without that renewal."""
        seen = self.journal_hub.revision if seen is None else seen
        return Compare(self._fence_renewals, CompareTarget.MOD_REVISION, CompareOp.LESS, seen + 1)

    async def _read(self, conversation_id: str) -> tuple[KeyValue | None, KeyValue | None, pb.LeaseInfo | None]:
        ckv = await self.store.get(self._ckey(conversation_id))
        if ckv is None:
            return None, None, None
        lkv = await self.store.get(self._lkey(ckv.value.decode()))
        return ckv, lkv, (_parse(lkv.value) if lkv else None)

    def _ttl(self, ttl_ms: int) -> int:
        return limits.check_range("ttl_ms", ttl_ms, limits.MIN_LEASE_TTL_MS, limits.MAX_LEASE_TTL_MS,
                                  default=self.config.default_ttl_ms)

    def _slack(self, ttl_ms: int) -> int:
        return min(self.config.max_slack_ms, ttl_ms // 4)

    async def _end_ops(self, info: pb.LeaseInfo, state: pb.LeaseState, reason: str, now: int) -> list[Put]:
        """The writes that end ``info`` (terminal record and index, under the tombstone)."""
        tomb = await self._tombstones.lease()
        ended = self._folded(info)
        ended.state = state
        ended.reason = reason
        ended.ended_at_ms = now
        del ended.pins[:]
        return [Put(self._lkey(info.lease_id), ended.SerializeToString(), lease=tomb), self._ends_put()]

    # -- grant -------------------------------------------------------------
    async def grant(
        self,
        conversation_id: str,
        engine_id: str,
        *,
        ttl_ms: int = 0,
        num_blocks: int = 0,
        retention_id: str = "",
        labels: dict[str, str] | None = None,
    ) -> tuple[pb.LeaseInfo, pb.LeaseInfo | None]:
        limits.check_id("conversation_id", conversation_id)
        limits.check_engine_id("engine_id", engine_id)
        limits.check_id("retention_id", retention_id, required=False)
        if num_blocks > limits.MAX_BLOCK_IDS:
            raise invalid(f"num_blocks is {num_blocks}; the limit is {limits.MAX_BLOCK_IDS}")
        ttl = self._ttl(ttl_ms)
        labels = limits.check_labels("labels", labels or {})
        for _ in range(_CAS_RETRIES):
            now = self.clock.now_ms()
            ckv, lkv, old = await self._read(conversation_id)
            if retention_id:
                await self._refuse_if_revoked_since(conversation_id, retention_id, old, lkv)
            if (old is None or old.state not in LIVE_STATES) and len(self.hub.records) >= self.config.max_live_leases:
                raise exhausted(f"{len(self.hub.records)} live leases (limit {self.config.max_live_leases}); "
                                "revoke finished conversations or raise the limit")
            info = pb.LeaseInfo(
                lease_id=secrets.token_hex(8), conversation_id=conversation_id, engine_id=engine_id,
                state=ACTIVE, ttl_ms=ttl, granted_at_ms=now, expires_at_ms=now + ttl,
                num_blocks=num_blocks, retention_id=retention_id, labels=labels,
            )
            ops: list[Put] = [
                Put(self._lkey(info.lease_id), info.SerializeToString()),
                Put(self._ckey(conversation_id), info.lease_id.encode()),
            ]
            compares = [Compare.unchanged(ckv, self._ckey(conversation_id))]
            replaced: pb.LeaseInfo | None = None
            if old is not None and lkv is not None and old.state in LIVE_STATES:
                compares.append(Compare.unchanged(lkv, self._lkey(old.lease_id)))
                reason = f"{_REPLACED_PREFIX}{info.lease_id}"
                if _live_pins(old, now):
                    replaced = self._folded(old)
                    replaced.state = DRAINING
                    replaced.reason = reason
                    ops.append(Put(self._lkey(old.lease_id), replaced.SerializeToString()))
                    ops.append(self._ends_put())
                else:
                    end = await self._end_ops(old, REVOKED, reason, now)
                    replaced = _parse(end[0].value)
                    ops.extend(end)
            elif old is not None:
                replaced = None  # ended already: nothing to free
            result = await self.store.txn(compares, ops)
            if result.succeeded:
                self.metrics.lease_grants.inc()
                if replaced is not None and replaced.state == REVOKED:
                    self.metrics.lease_ends.labels("replaced").inc()
                await self.hub.wait_for(result.revision)
                log.info("lease.granted", conversation_id=conversation_id, lease_id=info.lease_id,
                         engine_id=engine_id, ttl_ms=ttl, replaced=replaced.lease_id if replaced else None)
                return self._view(info, now), (self._view(replaced, now) if replaced else None)
        raise DomainError(Code.ABORTED, f"grant for {conversation_id} kept conflicting; retry")

    async def _refuse_if_revoked_since(self, conversation_id: str, retention_id: str, old: pb.LeaseInfo | None,
                                       lkv: KeyValue | None) -> None:
        """A late Grant must not outlive a revoke.

        Why: decode registers a finished turn's blocks and then leases them from its control
        thread, after the answer left the engine. A client that ends the conversation
        (``Revoke``) in between ends the *previous* turn's lease, or finds none yet on the
        first turn (:meth:`revoke` then leaves a marker); the late Grant would then start a
        fresh lease and decode would hold the last turn's blocks for a whole TTL after the
        client let go. The store orders the two: if the conversation was revoked (its lease
        revoked or draining from a revoke, or the marker written) at a revision after this
        registration was written, the client's revoke covers these blocks too, so the Grant
        is refused with FAILED_PRECONDITION and decode frees them. A registration written
        after the revoke (the conversation went on) is granted as usual."""
        if self.retention_revision is None:
            return
        if old is None:
            marker = await self.store.get(self._rkey(conversation_id))
            if marker is None:
                return
            revoked_at, what = marker.mod_revision, f"conversation {conversation_id} was revoked before its first lease,"
        else:
            if lkv is None or old.reason.startswith(_REPLACED_PREFIX):
                return
            if old.state != REVOKED and not (old.state == DRAINING and old.reason):
                return
            revoked_at = lkv.mod_revision
            what = f"conversation {conversation_id}: lease {old.lease_id} was revoked ({old.reason})"
        registered = await self.retention_revision(conversation_id, retention_id)
        if registered is not None and registered < revoked_at:
            self.metrics.lease_late_grants_refused.inc()
            raise precondition(f"{what} after retention {retention_id} was registered: not granted; free its blocks")

    # -- renew -------------------------------------------------------------
    async def renew(self, conversation_id: str, lease_id: str = "", ttl_ms: int = 0) -> pb.RenewResult:
        """Never raises for a lease-level problem: the status says it (KeepAlive batches)."""
        res = await self._renew(conversation_id, lease_id, ttl_ms)
        self.metrics.lease_renewals.labels(_RENEW_STATUS.get(res.status, "other")).inc()
        return res

    async def _renew(self, conversation_id: str, lease_id: str, ttl_ms: int) -> pb.RenewResult:
        res = pb.RenewResult(conversation_id=conversation_id)
        try:
            limits.check_id("conversation_id", conversation_id)
            limits.check_id("lease_id", lease_id, required=False)
            if ttl_ms:
                self._ttl(ttl_ms)
        except DomainError as exc:
            res.status, res.error = pb.RENEW_STATUS_INVALID, exc.message
            return res
        self.stats["renewals"] += 1
        for attempt in range(3):
            info = self._cached(conversation_id, lease_id) if attempt == 0 else await self._authoritative(conversation_id, lease_id)
            if info is None:
                if attempt == 0:
                    continue  # the cache may lag a grant made on another replica
                res.status, res.error = pb.RENEW_STATUS_NOT_FOUND, f"no lease for conversation {conversation_id}"
                return res
            if lease_id and info.lease_id != lease_id:
                if attempt == 0:
                    continue
                res.status = pb.RENEW_STATUS_SUPERSEDED
                res.error = f"lease {lease_id} was replaced by {info.lease_id}"
                res.lease.CopyFrom(self._view(info))
                return res
            now = self.clock.now_ms()
            if info.state != ACTIVE:
                if attempt == 0:
                    continue
                if lease_id:
                    _, _, current = await self._read(conversation_id)
                    if current is not None and current.lease_id != lease_id:
                        res.status = pb.RENEW_STATUS_SUPERSEDED
                        res.error = f"lease {lease_id} was replaced by {current.lease_id}"
                        res.lease.CopyFrom(self._view(current))
                        return res
                res.status = pb.RENEW_STATUS_ENDED
                res.error = f"lease {info.lease_id} is {pb.LeaseState.Name(info.state)}: {info.reason}"
                res.lease.CopyFrom(self._view(info, now))
                return res
            ttl = ttl_ms or info.ttl_ms
            promised = now + ttl
            if self.deadline(info) < promised:
                try:
                    await self._schedule_write(info.lease_id, promised + self._slack(ttl), ttl)
                except _Stale:
                    continue
                info = self._cached(conversation_id, info.lease_id) or info
            res.status = pb.RENEW_STATUS_OK
            res.lease.CopyFrom(self._view(info, now))
            return res
        res.status, res.error = pb.RENEW_STATUS_NOT_FOUND, f"lease for {conversation_id} changed while renewing; retry"
        return res

    def _cached(self, conversation_id: str, lease_id: str) -> pb.LeaseInfo | None:
        if lease_id:
            entry = self.hub.records.get(self._lkey(lease_id))
            return entry[0] if entry and entry[0].conversation_id == conversation_id else None
        # Current lease of a conversation: the live one in the cache, if any.
        for info, _ in self._by_conversation(conversation_id):
            return info
        return None

    def _by_conversation(self, conversation_id: str) -> list[tuple[pb.LeaseInfo, int]]:
        active = self._active.get(conversation_id)
        entry = self.hub.records.get(self._lkey(active[0])) if active else None
        return [entry] if entry and entry[0].state == ACTIVE else []

    def _index(self, ev: WatchEvent) -> None:
        """Keeps conversation -> ACTIVE lease id and the deadline index in step with the
        cache (hub listener; the hub has already parsed and cached a live record)."""
        if ev.type is not EventType.PUT:
            self._ends += 1
            self._deadlines.drop(ev.kv.key)
            lease_id = ev.kv.key[len(self._lprefix):].decode()
            self.journal.forget(lease_id)
            removed = self.hub.removed
            if removed is not None:  # a live record deleted (not by kvbaton): nothing to renew
                active = self._active.get(removed[0].conversation_id)
                if active is not None and active[0] == lease_id:
                    del self._active[removed[0].conversation_id]
            return
        entry = self.hub.records.get(ev.kv.key)
        if entry is not None:
            info, rev = entry
            self._deadlines.arm(ev.kv.key, _due_ms(info), rev)
        else:
            self._deadlines.drop(ev.kv.key, ev.kv.mod_revision)  # ended: nothing left to expire
            info = _parse(ev.kv.value)
            self.journal.forget(info.lease_id)
        if info.state != ACTIVE:
            self._ends += 1
        if info.state == ACTIVE:
            self._active[info.conversation_id] = (info.lease_id, info.ttl_ms, info.expires_at_ms)
        else:
            active = self._active.get(info.conversation_id)
            if active is not None and active[0] == info.lease_id:
                del self._active[info.conversation_id]

    def _rebuild_active(self) -> None:
        self._active.clear()
        for info, _ in self.hub.records.values():
            if info.state == ACTIVE:
                self._active[info.conversation_id] = (info.lease_id, info.ttl_ms, info.expires_at_ms)

    async def _authoritative(self, conversation_id: str, lease_id: str) -> pb.LeaseInfo | None:
        if lease_id:
            kv = await self.store.get(self._lkey(lease_id))
            info = _parse(kv.value) if kv else None
            if info is not None and info.conversation_id != conversation_id:
                return None
            return info
        _, _, info = await self._read(conversation_id)
        return info

    async def _schedule_write(self, lease_id: str, deadline: int, ttl: int) -> None:
        if lease_id in await self._enqueue_writes([(lease_id, deadline)]):
            raise _Stale()

    def _enqueue_writes(self, writes: Sequence[tuple[str, int]], checked: int | None = None, *,
                        ids: list[str] | None = None, deadlines: list[int] | None = None) -> asyncio.Future[set[str]]:
        """Hands deadlines to the group-commit flusher (as ``(lease id, deadline)`` pairs,
        or as the two columns ``ids`` / ``deadlines``). One future for the whole group (a
        KeepAlive batch of 10,000 is one future, not 10,000): it resolves, once every
        deadline is written, to the lease ids that were not (the lease changed first:
        stale), or fails with the store's error."""
        fut: asyncio.Future[set[str]] = asyncio.get_running_loop().create_future()
        if ids is None or deadlines is None:
            ids, deadlines = [lease_id for lease_id, _ in writes], [deadline for _, deadline in writes]
        # Columns, appended in C; a lease named twice (two groups) is merged by the flusher.
        self._pending_ids.extend(ids)
        self._pending_dls.extend(deadlines)
        self._groups.append((ids, fut))
        if checked is None or self._checked_at not in (None, checked):
            self._unchecked = True
        self._checked_at = checked
        self._flush_wakeup.set()
        return fut

    async def _flusher(self) -> None:
        """Group commit: every renewal that needs a write waits here, then all that are
        due are written together: one transaction per ``flush_batch`` leases, each
        compare-and-swapped against the version the cache holds (a conflict falls back to
        per-lease read-CAS)."""
        while True:
            await self._flush_wakeup.wait()
            self._flush_wakeup.clear()
            ids, dls = self._pending_ids, self._pending_dls
            self._pending_ids, self._pending_dls = [], []
            groups, self._groups = self._groups, []
            # Checked, and no lease left ACTIVE since: the journal write needs no second check.
            checked = not self._unchecked and self._checked_at == self._ends
            self._unchecked, self._checked_at = False, None
            try:
                stale: set[str] = set()
                failed: dict[str, BaseException] = {}
                items: list[tuple[str, int]] = []
                try:
                    if len(set(ids)) < len(ids):  # a lease named twice (two groups): its latest deadline
                        latest: dict[str, int] = {}
                        for lease_id, deadline in zip(ids, dls):
                            if latest.get(lease_id, 0) < deadline:
                                latest[lease_id] = deadline
                        ids, dls = list(latest), list(latest.values())
                    stale, items = await self._flush_journal(None, checked=checked, columns=(ids, dls))
                except Exception as exc:  # noqa: BLE001 - the store failed: every renewal of this flush fails with it
                    failed.update((lease_id, exc) for lease_id in ids)
                    items = []
                size = self.config.flush_batch
                chunks = [items[i : i + size] for i in range(0, len(items), size)]
                outcomes = await asyncio.gather(*(self._flush_chunk(chunk) for chunk in chunks), return_exceptions=True)
                for chunk, outcome in zip(chunks, outcomes):
                    if isinstance(outcome, BaseException):
                        failed.update((lease_id, outcome) for lease_id, _ in chunk)
                    else:
                        stale |= outcome
                for lease_ids, fut in groups:
                    if fut.done():
                        continue
                    error = next((failed[i] for i in lease_ids if i in failed), None) if failed else None
                    if error is not None:
                        fut.set_exception(error)
                    else:
                        fut.set_result({i for i in lease_ids if i in stale} if stale else set())
            except Exception:  # the flusher must outlive one bad flush; its callers fail below
                log.warning("lease.flush_failed", exc_info=True)
            finally:
                # Cancelled mid-flush (stop()): nobody may wait forever.
                for _, fut in groups:
                    if not fut.done():
                        fut.set_exception(DomainError(Code.UNAVAILABLE, "lease service stopping; retry"))

    async def _flush_journal(self, items: list[tuple[str, int]] | None, *, checked: bool = False,
                             columns: tuple[list[str], list[int]] | None = None) -> tuple[set[str], list[tuple[str, int]]]:
        """Writes the deadlines of every lease live in this replica's cache as journal
        records, in one transaction fenced by "ends" (no lease ended after the cache's
        revision, so each is still ACTIVE when it commits). Returns the lease ids that
        ended (stale) and what is left for per-lease writes: leases the cache does not
        hold (granted on another replica a moment ago), or the whole batch when ends kept
        racing the fence. ``checked``: every lease was found ACTIVE in the cache and none
        has left ACTIVE since, so the first attempt skips checking them again. ``columns``:
        the same as two lists (lease ids unique), instead of ``items``: a checked batch then
        never builds a pair per renewal."""
        if items is None:
            if columns is None:
                raise ValueError("_flush_journal needs items or columns")
            if len(columns[0]) > lease_journal.MAX_ENTRIES or not checked:
                items, columns = list(zip(columns[0], columns[1])), None
        else:
            columns = None
        pairs: list[tuple[str, int]] = items if items is not None else []  # built below only if needed
        step = lease_journal.MAX_ENTRIES
        if len(pairs) > step:
            # One record (and one transaction: etcd's request limit is 1.5 MiB) per chunk.
            stale_all: set[str] = set()
            rest_all: list[tuple[str, int]] = []
            ends = self._ends
            for i in range(0, len(pairs), step):
                # Still checked only while no lease has left ACTIVE since.
                chunk_stale, chunk_rest = await self._flush_journal(pairs[i:i + step], checked=checked and self._ends == ends)
                stale_all |= chunk_stale
                rest_all += chunk_rest
            return stale_all, rest_all
        records, lprefix = self.hub.records, self._lprefix
        for attempt in range(_FENCE_RETRIES):
            seen = self.hub.revision
            ids: list[str] = []
            deadlines: list[int] = []
            stale: set[str] = set()
            rest: list[tuple[str, int]] = []
            if checked and attempt == 0:
                ids, deadlines = columns if columns is not None else (list(map(_FIRST, pairs)), list(map(_SECOND, pairs)))
            elif columns is not None:
                pairs, columns = list(zip(columns[0], columns[1])), None
            for lease_id, deadline in (() if ids else pairs):
                entry = records.get(lprefix + lease_id.encode())
                if entry is None:
                    rest.append((lease_id, deadline))
                elif entry[0].state != ACTIVE:
                    stale.add(lease_id)
                elif self.deadline(entry[0]) < deadline:
                    ids.append(lease_id)
                    deadlines.append(deadline)
            if not ids:
                return stale, rest
            self._jseq += 1
            record = self._jprefix + b"%016x" % self._jseq
            value = lease_journal.encode(ids, deadlines)
            puts = [Put(record, value), Put(self._fence_renewals, b"")]
            fence = Compare(self._fence_ends, CompareTarget.MOD_REVISION, CompareOp.LESS, seen + 1)
            # Its watch event is cached without decoding the record again (10,000 ids split
            # and checked): the journal hub takes the batch this replica already holds.
            result = await self.journal_hub.txn_preparsed(
                {value: lease_journal.JournalBatch(ids, array.array("q", deadlines))}, [fence], puts,
                [Get(self._fence_ends)])
            if result.succeeded:
                self.journal.note(ids, deadlines, record, unique=True)
                self.stats["renewal_writes"] += len(ids)
                self.stats["journal_writes"] += len(puts) - 1
                self.metrics.lease_renewal_writes.inc(len(ids))
                self.metrics.lease_renewal_txns.inc()
                return stale, rest
            # A lease ended after the cache's revision: catch up (to the revision of that
            # end, which the lease watch carries) and check again.
            self.stats["fence_conflicts"] += 1
            await self.hub.wait_for(_mod_revision(result))
        return set(), pairs if columns is None else list(zip(columns[0], columns[1]))

    def _on_journal(self, ev: WatchEvent) -> None:
        """Journal hub listener: merges a record (or its deletion) into ``journal``."""
        if ev.type is not EventType.PUT:
            self.journal.apply_delete(ev.kv.key)
            return
        entry = self.journal_hub.records.get(ev.kv.key)
        if entry is None:
            return
        # Only a lease cache at least as new as the record can say a lease already ended.
        ended = self._ended if self.hub.revision >= ev.revision else None
        self.journal.apply_put(ev.kv.key, entry[0], ev.revision, ended)

    def _ended(self, lease_ids: list[str]) -> set[str]:
        """Which of ``lease_ids`` this replica's cache no longer holds as live (ended).
        Column-wise (a journal record names up to 32,768 leases, usually all live)."""
        live = list(map(self.hub.records.__contains__, map(self._lprefix.__add__, map(str.encode, lease_ids))))
        return set(compress(lease_ids, map(not_, live))) if not all(live) else set()

    def _rebuild_journal(self) -> None:
        self.journal.clear()
        for key, (batch, rev) in sorted(self.journal_hub.records.items(), key=lambda kv: kv[1][1]):
            ended = self._ended if self.hub.revision >= rev else None
            self.journal.apply_put(key, batch, rev, ended)

    async def collect_journal(self) -> int:
        """Deletes journal records that say nothing any more (leader only): returns how many."""
        keys = self.journal.deletable(self.clock.now_ms(), _JOURNAL_DELETES)
        if not keys:
            return 0
        await self.store.txn([], [Delete(k) for k in keys])
        return len(keys)

    async def _flush_chunk(self, chunk: list[tuple[str, int]]) -> set[str]:
        """Writes one chunk; returns the lease ids that could not be written (stale).
        A store error for any lease raises (its renewals fail UNAVAILABLE)."""
        outcomes: dict[str, bool | BaseException] = {}
        try:
            outcomes.update(await self._write_batch(chunk))
        except Exception as exc:  # noqa: BLE001 - a store hiccup: the per-lease path below decides
            log.debug("lease.batch_flush_failed", error=str(exc))
        rest = [(lid, dl) for lid, dl in chunk if lid not in outcomes]
        if rest:
            results = await asyncio.gather(*(self._write_deadline(lid, dl) for lid, dl in rest), return_exceptions=True)
            outcomes.update({lid: r for (lid, _), r in zip(rest, results)})
        stale: set[str] = set()
        for lid, outcome in outcomes.items():
            if isinstance(outcome, BaseException):
                raise outcome
            if not outcome:
                stale.add(lid)
        return stale

    async def _write_batch(self, due: list[tuple[str, int]]) -> dict[str, bool]:
        """One transaction for every lease whose cached record is usable; {} on conflict.
        The new records go to the hub already parsed: applying the watch event then costs
        a dictionary lookup instead of a parse per renewal."""
        compares, puts, done = [], [], {}
        records, parsed = self.hub.records, {}
        for lease_id, deadline in due:
            key = self._lkey(lease_id)
            entry = records.get(key)
            if entry is None or entry[0].state != ACTIVE:
                continue
            info, rev = entry
            if info.expires_at_ms >= deadline:
                done[lease_id] = True
                continue
            new = pb.LeaseInfo()
            new.CopyFrom(info)
            new.expires_at_ms = deadline
            new.renewals += 1
            value = new.SerializeToString()
            compares.append(Compare(key, CompareTarget.MOD_REVISION, CompareOp.EQUAL, rev))
            puts.append((lease_id, Put(key, value)))
            parsed[value] = new
        if not puts:
            return done
        result = await self.hub.txn_preparsed(parsed, compares, [p for _, p in puts])
        if not result.succeeded:
            return done
        self.stats["renewal_writes"] += len(puts)
        self.metrics.lease_renewal_writes.inc(len(puts))
        self.metrics.lease_renewal_txns.inc()
        await self.hub.wait_for(result.revision)
        done.update({lease_id: True for lease_id, _ in puts})
        return done

    async def _write_deadline(self, lease_id: str, deadline: int) -> bool:
        key = self._lkey(lease_id)
        for _ in range(4):
            kv = await self.store.get(key)
            if kv is None:
                return False
            info = _parse(kv.value)
            if info.state != ACTIVE:
                return False
            if info.expires_at_ms >= deadline:
                return True
            info.expires_at_ms = deadline
            info.renewals += 1
            result = await self.store.txn([Compare.unchanged(kv, key)], [Put(key, info.SerializeToString())])
            if result.succeeded:
                self.stats["renewal_writes"] += 1
                self.metrics.lease_renewal_writes.inc()
                self.metrics.lease_renewal_txns.inc()
                await self.hub.wait_for(result.revision)
                return True
        return False

    async def keepalive(self, batch: Sequence[pb.RenewRequest], into: pb.KeepAliveResponse | None = None, *,
                        compact: bool = False, conversation_ids: Sequence[str] = ()) -> list[pb.RenewResult]:
        """Renews a batch. The common case (the conversation's ACTIVE lease in this
        replica's cache, its own TTL) is decided in one synchronous pass over plain tuples
        (``_active``), with the deadlines that are due handed to the flusher together, so a
        batch costs about a microsecond per renewal; anything else (a cache miss, a new TTL,
        an ended lease, a lost race) takes ``renew``. With ``into``, the answer is built in
        that response. ``compact``: the answer holds a result only for each renewal that
        was NOT renewed (``result_index`` says which) and packed lease ids / deadlines /
        TTLs for all (no message per renewal: building and sending 10,000 ``LeaseInfo``
        cost more than renewing them); returns those results. Otherwise one result per
        renewal, returned in order. ``conversation_ids``: more renewals after ``batch``,
        by conversation only (packed: no message each)."""
        n = len(batch) + len(conversation_ids)
        if n > limits.MAX_KEEPALIVE_BATCH:
            raise invalid(f"{n} renewals in one message; the limit is {limits.MAX_KEEPALIVE_BATCH}")
        now = self.clock.now_ms()
        out = into if into is not None else pb.KeepAliveResponse()
        jget = self.journal.deadline.get
        checked = self._ends  # every lease the scan decides is ACTIVE in the cache as of this count
        sc = renewal_scan.scan(batch, now, self._active, self.hub.records, self._lprefix, jget, self.config.max_slack_ms,
                               with_records=not compact, conversation_ids=conversation_ids)
        lids, dls, ttls, infos, slow = sc.lids, sc.dls, sc.ttls, sc.infos, sc.slow
        if sc.w_at:
            stale = await self._enqueue_writes((), checked, ids=sc.w_lids, deadlines=sc.w_dls)
            # The deadline answered is the one this renewal wrote (a renewal racing it may
            # have journaled a later one: the lease lives at least as long as answered).
            written = sc.w_dls
            if len(sc.w_at) == n and not stale:
                dls = written
            else:
                for i, lid, deadline in zip(sc.w_at, sc.w_lids, written):
                    if stale and lid in stale:
                        slow.append(i)
                        lids[i], ttls[i], infos[i] = "", 0, None
                    else:
                        dls[i] = deadline
        fast = n - len(slow)
        self.stats["renewals"] += fast
        if fast:
            self.metrics.lease_renewals.labels("ok").inc(fast)
        slow_results: list[pb.RenewResult] = []
        if slow:
            slow.sort()
            reqs = renewal_scan.requests(batch, conversation_ids)
            slow_results = await asyncio.gather(*(self.renew(reqs[i].conversation_id, reqs[i].lease_id, reqs[i].ttl_ms)
                                                  for i in slow))
        if compact:
            return self._compact_answer(out, now, slow, slow_results, lids, dls, ttls)
        results = [out.results.add() for _ in range(n)]
        renewed = self._renewed
        for i, info in enumerate(infos):
            if info is not None:
                renewed(results[i], info.conversation_id, info, now, dls[i])
        for i, res in zip(slow, slow_results):
            results[i].CopyFrom(res)
        return results

    @staticmethod
    def _compact_answer(out: pb.KeepAliveResponse, now: int, slow: list[int], slow_results: Sequence[pb.RenewResult],
                        lids: list[str], dls: list[int], ttls: list[int]) -> list[pb.RenewResult]:
        """Fills a compact KeepAlive answer (packed columns; a result only per renewal that
        was not renewed) and returns those results."""
        out.compact = True
        out.now_ms = now
        failed: list[pb.RenewResult] = []
        for i, res in zip(slow, slow_results):
            if res.status == pb.RENEW_STATUS_OK:
                lids[i], dls[i], ttls[i] = res.lease.lease_id, res.lease.expires_at_ms, res.lease.ttl_ms
            else:
                out.result_index.append(i)
                failed.append(res)
        out.results.extend(failed)
        out.renewed = len(lids) - len(failed)
        out.lease_ids.extend(lids)
        out.expires_at_ms.extend(dls)
        out.ttl_ms.extend(ttls)
        return failed

    @staticmethod
    def _renewed(res: pb.RenewResult, conversation_id: str, info: pb.LeaseInfo, now: int, deadline: int) -> None:
        res.conversation_id = conversation_id
        res.status = pb.RENEW_STATUS_OK
        lease = res.lease
        lease.CopyFrom(info)
        lease.expires_at_ms = deadline
        lease.remaining_ms = max(0, deadline - now)
        lease.deadline_journaled = deadline > info.expires_at_ms

    # -- pins --------------------------------------------------------------
    async def _lease_of(self, conversation_id: str, lease_id: str) -> tuple[KeyValue, pb.LeaseInfo]:
        """The authoritative record of ``lease_id``, which must be ``conversation_id``'s."""
        kv = await self.store.get(self._lkey(lease_id))
        if kv is None:
            raise not_found(f"lease {lease_id} not found")
        info = _parse(kv.value)
        if info.conversation_id != conversation_id:
            raise invalid(f"lease {lease_id} belongs to another conversation")
        return kv, info

    async def pin(self, conversation_id: str, lease_id: str, reader: str, ttl_ms: int = 0,
                  reader_engine_id: str = "") -> tuple[pb.PinInfo, pb.LeaseInfo]:
        limits.check_id("conversation_id", conversation_id)
        limits.check_id("lease_id", lease_id)
        limits.check_id("reader", reader)
        limits.check_id("reader_engine_id", reader_engine_id, required=False)
        ttl = limits.check_range("ttl_ms", ttl_ms, 1, limits.MAX_PIN_TTL_MS, default=limits.DEFAULT_PIN_TTL_MS)
        key = self._lkey(lease_id)
        for _ in range(_CAS_RETRIES):
            kv, info = await self._lease_of(conversation_id, lease_id)
            now = self.clock.now_ms()
            if self.engine_alive is not None and not await self.engine_alive(info.engine_id):
                # Its liveness lapsed: it may be cut off from us and free the blocks on its
                # local hard cap at any moment, so nobody may start a read now.
                self.metrics.lease_pin_refusals.labels("engine_gone").inc()
                raise precondition(f"lease {lease_id}: engine {info.engine_id} is not registered (liveness lapsed): not pinned")
            if reader_engine_id and self.pair_check is not None:
                await self._check_pair(info, reader_engine_id)
            if info.state != ACTIVE:
                self.metrics.lease_pin_refusals.labels("ended").inc()
                raise precondition(f"lease {lease_id} is {pb.LeaseState.Name(info.state)} ({info.reason}): not pinned")
            if now >= self.deadline(info):
                self.metrics.lease_pin_refusals.labels("past_deadline").inc()
                raise precondition(f"lease {lease_id} is past its deadline by {now - self.deadline(info)} ms: not pinned")
            live = _live_pins(info, now)
            if len(live) >= MAX_PINS:
                self.metrics.lease_pin_refusals.labels("too_many").inc()
                raise exhausted(f"lease {lease_id} already has {len(live)} pins; the limit is {MAX_PINS}")
            pin = pb.PinInfo(pin_id=secrets.token_hex(6), reader=reader, expires_at_ms=now + ttl)
            info = self._folded(info)
            del info.pins[:]
            info.pins.extend(live)
            info.pins.append(pin)
            result = await self.store.txn([Compare.unchanged(kv, key)], [Put(key, info.SerializeToString())])
            if result.succeeded:
                self.stats["pins"] += 1
                self.metrics.lease_pins.inc()
                await self.hub.wait_for(result.revision)
                log.info("lease.pinned", conversation_id=conversation_id, lease_id=lease_id, reader=reader, pin_id=pin.pin_id)
                return pin, self._view(info, now)
        raise DomainError(Code.ABORTED, f"pin on {lease_id} kept conflicting; retry")

    async def _check_pair(self, info: pb.LeaseInfo, reader_engine_id: str) -> None:
        """Refuse the pin (FAILED_PRECONDITION) when the reader's KV cannot take the lease's
        engine's blocks, and record the refusal as a failed transfer."""
        verdict = await self.pair_check(info.engine_id, reader_engine_id)
        if verdict is None or not verdict.reason:
            return
        self.metrics.lease_pin_refusals.labels("incompatible").inc()
        reason = (f"incompatible KV: reuse READ of decode {info.engine_id} by prefill {reader_engine_id}: "
                  f"{verdict.reason}")
        if self.on_refused is not None:
            try:
                await self.on_refused(f"reuse-{info.lease_id}-{reader_engine_id}"[:limits.MAX_ID_BYTES], info.engine_id,
                                      reader_engine_id, reason)
            except Exception:  # the refusal stands even if recording it failed
                log.warning("lease.refusal_not_recorded", lease_id=info.lease_id, exc_info=True)
        raise precondition(f"lease {info.lease_id}: {reason}: not pinned")

    async def unpin(self, conversation_id: str, lease_id: str, pin_id: str) -> pb.LeaseInfo:
        limits.check_id("conversation_id", conversation_id)
        limits.check_id("lease_id", lease_id)
        limits.check_id("pin_id", pin_id)
        key = self._lkey(lease_id)
        for _ in range(_CAS_RETRIES):
            kv, info = await self._lease_of(conversation_id, lease_id)
            if info.state in TERMINAL_STATES or not any(p.pin_id == pin_id for p in info.pins):
                return self._view(info)  # idempotent: already gone
            now = self.clock.now_ms()
            remaining = [p for p in _live_pins(info, now) if p.pin_id != pin_id]
            del info.pins[:]
            info.pins.extend(remaining)
            compares = [Compare.unchanged(kv, key)]
            if not remaining and info.state == DRAINING:
                ops = await self._end_ops(info, REVOKED, info.reason, now)
            elif not remaining and now >= self.deadline(info):
                # Ends on its deadline: only if no renewal this replica has not seen was journaled.
                compares.append(self._renewals_fence())
                ops = await self._end_ops(info, EXPIRED, "ttl elapsed (ended at unpin)", now)
            else:
                ops = [Put(key, self._folded(info).SerializeToString())]
            result = await self.store.txn(compares, ops, [Get(self._fence_renewals)])
            if result.succeeded:
                final = _parse(ops[0].value)
                if final.state in TERMINAL_STATES:
                    self.metrics.lease_ends.labels(end_reason(final.state, final.reason)).inc()
                await self.hub.wait_for(result.revision)
                return self._view(final, now)
            await self._catch_up_renewals(result)  # a renewal fence may have lost: catch up
        raise DomainError(Code.ABORTED, f"unpin on {lease_id} kept conflicting; retry")

    # -- revoke ------------------------------------------------------------
    async def revoke(self, conversation_id: str, lease_id: str = "", reason: str = "") -> pb.LeaseInfo:
        limits.check_id("conversation_id", conversation_id)
        limits.check_id("lease_id", lease_id, required=False)
        reason = limits.check_text("reason", reason) or "revoked"
        for _ in range(_CAS_RETRIES):
            if lease_id:
                kv = await self.store.get(self._lkey(lease_id))
                info = _parse(kv.value) if kv else None
                if info is not None and info.conversation_id != conversation_id:
                    raise invalid(f"lease {lease_id} belongs to another conversation")
            else:
                _, kv, info = await self._read(conversation_id)
            if info is None or kv is None:
                if not lease_id:
                    # Decode may still be about to lease the conversation's first turn (its
                    # Grant follows the answer): remember the revoke, under the tombstone
                    # lease, so that Grant is refused (``_refuse_if_revoked_since``).
                    await self.store.put(self._rkey(conversation_id), b"", lease=await self._tombstones.lease())
                raise not_found(f"no lease {lease_id or ''} for conversation {conversation_id}".replace("  ", " "))
            if info.state in TERMINAL_STATES:
                return self._view(info)
            now = self.clock.now_ms()
            key = self._lkey(info.lease_id)
            if _live_pins(info, now):
                info = self._folded(info)
                info.state = DRAINING
                info.reason = reason
                ops = [Put(key, info.SerializeToString()), self._ends_put()]
            else:
                ops = await self._end_ops(info, REVOKED, reason, now)
            result = await self.store.txn([Compare.unchanged(kv, key)], ops)
            if result.succeeded:
                self.stats["revoked"] += 1
                if _parse(ops[0].value).state == REVOKED:
                    self.metrics.lease_ends.labels("revoked").inc()
                await self.hub.wait_for(result.revision)
                log.info("lease.revoked", conversation_id=conversation_id, lease_id=info.lease_id, reason=reason)
                return self._view(_parse(ops[0].value), now)
        raise DomainError(Code.ABORTED, f"revoke of {conversation_id} kept conflicting; retry")

    # -- reads -------------------------------------------------------------
    async def get(self, conversation_id: str) -> pb.LeaseInfo:
        limits.check_id("conversation_id", conversation_id)
        _, _, info = await self._read(conversation_id)
        if info is None:
            raise not_found(f"no lease for conversation {conversation_id}")
        return self._view(info)

    async def list(
        self, *, engine_id: str = "", states: Sequence[int] = (), expiring_within_ms: int = 0, limit: int = 0
    ) -> list[pb.LeaseInfo]:
        now = self.clock.now_ms()
        out = await self._matching(engine_id, states, expiring_within_ms, now)
        if limit:
            out = out[:limit]
        return [self._view(i, now) for i in out]

    async def list_page(
        self, *, engine_id: str = "", states: Sequence[int] = (), expiring_within_ms: int = 0, limit: int = 0,
        page_size: int = 0, page_token: str = "",
    ) -> tuple[builtins.list[pb.LeaseInfo], str]:
        """One page, by deadline (then lease id), and the next page's token."""
        now = self.clock.now_ms()
        out = await self._matching(engine_id, states, expiring_within_ms, now)
        page, token = paging.paginate(out, key=lambda i: (i.expires_at_ms, i.lease_id), size=lambda i: i.ByteSize(),
                                      kind="leases", page_size=paging.page_size(page_size, limit), page_token=page_token)
        return [self._view(i, now) for i in page], token

    async def _matching(self, engine_id: str, states: Sequence[int], expiring_within_ms: int, now: int) -> builtins.list[pb.LeaseInfo]:
        limits.check_id("engine_id", engine_id, required=False)
        wanted = set(states) or set(LIVE_STATES)
        if wanted - set(LIVE_STATES):
            kvs, _ = await self.store.range(self.prefix + b"l/")
            infos = [_parse(kv.value) for kv in kvs]
        else:
            infos = [info for info, _ in self.hub.records.values()]
        out = [
            self._with_deadline(i) for i in infos
            if i.state in wanted
            and (not engine_id or i.engine_id == engine_id)
        ]
        if expiring_within_ms:
            out = [i for i in out if i.expires_at_ms - now <= expiring_within_ms]
        out.sort(key=lambda i: (i.expires_at_ms, i.lease_id))
        return out

    def _with_deadline(self, info: pb.LeaseInfo) -> pb.LeaseInfo:
        """``info`` itself, or a copy carrying the journal's later deadline (cached
        records are shared: never changed in place)."""
        if info.state not in LIVE_STATES or self.deadline(info) == info.expires_at_ms:
            return info
        out = self._folded(info)
        out.deadline_journaled = True  # (a listing's copy, never stored)
        return out

    async def watch(self, engine_id: str = "", *, snapshot: bool = False, after_revision: int = 0) -> AsyncIterator[pb.LeaseEvent]:
        limits.check_id("engine_id", engine_id, required=False)
        route = engine_id or "*"
        if snapshot:
            for info, rev in list(self.hub.records.values()):
                if engine_id and info.engine_id != engine_id:
                    continue
                kind = pb.LeaseEvent.TYPE_GRANTED if info.state == ACTIVE else pb.LeaseEvent.TYPE_DRAINING
                yield pb.LeaseEvent(type=kind, lease=self._view(info), revision=rev)
            after_revision = after_revision or self.hub.revision
        async for _, event in self.hub.subscribe(route, after_revision):
            yield event

    # -- expiry ------------------------------------------------------------
    def _rebuild_deadlines(self) -> None:
        self._ends += 1  # the cache was reloaded: what was checked against it is checked again
        self._rebuild_active()
        self._deadlines.clear()
        for key, (info, rev) in self.hub.records.items():
            self._deadlines.arm(key, _due_ms(info), rev)

    async def expire_due(self) -> int:
        """Ends every lease that is due by this clock; returns how many it ended. Pops the
        deadline index, so a tick with nothing due costs O(1) however many leases live."""
        now = self.clock.now_ms()
        seen = self.journal_hub.revision  # the journal view every decision below is made on
        due: list[tuple[bytes, pb.LeaseInfo, int]] = []
        for key, rev in list(self._deadlines.pop_due(now)):
            entry = self.hub.records.get(key)
            if entry is None or entry[1] != rev:
                continue  # ended or changed since: a newer entry (if any) is armed
            info = entry[0]
            if _live_pins(info, now) or (info.state == ACTIVE and now < self.deadline(info)):
                self._deadlines.arm(key, max(self._due(info), now + 1), rev)  # re-armed: not ready yet
                continue
            due.append((key, info, rev))
        ended = 0
        for i, (key, info, rev) in enumerate(due):
            try:
                if i and i % END_YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # decisions stay fenced on `seen`, as across etcd's awaits
                ended += await self._end_due(key, info, rev, now, seen)
            except BaseException:
                # The store failed mid-tick: what was popped but not ended goes back.
                for k, _, r in due[i:]:
                    self._deadlines.arm(k, now, r)
                raise
        await self.collect_journal()
        return ended

    async def _end_due(self, key: bytes, info: pb.LeaseInfo, rev: int, now: int, seen: int) -> int:
        state = REVOKED if info.state == DRAINING else EXPIRED
        reason = info.reason if info.state == DRAINING else f"ttl {info.ttl_ms} ms elapsed without renewal"
        ops = await self._end_ops(info, state, reason, now)
        cmp = Compare(key, CompareTarget.MOD_REVISION, CompareOp.EQUAL, rev)
        # An expiry also requires that no renewal was journaled after what this replica's
        # journal view holds (DRAINING ends on its pins alone: no renewal can save it).
        compares = [cmp, self._renewals_fence(seen)] if state == EXPIRED else [cmp]
        result = await self.store.txn(compares, ops, [Get(self._fence_renewals)])
        if not result.succeeded:
            entry = self.hub.records.get(key)
            if entry is not None and entry[1] == rev:
                # The record is unchanged: a renewal was journaled that this view lacks.
                # Catch up and look again on the next tick.
                self.stats["fence_conflicts"] += 1
                await self._catch_up_renewals(result)
                self._deadlines.arm(key, max(self._due(info), now + 1), rev)
            return 0  # changed under us (a renewal raced the tick): its new record has its own entry
        self.stats["expired" if state == EXPIRED else "revoked"] += 1
        self.metrics.lease_ends.labels(end_reason(state, reason)).inc()
        log.info("lease.ended", conversation_id=info.conversation_id, lease_id=info.lease_id,
                 state=pb.LeaseState.Name(state), reason=reason)
        return 1


class _Stale(Exception):
    """The lease changed before the renewal could be written; re-read and retry."""
