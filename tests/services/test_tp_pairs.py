"""Tensor parallelism in the control plane, over a real gRPC server: every rank registers with
its real tp_size and KV heads, a push match records which prefill ranks write (one outcome
each), and a pair whose KV cannot be mapped is refused when the match or the reuse pin is
formed — with the reason, in the transfer the operators list."""

from __future__ import annotations

import asyncio
import os
import sys

import grpc
import pytest

from kvbaton.v1 import common_pb2, lease_pb2, registrar_pb2
from kvbaton.v1 import rendezvous_pb2 as pb
from tests.services.test_rendezvous import Collector

Ev = pb.RendezvousEvent
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEAD_BYTES = 2048


def tp_rank(engine_id: str, role: int, *, tp: int, rank: int, heads: int = 2, tpb: int = 16,
            dtype: str = "float32", head_major: bool = True) -> registrar_pb2.EngineRank:
    per = max(heads // tp, 1)
    return registrar_pb2.EngineRank(
        engine_id=engine_id, role=role, tp_size=tp, tp_rank=rank, agent_name=f"kvb-{engine_id}-r{rank}",
        agent_metadata=b"md-" + engine_id.encode(),
        geometry=common_pb2.KvGeometry(
            region_base_addrs=[0x10000 * (rank + 1), 0x90000 * (rank + 1)], bytes_per_block=per * HEAD_BYTES,
            num_blocks=100, tokens_per_block=tpb, dtype=dtype, layout="block_major",
            fingerprint=f"fp-{tp}-{tpb}-{dtype}", device="cpu", total_kv_heads=heads, head_major=head_major))


async def register_engine(kv, engine_id: str, role: int, *, tp: int, **kw) -> None:
    for r in range(tp):
        await kv.call(kv.registrar.RegisterEngine,
                      registrar_pb2.RegisterEngineRequest(rank=tp_rank(engine_id, role, tp=tp, rank=r, **kw)))


PREFILL, DECODE = common_pb2.ENGINE_ROLE_PREFILL, common_pb2.ENGINE_ROLE_DECODE


def offer(tid, engine, blocks=(1, 2, 3)):
    return pb.OfferRequest(transfer_id=tid, decode_engine_id=engine, block_ids=list(blocks), num_tokens=16 * len(blocks))


def complete(tid, engine, writers, blocks=(7, 8, 9)):
    return pb.CompleteRequest(transfer_id=tid, prefill_engine_id=engine, block_ids=list(blocks),
                              num_tokens=16 * len(blocks), writers=writers)


def outcome(tid, engine, rank, ok=True):
    return pb.ReportOutcomeRequest(transfer_id=tid, outcome=pb.Outcome(engine_id=engine, tp_rank=rank, success=ok,
                                                                       bytes=3 * HEAD_BYTES))


async def test_every_rank_registers_with_its_tp_size_and_heads(kv, plane):
    await register_engine(kv, "p2", PREFILL, tp=2)
    await register_engine(kv, "d1", DECODE, tp=1)
    got = await kv.call(kv.registrar.GetEngine, registrar_pb2.GetEngineRequest(engine_id="p2"))
    assert [(r.tp_rank, r.tp_size, r.geometry.total_kv_heads) for r in got.ranks] == [(0, 2, 2), (1, 2, 2)]
    # A head count the TP size cannot split is bad input, not a surprise at the first transfer.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(
            rank=tp_rank("p4", PREFILL, tp=4, rank=0, heads=6)), retries=0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "6 KV heads cannot be spread over 4" in err.value.details()
    # Ranks of one engine must agree on the head count.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(
            rank=tp_rank("p2", PREFILL, tp=2, rank=1, heads=4)), retries=0)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "KV head count" in err.value.details()
    # The operator's view lists every rank with the heads it holds.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbaton.cli", "engines", "list", "--addr", plane.address,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    out, err_out = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err_out.decode()
    rows = {tuple(line.split()[:4]) for line in out.decode().splitlines()[1:] if line.strip()}
    assert {("p2", "prefill", "0/2", "0/2"), ("p2", "prefill", "1/2", "1/2"), ("d1", "decode", "0/1", "0-1/2")} <= rows


@pytest.mark.parametrize("p_tp,d_tp,heads,writers", [
    (2, 1, 2, [0, 1]),   # P TP2 -> D TP1: both prefill ranks write
    (1, 2, 2, [0]),      # P TP1 -> D TP2: one rank writes into both decode ranks
    (2, 2, 2, [0, 1]),
    (4, 2, 2, [0, 2]),   # replicated heads on prefill: one replica of each head writes
])
async def test_match_expects_one_outcome_per_writing_rank(kv, p_tp, d_tp, heads, writers):
    await register_engine(kv, "pre", PREFILL, tp=p_tp, heads=heads)
    await register_engine(kv, "dec", DECODE, tp=d_tp, heads=heads)
    dec = Collector(kv, "dec", 0)
    await asyncio.wait_for(dec.ready.wait(), 5)
    await kv.call(kv.rendezvous.Offer, offer("x1", "dec"))
    m = await kv.call(kv.rendezvous.Complete, complete("x1", "pre", writers=p_tp))
    assert m.matched_now and m.state.phase == pb.TRANSFER_PHASE_MATCHED
    assert list(m.state.writer_ranks) == writers and m.state.expected_outcomes == len(writers)
    non_writers = [r for r in range(p_tp) if r not in writers]
    for r in non_writers:  # a rank that holds nothing to write cannot report
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv.call(kv.rendezvous.ReportOutcome, outcome("x1", "pre", r), retries=0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a writer" in err.value.details()
    for i, r in enumerate(writers):
        s = await kv.call(kv.rendezvous.ReportOutcome, outcome("x1", "pre", r))
        # Decode is done only when the last writing rank reported.
        assert s.phase == (pb.TRANSFER_PHASE_SUCCEEDED if i == len(writers) - 1 else pb.TRANSFER_PHASE_MATCHED)
    await dec.wait(lambda evs: any(e.type == Ev.TYPE_DONE for e in evs))
    [done] = dec.of(Ev.TYPE_DONE)
    assert done.transfer.phase == pb.TRANSFER_PHASE_SUCCEEDED
    assert sorted(o.tp_rank for o in done.transfer.outcomes) == writers
    assert sum(o.bytes for o in done.transfer.outcomes) == len(writers) * 3 * HEAD_BYTES
    await dec.close()


async def test_one_failed_rank_fails_the_whole_push(kv):
    await register_engine(kv, "pre", PREFILL, tp=2)
    await register_engine(kv, "dec", DECODE, tp=1)
    await kv.call(kv.rendezvous.Offer, offer("f1", "dec"))
    await kv.call(kv.rendezvous.Complete, complete("f1", "pre", writers=2))
    await kv.call(kv.rendezvous.ReportOutcome, outcome("f1", "pre", 0))
    s = await kv.call(kv.rendezvous.ReportOutcome, outcome("f1", "pre", 1, ok=False))
    assert s.phase == pb.TRANSFER_PHASE_FAILED and "rank 1 of pre failed" in s.reason


@pytest.mark.parametrize("change,words", [
    ({"tpb": 32}, "block sizes differ: 32 vs 16"),
    ({"dtype": "bfloat16"}, "dtype differs"),
    ({"heads": 4}, "head counts differ"),
    ({"head_major": False}, "not head-major"),
])
@pytest.mark.parametrize("offer_first", [True, False])
async def test_incompatible_push_is_refused_at_the_match_with_the_reason(kv, plane, change, words, offer_first):
    await register_engine(kv, "pre", PREFILL, tp=2, **change)
    await register_engine(kv, "dec", DECODE, tp=1)
    dec, pre = Collector(kv, "dec", 0), Collector(kv, "pre", 0)
    await asyncio.wait_for(asyncio.gather(dec.ready.wait(), pre.ready.wait()), 5)
    # Block counts differ too with different block sizes: the reason is still the real one.
    p_blocks = (7, 8) if change.get("tpb") else (7, 8, 9)
    calls = [(kv.rendezvous.Offer, offer("bad", "dec")),
             (kv.rendezvous.Complete, complete("bad", "pre", writers=2, blocks=p_blocks))]
    if not offer_first:
        calls.reverse()
    await kv.call(*calls[0])
    r = await kv.call(*calls[1])
    assert not r.matched_now and r.state.phase == pb.TRANSFER_PHASE_FAILED
    assert r.state.reason.startswith("incompatible KV: prefill pre -> decode dec: ") and words in r.state.reason
    # Both owners learn at once (decode recomputes, prefill frees); nobody is told to write.
    for c in (dec, pre):
        await c.wait(lambda evs: any(e.type == Ev.TYPE_DONE for e in evs))
        assert c.of(Ev.TYPE_DONE)[0].transfer.reason == r.state.reason
    assert not pre.of(Ev.TYPE_MATCH)
    with pytest.raises(grpc.aio.AioRpcError):  # no rank may report on it
        await kv.call(kv.rendezvous.ReportOutcome, outcome("bad", "pre", 0), retries=0)
    await dec.close()
    await pre.close()
    # Operators see the refusal and why.
    text = await _cli(plane, "transfers", "list", "--phase", "failed")
    [line] = [ln for ln in text.splitlines() if ln.startswith("bad ")]
    assert "incompatible KV" in line and words in line


async def test_engines_without_head_counts_are_judged_on_what_they_published(kv):
    # Older connectors publish no head count: same block size pairs as before (no writer
    # ranks: the completion's count), a different block size is still refused.
    def old(eid, role, tpb=16):
        return registrar_pb2.EngineRank(
            engine_id=eid, role=role, tp_size=1, agent_name=f"kvb-{eid}-r0", agent_metadata=b"m",
            geometry=common_pb2.KvGeometry(region_base_addrs=[1], bytes_per_block=4096, num_blocks=10,
                                           tokens_per_block=tpb, dtype="float32", layout="block_major", fingerprint="f"))
    for rank in (old("pre", PREFILL), old("dec", DECODE), old("dec32", DECODE, tpb=32)):
        await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(rank=rank))
    await kv.call(kv.rendezvous.Offer, offer("o1", "dec"))
    m = await kv.call(kv.rendezvous.Complete, complete("o1", "pre", writers=1))
    assert m.matched_now and not m.state.writer_ranks and m.state.expected_outcomes == 1
    await kv.call(kv.rendezvous.Offer, offer("o2", "dec32"))
    m = await kv.call(kv.rendezvous.Complete, complete("o2", "pre", writers=1))
    assert m.state.phase == pb.TRANSFER_PHASE_FAILED and "block sizes differ" in m.state.reason


async def test_incompatible_reuse_is_refused_at_the_pin_and_recorded(kv, plane):
    await register_engine(kv, "dec", DECODE, tp=1)
    await register_engine(kv, "pre-ok", PREFILL, tp=2)
    await register_engine(kv, "pre-bad", PREFILL, tp=2, tpb=32)
    lease = (await kv.call(kv.lease.Grant, lease_pb2.GrantRequest(conversation_id="conv", engine_id="dec",
                                                                  ttl_ms=10_000, num_blocks=4))).lease
    def pin(eid):
        return lease_pb2.PinRequest(conversation_id="conv", lease_id=lease.lease_id,
                                               reader=f"kvb-{eid}-r0", reader_engine_id=eid)
    ok = await kv.call(kv.lease.Pin, pin("pre-ok"))
    assert ok.pin.pin_id
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.lease.Pin, pin("pre-bad"), retries=0)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "incompatible KV: reuse READ of decode dec by prefill pre-bad" in err.value.details()
    assert "block sizes differ" in err.value.details()
    # Recorded where operators look, as a failed transfer (owner = decode, reader = prefill).
    failed = await kv.call(kv.rendezvous.ListTransfers, pb.ListTransfersRequest(
        phases=[pb.TRANSFER_PHASE_FAILED]))
    [t] = [t for t in failed.transfers if t.transfer_id.startswith("reuse-")]
    assert t.offer.engine_id == "dec" and t.completion.engine_id == "pre-bad" and "block sizes differ" in t.reason
    # The refused reader took no pin; the lease holds only the good one.
    got = await kv.call(kv.lease.Get, lease_pb2.GetLeaseRequest(conversation_id="conv"))
    assert [p.reader for p in got.pins] == ["kvb-pre-ok-r0"]
    # A pin without reader_engine_id (older connectors) is judged on nothing new.
    legacy = await kv.call(kv.lease.Pin, lease_pb2.PinRequest(conversation_id="conv", lease_id=lease.lease_id,
                                                              reader="kvb-pre-bad-r0"))
    assert legacy.pin.pin_id


async def _cli(plane, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbaton.cli", *args, "--addr", plane.address,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    # 120 s: a CLI process start (imports) took over 60 s at load average ~39 here.
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_incompatible_pull_and_reuse_reads_are_refused_at_begin_read(kv):
    await register_engine(kv, "dec", DECODE, tp=1)
    await register_engine(kv, "pre-bad", PREFILL, tp=2, tpb=32)
    # Pull: the prefill holds blocks; decode's BeginRead is refused and the hold ends with the reason.
    await kv.call(kv.rendezvous.Complete, pb.CompleteRequest(transfer_id="pl", prefill_engine_id="pre-bad",
                                                             block_ids=[1, 2], timeout_ms=60_000))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
            transfer_id="pl", kind=pb.TRANSFER_KIND_PULL, reader_engine_id="dec", block_ids=[5, 6]), retries=0)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "incompatible KV: pull READ of prefill pre-bad by decode dec" in err.value.details()
    hold = await kv.call(kv.rendezvous.GetTransfer, pb.GetTransferRequest(transfer_id="pl"))
    assert hold.phase == pb.TRANSFER_PHASE_FAILED and "block sizes differ" in hold.reason
    # Reuse: decode retains a turn; the incompatible prefill's BeginRead is refused and recorded.
    ret = (await kv.call(kv.registrar.RegisterRetained, registrar_pb2.RegisterRetainedRequest(
        retained=registrar_pb2.RetainedBlocks(conversation_id="c1", engine_id="dec", block_ids=[3, 4],
                                              num_tokens=32, tokens_per_block=16)))).retained
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
            transfer_id="ru", kind=pb.TRANSFER_KIND_REUSE, reader_engine_id="pre-bad", block_ids=[9, 10],
            generation=ret.retention_id, conversation_id="c1", source_block_ids=[3, 4]), retries=0)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "incompatible KV: reuse READ of decode dec by prefill pre-bad" in err.value.details()
    rec = await kv.call(kv.rendezvous.GetTransfer, pb.GetTransferRequest(transfer_id="ru"))
    assert rec.phase == pb.TRANSFER_PHASE_FAILED and rec.kind == pb.TRANSFER_KIND_REUSE
    assert rec.offer.engine_id == "dec" and rec.completion.engine_id == "pre-bad"
