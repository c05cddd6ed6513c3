"""The one sequence every flow uses to move blocks between this engine and a peer.

peer lookup (registrar, cached) → plan (coalesced runs) → strategy (runs or pack) →
the message that rides on the data (for a push: waits for our fingerprints) → just before
posting, the caller's hook (a reader asks the owner for its fingerprints) → staged (pack
path, :mod:`.staged`) or runs (one NIXL READ/WRITE with the message as its notification)
→ poll until done, past the deadline raise; on a NIXL error forget the peer (its metadata
may be stale: it died or restarted) and raise.

Push WRITE (:mod:`.send`), pull READ and reuse READ (:mod:`.receive`) differ only in what
they pass in: the op, the deadline, the message and the hook.

Tensor parallelism (either engine TP > 1): the plan is per rank. This rank moves the heads
:class:`~kvbaton.connector.transfer.tp_mapping.TpMapping` gives it — a WRITE goes to every
peer rank holding heads we own (``out_of``), a READ comes from every peer rank owning heads
we hold (``into``) — as one :class:`Part` per peer rank, each one NIXL transfer carrying its
own copy of the message (with that part's bytes and the receiving side's fan-in:
``Pushed.writers`` / ``Done.readers``). These moves use runs only (the pack path stages
whole blocks between rank 0s), and ``verify_kv`` (whole-block fingerprints) is refused
for them. A caller that catches an
exception from :meth:`Mover.step` calls :meth:`Mover.abort` (releases what is in flight).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import wire
from ..settings import STAGING_ALWAYS, STAGING_NEVER
from ..transfer.descriptors import Op, TransferPlan, plan_transfer
from ..transfer.nixl_agent import Transfer
from ..transfer.staging import choose_strategy
from .context import FlowContext
from .peers import PeerEngine

if TYPE_CHECKING:  # pragma: no cover
    from .staged import SendJob, StagedFlow


def pick_strategy(setting: str, num_descs: int, nbytes: int, *, device: str,
                  local_pool: bool, remote_pool: bool) -> str:
    """``"runs"`` or ``"pack"`` for one transfer, from the ``staging`` setting.

    Pack needs a staging pool on both sides (the peer's is published with its rank; an
    engine without one, e.g. ``staging: never`` or an older connector, gets runs).
    ``auto`` asks :func:`staging.choose_strategy` (per-descriptor cost vs pack cost),
    which keeps vLLM's large CPU blocks on runs.
    """
    if setting == STAGING_NEVER or not local_pool or not remote_pool or nbytes <= 0:
        return "runs"
    if setting == STAGING_ALWAYS:
        return "pack"
    return choose_strategy(num_descs, nbytes, device=device)


@dataclasses.dataclass
class Move:
    """One movement of blocks: ours ``local`` ⇄ the peer's ``remote``, by ``deadline``."""

    op: Op  # "READ" (we pull) | "WRITE" (we push)
    engine_id: str  # the peer engine
    local: tuple[int, ...]
    remote: tuple[int, ...]
    deadline: float
    #: the message that travels with the data (runs) or after it (staged); None = not ready yet
    message: Callable[[Move], wire.Message | None]
    #: called once, just before the data is posted (a reader asks for fingerprints here)
    before_post: Callable[[Move], None] | None = None
    peer_future: concurrent.futures.Future[Any] | None = None
    peer: str = ""  # the peer's agent name, once looked up
    plan: TransferPlan | None = None
    nbytes: int = 0
    num_descs: int = 0
    strategy: str = "runs"
    msg: wire.Message | None = None
    xfer: Transfer | None = None  # runs: the posted NIXL transfer
    job: SendJob | None = None  # staged WRITE: our queued/running send
    staged_xid: str = ""  # staged READ: the id of the incoming transfer
    chunks: int = 0  # staged WRITE: chunks it was cut into
    t_post: float = 0.0  # when the data was posted (kvbaton_connector_transfer_seconds)
    done: bool = False
    #: per-rank moves (TP > 1 on either side): one per peer rank; None: the whole-block path
    parts: list[Part] | None = None

    @property
    def posted(self) -> bool:
        return (self.xfer is not None or self.job is not None or bool(self.staged_xid)
                or any(p.xfer is not None or p.done for p in self.parts or ()))


@dataclasses.dataclass
class Part:
    """This rank's share of a :class:`Move` with one peer rank (tensor parallelism)."""

    peer_rank: int
    agent: str
    plan: TransferPlan
    fan_in: int  # WRITE: writers of the peer rank; READ: readers of the peer (owner) rank
    xfer: Transfer | None = None
    done: bool = False


class Mover:
    """Advances :class:`Move` objects one non-blocking step at a time."""

    def __init__(self, ctx: FlowContext, staged: StagedFlow | None) -> None:
        self.ctx = ctx
        self.staged = staged

    def step(self, mv: Move, now: float) -> bool:
        """One look; True once the data is in place (the message sent). Raises on failure."""
        if mv.done:
            return True
        if mv.parts is not None and mv.msg is not None:
            return self._poll_parts(mv, now)
        if mv.xfer is not None:
            return self._poll_runs(mv, now)
        if mv.job is not None or mv.staged_xid:
            return self._poll_staged(mv, now)
        if mv.plan is None and not self._plan(mv, now):
            return False
        if mv.msg is None:
            mv.msg = mv.message(mv)
            if mv.msg is None:
                return False
            if mv.before_post is not None:
                mv.before_post(mv)
            mv.t_post = time.monotonic()
        if mv.parts is not None:
            return self._post_parts(mv, now)
        if mv.strategy == "pack":
            return self._start_staged(mv, now)
        try:
            assert mv.plan is not None
            ep, raw = self.ctx.endpoint, wire.encode(mv.msg)
            mv.xfer = ep.write(mv.plan, mv.peer, raw) if mv.op == "WRITE" else ep.read(mv.plan, mv.peer, raw)
        except Exception:
            self.ctx.peers.forget(mv.engine_id)  # metadata may be stale (peer restarted)
            raise
        return False

    def abort(self, mv: Move) -> None:
        """Release whatever is in flight after a failure (idempotent)."""
        if mv.xfer is not None:
            self.ctx.endpoint.release(mv.xfer)
            mv.xfer = None
        for part in mv.parts or ():
            if part.xfer is not None:
                self.ctx.endpoint.release(part.xfer)
                part.xfer = None
        if self.staged is not None:
            if mv.job is not None:
                self.staged.abandon(mv.job)
                mv.job = None
            if mv.staged_xid:
                self.staged.end_read(mv.peer, mv.staged_xid, ok=False)
                mv.staged_xid = ""

    # ------------------------------------------------------------------ steps
    def _plan(self, mv: Move, now: float) -> bool:
        peer = self.ctx.peers.lookup_engine(mv.engine_id, mv, now)
        if peer is None:
            return False
        if self.ctx.peers.per_rank(mv.engine_id):
            self._plan_parts(mv, peer)
            return True
        mv.peer, remote_layout = peer.ranks[0].agent, peer.ranks[0].layout
        mv.plan = plan_transfer(self.ctx.layout, list(mv.local), remote_layout, list(mv.remote), op=mv.op,
                                coalesce=True)
        mv.nbytes, mv.num_descs = mv.plan.nbytes, mv.plan.num_descs
        s = self.ctx.settings
        mv.strategy = pick_strategy(s.staging, mv.num_descs, mv.nbytes, device=self.ctx.layout.device,
                                    local_pool=self.staged is not None and self.staged.has_pool,
                                    remote_pool=self.ctx.peers.staging(mv.engine_id) is not None)
        return True

    def _plan_parts(self, mv: Move, peer: PeerEngine) -> None:
        """Per rank: one :class:`Part` per peer rank this rank exchanges heads with."""
        peers, me = self.ctx.peers, self.ctx.tp_rank
        if self.ctx.fp is not None:
            raise RuntimeError("verify_kv is not built for tensor-parallel moves (whole-block fingerprints)")
        reading = mv.op == "READ"
        m = peers.mapping(mv.engine_id, peer_owns=reading)
        pieces = m.into(me) if reading else m.out_of(me)
        by_peer: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for piece in pieces:
            other = piece.src_rank if reading else piece.dst_rank
            pl = peer.ranks[other].layout
            if reading:  # the peer owns: descs come back (owner rows, receiver rows)
                rem, loc = m.descs(piece, pl, mv.remote, self.ctx.layout, mv.local)
            else:
                loc, rem = m.descs(piece, self.ctx.layout, mv.local, pl, mv.remote)
            by_peer.setdefault(other, []).append((loc, rem))
        mv.parts = []
        for other, rows in sorted(by_peer.items()):
            loc = np.concatenate([r[0] for r in rows])
            rem = np.concatenate([r[1] for r in rows])
            plan = TransferPlan(loc, rem, int(loc[:, 1].sum()), len(loc), self.ctx.layout.nixl_mem_type,
                                peer.ranks[other].layout.nixl_mem_type)
            fan_in = m.readers_of(other) if reading else m.writers_of(other)
            mv.parts.append(Part(other, peer.ranks[other].agent, plan, fan_in))
        mv.peer = mv.parts[0].agent if len(mv.parts) == 1 else ""
        mv.nbytes = sum(p.plan.nbytes for p in mv.parts)
        mv.num_descs = sum(p.plan.num_descs for p in mv.parts)
        mv.strategy = "runs"

    def _post_parts(self, mv: Move, now: float) -> bool:
        assert mv.parts is not None and mv.msg is not None
        ep = self.ctx.endpoint
        try:
            for part in mv.parts:
                if part.plan.num_descs == 0:
                    part.done = True
                    continue
                raw = wire.encode(_for_part(mv.msg, part))
                part.xfer = ep.write(part.plan, part.agent, raw) if mv.op == "WRITE" else ep.read(
                    part.plan, part.agent, raw)
        except Exception:
            self.ctx.peers.forget(mv.engine_id)  # metadata may be stale (a peer rank restarted)
            raise
        return self._poll_parts(mv, now)

    def _poll_parts(self, mv: Move, now: float) -> bool:
        """Every part DONE → the move is done; any part ERR or late → it fails (all of it)."""
        ep = self.ctx.endpoint
        what = "WRITE to" if mv.op == "WRITE" else "READ from"
        for part in mv.parts or ():
            if part.done or part.xfer is None:
                continue
            st = ep.state(part.xfer)
            if st == "DONE":
                ep.release(part.xfer)
                part.xfer, part.done = None, True
            elif st == "ERR":
                self.ctx.peers.forget(mv.engine_id)
                raise RuntimeError(f"NIXL {what} {part.agent} (rank {part.peer_rank}) failed")
        if all(p.done for p in mv.parts or ()):
            mv.done = True
            return True
        if now >= mv.deadline:
            late = [p.agent for p in mv.parts or () if not p.done]
            raise TimeoutError(f"NIXL {what} {', '.join(late)} not done after {self.ctx.settings.timeout_s}s")
        return False

    def _poll_runs(self, mv: Move, now: float) -> bool:
        assert mv.xfer is not None
        ep = self.ctx.endpoint
        what = "WRITE to" if mv.op == "WRITE" else "READ from"
        st = ep.state(mv.xfer)
        if st == "DONE":
            ep.release(mv.xfer)
            mv.xfer, mv.done = None, True
            return True
        if st == "ERR":
            self.ctx.peers.forget(mv.engine_id)
            raise RuntimeError(f"NIXL {what} {mv.peer} failed")
        if now >= mv.deadline:
            raise TimeoutError(f"NIXL {what} {mv.peer} not done after {self.ctx.settings.timeout_s}s")
        return False

    def _start_staged(self, mv: Move, now: float) -> bool:
        assert self.staged is not None
        if mv.op == "WRITE":
            info = self.ctx.peers.staging(mv.engine_id)
            assert info is not None
            mv.job = self.staged.submit_send(mv.peer, mv.engine_id, info, mv.local, mv.remote,
                                             push_xfer_id_of(mv.msg), mv.deadline)
            return False
        xid = self.staged.start_read(mv.peer, mv.remote, mv.local, timeout_s=max(0.001, mv.deadline - now))
        if xid is None:  # no pool (cannot happen once chosen): wait, bounded by the deadline
            if now >= mv.deadline:
                raise TimeoutError("no staging pool")
            return False
        mv.staged_xid = xid
        return False

    def _poll_staged(self, mv: Move, now: float) -> bool:
        assert self.staged is not None and mv.msg is not None
        if mv.job is not None:
            if mv.job.error is not None:
                err, mv.job = mv.job.error, None
                self.ctx.peers.forget(mv.engine_id)
                raise err
            if not mv.job.finished:
                return False
            mv.chunks, mv.job = mv.job.chunks, None
        else:
            if not self.staged.read_done(mv.staged_xid):
                if now >= mv.deadline:
                    self.ctx.peers.forget(mv.engine_id)  # dead or restarted owner: look it up again
                    raise TimeoutError(f"staged READ {mv.staged_xid} from {mv.peer} not complete in time")
                return False
            self.staged.end_read(mv.peer, mv.staged_xid, ok=True)
            mv.staged_xid = ""
        # every chunk is scattered into the receiver's blocks: now the message (the owner
        # frees / counts; decode's "push arrived" still means "the blocks are complete")
        self.ctx.notify(mv.peer, mv.msg)
        mv.done = True
        return True


def _for_part(msg: wire.Message, part: Part) -> wire.Message:
    """The move's message as one peer rank gets it: that part's bytes and fan-in."""
    if isinstance(msg, wire.Pushed):
        return dataclasses.replace(msg, nbytes=part.plan.nbytes, writers=part.fan_in)
    if isinstance(msg, wire.Done):
        return dataclasses.replace(msg, readers=part.fan_in)
    if isinstance(msg, wire.ReuseServed):
        return dataclasses.replace(msg, nbytes=part.plan.nbytes)
    return msg


def push_xfer_id(transfer_id: str) -> str:
    """Staged-protocol id of a push's WRITE: derived from the transfer id, so a decode that
    gave up on the transfer can refuse its late chunks (:meth:`StagedPeer.cancel`)."""
    if transfer_id and not any(c.isspace() for c in transfer_id):
        return "w" + transfer_id
    return "w" + uuid.uuid4().hex


def push_xfer_id_of(msg: wire.Message | None) -> str:
    return push_xfer_id(msg.transfer_id if isinstance(msg, wire.Pushed) else "")
