"""Prefill: blocks held for a transfer, until decode is done with them (or the hold ends).

* Pull: each :class:`SendSpec` holds the request until decode's
  :class:`~kvbaton.connector.wire.Done` for its transfer id arrives (it rides on decode's
  READ, or comes alone) or ``timeout_s`` passes; then ``finished_sending`` (vLLM frees).
* Push: the hold waits for the rendezvous MATCH (from the control thread's subscription;
  it may come before the SendSpec), then WRITEs through :mod:`.sequence` with a
  :class:`~kvbaton.connector.wire.Pushed` message (carrying our fingerprints with
  ``verify_kv``) and reports the outcome to the rendezvous. A staged WRITE sends that
  message only once decode acked every chunk, so its arrival still means "complete".
  EXPIRED/CANCELLED before the WRITE started frees the blocks at once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from kvbaton.v1 import rendezvous_pb2 as rpb

from .. import wire
from ..control import rendezvous_call
from ..metadata import SendSpec
from ..settings import MODE_PULL, MODE_PUSH
from ..transfer.integrity import Fingerprints, KvIntegrityError
from .context import FlowContext, error_text, fire_and_forget, outcome
from .sequence import Move, Mover
from .verify import Verifier

log = logging.getLogger("kvbaton.connector.send")

# Pull: the ledger frees a hold's blocks (DONE after the reader's outcome, or EXPIRED at the
# hold's timeout); a READ begun just before that timeout may run until the rendezvous'
# match timeout (60 s by default) ends it. This local cap, past both, is only the last
# resort for a control plane that never answers.
PULL_HOLD_CAP_EXTRA_S = 75.0


@dataclasses.dataclass
class Held:
    req_id: str
    spec: SendSpec
    deadline: float
    t0: float
    match: Any = None  # push: the rendezvous TransferState once matched
    move: Move | None = None
    delay_until: float = 0.0  # test-only fault: the push WRITE held back until then


class SendFlow:
    def __init__(self, ctx: FlowContext, mover: Mover, verifier: Verifier) -> None:
        self.ctx = ctx
        self.mover = mover
        self.verifier = verifier
        self.held: dict[str, Held] = {}  # transfer_id -> held request
        self._early_done: dict[str, float] = {}  # Done messages that arrived before the SendSpec
        self._early_matches: dict[str, tuple[float, Any]] = {}  # MATCH before the SendSpec
        self._early_ended: dict[str, tuple[float, str, str]] = {}  # FAILED before the SendSpec
        self._done_from: dict[str, set[str]] = {}  # pull: reader agents whose Done arrived (TP)
        self._done_from_t: dict[str, float] = {}

    @property
    def busy(self) -> bool:
        return bool(self.held)

    def on_send(self, req_id: str, spec: SendSpec, now: float) -> None:
        tid = spec.transfer_id
        if spec.block_ids:
            self.verifier.expose(f"t:{tid}", spec.block_ids, mode=spec.mode, req_id=req_id)
        cap = spec.timeout_s + (PULL_HOLD_CAP_EXTRA_S if spec.mode == MODE_PULL else 0.0)
        held = Held(req_id, spec, now + cap, now)
        ended = self._early_ended.pop(tid, None) if spec.mode == MODE_PUSH else None
        if ended is not None:  # the rendezvous failed it already (refused at the match): free, never write
            self._cancelled(tid, req_id, spec.mode, ended[1], ended[2])
            return
        if spec.mode == MODE_PUSH:
            early = self._early_matches.pop(tid, None)
            if early is not None:
                held.match = early[1]
        elif self._early_done.pop(tid, None) is not None:
            self.ctx.stats.record("send_done", transfer_id=tid, req_id=req_id, notif=True, early=True)
            self.ctx.metrics.transfers.labels(MODE_PULL, "prefill", "ok").inc()
            self.ctx.report("sent", req_id, True)
            return
        self.held[tid] = held

    def on_done(self, peer: str, msg: wire.Done) -> None:
        """A reader rank is done with (or gave up on) our blocks: free once every reader
        rank of ours said so (``msg.readers``: one unless decode runs more ranks than us)."""
        tid = msg.transfer_id
        self.ctx.stats.record("notif", transfer_id=tid, peer=peer)
        seen = self._done_from.setdefault(tid, set())
        seen.add(peer)
        if len(seen) < max(msg.readers, 1):
            self._done_from_t.setdefault(tid, self.ctx.clock())
            return
        self._done_from.pop(tid, None)
        self._done_from_t.pop(tid, None)
        held = self.held.pop(tid, None)
        if held is None:
            self._early_done[tid] = self.ctx.clock()
            return
        self.ctx.stats.record("send_done", transfer_id=tid, req_id=held.req_id, notif=True,
                              held_s=round(time.monotonic() - held.t0, 6))
        self.ctx.metrics.transfers.labels(held.spec.mode, "prefill", "ok").inc()
        self.ctx.report("sent", held.req_id, True)

    def on_event(self, tid: str, ev: Any) -> None:
        """A rendezvous event for a transfer this engine prefilled."""
        T = rpb.RendezvousEvent
        state = ev.transfer
        held = self.held.get(tid)
        if ev.type == T.TYPE_MATCH:
            if held is not None and held.spec.mode == MODE_PUSH:
                held.match = state
            else:
                self._early_matches[tid] = (self.ctx.clock(), state)
        elif ev.type == T.TYPE_DONE and held is not None and held.spec.mode == MODE_PULL:
            # The reader reported (or the match timed out): the ledger says the READ is over.
            del self.held[tid]
            ok = state.phase == rpb.TRANSFER_PHASE_SUCCEEDED
            nbytes = sum(o.bytes for o in state.outcomes)
            self.ctx.stats.record("send_done", transfer_id=tid, req_id=held.req_id, ledger=True, ok=ok,
                                  read_nbytes=nbytes, held_s=round(time.monotonic() - held.t0, 6))
            self.ctx.metrics.transfers.labels(MODE_PULL, "prefill", "ok" if ok else "failed").inc()
            self.ctx.report("sent", held.req_id, ok)
        elif ev.type in (T.TYPE_EXPIRED, T.TYPE_CANCELLED) or (
                ev.type == T.TYPE_DONE and state.phase == rpb.TRANSFER_PHASE_FAILED):
            # Expired, cancelled, or failed (refused at the match as incompatible, a rank
            # failed, no outcome in time): free what we have not started writing.
            reason = state.reason or rpb.TransferPhase.Name(state.phase)
            label = "timeout" if ev.type == T.TYPE_EXPIRED else "failed"
            if held is not None and not self._posted(held):
                del self.held[tid]
                self._cancelled(tid, held.req_id, held.spec.mode, reason, label)
            elif held is None and state.phase == rpb.TRANSFER_PHASE_FAILED:
                # Refused before our SendSpec arrived (Complete goes out from the scheduler
                # process): drop the send when it comes.
                self._early_ended[tid] = (time.monotonic(), reason, label)

    def _cancelled(self, tid: str, req_id: str, mode: str, reason: str, label: str) -> None:
        self.ctx.stats.record("send_cancelled", transfer_id=tid, req_id=req_id, reason=reason)
        self.ctx.metrics.transfers.labels(mode, "prefill", label).inc()
        self.ctx.report("sent", req_id, False)

    @staticmethod
    def _posted(held: Held) -> bool:
        return held.move is not None and held.move.posted

    def expire(self, now: float, max_age_s: float) -> None:
        for tid, held in list(self.held.items()):
            if now >= held.deadline and not self._posted(held):
                del self.held[tid]
                self.ctx.stats.record("send_expired", transfer_id=tid, req_id=held.req_id)
                self.ctx.metrics.transfers.labels(held.spec.mode, "prefill", "timeout").inc()
                self.ctx.report("sent", held.req_id, False)
        for tid, t in list(self._early_done.items()):
            if now - t > max_age_s:
                del self._early_done[tid]
        for tid, (t, _) in list(self._early_matches.items()):
            if now - t > max_age_s:
                del self._early_matches[tid]
        for tid, (t, _, _) in list(self._early_ended.items()):
            if now - t > max_age_s:
                del self._early_ended[tid]
        for tid, t in list(self._done_from_t.items()):
            if now - t > max_age_s:
                del self._done_from_t[tid]
                self._done_from.pop(tid, None)

    # ------------------------------------------------------------------ push WRITEs
    def progress(self, now: float) -> None:
        for tid, held in list(self.held.items()):
            if held.spec.mode != MODE_PUSH or held.match is None:
                continue
            try:
                done, err = self._step_write(tid, held, now), ""
            except Exception as exc:  # noqa: BLE001 - any failure: report, free, decode recomputes
                if held.move is not None:
                    self.mover.abort(held.move)
                done, err = True, error_text(exc)
            if done:
                del self.held[tid]
                self._report_outcome(held, ok=not err, error=err, dur=now - held.t0)
                self.ctx.report("sent", held.req_id, not err)

    def _step_write(self, tid: str, held: Held, now: float) -> bool:
        if held.move is None and self._fault_delay(tid, held, now):
            return False
        if held.move is None:
            offer = held.match.offer
            local = tuple(held.spec.block_ids)
            remote = tuple(int(b) for b in offer.block_ids)
            if len(local) != len(remote):
                raise ValueError(f"block count mismatch: {len(local)} local vs {len(remote)} offered")
            # Decode needs only its last num_tokens tokens; the leading blocks are its own
            # prefix-cache hits (shared) and must not be written.
            skip = max(0, (held.spec.num_tokens - int(offer.num_tokens)) // self.ctx.layout.tokens_per_block)
            held.move = Move("WRITE", offer.engine_id, local[skip:], remote[skip:], held.deadline,
                             message=lambda mv: self._pushed(tid, local, skip, mv))
        return self.mover.step(held.move, now)

    def _fault_delay(self, tid: str, held: Held, now: float) -> bool:
        """Test-only (``delay_push_write_s``): hold the matched push WRITE back, so a test
        can kill a rank mid-push. True while held back."""
        if not self.ctx.faults.path:
            return False
        if not held.delay_until:
            held.delay_until = now + self.ctx.faults.value("delay_push_write_s")
            if held.delay_until > now:
                self.ctx.stats.record("fault_delay", transfer_id=tid, req_id=held.req_id,
                                      delay_s=round(held.delay_until - now, 3))
        return now < held.delay_until

    def _pushed(self, tid: str, local: tuple[int, ...], skip: int, mv: Move) -> wire.Message | None:
        """The push's message; with ``verify_kv`` it waits for our fingerprints (µs to ms)."""
        fps = ""
        if self.verifier.enabled:
            found = self.verifier.record(f"t:{tid}", 0, local)
            if found is None:
                raise KvIntegrityError("no fingerprints of the blocks to push")
            rec = found[0]
            if not rec.future.done():
                return None
            mine = rec.future.result()
            fps = Fingerprints(mine.alg, mine.block_ids[skip:], mine.values[skip:]).encode()
        return wire.Pushed(tid, mv.nbytes, fps)

    def _report_outcome(self, held: Held, *, ok: bool, error: str, dur: float) -> None:
        mv = held.move
        nbytes = mv.nbytes if mv is not None else 0
        chunks = mv.chunks if mv is not None else 0
        self.ctx.stats.record("send_done" if ok else "send_failed", transfer_id=held.spec.transfer_id,
                              req_id=held.req_id, mode=MODE_PUSH, write_nbytes=nbytes,
                              num_descs=mv.num_descs if mv is not None else 0, error=error, held_s=round(dur, 6),
                              strategy=mv.strategy if mv is not None else "runs", chunks=chunks)
        m = self.ctx.metrics
        m.transfers.labels(MODE_PUSH, "prefill", outcome(ok, error)).inc()
        if ok and mv is not None and mv.parts == []:
            return  # a rank whose heads another rank writes (replicas): not a writer, no outcome
        if ok:
            m.transfer_bytes.labels(MODE_PUSH, "write").inc(nbytes)
            if mv is not None and mv.t_post:
                m.transfer_seconds.labels(MODE_PUSH, "write").observe(time.monotonic() - mv.t_post)
        req = rpb.ReportOutcomeRequest(
            transfer_id=held.spec.transfer_id, attempt=held.match.attempt,
            outcome=rpb.Outcome(engine_id=self.ctx.settings.engine_id, tp_rank=self.ctx.tp_rank, success=ok,
                                bytes=nbytes if ok else 0, error=error[:500], duration_us=int(dur * 1e6)))
        fut = self.ctx.control.submit(rendezvous_call("ReportOutcome", req, held.spec.traceparent))
        fire_and_forget(fut, "ReportOutcome", log)
