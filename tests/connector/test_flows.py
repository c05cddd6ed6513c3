"""The worker's flows as state machines, against a fake NIXL endpoint and control plane.

Each test drives one flow with an explicit clock (``now`` passed to ``progress``) and
decides every transfer's and every RPC's fate: timeouts, late notifications, peer death,
cancellation. The same flows run inside real engines in tests/e2e.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

from kvbaton.connector import wire
from kvbaton.connector.flows.receive import ReceiveFlow
from kvbaton.connector.flows.send import SendFlow
from kvbaton.connector.flows.sequence import Mover
from kvbaton.connector.flows.staged import SendJob, StagedFlow
from kvbaton.connector.flows.verify import Verifier
from kvbaton.connector.metadata import LoadSpec, ReuseSource, SendSpec
from kvbaton.v1 import lease_pb2, rendezvous_pb2
from tests.connector.fake_endpoint import BS, FakeControl, FakeEndpoint, context, drain, layout, rank

T0 = time.monotonic()  # steps take `now` from the test; handlers stamp arrivals with ctx.clock (fixed at T0)
TID = "t:1:with:colons"  # ids may contain ':' (the old strings cut them at the first one)


class Rig:
    def __init__(self, *, known: tuple[str, ...] = ("p0", "d0"), staged: bool = False, **settings: Any) -> None:
        self.lay = layout()
        self.control = FakeControl({e: rank(e, self.lay) for e in known})
        self.ep = FakeEndpoint()
        self.ctx = context(self.control, self.ep, self.lay, timeout_s=5.0, **settings)
        self.ctx.clock = lambda: T0  # not the real clock: a suite that ran long before must not age them
        self.verifier = Verifier(self.ctx, lambda cmd: None)
        self.staged = StagedFlow(self.ctx, []) if staged else None
        mover = Mover(self.ctx, self.staged)
        self.recv = ReceiveFlow(self.ctx, mover, self.verifier, self.staged)
        self.send = SendFlow(self.ctx, mover, self.verifier)

    def results(self) -> list[tuple[str, str, bool, tuple[int, ...]]]:
        return drain(self.ctx)

    def recompute_count(self, reason: str) -> float:
        return self.ctx.metrics.recomputes.labels(reason)._value.get()


def _pull(tid: str = TID, local: tuple[int, ...] = (1, 2, 3), remote: tuple[int, ...] = (5, 6, 7)) -> LoadSpec:
    return LoadSpec(tid, "p0", remote, local)


# ---------------------------------------------------------------------------- pull (decode)
def test_pull_reads_then_reports_and_tells_the_owner() -> None:
    r = Rig()
    r.recv.on_load("req", _pull(), T0)
    r.recv.progress(T0)
    (x,) = r.ep.xfers
    assert x.op == "READ" and x.peer == "kvb-p0-r0"
    assert wire.decode(x.notif) == wire.Done(TID)  # rides on the READ: prefill frees after the data
    r.recv.progress(T0 + 0.1)
    assert r.results() == []  # still in flight
    x.state = "DONE"
    r.recv.progress(T0 + 0.2)
    assert r.results() == [("recv", "req", True, (1, 2, 3))]
    assert x.released and not r.recv.busy


def _refused(details: str, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_pull_begins_on_the_ledger_before_reading_and_reports_its_bytes() -> None:
    r = Rig()
    r.control.begin_read = None  # answered by the test
    spec = LoadSpec(TID, "p0", (6, 7), (2, 3), ledger_block_ids=(1, 2, 3))  # block 1: a local cache hit
    r.recv.on_load("req", spec, T0)
    r.recv.progress(T0)
    fut, begin = r.control.calls[-1]
    assert isinstance(begin, rendezvous_pb2.BeginReadRequest) and r.ep.xfers == []  # no READ before it
    assert (begin.transfer_id, begin.kind, begin.reader_engine_id, list(begin.block_ids), begin.generation) == (
        TID, rendezvous_pb2.TRANSFER_KIND_PULL, "me", [1, 2, 3], "")
    lines: list[tuple[str, dict[str, Any]]] = []
    r.ctx.stats.record = lambda event, **f: lines.append((event, f))  # type: ignore[method-assign]
    fut.set_result(rendezvous_pb2.TransferState(transfer_id=TID, attempt=0, phase=rendezvous_pb2.TRANSFER_PHASE_MATCHED))
    r.recv.progress(T0 + 0.1)
    (x,) = r.ep.xfers
    x.state = "DONE"
    r.recv.progress(T0 + 0.2)
    assert r.results() == [("recv", "req", True, (2, 3))]
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert rep.transfer_id == TID and rep.outcome.success and rep.outcome.bytes == x.nbytes > 0
    assert rep.outcome.engine_id == "me"
    # Where the load's time went (the TTFT breakdown): BeginRead answered at +0.1 s, no pin.
    ((ev, f),) = [x for x in lines if x[0] == "recv_done"]
    assert f["begun_s"] == pytest.approx(0.1) and f["pinned_s"] == -1.0 and f["posted_s"] > 0


def test_a_fenced_pull_is_not_read_and_is_recomputed_with_its_reason() -> None:
    r = Rig()
    before = r.recompute_count("fenced")
    r.control.begin_read = _refused("transfer t attempt 0: the prefill's hold is EXPIRED; its blocks may be freed: "
                                    "recompute")
    r.recv.on_load("req", _pull(), T0)
    r.recv.progress(T0)
    assert r.ep.xfers == [] and r.results() == [("recv", "req", False, (1, 2, 3))]
    assert r.recompute_count("fenced") == before + 1
    assert r.control.requests("ReportOutcomeRequest") == []  # nothing began: nothing to report


def test_a_hold_not_yet_on_the_ledger_is_asked_for_again_briefly() -> None:
    from kvbaton.connector.flows.receive import BEGIN_READ_HOLD_GRACE_S
    r = Rig()
    r.control.begin_read = _refused("transfer t: no hold (never made, or freed and forgotten): recompute")
    r.recv.on_load("req", _pull(), T0)
    r.recv.progress(T0)
    r.recv.progress(T0 + 0.1)
    assert r.results() == [] and len(r.control.requests("BeginReadRequest")) == 2  # the Complete may be late
    r.control.begin_read = rendezvous_pb2.TransferState(transfer_id=TID)
    r.recv.progress(T0 + 0.2)
    assert len(r.ep.xfers) == 1
    r2 = Rig()
    r2.control.begin_read = _refused("transfer t: no hold (never made, or freed and forgotten): recompute")
    r2.recv.on_load("req", _pull(), T0)
    r2.recv.progress(T0 + BEGIN_READ_HOLD_GRACE_S)
    assert r2.results() == [("recv", "req", False, (1, 2, 3))] and r2.ep.xfers == []


def test_a_begin_read_refused_for_a_lapsed_registration_is_asked_again_later() -> None:
    """NOT_FOUND "engine me is not registered": our registration lapsed (a late refresh),
    nothing was recorded; asked again after UNREGISTERED_RETRY_S, not every step, and the
    READ goes ahead once answered (issue 14: recomputed before)."""
    from kvbaton.connector.flows.receive import UNREGISTERED_RETRY_S
    r = Rig()
    r.control.begin_read = _refused("engine me is not registered", grpc.StatusCode.NOT_FOUND)
    r.recv.on_load("req", _pull(), T0)
    r.recv.progress(T0)
    r.recv.progress(T0 + UNREGISTERED_RETRY_S / 2)
    assert r.results() == [] and len(r.control.requests("BeginReadRequest")) == 1  # not yet again
    r.control.begin_read = rendezvous_pb2.TransferState(transfer_id=TID)
    r.recv.progress(T0 + UNREGISTERED_RETRY_S)
    r.recv.progress(T0 + UNREGISTERED_RETRY_S + 0.01)
    assert len(r.control.requests("BeginReadRequest")) == 2 and len(r.ep.xfers) == 1
    r2 = Rig()  # another NOT_FOUND is final
    r2.control.begin_read = _refused("transfer t not found", grpc.StatusCode.NOT_FOUND)
    r2.recv.on_load("req", _pull(), T0)
    r2.recv.progress(T0)
    assert r2.results() == [("recv", "req", False, (1, 2, 3))] and r2.ep.xfers == []


def test_a_server_without_begin_read_is_read_from_unrecorded() -> None:
    r = Rig()
    r.control.begin_read = _refused("no BeginRead here", grpc.StatusCode.UNIMPLEMENTED)
    r.recv.on_load("req", _pull(), T0)
    r.recv.progress(T0)
    (x,) = r.ep.xfers
    x.state = "DONE"
    r.recv.progress(T0 + 0.1)
    assert r.results() == [("recv", "req", True, (1, 2, 3))]
    assert r.control.requests("ReportOutcomeRequest") == []


def test_pull_times_out_fails_the_load_and_frees_the_owner() -> None:
    r = Rig()
    before = r.recompute_count("timeout")
    r.recv.on_load("req", _pull(), T0)
    r.recv.progress(T0)
    r.recv.progress(T0 + 4.9)
    assert r.results() == []
    r.recv.progress(T0 + 5.0)  # the load's deadline (timeout_s)
    assert r.results() == [("recv", "req", False, (1, 2, 3))]  # block ids → load errors → recompute
    assert r.ep.xfers[0].released  # cancelled
    assert r.ep.messages(wire.Done) == [wire.Done(TID)]  # prefill frees now, not at its own timeout
    assert r.recompute_count("timeout") == before + 1


def test_pull_from_a_dead_peer_forgets_it_and_looks_it_up_again() -> None:
    r = Rig()
    r.recv.on_load("a", _pull("ta"), T0)
    r.recv.progress(T0)
    r.ep.xfers[0].state = "ERR"  # the peer died mid-READ
    r.recv.progress(T0 + 0.1)
    assert r.results() == [("recv", "a", False, (1, 2, 3))]
    assert r.ep.removed == ["kvb-p0-r0"]
    n = len(r.control.lookups)
    r.recv.on_load("b", _pull("tb"), T0 + 1)
    r.recv.progress(T0 + 1)
    assert len(r.control.lookups) == n + 1  # fresh metadata for the next transfer


def test_pull_gives_up_when_the_registrar_never_answers() -> None:
    r = Rig(known=())
    r.recv.on_load("req", _pull(), T0)
    r.recv.progress(T0)
    assert r.ep.xfers == [] and r.results() == []
    r.recv.progress(T0 + 5.0)
    assert r.results() == [("recv", "req", False, (1, 2, 3))]
    assert r.control.lookups[0].cancelled()


def test_pull_post_failure_forgets_the_peer() -> None:
    r = Rig()
    r.ep.post_error = RuntimeError("stale metadata")
    r.recv.on_load("req", _pull(), T0)
    r.recv.progress(T0)
    assert r.results() == [("recv", "req", False, (1, 2, 3))]
    assert r.ep.removed == ["kvb-p0-r0"]


def test_release_only_load_just_tells_prefill_to_free() -> None:
    r = Rig()
    r.recv.on_load("req", LoadSpec(TID, "p0", (), (), report_recv=False), T0)
    r.recv.progress(T0)
    assert r.ep.messages(wire.Done) == [wire.Done(TID)] and r.ep.xfers == []
    assert r.results() == []  # nobody waits for it


# ---------------------------------------------------------------------------- push (decode)
def _push_load(tid: str = TID) -> LoadSpec:
    return LoadSpec(tid, "", (), (4, 5), mode="push")


def test_push_arrival_completes_the_load() -> None:
    r = Rig()
    r.recv.on_load("req", _push_load(), T0)
    r.recv.progress(T0)
    r.recv.on_pushed("kvb-p0-r0", wire.Pushed(TID, 4096))
    r.recv.progress(T0 + 0.1)
    assert r.results() == [("recv", "req", True, (4, 5))]


def test_push_cancelled_at_the_rendezvous_fails_and_cancels() -> None:
    r = Rig()
    r.recv.on_load("req", _push_load(), T0)
    ev = rendezvous_pb2.RendezvousEvent(type=rendezvous_pb2.RendezvousEvent.TYPE_CANCELLED)
    ev.transfer.reason = "prefill aborted"
    r.recv.on_event(TID, ev)
    r.recv.progress(T0 + 0.1)
    assert r.results() == [("recv", "req", False, (4, 5))]
    (cancel,) = r.control.requests("CancelRequest")
    assert cancel.transfer_id == TID and "push transfer ended without data: prefill aborted" in cancel.reason


def test_push_that_never_arrives_times_out_and_a_late_notification_is_dropped() -> None:
    r = Rig()
    r.recv.on_load("req", _push_load(), T0)
    r.recv.progress(T0 + 5.0)
    assert r.results() == [("recv", "req", False, (4, 5))]
    assert len(r.control.requests("CancelRequest")) == 1  # a late match is refused
    r.recv.on_pushed("kvb-p0-r0", wire.Pushed(TID, 4096))  # late: nobody waits for it
    assert r.recv._push_arrived[TID][0] == T0  # stamped on the flow's clock, which expire() ages against
    r.recv.progress(T0 + 6.0)
    assert r.results() == [] and not r.recv.busy
    r.recv.expire(T0 + 100.0, 10.0)  # and it does not stay forever
    assert r.recv._push_arrived == {}


# ---------------------------------------------------------------------------- reuse (prefill)
def _reuse_load() -> LoadSpec:
    src = ReuseSource("conv", "d0", "lease-1", "ret-1", num_tokens=4 * BS)
    return LoadSpec("reuse-x", "d0", (8, 9), (1, 2), mode="reuse", reuse=src)


def _pinned(r: Rig, *, retention: str = "ret-1") -> None:
    fut, req = r.control.calls[-1]
    assert isinstance(req, lease_pb2.PinRequest) and req.lease_id == "lease-1"
    resp = lease_pb2.PinResponse()
    resp.pin.pin_id = "pin-1"
    resp.lease.retention_id, resp.lease.engine_id = retention, "d0"
    fut.set_result(resp)


def test_reuse_pins_reads_and_unpins() -> None:
    r = Rig()
    r.recv.on_load("req", _reuse_load(), T0)
    r.recv.progress(T0)
    assert r.ep.xfers == []  # no READ before the pin
    _pinned(r)
    lines: list[tuple[str, dict[str, Any]]] = []
    r.ctx.stats.record = lambda event, **f: lines.append((event, f))  # type: ignore[method-assign]
    r.recv.progress(T0 + 0.1)
    (x,) = r.ep.xfers
    assert wire.decode(x.notif) == wire.ReuseServed("conv", x.nbytes)
    x.state = "DONE"
    r.recv.progress(T0 + 0.2)
    assert r.results() == [("recv", "req", True, (1, 2))]
    ((ev, f),) = [x for x in lines if x[0] == "reuse_read"]
    assert f["pinned_s"] == pytest.approx(0.1) and f["begun_s"] >= f["pinned_s"] and f["num_blocks"] == 2
    (unpin,) = r.control.requests("UnpinRequest")
    assert unpin.pin_id == "pin-1"


def test_reuse_begins_on_the_ledger_naming_the_retention_and_a_stale_one_is_fenced() -> None:
    r = Rig()
    r.recv.on_load("req", _reuse_load(), T0)
    r.recv.progress(T0)
    _pinned(r)
    r.recv.progress(T0 + 0.1)
    (begin,) = r.control.requests("BeginReadRequest")
    assert (begin.transfer_id, begin.kind, begin.generation, begin.conversation_id, list(begin.block_ids),
            list(begin.source_block_ids)) == ("reuse-x", rendezvous_pb2.TRANSFER_KIND_REUSE, "ret-1", "conv",
                                              [1, 2], [8, 9])
    (x,) = r.ep.xfers
    x.state = "DONE"
    r.recv.progress(T0 + 0.2)
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert rep.transfer_id == "reuse-x" and rep.outcome.success and rep.outcome.bytes == x.nbytes

    stale = Rig()
    before = stale.recompute_count("fenced")
    stale.control.begin_read = _refused("conversation conv's blocks were re-registered (generation ret-2; the "
                                        "read names ret-1): recompute")
    stale.recv.on_load("req", _reuse_load(), T0)
    stale.recv.progress(T0)
    _pinned(stale)
    stale.recv.progress(T0 + 0.1)
    assert stale.ep.xfers == [] and stale.results() == [("recv", "req", False, (1, 2))]
    assert stale.recompute_count("fenced") == before + 1
    assert len(stale.control.requests("UnpinRequest")) == 1


def test_reuse_refused_pin_recomputes_without_reading() -> None:
    r = Rig()
    before = r.recompute_count("pin_refused")
    r.recv.on_load("req", _reuse_load(), T0)
    r.recv.progress(T0)
    r.control.calls[-1][0].set_exception(grpc.RpcError("lease ended"))
    r.recv.progress(T0 + 0.1)
    assert r.results() == [("recv", "req", False, (1, 2))] and r.ep.xfers == []
    assert r.recompute_count("pin_refused") == before + 1


def test_reuse_of_a_retention_the_lease_no_longer_protects_is_refused() -> None:
    r = Rig()
    before = r.recompute_count("lease_ended")
    r.recv.on_load("req", _reuse_load(), T0)
    r.recv.progress(T0)
    _pinned(r, retention="ret-2")
    r.recv.progress(T0 + 0.1)
    assert r.results() == [("recv", "req", False, (1, 2))] and r.ep.xfers == []
    assert r.recompute_count("lease_ended") == before + 1
    assert len(r.control.requests("UnpinRequest")) == 1  # the pin we got is released


def test_reuse_read_must_end_within_half_the_pin_ttl() -> None:
    r = Rig(pin_ttl_s=2.0)
    r.recv.on_load("req", _reuse_load(), T0)
    r.recv.progress(T0)
    _pinned(r)
    r.recv.progress(T0 + 0.1)
    r.recv.progress(T0 + 0.99)
    assert r.results() == []
    r.recv.progress(T0 + 1.0)  # pin requested at T0, TTL 2 s: the READ is cancelled at T0 + 1
    assert r.results() == [("recv", "req", False, (1, 2))]
    assert r.ep.xfers[0].released


# ---------------------------------------------------------------------------- prefill holds
def _send(mode: str = "pull", tid: str = TID) -> SendSpec:
    return SendSpec(tid, 3, 5.0, mode, block_ids=(1, 2, 3), num_tokens=3 * BS)


def test_pull_hold_ends_on_done_even_when_it_arrives_first() -> None:
    r = Rig()
    r.send.on_done("kvb-d0-r0", wire.Done(TID))  # decode was faster than this step's SendSpec
    r.send.on_send("req", _send(), T0)
    assert r.results() == [("sent", "req", True, ())] and not r.send.busy


def _ledger(kind: int, tid: str = TID, phase: int = rendezvous_pb2.TRANSFER_PHASE_SUCCEEDED) -> Any:
    ev = rendezvous_pb2.RendezvousEvent(type=kind)
    ev.transfer.transfer_id, ev.transfer.phase = tid, phase
    ev.transfer.completion.engine_id = "me"
    ev.transfer.outcomes.add(engine_id="d0", success=phase == rendezvous_pb2.TRANSFER_PHASE_SUCCEEDED, bytes=3072)
    return ev


def test_pull_hold_is_freed_on_the_ledgers_expiry_not_at_its_own_timeout() -> None:
    r = Rig()
    r.send.on_send("req", _send(), T0)
    r.send.expire(T0 + 5.0, 10.0)  # the hold's timeout: a READ begun just before may still run
    assert r.results() == [] and r.send.busy
    r.send.on_event(TID, _ledger(rendezvous_pb2.RendezvousEvent.TYPE_EXPIRED,
                                 phase=rendezvous_pb2.TRANSFER_PHASE_EXPIRED))
    assert r.results() == [("sent", "req", False, ())] and not r.send.busy


def test_pull_hold_is_freed_on_the_ledgers_done_with_the_readers_outcome() -> None:
    for phase, ok in ((rendezvous_pb2.TRANSFER_PHASE_SUCCEEDED, True), (rendezvous_pb2.TRANSFER_PHASE_FAILED, False)):
        r = Rig()
        r.send.on_send("req", _send(), T0)
        r.send.on_event(TID, _ledger(rendezvous_pb2.RendezvousEvent.TYPE_DONE, phase=phase))
        assert r.results() == [("sent", "req", ok, ())] and not r.send.busy


def test_pull_hold_local_cap_is_the_last_resort_past_every_ledger_deadline() -> None:
    from kvbaton.connector.flows.send import PULL_HOLD_CAP_EXTRA_S
    assert PULL_HOLD_CAP_EXTRA_S > 60.0  # the rendezvous' default match timeout
    r = Rig()
    r.send.on_send("req", _send(), T0)
    r.send.expire(T0 + 5.0 + PULL_HOLD_CAP_EXTRA_S - 0.1, 1000.0)
    assert r.results() == []
    r.send.expire(T0 + 5.0 + PULL_HOLD_CAP_EXTRA_S, 1000.0)  # the control plane never said
    assert r.results() == [("sent", "req", False, ())]


def _match(tid: str = TID, offered: tuple[int, ...] = (11, 12, 13)) -> Any:
    ev = rendezvous_pb2.RendezvousEvent(type=rendezvous_pb2.RendezvousEvent.TYPE_MATCH)
    ev.transfer.transfer_id = tid
    ev.transfer.attempt = 2
    ev.transfer.offer.engine_id = "d0"
    ev.transfer.offer.block_ids.extend(offered)
    ev.transfer.offer.num_tokens = 2 * BS  # decode had the first block cached
    return ev


def test_push_writes_on_match_and_reports_the_outcome() -> None:
    r = Rig()
    r.send.on_send("req", _send("push"), T0)
    r.send.on_event(TID, _match())
    r.send.progress(T0)
    (x,) = r.ep.xfers
    assert x.op == "WRITE" and wire.decode(x.notif) == wire.Pushed(TID, x.nbytes)
    assert x.nbytes == 2 * r.lay.bytes_per_block * r.lay.num_regions  # the cached block is skipped
    x.state = "DONE"
    r.send.progress(T0 + 0.1)
    assert r.results() == [("sent", "req", True, ())]
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert rep.transfer_id == TID and rep.attempt == 2 and rep.outcome.success and rep.outcome.bytes == x.nbytes


def test_push_write_error_reports_failure_and_forgets_the_peer() -> None:
    r = Rig()
    r.send.on_event(TID, _match())  # the match may come before the SendSpec
    r.send.on_send("req", _send("push"), T0)
    r.send.progress(T0)
    r.ep.xfers[0].state = "ERR"
    r.send.progress(T0 + 0.1)
    assert r.results() == [("sent", "req", False, ())]
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert not rep.outcome.success and "failed" in rep.outcome.error
    assert r.ep.removed == ["kvb-d0-r0"]


def test_push_cancelled_before_the_write_frees_at_once() -> None:
    r = Rig()
    r.send.on_send("req", _send("push"), T0)
    ev = rendezvous_pb2.RendezvousEvent(type=rendezvous_pb2.RendezvousEvent.TYPE_CANCELLED)
    r.send.on_event(TID, ev)
    assert r.results() == [("sent", "req", False, ())] and not r.send.busy


def test_push_with_mismatched_block_counts_fails_cleanly() -> None:
    r = Rig()
    r.send.on_send("req", _send("push"), T0)
    r.send.on_event(TID, _match(offered=(11, 12)))
    r.send.progress(T0)
    assert r.results() == [("sent", "req", False, ())] and r.ep.xfers == []
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert "block count mismatch" in rep.outcome.error


# ---------------------------------------------------------------------------- verify_kv (owner)
def test_owner_without_verify_kv_refuses_to_vouch() -> None:
    r = Rig()
    r.verifier.on_question("kvb-d0-r0", wire.FpQuestion("t:x", "d0", -1, (1, 2)))
    r.verifier.progress(T0)
    (ans,) = r.ep.messages(wire.FpAnswer)
    assert ans.key == "t:x" and ans.refused == "verify_kv is off on the owner"


# ---------------------------------------------------------------------------- staged
class _SlowSend:
    """A staged send that never finishes by itself."""

    nchunks, nbytes = 4, 0

    def __init__(self) -> None:
        self.steps = 0
        self.closed = False
        self.finish = False

    def step(self) -> bool:
        self.steps += 1
        return self.finish

    def close(self) -> None:
        self.closed = True


class _FakeStagedPeer:
    def __init__(self) -> None:
        self.sends: list[_SlowSend] = []

    def start_send(self, *a: Any, **kw: Any) -> _SlowSend:
        self.sends.append(_SlowSend())
        return self.sends[-1]

    def take_pull(self) -> None:
        return None

    def cancel(self, xid: str) -> None:
        pass


def test_a_slow_staged_send_does_not_stall_other_loads() -> None:
    r = Rig(staged=True)
    assert r.staged is not None
    r.staged.peer = _FakeStagedPeer()  # type: ignore[assignment]
    info: Any = object()
    a = r.staged.submit_send("kvb-d0-r0", "d0", info, [1], [2], "wa", T0 + 5)
    b = r.staged.submit_send("kvb-d0-r0", "d0", info, [3], [4], "wb", T0 + 5)
    r.recv.on_load("req", _pull(), T0)
    for k in range(3):  # the loop's turns: staged, then loads
        r.staged.progress(T0 + k * 0.01)
        r.recv.progress(T0 + k * 0.01)
        if r.ep.xfers:
            r.ep.xfers[0].state = "DONE"
    assert r.results() == [("recv", "req", True, (1, 2, 3))]  # the READ finished meanwhile
    peer = r.staged.peer
    assert len(peer.sends) == 1 and peer.sends[0].steps == 3  # one staged send at a time, stepped
    peer.sends[0].finish = True
    r.staged.progress(T0 + 1)
    assert a.finished and peer.sends[0].closed and len(peer.sends) == 2  # then the next one starts
    assert isinstance(b, SendJob) and not b.finished


def test_an_abandoned_staged_send_is_closed_and_dequeued() -> None:
    r = Rig(staged=True)
    assert r.staged is not None
    r.staged.peer = _FakeStagedPeer()  # type: ignore[assignment]
    job = r.staged.submit_send("kvb-d0-r0", "d0", object(), [1], [2], "wa", T0 + 5)  # type: ignore[arg-type]
    r.staged.progress(T0)
    r.staged.abandon(job)
    assert r.staged.peer.sends[0].closed and not r.staged.busy


# ---------------------------------------------------------------------------- wire
def test_wire_round_trips_ids_with_colons() -> None:
    for msg in (wire.Done(TID), wire.Pushed(TID, 7, "crc32=00ff"), wire.ReuseServed("c:1", 3),
                wire.FpQuestion("t:" + TID, "d:0", -1, (1, 2)), wire.FpAnswer("r:c", refused="gone")):
        assert wire.decode(wire.encode(msg)) == msg


@pytest.mark.parametrize("raw", [b"kvb:done:t1", b"KVBS/A x 1 0", b"kvb/2 done\n{\"transfer_id\":\"t\"}"])
def test_another_wire_version_is_refused_not_misparsed(raw: bytes) -> None:
    with pytest.raises(wire.WireVersionError, match="refused"):
        wire.decode(raw)


def test_malformed_messages_are_errors() -> None:
    for raw in (b"kvb/1 done\n{}", b"kvb/1 nope\n{}", b"kvb/1 done\nnot json", b"hello"):
        with pytest.raises(wire.WireError):
            wire.decode(raw)


# ---------------------------------------------------------------------------- verify_kv (reader)
class VerifyRig(Rig):
    """A reader with verify_kv on: real fingerprints of real (host) tensors."""

    def __init__(self) -> None:
        import torch

        from kvbaton.connector.transfer.geometry import KvLayout
        from kvbaton.connector.transfer.integrity import Fingerprinter

        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.tensors = [torch.randn(32, 2, BS, 8, generator=gen)]
        self.lay = KvLayout.from_tensors(self.tensors, BS, block_dim=0)
        self.ctx.layout = self.lay
        self.ctx.fp = self.fp = Fingerprinter(self.lay, self.tensors)
        self.verifier = Verifier(self.ctx, lambda cmd: None)
        mover = Mover(self.ctx, None)
        self.recv = ReceiveFlow(self.ctx, mover, self.verifier, None)

    def landed(self, now: float) -> None:
        """Post the READ, let it complete: the blocks are 'in' (our tensors)."""
        self.recv.on_load("req", _pull(), now)
        self.recv.progress(now)
        (q,) = self.ep.messages(wire.FpQuestion)  # asked before the READ was posted
        assert q.key == f"t:{TID}" and q.block_ids == (5, 6, 7) and q.reader == "me"
        self.ep.xfers[0].state = "DONE"
        self.recv.progress(now + 0.01)

    def answer(self, owner_blocks: tuple[int, ...]) -> None:
        fps = self.fp.submit(owner_blocks).result(timeout=10)
        self.recv_answer(wire.FpAnswer(f"t:{TID}", fps.encode()))

    def recv_answer(self, ans: wire.FpAnswer) -> None:
        self.verifier.on_answer("kvb-p0-r0", ans)

    def finish(self, now: float) -> list[Any]:
        self.recv.progress(now)  # starts fingerprinting what landed
        (ld,) = self.recv.loads
        assert ld.fp_local is not None
        ld.fp_local.result(timeout=10)
        self.recv.progress(now + 0.01)
        return self.results()

    def close(self) -> None:
        self.fp.close()


def test_verified_load_finishes_only_when_fingerprints_match() -> None:
    r = VerifyRig()
    try:
        r.landed(T0)
        assert r.results() == []  # landed, not verified yet
        r.answer((1, 2, 3))  # the owner's bytes equal what landed in our blocks 1, 2, 3
        assert r.finish(T0 + 0.1) == [("recv", "req", True, (1, 2, 3))]
    finally:
        r.close()


def test_mismatched_fingerprints_fail_the_load() -> None:
    r = VerifyRig()
    before = r.recompute_count("verify_failed")
    try:
        r.landed(T0)
        r.answer((9, 10, 11))  # other bytes
        assert r.finish(T0 + 0.1) == [("recv", "req", False, (1, 2, 3))]
        assert r.recompute_count("verify_failed") == before + 1
    finally:
        r.close()


def test_a_silent_owner_fails_verification_in_bounded_time() -> None:
    r = VerifyRig()
    try:
        r.landed(T0)
        r.recv.progress(T0 + 4.0)
        assert r.results() == []
        r.recv.progress(T0 + 5.02)  # landed + min(timeout_s, 5 s)
        assert r.results() == [("recv", "req", False, (1, 2, 3))]
    finally:
        r.close()


def test_an_owner_that_cannot_vouch_fails_the_load() -> None:
    r = VerifyRig()
    try:
        r.landed(T0)
        r.recv_answer(wire.FpAnswer(f"t:{TID}", refused="no fingerprints of those blocks"))
        r.recv.progress(T0 + 0.1)
        assert r.results() == [("recv", "req", False, (1, 2, 3))]
    finally:
        r.close()


# ---------------------------------------------------------------------------- dispatch
def test_the_loop_refuses_other_versions_and_routes_its_own() -> None:
    from kvbaton.connector.loop import TransferLoop
    from kvbaton.connector.settings import KvbatonSettings
    from kvbaton.connector.statslog import StatsLog

    lay = layout()
    loop = TransferLoop(KvbatonSettings(control_plane="cp:1", engine_id="me"), 0, lay, FakeControl(),  # type: ignore[arg-type]
                        StatsLog("", "me"))
    got: list[Any] = []
    handler = loop._typed(lambda peer, msg: got.append((peer, msg)))
    handler("kvb-p0-r0", b"kvb/2 done\n{\"transfer_id\":\"t\"}")  # a newer peer
    handler("kvb-p0-r0", b"kvb:done:t")  # an older one
    loop._refuse("kvb-p0-r0", b"KVBS/A x 1 0")
    assert got == [] and loop.ctx.stats.counters["wire_refused"] == 3
    handler("kvb-p0-r0", wire.encode(wire.Done(TID)))
    assert got == [("kvb-p0-r0", wire.Done(TID))]
