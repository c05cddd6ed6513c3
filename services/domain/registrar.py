"""Registrar: engines (one record per worker rank, under a liveness lease) and the
blocks decode engines retain per conversation.

An engine rank lives at ``<prefix>e/<engine_id>/<rank>`` under a store TTL lease; if it
stops refreshing, the store deletes the record and watchers see it go. The identity that
registered it (a token's or client certificate's, never shown in answers) lives beside
it at ``<prefix>o/<engine_id>/<rank>`` under the same lease: while any rank of an engine
lives, only that identity may register or deregister the engine id again. A refresh for an
incarnation the store no longer has answers NOT_FOUND, which tells the engine to
register again rather than stay invisible.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncIterator

import structlog

from kvbaton.kvgeometry import (
    EngineKv,
    basic_incompatibility,
    incompatibility,
    split_reason,
    writer_ranks,
)
from kvbaton.v1 import common_pb2 as cpb
from kvbaton.v1 import registrar_pb2 as pb

from ..metrics import ServiceMetrics
from ..store.base import CompactedError, Compare, Delete, EventType, KeyValue, LeaseNotFoundError, Put, Store
from . import limits, paging
from .clock import Clock, WallClock
from .errors import Code, DomainError, denied, invalid, not_found, precondition

log = structlog.get_logger(__name__)

_DTYPES = {"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8", "fp8", "auto"}


def role_name(role: int) -> str:
    """``prefill`` / ``decode`` / ``both``: the metric label and the JSON spelling of a role."""
    return cpb.EngineRole.Name(role).removeprefix("ENGINE_ROLE_").lower()


def validate_geometry(g: cpb.KvGeometry) -> None:
    if not g.region_base_addrs:
        raise invalid("geometry.region_base_addrs is empty")
    if len(g.region_base_addrs) > limits.MAX_REGIONS:
        raise invalid(f"geometry has {len(g.region_base_addrs)} regions; the limit is {limits.MAX_REGIONS}")
    if g.bytes_per_block == 0:
        raise invalid("geometry.bytes_per_block must be > 0")
    if g.block_stride_bytes and g.block_stride_bytes < g.bytes_per_block:
        raise invalid("geometry.block_stride_bytes is smaller than bytes_per_block")
    if g.num_blocks == 0:
        raise invalid("geometry.num_blocks must be > 0")
    if g.tokens_per_block == 0:
        raise invalid("geometry.tokens_per_block must be > 0")
    if g.dtype not in _DTYPES:
        raise invalid(f"geometry.dtype {g.dtype!r} is not one of {sorted(_DTYPES)}")
    if not g.fingerprint:
        raise invalid("geometry.fingerprint is required (peers with different fingerprints cannot exchange KV)")
    limits.check_id("geometry.fingerprint", g.fingerprint)


@dataclasses.dataclass(frozen=True)
class PairVerdict:
    """Whether KV held by one engine can move into another's, decided from what both
    registered (``kvbaton.kvgeometry``): ``reason`` is empty when it can, and then
    ``writer_ranks`` are the owner's ranks that move anything (one outcome each)."""

    reason: str
    writer_ranks: tuple[int, ...] = ()


def _engine_shape(rank: pb.EngineRank) -> tuple:
    """What every rank of one engine must agree on."""
    return (rank.role, rank.tp_size, rank.geometry.fingerprint, rank.geometry.total_kv_heads,
            rank.geometry.head_major)


class RegistrarService:
    def __init__(self, store: Store, *, clock: Clock | None = None, prefix: bytes = b"kvb/reg/",
                 metrics: ServiceMetrics | None = None) -> None:
        self.store = store
        self.metrics = metrics or ServiceMetrics()
        self.clock = clock or WallClock()
        self.prefix = prefix

    def _ekey(self, engine_id: str, rank: int | None = None) -> bytes:
        base = self.prefix + b"e/" + engine_id.encode() + b"/"
        return base if rank is None else base + b"%05d" % rank

    def _okey(self, engine_id: str, rank: int | None = None) -> bytes:
        base = self.prefix + b"o/" + engine_id.encode() + b"/"
        return base if rank is None else base + b"%05d" % rank

    async def _check_owner(self, engine_id: str, owner: str, verb: str) -> None:
        """Refuses ``owner`` if a live rank of ``engine_id`` was registered by another identity."""
        if not owner:
            return
        kvs, _ = await self.store.range(self._okey(engine_id))
        if any(kv.value.decode() != owner for kv in kvs):
            raise denied(f"engine {engine_id} is registered by another identity (token or client certificate); "
                         f"it may {verb} only as that identity, or after its registration lapses")

    def _rkey(self, conversation_id: str) -> bytes:
        return self.prefix + b"r/" + conversation_id.encode()

    def _dkey(self, engine_id: str) -> bytes:
        """The drain marker: outlives the engine's rank records (no lease), so an engine
        that re-registers while drained stays drained."""
        return self.prefix + b"d/" + engine_id.encode()

    # -- engines -----------------------------------------------------------
    async def register_engine(self, rank: pb.EngineRank, ttl_ms: int, *, owner: str = "") -> tuple[pb.EngineRank, int]:
        """``owner``: the caller's identity ("" = unauthenticated: not recorded, not checked)."""
        limits.check_engine_id("engine_id", rank.engine_id)
        if rank.role == cpb.ENGINE_ROLE_UNSPECIFIED:
            raise invalid("role is required (PREFILL, DECODE or BOTH)")
        if not 1 <= rank.tp_size <= limits.MAX_TP_SIZE:
            raise invalid(f"tp_size is {rank.tp_size}; it must lie in [1, {limits.MAX_TP_SIZE}]")
        if rank.tp_rank >= rank.tp_size:
            raise invalid(f"tp_rank {rank.tp_rank} is not below tp_size {rank.tp_size}")
        limits.check_id("agent_name", rank.agent_name)
        if not rank.agent_metadata:
            raise invalid("agent_metadata is empty")
        if len(rank.agent_metadata) > limits.MAX_AGENT_METADATA_BYTES:
            raise invalid(f"agent_metadata is {len(rank.agent_metadata)} bytes; the limit is {limits.MAX_AGENT_METADATA_BYTES}")
        validate_geometry(rank.geometry)
        if rank.geometry.total_kv_heads:
            why = split_reason(rank.tp_size, rank.geometry.total_kv_heads)
            if why:
                raise invalid(f"geometry.total_kv_heads: {why}")
        limits.check_labels("labels", dict(rank.labels))
        if rank.serve_url and (not rank.serve_url.startswith(("http://", "https://"))
                               or len(rank.serve_url) > limits.MAX_LABEL_BYTES):
            raise invalid(f"serve_url {rank.serve_url[:80]!r} must be an http(s):// URL of at most "
                          f"{limits.MAX_LABEL_BYTES} bytes")
        ttl = limits.check_range("ttl_ms", ttl_ms, limits.MIN_ENGINE_TTL_MS, limits.MAX_ENGINE_TTL_MS,
                                 default=limits.DEFAULT_ENGINE_TTL_MS)
        peers, _ = await self.store.range(self._ekey(rank.engine_id))
        for kv in peers:
            other = pb.EngineRank.FromString(kv.value)
            if other.tp_rank == rank.tp_rank:
                continue
            if _engine_shape(other) != _engine_shape(rank):
                raise precondition(
                    f"engine {rank.engine_id} rank {other.tp_rank} is registered with a different role, tp_size, "
                    "fingerprint or KV head count; deregister it first")
        rec = pb.EngineRank()
        rec.CopyFrom(rank)
        rec.registered_at_ms = self.clock.now_ms()
        rec.incarnation = secrets.token_hex(8)
        await self._check_owner(rank.engine_id, owner, "be registered again")
        rec.draining = await self.store.get(self._dkey(rank.engine_id)) is not None
        key = self._ekey(rank.engine_id, rank.tp_rank)
        limit = self.store.max_request_bytes
        if limit and rec.ByteSize() + len(key) + 64 > limit:
            # Refused up front: the store can never hold it, so a retry could never succeed.
            raise invalid(
                f"engine {rank.engine_id} rank {rank.tp_rank}: the registration is {rec.ByteSize()} bytes "
                f"(agent_metadata {len(rank.agent_metadata)} bytes) but this control plane's store ({self.store.name}) "
                f"takes at most {limit} bytes per write; shrink the NIXL metadata or raise the store's request limit")
        old = await self.store.get(key)
        store_lease = await self.store.grant_lease(ttl / 1000)
        if owner:
            await self.store.put(self._okey(rank.engine_id, rank.tp_rank), owner.encode(), lease=store_lease)
        await self.store.put(key, rec.SerializeToString(), lease=store_lease)
        if old is not None and old.lease and old.lease != store_lease:
            await self.store.revoke_lease(old.lease)  # the previous incarnation's liveness
        self.metrics.engine_registrations.labels(role_name(rank.role)).inc()
        log.info("engine.registered", engine_id=rank.engine_id, tp_rank=rank.tp_rank,
                 role=cpb.EngineRole.Name(rank.role), incarnation=rec.incarnation)
        return rec, ttl

    async def refresh_engine(self, engine_id: str, tp_rank: int, incarnation: str) -> int:
        limits.check_id("engine_id", engine_id)
        kv = await self.store.get(self._ekey(engine_id, tp_rank))
        if kv is None:
            raise not_found(f"engine {engine_id} rank {tp_rank} is not registered (liveness lapsed?): register again")
        rec = pb.EngineRank.FromString(kv.value)
        if incarnation and rec.incarnation != incarnation:
            raise not_found(f"engine {engine_id} rank {tp_rank} was re-registered (incarnation {rec.incarnation})")
        try:
            ttl_s = await self.store.keepalive(kv.lease)
        except LeaseNotFoundError:
            raise not_found(f"engine {engine_id} rank {tp_rank}'s liveness lapsed: register again") from None
        return int(ttl_s * 1000)

    async def deregister_engine(self, engine_id: str, tp_rank: int | None = None, *, owner: str = "") -> int:
        limits.check_id("engine_id", engine_id)
        await self._check_owner(engine_id, owner, "be deregistered")
        if tp_rank is None:
            kvs, _ = await self.store.range(self._ekey(engine_id))
        else:
            kv = await self.store.get(self._ekey(engine_id, tp_rank))
            kvs = [kv] if kv else []
        for kv in kvs:
            await self.store.delete(kv.key)
            await self.store.delete(self._okey(engine_id) + kv.key.rsplit(b"/", 1)[-1])
            if kv.lease:
                await self.store.revoke_lease(kv.lease)
        if kvs:
            log.info("engine.deregistered", engine_id=engine_id, ranks=len(kvs))
        return len(kvs)

    async def drain_engine(self, engine_id: str, *, undo: bool = False, reason: str = "") -> list[pb.EngineRank]:
        """Mark (or unmark) every rank of ``engine_id`` draining.

        The marker is written first, then each rank record is rewritten under its own
        liveness lease (a record that changed meanwhile is read again), so a watcher sees
        one PUT per rank with ``draining`` set. Draining an engine that is not registered
        is allowed (it may be restarting) and returns no ranks.
        """
        limits.check_id("engine_id", engine_id)
        if len(reason) > limits.MAX_REASON_BYTES:
            raise invalid(f"reason is {len(reason)} bytes; the limit is {limits.MAX_REASON_BYTES}")
        dkey = self._dkey(engine_id)
        if undo:
            await self.store.delete(dkey)
        else:
            await self.store.put(dkey, reason.encode())
        out: list[pb.EngineRank] = []
        kvs, _ = await self.store.range(self._ekey(engine_id))
        for kv in kvs:
            rec = await self._set_draining(engine_id, kv, not undo)
            if rec is not None:
                out.append(rec)
        log.info("engine.drain", engine_id=engine_id, undo=undo, ranks=len(out), reason=reason)
        return out

    async def _set_draining(self, engine_id: str, kv: KeyValue, draining: bool) -> pb.EngineRank | None:
        """Rewrite one rank record with ``draining`` (under its own liveness lease);
        None when the rank went away meanwhile."""
        for _ in range(16):
            rec = pb.EngineRank.FromString(kv.value)
            if rec.draining == draining:
                return rec
            rec.draining = draining
            result = await self.store.txn([Compare.unchanged(kv, kv.key)],
                                          [Put(kv.key, rec.SerializeToString(), lease=kv.lease)])
            if result.succeeded:
                return rec
            fresh = await self.store.get(kv.key)
            if fresh is None:
                return None
            kv = fresh
        raise DomainError(Code.ABORTED, f"engine {engine_id} kept changing; retry the drain")

    async def is_draining(self, engine_id: str) -> bool:
        return await self.store.get(self._dkey(engine_id)) is not None

    async def get_engine(self, engine_id: str) -> list[pb.EngineRank]:
        limits.check_id("engine_id", engine_id)
        kvs, _ = await self.store.range(self._ekey(engine_id))
        if not kvs:
            raise not_found(f"engine {engine_id} is not registered")
        return [pb.EngineRank.FromString(kv.value) for kv in kvs]

    async def pair_verdict(self, owner_engine_id: str, receiver_engine_id: str) -> PairVerdict | None:
        """Can KV held by ``owner_engine_id`` (prefill in push/pull, decode in reuse) land in
        ``receiver_engine_id``'s ranks? None when either engine has no rank registered now
        (nothing to judge: the transfer proceeds and fails or succeeds on its own).

        Engines that did not publish their KV head count (``geometry.total_kv_heads``: older
        connectors) are judged on dtype, layout, layer count and block size only, and get no
        writer ranks (the completion's ``writers`` count, as before)."""
        owner, _ = await self.store.range(self._ekey(owner_engine_id), limit=1)
        receiver, _ = await self.store.range(self._ekey(receiver_engine_id), limit=1)
        if not owner or not receiver:
            return None
        src = EngineKv.from_rank(pb.EngineRank.FromString(owner[0].value))
        dst = EngineKv.from_rank(pb.EngineRank.FromString(receiver[0].value))
        if not (src.heads_known and dst.heads_known):
            return PairVerdict(basic_incompatibility(src, dst) or "")
        why = incompatibility(src, dst)
        if why:
            return PairVerdict(why)
        return PairVerdict("", writer_ranks(src, dst))

    async def engine_exists(self, engine_id: str) -> bool:
        kvs, _ = await self.store.range(self._ekey(engine_id), limit=1)
        return bool(kvs)

    async def list_engines(self, role: int = 0) -> list[pb.EngineRank]:
        return (await self._list_engines_at(role))[0]

    async def _list_engines_at(self, role: int = 0) -> tuple[list[pb.EngineRank], int]:
        kvs, rev = await self.store.range(self.prefix + b"e/")
        ranks = [pb.EngineRank.FromString(kv.value) for kv in kvs]
        return [r for r in ranks if not role or r.role == role], rev

    async def list_engines_page(self, role: int = 0, *, page_size: int = 0,
                                page_token: str = "") -> tuple[list[pb.EngineRank], str, int]:
        """One page by (engine, rank), bounded in bytes too (agent metadata may be MiBs),
        and the store revision it was read at (a follower watches the changes after it:
        :meth:`watch_engines`)."""
        listed, rev = await self._list_engines_at(role)
        ranks = sorted(listed, key=lambda r: (r.engine_id, r.tp_rank))
        page, token = paging.paginate(ranks, key=lambda r: (r.engine_id, r.tp_rank), size=lambda r: r.ByteSize(),
                                      kind="engines", page_size=paging.page_size(page_size), page_token=page_token)
        return page, token, rev

    async def watch_engines(self, role: int = 0, *, after_revision: int = 0,
                            incarnation: str = "") -> AsyncIterator[pb.EngineEvent]:
        """A snapshot (PUTs) then every change; or, with ``after_revision`` (a listing's
        revision, under store ``incarnation``), only the changes after it, so that a
        follower that listed first sees each change once and none is lost between its
        listing and its watch. A revision this store can no longer resume from is refused
        (the follower lists again)."""
        prefix = self.prefix + b"e/"
        if after_revision:
            if incarnation and self.store.incarnation and incarnation != self.store.incarnation:
                raise precondition(f"revision {after_revision} was read under store incarnation {incarnation}, "
                                   f"now {self.store.incarnation} (the store restarted): list the engines again")
            current = await self.store.current_revision()
            if after_revision > current:
                raise precondition(f"revision {after_revision} lies beyond the store's ({current}): "
                                   "list the engines again")
            try:
                watch = await self.store.watch(prefix, start_revision=after_revision + 1, prev_kv=True)
            except CompactedError as exc:
                raise precondition(f"revision {after_revision} is no longer kept (compacted, oldest "
                                   f"{exc.compact_revision}): list the engines again") from None
        else:
            kvs, rev = await self.store.range(prefix)
            for kv in kvs:
                r = pb.EngineRank.FromString(kv.value)
                if not role or r.role == role:
                    yield pb.EngineEvent(type=pb.EngineEvent.TYPE_PUT, rank=r, revision=kv.mod_revision)
            watch = await self.store.watch(prefix, start_revision=rev + 1, prev_kv=True)
        try:
            async for batch in watch:
                for ev in batch:
                    if ev.type is EventType.PUT:
                        r = pb.EngineRank.FromString(ev.kv.value)
                        kind = pb.EngineEvent.TYPE_PUT
                    else:
                        if ev.prev_kv is None or not ev.prev_kv.value:
                            continue
                        r = pb.EngineRank.FromString(ev.prev_kv.value)
                        kind = pb.EngineEvent.TYPE_DELETE
                    if not role or r.role == role:
                        yield pb.EngineEvent(type=kind, rank=r, revision=ev.revision)
        except CompactedError as exc:
            raise precondition(f"the watch fell out of the kept history (oldest {exc.compact_revision}): "
                               "list the engines again") from None
        finally:
            await watch.close()

    # -- retained blocks ---------------------------------------------------
    async def register_retained(self, retained: pb.RetainedBlocks) -> tuple[pb.RetainedBlocks, pb.RetainedBlocks | None]:
        limits.check_id("conversation_id", retained.conversation_id)
        limits.check_engine_id("engine_id", retained.engine_id)
        ids = limits.check_block_ids("block_ids", retained.block_ids)
        if retained.tokens_per_block == 0:
            raise invalid("tokens_per_block must be > 0")
        if retained.num_tokens == 0 or retained.num_tokens > len(ids) * retained.tokens_per_block:
            raise invalid(f"num_tokens {retained.num_tokens} does not fit {len(ids)} blocks of {retained.tokens_per_block}")
        if retained.block_hashes and len(retained.block_hashes) != retained.num_tokens // retained.tokens_per_block:
            raise invalid(f"{len(retained.block_hashes)} block hashes for {retained.num_tokens // retained.tokens_per_block} full blocks")
        if any(len(h) > limits.MAX_HASH_BYTES or not h for h in retained.block_hashes):
            raise invalid(f"block hashes must be 1..{limits.MAX_HASH_BYTES} bytes")
        ranks = await self.store.range(self._ekey(retained.engine_id), limit=1)
        if not ranks[0]:
            raise not_found(f"engine {retained.engine_id} is not registered")
        first = pb.EngineRank.FromString(ranks[0][0].value)
        if first.role not in (cpb.ENGINE_ROLE_DECODE, cpb.ENGINE_ROLE_BOTH):
            raise precondition(f"engine {retained.engine_id} is not a decode engine")
        if first.draining or await self.is_draining(retained.engine_id):
            # The engine frees the blocks when this is refused: a drained engine ends up
            # holding no conversation.
            raise precondition(f"engine {retained.engine_id} is draining: it retains no new conversation")
        key = self._rkey(retained.conversation_id)
        for _ in range(16):
            old = await self.store.get(key)
            rec = pb.RetainedBlocks()
            rec.CopyFrom(retained)
            rec.retention_id = secrets.token_hex(8)
            rec.registered_at_ms = self.clock.now_ms()
            result = await self.store.txn([Compare.unchanged(old, key)], [Put(key, rec.SerializeToString())])
            if result.succeeded:
                return rec, (pb.RetainedBlocks.FromString(old.value) if old else None)
        raise DomainError(Code.ABORTED, f"retained blocks of {retained.conversation_id} kept conflicting; retry")

    async def lookup_retained(self, conversation_id: str) -> pb.RetainedBlocks:
        limits.check_id("conversation_id", conversation_id)
        kv = await self.store.get(self._rkey(conversation_id))
        if kv is None:
            raise not_found(f"no retained blocks for conversation {conversation_id}")
        return pb.RetainedBlocks.FromString(kv.value)

    async def find_retained(self, conversation_id: str) -> pb.RetainedBlocks | None:
        """The conversation's current retained registration, or None (what reuse reads
        are fenced against: its ``retention_id`` is the blocks' generation)."""
        kv = await self.store.get(self._rkey(conversation_id))
        return pb.RetainedBlocks.FromString(kv.value) if kv is not None else None

    async def retention_revision(self, conversation_id: str, retention_id: str) -> int | None:
        """The store revision at which ``retention_id`` was registered, if it is still the
        conversation's registration (the lease service orders a late Grant against a revoke
        with it: both live in the one store, so their revisions compare)."""
        kv = await self.store.get(self._rkey(conversation_id))
        if kv is None or pb.RetainedBlocks.FromString(kv.value).retention_id != retention_id:
            return None
        return kv.mod_revision

    async def release_retained(self, conversation_id: str, retention_id: str = "") -> bool:
        limits.check_id("conversation_id", conversation_id)
        limits.check_id("retention_id", retention_id, required=False)
        key = self._rkey(conversation_id)
        kv = await self.store.get(key)
        if kv is None:
            return False
        if retention_id and pb.RetainedBlocks.FromString(kv.value).retention_id != retention_id:
            return False
        result = await self.store.txn([Compare.unchanged(kv, key)], [Delete(key)])
        return result.succeeded
