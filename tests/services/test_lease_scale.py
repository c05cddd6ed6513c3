"""Lease expiry driven by the deadline index, and KeepAlive batches answered in one pass:
the domain on the real in-memory store with a manual clock (no sleeps)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvbaton.services.domain.clock import ManualClock
from kvbaton.services.domain.lease import LeaseConfig, LeaseService
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import lease_pb2 as pb


@pytest.fixture
async def leases():
    store = MemoryStore()
    clock = ManualClock()
    svc = LeaseService(store, clock=clock, config=LeaseConfig(default_ttl_ms=10_000))
    await svc.start(run_expiry=False)
    yield svc, clock
    await svc.stop()
    await store.close()


async def settle(svc: LeaseService) -> None:
    await svc.hub.wait_for(await svc.store.current_revision())


async def test_a_tick_with_nothing_due_touches_no_lease(leases):
    svc, clock = leases
    for i in range(2_000):
        await svc.grant(f"c{i}", "dec", ttl_ms=10_000 + i)
    await settle(svc)
    assert len(svc._deadlines) == 2_000
    # Nothing due: the tick is a heap peek, not a scan (2,000 ticks well under a second).
    t0 = time.process_time()
    for _ in range(2_000):
        assert await svc.expire_due() == 0
    assert time.process_time() - t0 < 0.5
    clock.advance(10_000 + 999)  # the first thousand are due, the rest are not
    assert await svc.expire_due() == 1_000
    await settle(svc)
    assert (await svc.get("c999")).state == pb.LEASE_STATE_EXPIRED
    assert (await svc.get("c1000")).state == pb.LEASE_STATE_ACTIVE


async def test_renewed_and_pinned_leases_are_not_ended_by_stale_index_entries(leases):
    svc, clock = leases
    renewed, _ = await svc.grant("c-renewed", "dec", ttl_ms=1_000)
    pinned, _ = await svc.grant("c-pinned", "dec", ttl_ms=1_000)
    draining, _ = await svc.grant("c-draining", "dec", ttl_ms=1_000)
    await svc.pin("c-pinned", pinned.lease_id, "reader", ttl_ms=5_000)
    await svc.pin("c-draining", draining.lease_id, "reader", ttl_ms=3_000)
    await svc.revoke("c-draining", draining.lease_id)
    clock.advance(900)
    assert (await svc.renew("c-renewed", renewed.lease_id)).status == pb.RENEW_STATUS_OK
    await settle(svc)
    clock.advance(200)  # past every original deadline
    assert await svc.expire_due() == 0
    assert (await svc.get("c-renewed")).state == pb.LEASE_STATE_ACTIVE
    assert (await svc.get("c-pinned")).state == pb.LEASE_STATE_ACTIVE
    assert (await svc.get("c-draining")).state == pb.LEASE_STATE_DRAINING
    clock.advance(2_000)  # the drain's pin lapsed, and the renewed deadline (+ slack) passed
    assert await svc.expire_due() == 2
    await settle(svc)
    assert (await svc.get("c-draining")).state == pb.LEASE_STATE_REVOKED
    assert (await svc.get("c-renewed")).state == pb.LEASE_STATE_EXPIRED
    assert (await svc.get("c-pinned")).state == pb.LEASE_STATE_ACTIVE
    clock.advance(2_000)  # the last pin lapsed
    assert await svc.expire_due() == 1
    await settle(svc)
    assert (await svc.get("c-pinned")).state == pb.LEASE_STATE_EXPIRED


async def test_index_stays_bounded_under_many_renewal_writes(leases):
    svc, clock = leases
    for i in range(100):
        await svc.grant(f"c{i}", "dec")
    for _ in range(100):
        clock.advance(1_500)  # every renewal needs a write
        batch = [pb.RenewRequest(conversation_id=f"c{i}") for i in range(100)]
        assert all(r.status == pb.RENEW_STATUS_OK for r in await svc.keepalive(batch))
    await settle(svc)
    assert svc.stats["renewal_writes"] >= 100 * 100
    assert svc._deadlines.heap_size <= 2 * len(svc.hub.records) + svc._deadlines.slack


async def test_keepalive_batch_answers_every_case_in_order(leases):
    svc, clock = leases
    a, _ = await svc.grant("c-a", "dec")
    b, _ = await svc.grant("c-b", "dec")
    old, _ = await svc.grant("c-r", "dec")
    new, _ = await svc.grant("c-r", "dec")
    ended, _ = await svc.grant("c-e", "dec")
    await svc.revoke("c-e")
    await settle(svc)
    clock.advance(2_000)
    batch = [
        pb.RenewRequest(conversation_id="c-a"),
        pb.RenewRequest(conversation_id="c-b", lease_id=b.lease_id, ttl_ms=20_000),
        pb.RenewRequest(conversation_id="c-r", lease_id=old.lease_id),
        pb.RenewRequest(conversation_id="nobody"),
        pb.RenewRequest(conversation_id="c-e", lease_id=ended.lease_id),
        pb.RenewRequest(conversation_id="bad/id"),
        pb.RenewRequest(conversation_id="c-a", lease_id=b.lease_id),  # another conversation's lease
    ]
    res = await svc.keepalive(batch)
    assert [r.conversation_id for r in res] == [r.conversation_id for r in batch]
    assert [r.status for r in res] == [
        pb.RENEW_STATUS_OK, pb.RENEW_STATUS_OK, pb.RENEW_STATUS_SUPERSEDED, pb.RENEW_STATUS_NOT_FOUND,
        pb.RENEW_STATUS_ENDED, pb.RENEW_STATUS_INVALID, pb.RENEW_STATUS_NOT_FOUND,
    ]
    now = clock.now_ms()
    assert res[0].lease.lease_id == a.lease_id and res[0].lease.expires_at_ms >= now + 10_000
    assert res[1].lease.expires_at_ms >= now + 20_000
    assert res[2].lease.lease_id == new.lease_id
    # The promise is in the store (the renewal journal), not only in this replica's
    # cache: another replica starting on the same store reads it.
    other = LeaseService(svc.store, clock=clock, config=svc.config)
    await other.start(run_expiry=False)
    try:
        assert (await other.get("c-a")).expires_at_ms >= now + 10_000
        assert (await other.get("c-b")).expires_at_ms >= now + 20_000
    finally:
        await other.stop()


async def test_keepalive_is_rate_limited_per_renewal_not_per_message():
    import grpc

    from kvbaton.client import KvbatonClient
    from kvbaton.services.server import ControlPlane
    from tests.services.conftest import fast_config

    cp = ControlPlane(fast_config(rate_limit=1_000.0), store=MemoryStore())
    await cp.start()
    kv = KvbatonClient(cp.address, timeout_s=5)
    try:
        for i in range(200):
            await kv.lease.Grant(pb.GrantRequest(conversation_id=f"c{i}", engine_id="dec", ttl_ms=60_000), timeout=5)
        await asyncio.sleep(0.3)  # the bucket refills after the grants
        renewals = [pb.RenewRequest(conversation_id=f"c{i % 200}") for i in range(1_000)]

        async def two_big_messages():
            yield pb.KeepAliveRequest(seq=1, renewals=renewals)
            yield pb.KeepAliveRequest(seq=2, renewals=renewals)

        seen = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for resp in kv.lease.KeepAlive(two_big_messages(), timeout=10):
                seen.append((resp.seq, len(resp.results)))
        # 1,000 renewals spend the whole bucket: the second message (1,000 more within
        # milliseconds) is over 1,000 renewals/s although it is only the second message.
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "renewals/s" in err.value.details()
        assert seen in ([], [(1, 1_000)])
    finally:
        await kv.close()
        await cp.stop()


async def test_keepalive_batches_share_one_group_commit_and_stale_leases_take_the_slow_path(leases):
    svc, clock = leases
    for i in range(300):
        await svc.grant(f"c{i}", "dec")
    await settle(svc)
    clock.advance(1_500)  # every renewal needs a write
    # c0 is revoked after the batch is answered from the cache but before its write lands:
    # its write is stale (compare fails), so the slow path answers ENDED, not OK.
    first = asyncio.ensure_future(svc.keepalive([pb.RenewRequest(conversation_id=f"c{i}") for i in range(150)]))
    second = asyncio.ensure_future(svc.keepalive([pb.RenewRequest(conversation_id=f"c{i}") for i in range(150, 300)]))
    await asyncio.sleep(0)  # both batches queued their writes; the flusher has not run yet
    assert len(svc._groups) == 2 and len(set(svc._pending_ids)) == 300
    await svc.revoke("c0")
    txns = svc.metrics.lease_renewal_txns._value.get()
    a, b = await asyncio.gather(first, second)
    assert a[0].status == pb.RENEW_STATUS_ENDED
    assert all(r.status == pb.RENEW_STATUS_OK for r in a[1:] + b)
    now = clock.now_ms()
    assert all(r.lease.expires_at_ms >= now + 10_000 for r in a[1:] + b)
    # 300 writes as a handful of transactions (flush_batch each), not one per renewal.
    written = svc.metrics.lease_renewal_txns._value.get() - txns
    assert written <= 300 // svc.config.flush_batch + 2
    assert not svc._groups and not svc._pending_ids and not svc.hub.preparsed


async def test_a_burst_of_expiries_lets_other_work_run(leases):
    """600 leases due in one tick (agents gone together): the tick ends them all, and the
    loop gets turns meanwhile (on the memory store nothing in ending one suspends)."""
    svc, clock = leases
    for i in range(600):
        await svc.grant(f"b{i}", "dec", ttl_ms=10_000)
    await settle(svc)
    clock.advance(10_001)
    tick = asyncio.ensure_future(svc.expire_due())
    turns = 0
    while not tick.done():
        await asyncio.sleep(0)
        turns += 0 if tick.done() else 1
    assert await tick == 600
    assert turns >= 2, f"the expiry tick gave the loop {turns} turns while ending 600 leases"
