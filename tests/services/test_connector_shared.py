"""One control client per engine process (``ControlThread.shared``), on a real server.

The scheduler's connector and the rank-0 worker's of a one-rank engine share the thread
and client, so a completion the scheduler sends goes out on the client that holds the
engine's sole subscription and is answered with the MATCH (no separate stream event).
Each holder's tasks are its own, and the thread lives until its last holder closes.
"""

from __future__ import annotations

import asyncio
import queue

from kvbaton.connector.control import ControlThread, rendezvous_call
from kvbaton.v1 import common_pb2
from kvbaton.v1 import rendezvous_pb2 as pb
from tests.services.helpers import register
from tests.services.test_rendezvous import complete, offer

MATCH = pb.RendezvousEvent.TYPE_MATCH


async def _send(ct: ControlThread, method: str, req):
    return await asyncio.wrap_future(ct.submit(rendezvous_call(method, req)))


async def _in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def _subscribed(ct: ControlThread, engine_id: str) -> None:
    """Until the sole subscription's inbox is open on the control thread's client."""
    async def check() -> bool:
        inbox = ct.client.match_inboxes.get(engine_id)
        return inbox is not None and inbox.subscribed > 0
    async with asyncio.timeout(10):
        while not await asyncio.wrap_future(ct.submit(lambda c: check())):
            await asyncio.sleep(0.02)


async def test_the_schedulers_completion_gets_the_match_on_its_answer(kv, plane):
    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL)
    worker = ControlThread.shared(plane.address, timeout_s=5.0)
    sched = ControlThread.shared(plane.address, timeout_s=5.0, name="kvbaton-sched-control")
    try:
        assert sched.client is worker.client and worker.holders == 2
        events: queue.Queue = queue.Queue()
        worker.subscribe("pre", 0, events.put, sole_subscriber=True)
        await _subscribed(worker, "pre")
        await _send(sched, "Offer", offer("t1"))
        answer = await _send(sched, "Complete", complete("t1", writers=1))
        assert answer.matched_now and answer.match_delivered
        ev = await _in_thread(events.get, True, 10)
        # Revision 0: it came on the completion's answer, not the Subscribe stream.
        assert ev.type == MATCH and ev.transfer.transfer_id == "t1" and ev.revision == 0
        state = await kv.call(kv.rendezvous.GetTransfer, pb.GetTransferRequest(transfer_id="t1"))
        assert state.phase == pb.TRANSFER_PHASE_MATCHED and state.match_answered
    finally:
        await _in_thread(sched.close)
        await _in_thread(worker.close)


async def test_the_thread_lives_until_its_last_holder_closes(kv, plane):
    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
    first = ControlThread.shared(plane.address, timeout_s=5.0)
    second = ControlThread.shared(plane.address, timeout_s=5.0)
    await _in_thread(first.close)
    await _in_thread(first.close)  # a second close of one holder changes nothing
    assert second.holders == 1 and second._thread.is_alive()
    answer = await _send(second, "Offer", offer("t2"))
    assert answer.state.phase == pb.TRANSFER_PHASE_OFFERED
    await _in_thread(second.close)
    assert second.holders == 0 and not second._thread.is_alive()
    # The next holder starts a thread and client of its own.
    third = ControlThread.shared(plane.address, timeout_s=5.0)
    try:
        assert third.client is not second.client and third.holders == 1
        assert (await _send(third, "Offer", offer("t3"))).state.phase == pb.TRANSFER_PHASE_OFFERED
    finally:
        await _in_thread(third.close)
