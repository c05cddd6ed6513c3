"""The renewal journal (one store record per KeepAlive flush, ``lease_journal``): lease
semantics with a manual clock, on the real in-memory store and on real etcd — a replica
taking over reads the journal and never expires a lease early, a batch never renews a
lease that ended, an expiry never ends a lease whose renewal it has not seen, and records
that say nothing any more are deleted."""

from __future__ import annotations

import pytest

from kvbaton.services.domain import lease_journal
from kvbaton.services.domain.clock import ManualClock
from kvbaton.services.domain.lease import LeaseConfig, LeaseService
from kvbaton.v1 import lease_pb2 as pb

TTL = 10_000


async def replica(store, clock) -> LeaseService:
    svc = LeaseService(store, clock=clock, config=LeaseConfig(default_ttl_ms=TTL, max_slack_ms=1_000))
    await svc.start(run_expiry=False)
    return svc


async def newest(svc: LeaseService, prefix: bytes) -> int:
    kvs, _ = await svc.store.range(svc.prefix + prefix)
    return max((kv.mod_revision for kv in kvs), default=0)


async def settle(*svcs: LeaseService) -> None:
    """Every replica's lease and journal views hold what the store holds (each hub only
    sees the revisions of its own prefix, so each waits for its newest key)."""
    leases, journal = await newest(svcs[0], b"l/"), await newest(svcs[0], b"j/")
    for svc in svcs:
        assert await svc.hub.wait_for(leases) and await svc.journal_hub.wait_for(journal)


async def collected(*svcs: LeaseService) -> None:
    """After ``collect_journal``: its delete is the store's newest revision."""
    rev = await svcs[0].store.current_revision()
    for svc in svcs:
        assert await svc.journal_hub.wait_for(rev)


async def journal_keys(svc: LeaseService) -> list[bytes]:
    kvs, _ = await svc.store.range(svc.prefix + b"j/")
    return [kv.key for kv in kvs]


@pytest.fixture
async def two(store):
    clock = ManualClock()
    a, b = await replica(store, clock), await replica(store, clock)
    yield a, b, clock
    await a.stop()
    await b.stop()


def test_encoding_round_trips_and_rejects_garbage():
    ids = ["00ff00ff00ff00ff", "1234567890abcdef"]
    batch = lease_journal.decode(lease_journal.encode(ids, [1, 1_700_000_000_123]))
    assert batch.ids == ids and list(batch.deadlines) == [1, 1_700_000_000_123]
    assert lease_journal.decode(b"no separator").ids == []
    assert lease_journal.decode(b"a\nb\0" + b"\1" * 8).ids == []  # 2 ids, 1 deadline


async def test_a_keepalive_batch_is_one_store_record(two):
    a, b, clock = two
    granted = [(await a.grant(f"c{i}", "dec"))[0] for i in range(300)]
    await settle(a, b)
    clock.advance(3_000)  # past the slack: every renewal needs a write
    res = await a.keepalive([pb.RenewRequest(conversation_id=g.conversation_id) for g in granted])
    now = clock.now_ms()
    assert all(r.status == pb.RENEW_STATUS_OK and r.lease.expires_at_ms >= now + TTL for r in res)
    assert a.stats["journal_writes"] == 1 and a.stats["renewal_writes"] == 300
    assert len(await journal_keys(a)) == 1
    # The lease records themselves were not rewritten: their deadline stays conservative.
    rec = pb.LeaseInfo.FromString((await a.store.get(a._lkey(granted[0].lease_id))).value)
    assert rec.expires_at_ms == granted[0].expires_at_ms < now + TTL
    # Within the slack now: no write at all.
    clock.advance(500)
    res = await a.keepalive([pb.RenewRequest(conversation_id=g.conversation_id) for g in granted])
    assert all(r.status == pb.RENEW_STATUS_OK for r in res) and a.stats["journal_writes"] == 1
    # Every reader merges the journal: Get and List on the other replica.
    await settle(a, b)
    got = await b.get("c7")
    assert got.expires_at_ms == res[7].lease.expires_at_ms and got.remaining_ms > TTL - 1_000
    listed = await b.list(expiring_within_ms=TTL // 2)
    assert listed == []  # all renewed beyond half a TTL, although the records say otherwise


async def test_takeover_reads_the_journal_and_never_expires_early(store):
    clock = ManualClock()
    a = await replica(store, clock)
    info, _ = await a.grant("conv", "dec")
    clock.advance(TTL - 100)
    (res,) = await a.keepalive([pb.RenewRequest(conversation_id="conv")])
    promised = res.lease.expires_at_ms
    assert promised >= clock.now_ms() + TTL
    await a.stop()  # the replica that renewed is gone
    b = await replica(store, clock)  # a restart / the replica taking over
    try:
        clock.advance(200)  # past the record's own deadline, well inside the renewal
        assert await b.expire_due() == 0
        assert (await b.get("conv")).state == pb.LEASE_STATE_ACTIVE
        assert (await b.get("conv")).expires_at_ms == promised
        clock.advance(promised - clock.now_ms())  # exactly the promised deadline: now it ends
        assert await b.expire_due() == 1
        ended = await b.get("conv")
        assert ended.state == pb.LEASE_STATE_EXPIRED and ended.expires_at_ms == promised
    finally:
        await b.stop()


async def test_a_batch_never_renews_a_lease_that_ended_meanwhile(two, store_kind):
    a, b, clock = two
    info, _ = await a.grant("conv", "dec")
    await settle(a, b)
    clock.advance(3_000)
    # b revokes the lease; a's cache has not seen it yet when a's batch is written.
    kv = await b.store.get(b._lkey(info.lease_id))
    ops = await b._end_ops(pb.LeaseInfo.FromString(kv.value), pb.LEASE_STATE_REVOKED, "gone", clock.now_ms())
    assert (await b.store.txn([], ops)).succeeded
    stale, rest = await a._flush_journal([(info.lease_id, clock.now_ms() + TTL)])
    assert (stale or {lid for lid, _ in rest}) == {info.lease_id}  # not journaled: ended, or left to a CAS
    if store_kind == "memory":
        assert a.stats["fence_conflicts"] == 1  # the "ends" fence refused the first attempt
    assert await journal_keys(a) == []
    # Through the flusher (the per-lease fallback included): refused, not acknowledged.
    assert await a._enqueue_writes([(info.lease_id, clock.now_ms() + TTL)]) == {info.lease_id}
    (res,) = await a.keepalive([pb.RenewRequest(conversation_id="conv", lease_id=info.lease_id)])
    assert res.status == pb.RENEW_STATUS_ENDED


async def test_expiry_never_ends_a_lease_renewed_behind_its_view(two, store_kind):
    a, b, clock = two
    info, _ = await a.grant("conv", "dec")
    await settle(a, b)
    clock.advance(TTL - 10)
    deadline = clock.now_ms() + TTL
    stale, rest = await a._flush_journal([(info.lease_id, deadline)])  # acknowledged by a
    assert not stale and not rest
    clock.advance(20)  # past the record's deadline; b may not have the journal record yet
    assert await b.expire_due() == 0
    if store_kind == "memory":
        assert b.stats["fence_conflicts"] == 1  # the "renewals" fence refused the end
    await settle(a, b)
    assert (await b.get("conv")).expires_at_ms == deadline
    assert await b.expire_due() == 0  # re-armed on the journal's deadline
    clock.advance(deadline - clock.now_ms())
    assert await b.expire_due() == 1


async def test_expiry_fences_on_the_view_it_judged_with(two, store_kind):
    """The race behind a flake of the test above on etcd: b judges the lease due on a
    journal view without the renewal, the renewal reaches b's view while b prepares the
    end (an await), and the end must still be refused: the fence carries the revision of
    the view the judgement was made on, not the newer one."""
    a, b, clock = two
    info, _ = await a.grant("conv", "dec")
    await settle(a, b)
    clock.advance(TTL - 10)
    deadline = clock.now_ms() + TTL
    judged_on = b.journal_hub.revision
    assert await a._flush_journal([(info.lease_id, deadline)]) == (set(), [])
    written = await newest(a, b"j/")
    prepare = b._end_ops

    async def end_ops_after_the_renewal_arrives(*args, **kwargs):
        assert await b.journal_hub.wait_for(written)  # the view moves on mid-decision
        return await prepare(*args, **kwargs)

    b._end_ops = end_ops_after_the_renewal_arrives
    clock.advance(20)
    if b.journal_hub.revision == judged_on:  # (etcd may deliver it before the tick: nothing to race)
        assert await b.expire_due() == 0
        assert b.stats["fence_conflicts"] == 1
    b._end_ops = prepare
    await settle(a, b)
    got = await b.get("conv")
    assert got.state == pb.LEASE_STATE_ACTIVE and got.expires_at_ms == deadline
    assert await b.expire_due() == 0


async def test_answers_and_the_cli_say_when_a_deadline_comes_from_the_journal(two):
    """An operator reading `kvbaton leases` sees that a lease was renewed since its record
    was written (its RENEWALS count does not include journaled renewals); the flag is
    never stored."""
    from kvbaton.cli import _lease_rows

    a, b, clock = two
    info, _ = await a.grant("conv", "dec")
    assert not info.deadline_journaled and _lease_rows([info])[0][7] == "0"
    clock.advance(2_000)
    (res,) = await a.keepalive([pb.RenewRequest(conversation_id="conv")])
    assert res.status == pb.RENEW_STATUS_OK and res.lease.deadline_journaled
    await settle(a, b)
    for svc in (a, b):
        got = await svc.get("conv")
        assert got.deadline_journaled and got.expires_at_ms == res.lease.expires_at_ms > info.expires_at_ms
        (listed,) = await svc.list()
        assert listed.deadline_journaled and _lease_rows([listed])[0][7] == "0+journal"
    stored = pb.LeaseInfo.FromString((await a.store.get(a._lkey(info.lease_id))).value)
    assert not stored.deadline_journaled and stored.expires_at_ms == info.expires_at_ms


async def test_records_that_say_nothing_are_deleted(two):
    a, b, clock = two
    for i in range(50):
        await a.grant(f"c{i}", "dec")
    await settle(a, b)
    batch = [pb.RenewRequest(conversation_id=f"c{i}") for i in range(50)]
    clock.advance(3_000)
    await a.keepalive(batch)
    first = await journal_keys(a)
    clock.advance(3_000)
    await a.keepalive(batch)  # supersedes every entry of the first record
    await settle(a, b)
    assert len(await journal_keys(a)) == 2
    assert await b.collect_journal() == 1
    await collected(a, b)
    left = await journal_keys(a)
    assert len(left) == 1 and left != first
    for i in range(50):
        await a.revoke(f"c{i}")  # ended leases: their entries say nothing either
    await settle(a, b)
    assert await b.collect_journal() == 1
    await collected(a, b)
    assert await journal_keys(a) == [] and len(b.journal) == 0 and not b.journal.deadline


async def test_a_record_past_its_latest_deadline_is_deleted(two):
    a, b, clock = two
    info, _ = await a.grant("conv", "dec", ttl_ms=5_000)
    await settle(a, b)
    clock.advance(2_000)
    await a.keepalive([pb.RenewRequest(conversation_id="conv")])
    await settle(a, b)
    a.hub.listeners.clear()  # a's cache stops following: it will never see the lease end
    b.hub.listeners.clear()
    assert await b.collect_journal() == 0  # the entry is the lease's latest and still ahead
    clock.advance(10_000)
    assert await b.collect_journal() == 1  # every deadline in it is past
    await collected(a, b)
    assert await journal_keys(a) == []


def test_journal_view_counts_what_each_record_still_holds():
    """The merge alone: a record is deletable once every entry is superseded or ended,
    and deleting it never lowers a deadline a newer record (or a write-through) holds."""
    j = lease_journal.LeaseJournal()
    j.apply_put(b"r1", lease_journal.decode(lease_journal.encode(["a", "b"], [100, 100])), 1)
    j.apply_put(b"r2", lease_journal.decode(lease_journal.encode(["a"], [200])), 2)
    assert j.deadline == {"a": 200, "b": 100} and j.dead == set()
    j.apply_put(b"r3", lease_journal.decode(lease_journal.encode(["a"], [150])), 3)  # older news
    assert j.deadline["a"] == 200 and j.dead == {b"r3"}
    j.forget("b")  # b ended: r1 now holds nothing
    assert j.dead == {b"r1", b"r3"} and "b" not in j.deadline
    j.note(["a"], [300])  # this replica's own write, before the watch brings it
    j.apply_delete(b"r2")  # r2 deleted (past): a keeps the later write-through deadline
    assert j.deadline["a"] == 300
    assert sorted(j.deletable(0, 10)) == [b"r1", b"r3"]
    for key in (b"r1", b"r3"):
        j.apply_delete(key)
    assert len(j) == 0 and j.dead == set()
    # A record whose lease already ended (per a lease cache as new as it) owns nothing.
    j.apply_put(b"r4", lease_journal.decode(lease_journal.encode(["gone"], [500])), 4, ended=set)
    assert j.dead == {b"r4"} and "gone" not in j.deadline


def test_deleting_a_superseded_record_leaves_its_successor_whole():
    """The usual deletion (a batch wholly superseded by the next batch of the same
    renewals) touches no entry: the successor keeps every lease's deadline and ownership;
    deleting a record that still owns entries drops exactly those."""
    j = lease_journal.LeaseJournal()
    j.apply_put(b"r1", lease_journal.decode(lease_journal.encode(["a", "b"], [100, 100])), 1)
    j.apply_put(b"r2", lease_journal.decode(lease_journal.encode(["a", "b"], [200, 200])), 2)
    assert j.dead == {b"r1"}
    j.apply_delete(b"r1")
    assert j.deadline == {"a": 200, "b": 200} and j.dead == set() and len(j) == 1
    j.forget("a")
    assert j.dead == set()  # r2 still holds b's latest deadline
    j.apply_delete(b"r2")
    assert j.deadline == {} and len(j) == 0 and j.dead == set()


async def test_a_large_flush_is_one_record_per_chunk(two, monkeypatch):
    a, b, clock = two
    monkeypatch.setattr(lease_journal, "MAX_ENTRIES", 100)  # etcd: 1.5 MiB a request
    for i in range(250):
        await a.grant(f"c{i}", "dec")
    await settle(a, b)
    clock.advance(3_000)
    res = await a.keepalive([pb.RenewRequest(conversation_id=f"c{i}") for i in range(250)])
    assert all(r.status == pb.RENEW_STATUS_OK for r in res)
    assert a.stats["journal_writes"] == 3 and len(await journal_keys(a)) == 3
    await settle(a, b)
    for i in (0, 150, 249):
        assert (await b.get(f"c{i}")).expires_at_ms == res[i].lease.expires_at_ms
