"""Peer engines as this worker knows them: registrar lookups, cached per engine.

A lookup is a ``Registrar.GetEngine`` on the control thread; the asking flow polls its
future on every loop turn (never blocks) and gives up at its own deadline. The answer adds
the peer's NIXL metadata to the endpoint; :meth:`PeerCache.forget` drops it again after an
error, so a restarted peer is looked up afresh on the next transfer.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Any, Protocol

from ..control import ControlThread, geometry_fields
from ..transfer.geometry import KvLayout
from ..transfer.nixl_agent import NixlEndpoint
from ..transfer.staging import StagingInfo

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


class PeerCache:
    """engine id → (agent name, KV layout, staging pool) of peers whose metadata we hold."""

    def __init__(self, control: ControlThread, endpoint: NixlEndpoint | None = None, *, tp_size: int = 1) -> None:
        self.control = control
        self.ep = endpoint
        self.tp_size = tp_size  # ours
        self._peers: dict[str, tuple[str, KvLayout]] = {}
        self._staging: dict[str, StagingInfo | None] = {}

    def known(self, engine_id: str) -> bool:
        return engine_id in self._peers

    def staging(self, engine_id: str) -> StagingInfo | None:
        return self._staging.get(engine_id)

    def lookup(self, engine_id: str, waiter: Waiter, now: float) -> tuple[str, KvLayout] | None:
        """The peer's (agent, layout), fetched from the registrar once; None while pending.
        Raises TimeoutError past ``waiter.deadline``, LookupError for an unregistered engine."""
        assert self.ep is not None
        if engine_id in self._peers:
            return self._peers[engine_id]
        if waiter.peer_future is None:
            waiter.peer_future = self.control.get_engine(engine_id)
        if not waiter.peer_future.done():
            if now >= waiter.deadline:
                waiter.peer_future.cancel()
                raise TimeoutError(f"registrar lookup of engine {engine_id!r} timed out")
            return None
        fut, waiter.peer_future = waiter.peer_future, None
        resp = fut.result()
        if not resp.ranks:
            raise LookupError(f"engine {engine_id!r} has no registered ranks")
        rank = resp.ranks[0]
        if rank.tp_size > 1 or self.tp_size > 1:
            # Registered for real (the control plane pairs and counts ranks), but this data
            # path moves whole blocks rank 0 to rank 0 only: fail now, before any byte moves,
            # so the request recomputes at once instead of landing another rank's heads.
            raise NotImplementedError(
                f"tensor-parallel KV transfer (this engine TP {self.tp_size}, engine {engine_id!r} TP "
                f"{rank.tp_size}) is not built in this data path yet: recomputing")
        layout = KvLayout.from_proto_fields(**geometry_fields(rank))
        self.ep.add_peer(rank.agent_name, rank.agent_metadata)
        self._peers[engine_id] = (rank.agent_name, layout)
        self._staging[engine_id] = staging_from_rank(rank)
        return self._peers[engine_id]

    def forget(self, engine_id: str) -> None:
        """Drop a peer's metadata (it may be stale: the peer died or restarted)."""
        self._staging.pop(engine_id, None)
        got = self._peers.pop(engine_id, None)
        if got is not None and self.ep is not None:
            try:
                self.ep.remove_peer(got[0])
            except Exception:  # already gone is fine
                log.debug("remove_peer failed", exc_info=True)
