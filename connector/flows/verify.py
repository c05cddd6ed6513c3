"""KV integrity (``verify_kv``, :mod:`..transfer.integrity`): owner and reader sides.

The owner of the bytes fingerprints the blocks it exposes, on the ``kvbaton-verify``
thread, as soon as it learns of them (prefill: the SendSpec of a push or pull; decode: the
hold ids the scheduler passes in ``KvbatonMeta.retains`` in the step after a turn
finished). How the owner's fingerprints reach the reader:

* **push**: in the WRITE's :class:`~kvbaton.connector.wire.Pushed` message, so they arrive
  with the data and cost no round trip.
* **pull and reuse**: the reader sends :class:`~kvbaton.connector.wire.FpQuestion` just
  before posting its READ and the owner answers :class:`~kvbaton.connector.wire.FpAnswer`
  (it looks the reader up in the registrar like any peer). Why not the registrar's
  retained-blocks record or the pin answer: the scheduler process that registers
  retentions cannot read KV, and the worker that can computes the fingerprints only in
  the *next* step, so publishing them there means a second, racing write to the registrar
  and a router that must wait for it. The NIXL answer is owned end to end by the two
  workers that touch the bytes, needs no control-plane change, and overlaps the READ (the
  owner answers from fingerprints made when it exposed the blocks, so blocks freed or
  rewritten since then cannot match).

The reader fingerprints its landed blocks with the owner's algorithm and compares before
reporting the load finished. A mismatch, a missing answer (owner dead or without
``verify_kv``) or an owner that no longer has the record fails the load exactly like a
failed READ (recompute, blocks freed), with a ``kv_verify`` stats line,
``kvbaton_connector_kv_verifications_total`` and a warning.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from .. import wire
from ..settings import MODE_REUSE
from ..transfer.integrity import (
    Fingerprinter,
    Fingerprints,
    KvIntegrityError,
    compare,
    corrupt_block,
)
from .context import FlowContext
from .load import Load

log = logging.getLogger("kvbaton.connector.verify")

#: Upper bound on retained-block fingerprint records kept by one worker (oldest dropped):
#: a safety net only, holds are normally forgotten when the scheduler frees them.
MAX_RETAINED_RECORDS = 4096


@dataclasses.dataclass
class FpRecord:
    """Owner side: fingerprints of blocks this engine exposes (being computed or done)."""

    block_ids: tuple[int, ...]
    future: concurrent.futures.Future[Fingerprints]
    t: float
    hold_id: str = ""  # retained blocks: the scheduler's hold (dropped when it is freed)


@dataclasses.dataclass
class _Question:
    """Owner side: a reader's question waiting for its record or its reader's metadata."""

    q: wire.FpQuestion
    deadline: float
    t0: float
    peer_future: concurrent.futures.Future[Any] | None = None


class Verifier:
    """Both sides of ``verify_kv``. Exists with it off too: the owner then answers every
    question with a refusal (the reader fails its load rather than trust unverified KV)."""

    def __init__(self, ctx: FlowContext, post: Callable[[tuple[str, str, Any]], None]) -> None:
        self.ctx = ctx
        self.fp: Fingerprinter | None = ctx.fp
        self._post = post  # back onto the loop's inbox (the stats file has one writer)
        self.records: dict[str, list[FpRecord]] = {}  # owner: key -> records, newest first
        self._questions: list[_Question] = []  # owner: not answered yet
        self._answers: dict[str, tuple[float, wire.FpAnswer]] = {}  # reader: key -> (t, answer)
        self._retained = 0  # owner: records under "r:" keys (approximate, for the cap)

    @property
    def enabled(self) -> bool:
        return self.fp is not None

    @property
    def busy(self) -> bool:
        return bool(self._questions)

    # ------------------------------------------------------------------ owner
    def expose(self, key: str, block_ids: Any, *, mode: str, **fields: Any) -> None:
        """Start fingerprinting blocks we expose under ``key`` (verify thread)."""
        if self.fp is None or not block_ids:
            return
        ids = tuple(int(b) for b in block_ids)
        t0 = time.monotonic()
        fut = self.fp.submit(ids)
        recs = self.records.setdefault(key, [])
        recs.insert(0, FpRecord(ids, fut, t0, str(fields.get("hold_id", ""))))
        del recs[8:]  # a conversation's last few retentions are plenty
        if key.startswith("r:"):
            self._retained += 1
            if self._retained > MAX_RETAINED_RECORDS:
                self._cap_retained()

        def _done(f: concurrent.futures.Future[Fingerprints]) -> None:
            if f.cancelled() or f.exception() is not None:
                log.warning("kvbaton: fingerprinting %s failed: %r", key, None if f.cancelled() else f.exception())
                return
            self._post(("fp_stat", key, {"mode": mode, "role": "owner", "num_blocks": len(ids),
                                         "alg": f.result().alg, "duration_s": round(time.monotonic() - t0, 6),
                                         **fields}))
        fut.add_done_callback(_done)

    def _cap_retained(self) -> None:
        """Safety net: drop the oldest retained records beyond the cap."""
        ordered = sorted((r.t, k) for k, rs in self.records.items() if k.startswith("r:") for r in rs)
        cut = ordered[len(ordered) - MAX_RETAINED_RECORDS][0]
        for k in {k for _, k in ordered}:
            self.records[k] = [r for r in self.records[k] if r.t >= cut]
            if not self.records[k]:
                del self.records[k]
        self._retained = sum(len(rs) for k, rs in self.records.items() if k.startswith("r:"))

    def on_retain(self, hold_id: str, conversation_id: str, ids: tuple[int, ...]) -> None:
        """Decode: a finished turn's retained blocks (fingerprint them), or its hold was freed
        (empty ids: its blocks are not ours to vouch for any more)."""
        key = f"r:{conversation_id}"
        if ids:
            self.expose(key, ids, mode=MODE_REUSE, hold_id=hold_id)
            return
        recs = self.records.get(key, [])
        n = len(recs)
        recs[:] = [r for r in recs if r.hold_id != hold_id]
        self._retained -= n - len(recs)
        if not recs:
            self.records.pop(key, None)

    def record(self, key: str, first: int, ids: tuple[int, ...]) -> tuple[FpRecord, int] | None:
        """The newest record under ``key`` holding ``ids`` as a run, and where it starts.
        ``first`` is the reader's hint; a reader that skipped leading blocks it had cached
        locally (pull after a prefix hit) reads a later run, found by the position of its
        first id (block ids are unique within one record)."""
        for rec in self.records.get(key, ()):
            if not ids:
                return rec, 0
            starts = [first] if 0 <= first < len(rec.block_ids) else []
            if ids[0] in rec.block_ids:
                starts.append(rec.block_ids.index(ids[0]))
            for a in starts:
                if rec.block_ids[a:a + len(ids)] == ids:
                    return rec, a
        return None

    def on_question(self, peer: str, q: wire.FpQuestion) -> None:
        now = time.monotonic()
        self._questions.append(_Question(q, now + min(self.ctx.settings.timeout_s, 10.0), now))

    def _answer_text(self, qu: _Question, now: float) -> wire.FpAnswer | None:
        q = qu.q
        if self.fp is None:
            return wire.FpAnswer(q.key, refused="verify_kv is off on the owner")
        found = self.record(q.key, q.first, q.block_ids)
        rec, a = found if found is not None else (None, 0)
        # A question may beat the SendSpec / retained hold it is about to this thread
        # (they come with the engine's next step): wait a little, not long for retained
        # blocks (their hold came a whole turn earlier).
        limit = min(qu.deadline, qu.t0 + (5.0 if q.key.startswith("t:") else 1.0))
        if rec is None or not rec.future.done():
            if now < limit:
                return None
            return wire.FpAnswer(q.key, refused="no fingerprints of those blocks" if rec is None
                                 else "fingerprints not ready")
        fps = rec.future.result()
        n = len(q.block_ids)
        return wire.FpAnswer(q.key, Fingerprints(fps.alg, fps.block_ids[a:a + n], fps.values[a:a + n]).encode())

    def progress(self, now: float) -> None:
        """Owner: answer questions whose record is ready (or say why not) once the reader's
        NIXL metadata is known. Bounded: a question is dropped at its deadline."""
        keep: list[_Question] = []
        for qu in self._questions:
            try:
                ans = self._answer_text(qu, now)
                got = self.ctx.peers.lookup(qu.q.reader, qu, now) if ans is not None else None
                if got is None:
                    keep.append(qu)
                    continue
                assert ans is not None
                self.ctx.notify(got[0], ans)
                self.ctx.stats.record("kv_fp_answer", key=qu.q.key, reader=qu.q.reader,
                                      num_blocks=len(qu.q.block_ids), answer=ans.refused or "ok")
            except Exception as exc:  # noqa: BLE001 - the reader fails its load at its own deadline
                log.warning("kvbaton: fingerprint answer to %s for %s failed: %r", qu.q.reader, qu.q.key, exc)
                self.ctx.peers.forget(qu.q.reader)  # its metadata may be stale: look it up again
        self._questions = keep

    def expire(self, now: float, max_age_s: float) -> None:
        """A transfer's records live as long as its hold can; a retained turn's until the
        scheduler says its hold was freed (a renewed lease can outlast any fixed age)."""
        for key, recs in list(self.records.items()):
            if key.startswith("r:"):
                continue
            recs[:] = [r for r in recs if now - r.t <= max_age_s]
            if not recs:
                del self.records[key]
        for key, (t, _) in list(self._answers.items()):
            if now - t > max_age_s:
                del self._answers[key]

    # ------------------------------------------------------------------ reader
    def ask(self, ld: Load, agent: str, key: str, first: int) -> None:
        """Just before posting a READ, ask the owner for its fingerprints (the answer
        travels while the data does)."""
        if self.fp is None:
            return
        ld.fp_key = key
        self._answers.pop(key, None)  # an older answer for the same key is not ours
        self.ctx.notify(agent, wire.FpQuestion(key, self.ctx.settings.engine_id, first,
                                               tuple(int(b) for b in ld.spec.remote_block_ids)))

    def on_answer(self, peer: str, ans: wire.FpAnswer) -> None:
        self._answers[ans.key] = (self.ctx.clock(), ans)

    def check(self, ld: Load, now: float) -> bool:
        """Owner's fingerprints vs ours of what landed; True when verified. Raises
        KvIntegrityError (→ failed load → recompute) on a mismatch or no answer."""
        assert self.fp is not None
        if ld.fp_owner is None and not self._owner_answer(ld, now):
            return False
        assert ld.fp_owner is not None
        if ld.fp_local is None:
            if self.ctx.faults.path and self.ctx.faults.take_corruption(ld.spec.mode):
                corrupt_block(self.ctx.layout, ld.spec.local_block_ids[0])  # test-only fault
                ld.corrupted = True
                self.ctx.stats.record("fault_corrupt", req_id=ld.req_id, mode=ld.spec.mode,
                                      block_id=ld.spec.local_block_ids[0])
            ld.fp_local = self.fp.submit(ld.spec.local_block_ids, ld.fp_owner.alg)
        if not ld.fp_local.done():
            if now >= ld.deadline:
                raise TimeoutError("fingerprinting the landed blocks took too long")
            return False
        mine = ld.fp_local.result()
        bad = compare(ld.fp_owner.values, mine.values)
        self.count(ld, "mismatch" if bad else "ok", mismatched=bad[:16], alg=mine.alg,
                   verify_s=round(time.monotonic() - ld.t_landed, 6))
        if bad:
            log.warning("kvbaton: KV integrity mismatch on %s load %s (%s): %d of %d blocks differ from the "
                        "owner's fingerprints; recomputing", ld.spec.mode, ld.req_id,
                        ld.fp_key or ld.spec.transfer_id, len(bad), len(ld.spec.local_block_ids))
            raise KvIntegrityError(f"{len(bad)} of {len(ld.spec.local_block_ids)} blocks differ from the owner's")
        return True

    def _owner_answer(self, ld: Load, now: float) -> bool:
        got = self._answers.pop(ld.fp_key, None)
        if got is None:
            # The owner answers within one of its polls; a dead or silent owner fails the
            # load (we cannot vouch for the bytes), bounded by the load's deadlines.
            limit = min(ld.deadline, ld.t_landed + min(self.ctx.settings.timeout_s, 5.0))
            if ld.spec.mode == MODE_REUSE:
                limit = min(limit, ld.read_deadline)
            if now >= limit:
                self.count(ld, "unavailable")
                raise KvIntegrityError(f"no fingerprints from the owner of {ld.fp_key} in time")
            return False
        ans = got[1]
        if ans.refused:
            self.count(ld, "unavailable")
            raise KvIntegrityError(f"owner cannot vouch for {ld.fp_key}: {ans.refused}")
        ld.fp_owner = Fingerprints.decode(ans.fingerprints, ld.spec.remote_block_ids)
        return True

    def count(self, ld: Load, result: str, **fields: Any) -> None:
        self.ctx.metrics.kv_verifications.labels(ld.spec.mode, result).inc()
        src = ld.spec.reuse
        self.ctx.stats.record("kv_verify", req_id=ld.req_id, mode=ld.spec.mode, transfer_id=ld.spec.transfer_id,
                              conversation_id=src.conversation_id if src else "", ok=result == "ok", result=result,
                              num_blocks=len(ld.spec.local_block_ids), corrupted=ld.corrupted, **fields)
