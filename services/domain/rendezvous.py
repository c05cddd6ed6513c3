"""Rendezvous: decode offers × prefill completions, matched in either order.

One record per transfer (``<prefix>t/<transfer_id>`` holding ``TransferState``) and every
change is a compare-and-swap on it, so with any number of replicas exactly one message
makes the match. Events are derived from record transitions (with the previous value)
and routed by engine: the prefill engine's ranks get MATCH; the owners of a side get
EXPIRED, CANCELLED and DONE.

Attempts: every message carries ``attempt``. A message for an older attempt than the
record's is refused (FAILED_PRECONDITION); a newer attempt supersedes the record (the
old sides' owners are told CANCELLED so they free their blocks). Only a party of the
record (an engine on a side, or named by one) may start a newer attempt, and by at most
``limits.MAX_ATTEMPT_STEP`` (PERMISSION_DENIED / INVALID_ARGUMENT otherwise).

Binding: a side may name the engine it expects on the other side (``peer_engine_id``,
from the router). A message from an engine the existing side did not name is refused
(PERMISSION_DENIED); an existing side from an engine the incoming message did not name
is dropped (it was never the router's choice) and the incoming side recorded. So a
transfer whose sides both name their peers is only ever matched between those two: an
impostor can make it expire (if it knows the transfer id), never read or write its KV. The same message twice
is a duplicate and answered with the current state; a different message for a side that
is already there is a conflict (FAILED_PRECONDITION).

Compatibility: when both sides are there, the two engines' registered KV (TP sizes, KV
heads, dtype, layout, block size; ``kvbaton.kvgeometry``) is judged before the match is
made. A pair that cannot be mapped never matches: the transfer FAILS at once with the
reason (decode recomputes, prefill frees), and a pair that can records which prefill ranks
write (``writer_ranks``), one outcome expected from each.

A matched transfer ends when every writer reported (SUCCEEDED/FAILED) or when its match
deadline passes without that (FAILED), so decode never waits forever. A decode engine
may not cancel a matched transfer: the writer may be writing into its blocks; the
writer may (it then promises not to write).
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import time
from collections.abc import AsyncIterator, Container, Iterable, Sequence
from typing import Any, NamedTuple

import structlog

from kvbaton import logs
from kvbaton.v1 import rendezvous_pb2 as pb

from ..metrics import ServiceMetrics
from ..store.base import Compare, EventType, Get, KeyValue, Put, Store, WatchEvent
from . import limits, paging
from .background import Tombstones, cancel_all, leader_ticks
from .clock import Clock, WallClock
from .deadlines import END_YIELD_EVERY, DeadlineIndex
from .errors import Code, DomainError, denied, exhausted, invalid, not_found, precondition
from .hub import PrefixHub

log = structlog.get_logger(__name__)

P = pb.TransferPhase
OFFERED, COMPLETED, MATCHED = pb.TRANSFER_PHASE_OFFERED, pb.TRANSFER_PHASE_COMPLETED, pb.TRANSFER_PHASE_MATCHED
SUCCEEDED, FAILED = pb.TRANSFER_PHASE_SUCCEEDED, pb.TRANSFER_PHASE_FAILED
EXPIRED, CANCELLED = pb.TRANSFER_PHASE_EXPIRED, pb.TRANSFER_PHASE_CANCELLED
PENDING = (OFFERED, COMPLETED)
TERMINAL = (SUCCEEDED, FAILED, EXPIRED, CANCELLED)
Ev = pb.RendezvousEvent
_CAS_RETRIES = 32
# Retry hint of a refusal for too many pending transfers: slots free as transfers end.
PENDING_FULL_RETRY_MS = 100
PUSH, PULL, REUSE = pb.TRANSFER_KIND_PUSH, pb.TRANSFER_KIND_PULL, pb.TRANSFER_KIND_REUSE
# A protobuf repeated scalar field's type (as a request's block_ids arrive).
_REPEATED_IDS = type(pb.OfferRequest().block_ids)


def _kind_name(kind: int) -> str:
    """The ``mode`` label of transfer metrics: push (also older records), pull or reuse."""
    return "pull" if kind == PULL else "reuse" if kind == REUSE else "push"


def _mover(t: pb.TransferState) -> pb.TransferSide:
    """The side whose engine moves the bytes and reports outcomes: decode for a pull
    READ, prefill for a push WRITE or a reuse READ."""
    return t.offer if t.kind == PULL else t.completion


def _phase_name(phase: int) -> str:
    return P.Name(phase).removeprefix("TRANSFER_PHASE_").lower()


@dataclasses.dataclass
class RendezvousConfig:
    default_timeout_ms: int = limits.DEFAULT_RENDEZVOUS_TIMEOUT_MS
    # How long writers have, after the match, to report before decode is told FAILED.
    match_timeout_ms: int = 60_000
    sweep_tick_s: float = 0.05
    # Ended transfers are kept this long so late duplicates are answered, not re-opened.
    tombstone_s: float = 120.0
    # Bounded memory: a new transfer is refused (RESOURCE_EXHAUSTED) while this many are
    # pending or matched; existing ones still progress, expire and free their slots.
    max_pending: int = 200_000
    # An engine found registered is not looked up again for this long (a store read per
    # message otherwise); an engine that deregisters may still be matched meanwhile, as it
    # may be anyway when it dies right after the check.
    engine_cache_s: float = 1.0
    # Offers must name their prefill and completions their decode (peer_engine_id), so no
    # transfer is matched with an engine the router did not choose. None: on when the
    # server has tokens (services/server.py), off otherwise.
    require_binding: bool | None = None


def _parse(value: bytes) -> pb.TransferState:
    return pb.TransferState.FromString(value)


class _ViewParser:
    """Parses for the hub's cache and the events derived from it, once per value.

    Each store event would otherwise be parsed three times: for the cache, and (new and
    previous value) to derive its events; the previous value is the one the event before
    it cached. Values are bytes (their hash is computed once and kept), so the memo costs
    a dict lookup. What it returns is shared: the hub's records and derived events only
    read it (``PrefixHub.note_write``'s rule); code that changes a record parses its own
    with ``_parse``."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._memo: dict[bytes, pb.TransferState] = {}

    def __call__(self, value: bytes) -> pb.TransferState:
        t = self._memo.get(value)
        if t is None:
            t = pb.TransferState.FromString(value)
            self.seed(value, t)
        return t

    def seed(self, value: bytes, record: pb.TransferState) -> None:
        """``record`` is what ``value`` holds, already parsed: the writer of ``value`` (this
        replica's ``submit``) hands over the record it serialized, so the event of that
        write is cached and routed without parsing it back (one parse per store write at
        hundreds of writes a second). Only its ``revision`` field may differ from the
        bytes: the writer sets it to the write's revision afterwards, which is the value
        that field means (a replayed event carries the same)."""
        if len(self._memo) >= self.size:
            self._memo.clear()  # bounded; the next event re-fills what it needs
        self._memo[value] = record


_EVENT_OF_PHASE = {
    MATCHED: Ev.TYPE_MATCH, EXPIRED: Ev.TYPE_EXPIRED, CANCELLED: Ev.TYPE_CANCELLED,
    SUCCEEDED: Ev.TYPE_DONE, FAILED: Ev.TYPE_DONE,
}


def derive_events(ev: WatchEvent, parse=_parse, wanted: Container[Any] | None = None) -> Iterable[tuple[str, pb.RendezvousEvent]]:
    """Routes a record change to the engines it concerns (``parse``: the hub's, memoized;
    what it returns is only read here). With ``wanted`` (the routes that have subscribers),
    only those routes are returned, and an event none of them wants is not built (a copy
    of the whole record: e.g. every MATCH answered on its completion, which goes only to
    ``*``, usually unsubscribed)."""
    if ev.type is not EventType.PUT:
        return ()
    new = parse(ev.kv.value)
    old = parse(ev.prev_kv.value) if ev.prev_kv is not None and ev.prev_kv.value else None
    out: list[tuple[str, pb.RendezvousEvent]] = []
    if old is not None and old.attempt < new.attempt and old.phase not in TERMINAL:
        # Superseded: the old attempt's owners free their blocks.
        gone = pb.TransferState()
        gone.CopyFrom(old)
        gone.phase = CANCELLED
        gone.reason = f"superseded by attempt {new.attempt}"
        event = Ev(type=Ev.TYPE_CANCELLED, transfer=gone, revision=ev.revision)
        out.extend((engine, event) for engine in _owners(old))
        old = None
    if old is not None and old.phase == new.phase:
        return out
    kind = _EVENT_OF_PHASE.get(new.phase)
    if kind is None:
        return out
    if kind == Ev.TYPE_MATCH:
        # A read's reader began it itself: nothing to write. A MATCH delivered on the
        # answer of the completion that made it is not sent again on the engine's streams.
        routes = [new.completion.engine_id] if new.kind not in (PULL, REUSE) and not new.match_answered else []
    else:
        routes = _owners(new)
    routes.append("*")
    if wanted is not None:
        routes = [r for r in routes if r in wanted]
        if not routes:
            return out
    event = Ev(type=kind, transfer=new, revision=ev.revision)
    # The record's own ``revision`` is this write's (on the event's copy: ``new`` is only
    # read). Its writer sets it on its copy only after the write, and a synchronous watch
    # (the memory store's) derives the event inside the write, before that.
    event.transfer.revision = ev.revision
    out.extend((route, event) for route in routes)
    return out


def _only_rank0_writes(t: pb.TransferState) -> bool:
    return list(t.writer_ranks) == [0] if t.writer_ranks else t.expected_outcomes <= 1


def match_delivered(t: pb.TransferState, engine_id: str) -> bool:
    """Whether an answer to ``engine_id``'s completion carrying ``t`` is that engine's MATCH."""
    return t.match_answered and t.phase == MATCHED and t.completion.engine_id == engine_id


def _owners(t: pb.TransferState) -> list[str]:
    return list(dict.fromkeys(e for e in (t.offer.engine_id, t.completion.engine_id) if e))


def _parties(t: pb.TransferState) -> set[str]:
    """Engines on a side of ``t`` or named by one: who may start its next attempt."""
    return {e for e in (t.offer.engine_id, t.completion.engine_id, t.offer.peer_engine_id,
                        t.completion.peer_engine_id) if e}


def _check_binding(msg: SideMessage, cur: pb.TransferState) -> bool:
    """Same attempt: may ``msg`` join ``cur``? Raises PERMISSION_DENIED if the other side
    named another engine; returns True if the other side must be dropped (``msg`` named
    another engine than the one there)."""
    other = cur.completion if msg.is_offer else cur.offer
    if not other.engine_id:
        return False
    if other.peer_engine_id and other.peer_engine_id != msg.engine_id:
        role = "decode" if msg.is_offer else "prefill"
        raise denied(f"transfer {msg.transfer_id} is bound to {role} engine {other.peer_engine_id} "
                     f"(named by {other.engine_id}); engine {msg.engine_id} may not {'offer' if msg.is_offer else 'complete'} on it")
    return bool(msg.peer) and msg.peer != other.engine_id


class SideMessage(NamedTuple):
    """An offer (decode) or a completion (prefill), validated. Immutable like the frozen
    dataclass it was, but a tuple: built once per message, and a frozen dataclass's
    ``__init__`` (one ``object.__setattr__`` per field) cost about three times as much."""

    is_offer: bool
    transfer_id: str
    attempt: int
    engine_id: str
    block_ids: Sequence[int]  # a list, or the request's repeated field (compares equal to a list)
    num_tokens: int
    timeout_ms: int
    request_id: str
    writers: int = 1
    peer: str = ""  # the engine this side names for the other side ("" = any)
    match_in_answer: bool = False  # completion: its answer may be the MATCH (proto CompleteRequest)

    @property
    def side_name(self) -> str:
        return "offer" if self.is_offer else "completion"


class RendezvousService:
    def __init__(
        self,
        store: Store,
        *,
        clock: Clock | None = None,
        config: RendezvousConfig | None = None,
        prefix: bytes = b"kvb/rdv/",
        engine_exists=None,
        pair_check=None,
        metrics: ServiceMetrics | None = None,
        retained_lookup=None,
    ) -> None:
        self.store = store
        self.metrics = metrics or ServiceMetrics()
        self.clock = clock or WallClock()
        self.config = config or RendezvousConfig()
        self.prefix = prefix
        # Optional async predicate: is this engine registered? (unknown engines are refused)
        self.engine_exists = engine_exists
        # Optional async (prefill_engine_id, decode_engine_id) -> PairVerdict | None: may KV
        # move between them, and which prefill ranks write (RegistrarService.pair_verdict).
        self.pair_check = pair_check
        self._pairs_seen: dict[tuple[str, str], tuple[float, Any]] = {}
        # Optional async (conversation_id) -> RetainedBlocks | None (the registrar's): what
        # a reuse read is fenced against.
        self.retained_lookup = retained_lookup
        view_parse = self._view_parse = _ViewParser()
        self.hub: PrefixHub[pb.TransferState, pb.RendezvousEvent] = PrefixHub(
            store, prefix + b"t/", parse=view_parse, derive=lambda ev: derive_events(ev, view_parse, self.hub.routes), name="transfers",
            keep=lambda t: t.phase not in TERMINAL, sync=True,
        )
        self._tasks: list[asyncio.Task] = []
        self._tombstones = Tombstones(store, self.config.tombstone_s)
        # When each live record's side expires or its match fails: the sweeper pops what is
        # due instead of scanning every pending transfer on each tick.
        self._deadlines: DeadlineIndex[bytes] = DeadlineIndex()
        self.hub.listeners.append(self._track_deadline)
        self.hub.on_reload.append(self._rearm_all)
        # MATCHED records in the cache by prefill engine (key -> None, in match order): what
        # a fresh subscription replays, found without a pass over every cached record (at
        # 20,000 live transfers that pass held the loop ~30 ms per Subscribe).
        self._matched_for: dict[str, dict[bytes, None]] = {}
        self._matched_engine: dict[bytes, str] = {}
        self.is_leader = lambda: True
        self._engines_seen: dict[str, float] = {}  # engine_id -> monotonic time it was last found
        self.stats = {"matches": 0, "expired_offers": 0, "expired_completions": 0, "failed": 0, "succeeded": 0}

    async def start(self, *, run_sweeper: bool = True) -> None:
        await self.hub.start()
        self._rearm_all()
        if run_sweeper:
            self._tasks.append(asyncio.get_running_loop().create_task(
                leader_ticks("rendezvous.sweep", self.config.sweep_tick_s, lambda: self.is_leader(), self.sweep),
                name="rdv-sweeper"))

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        await self.hub.stop()

    def _key(self, transfer_id: str) -> bytes:
        return self.prefix + b"t/" + transfer_id.encode()

    async def _put_ops(self, t: pb.TransferState) -> list[Put]:
        lease = await self._tombstones.lease() if t.phase in TERMINAL else 0
        return [Put(self._key(t.transfer_id), t.SerializeToString(), lease=lease)]

    # -- validation --------------------------------------------------------
    def validate(self, *, is_offer: bool, transfer_id: str, attempt: int, engine_id: str, block_ids: Sequence[int],
                 num_tokens: int, timeout_ms: int, request_id: str, writers: int = 1, peer: str = "",
                 match_in_answer: bool = False) -> SideMessage:
        limits.check_id("transfer_id", transfer_id)
        limits.check_engine_id("decode_engine_id" if is_offer else "prefill_engine_id", engine_id)
        limits.check_engine_id("prefill_engine_id" if is_offer else "decode_engine_id", peer, required=False)
        limits.check_id("request_id", request_id, required=False)
        ids = limits.check_block_ids("block_ids", block_ids)
        timeout = limits.check_range("timeout_ms", timeout_ms, limits.MIN_RENDEZVOUS_TIMEOUT_MS,
                                     limits.MAX_RENDEZVOUS_TIMEOUT_MS, default=self.config.default_timeout_ms)
        writers = limits.check_range("writers", writers, 1, limits.MAX_TP_SIZE, default=1)
        if self.config.require_binding and not peer:
            raise invalid(f"transfer {transfer_id}: {'an offer must name its prefill_engine_id' if is_offer else 'a completion must name its decode_engine_id'} "
                          "(the router passes it; this control plane requires bound transfers)")
        # The request's own repeated field when it is one (checked above, and only read
        # from here on): a record's side copies it in one C call (``extend`` from a list
        # converts element by element, about three times as long for a request's blocks).
        return SideMessage(is_offer, transfer_id, attempt, engine_id, block_ids if type(block_ids) is _REPEATED_IDS else ids,
                           num_tokens, timeout, request_id, writers, peer, match_in_answer and not is_offer)

    # -- offer / complete --------------------------------------------------
    async def submit(self, msg: SideMessage) -> tuple[pb.TransferState, bool, bool]:
        """Records one side; returns (state, matched_now, duplicate)."""
        if self.engine_exists is not None:
            await self._check_engine(msg.engine_id)
        key = self._key(msg.transfer_id)
        fresh: tuple[KeyValue | None, ...] | None = None  # the current value, read by a lost CAS
        for attempt_no in range(_CAS_RETRIES):
            now = self.clock.now_ms()
            # First try from the replica's cache, saving a store read: the CAS below is
            # what decides, so a stale cache only costs a retry. Answers that write
            # nothing (duplicate, conflict) are only given from an authoritative read:
            # the one a lost CAS returns from its failure branch, or a get.
            cached = attempt_no == 0
            if cached:
                entry = self.hub.records.get(key)
                cur = entry[0] if entry else None
                expect = Compare.at_revision(key, entry[1]) if entry else Compare.absent(key)
            else:
                kv = fresh[0] if fresh is not None else await self.store.get(key)
                fresh = None
                cur = _parse(kv.value) if kv else None
                expect = Compare.unchanged(kv, key)
            if cached and cur is not None and (cur.attempt > msg.attempt or (
                    cur.attempt == msg.attempt and ((cur.offer if msg.is_offer else cur.completion).engine_id
                                                    or cur.phase in TERMINAL))):
                continue
            if cur is not None and cur.attempt > msg.attempt:
                raise precondition(
                    f"transfer {msg.transfer_id}: attempt {msg.attempt} is superseded by attempt {cur.attempt}")
            if cur is not None and cur.attempt < msg.attempt and msg.engine_id not in _parties(cur):
                raise denied(f"engine {msg.engine_id} is not a party of transfer {msg.transfer_id} "
                             f"(attempt {cur.attempt}): only its parties start a new attempt")
            base = cur.attempt if cur is not None else 0
            if msg.attempt > base + limits.MAX_ATTEMPT_STEP:
                raise invalid(f"transfer {msg.transfer_id}: attempt {msg.attempt} skips ahead of attempt {base} by more "
                              f"than {limits.MAX_ATTEMPT_STEP}")
            superseded = cur is not None and cur.attempt < msg.attempt and cur.phase not in TERMINAL
            if cur is None and len(self.hub.records) >= self.config.max_pending:
                raise exhausted(f"{len(self.hub.records)} transfers are pending (limit {self.config.max_pending}); "
                                "retry after some complete or expire", retry_after_ms=PENDING_FULL_RETRY_MS)
            if cur is None or cur.attempt < msg.attempt:
                new = pb.TransferState(transfer_id=msg.transfer_id, attempt=msg.attempt, updated_at_ms=now)
            else:
                mine = cur.offer if msg.is_offer else cur.completion
                if mine.engine_id:
                    if mine.engine_id == msg.engine_id and list(mine.block_ids) == msg.block_ids:
                        return cur, False, True
                    raise precondition(
                        f"transfer {msg.transfer_id} attempt {msg.attempt} already has a different {msg.side_name} "
                        f"(engine {mine.engine_id}, {len(mine.block_ids)} blocks)")
                if cur.phase in TERMINAL:
                    raise precondition(
                        f"transfer {msg.transfer_id} attempt {msg.attempt} is already "
                        f"{P.Name(cur.phase).removeprefix('TRANSFER_PHASE_').lower()}: {cur.reason}")
                drop_other = _check_binding(msg, cur)
                new = pb.TransferState()
                new.CopyFrom(cur)
                if drop_other:
                    dropped = new.completion if msg.is_offer else new.offer
                    log.warning("rendezvous.impostor_dropped", transfer_id=msg.transfer_id, engine_id=dropped.engine_id,
                                named=msg.peer, by=msg.engine_id)
                    self.metrics.transfers.labels("cancelled", "impostor").inc()
                    dropped.Clear()
            # The side is written in place (no separate message copied in).
            side = new.offer if msg.is_offer else new.completion
            side.Clear()
            side.engine_id, side.num_tokens, side.request_id = msg.engine_id, msg.num_tokens, msg.request_id
            side.deadline_ms, side.received_at_ms, side.peer_engine_id = now + msg.timeout_ms, now, msg.peer
            side.block_ids.extend(msg.block_ids)
            if not msg.is_offer:
                new.expected_outcomes = msg.writers
            matched = bool(new.offer.engine_id and new.completion.engine_id)
            refused = ""
            if matched:
                # Incompatibility first: it explains a block count mismatch (different block sizes).
                verdict = await self._pair(new.completion.engine_id, new.offer.engine_id)
                if verdict is not None and verdict.reason:
                    new.phase, refused = pb.TRANSFER_PHASE_FAILED, verdict.reason
                    new.reason = (f"incompatible KV: prefill {new.completion.engine_id} -> decode "
                                  f"{new.offer.engine_id}: {verdict.reason}")
                elif len(new.offer.block_ids) != len(new.completion.block_ids):
                    new.phase = FAILED
                    new.reason = (f"block count mismatch: decode offered {len(new.offer.block_ids)}, "
                                  f"prefill completed {len(new.completion.block_ids)}")
                else:
                    new.phase = MATCHED
                    new.matched_at_ms = now
                    if verdict is not None and verdict.writer_ranks:
                        del new.writer_ranks[:]
                        new.writer_ranks.extend(verdict.writer_ranks)
                        new.expected_outcomes = len(verdict.writer_ranks)
                    # The completion's answer is the MATCH when it asked and rank 0 is the
                    # only writer (one subscriber to tell); otherwise the streams carry it.
                    new.match_answered = msg.match_in_answer and _only_rank0_writes(new)
            else:
                new.phase = OFFERED if msg.is_offer else COMPLETED
            new.updated_at_ms = now
            # A first side that supersedes nothing makes no event, so it may share a store
            # revision with other such writes (batched: one etcd proposal for many); writes
            # that make events (match, failure, superseding) keep a revision of their own,
            # which is what subscribers resume from.
            txn = self.store.txn_batched if new.phase in PENDING and not superseded else self.store.txn
            # A live record has no tombstone lease: its put needs no await.
            ops = [Put(key, new.SerializeToString())] if new.phase not in TERMINAL else await self._put_ops(new)
            # Seeded before the write: on the memory store the hub applies the write's event
            # inside it (a synchronous watch), and finds the record there unparsed. (If the
            # write fails, the entry is only a parse of those bytes that nobody asks for.)
            self._view_parse.seed(ops[0].value, new)
            result = await txn([expect], ops, [Get(key)])
            if not result.succeeded:
                fresh = result.values[:1] or None
            else:
                new.revision = result.revision
                self.hub.note_write(key, new, result.revision)
                if superseded:
                    self.metrics.transfers.labels("cancelled", "superseded").inc()
                if matched and new.phase == MATCHED:
                    self.stats["matches"] += 1
                    first = new.completion if msg.is_offer else new.offer
                    self.metrics.matches.inc()
                    self.metrics.match_wait_by_first["completion" if msg.is_offer else "offer"].observe(
                        max(now - first.received_at_ms, 0) / 1000)
                    if logs.debug_enabled:
                        log.debug("rendezvous.matched", transfer_id=msg.transfer_id, attempt=msg.attempt)
                elif matched:
                    self.metrics.transfers.labels("failed", "incompatible" if refused else "block_count_mismatch").inc()
                    if refused:
                        self.stats["refused"] = self.stats.get("refused", 0) + 1
                        log.info("rendezvous.refused", transfer_id=msg.transfer_id, reason=new.reason)
                return new, matched and new.phase == MATCHED, False
        raise DomainError(Code.ABORTED, f"transfer {msg.transfer_id} kept conflicting; retry")

    async def _check_engine(self, engine_id: str) -> None:
        seen = self._engines_seen.get(engine_id)
        mono = time.monotonic()
        if seen is not None and mono - seen < self.config.engine_cache_s:
            return
        if not await self.engine_exists(engine_id):
            self._engines_seen.pop(engine_id, None)
            raise not_found(f"engine {engine_id} is not registered")
        if len(self._engines_seen) >= 10_000:
            self._engines_seen.clear()  # bounded memory
        self._engines_seen[engine_id] = mono

    async def _pair(self, prefill_engine_id: str, decode_engine_id: str) -> Any:
        """The pair check's verdict, cached like engine existence (a store read per match
        otherwise); None without a pair check."""
        if self.pair_check is None:
            return None
        key = (prefill_engine_id, decode_engine_id)
        mono = time.monotonic()
        seen = self._pairs_seen.get(key)
        if seen is not None and mono - seen[0] < self.config.engine_cache_s:
            return seen[1]
        verdict = await self.pair_check(prefill_engine_id, decode_engine_id)
        if len(self._pairs_seen) >= 10_000:
            self._pairs_seen.clear()  # bounded memory
        if verdict is not None:
            self._pairs_seen[key] = (mono, verdict)
        return verdict

    async def record_refused(self, transfer_id: str, *, owner_engine_id: str, reader_engine_id: str,
                             reason: str, request_id: str = "") -> pb.TransferState:
        """Records a transfer refused before it was formed outside the rendezvous (a reuse
        READ of ``owner_engine_id``'s retained blocks by ``reader_engine_id``) as FAILED with
        the reason, so operators see it in ``transfers list`` like a refused push. The owner
        (the engine the KV lives on, decode) is the offer side, the reader the completion
        side. Written once per id; a repeat returns the record there."""
        limits.check_id("transfer_id", transfer_id)
        key = self._key(transfer_id)
        now = self.clock.now_ms()
        t = pb.TransferState(transfer_id=transfer_id, phase=pb.TRANSFER_PHASE_FAILED,
                             reason=limits.check_text("reason", reason[:900]),
                             updated_at_ms=now)
        t.offer.engine_id, t.offer.received_at_ms = owner_engine_id, now
        t.completion.engine_id, t.completion.received_at_ms, t.completion.request_id = reader_engine_id, now, request_id
        t.kind = REUSE
        result = await self.store.txn([Compare.absent(key)], await self._put_ops(t), [Get(key)])
        if not result.succeeded:
            return _parse(result.values[0].value) if result.values and result.values[0] else t
        t.revision = result.revision
        self.metrics.transfers.labels("failed", "incompatible").inc()
        log.info("rendezvous.refused", transfer_id=transfer_id, reason=reason)
        return t

    async def _update(self, transfer_id: str, attempt: int, change) -> pb.TransferState:
        """Read-modify-CAS on a transfer; ``change(state, now)`` mutates it or returns False."""
        limits.check_id("transfer_id", transfer_id)
        key = self._key(transfer_id)
        fresh: tuple[KeyValue | None, ...] | None = None  # the current value, read by a lost CAS
        for _ in range(_CAS_RETRIES):
            kv = fresh[0] if fresh is not None else await self.store.get(key)
            fresh = None
            if kv is None:
                raise not_found(f"transfer {transfer_id} not found (never seen, or ended long ago)")
            cur = _parse(kv.value)
            if cur.attempt > attempt:
                raise precondition(f"transfer {transfer_id}: attempt {attempt} is superseded by attempt {cur.attempt}")
            if cur.attempt < attempt:
                raise precondition(f"transfer {transfer_id}: attempt {attempt} is unknown (current {cur.attempt})")
            now = self.clock.now_ms()
            if change(cur, now) is False:
                cur.revision = kv.mod_revision
                return cur
            cur.updated_at_ms = now
            result = await self.store.txn([Compare.unchanged(kv, key)], await self._put_ops(cur), [Get(key)])
            if result.succeeded:
                cur.revision = result.revision
                return cur
            fresh = result.values[:1] or None
        raise DomainError(Code.ABORTED, f"transfer {transfer_id} kept conflicting; retry")

    async def report_outcome(self, transfer_id: str, attempt: int, outcome: pb.Outcome) -> pb.TransferState:
        limits.check_id("engine_id", outcome.engine_id)
        limits.check_text("error", outcome.error)
        # What the last (committed) run of ``change`` did: it may run once per CAS retry,
        # so metrics are taken from it only after the write succeeded.
        effect: dict[str, Any] = {}

        def change(t: pb.TransferState, now: int):
            effect.clear()
            if t.phase in TERMINAL and t.phase != FAILED:
                return False  # late report after the end: nothing to change
            if t.phase in PENDING:
                raise precondition(f"transfer {transfer_id} is not matched yet")
            if t.phase == FAILED and not t.matched_at_ms:
                raise precondition(f"transfer {transfer_id} was never matched (nothing to write): {t.reason}")
            if outcome.engine_id != _mover(t).engine_id:
                raise invalid(f"engine {outcome.engine_id} is not the engine moving the blocks of transfer {transfer_id}")
            if t.writer_ranks and outcome.tp_rank not in t.writer_ranks:
                raise invalid(f"tp_rank {outcome.tp_rank} is not a writer of transfer {transfer_id} "
                              f"(writer ranks {list(t.writer_ranks)})")
            if not t.writer_ranks and outcome.tp_rank >= max(t.expected_outcomes, 1):
                raise invalid(f"tp_rank {outcome.tp_rank} >= writers {t.expected_outcomes}")
            if any(o.tp_rank == outcome.tp_rank for o in t.outcomes):
                return False  # duplicate
            o = pb.Outcome()
            o.CopyFrom(outcome)
            o.reported_at_ms = now
            t.outcomes.append(o)
            effect["reported"] = True
            if t.phase == FAILED:
                return None
            if not outcome.success:
                t.phase = FAILED
                t.reason = f"rank {outcome.tp_rank} of {outcome.engine_id} failed: {outcome.error}"
            elif len(t.outcomes) >= max(t.expected_outcomes, 1):
                t.phase = SUCCEEDED
            if t.phase in TERMINAL:
                effect["ended"] = (t.phase, now - t.matched_at_ms)
            return None

        state = await self._update(transfer_id, attempt, change)
        m = self.metrics
        if effect.get("reported"):
            rank_outcome = "succeeded" if outcome.success else "failed"
            m.transfer_bytes.labels(_kind_name(state.kind), rank_outcome).inc(outcome.bytes)
            if outcome.duration_us:
                m.transfer_write.labels(_kind_name(state.kind)).observe(outcome.duration_us / 1e6)
        if "ended" in effect:
            phase, since_match_ms = effect["ended"]
            self.stats["succeeded" if phase == SUCCEEDED else "failed"] += 1
            m.transfers.labels(_phase_name(phase), "reported").inc()
            m.match_to_outcome.labels(_phase_name(phase)).observe(max(since_match_ms, 0) / 1000)
        return state

    # -- reads: one ledger with push ------------------------------------------
    async def begin_read(self, *, kind: int, transfer_id: str, attempt: int, reader_engine_id: str,
                         block_ids: Sequence[int], readers: int = 0, generation: str = "", conversation_id: str = "",
                         source_block_ids: Sequence[int] = (), request_id: str = "") -> pb.TransferState:
        """Records a pull or reuse READ as a MATCHED transfer before it is posted, or refuses
        it (FAILED_PRECONDITION) when the owner has since freed or re-leased the blocks: the
        generation the reader names is checked against the owner's current one. The reader
        reports outcomes (``report_outcome``); without them the match timeout fails it, and
        the owners get DONE either way (when a prefill may free a pull's blocks)."""
        limits.check_id("transfer_id", transfer_id)
        limits.check_id("reader_engine_id", reader_engine_id)
        limits.check_id("request_id", request_id, required=False)
        ids = limits.check_block_ids("block_ids", block_ids)
        readers = limits.check_range("readers", readers, 1, limits.MAX_TP_SIZE, default=1)
        if kind not in (PULL, REUSE):
            raise invalid("kind must be PULL or REUSE (push transfers meet through Offer and Complete)")
        if self.engine_exists is not None:
            await self._check_engine(reader_engine_id)
        if kind == PULL:
            return await self._begin_pull(transfer_id, attempt, reader_engine_id, ids, readers, generation, request_id)
        return await self._begin_reuse(transfer_id, attempt, reader_engine_id, ids, readers, generation,
                                       conversation_id, source_block_ids, request_id)

    async def _begin_pull(self, transfer_id: str, attempt: int, reader: str, ids: list[int], readers: int,
                          generation: str, request_id: str) -> pb.TransferState:
        generation = generation or str(attempt)
        if generation != str(attempt):
            raise invalid(f"a pull hold's generation is its attempt: got {generation!r} for attempt {attempt}")
        held = await self.store.get(self._key(transfer_id))
        owner = _parse(held.value).completion.engine_id if held is not None else ""
        verdict = await self._pair(owner, reader) if owner else None
        if verdict is not None and verdict.reason:
            # Never mappable: end the hold now (the prefill frees on DONE) and say why.
            why = f"incompatible KV: pull READ of prefill {owner} by decode {reader}: {verdict.reason}"

            def fail(t: pb.TransferState, now: int):
                if t.phase != COMPLETED:
                    return False
                t.phase, t.reason, t.kind = FAILED, why, PULL
                return None

            await self._update(transfer_id, attempt, fail)
            self.metrics.transfers.labels("failed", "incompatible").inc()
            raise precondition(f"{why}: recompute")

        def change(t: pb.TransferState, now: int):
            if t.kind == PULL and t.phase != COMPLETED and t.offer.engine_id == reader and list(t.offer.block_ids) == ids:
                return False  # the same read again: answered with its state
            if t.phase != COMPLETED:
                raise precondition(
                    f"transfer {transfer_id} attempt {attempt}: the prefill's hold is {_phase_name(t.phase)}"
                    f"{': ' + t.reason if t.reason else ''}; its blocks may be freed: recompute")
            # Fewer is fine: the reader's leading blocks may be its own prefix-cache hits,
            # so it reads a prefix of the hold (at most the whole of it).
            if len(ids) > len(t.completion.block_ids):
                raise invalid(f"block_ids has {len(ids)} ids; the hold has only {len(t.completion.block_ids)}")
            t.offer.CopyFrom(pb.TransferSide(engine_id=reader, block_ids=ids, received_at_ms=now, request_id=request_id))
            t.kind, t.generation, t.expected_outcomes = PULL, generation, readers
            t.phase, t.matched_at_ms, t.reason = MATCHED, now, ""
            return None

        try:
            state = await self._update(transfer_id, attempt, change)
        except DomainError as exc:
            if exc.code is not Code.NOT_FOUND:
                raise
            raise precondition(f"transfer {transfer_id}: no hold (never made, or freed and forgotten): recompute") from None
        return state

    async def _begin_reuse(self, transfer_id: str, attempt: int, reader: str, ids: list[int], readers: int,
                           generation: str, conversation_id: str, source_block_ids: Sequence[int],
                           request_id: str) -> pb.TransferState:
        limits.check_id("conversation_id", conversation_id)
        if not generation:
            raise invalid("generation (the retention_id LookupRetained answered) is required for a reuse read")
        src = limits.check_block_ids("source_block_ids", source_block_ids)
        if len(src) != len(ids):
            raise invalid(f"source_block_ids has {len(src)} ids and block_ids {len(ids)}")
        if self.retained_lookup is None:
            raise precondition("this control plane has no registrar to fence reuse reads against")
        retained = await self.retained_lookup(conversation_id)
        if retained is None:
            raise precondition(f"conversation {conversation_id} has no retained blocks (released or expired): recompute")
        if retained.retention_id != generation:
            raise precondition(f"conversation {conversation_id}'s blocks were re-registered (generation "
                               f"{retained.retention_id}; the read names {generation}): recompute")
        if not set(src) <= set(retained.block_ids):
            raise precondition(f"source_block_ids are not all retained for conversation {conversation_id}")
        verdict = await self._pair(retained.engine_id, reader)
        if verdict is not None and verdict.reason:
            why = f"incompatible KV: reuse READ of decode {retained.engine_id} by prefill {reader}: {verdict.reason}"
            await self.record_refused(transfer_id, owner_engine_id=retained.engine_id, reader_engine_id=reader,
                                      reason=why, request_id=request_id)
            raise precondition(f"{why}: recompute")
        key = self._key(transfer_id)
        for _ in range(_CAS_RETRIES):
            kv = await self.store.get(key)
            cur = _parse(kv.value) if kv else None
            if cur is not None and cur.attempt >= attempt:
                if (cur.attempt == attempt and cur.kind == REUSE and cur.generation == generation
                        and cur.completion.engine_id == reader and list(cur.completion.block_ids) == ids):
                    cur.revision = kv.mod_revision if kv else 0
                    return cur  # the same read again
                raise precondition(f"transfer {transfer_id} attempt {cur.attempt} already exists")
            if cur is None and len(self.hub.records) >= self.config.max_pending:
                raise exhausted(f"{len(self.hub.records)} transfers are pending (limit {self.config.max_pending})",
                                retry_after_ms=PENDING_FULL_RETRY_MS)
            now = self.clock.now_ms()
            new = pb.TransferState(
                transfer_id=transfer_id, attempt=attempt, phase=MATCHED, kind=REUSE, generation=generation,
                conversation_id=conversation_id, matched_at_ms=now, updated_at_ms=now, expected_outcomes=readers,
                offer=pb.TransferSide(engine_id=retained.engine_id, block_ids=src, received_at_ms=now),
                completion=pb.TransferSide(engine_id=reader, block_ids=ids, received_at_ms=now, request_id=request_id))
            result = await self.store.txn([Compare.unchanged(kv, key)], await self._put_ops(new))
            if result.succeeded:
                new.revision = result.revision
                return new
        raise DomainError(Code.ABORTED, f"transfer {transfer_id} kept conflicting; retry")

    async def cancel(self, transfer_id: str, attempt: int, engine_id: str, reason: str) -> pb.TransferState:
        limits.check_id("engine_id", engine_id)
        reason = limits.check_text("reason", reason) or "cancelled"
        effect: dict[str, bool] = {}

        def change(t: pb.TransferState, now: int):
            effect.clear()
            if t.phase in TERMINAL:
                return False
            if engine_id not in (t.offer.engine_id, t.completion.engine_id):
                raise precondition(f"engine {engine_id} is not a party of transfer {transfer_id}")
            if t.phase == MATCHED and engine_id != _mover(t).engine_id:
                raise precondition(
                    f"transfer {transfer_id} is matched: the writer may be writing into your blocks; "
                    "wait for its DONE event (it comes within the match timeout)")
            t.phase = CANCELLED
            t.reason = f"cancelled by {engine_id}: {reason}"
            effect["cancelled"] = True
            return None

        state = await self._update(transfer_id, attempt, change)
        if effect.get("cancelled"):
            self.metrics.transfers.labels("cancelled", "cancelled").inc()
        return state

    async def get(self, transfer_id: str) -> pb.TransferState:
        limits.check_id("transfer_id", transfer_id)
        kv = await self.store.get(self._key(transfer_id))
        if kv is None:
            raise not_found(f"transfer {transfer_id} not found")
        t = _parse(kv.value)
        t.revision = kv.mod_revision
        return t

    async def list(self, *, phases: Sequence[int] = (), engine_id: str = "", limit: int = 0) -> list[pb.TransferState]:
        out = await self._matching(phases, engine_id)
        return out[:limit] if limit else out

    async def list_page(self, *, phases: Sequence[int] = (), engine_id: str = "", limit: int = 0, page_size: int = 0,
                        page_token: str = "") -> tuple[builtins.list[pb.TransferState], str]:
        """One page, oldest change first, and the next page's token."""
        return paging.paginate(await self._matching(phases, engine_id), key=lambda t: (t.updated_at_ms, t.transfer_id),
                               size=lambda t: t.ByteSize(), kind="transfers", page_size=paging.page_size(page_size, limit),
                               page_token=page_token)

    async def _matching(self, phases: Sequence[int], engine_id: str) -> builtins.list[pb.TransferState]:
        limits.check_id("engine_id", engine_id, required=False)
        wanted = set(phases) or set(PENDING) | {MATCHED}
        # From the store, not the replica's cache: the cache trails the store by the watch's
        # delay, and a list must show a transfer whose Offer was answered before it was asked
        # (read-your-writes; ended transfers are only in the store anyway).
        kvs, _ = await self.store.range(self.prefix + b"t/")
        records = [(_parse(kv.value), kv.mod_revision) for kv in kvs]
        out = []
        for t, rev in records:
            if t.phase in wanted and (not engine_id or engine_id in (t.offer.engine_id, t.completion.engine_id)):
                t.revision = rev
                out.append(t)
        out.sort(key=lambda t: (t.updated_at_ms, t.transfer_id))
        return out

    async def subscribe(self, engine_id: str, tp_rank: int, after_revision: int = 0, *,
                        idle_s: float = 0.0) -> AsyncIterator[pb.RendezvousEvent | None]:
        """Pending matches of this engine (when starting fresh), then live events; with
        ``idle_s``, None whenever nothing came for that long (time for a heartbeat)."""
        limits.check_engine_id("engine_id", engine_id)
        if not after_revision:
            after_revision = self.hub.revision
            for key in list(self._matched_for.get(engine_id, ())):
                entry = self.hub.records.get(key)
                if entry is None:
                    continue
                t, rev = entry
                # (A write-through entry ahead of the watch comes as a live event instead.)
                if rev <= after_revision and t.phase == MATCHED and t.completion.engine_id == engine_id and (
                    not t.match_answered) and not any(
                    o.tp_rank == tp_rank for o in t.outcomes
                ):
                    replayed = Ev(type=Ev.TYPE_MATCH, transfer=t, revision=rev)
                    replayed.transfer.revision = rev  # on the event's copy: cached records are only read
                    yield replayed
        async for _, event in self.hub.subscribe_idle(engine_id, after_revision, idle_s):
            yield event

    # -- deadlines ---------------------------------------------------------
    def _deadline_of(self, t: pb.TransferState) -> int | None:
        if t.phase == OFFERED:
            return t.offer.deadline_ms
        if t.phase == COMPLETED:
            return t.completion.deadline_ms
        if t.phase == MATCHED:
            return t.matched_at_ms + self.config.match_timeout_ms
        return None

    def _rearm_all(self) -> None:
        """Every cached record's deadline, afresh (at start, and after the hub reloaded
        its cache without events: a compacted watch)."""
        self._deadlines.clear()
        self._matched_for.clear()
        self._matched_engine.clear()
        for key, (t, rev) in self.hub.records.items():
            self._push_deadline(key, t, rev)
            self._index_matched(key, t)

    def _index_matched(self, key: bytes, t: pb.TransferState | None) -> None:
        """Keeps ``_matched_for`` in step with the cache (``t``: the key's cached record, or
        None once it left the cache)."""
        engine = t.completion.engine_id if t is not None and t.phase == MATCHED else None
        old = self._matched_engine.get(key)
        if old == engine:
            return
        if old is not None:
            keys = self._matched_for.get(old)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._matched_for[old]
            del self._matched_engine[key]
        if engine:
            self._matched_for.setdefault(engine, {})[key] = None
            self._matched_engine[key] = engine

    def _push_deadline(self, key: bytes, t: pb.TransferState, rev: int) -> None:
        deadline = self._deadline_of(t)
        if deadline is not None:
            self._deadlines.arm(key, deadline, rev)
        else:
            self._deadlines.drop(key, rev)

    def _track_deadline(self, ev: WatchEvent) -> None:
        key = ev.kv.key
        entry = self.hub.records.get(key) if ev.type is EventType.PUT else None
        self._index_matched(key, entry[0] if entry is not None else None)
        if entry is not None:
            self._push_deadline(key, entry[0], entry[1])
        else:
            # Ended (left the cache) or deleted: its entry would only be skipped later.
            self._deadlines.drop(key, ev.kv.mod_revision if ev.type is EventType.PUT else None)

    async def sweep(self) -> int:
        """Expires unmatched sides and fails matches nobody reported on; returns how many."""
        now = self.clock.now_ms()
        ended = 0
        due = list(self._deadlines.pop_due(now))
        for i, (key, rev) in enumerate(due):
            if i and i % END_YIELD_EVERY == 0:
                await asyncio.sleep(0)
            entry = self.hub.records.get(key)
            if entry is None or entry[1] != rev:
                continue  # ended or changed since: a newer entry (if any) is armed
            try:
                ended += await self._end_due(key, entry[0], rev, now)
            except BaseException:
                # The store failed mid-sweep: what was popped but not ended is re-armed.
                for k, r in due[i:]:
                    self._deadlines.arm(k, now, r)
                raise
        return ended

    async def _end_due(self, key: bytes, t: pb.TransferState, rev: int, now: int) -> int:
        """Expires an unmatched side or fails a match nobody reported on; 1 if it did,
        0 if the record changed first (its new version has its own deadline)."""
        if t.phase in PENDING:
            side = t.offer if t.phase == OFFERED else t.completion
            new_phase, reason = EXPIRED, (
                f"{'offer' if t.phase == OFFERED else 'completion'} from {side.engine_id} unmatched "
                f"for {now - side.received_at_ms} ms")
        else:
            new_phase, reason = FAILED, f"no outcome from the writers within {self.config.match_timeout_ms} ms of the match"
        new = pb.TransferState()
        new.CopyFrom(t)
        new.phase, new.reason, new.updated_at_ms = new_phase, reason, now
        kv = KeyValue(key, b"", 0, rev, 0)
        result = await self.store.txn([Compare.unchanged(kv, key)], await self._put_ops(new))
        if not result.succeeded:
            return 0
        if new_phase == EXPIRED:
            self.stats["expired_offers" if t.phase == OFFERED else "expired_completions"] += 1
            self.metrics.unmatched_expired.labels("offer" if t.phase == OFFERED else "completion").inc()
            self.metrics.transfers.labels("expired", "unmatched").inc()
        else:
            self.stats["failed"] += 1
            self.metrics.transfers.labels("failed", "match_timeout").inc()
            self.metrics.match_to_outcome.labels("failed").observe(max(now - t.matched_at_ms, 0) / 1000)
        log.info("rendezvous.ended", transfer_id=t.transfer_id, attempt=t.attempt, phase=P.Name(new_phase), reason=reason)
        return 1
