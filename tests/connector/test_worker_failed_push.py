"""A push the rendezvous FAILED (refused at the match as incompatible, a rank failed, no
outcome in time): prefill frees the request's blocks at once, also when the failure came
before its SendSpec; decode stops waiting for a WRITE; outcomes carry the worker's own rank;
a TP > 1 peer whose ranks have not all registered is refused before anything moves."""

from __future__ import annotations

import time

from kvbaton.connector.metadata import LoadSpec, SendSpec
from kvbaton.v1 import rendezvous_pb2 as rpb
from tests.connector.test_flows import Rig, _match

T0 = time.monotonic()
REASON = "incompatible KV: prefill me -> decode d0: KV block sizes differ: 32 vs 16"


def _failed(tid: str) -> rpb.RendezvousEvent:
    ev = rpb.RendezvousEvent(type=rpb.RendezvousEvent.TYPE_DONE)
    ev.transfer.transfer_id, ev.transfer.phase, ev.transfer.reason = tid, rpb.TRANSFER_PHASE_FAILED, REASON
    return ev


def _send(tid: str) -> SendSpec:
    return SendSpec(transfer_id=tid, num_blocks=3, timeout_s=5.0, mode="push", block_ids=(1, 2, 3), num_tokens=48)


def test_prefill_frees_a_held_push_when_the_transfer_failed() -> None:
    r = Rig()
    r.send.on_send("req", _send("x1"), T0)
    r.send.on_event("x1", _failed("x1"))
    assert r.results() == [("sent", "req", False, ())] and not r.send.busy
    assert not r.ep.xfers


def test_prefill_drops_a_send_whose_transfer_failed_before_it_arrived() -> None:
    r = Rig()
    r.send.on_event("x2", _failed("x2"))  # the Complete went out from the scheduler; refused at once
    assert r.results() == []
    r.send.on_send("req", _send("x2"), T0)
    assert r.results() == [("sent", "req", False, ())] and not r.send.busy


def test_decode_stops_waiting_for_the_write_with_the_reason() -> None:
    r = Rig()
    r.recv.on_load("req", LoadSpec("x3", "", (), (4, 5), mode="push"), T0)
    r.recv.on_event("x3", _failed("x3"))
    r.recv.progress(T0 + 0.1)
    assert r.results() == [("recv", "req", False, (4, 5))]


def test_outcome_carries_this_workers_rank() -> None:
    r = Rig()
    r.ctx.tp_rank = 1
    r.send.on_send("req", _send("t:1:with:colons"), T0)
    r.send.on_event("t:1:with:colons", _match())
    r.send.progress(T0)
    r.ep.xfers[0].state = "DONE"
    r.send.progress(T0 + 0.1)
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert rep.outcome.tp_rank == 1


def test_a_tensor_parallel_peer_missing_a_rank_is_refused_before_anything_moves() -> None:
    r = Rig()
    r.control.ranks["d0"].tp_size = 2  # decode's rank 1 has not registered (yet)
    r.send.on_send("req", _send("t:1:with:colons"), T0)
    r.send.on_event("t:1:with:colons", _match())
    r.send.progress(T0)
    r.send.progress(T0 + 0.1)
    assert not r.ep.xfers
    assert r.results() == [("sent", "req", False, ())]
    (rep,) = r.control.requests("ReportOutcomeRequest")
    assert not rep.outcome.success and "has no registered rank(s) [1]" in rep.outcome.error
