"""What a finished load leaves behind: its stats line and the connector's counters.

Kept apart from :mod:`.receive` so the flow reads as a state machine; the field names are
part of the stats contract (tests and operators read ``<engine>.worker.jsonl``)."""

from __future__ import annotations

from ..settings import MODE_PUSH, MODE_REUSE
from .context import FlowContext, outcome, recompute_reason
from .load import Load


def _moved(ld: Load) -> tuple[int, int, str, float]:
    """(bytes, descriptors, strategy, post time) of a load, from its READ when it had one."""
    mv = ld.move
    if mv is None:
        return ld.nbytes, 0, ld.strategy, 0.0
    return mv.nbytes, mv.num_descs, mv.strategy, mv.t_post


def count_load(ctx: FlowContext, ld: Load, *, ok: bool, reason: str, now: float) -> None:
    """Connector metrics for a finished load (decode's pull/push receive, prefill's reuse READ)."""
    mode = ld.spec.mode
    if not ld.spec.local_block_ids:
        return  # release only: nothing to receive, nothing moved
    m = ctx.metrics
    m.transfers.labels(mode, "prefill" if mode == MODE_REUSE else "decode", outcome(ok, reason)).inc()
    if not ok:
        m.recomputes.labels(recompute_reason(reason)).inc()
        return
    nbytes, _, _, t_post = _moved(ld)
    if mode != MODE_PUSH:  # a push was written by prefill, which counts its bytes
        m.transfer_bytes.labels(mode, "read").inc(nbytes)
        if t_post:
            m.transfer_seconds.labels(mode, "read").observe(now - t_post)
    if mode == MODE_REUSE:
        m.reused_tokens.inc(len(ld.spec.local_block_ids) * ctx.layout.tokens_per_block)


def _phases(ld: Load, t_post: float) -> dict[str, float]:
    """Where a finished load's time went, in seconds from its start (``-1``: not reached):
    the pin answered (reuse), the ledger's BeginRead answered, the READ posted. The rest of
    ``duration_s`` after ``posted_s`` is the data moving and its completion being seen."""
    def rel(t: float) -> float:
        return round(t - ld.t0, 6) if t else -1.0
    return {"pinned_s": rel(ld.t_pinned), "begun_s": rel(ld.t_begun), "posted_s": rel(t_post)}


def record_finish(ctx: FlowContext, ld: Load, *, ok: bool, reason: str, dur: float) -> None:
    """The load's stats line: reuse_read / reuse_failed, recv_done / release_sent / recv_failed."""
    nbytes, num_descs, strategy, t_post = _moved(ld)
    spec, rec = ld.spec, ctx.stats.record
    if spec.mode == MODE_REUSE:
        conv = spec.reuse.conversation_id if spec.reuse else ""
        if ok:
            rec("reuse_read", conversation_id=conv, req_id=ld.req_id, nbytes=nbytes, num_descs=num_descs,
                strategy=strategy, num_blocks=len(spec.local_block_ids), duration_s=round(dur, 6),
                **_phases(ld, t_post))
        else:
            rec("reuse_failed", conversation_id=conv, req_id=ld.req_id, reason=reason, duration_s=round(dur, 6))
    elif ok and spec.local_block_ids:
        rec("recv_done", transfer_id=spec.transfer_id, req_id=ld.req_id, nbytes=nbytes, num_descs=num_descs,
            mode=spec.mode, strategy=strategy, num_blocks=len(spec.local_block_ids), duration_s=round(dur, 6),
            **_phases(ld, t_post))
    elif ok:
        rec("release_sent", transfer_id=spec.transfer_id, req_id=ld.req_id)
    else:
        rec("recv_failed", transfer_id=spec.transfer_id, req_id=ld.req_id, reason=reason, duration_s=round(dur, 6))
