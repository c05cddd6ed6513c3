"""The etcd backend across member failure, on a 3-member cluster.

The point: a watch whose member dies must resume elsewhere from the last delivered
revision (no lost events, no duplicates), the shared keepalive stream must re-open and
keep leases alive, and a restarted member must rejoin and serve current data.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

from kvbaton.services.store import EventType, StoreError, WatchEvent
from kvbaton.services.store.etcd import EtcdStore
from kvbaton.stack.etcd_cluster import EtcdCluster, find_etcd

from .conftest import NO_ETCD

pytestmark = pytest.mark.etcd


@pytest.fixture(scope="module")
def cluster3() -> Iterator[EtcdCluster]:
    if find_etcd() is None:
        pytest.skip(NO_ETCD)
    c = EtcdCluster(3).start()
    try:
        yield c
    finally:
        c.stop()


def _sig(events: list[WatchEvent]) -> list[tuple[int, bytes, EventType, bytes]]:
    return [(e.revision, e.kv.key, e.type, e.kv.value) for e in events]


async def test_kill_watched_member_no_loss_no_dup(cluster3: EtcdCluster) -> None:
    ns = f"fo/{uuid.uuid4().hex[:8]}/".encode()
    watcher = await EtcdStore.connect(cluster3.endpoints, timeout_s=10)
    victim = cluster3.index_of(watcher.current_endpoint)
    writer = await EtcdStore.connect([e for i, e in enumerate(cluster3.endpoints) if i != victim], timeout_s=10)
    try:
        lease = await watcher.grant_lease(2)
        await watcher.put(ns + b"alive", b"1", lease=lease)
        start = await writer.current_revision() + 1
        w = await watcher.watch(ns, prev_kv=True)

        got: list[WatchEvent] = []
        progressed = asyncio.Event()

        async def consume() -> None:
            async for batch in w:
                got.extend(batch)
                progressed.set()

        keepalive_errors: list[str] = []

        async def keep() -> None:
            while True:
                try:
                    await watcher.keepalive(lease)
                except StoreError as e:
                    keepalive_errors.append(str(e))
                await asyncio.sleep(0.4)

        write_retries = 0
        n = 300

        async def write() -> None:
            nonlocal write_retries
            for i in range(n):
                while True:
                    try:
                        await writer.put(ns + b"k/%04d" % i, b"%d" % i)
                        break
                    except StoreError:
                        write_retries += 1  # outcome unknown: re-put (a second event is fine)
                        await asyncio.sleep(0.05)
                if i == n // 3:
                    cluster3.kill_member(victim)
                await asyncio.sleep(0.005)

        tasks = [asyncio.ensure_future(consume()), asyncio.ensure_future(keep())]
        t0 = time.monotonic()
        await asyncio.wait_for(write(), 60)
        write_s = time.monotonic() - t0
        final = await writer.current_revision()
        async with asyncio.timeout(20):
            while not got or got[-1].revision < final:
                progressed.clear()
                await progressed.wait()
        assert w.reconnects >= 1  # type: ignore[attr-defined]
        assert watcher.current_endpoint != cluster3.endpoints[victim]

        ref_w = await writer.watch(ns, start_revision=start, prev_kv=True)
        ref: list[WatchEvent] = []
        async with asyncio.timeout(10):
            async for batch in ref_w:
                ref.extend(batch)
                if ref[-1].revision >= final:
                    break
        await ref_w.close()
        assert _sig(got) == _sig(ref)  # nothing lost, nothing twice, same order
        assert len({e.revision for e in got}) == len(got)
        assert {e.kv.key for e in got} == {ns + b"k/%04d" % i for i in range(n)}

        # The lease lived through the outage on the shared keepalive stream.
        assert await watcher.get(ns + b"alive") is not None, keepalive_errors
        assert await watcher.keepalive(lease) >= 1
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await w.close()
        print(f"\nfailover: {n} writes in {write_s:.2f}s, {write_retries} writer retries, "
              f"{len(keepalive_errors)} keepalive errors, watch reconnects={w.reconnects}")  # type: ignore[attr-defined]

        # The member comes back, catches up and serves linearizable reads.
        cluster3.restart_member(victim)
        only = await EtcdStore.connect([cluster3.endpoints[victim]], timeout_s=10)
        try:
            kvs, rev = await only.range(ns + b"k/")
            assert len(kvs) == n and rev >= final
            assert await only.put(ns + b"after", b"1") > final
        finally:
            await only.close()
        await writer.delete(ns, prefix=True)
        await writer.revoke_lease(lease)
    finally:
        await watcher.close()
        await writer.close()
        for i in range(cluster3.size):
            if not cluster3.members[i].alive:
                cluster3.restart_member(i)


async def test_keepalive_survives_member_kill(cluster3: EtcdCluster) -> None:
    """Several leases share one keepalive stream; its member dies; none of them expires."""
    store = await EtcdStore.connect(cluster3.endpoints, timeout_s=10)
    victim = cluster3.index_of(store.current_endpoint)
    ns = f"ka/{uuid.uuid4().hex[:8]}/".encode()
    try:
        leases = [await store.grant_lease(2) for _ in range(5)]
        for i, lid in enumerate(leases):
            await store.put(ns + b"%d" % i, b"x", lease=lid)
        await asyncio.gather(*(store.keepalive(lid) for lid in leases))
        cluster3.kill_member(victim)
        end = time.monotonic() + 5
        while time.monotonic() < end:
            await asyncio.gather(*(store.keepalive(lid) for lid in leases))
            await asyncio.sleep(0.5)
        kvs, _ = await store.range(ns)
        assert len(kvs) == 5
        for lid in leases:
            await store.revoke_lease(lid)
        assert (await store.range(ns))[0] == []
    finally:
        await store.close()
        cluster3.restart_member(victim)


async def test_unreachable_fails_within_deadline(cluster3: EtcdCluster) -> None:
    cluster3.kill_member(2)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError):
            await EtcdStore.connect([cluster3.endpoints[2]], timeout_s=1.0, attempt_timeout_s=0.5)
        assert time.monotonic() - t0 < 2.5
    finally:
        cluster3.restart_member(2)
