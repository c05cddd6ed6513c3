"""The per-rank data path of the worker's flows (tensor parallelism), against the fake
endpoint: which peer ranks one rank WRITEs to / READs from, the bytes and descriptors of
each part, the fan-in each message carries (``Pushed.writers``, ``Done.readers``), and that
a request is complete only when every writer / reader rank is — and fails as a whole when
any part fails.

The model has 2 KV heads (the project's tiny model): a TP-1 rank holds both heads of a
block, a TP-2 rank one head (half a block). Real bytes move between ranks in
test_tp_nixl.py (real NIXL) and between vLLM engines in tests/e2e/test_tp_vllm.py.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import torch

from kvbaton.connector import wire
from kvbaton.connector.flows.receive import ReceiveFlow
from kvbaton.connector.flows.send import SendFlow
from kvbaton.connector.flows.sequence import Mover
from kvbaton.connector.flows.verify import Verifier
from kvbaton.connector.metadata import LoadSpec, ReuseSource, SendSpec
from kvbaton.connector.transfer.geometry import KvLayout
from kvbaton.kvgeometry import EngineKv
from kvbaton.v1 import common_pb2, registrar_pb2
from kvbaton.v1 import rendezvous_pb2 as rpb
from tests.connector.fake_endpoint import BS, FakeControl, FakeEndpoint, context, drain
from tests.connector.test_flows import _match, _pinned

T0 = time.monotonic()
TID = "t:tp"
HEADS, HEAD_BYTES = 2, BS * 8 * 4  # per block per region: 16 tokens x (K+V) 8 floats


def tp_layout(tp: int) -> KvLayout:
    return KvLayout.from_tensors([torch.zeros(32, HEADS // tp, BS, 8)], BS, block_dim=0)


def tp_rank(engine_id: str, rank: int, tp: int) -> Any:
    lay = tp_layout(tp)
    return registrar_pb2.EngineRank(
        engine_id=engine_id, tp_size=tp, tp_rank=rank, agent_name=f"kvb-{engine_id}-r{rank}", agent_metadata=b"md",
        geometry=common_pb2.KvGeometry(**lay.to_proto_fields(), total_kv_heads=HEADS, head_major=True))


class _PendingFingerprints:
    """verify_kv on; fingerprints never ready (the move is refused before they matter)."""

    def submit(self, ids: Any) -> concurrent.futures.Future[Any]:
        return concurrent.futures.Future()


class TpRig:
    """One rank (``me``, TP ``tp``) of engine "me", with peers "p0" and "d0" of given TP sizes."""

    def __init__(self, tp: int, me: int, *, peer_tp: int, verify: bool = False) -> None:
        self.lay = tp_layout(tp)
        self.control = FakeControl({e: [tp_rank(e, r, peer_tp) for r in range(peer_tp)] for e in ("p0", "d0")})
        self.ep = FakeEndpoint()
        self.ctx = context(self.control, self.ep, self.lay, timeout_s=5.0)
        self.ctx.tp_rank = me
        self.ctx.peers.tp_size = tp
        self.ctx.peers.me = EngineKv.from_rank(tp_rank("me", me, tp))
        if verify:
            self.ctx.fp = _PendingFingerprints()  # type: ignore[assignment]
        verifier = Verifier(self.ctx, lambda cmd: None)
        mover = Mover(self.ctx, None)
        self.recv = ReceiveFlow(self.ctx, mover, verifier, None)
        self.send = SendFlow(self.ctx, mover, verifier)

    def results(self) -> list[tuple[str, str, bool, tuple[int, ...]]]:
        return drain(self.ctx)


def _push_send() -> SendSpec:
    return SendSpec(transfer_id=TID, num_blocks=3, timeout_s=5.0, mode="push", block_ids=(1, 2, 3), num_tokens=48)


def _offsets(r: TpRig, x: Any) -> tuple[set[int], set[int]]:
    """Byte offsets within a block of every local / remote descriptor row of a posted plan."""
    (peer,) = [p for e in ("p0", "d0") for p in r.control.ranks[e] if p.agent_name == x.peer]
    sides = ((x.plan.local_descs, r.lay.region_base_addrs[0], r.lay.bytes_per_block),
             (x.plan.remote_descs, peer.geometry.region_base_addrs[0], peer.geometry.bytes_per_block))
    return tuple({(int(a) - base) % blk for a in rows[:, 0]} for rows, base, blk in sides)  # type: ignore[return-value]


# ---------------------------------------------------------------------------- push, prefill ranks
def test_each_prefill_rank_writes_its_head_into_a_tp1_decode() -> None:
    """P TP 2 → D TP 1: rank 1 writes its one head into the second half of decode's blocks,
    telling decode that 2 ranks write (so rank 1's notification alone does not finish it)."""
    r = TpRig(2, 1, peer_tp=1)
    r.send.on_send("req", _push_send(), T0)
    r.send.on_event(TID, _match())
    r.send.progress(T0)
    (x,) = r.ep.xfers
    assert x.op == "WRITE" and x.peer == "kvb-d0-r0"
    assert wire.decode(x.notif) == wire.Pushed(TID, x.nbytes, writers=2)
    assert x.nbytes == 2 * HEAD_BYTES  # 2 blocks (the first is decode's cache hit) x one head
    local, remote = _offsets(r, x)
    assert remote == {HEAD_BYTES} and local == {0}  # its head lands after rank 0's in decode's block
    x.state = "DONE"
    r.send.progress(T0 + 0.1)
    assert r.results() == [("sent", "req", True, ())]
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert rep.outcome.tp_rank == 1 and rep.outcome.success and rep.outcome.bytes == x.nbytes


def test_a_tp1_prefill_writes_each_head_into_the_decode_rank_holding_it() -> None:
    """P TP 1 → D TP 2: one WRITE per decode rank, each with that rank's head and bytes."""
    r = TpRig(1, 0, peer_tp=2)
    r.send.on_send("req", _push_send(), T0)
    r.send.on_event(TID, _match())
    r.send.progress(T0)
    assert sorted(x.peer for x in r.ep.xfers) == ["kvb-d0-r0", "kvb-d0-r1"]
    for x in r.ep.xfers:
        d = int(x.peer[-1])
        assert wire.decode(x.notif) == wire.Pushed(TID, 2 * HEAD_BYTES, writers=1)
        assert _offsets(r, x) == ({d * HEAD_BYTES}, {0})
    r.ep.xfers[0].state = "DONE"
    r.send.progress(T0 + 0.1)
    assert r.results() == []  # one decode rank still being written
    r.ep.xfers[1].state = "DONE"
    r.send.progress(T0 + 0.2)
    assert r.results() == [("sent", "req", True, ())]
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert rep.outcome.success and rep.outcome.bytes == 4 * HEAD_BYTES  # adds up to the request's KV


def test_one_failed_part_fails_the_whole_push_and_releases_the_rest() -> None:
    r = TpRig(1, 0, peer_tp=2)
    r.send.on_send("req", _push_send(), T0)
    r.send.on_event(TID, _match())
    r.send.progress(T0)
    ok, bad = r.ep.xfers
    bad.state = "ERR"
    r.send.progress(T0 + 0.1)
    assert r.results() == [("sent", "req", False, ())]
    assert ok.released and bad.released
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert not rep.outcome.success and "rank 1" in rep.outcome.error and rep.outcome.bytes == 0
    assert set(r.ep.removed) == {"kvb-d0-r0", "kvb-d0-r1"}  # looked up afresh next time


def test_verify_kv_is_refused_for_a_per_rank_move() -> None:
    r = TpRig(2, 0, peer_tp=1, verify=True)
    r.send.on_send("req", _push_send(), T0)
    r.send.on_event(TID, _match())
    r.send.progress(T0)
    assert r.ep.xfers == [] and r.results() == [("sent", "req", False, ())]
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert "verify_kv is not built for tensor-parallel" in rep.outcome.error


# ---------------------------------------------------------------------------- push, decode ranks
def _push_load() -> LoadSpec:
    return LoadSpec(TID, "", (), (4, 5), mode="push")


def test_a_decode_rank_finishes_only_when_every_writer_rank_notified() -> None:
    r = TpRig(1, 0, peer_tp=2)
    r.recv.on_load("req", _push_load(), T0)
    r.recv.on_pushed("kvb-p0-r0", wire.Pushed(TID, 1024, writers=2))
    r.recv.progress(T0 + 0.1)
    r.recv.on_pushed("kvb-p0-r0", wire.Pushed(TID, 1024, writers=2))  # the same writer again
    r.recv.progress(T0 + 0.2)
    assert r.results() == []  # one writer rank of two: not complete
    r.recv.on_pushed("kvb-p0-r1", wire.Pushed(TID, 1024, writers=2))
    r.recv.progress(T0 + 0.3)
    assert r.results() == [("recv", "req", True, (4, 5))]


def test_a_writer_rank_that_never_notifies_fails_the_load_at_the_timeout() -> None:
    r = TpRig(1, 0, peer_tp=2)
    r.recv.on_load("req", _push_load(), T0)
    r.recv.on_pushed("kvb-p0-r1", wire.Pushed(TID, 1024, writers=2))
    r.recv.progress(T0 + 4.9)
    assert r.results() == []
    r.recv.progress(T0 + 5.0)
    assert r.results() == [("recv", "req", False, (4, 5))]
    (cancel,) = r.control.requests("CancelRequest")
    assert cancel.transfer_id == TID


def test_a_failed_writer_rank_at_the_rendezvous_fails_every_decode_rank() -> None:
    ev = rpb.RendezvousEvent(type=rpb.RendezvousEvent.TYPE_DONE)
    ev.transfer.phase, ev.transfer.reason = rpb.TRANSFER_PHASE_FAILED, "rank 1 of p0 failed: killed"
    for me in (0, 1):
        r = TpRig(2, me, peer_tp=2)
        r.recv.on_load("req", _push_load(), T0)
        r.recv.on_pushed(f"kvb-p0-r{me}", wire.Pushed(TID, 1024, writers=1) if me else wire.Pushed(TID, 1, writers=2))
        r.recv.on_event(TID, ev)
        r.recv.progress(T0 + 0.1)
        if me == 1:  # its one writer finished before the event was seen: vLLM's union of
            assert r.results() == [("recv", "req", True, (4, 5))]  # invalid blocks still recomputes
        else:
            assert r.results() == [("recv", "req", False, (4, 5))]


# ---------------------------------------------------------------------------- pull and reuse
def _pull() -> LoadSpec:
    return LoadSpec(TID, "p0", (5, 6, 7), (1, 2, 3))


def test_a_tp1_decode_pulls_each_head_from_the_prefill_rank_owning_it() -> None:
    r = TpRig(1, 0, peer_tp=2)
    r.recv.on_load("req", _pull(), T0)
    r.recv.progress(T0)
    (begin,) = r.control.requests("BeginReadRequest")
    assert begin.readers == 1
    assert sorted(x.peer for x in r.ep.xfers) == ["kvb-p0-r0", "kvb-p0-r1"]
    for x in r.ep.xfers:
        s = int(x.peer[-1])
        assert x.op == "READ" and wire.decode(x.notif) == wire.Done(TID, readers=1)
        assert x.nbytes == 3 * HEAD_BYTES and _offsets(r, x) == ({s * HEAD_BYTES}, {0})
    r.ep.xfers[0].state = "DONE"
    r.recv.progress(T0 + 0.1)
    assert r.results() == []
    r.ep.xfers[1].state = "DONE"
    r.recv.progress(T0 + 0.2)
    assert r.results() == [("recv", "req", True, (1, 2, 3))]
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert rep.outcome.tp_rank == 0 and rep.outcome.bytes == 6 * HEAD_BYTES


def test_each_tp2_decode_rank_reads_its_head_and_reports_its_own_outcome() -> None:
    total = 0
    for me in (0, 1):
        r = TpRig(2, me, peer_tp=1)
        r.recv.on_load("req", _pull(), T0)
        r.recv.progress(T0)
        (begin,) = r.control.requests("BeginReadRequest")
        assert begin.readers == 2  # the ledger expects one outcome per decode rank
        (x,) = r.ep.xfers
        assert x.peer == "kvb-p0-r0" and wire.decode(x.notif) == wire.Done(TID, readers=2)
        assert _offsets(r, x) == ({0}, {me * HEAD_BYTES})
        x.state = "DONE"
        r.recv.progress(T0 + 0.1)
        (rep,) = r.control.requests("ReportOutcomeRequest")
        assert rep.outcome.tp_rank == me and rep.outcome.success
        total += rep.outcome.bytes
    assert total == 3 * 2 * HEAD_BYTES  # the ranks' bytes add up to the request's KV


def test_a_failed_pull_part_fails_the_load_and_frees_every_owner_rank() -> None:
    r = TpRig(1, 0, peer_tp=2)
    r.recv.on_load("req", _pull(), T0)
    r.recv.progress(T0)
    r.ep.xfers[1].state = "ERR"
    r.recv.progress(T0 + 0.1)
    assert r.results() == [("recv", "req", False, (1, 2, 3))]
    assert all(x.released for x in r.ep.xfers)
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert not rep.outcome.success


def test_a_read_the_ledger_already_failed_is_not_posted() -> None:
    """Another decode rank failed this pull first: the ledger answers BeginRead FAILED."""
    r = TpRig(2, 1, peer_tp=1)
    r.control.begin_read = rpb.TransferState(transfer_id=TID, phase=rpb.TRANSFER_PHASE_FAILED,
                                             reason="rank 0 of me failed")
    r.recv.on_load("req", _pull(), T0)
    r.recv.progress(T0)
    assert r.ep.xfers == [] and r.results() == [("recv", "req", False, (1, 2, 3))]


def test_a_prefill_rank_frees_a_pull_only_after_every_reader_rank_is_done() -> None:
    r = TpRig(1, 0, peer_tp=2)
    r.send.on_send("req", SendSpec(transfer_id=TID, num_blocks=3, timeout_s=5.0), T0)
    r.send.on_done("kvb-d0-r0", wire.Done(TID, readers=2))
    r.send.on_done("kvb-d0-r0", wire.Done(TID, readers=2))  # the same reader twice
    assert r.results() == []
    r.send.on_done("kvb-d0-r1", wire.Done(TID, readers=2))
    assert r.results() == [("sent", "req", True, ())] and not r.send.busy


def test_release_only_tells_every_owner_rank() -> None:
    r = TpRig(1, 0, peer_tp=2)
    r.recv.on_load("req", LoadSpec(TID, "p0", (), (), report_recv=False), T0)
    r.recv.progress(T0)
    assert sorted(p for p, m in r.ep.sent if isinstance(m, wire.Done)) == ["kvb-p0-r0", "kvb-p0-r1"]
    assert r.ep.messages(wire.Done) == [wire.Done(TID, readers=1)] * 2


def test_a_tp2_prefill_rank_reuses_its_head_from_a_tp1_decode() -> None:
    r = TpRig(2, 1, peer_tp=1)
    src = ReuseSource("conv", "d0", "lease-1", "ret-1", num_tokens=4 * BS)
    r.recv.on_load("req", LoadSpec("reuse-x", "d0", (8, 9), (1, 2), mode="reuse", reuse=src), T0)
    r.recv.progress(T0)
    _pinned(r)  # type: ignore[arg-type]
    r.recv.progress(T0 + 0.1)
    (begin,) = r.control.requests("BeginReadRequest")
    assert begin.readers == 2
    (x,) = r.ep.xfers
    assert x.peer == "kvb-d0-r0" and wire.decode(x.notif) == wire.ReuseServed("conv", 2 * HEAD_BYTES)
    assert _offsets(r, x) == ({0}, {HEAD_BYTES})  # decode's second head into our one head
    x.state = "DONE"
    r.recv.progress(T0 + 0.2)
    assert r.results() == [("recv", "req", True, (1, 2))]
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert rep.outcome.tp_rank == 1 and rep.outcome.bytes == 2 * HEAD_BYTES
