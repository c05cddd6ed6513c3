"""The connector's control thread sends offers/completions/outcomes/cancels over one
``Rendezvous/Session`` stream (real server), and a call carrying a request's trace as a
unary call (session messages have no per-call metadata)."""

from __future__ import annotations

import asyncio

import pytest

from kvbaton.connector.control import ControlThread, rendezvous_call
from kvbaton.v1 import common_pb2
from kvbaton.v1 import rendezvous_pb2 as pb
from tests.services.helpers import register
from tests.services.test_rendezvous import complete, offer

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
async def control(plane):
    ct = ControlThread(plane.address, timeout_s=5.0)
    yield ct
    await asyncio.get_running_loop().run_in_executor(None, ct.close)


async def _send(ct: ControlThread, method: str, req, traceparent: str | None = None):
    return await asyncio.wrap_future(ct.submit(rendezvous_call(method, req, traceparent)))


async def test_calls_go_over_one_session_and_traced_ones_stay_unary(kv, control):
    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL)
    await _send(control, "Offer", offer("t1"))
    await _send(control, "Complete", complete("t1", writers=1))
    session = control.client.session
    assert not session.unary_fallback
    assert session.stats["sent_calls"] == 2 and session.stats["received_results"] == 2
    state = await kv.call(kv.rendezvous.GetTransfer, pb.GetTransferRequest(transfer_id="t1"))
    assert state.phase == pb.TRANSFER_PHASE_MATCHED

    # Traced: a unary call, so the session saw nothing more; the outcome still applied.
    done = pb.ReportOutcomeRequest(transfer_id="t1", outcome=pb.Outcome(engine_id="pre", success=True, bytes=4096))
    await _send(control, "ReportOutcome", done, TP)
    assert session.stats["sent_calls"] == 2
    state = await kv.call(kv.rendezvous.GetTransfer, pb.GetTransferRequest(transfer_id="t1"))
    assert state.phase == pb.TRANSFER_PHASE_SUCCEEDED and state.outcomes[0].bytes == 4096

def test_only_session_calls_are_accepted():
    with pytest.raises(ValueError):
        rendezvous_call("GetTransfer", pb.GetTransferRequest())
