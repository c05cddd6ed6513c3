"""The one deadline index that lease expiry and the rendezvous sweeper share."""

from __future__ import annotations

from kvbaton.services.domain.deadlines import DeadlineIndex


def test_pops_only_what_is_due_earliest_first():
    idx: DeadlineIndex[str] = DeadlineIndex()
    idx.arm("b", 20, 1)
    idx.arm("a", 10, 1)
    idx.arm("c", 30, 1)
    assert list(idx.pop_due(9)) == []
    assert list(idx.pop_due(20)) == [("a", 1), ("b", 1)]
    assert len(idx) == 1 and idx.next_due() == 30


def test_a_changed_or_dropped_key_leaves_no_live_entry_behind():
    idx: DeadlineIndex[str] = DeadlineIndex()
    idx.arm("renewed", 10, 1)
    idx.arm("renewed", 50, 2)  # renewed: the entry at 10 is stale now
    idx.arm("ended", 10, 1)
    idx.drop("ended")
    assert list(idx.pop_due(40)) == []
    assert idx.next_due() == 50  # the stale tops were discarded on the way
    assert list(idx.pop_due(50)) == [("renewed", 2)]
    assert len(idx) == 0 and idx.next_due() is None


def test_an_older_version_never_replaces_a_newer_one():
    idx: DeadlineIndex[str] = DeadlineIndex()
    idx.arm("k", 100, 5)
    assert idx.arm("k", 10, 4) is False  # a late re-arm after a store error, say
    assert list(idx.pop_due(99)) == []
    idx.drop("k", version=4)  # the drop of an older version keeps the newer deadline
    assert idx.due_of("k") == 100
    idx.drop("k", version=5)
    assert idx.due_of("k") is None


def test_a_popped_key_can_be_rearmed_and_pops_again():
    idx: DeadlineIndex[str] = DeadlineIndex()
    idx.arm("pinned", 10, 1)
    assert list(idx.pop_due(10)) == [("pinned", 1)]
    assert idx.due_of("pinned") is None  # popped: not armed until the caller re-arms it
    idx.arm("pinned", 25, 1)  # not ready to end (a live pin): same version, later
    assert list(idx.pop_due(24)) == []
    assert list(idx.pop_due(25)) == [("pinned", 1)]


def test_the_heap_stays_bounded_however_often_keys_are_rearmed():
    idx: DeadlineIndex[int] = DeadlineIndex(slack=16)
    for version in range(1, 2_001):
        for key in range(10):
            idx.arm(key, 1_000 + version, version)  # every key renewed 2,000 times
    assert len(idx) == 10
    assert idx.heap_size <= 2 * len(idx) + idx.slack
    for key in range(10):
        idx.drop(key)
    assert idx.heap_size <= idx.slack
    assert list(idx.pop_due(10**9)) == []


def test_rearming_the_same_deadline_adds_no_entry():
    idx: DeadlineIndex[str] = DeadlineIndex()
    for _ in range(100):
        idx.arm("k", 10, 1)
    assert idx.heap_size == 1


async def test_the_rendezvous_index_forgets_ended_transfers_and_expires_the_rest():
    from kvbaton.services.domain.clock import ManualClock
    from kvbaton.services.domain.rendezvous import RendezvousService, SideMessage
    from kvbaton.services.store import MemoryStore
    from kvbaton.v1 import rendezvous_pb2 as pb

    store, clock = MemoryStore(), ManualClock()
    svc = RendezvousService(store, clock=clock)
    await svc.start(run_sweeper=False)
    try:
        def side(is_offer: bool, tid: str, engine: str) -> SideMessage:
            return SideMessage(is_offer=is_offer, transfer_id=tid, attempt=1, engine_id=engine, block_ids=[1, 2],
                               num_tokens=32, timeout_ms=1_000, request_id=tid)

        for i in range(50):  # matched and reported: ended, nothing left to expire
            await svc.submit(side(True, f"done-{i}", "dec"))
            await svc.submit(side(False, f"done-{i}", "pre"))
            await svc.report_outcome(f"done-{i}", 1, pb.Outcome(engine_id="pre", success=True))
        await svc.submit(side(True, "lonely", "dec"))
        await svc.hub.wait_for(await store.current_revision())
        assert len(svc._deadlines) == 1  # only the unmatched offer: ended ones were dropped
        assert svc._deadlines.heap_size <= 2 * len(svc._deadlines) + svc._deadlines.slack
        clock.advance(999)
        assert await svc.sweep() == 0
        clock.advance(1)
        assert await svc.sweep() == 1
        assert (await svc.get("lonely")).phase == pb.TRANSFER_PHASE_EXPIRED
        await svc.hub.wait_for(await store.current_revision())
        assert len(svc._deadlines) == 0
    finally:
        await svc.stop()
        await store.close()


async def test_a_large_sweep_lets_other_work_run():
    """Thousands of transfers falling due at once (a burst that nobody reported on) are ended
    in one sweep; on the memory store no await in it suspends, so without yielding the sweep
    would hold the event loop, and every other call, for its whole length."""
    import asyncio

    from kvbaton.services.domain.clock import ManualClock
    from kvbaton.services.domain.rendezvous import RendezvousService, SideMessage
    from kvbaton.services.store import MemoryStore

    store, clock = MemoryStore(), ManualClock()
    svc = RendezvousService(store, clock=clock)
    await svc.start(run_sweeper=False)
    try:
        n = 600
        for i in range(n):
            await svc.submit(SideMessage(is_offer=True, transfer_id=f"t{i}", attempt=1, engine_id="dec",
                                         block_ids=[1], num_tokens=16, timeout_ms=1_000, request_id=f"t{i}"))
        await svc.hub.wait_for(await store.current_revision())
        clock.advance(1_000)
        sweep = asyncio.ensure_future(svc.sweep())
        turns_during = 0
        while not sweep.done():
            await asyncio.sleep(0)
            turns_during += 1 if not sweep.done() else 0
        assert await sweep == n
        # END_YIELD_EVERY = 128: about four turns; at least two, whatever the store does
        assert turns_during >= n // 256, f"the sweep gave the loop {turns_during} turns while ending {n} transfers"
    finally:
        await svc.stop()
        await store.close()
