"""What the per-match cuts of issue 17 change, held in place (memory store, the domain
directly): the watch caches the record its writer serialized instead of parsing it back,
and a live MATCH event carries the revision of the write that made it (as a replayed one
does), not the previous write's."""

from __future__ import annotations

import asyncio

from kvbaton.services.domain.clock import ManualClock
from kvbaton.services.domain.rendezvous import RendezvousService, SideMessage
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import rendezvous_pb2 as pb


def _side(is_offer: bool, tid: str, engine: str) -> SideMessage:
    return SideMessage(is_offer=is_offer, transfer_id=tid, attempt=1, engine_id=engine, block_ids=[1, 2],
                       num_tokens=32, timeout_ms=5_000, request_id=tid, match_in_answer=False)


async def test_the_watch_caches_the_record_its_writer_wrote_without_parsing_it_again():
    store = MemoryStore()
    svc = RendezvousService(store, clock=ManualClock())
    await svc.start(run_sweeper=False)
    try:
        offered, _, _ = await svc.submit(_side(True, "t1", "dec"))
        matched, now, _ = await svc.submit(_side(False, "t1", "pre"))
        assert now and matched.phase == pb.TRANSFER_PHASE_MATCHED
        assert await svc.hub.wait_for(matched.revision)
        # After the watch applied both writes, the cache holds the very record submit
        # returned (a parse of the stored bytes would be another object).
        assert svc.hub.records[svc._key("t1")][0] is matched
        assert (await svc.get("t1")).offer.block_ids == [1, 2]
        assert offered.revision < matched.revision
    finally:
        await svc.stop()
        await store.close()


async def test_a_live_match_event_carries_its_own_revision():
    store = MemoryStore()
    svc = RendezvousService(store, clock=ManualClock())
    await svc.start(run_sweeper=False)
    events: list[pb.RendezvousEvent] = []
    got = asyncio.Event()

    async def follow() -> None:
        async for ev in svc.subscribe("pre", 0):
            if ev is not None and ev.type == pb.RendezvousEvent.TYPE_MATCH:
                events.append(ev)
                if len(events) == 3:
                    got.set()

    task = asyncio.get_running_loop().create_task(follow())
    try:
        await asyncio.sleep(0)  # subscribed before the writes
        for tid in ("a", "b", "c"):
            await svc.submit(_side(True, tid, "dec"))
            await svc.submit(_side(False, tid, "pre"))
        await asyncio.wait_for(got.wait(), 5)
        assert [e.transfer.transfer_id for e in events] == ["a", "b", "c"]
        assert all(e.transfer.revision == e.revision > 0 for e in events)
        # The event is a copy: the cached record it came from is unchanged by the stream.
        assert svc.hub.records[svc._key("a")][0].transfer_id == "a"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await svc.stop()
        await store.close()
