"""The transfer thread's handling of a push the rendezvous FAILED (refused at the match as
incompatible, a rank failed, no outcome in time): prefill frees the request's blocks at
once, also when the failure came before its SendSpec; decode stops waiting for a WRITE."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

from kvbaton.connector.geometry import KvLayout
from kvbaton.connector.metadata import MODE_PUSH, KvbatonSettings, SendSpec
from kvbaton.connector.worker import StatsLog, TransferThread
from kvbaton.v1 import rendezvous_pb2 as rpb

Ev = rpb.RendezvousEvent


def thread(engine_id: str) -> TransferThread:
    values = {"control_plane": "127.0.0.1:9", "engine_id": engine_id}
    ktc = types.SimpleNamespace(engine_id="", get_from_extra_config=lambda k, default=None: values.get(k, default))
    layout = KvLayout(region_base_addrs=(4096,), bytes_per_block=1024, num_blocks=8, tokens_per_block=16,
                      dtype="float32")
    return TransferThread(KvbatonSettings.from_vllm(ktc), 0, layout, None, StatsLog("", engine_id))  # never started


def failed(tid: str, reason: str = "incompatible KV: prefill p -> decode d: block sizes differ") -> Ev:
    st = rpb.TransferState(transfer_id=tid, phase=rpb.TRANSFER_PHASE_FAILED, reason=reason)
    st.offer.engine_id, st.completion.engine_id = "d", "p"
    return Ev(type=Ev.TYPE_DONE, transfer=st)


def send(tid: str) -> SendSpec:
    return SendSpec(transfer_id=tid, num_blocks=2, timeout_s=30.0, mode=MODE_PUSH, block_ids=(1, 2), num_tokens=32)


def test_prefill_frees_a_held_push_when_the_transfer_failed():
    t = thread("p")
    t._handle(("send", "req-1", send("x1")))
    assert "x1" in t._held
    t._on_event("x1", failed("x1"))
    assert "x1" not in t._held
    assert t.results.get_nowait() == ("sent", "req-1", False, ())
    assert t.stats.counters["send_cancelled"] == 1


def test_prefill_drops_a_send_whose_transfer_failed_before_it_arrived():
    t = thread("p")
    t._on_event("x2", failed("x2"))  # the Complete went out from the scheduler; refused at once
    assert t.results.empty()
    t._handle(("send", "req-2", send("x2")))
    assert "x2" not in t._held  # never held: nothing to write, nothing to wait for
    assert t.results.get_nowait() == ("sent", "req-2", False, ())


def test_decode_stops_waiting_for_the_write_with_the_reason():
    t = thread("d")
    t._on_event("x3", failed("x3"))
    assert "incompatible KV" in t._push_failed["x3"][1]
    ok = failed("x4")
    ok.transfer.phase = rpb.TRANSFER_PHASE_SUCCEEDED
    t._on_event("x4", ok)
    assert "x4" not in t._push_failed
