"""Peer engines as this worker knows them: registrar lookups, cached per engine.

A lookup is a ``Registrar.GetEngine`` on the control thread; the asking flow polls its
future on every loop turn (never blocks) and gives up at its own deadline. The answer
holds every tensor-parallel rank of the peer (agent, layout) and adds each rank's NIXL
metadata to the endpoint; when either engine runs TP > 1, :meth:`PeerCache.mapping` says
which of our ranks moves which heads to/from which of theirs; :meth:`PeerCache.forget` drops it again after an
error, so a restarted peer is looked up afresh on the next transfer.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Any, Protocol

from kvbaton.kvgeometry import EngineKv

from ..control import ControlThread, geometry_fields
from ..transfer.geometry import KvLayout
from ..transfer.nixl_agent import NixlEndpoint
from ..transfer.staging import StagingInfo
from ..transfer.tp_mapping import KvIncompatible, TpMapping, compute_tp_mapping

log = logging.getLogger("kvbaton.connector.peers")


def agent_name(engine_id: str, tp_rank: int) -> str:
    return f"kvb-{engine_id}-r{tp_rank}"


def engine_of_agent(agent: str) -> str:
    """Inverse of :func:`agent_name` (``kvb-<engine>-r<rank>`` → engine id)."""
    core = agent.removeprefix("kvb-")
    head, sep, rank = core.rpartition("-r")
    return head if sep and rank.isdigit() else core


def staging_from_rank(rank: Any) -> StagingInfo | None:
    """A peer's published receive pool (``EngineRank.staging``), None when it has none."""
    st = rank.staging if rank.HasField("staging") else None
    if st is None or not st.num_slots or not st.slot_bytes:
        return None
    return StagingInfo(int(st.base_addr), int(st.slot_bytes), int(st.num_slots), st.mem_type or "DRAM",
                       int(st.device_id))


class Waiter(Protocol):
    """Anything that waits for a lookup: holds its pending future, gives up at its deadline."""

    peer_future: concurrent.futures.Future[Any] | None
    deadline: float


@dataclasses.dataclass(frozen=True)
class PeerRank:
    """One tensor-parallel rank of a peer engine: its NIXL agent and its KV layout."""

    rank: int
    agent: str
    layout: KvLayout


@dataclasses.dataclass(frozen=True)
class PeerEngine:
    """Every rank of a peer engine (``Registrar.GetEngine`` answers them all), and what its
    ranks published about the KV cache (for :func:`compute_tp_mapping`)."""

    engine_id: str
    ranks: dict[int, PeerRank]
    kv: EngineKv

    @property
    def tp_size(self) -> int:
        return self.kv.tp_size


class PeerCache:
    """engine id → every rank of peers whose metadata we hold (agents added to the endpoint).

    ``me``: what our own ranks published (set once the caches are registered); the per-rank
    plan between us and a peer (:meth:`mapping`) is computed from it and the peer's ranks."""

    def __init__(self, control: ControlThread, endpoint: NixlEndpoint | None = None, *, tp_size: int = 1,
                 me: EngineKv | None = None) -> None:
        self.control = control
        self.ep = endpoint
        self.tp_size = tp_size  # ours
        self.me = me
        self._engines: dict[str, PeerEngine] = {}
        self._staging: dict[str, StagingInfo | None] = {}
        self._mappings: dict[tuple[str, bool], TpMapping] = {}

    def known(self, engine_id: str) -> bool:
        return engine_id in self._engines

    def staging(self, engine_id: str) -> StagingInfo | None:
        return self._staging.get(engine_id)

    def per_rank(self, engine_id: str) -> bool:
        """True when moves with this (looked up) peer go rank by rank through a
        :class:`TpMapping` (either side TP > 1); False: whole blocks, rank 0 to rank 0."""
        return self.tp_size > 1 or self._engines[engine_id].tp_size > 1

    def lookup(self, engine_id: str, waiter: Waiter, now: float) -> tuple[str, KvLayout] | None:
        """The peer's rank 0 (agent, layout), fetched from the registrar once; None while
        pending. Raises TimeoutError past ``waiter.deadline``, LookupError for an
        unregistered engine (or one whose ranks have not all registered)."""
        peer = self.lookup_engine(engine_id, waiter, now)
        if peer is None:
            return None
        r0 = peer.ranks[0]
        return r0.agent, r0.layout

    def lookup_engine(self, engine_id: str, waiter: Waiter, now: float) -> PeerEngine | None:
        """Every rank of the peer (see :meth:`lookup`)."""
        assert self.ep is not None
        got = self._engines.get(engine_id)
        if got is not None:
            return got
        if waiter.peer_future is None:
            waiter.peer_future = self.control.get_engine(engine_id)
        if not waiter.peer_future.done():
            if now >= waiter.deadline:
                waiter.peer_future.cancel()
                raise TimeoutError(f"registrar lookup of engine {engine_id!r} timed out")
            return None
        fut, waiter.peer_future = waiter.peer_future, None
        peer = _peer_engine(engine_id, fut.result().ranks)
        for r in peer.ranks.values():
            self.ep.add_peer(r.agent, _metadata_of(fut, r.rank))
        self._engines[engine_id] = peer
        self._staging[engine_id] = staging_from_rank(_rank_proto(fut, 0))
        return peer

    def mapping(self, engine_id: str, *, peer_owns: bool) -> TpMapping:
        """The per-rank plan between us and a looked-up peer: the peer's KV into ours when
        ``peer_owns`` (we READ, or it pushes to us), ours into the peer's otherwise.
        Raises :class:`KvIncompatible` (with the reason) for a pair that cannot be mapped."""
        key = (engine_id, peer_owns)
        m = self._mappings.get(key)
        if m is None:
            if self.me is None:
                raise KvIncompatible("this rank's KV geometry is not known yet")
            other = self._engines[engine_id].kv
            m = compute_tp_mapping(other, self.me) if peer_owns else compute_tp_mapping(self.me, other)
            self._mappings[key] = m
        return m

    def forget(self, engine_id: str) -> None:
        """Drop a peer's metadata (it may be stale: the peer died or restarted)."""
        self._staging.pop(engine_id, None)
        for key in [k for k in self._mappings if k[0] == engine_id]:
            del self._mappings[key]
        got = self._engines.pop(engine_id, None)
        if got is None or self.ep is None:
            return
        for r in got.ranks.values():
            try:
                self.ep.remove_peer(r.agent)
            except Exception:  # already gone is fine
                log.debug("remove_peer failed", exc_info=True)


def _rank_proto(fut: concurrent.futures.Future[Any], rank: int) -> Any:
    return next(r for r in fut.result().ranks if int(r.tp_rank) == rank)


def _metadata_of(fut: concurrent.futures.Future[Any], rank: int) -> bytes:
    return bytes(_rank_proto(fut, rank).agent_metadata)


def _peer_engine(engine_id: str, ranks: Any) -> PeerEngine:
    """Every rank of a registrar answer, checked complete (ranks 0..tp_size-1)."""
    if not ranks:
        raise LookupError(f"engine {engine_id!r} has no registered ranks")
    tp = max(int(ranks[0].tp_size), 1)
    by_rank = {int(r.tp_rank): r for r in ranks}
    missing = sorted(set(range(tp)) - set(by_rank))
    if missing:
        raise LookupError(f"engine {engine_id!r} (TP {tp}) has no registered rank(s) {missing} yet")
    out = {r: PeerRank(r, by_rank[r].agent_name, KvLayout.from_proto_fields(**geometry_fields(by_rank[r])))
           for r in range(tp)}
    return PeerEngine(engine_id, out, EngineKv.from_rank(by_rank[0]))
