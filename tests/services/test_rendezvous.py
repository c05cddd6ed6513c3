"""Rendezvous over a real gRPC server: matching in any order, exactly once, deadlines,
attempts, outcomes, cancellation and bad input."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kvbaton.v1 import common_pb2
from kvbaton.v1 import rendezvous_pb2 as pb
from tests.services.helpers import register

Ev = pb.RendezvousEvent


@pytest.fixture
async def engines(kv):
    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL, tp_size=2, tp_rank=0)
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL, tp_size=2, tp_rank=1)


def offer(tid, blocks=(1, 2, 3), attempt=0, timeout_ms=0, engine="dec", peer=""):
    return pb.OfferRequest(transfer_id=tid, attempt=attempt, decode_engine_id=engine, block_ids=list(blocks),
                           num_tokens=16 * len(blocks), timeout_ms=timeout_ms, prefill_engine_id=peer)


def complete(tid, blocks=(7, 8, 9), attempt=0, timeout_ms=0, writers=2, engine="pre", peer=""):
    return pb.CompleteRequest(transfer_id=tid, attempt=attempt, prefill_engine_id=engine, block_ids=list(blocks),
                              num_tokens=16 * len(blocks), timeout_ms=timeout_ms, writers=writers,
                              decode_engine_id=peer)


class Collector:
    """Reads one engine rank's event stream into a list."""

    def __init__(self, kv, engine, rank=0, *, sole_subscriber=False):
        self.events: list[Ev] = []
        self.changed = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(kv.subscribe(engine, rank, heartbeats=True,
                                                                 sole_subscriber=sole_subscriber)))
        self.ready = asyncio.Event()

    async def _run(self, it):
        async for ev in it:
            if ev.type == Ev.TYPE_HEARTBEAT:
                self.ready.set()
                continue
            self.events.append(ev)
            self.changed.set()

    async def wait(self, pred, timeout=5.0):
        async def loop():
            while not pred(self.events):
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(loop(), timeout)

    def of(self, kind):
        return [e for e in self.events if e.type == kind]

    async def close(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@pytest.mark.parametrize("offer_first", [True, False])
async def test_match_in_either_order_reaches_every_prefill_rank(kv, engines, offer_first):
    ranks = [Collector(kv, "pre", r) for r in (0, 1)]
    for c in ranks:
        await asyncio.wait_for(c.ready.wait(), 5)
    first, second = (kv.rendezvous.Offer, offer("t1")), (kv.rendezvous.Complete, complete("t1"))
    if not offer_first:
        first, second = second, first
    a = await kv.call(*first)
    b = await kv.call(*second)
    assert not a.matched_now and b.matched_now
    assert b.state.phase == pb.TRANSFER_PHASE_MATCHED
    for c in ranks:
        await c.wait(lambda evs: len(evs) >= 1)
        [m] = c.of(Ev.TYPE_MATCH)
        assert list(m.transfer.offer.block_ids) == [1, 2, 3] and list(m.transfer.completion.block_ids) == [7, 8, 9]
        await c.close()


async def test_hundreds_of_concurrent_transfers_each_matched_exactly_once(kv, engines):
    col = Collector(kv, "pre", 0)
    await asyncio.wait_for(col.ready.wait(), 5)
    n = 300
    rng = random.Random(7)
    calls = []
    for i in range(n):
        pair = [kv.call(kv.rendezvous.Offer, offer(f"c{i}")), kv.call(kv.rendezvous.Complete, complete(f"c{i}"))]
        rng.shuffle(pair)
        calls.extend(pair)
        if rng.random() < 0.3:  # duplicates racing the originals
            calls.append(kv.call(kv.rendezvous.Offer, offer(f"c{i}")))
    results = await asyncio.gather(*calls)
    matched_now = [r.state.transfer_id for r in results if r.matched_now]
    assert sorted(matched_now) == sorted(f"c{i}" for i in range(n))  # one maker per transfer
    await col.wait(lambda evs: len(evs) >= n, timeout=20)
    await asyncio.sleep(0.2)
    ids = [e.transfer.transfer_id for e in col.of(Ev.TYPE_MATCH)]
    assert len(ids) == n and len(set(ids)) == n  # delivered once each
    await col.close()


async def test_duplicates_are_idempotent_and_conflicts_refused(kv, engines):
    a = await kv.call(kv.rendezvous.Offer, offer("d1"))
    b = await kv.call(kv.rendezvous.Offer, offer("d1"))
    assert not a.duplicate and b.duplicate and b.state.phase == pb.TRANSFER_PHASE_OFFERED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.rendezvous.Offer, offer("d1", blocks=(4, 5, 6)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "different offer" in err.value.details()
    m = await kv.call(kv.rendezvous.Complete, complete("d1"))
    again = await kv.call(kv.rendezvous.Complete, complete("d1"))
    assert m.matched_now and again.duplicate and not again.matched_now


@pytest.mark.parametrize("side", ["offer", "completion"])
async def test_unmatched_side_expires_and_its_owner_is_told(kv, engines, side):
    owner = "dec" if side == "offer" else "pre"
    col = Collector(kv, owner, 0)
    await asyncio.wait_for(col.ready.wait(), 5)
    if side == "offer":
        await kv.call(kv.rendezvous.Offer, offer("e1", timeout_ms=300))
    else:
        await kv.call(kv.rendezvous.Complete, complete("e1", timeout_ms=300))
    await col.wait(lambda evs: any(e.type == Ev.TYPE_EXPIRED for e in evs), timeout=5)
    [ev] = col.of(Ev.TYPE_EXPIRED)
    assert ev.transfer.transfer_id == "e1" and "unmatched" in ev.transfer.reason
    # The late other side is refused, not matched against freed blocks.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if side == "offer":
            await kv.call(kv.rendezvous.Complete, complete("e1"))
        else:
            await kv.call(kv.rendezvous.Offer, offer("e1"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "expired" in err.value.details()
    await col.close()


async def test_superseded_attempt_is_refused_and_old_owner_told(kv, engines):
    dec = Collector(kv, "dec", 0)
    await asyncio.wait_for(dec.ready.wait(), 5)
    await kv.call(kv.rendezvous.Offer, offer("s1", attempt=0))
    newer = await kv.call(kv.rendezvous.Offer, offer("s1", blocks=(10, 11, 12), attempt=1))
    assert newer.state.attempt == 1
    await dec.wait(lambda evs: any(e.type == Ev.TYPE_CANCELLED for e in evs))
    [ev] = dec.of(Ev.TYPE_CANCELLED)
    assert ev.transfer.attempt == 0 and "superseded" in ev.transfer.reason and list(ev.transfer.offer.block_ids) == [1, 2, 3]
    for call in (kv.call(kv.rendezvous.Complete, complete("s1", attempt=0)), kv.call(kv.rendezvous.Offer, offer("s1", attempt=0))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "superseded by attempt 1" in err.value.details()
    m = await kv.call(kv.rendezvous.Complete, complete("s1", attempt=1))
    assert m.matched_now and list(m.state.offer.block_ids) == [10, 11, 12]
    await dec.close()


async def test_outcomes_finish_transfer_and_decode_learns(kv, engines):
    dec = Collector(kv, "dec", 0)
    await asyncio.wait_for(dec.ready.wait(), 5)
    await kv.call(kv.rendezvous.Offer, offer("o1"))
    await kv.call(kv.rendezvous.Complete, complete("o1", writers=2))

    def out(rank, ok=True):
        return pb.ReportOutcomeRequest(transfer_id="o1", outcome=pb.Outcome(engine_id="pre", tp_rank=rank, success=ok,
                                                                            bytes=1000))

    s1 = await kv.call(kv.rendezvous.ReportOutcome, out(0))
    assert s1.phase == pb.TRANSFER_PHASE_MATCHED
    s1b = await kv.call(kv.rendezvous.ReportOutcome, out(0))  # duplicate
    assert len(s1b.outcomes) == 1
    s2 = await kv.call(kv.rendezvous.ReportOutcome, out(1))
    assert s2.phase == pb.TRANSFER_PHASE_SUCCEEDED
    await dec.wait(lambda evs: any(e.type == Ev.TYPE_DONE for e in evs))
    assert dec.of(Ev.TYPE_DONE)[0].transfer.phase == pb.TRANSFER_PHASE_SUCCEEDED
    # A failing rank fails the transfer at once.
    await kv.call(kv.rendezvous.Offer, offer("o2"))
    await kv.call(kv.rendezvous.Complete, complete("o2", writers=2))
    f = await kv.call(kv.rendezvous.ReportOutcome, pb.ReportOutcomeRequest(transfer_id="o2", outcome=pb.Outcome(
        engine_id="pre", tp_rank=1, success=False, error="NIXL_ERR_REMOTE_DISCONNECT")))
    assert f.phase == pb.TRANSFER_PHASE_FAILED and "NIXL_ERR_REMOTE_DISCONNECT" in f.reason
    await dec.close()


async def test_match_without_outcome_fails_within_match_timeout(kv, engines):
    dec = Collector(kv, "dec", 0)
    await asyncio.wait_for(dec.ready.wait(), 5)
    await kv.call(kv.rendezvous.Offer, offer("m1"))
    await kv.call(kv.rendezvous.Complete, complete("m1"))
    await dec.wait(lambda evs: any(e.type == Ev.TYPE_DONE for e in evs), timeout=6)  # match timeout is 2 s here
    assert dec.of(Ev.TYPE_DONE)[0].transfer.phase == pb.TRANSFER_PHASE_FAILED
    await dec.close()


async def test_cancel_rules(kv, engines):
    pre = Collector(kv, "pre", 0)
    await asyncio.wait_for(pre.ready.wait(), 5)
    await kv.call(kv.rendezvous.Complete, complete("x1"))
    st = await kv.call(kv.rendezvous.Cancel, pb.CancelRequest(transfer_id="x1", engine_id="pre", reason="preempted"))
    assert st.phase == pb.TRANSFER_PHASE_CANCELLED
    await pre.wait(lambda evs: any(e.type == Ev.TYPE_CANCELLED for e in evs))
    # Decode may not cancel a matched transfer: the writer may be writing into its blocks.
    await kv.call(kv.rendezvous.Offer, offer("x2"))
    await kv.call(kv.rendezvous.Complete, complete("x2"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.rendezvous.Cancel, pb.CancelRequest(transfer_id="x2", engine_id="dec"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "writer may be writing" in err.value.details()
    st = await kv.call(kv.rendezvous.Cancel, pb.CancelRequest(transfer_id="x2", engine_id="pre", reason="won't write"))
    assert st.phase == pb.TRANSFER_PHASE_CANCELLED
    listed = await kv.call(kv.rendezvous.ListTransfers, pb.ListTransfersRequest(phases=[pb.TRANSFER_PHASE_CANCELLED]))
    assert {t.transfer_id for t in listed.transfers} == {"x1", "x2"}
    await pre.close()


async def test_subscriber_that_reconnects_gets_pending_match(kv, engines):
    await kv.call(kv.rendezvous.Offer, offer("r1"))
    await kv.call(kv.rendezvous.Complete, complete("r1"))
    late = Collector(kv, "pre", 1)  # subscribes after the match was made
    await late.wait(lambda evs: len(evs) >= 1)
    assert late.of(Ev.TYPE_MATCH)[0].transfer.transfer_id == "r1"
    await late.close()


@pytest.mark.parametrize("req, words", [
    (offer(""), "transfer_id is required"),
    (offer("t", blocks=()), "block_ids is empty"),
    (offer("t", blocks=range(70_000)), "limit is 65536"),
    (offer("t", blocks=(1, 1)), "duplicate"),
    (offer("t", timeout_ms=10_000_000), "timeout_ms"),
    (offer("t", engine=""), "decode_engine_id is required"),
    (offer("t" * 300), "limit is 256"),
])
async def test_bad_offers(kv, engines, req, words):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.rendezvous.Offer, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    assert not (await kv.call(kv.rendezvous.ListTransfers, pb.ListTransfersRequest())).transfers


async def test_unknown_engine_and_block_count_mismatch(kv, engines):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.rendezvous.Offer, offer("u1", engine="ghost"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "ghost" in err.value.details()
    await kv.call(kv.rendezvous.Offer, offer("u2", blocks=(1, 2)))
    r = await kv.call(kv.rendezvous.Complete, complete("u2", blocks=(1, 2, 3)))
    assert r.state.phase == pb.TRANSFER_PHASE_FAILED and "mismatch" in r.state.reason


async def test_pending_transfers_are_bounded(kv, engines, plane):
    plane.rendezvous.config.max_pending = 3
    for i in range(3):
        await kv.call(kv.rendezvous.Offer, offer(f"b{i}"))
    with pytest.raises(grpc.aio.AioRpcError) as err:  # (a raw stub: kv.call would wait for a slot)
        await kv.rendezvous.Offer(offer("b3"), timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit 3" in err.value.details()
    # Existing transfers still progress and free their slot.
    done = await kv.call(kv.rendezvous.Complete, complete("b0", blocks=(4, 5, 6)))
    assert done.matched_now
    await kv.call(kv.rendezvous.Cancel, pb.CancelRequest(transfer_id="b0", engine_id="pre"))
    assert (await kv.call(kv.rendezvous.Offer, offer("b3"))).state.phase == pb.TRANSFER_PHASE_OFFERED


async def test_quiet_subscribe_stream_gets_heartbeats_busy_one_does_not(kv, engines, monkeypatch):
    """Heartbeats come from the hub's idle timer: one per quiet interval, none between
    events that keep coming faster than that."""
    import kvbaton.services.api.rendezvous as api

    monkeypatch.setattr(api, "HEARTBEAT_S", 0.25)
    seen: list[Ev] = []
    got = asyncio.Event()

    async def read():
        async for ev in kv.subscribe("pre", 0, heartbeats=True):
            seen.append(ev)
            got.set()

    task = asyncio.ensure_future(read())
    try:
        async def until(pred):
            while not pred():
                got.clear()
                await got.wait()
        # The first heartbeat (stream start) and at least two idle ones.
        await asyncio.wait_for(until(lambda: sum(e.type == Ev.TYPE_HEARTBEAT for e in seen) >= 3), 5)
        start = len(seen)
        for i in range(20):  # 20 matches, one every 20 ms: never idle for 250 ms (a stall on this shared box may let one through)
            await kv.call(kv.rendezvous.Offer, offer(f"hb{i}"))
            await kv.call(kv.rendezvous.Complete, complete(f"hb{i}"))
            await asyncio.sleep(0.02)
        await asyncio.wait_for(until(lambda: sum(e.type == Ev.TYPE_MATCH for e in seen) >= 20), 5)
        busy = seen[start:]
        matches = [i for i, e in enumerate(busy) if e.type == Ev.TYPE_MATCH]
        between = busy[matches[0]:matches[-1]]
        assert sum(e.type == Ev.TYPE_HEARTBEAT for e in between) <= 3, [Ev.Type.Name(e.type) for e in between]
        assert all(e.revision for e in seen if e.type == Ev.TYPE_HEARTBEAT)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_second_side_finds_the_first_in_the_cache_one_write_each(kv, engines, plane, store_kind):
    """The replica caches the side it has just written (write-through), so the other side
    arriving before the watch brought the first back makes one compare-and-swap, not a
    lost one against a stale cache and another (one store round trip more per match)."""
    registry = plane.metrics.registry

    def txns() -> float:
        return registry.get_sample_value("kvbaton_store_operation_seconds_count",
                                         {"op": "txn", "backend": store_kind}) or 0.0

    dom = plane.rendezvous
    await kv.call(kv.rendezvous.Offer, offer("warm"))  # engine lookups cached
    await kv.call(kv.rendezvous.Complete, complete("warm"))
    before = txns()
    first = dom.validate(is_offer=True, transfer_id="wt1", attempt=0, engine_id="dec", block_ids=[1, 2, 3],
                         num_tokens=48, timeout_ms=0, request_id="")
    second = dom.validate(is_offer=False, transfer_id="wt1", attempt=0, engine_id="pre", block_ids=[7, 8, 9],
                          num_tokens=48, timeout_ms=0, request_id="", writers=2)
    await dom.submit(first)
    state, matched, duplicate = await dom.submit(second)
    assert matched and not duplicate and state.phase == pb.TRANSFER_PHASE_MATCHED
    assert txns() - before == 2
