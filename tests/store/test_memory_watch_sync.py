"""``MemoryStore.watch_sync``: a watch's events handed to a callback inside the write that
makes them (what the rendezvous hub uses to skip a task wake-up per write), in revision
order, history first; a callback that raises does not fail the committed write, it ends
the watch with ``StoreError``; and a ``PrefixHub(sync=True)`` is never behind a write of
its own process once that write returns."""

from __future__ import annotations

import asyncio

import pytest

from kvbaton.services.domain.hub import PrefixHub
from kvbaton.services.store import MemoryStore, StoreError
from kvbaton.services.store.base import Delete, Put


async def test_events_reach_the_callback_inside_the_write_in_revision_order_history_first():
    store = MemoryStore()
    try:
        first = await store.put(b"a/0", b"old")
        await store.put(b"b/0", b"other prefix")
        seen: list[tuple[bytes, int, bytes | None]] = []

        def deliver(batch):
            seen.extend((e.kv.key, e.revision, e.prev_kv.value if e.prev_kv else None) for e in batch)

        w = await store.watch_sync(b"a/", deliver, start_revision=first, prev_kv=True)
        assert seen == [(b"a/0", first, None)]  # the history from start_revision, before it returned
        rev = await store.put(b"a/0", b"new")
        assert seen[-1] == (b"a/0", rev, b"old")  # already there when put() returned
        await store.txn((), (Put(b"a/1", b"x"), Put(b"b/1", b"y")))
        await store.txn((), (Delete(b"a/1"),))
        assert [k for k, _, _ in seen] == [b"a/0", b"a/0", b"a/1", b"a/1"]
        revs = [r for _, r, _ in seen]
        assert revs == sorted(revs)
        # Nothing goes through the queue: iterating waits until the watch ends.
        it = aiter(w)
        nxt = asyncio.ensure_future(anext(it))
        await asyncio.sleep(0.01)
        assert not nxt.done()
        await w.close()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(nxt, 5)
        await store.put(b"a/2", b"after close")
        assert seen[-1][0] != b"a/2"
    finally:
        await store.close()


async def test_a_failing_callback_keeps_the_write_and_ends_the_watch_with_store_error():
    store = MemoryStore()
    try:
        calls = []

        def deliver(batch):
            calls.append(batch)
            raise RuntimeError("listener bug")

        w = await store.watch_sync(b"k/", deliver)
        rev = await store.put(b"k/1", b"v")  # does not raise: the write is committed
        assert (await store.get(b"k/1")).mod_revision == rev
        with pytest.raises(StoreError, match="callback failed"):
            async for _ in w:
                pass
        await store.put(b"k/2", b"v")
        assert len(calls) == 1  # ended: no more deliveries
    finally:
        await store.close()


async def test_a_sync_hub_applies_its_process_writes_before_they_return_and_falls_back_elsewhere():
    store = MemoryStore()
    try:
        hub: PrefixHub[bytes, tuple] = PrefixHub(store, b"p/", parse=lambda v: v, derive=lambda ev: [("r", ev.kv.value)],
                                                 sync=True)
        await hub.start()
        await asyncio.sleep(0)  # its watch task establishes the watch
        sub = hub.subscribe("r")
        got = asyncio.ensure_future(anext(sub))
        await asyncio.sleep(0)
        rev = await store.put(b"p/x", b"1")
        assert hub.records[b"p/x"] == (b"1", rev) and hub.revision == rev  # no loop turn needed
        assert await asyncio.wait_for(got, 5) == (rev, b"1")
        await sub.aclose()
        await hub.stop()

        # A store without watch_sync: the same hub over the ordinary watch.
        class Plain:
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                if name == "watch_sync":
                    raise AttributeError(name)
                return getattr(self.inner, name)

        plain: PrefixHub[bytes, tuple] = PrefixHub(Plain(store), b"p/", parse=lambda v: v,  # type: ignore[arg-type]
                                                   derive=lambda ev: (), sync=True)
        await plain.start()
        rev = await store.put(b"p/y", b"2")
        assert await plain.wait_for(rev, 5) and plain.records[b"p/y"] == (b"2", rev)
        await plain.stop()
    finally:
        await store.close()
