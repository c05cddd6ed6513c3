"""A network partition between one service replica and etcd (through proxies we control).

Replica A reaches the 3-member etcd cluster only through proxies; replica B directly.
While A is cut off: calls to A fail within their deadline (no hang), A gives up any
leadership it held (B takes expiry over), a lease renewed through B never expires, and a
lease nobody renews still expires on time. After healing, A serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from kvbaton.client import KvbatonClient, LeaseKeeper
from kvbaton.stack.etcd_cluster import find_etcd
from kvbaton.v1 import common_pb2, lease_pb2, registrar_pb2
from tests.failover.helpers import Replica
from tests.harness.tcp_proxy import TcpProxy
from tests.services.helpers import engine_rank

pytestmark = [pytest.mark.etcd, pytest.mark.skipif(find_etcd() is None, reason="etcd not installed")]


async def test_partition_from_etcd_fails_fast_hands_over_and_keeps_leases(cluster):
    from kvbaton.services.store.etcd import EtcdStore

    s = await EtcdStore.connect(cluster.endpoints)
    await s.delete(b"kvb/", prefix=True)
    await s.close()
    proxies = [TcpProxy(*ep.rsplit(":", 1)[0:1], int(ep.rsplit(":", 1)[1])) for ep in cluster.endpoints]
    a = Replica("etcd://" + ",".join(p.endpoint for p in proxies))
    await a.ready()
    await asyncio.sleep(1.0)  # A starts first: it likely holds the expiry leadership
    b = Replica(cluster.url)
    kva = KvbatonClient(a.address, timeout_s=3)
    # B is the healthy replica: its client need not fail fast (A's does, asserted below).
    # With 3 s (a renewal then gives up after 6 s), one run of services+failover failed at
    # the keeper's first renewal through B; see stalled() for what to look at if it recurs.
    kvb = KvbatonClient(b.address, timeout_s=10)

    def stalled() -> str:
        """What B and etcd said (a store stall shows as slow fdatasync / leader changes)."""
        members = "\n".join(f"-- etcd member {i}:\n{cluster.log_tail(i, 8)}" for i in range(len(cluster.members)))
        return f"-- replica B:\n{b.log_tail()}\n{members}"

    try:
        await b.ready()
        await kvb.call(kvb.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(
            rank=engine_rank("dec", common_pb2.ENGINE_ROLE_DECODE), ttl_ms=300_000))
        for conv, ttl in (("kept", 2000), ("idle", 2000)):
            await kvb.call(kvb.lease.Grant, lease_pb2.GrantRequest(conversation_id=conv, engine_id="dec", ttl_ms=ttl))
        async with contextlib.AsyncExitStack() as stack:
            try:
                keeper = await stack.enter_async_context(LeaseKeeper(kvb, "kept", interval_s=0.4))
            except Exception as exc:
                raise AssertionError(f"the keeper's first renewal through B failed: {exc!r}\n{stalled()}") from exc
            for p in proxies:
                p.partition()
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await kva.registrar.ListEngines(registrar_pb2.ListEnginesRequest(), timeout=12)
            failed_after = time.monotonic() - t0
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            assert failed_after < 12.5
            # Whoever leads expiry now, the unrenewed lease still ends, and the kept one doesn't.
            deadline = time.monotonic() + 20
            while (await kvb.call(kvb.lease.Get, lease_pb2.GetLeaseRequest(conversation_id="idle"))).state \
                    != lease_pb2.LEASE_STATE_EXPIRED:
                assert time.monotonic() < deadline, "nobody expired the idle lease during the partition"
                await asyncio.sleep(0.2)
            kept = await kvb.call(kvb.lease.Get, lease_pb2.GetLeaseRequest(conversation_id="kept"))
            assert kept.state == lease_pb2.LEASE_STATE_ACTIVE, kept
            for p in proxies:
                p.heal()
            deadline = time.monotonic() + 30
            while True:
                try:
                    listed = await kva.registrar.ListEngines(registrar_pb2.ListEnginesRequest(), timeout=3)
                    break
                except grpc.aio.AioRpcError:
                    assert time.monotonic() < deadline, "replica A did not recover after the partition healed"
                    await asyncio.sleep(0.5)
            assert [r.engine_id for r in listed.ranks] == ["dec"]
            assert keeper.failures == 0
        kept = await kvb.call(kvb.lease.Get, lease_pb2.GetLeaseRequest(conversation_id="kept"))
        assert kept.state == lease_pb2.LEASE_STATE_ACTIVE  # never expired early
    finally:
        await kva.close()
        await kvb.close()
        a.stop()
        b.stop()
        for p in proxies:
            p.close()
