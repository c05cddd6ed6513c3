"""A fresh subscription replays its engine's pending matches from a per-engine index of
the cache, not a pass over every cached transfer (which held the server's loop ~30 ms
per Subscribe at 20,000 live transfers: the first transfers of each open-loop point
waited for it). Real server, both stores."""

from __future__ import annotations

from kvbaton.v1 import common_pb2
from kvbaton.v1 import rendezvous_pb2 as pb
from tests.services.helpers import register
from tests.services.test_rendezvous import Collector, complete, offer

Ev = pb.RendezvousEvent


async def test_a_fresh_subscription_replays_only_its_engines_pending_matches(kv, plane):
    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
    await register(kv, "pre-a", common_pb2.ENGINE_ROLE_PREFILL)
    await register(kv, "pre-b", common_pb2.ENGINE_ROLE_PREFILL)
    for i in range(20):
        await kv.call(kv.rendezvous.Offer, offer(f"a{i}"))
        await kv.call(kv.rendezvous.Complete, complete(f"a{i}", writers=1, engine="pre-a"))
    await kv.call(kv.rendezvous.Offer, offer("b0"))
    await kv.call(kv.rendezvous.Complete, complete("b0", writers=1, engine="pre-b"))
    # Ended: no longer replayed, and gone from the index.
    done = await kv.call(kv.rendezvous.ReportOutcome, pb.ReportOutcomeRequest(
        transfer_id="a0", outcome=pb.Outcome(engine_id="pre-a", success=True, bytes=1)))
    assert done.phase == pb.TRANSFER_PHASE_SUCCEEDED and done.revision
    rdv = plane.rendezvous
    assert await rdv.hub.wait_for(done.revision)  # the watch has applied every write above

    late_b = Collector(kv, "pre-b", 0)
    await late_b.wait(lambda evs: len(evs) >= 1)
    late_a = Collector(kv, "pre-a", 0)
    await late_a.wait(lambda evs: len(evs) >= 19)
    try:
        assert [e.transfer.transfer_id for e in late_b.of(Ev.TYPE_MATCH)] == ["b0"]
        replayed = [e.transfer.transfer_id for e in late_a.of(Ev.TYPE_MATCH)]
        assert sorted(replayed) == sorted(f"a{i}" for i in range(1, 20))
        # Each replayed MATCH carries its record's revision (set on the event, not the cache).
        assert all(e.transfer.revision == e.revision > 0 for e in late_a.of(Ev.TYPE_MATCH))
        assert set(rdv._matched_for) == {"pre-a", "pre-b"} and len(rdv._matched_for["pre-a"]) == 19
    finally:
        await late_a.close()
        await late_b.close()
