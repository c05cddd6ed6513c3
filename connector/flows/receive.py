"""Loads: KV arriving into this engine's blocks (decode's pull and push, prefill's reuse).

* **Pull** (decode): look the prefill rank up (cached), READ through :mod:`.sequence` with a
  :class:`~kvbaton.connector.wire.Done` message that NIXL delivers to prefill after the
  data (prefill frees). A load with no blocks only sends ``Done`` (release only).
* **Push** (decode): wait for prefill's :class:`~kvbaton.connector.wire.Pushed` (it follows
  the WRITE's data), or for the rendezvous to say the transfer is off.
* **Reuse** (prefill reads a conversation's history from decode's retained blocks):
  ``Lease.Pin`` (control thread) → check the pinned lease still names the retention the
  router looked up → READ with a :class:`~kvbaton.connector.wire.ReuseServed` message →
  ``Lease.Unpin``. The READ must finish within half the pin's TTL counted from when the pin
  was *requested* (so it ends before the service can let the pin lapse, without comparing
  clocks). A refused pin, a mismatch or a failed/late READ fails the load.

Landed data is verified first with ``verify_kv`` (:mod:`.verify`). Any failure (unknown
engine, layout mismatch, NIXL error, timeout, mismatch) reports the block ids as load
errors *and* the request as finished, so vLLM's ``kv_load_failure_policy=recompute``
recomputes it and every block is freed; a push is also cancelled at the rendezvous.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import grpc

from kvbaton.services.tracing import grpc_metadata
from kvbaton.stack.procs import process_group_members
from kvbaton.v1 import lease_pb2 as lpb
from kvbaton.v1 import rendezvous_pb2 as rpb

from .. import wire
from ..control import rendezvous_call, unregistered
from ..metadata import LoadSpec
from ..settings import MODE_PUSH, MODE_REUSE
from ..transfer.integrity import Fingerprints, KvIntegrityError
from .context import FlowContext, error_text, fire_and_forget
from .faults import kill_own_process_group, kill_process_group
from .load import Load
from .load_stats import count_load, record_finish
from .sequence import Move, Mover, push_xfer_id
from .staged import StagedFlow
from .verify import Verifier

log = logging.getLogger("kvbaton.connector.receive")

# Pull: how long after the load starts a BeginRead answered "no hold" is asked again (the
# prefill's Complete and its response to the router race; the response may win).
BEGIN_READ_HOLD_GRACE_S = 2.0
#: BeginRead refused because this engine is not registered (a lapse): asked again this much later
UNREGISTERED_RETRY_S = 0.5


class ReceiveFlow:
    def __init__(self, ctx: FlowContext, mover: Mover, verifier: Verifier, staged: StagedFlow | None) -> None:
        self.ctx = ctx
        self.mover = mover
        self.verifier = verifier
        self.staged = staged
        self.loads: list[Load] = []
        # push: writer agent -> its Pushed, per transfer (TP: one per prefill rank writing to us)
        self._push_arrived: dict[str, tuple[float, dict[str, wire.Pushed]]] = {}
        self._push_failed: dict[str, tuple[float, str]] = {}  # rendezvous said the push is off

    @property
    def busy(self) -> bool:
        return bool(self.loads)

    def on_load(self, req_id: str, spec: LoadSpec, now: float) -> None:
        self.loads.append(Load(req_id, spec, now + self.ctx.settings.timeout_s, now))

    def on_pushed(self, peer: str, msg: wire.Pushed) -> None:
        """One writer rank's WRITE into our blocks is complete (its data came first)."""
        self.ctx.stats.record("notif", transfer_id=msg.transfer_id, peer=peer, kind="push", nbytes_in=msg.nbytes,
                              writers=msg.writers)
        got = self._push_arrived.setdefault(msg.transfer_id, (self.ctx.clock(), {}))
        got[1][peer] = msg

    def on_reuse_served(self, peer: str, msg: wire.ReuseServed) -> None:
        """Decode only counts it: the blocks belong to the lease, not to the reader."""
        self.ctx.stats.record("reuse_served", conversation_id=msg.conversation_id, peer=peer,
                              served_nbytes=msg.nbytes)

    def on_event(self, tid: str, ev: Any) -> None:
        """A rendezvous event for a transfer this engine offered (decode, push)."""
        T = rpb.RendezvousEvent
        if ev.type in (T.TYPE_EXPIRED, T.TYPE_CANCELLED) or (
                ev.type == T.TYPE_DONE and ev.transfer.phase == rpb.TRANSFER_PHASE_FAILED):
            # Also a push refused at the match (incompatible KV) or failed by any rank:
            # recompute now rather than wait out the timeout for a WRITE.
            self._push_failed[tid] = (self.ctx.clock(), ev.transfer.reason or "expired/cancelled/failed")

    def expire(self, now: float, max_age_s: float) -> None:
        for box in (self._push_arrived, self._push_failed):
            for tid, v in list(box.items()):
                if now - v[0] > max_age_s:
                    del box[tid]

    def progress(self, now: float) -> None:
        keep: list[Load] = []
        for ld in self.loads:
            try:
                done = self._step(ld, now)
            except Exception as exc:  # noqa: BLE001 - any failure → recompute
                if ld.move is not None:
                    self.mover.abort(ld.move)
                self.finish(ld, ok=False, reason=error_text(exc))
                done = True
            if not done:
                keep.append(ld)
        self.loads = keep

    def close(self) -> None:
        for ld in self.loads:
            if ld.move is not None:
                self.mover.abort(ld.move)
            self.finish(ld, ok=False, reason="shutdown")
        self.loads = []

    # ------------------------------------------------------------------ steps
    def _step(self, ld: Load, now: float) -> bool:
        """Advance one load; True when finished (reported)."""
        if ld.landed:
            return self._verified(ld, now)
        if ld.spec.mode == MODE_PUSH:
            return self._step_push(ld, now)
        if ld.spec.mode == MODE_REUSE:
            if not self._pinned(ld, now):
                return False
            if now >= ld.read_deadline:
                src = ld.spec.reuse
                raise TimeoutError(f"reuse READ from {src.engine_id if src else '?'} not done within half the pin TTL")
            if self._fault_delay(ld, now):
                return False
        elif not ld.spec.local_block_ids:
            return self._release_only(ld, now)
        if not self._begun(ld, now):
            return False
        if ld.move is None:
            ld.move = self._move(ld)
        if not self.mover.step(ld.move, now):
            return False
        return self._landed(ld, now)

    def _move(self, ld: Load) -> Move:
        """The READ of this load: pull (Done to prefill) or reuse (ReuseServed to decode)."""
        spec, src = ld.spec, ld.spec.reuse
        if src is None:
            key, first, deadline = f"t:{spec.transfer_id}", -1, ld.deadline  # the owner finds the run
            message: Any = lambda mv: wire.Done(spec.transfer_id)  # noqa: E731
        else:
            key, deadline = f"r:{src.conversation_id}", ld.read_deadline
            first = src.num_tokens // self.ctx.layout.tokens_per_block - len(spec.remote_block_ids)
            message = lambda mv: wire.ReuseServed(src.conversation_id, mv.nbytes)  # noqa: E731
        eid = src.engine_id if src is not None else spec.remote_engine_id
        # verify_kv: ask first, so the owner answers in the same poll that serves the READ
        # (while it still holds the blocks and polls fast), not one idle poll later.
        return Move("READ", eid, spec.local_block_ids, spec.remote_block_ids, deadline, message,
                    before_post=lambda mv: self.verifier.ask(ld, mv.peer, key, first))

    def _step_push(self, ld: Load, now: float) -> bool:
        tid = ld.spec.transfer_id
        arrived = self._push_arrived.get(tid)
        # Complete only once every writer rank's WRITE landed: one notification per writer
        # (a prefill with more ranks than ours writes our heads from several ranks).
        if arrived is not None and len(arrived[1]) >= max(m.writers for m in arrived[1].values()):
            del self._push_arrived[tid]
            msgs = list(arrived[1].values())
            msg = msgs[0]
            ld.nbytes = sum(m.nbytes for m in msgs)
            # a staged push completed (every chunk scattered) before its message was sent
            if self.staged is not None and self.staged.completed_push(push_xfer_id(tid)):
                ld.strategy = "pack"
            if self.verifier.enabled:
                if len(msgs) > 1:
                    raise KvIntegrityError("verify_kv is not built for tensor-parallel pushes (several writers)")
                if not msg.fingerprints:
                    raise KvIntegrityError("the writer sent no fingerprints (verify_kv off there?)")
                ld.fp_owner = Fingerprints.decode(msg.fingerprints, ())
            return self._landed(ld, now)
        failed = self._push_failed.pop(tid, None)
        if failed is not None:
            raise RuntimeError(f"push transfer ended without data: {failed[1]}")
        if now >= ld.deadline:
            raise TimeoutError(f"no push WRITE for {tid} after {self.ctx.settings.timeout_s}s")
        return False

    def _release_only(self, ld: Load, now: float) -> bool:
        """Nothing to read (aborted, or all cached locally): tell prefill to free now."""
        eid = ld.spec.remote_engine_id
        got = self.ctx.peers.lookup_engine(eid, ld, now)
        if got is None:
            return False
        for agent, readers in self._owner_ranks(eid):
            self.ctx.notify(agent, wire.Done(ld.spec.transfer_id, readers))
        self.finish(ld, ok=True, reason="release-only")
        return True

    def _owner_ranks(self, engine_id: str) -> list[tuple[str, int]]:
        """(agent, readers) of each rank of a looked-up owner that this rank reads from:
        rank 0 alone without tensor parallelism."""
        peers = self.ctx.peers
        peer = peers.lookup_engine(engine_id, _NoWait(), 0.0)
        assert peer is not None
        if not peers.per_rank(engine_id):
            return [(peer.ranks[0].agent, 1)]
        m = peers.mapping(engine_id, peer_owns=True)
        return [(peer.ranks[s].agent, m.readers_of(s)) for s in sorted({p.src_rank for p in m.into(self.ctx.tp_rank)})]

    def _pinned(self, ld: Load, now: float) -> bool:
        """Reuse: pin the lease the router looked up, and check it still protects the
        retention we are about to read. True once pinned."""
        src = ld.spec.reuse
        assert src is not None
        if ld.pin_id:
            return True
        if ld.pin_future is None:
            ld.pin_sent = now
            req = lpb.PinRequest(conversation_id=src.conversation_id, lease_id=src.lease_id,
                                 reader=self.ctx.name, ttl_ms=int(self.ctx.settings.pin_ttl_s * 1000),
                                 reader_engine_id=self.ctx.settings.engine_id)
            md = grpc_metadata(ld.spec.traceparent)
            ld.pin_future = self.ctx.control.submit(lambda c: c.call(c.lease.Pin, req, retries=1, metadata=md))
        if not _answered(ld.pin_future, now, ld.deadline, "Lease.Pin"):
            return False
        fut, ld.pin_future = ld.pin_future, None
        try:
            resp = fut.result()
        except Exception as exc:  # noqa: BLE001 - refused or unreachable: either way, do not read
            detail = exc.details() if hasattr(exc, "details") else repr(exc)
            raise RuntimeError(f"pin refused: {detail}") from None
        ld.pin_id, ld.pin_expires_at_ms = resp.pin.pin_id, int(resp.pin.expires_at_ms)
        ld.t_pinned = now
        ld.read_deadline = ld.pin_sent + self.ctx.settings.pin_ttl_s * 0.5
        if resp.lease.retention_id != src.retention_id or resp.lease.engine_id != src.engine_id:
            raise RuntimeError(f"lease {src.lease_id} now protects retention {resp.lease.retention_id!r}, "
                               f"not {src.retention_id!r}")
        return True

    def _begun(self, ld: Load, now: float) -> bool:
        """Record this READ on the ledger (``Rendezvous/BeginRead``) before posting it, naming
        the owner's generation of the blocks; True once the READ may be posted.

        A refusal (FAILED_PRECONDITION: the prefill's hold expired or was cancelled, or the
        retained blocks were released or re-registered since the lookup) means the blocks
        may hold something else by now: the load fails and the request is recomputed. A
        server without ``BeginRead`` (UNIMPLEMENTED) is read from unrecorded, as before."""
        if ld.begun:
            return True
        if ld.begin_future is None:
            if now < ld.begin_after:
                return False
            req = begin_read_request(ld.spec, self.ctx.settings.engine_id, ld.req_id, self.ctx.peers.tp_size)
            # Over the engine's session like offers and completions (a traced one as its
            # own unary call; a server without sessions, or without BeginRead in them,
            # gets unary calls: kvbaton.client).
            ld.begin_future = self.ctx.control.submit(
                rendezvous_call("BeginRead", req, ld.spec.traceparent or None, retries=1))
        if not _answered(ld.begin_future, now, ld.deadline, "Rendezvous.BeginRead"):
            return False
        fut, ld.begin_future = ld.begin_future, None
        try:
            state = fut.result()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                ld.begun, ld.t_begun = True, now
                return True
            if (exc.code() == grpc.StatusCode.FAILED_PRECONDITION and ld.spec.mode != MODE_REUSE
                    and "no hold" in (exc.details() or "") and now < ld.t0 + BEGIN_READ_HOLD_GRACE_S):
                # The prefill's Complete (sent as it answered the router) may still be on
                # its way: ask again shortly rather than recompute a hold about to exist.
                return False
            if unregistered(exc) and now + UNREGISTERED_RETRY_S < ld.deadline:
                # Our registration lapsed (a refresh came late on a starved machine); the
                # worker registers again at its next refresh (every third of ttl_ms). Nothing
                # was recorded: ask again shortly rather than recompute (issue 14).
                ld.begin_after = now + UNREGISTERED_RETRY_S
                return False
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise RuntimeError(f"read fenced by the ledger: {exc.details()}") from None
            raise RuntimeError(f"BeginRead failed: {exc.code().name}: {exc.details()}") from None
        if state.phase == rpb.TRANSFER_PHASE_FAILED:  # another rank of ours failed this read already
            raise RuntimeError(f"read fenced by the ledger: {state.reason or 'the read failed'}")
        ld.begun, ld.ledger_attempt, ld.t_begun = True, int(state.attempt), now
        return True

    def _report_read(self, ld: Load, ok: bool, reason: str) -> None:
        """The READ's outcome on the ledger (its bytes): DONE then tells the owner it may
        free (pull) and ``kvbaton transfers list`` shows it."""
        if ld.ledger_attempt is None:
            return
        mv = ld.move
        nbytes = mv.nbytes if mv is not None and ok else 0
        req = rpb.ReportOutcomeRequest(
            transfer_id=ledger_transfer_id(ld.spec, ld.req_id), attempt=ld.ledger_attempt,
            outcome=rpb.Outcome(engine_id=self.ctx.settings.engine_id, tp_rank=self.ctx.tp_rank, success=ok, bytes=nbytes,
                                error=reason[:500], duration_us=int((time.monotonic() - ld.t0) * 1e6)))
        ld.ledger_attempt = None
        fut = self.ctx.control.submit(rendezvous_call("ReportOutcome", req, ld.spec.traceparent))
        fire_and_forget(fut, "ReportOutcome (read)", log)

    def _fault_delay(self, ld: Load, now: float) -> bool:
        """Test-only: widen the reuse READ window, pin held. True while held back."""
        if not self.ctx.faults.path or (ld.move is not None and ld.move.posted):
            return False
        if self.ctx.faults.value("kill_at_reuse_read"):
            src = ld.spec.reuse
            self.ctx.stats.record("fault_kill", req_id=ld.req_id, conversation_id=src.conversation_id if src else "",
                                  pin_id=ld.pin_id, pin_expires_at_ms=ld.pin_expires_at_ms)
            kill_own_process_group()
        if ld.fault_killed_group:  # the READ waits until the killed owner is really gone
            if process_group_members(ld.fault_killed_group) and now < ld.read_deadline:
                return True
            ld.fault_killed_group = 0
        elif pgid := self.ctx.faults.take_once("kill_group_at_reuse_read"):
            src = ld.spec.reuse
            self.ctx.stats.record("fault_kill_group", req_id=ld.req_id, pgid=pgid,
                                  conversation_id=src.conversation_id if src else "", pin_id=ld.pin_id,
                                  pin_expires_at_ms=ld.pin_expires_at_ms)
            kill_process_group(pgid)
            ld.fault_killed_group = pgid
            return True
        if not ld.delay_until:
            ld.delay_until = now + self.ctx.faults.value("delay_reuse_read_s")
            if ld.delay_until > now:
                src = ld.spec.reuse
                self.ctx.stats.record("fault_delay", req_id=ld.req_id, conversation_id=src.conversation_id if src
                                      else "", delay_s=ld.delay_until - now, pin_id=ld.pin_id)
        return now < ld.delay_until

    def _landed(self, ld: Load, now: float) -> bool:
        """The data is in our blocks: finish now, or verify first (``verify_kv``)."""
        if not self.verifier.enabled or not ld.spec.local_block_ids:
            self.finish(ld, ok=True)
            return True
        ld.landed, ld.t_landed = True, now
        return self._verified(ld, now)

    def _verified(self, ld: Load, now: float) -> bool:
        if not self.verifier.check(ld, now):
            return False
        self.finish(ld, ok=True)
        return True

    # ------------------------------------------------------------------ the end
    def finish(self, ld: Load, *, ok: bool, reason: str = "") -> None:
        now = time.monotonic()
        count_load(self.ctx, ld, ok=ok, reason=reason, now=now)
        record_finish(self.ctx, ld, ok=ok, reason=reason, dur=now - ld.t0)
        self._report_read(ld, ok, reason)
        if ld.spec.mode == MODE_REUSE:
            self._unpin(ld)
            self.ctx.report("recv", ld.req_id, ok, ld.spec.local_block_ids)
            return
        if not ok:
            self._give_up(ld, reason)
        if ld.spec.report_recv:
            self.ctx.report("recv", ld.req_id, ok, ld.spec.local_block_ids)

    def _give_up(self, ld: Load, reason: str) -> None:
        spec = ld.spec
        if spec.mode == MODE_PUSH and spec.transfer_id:
            if self.staged is not None:
                # a staged WRITE still in flight must not land in blocks vLLM frees now
                self.staged.cancel(push_xfer_id(spec.transfer_id))
            # Tell the rendezvous we gave up, so a late match is refused and prefill frees
            # its blocks (a write already in flight can still land: not fenced yet).
            cancel = rpb.CancelRequest(transfer_id=spec.transfer_id, engine_id=self.ctx.settings.engine_id,
                                       reason=f"decode gave up: {reason}"[:200])
            self.ctx.control.submit(rendezvous_call("Cancel", cancel, spec.traceparent, retries=1))
        # Let prefill free now rather than at its timeout (best effort): every owner rank
        # this rank reads from (each counts its readers' Done messages).
        if ld.move is not None and self.ctx.ep is not None and self.ctx.peers.known(spec.remote_engine_id):
            try:
                for agent, readers in self._owner_ranks(spec.remote_engine_id):
                    self.ctx.notify(agent, wire.Done(spec.transfer_id, readers))
            except Exception:  # best effort: prefill frees at its own timeout
                log.debug("failure notif not sent", exc_info=True)

    def _unpin(self, ld: Load) -> None:
        """Release our pin (fire-and-forget: a lost Unpin only delays expiry by the pin TTL)."""
        src = ld.spec.reuse
        if src is None or not ld.pin_id:
            return
        req = lpb.UnpinRequest(conversation_id=src.conversation_id, lease_id=src.lease_id, pin_id=ld.pin_id)
        ld.pin_id = ""
        md = grpc_metadata(ld.spec.traceparent)
        fut = self.ctx.control.submit(lambda c: c.call(c.lease.Unpin, req, retries=2, metadata=md))
        fire_and_forget(fut, "Unpin (the pin lapses by itself)", log)


def ledger_transfer_id(spec: LoadSpec, request_id: str) -> str:
    """The READ's transfer on the ledger: a pull's is the prefill's hold (its transfer id);
    a reuse READ's is the scheduler's fresh ``reuse-<hex>`` (the request id if it has none)."""
    if spec.mode == MODE_REUSE:
        return spec.transfer_id or f"reuse-{request_id}"
    return spec.transfer_id


def begin_read_request(spec: LoadSpec, engine_id: str, request_id: str, readers: int = 1) -> rpb.BeginReadRequest:
    """``BeginRead`` for a pull (generation: the hold's attempt, always 0 from this
    connector) or a reuse READ (generation: the retention_id the router looked up).

    Every tensor-parallel rank of the reader sends the same request (the ledger answers a
    repeat with the recorded state) and reports its own outcome: ``readers`` = our TP size."""
    if spec.mode == MODE_REUSE:
        src = spec.reuse
        assert src is not None
        return rpb.BeginReadRequest(transfer_id=ledger_transfer_id(spec, request_id), kind=rpb.TRANSFER_KIND_REUSE,
                                    reader_engine_id=engine_id, block_ids=spec.local_block_ids,
                                    generation=src.retention_id, conversation_id=src.conversation_id,
                                    source_block_ids=spec.remote_block_ids, request_id=request_id,
                                    readers=readers)
    return rpb.BeginReadRequest(transfer_id=spec.transfer_id, kind=rpb.TRANSFER_KIND_PULL,
                                reader_engine_id=engine_id, readers=readers,
                                block_ids=spec.ledger_block_ids or spec.local_block_ids, request_id=request_id)


class _NoWait:
    """A waiter for a lookup already cached (never pending)."""

    peer_future: Any = None
    deadline: float = 0.0


def _answered(fut: Any, now: float, deadline: float, what: str) -> bool:
    """True once a control-plane call ``fut`` has answered; past ``deadline`` it is
    abandoned and the load fails (TimeoutError -> recompute)."""
    if fut.done():
        return True
    if now >= deadline:
        fut.cancel()
        raise TimeoutError(f"{what} did not answer")
    return False
