"""The ``Store`` contract, run against every backend (memory and a real etcd).

The memory store is the reference; anything that passes here on one backend and fails on
the other is a semantic difference the domain modules would trip over.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvbaton.services.store import (
    CompactedError,
    Compare,
    CompareOp,
    CompareTarget,
    Delete,
    EventType,
    Get,
    LeaseNotFoundError,
    Put,
    Store,
    Watch,
    WatchEvent,
)
from kvbaton.services.store.election import Election

TTL = 1.0  # etcd's floor with --election-timeout 500


async def next_batch(w: Watch, timeout: float = 5.0) -> list[WatchEvent]:
    it = w.__aiter__()
    return await asyncio.wait_for(it.__anext__(), timeout)


async def collect(w: Watch, n: int, timeout: float = 5.0) -> list[WatchEvent]:
    """The next ``n`` events (across batches)."""
    out: list[WatchEvent] = []
    async with asyncio.timeout(timeout):
        async for batch in w:
            out.extend(batch)
            if len(out) >= n:
                break
    return out


# -- basic key/value ------------------------------------------------------------
async def test_get_put_range_delete(store: Store, ns: bytes) -> None:
    assert await store.get(ns + b"a") is None
    r1 = await store.put(ns + b"a", b"1")
    r2 = await store.put(ns + b"b", b"2")
    r3 = await store.put(ns + b"c/x", b"3")
    assert r1 < r2 < r3
    kv = await store.get(ns + b"a")
    assert kv is not None and kv.value == b"1" and kv.create_revision == kv.mod_revision == r1 and kv.version == 1
    r4 = await store.put(ns + b"a", b"1b")
    kv = await store.get(ns + b"a")
    assert kv is not None and (kv.create_revision, kv.mod_revision, kv.version) == (r1, r4, 2)

    kvs, rev = await store.range(ns)
    assert [k.key for k in kvs] == [ns + b"a", ns + b"b", ns + b"c/x"]
    assert rev == r4 == await store.current_revision()
    kvs, _ = await store.range(ns, limit=2)
    assert [k.key for k in kvs] == [ns + b"a", ns + b"b"]
    kvs, _ = await store.range(ns + b"c/")
    assert [k.value for k in kvs] == [b"3"]

    assert await store.delete(ns + b"missing") == 0
    assert await store.current_revision() == r4  # deleting nothing writes nothing
    res = await store.txn([], [Delete(ns + b"missing"), Delete(ns + b"nothing/", prefix=True)])
    assert res.succeeded and res.revision == r4 == await store.current_revision()
    assert await store.delete(ns + b"b") == 1
    assert await store.delete(ns, prefix=True) == 2
    assert (await store.range(ns))[0] == []


async def test_binary_keys_and_prefix_end(store: Store, ns: bytes) -> None:
    p = ns + b"\xff\xff"
    await store.put(p + b"\x00", b"a")
    await store.put(p + b"\xff", b"b")
    await store.put(ns + b"\xfe", b"outside")
    kvs, _ = await store.range(p)
    assert [k.value for k in kvs] == [b"a", b"b"]
    assert await store.delete(p, prefix=True) == 2
    assert await store.get(ns + b"\xfe") is not None


# -- transactions -----------------------------------------------------------------
@pytest.mark.parametrize(
    "target,operand_ok,operand_bad",
    [
        (CompareTarget.VALUE, b"v1", b"nope"),
        (CompareTarget.VERSION, 1, 2),
        (CompareTarget.CREATE_REVISION, "rev", 0),
        (CompareTarget.MOD_REVISION, "rev", 12345678),
    ],
)
async def test_txn_each_target(store: Store, ns: bytes, target: CompareTarget, operand_ok, operand_bad) -> None:
    k = ns + b"k"
    rev = await store.put(k, b"v1")
    ok = rev if operand_ok == "rev" else operand_ok
    res = await store.txn([Compare(k, target, CompareOp.EQUAL, ok)], [Put(ns + b"s", b"1")], [Put(ns + b"f", b"1")])
    assert res.succeeded and res.revision == rev + 1
    assert await store.get(ns + b"s") is not None and await store.get(ns + b"f") is None
    res = await store.txn([Compare(k, target, CompareOp.EQUAL, operand_bad)], [Put(ns + b"s2", b"1")], [Put(ns + b"f2", b"1")])
    assert not res.succeeded and res.revision == rev + 2
    assert await store.get(ns + b"s2") is None and await store.get(ns + b"f2") is not None
    res = await store.txn([Compare(k, target, CompareOp.NOT_EQUAL, operand_bad)], [], [])
    assert res.succeeded and res.revision == rev + 2  # nothing written: revision unchanged


async def test_txn_ordering_ops(store: Store, ns: bytes) -> None:
    k = ns + b"n"
    await store.put(k, b"5")
    kv = await store.get(k)
    assert kv is not None
    assert (await store.txn([Compare(k, CompareTarget.VERSION, CompareOp.GREATER, 0)], [])).succeeded
    assert (await store.txn([Compare(k, CompareTarget.VERSION, CompareOp.LESS, 2)], [])).succeeded
    assert not (await store.txn([Compare(k, CompareTarget.MOD_REVISION, CompareOp.GREATER, kv.mod_revision)], [])).succeeded
    assert (await store.txn([Compare(k, CompareTarget.VALUE, CompareOp.GREATER, b"4")], [])).succeeded
    assert (await store.txn([Compare(k, CompareTarget.VALUE, CompareOp.LESS, b"6")], [])).succeeded


async def test_txn_get_returns_the_current_value_from_the_branch_that_ran(store: Store, ns: bytes) -> None:
    k, other = ns + b"cas", ns + b"absent"
    first = await store.txn([Compare.absent(k)], [Put(k, b"v1")], [Get(k)])
    assert first.succeeded and first.values == ()  # no Get in the branch that ran
    # A lost compare-and-swap reads the winner's value in the same round trip.
    lost = await store.txn([Compare.absent(k)], [Put(k, b"v2")], [Get(k), Get(other)])
    assert not lost.succeeded and lost.revision == first.revision
    assert len(lost.values) == 2 and lost.values[1] is None
    assert lost.values[0].value == b"v1" and lost.values[0].mod_revision == first.revision
    assert (await store.get(k)).value == b"v1"
    # In a branch that writes, a Get after the Put sees the new value.
    won = await store.txn([Compare.unchanged(lost.values[0], k)], [Put(k, b"v3"), Get(k)])
    assert won.succeeded and won.values[0].value == b"v3" and won.values[0].mod_revision == won.revision


async def test_txn_batched_keeps_each_writes_compare_and_outcome(store: Store, ns: bytes) -> None:
    keys = [ns + b"b%d" % i for i in range(40)]
    results = await asyncio.gather(*(store.txn_batched([Compare.absent(k)], [Put(k, b"x")], [Get(k)]) for k in keys))
    assert all(r.succeeded for r in results)
    for k, r in zip(keys, results):
        assert (await store.get(k)).mod_revision == r.revision  # the revision the write got
    # Racing writes to one key: exactly one wins, the others read the winner's value.
    k = ns + b"race"
    racers = await asyncio.gather(*(store.txn_batched([Compare.absent(k)], [Put(k, b"w%d" % i)], [Get(k)])
                                    for i in range(6)))
    winners = [i for i, r in enumerate(racers) if r.succeeded]
    assert len(winners) == 1
    won = (await store.get(k))
    assert won.value == b"w%d" % winners[0]
    for r in racers:
        if not r.succeeded:
            assert r.values[0] is not None and r.values[0].value == won.value and r.values[0].mod_revision == won.mod_revision
    # A stale compare fails on its own without failing the rest of a batch.
    stale = [store.txn_batched([Compare(keys[0], CompareTarget.MOD_REVISION, CompareOp.EQUAL, 1)], [Put(keys[0], b"no")], [Get(keys[0])])]
    fresh = [store.txn_batched([Compare.unchanged(await store.get(keys[i]), keys[i])], [Put(keys[i], b"y")]) for i in (1, 2)]
    out = await asyncio.gather(*stale, *fresh)
    assert not out[0].succeeded and out[0].values[0].value == b"x"
    assert out[1].succeeded and out[2].succeeded
    assert (await store.get(keys[1])).value == b"y" and (await store.get(keys[0])).value == b"x"


async def test_txn_missing_key(store: Store, ns: bytes) -> None:
    k = ns + b"absent"
    assert (await store.txn([Compare.absent(k)], [])).succeeded
    assert (await store.txn([Compare(k, CompareTarget.VERSION, CompareOp.EQUAL, 0)], [])).succeeded
    assert (await store.txn([Compare(k, CompareTarget.MOD_REVISION, CompareOp.LESS, 1)], [])).succeeded
    # etcd: a VALUE compare on a missing key is false whatever the operator.
    for op in CompareOp:
        assert not (await store.txn([Compare(k, CompareTarget.VALUE, op, b"")], [])).succeeded
    assert (await store.txn([Compare.unchanged(None, k)], [Put(k, b"1")])).succeeded
    assert not (await store.txn([Compare.unchanged(None, k)], [Put(k, b"2")])).succeeded


async def test_txn_atomic_multi_op_one_revision(store: Store, ns: bytes) -> None:
    await store.put(ns + b"old/1", b"x")
    await store.put(ns + b"old/2", b"x")
    w = await store.watch(ns)
    res = await store.txn([], [Put(ns + b"a", b"1"), Put(ns + b"b", b"2"), Delete(ns + b"old/", prefix=True)])
    assert res.succeeded
    events = await collect(w, 4)
    assert {e.revision for e in events} == {res.revision}
    assert sorted((e.type.value, e.kv.key) for e in events) == sorted(
        [("put", ns + b"a"), ("put", ns + b"b"), ("delete", ns + b"old/1"), ("delete", ns + b"old/2")]
    )
    await w.close()


async def test_txn_many_ops(store: Store, ns: bytes) -> None:
    """Above etcd's default --max-txn-ops (128): the test cluster runs with 10000."""
    ops = [Put(ns + b"m/%04d" % i, b"x") for i in range(300)]
    assert (await store.txn([Compare.absent(ns + b"zz")], ops)).succeeded
    assert len((await store.range(ns + b"m/"))[0]) == 300


async def test_put_with_unknown_lease(store: Store, ns: bytes) -> None:
    with pytest.raises(LeaseNotFoundError):
        await store.put(ns + b"x", b"1", lease=0x7FFF_FFFF_0000_0001)
    with pytest.raises(LeaseNotFoundError):
        await store.txn([], [Put(ns + b"x", b"1", lease=0x7FFF_FFFF_0000_0001)])
    assert await store.get(ns + b"x") is None


async def test_concurrent_cas_increments(store: Store, ns: bytes) -> None:
    k = ns + b"counter"
    n = 25

    async def incr() -> int:
        tries = 0
        while True:
            tries += 1
            kv = await store.get(k)
            value = int(kv.value) if kv else 0
            if (await store.txn([Compare.unchanged(kv, k)], [Put(k, str(value + 1).encode())])).succeeded:
                return tries

    tries = await asyncio.gather(*(incr() for _ in range(n)))
    kv = await store.get(k)
    assert kv is not None and int(kv.value) == n and kv.version == n
    assert sum(tries) >= n


# -- leases -----------------------------------------------------------------------
async def test_lease_expiry_deletes_and_emits(store: Store, ns: bytes) -> None:
    lease = await store.grant_lease(TTL)
    await store.put(ns + b"l/1", b"a", lease=lease)
    await store.put(ns + b"l/2", b"b", lease=lease)
    kv = await store.get(ns + b"l/1")
    assert kv is not None and kv.lease == lease
    w = await store.watch(ns + b"l/", prev_kv=True)
    t0 = time.monotonic()
    events = await collect(w, 2, timeout=TTL + 4)
    assert time.monotonic() - t0 >= TTL * 0.8
    assert {(e.type, e.kv.key) for e in events} == {(EventType.DELETE, ns + b"l/1"), (EventType.DELETE, ns + b"l/2")}
    assert {e.prev_kv.value for e in events if e.prev_kv} == {b"a", b"b"}
    assert (await store.range(ns + b"l/"))[0] == []
    with pytest.raises(LeaseNotFoundError):
        await store.keepalive(lease)
    await w.close()


async def test_keepalive_extends(store: Store, ns: bytes) -> None:
    lease = await store.grant_lease(TTL)
    await store.put(ns + b"ka", b"a", lease=lease)
    end = time.monotonic() + 3 * TTL
    while time.monotonic() < end:
        assert await store.keepalive(lease) >= TTL
        await asyncio.sleep(TTL / 3)
    assert await store.get(ns + b"ka") is not None
    await store.revoke_lease(lease)


async def test_concurrent_keepalives_many_leases(store: Store, ns: bytes) -> None:
    leases = await asyncio.gather(*(store.grant_lease(TTL) for _ in range(20)))
    for _ in range(3):
        ttls = await asyncio.gather(*(store.keepalive(lid) for lid in leases for _ in range(3)))
        assert all(t >= TTL for t in ttls)
    await store.revoke_lease(leases[0])
    res = await asyncio.gather(*(store.keepalive(lid) for lid in leases), return_exceptions=True)
    assert isinstance(res[0], LeaseNotFoundError) and all(isinstance(r, float) for r in res[1:])
    await asyncio.gather(*(store.revoke_lease(lid) for lid in leases))


async def test_revoke_deletes(store: Store, ns: bytes) -> None:
    lease = await store.grant_lease(30)
    await store.put(ns + b"r", b"a", lease=lease)
    w = await store.watch(ns)
    await store.revoke_lease(lease)
    [ev] = await next_batch(w)
    assert ev.type is EventType.DELETE and ev.kv.key == ns + b"r"
    assert await store.get(ns + b"r") is None
    await store.revoke_lease(lease)  # already gone: no error
    with pytest.raises(LeaseNotFoundError):
        await store.keepalive(lease)
    await w.close()


# -- watches ----------------------------------------------------------------------
async def test_watch_from_now(store: Store, ns: bytes) -> None:
    await store.put(ns + b"before", b"0")
    w = await store.watch(ns)
    r1 = await store.put(ns + b"a", b"1")
    await store.put(b"elsewhere/" + ns, b"not mine")
    r2 = await store.put(ns + b"a", b"2")
    r3 = await store.delete(ns + b"a")
    events = await collect(w, 3)
    assert [(e.type, e.kv.key, e.kv.value) for e in events] == [
        (EventType.PUT, ns + b"a", b"1"),
        (EventType.PUT, ns + b"a", b"2"),
        (EventType.DELETE, ns + b"a", b""),
    ]
    assert events[0].revision == r1 and events[1].revision == r2 and r3 == 1
    assert events[1].kv.version == 2 and events[1].kv.create_revision == r1
    await w.close()
    await store.delete(b"elsewhere/" + ns)


async def test_watch_from_past_revision_and_prev_kv(store: Store, ns: bytes) -> None:
    r1 = await store.put(ns + b"k", b"1")
    r2 = await store.put(ns + b"k", b"2")
    await store.delete(ns + b"k")
    w = await store.watch(ns, start_revision=r2, prev_kv=True)
    events = await collect(w, 2)
    assert [(e.type, e.revision) for e in events] == [(EventType.PUT, r2), (EventType.DELETE, r2 + 1)]
    assert events[0].prev_kv is not None and events[0].prev_kv.value == b"1" and events[0].prev_kv.mod_revision == r1
    assert events[1].prev_kv is not None and events[1].prev_kv.value == b"2"
    r4 = await store.put(ns + b"k", b"3")  # live events follow the replay, once
    [ev] = await next_batch(w)
    assert ev.revision == r4 and ev.prev_kv is None  # a creation has no previous value
    await w.close()


async def test_watch_from_future_revision(store: Store, ns: bytes) -> None:
    now = await store.current_revision()
    w = await store.watch(ns, start_revision=now + 2)
    await store.put(ns + b"a", b"skipped")
    r = await store.put(ns + b"a", b"seen")
    [ev] = await next_batch(w)
    assert ev.revision == r and ev.kv.value == b"seen"
    await w.close()


async def test_watch_close_ends_iteration(store: Store, ns: bytes) -> None:
    w = await store.watch(ns)
    await w.close()
    async with asyncio.timeout(2):
        assert [b async for b in w] == []


async def test_watch_compacted(store: Store, ns: bytes, backend: str) -> None:
    r1 = await store.put(ns + b"c", b"1")
    if backend == "etcd":
        for i in range(3):
            await store.put(ns + b"c", b"%d" % i)
        await store.compact(await store.current_revision())  # type: ignore[attr-defined]
    else:
        from kvbaton.services.store import memory

        for _ in range(memory._HISTORY + 1):  # push r1 out of the memory store's window
            await store.put(ns + b"c", b"x")
    with pytest.raises(CompactedError) as err:
        w = await store.watch(ns, start_revision=r1)
        await next_batch(w)
    assert err.value.compact_revision > r1


# -- election ---------------------------------------------------------------------
async def test_election_resign_hands_over(store: Store, ns: bytes) -> None:
    name = ns.decode() + "leader"
    e1 = Election(store, name, ttl_s=TTL, identity=b"one")
    e2 = Election(store, name, ttl_s=TTL, identity=b"two")
    await e1.campaign(timeout_s=5)
    assert e1.is_leader and await e1.leader() == b"one"
    c2 = asyncio.ensure_future(e2.campaign(timeout_s=10))
    await asyncio.sleep(3 * TTL)  # e1 keeps the lease alive well past its TTL
    assert not c2.done() and e1.is_leader
    t0 = time.monotonic()
    await e1.resign()
    await asyncio.wait_for(c2, 5)
    assert time.monotonic() - t0 < 1.0  # resign is immediate, no TTL wait
    assert e2.is_leader and not e1.is_leader and await e2.leader() == b"two"
    await e2.resign()
    assert await e2.leader() is None


async def test_election_leader_death_hands_over(store: Store, ns: bytes) -> None:
    name = ns.decode() + "leader"
    e1 = Election(store, name, ttl_s=TTL, identity=b"one")
    e2 = Election(store, name, ttl_s=TTL, identity=b"two")
    await e1.campaign(timeout_s=5)
    c2 = asyncio.ensure_future(e2.campaign(timeout_s=10))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    await e1.abandon()  # crash: no revoke
    await asyncio.wait_for(c2, TTL + 3)
    took = time.monotonic() - t0
    assert TTL * 0.5 <= took <= TTL + 1.5, took  # ~ttl (+ etcd's 0.5 s expiry scan)
    assert e2.is_leader and await e2.leader() == b"two"
    await e2.resign()


async def test_election_lost_when_lease_revoked(store: Store, ns: bytes) -> None:
    lost_calls: list[str] = []
    e = Election(store, ns.decode() + "leader", ttl_s=TTL, on_lost=lambda: lost_calls.append("lost"))
    await e.campaign(timeout_s=5)
    await store.revoke_lease(e.lease_id)  # e.g. an operator, or an expiry during a stall
    await asyncio.wait_for(e.lost.wait(), 3)
    assert not e.is_leader and lost_calls == ["lost"]
    await e.resign()


async def test_election_run_cancels_work_on_loss(store: Store, ns: bytes) -> None:
    e = Election(store, ns.decode() + "leader", ttl_s=TTL)
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    runner = asyncio.ensure_future(e.run(work, timeout_s=5))
    await asyncio.wait_for(started.wait(), 5)
    await store.delete(e.key)  # someone removed the leader key
    assert await asyncio.wait_for(runner, 5) is False
    assert cancelled.is_set()


async def test_a_write_over_the_backends_request_limit_is_refused_not_retried(store: Store, ns: bytes) -> None:
    """Over the backend's own limit (etcd: 1.5 MiB) a write raises RequestTooLargeError at
    once, not StoreError (which callers retry) and not after a round trip."""
    import time

    from kvbaton.services.store import RequestTooLargeError, StoreError

    if not store.max_request_bytes:
        await store.put(ns + b"big", b"x" * (2 * 1024 * 1024))  # no limit of its own
        return
    big = b"x" * (store.max_request_bytes + 1)
    t0 = time.monotonic()
    with pytest.raises(RequestTooLargeError, match="request limit"):
        await store.put(ns + b"big", big)
    with pytest.raises(RequestTooLargeError):
        await store.txn([], [Put(ns + b"big", big)])
    assert time.monotonic() - t0 < 1.0
    assert not issubclass(RequestTooLargeError, StoreError)
    assert await store.get(ns + b"big") is None
