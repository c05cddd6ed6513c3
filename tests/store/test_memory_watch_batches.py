"""The memory store hands a watch's reader every write queued since it last ran as one
batch, in revision order (one pass of the reader's loop for them, as one etcd watch
response carries several revisions), and a one-key write reaches only the watches whose
prefix it is under."""

from __future__ import annotations

import asyncio

from kvbaton.services.store import MemoryStore, StoreError
from kvbaton.services.store.base import Delete, Put


async def test_writes_queued_before_the_reader_runs_come_as_one_batch_in_order():
    store = MemoryStore()
    try:
        w = await store.watch(b"a/", prev_kv=True)
        other = await store.watch(b"b/")
        for i in range(5):
            await store.put(f"a/{i}".encode(), b"v%d" % i)
        await store.txn((), (Put(b"a/x", b"1"), Put(b"b/x", b"2")))  # one txn, two prefixes
        await store.txn((), (Delete(b"a/0"),))
        it = aiter(w)
        batch = await asyncio.wait_for(anext(it), 5)
        assert [e.kv.key for e in batch] == [b"a/0", b"a/1", b"a/2", b"a/3", b"a/4", b"a/x", b"a/0"]
        revs = [e.revision for e in batch]
        assert revs == sorted(revs) and len(set(revs)) == 7  # one revision per txn
        assert batch[-1].prev_kv is not None and batch[-1].prev_kv.value == b"v0"
        # Nothing more is queued: the next read waits for the next write.
        nxt = asyncio.ensure_future(anext(it))
        await asyncio.sleep(0.01)
        assert not nxt.done()
        await store.put(b"a/late", b"z")
        assert [e.kv.key for e in await asyncio.wait_for(nxt, 5)] == [b"a/late"]
        # The other prefix saw only its own key.
        assert [e.kv.key for e in await asyncio.wait_for(anext(aiter(other)), 5)] == [b"b/x"]
        await w.close()
        await other.close()
    finally:
        await store.close()


async def test_a_watch_closed_or_overflowed_behind_queued_writes_still_delivers_them_first():
    store = MemoryStore(watch_bytes=10_000)
    try:
        w = await store.watch(b"k/")
        await store.put(b"k/1", b"x")
        await store.put(b"k/2", b"y")
        await w.close()
        seen = [e.kv.key async for batch in w for e in batch]
        assert seen == [b"k/1", b"k/2"]  # then the watch ended

        slow = await store.watch(b"s/")
        await store.put(b"s/0", b"x" * 100)
        for i in range(200):  # past watch_bytes while nobody reads: the watch is ended
            await store.put(b"s/%d" % i, b"x" * 100)
        try:
            async for _ in slow:
                pass
            raise AssertionError("an overflowed watch must end with StoreError")
        except StoreError as exc:
            assert "fell behind" in str(exc)
    finally:
        await store.close()
