"""The MATCH riding on the answer of the completion that made it (CompleteRequest.
match_in_answer), through a real server on both stores: one message fewer per match, the
match delivered exactly once to the engine's sole subscriber, and the Subscribe stream left
to carry it whenever the answer cannot (offer second, several writing ranks, no sole
subscriber on the completing client)."""

from __future__ import annotations

import asyncio

import pytest

from kvbaton.client import KvbatonClient
from kvbaton.match_inbox import MatchInbox
from kvbaton.v1 import common_pb2
from kvbaton.v1 import rendezvous_pb2 as pb
from tests.services.helpers import register
from tests.services.test_rendezvous import Collector, complete, offer

Ev = pb.RendezvousEvent
P = pb.TransferPhase


def Sub(client: KvbatonClient, engine: str, *, sole: bool) -> Collector:
    return Collector(client, engine, 0, sole_subscriber=sole)


def kinds(c: Collector, tid: str) -> list[str]:
    return [Ev.Type.Name(e.type).removeprefix("TYPE_") for e in c.events if e.transfer.transfer_id == tid]


@pytest.fixture
async def clients(plane):
    """(decode's client, the one-rank prefill's client, an operator's client)."""
    out = [KvbatonClient(plane.address, timeout_s=5.0) for _ in range(3)]
    for c in out:
        await c.wait_ready()
    await register(out[2], "dec", common_pb2.ENGINE_ROLE_DECODE)
    await register(out[2], "p1", common_pb2.ENGINE_ROLE_PREFILL)
    await register(out[2], "p2", common_pb2.ENGINE_ROLE_PREFILL, tp_size=2, tp_rank=0)
    await register(out[2], "p2", common_pb2.ENGINE_ROLE_PREFILL, tp_size=2, tp_rank=1)
    yield out
    for c in out:
        await c.close()


def done(tid: str, engine: str, rank: int = 0) -> pb.ReportOutcomeRequest:
    return pb.ReportOutcomeRequest(transfer_id=tid, outcome=pb.Outcome(engine_id=engine, tp_rank=rank, success=True))


async def test_completion_second_its_answer_is_the_match_and_the_stream_skips_it(clients):
    dec, pre, op = clients
    sole = Sub(pre, "p1", sole=True)
    other = Sub(op, "p1", sole=False)  # proves what the server sent on the engine's streams
    await asyncio.gather(sole.ready.wait(), other.ready.wait())
    await dec.session.offer(offer("m1"))
    ans = await pre.session.complete(complete("m1", writers=1, engine="p1"))
    assert ans.matched_now and ans.match_delivered and ans.state.match_answered
    await pre.session.report_outcome(done("m1", "p1"))
    await sole.wait(lambda evs: "DONE" in [Ev.Type.Name(e.type).removeprefix("TYPE_") for e in evs])
    await other.wait(lambda evs: any(e.type == Ev.TYPE_DONE for e in evs))
    assert kinds(sole, "m1") == ["MATCH", "DONE"]
    assert sole.events[0].revision == 0 and sole.events[0].transfer.phase == P.Value("TRANSFER_PHASE_MATCHED")
    assert kinds(other, "m1") == ["DONE"]  # no MATCH message on the stream
    # The completion sent again (its first answer lost): answered as the MATCH again,
    # delivered once.
    dup = await pre.session.complete(complete("m1", writers=1, engine="p1"))
    assert dup.duplicate and not dup.match_delivered  # ended: nothing to write any more
    assert pre.match_inboxes["p1"].stats["answered_matches"] == 1
    await sole.close()
    await other.close()


async def test_a_duplicate_completion_of_a_live_match_is_answered_as_the_match_once(clients):
    dec, pre, _ = clients
    sole = Sub(pre, "p1", sole=True)
    await sole.ready.wait()
    await dec.session.offer(offer("m2"))
    first = await pre.session.complete(complete("m2", writers=1, engine="p1"))
    again = await pre.session.complete(complete("m2", writers=1, engine="p1"))
    assert first.match_delivered and again.duplicate and again.match_delivered
    await sole.wait(lambda evs: len(evs) >= 1)
    await asyncio.sleep(0)  # let a second delivery, if any, reach the list
    assert kinds(sole, "m2") == ["MATCH"]
    stats = pre.match_inboxes["p1"].stats
    assert stats["answered_matches"] == 1 and stats["dropped_duplicate"] == 1
    await sole.close()


async def test_completion_first_the_stream_carries_the_match(clients):
    dec, pre, _ = clients
    sole = Sub(pre, "p1", sole=True)
    await sole.ready.wait()
    ans = await pre.session.complete(complete("m3", writers=1, engine="p1"))
    assert not ans.matched_now and not ans.match_delivered
    made = await dec.session.offer(offer("m3"))
    assert made.matched_now and not made.state.match_answered
    await sole.wait(lambda evs: len(evs) >= 1)
    assert kinds(sole, "m3") == ["MATCH"] and sole.events[0].revision > 0


async def test_several_writing_ranks_or_no_sole_subscriber_keep_the_stream(clients):
    dec, pre, op = clients
    ranks = Sub(op, "p2", sole=False)
    await ranks.ready.wait()
    # Two writers: every rank must hear of it, so the answer is not the MATCH.
    sole2 = Sub(pre, "p2", sole=True)
    await sole2.ready.wait()
    await dec.session.offer(offer("m4"))
    ans = await pre.session.complete(complete("m4", writers=2, engine="p2"))
    assert ans.matched_now and not ans.match_delivered and not ans.state.match_answered
    await ranks.wait(lambda evs: any(e.type == Ev.TYPE_MATCH for e in evs))
    await sole2.wait(lambda evs: any(e.type == Ev.TYPE_MATCH for e in evs))
    assert sole2.events[0].revision > 0
    await sole2.close()
    # A client with no sole subscription of the engine does not ask.
    plain = Sub(op, "p1", sole=False)
    await plain.ready.wait()
    await dec.session.offer(offer("m5"))
    ans = await op.session.complete(complete("m5", writers=1, engine="p1"))
    assert ans.matched_now and not ans.match_delivered
    await plain.wait(lambda evs: any(e.type == Ev.TYPE_MATCH for e in evs))
    await plain.close()
    await ranks.close()


# -- the inbox's ordering rules (logic only: a scripted stream) ---------------------------

async def test_inbox_drops_an_answered_match_whose_transfer_already_ended_on_the_stream():
    inbox = MatchInbox()
    t = pb.TransferState(transfer_id="x", attempt=1, phase=P.Value("TRANSFER_PHASE_MATCHED"))
    ended = pb.TransferState(transfer_id="x", attempt=1, phase=P.Value("TRANSFER_PHASE_CANCELLED"))
    stream_done = asyncio.Event()

    async def stream():
        yield Ev(type=Ev.TYPE_CANCELLED, transfer=ended, revision=7)
        stream_done.set()
        await asyncio.Event().wait()  # stays open

    sub = inbox.merge(stream())
    first = await asyncio.wait_for(sub.__anext__(), 5)
    assert first.type == Ev.TYPE_CANCELLED and inbox.subscribed == 1
    inbox.answered(t)  # its answer came after the cancel: never delivered
    other = pb.TransferState(transfer_id="y", attempt=0, phase=P.Value("TRANSFER_PHASE_MATCHED"))
    inbox.answered(other)
    second = await asyncio.wait_for(sub.__anext__(), 5)
    assert second.transfer.transfer_id == "y" and second.revision == 0
    assert inbox.stats["dropped_ended"] == 1
    await sub.aclose()
    assert inbox.subscribed == 0


async def test_inbox_keeps_answered_matches_across_a_resubscription_and_passes_stream_errors():
    inbox = MatchInbox()

    async def broken():
        yield Ev(type=Ev.TYPE_HEARTBEAT, revision=3)
        raise RuntimeError("stream broke")

    sub = inbox.merge(broken())
    assert (await sub.__anext__()).type == Ev.TYPE_HEARTBEAT
    with pytest.raises(RuntimeError, match="stream broke"):
        await asyncio.wait_for(sub.__anext__(), 5)
    # Answered while nobody was subscribed: handed to the next subscription.
    inbox.answered(pb.TransferState(transfer_id="z", attempt=0, phase=P.Value("TRANSFER_PHASE_MATCHED")))

    async def quiet():
        await asyncio.Event().wait()
        yield Ev()

    sub2 = inbox.merge(quiet())
    got = await asyncio.wait_for(sub2.__anext__(), 5)
    assert got.type == Ev.TYPE_MATCH and got.transfer.transfer_id == "z"
    await sub2.aclose()
