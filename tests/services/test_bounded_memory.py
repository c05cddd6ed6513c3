"""Bounded memory: the store's history in bytes, watches and subscribers that fall behind,
and clients that never read their streams (a real server process, its RSS measured)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys

import grpc
import pytest

from kvbaton.client import KvbatonClient
from kvbaton.services.domain.hub import SUBSCRIBER_BYTES, SubscriberOverflow
from kvbaton.services.domain.lease import LeaseService
from kvbaton.services.store import CompactedError, MemoryStore, StoreError
from kvbaton.stack.ports import free_port
from kvbaton.v1 import lease_pb2, rendezvous_pb2

MiB = 1024 * 1024


async def test_history_is_bounded_in_bytes_and_old_revisions_are_compacted():
    store = MemoryStore(history_bytes=16 * MiB)
    try:
        first = await store.put(b"kvb/reg/e/big", b"a" * MiB)
        for i in range(150):  # 150 re-registrations of a 1 MiB engine record
            await store.put(b"kvb/reg/e/big", bytes([i % 256]) * MiB)
        assert store._history_size <= 16 * MiB + 3 * MiB
        with pytest.raises(CompactedError):
            await store.watch(b"kvb/", start_revision=first)
        recent = store._revision - 2
        w = await store.watch(b"kvb/", start_revision=recent)
        batch = await asyncio.wait_for(w.__aiter__().__anext__(), 2)
        assert batch[0].revision == recent
        await w.close()
    finally:
        await store.close()


async def test_a_watch_that_is_not_read_ends_instead_of_growing():
    store = MemoryStore(watch_bytes=8 * MiB)
    try:
        w = await store.watch(b"kvb/")
        for i in range(40):
            await store.put(f"kvb/x{i}".encode(), b"v" * MiB)
        assert w._bytes <= 8 * MiB
        with pytest.raises(StoreError, match="fell behind"):
            async for _ in w:
                pass
    finally:
        await store.close()


async def test_a_lease_watcher_that_does_not_read_is_cut_off_at_its_byte_bound():
    store = MemoryStore()
    svc = LeaseService(store)
    await svc.start(run_expiry=False)
    try:
        events = svc.watch("")
        first = asyncio.ensure_future(events.__anext__())
        while not svc.hub._subs:
            await asyncio.sleep(0.01)
        await svc.grant("c-0", "dec")
        await asyncio.wait_for(first, 2)  # subscribed; from here on it never reads
        labels = {f"k{i}": "v" * 200 for i in range(30)}  # ~6 KB per event
        for i in range(1, 3_000):
            await svc.grant(f"c-{i}", "dec", labels=labels)
        subs = [s for group in svc.hub._subs.values() for s in group]
        assert subs and all(s.bytes <= SUBSCRIBER_BYTES for s in subs)
        assert any(s.overflowed for s in subs)
        with pytest.raises(SubscriberOverflow):
            async for _ in events:
                pass
    finally:
        await svc.stop()
        await store.close()


# -- clients that never read, against a real server process ---------------------------

def _rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
async def server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvbaton.cli", "serve", "--insecure", "--listen", f"127.0.0.1:{port}",
                             "--log-level", "WARNING"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kv = KvbatonClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        await kv.wait_ready(30)
        yield proc, kv
    finally:
        await kv.close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


async def _write_until_blocked(call, make, *, messages: int, stall_s: float = 3.0) -> int:
    """Writes up to ``messages`` requests; returns how many went out before a write stalled."""
    for i in range(messages):
        try:
            await asyncio.wait_for(call.write(make(i)), stall_s)
        except TimeoutError:
            return i
    return messages


async def test_a_session_client_that_never_reads_cannot_grow_server_memory(server):
    proc, kv = server
    await asyncio.sleep(1.0)
    base = _rss_mib(proc.pid)
    call = kv.rendezvous.Session()
    # Calls with no body: each is answered INVALID_ARGUMENT (no state kept), so all that
    # could grow is the answers the client never takes.
    batch = rendezvous_pb2.SessionRequest(calls=[rendezvous_pb2.SessionCall(seq=i) for i in range(1_000)])
    sent = await _write_until_blocked(call, lambda i: batch, messages=3_000)
    grown = _rss_mib(proc.pid) - base
    print(f"never-reading client: {sent} messages written, server RSS +{grown:.1f} MiB")
    call.cancel()
    # Unbounded, 3M answers are ~400 MiB (100 MiB by 1,000 messages before the fix);
    # bounded, the server holds a few MiB and stops reading (how soon the client's writes
    # then stall depends on the client's own gRPC buffers, so that is not asserted).
    assert grown < 64, f"server RSS grew {grown:.0f} MiB for a client that never reads ({sent} messages sent)"


@pytest.mark.parametrize("form", ["renewals", "packed-compact"])
async def test_a_keepalive_client_that_never_reads_cannot_grow_server_memory(server, form):
    """Whatever the message's form: full answers to RenewRequests, or compact answers to
    packed conversation ids (reserved per renewal at the compact answer's size)."""
    proc, kv = server
    for i in range(2_000):
        await kv.lease.Grant(lease_pb2.GrantRequest(conversation_id=f"c{i}", engine_id="dec", ttl_ms=600_000), timeout=10)
    await asyncio.sleep(1.0)
    base = _rss_mib(proc.pid)
    call = kv.lease.KeepAlive()
    convs = [f"c{i}" for i in range(2_000)]
    renewals = [lease_pb2.RenewRequest(conversation_id=c) for c in convs]
    if form == "renewals":
        def message(i):
            return lease_pb2.KeepAliveRequest(seq=i, renewals=renewals)
    else:
        def message(i):
            return lease_pb2.KeepAliveRequest(seq=i, compact=True, conversation_ids=convs)
    sent = await _write_until_blocked(call, message, messages=1_500)
    grown = _rss_mib(proc.pid) - base
    print(f"never-reading client: {sent} messages written, server RSS +{grown:.1f} MiB")
    call.cancel()
    # Unbounded, 1,500 answers of 2,000 renewals are ~350 MiB.
    assert grown < 64, f"server RSS grew {grown:.0f} MiB for a client that never reads ({sent} messages sent)"


async def test_keepalive_store_failure_is_unavailable_with_a_reason(kv, plane):
    """A store error mid-stream ends KeepAlive with UNAVAILABLE and a reason, not UNKNOWN."""
    await kv.lease.Grant(lease_pb2.GrantRequest(conversation_id="c-s", engine_id="dec", ttl_ms=600), timeout=5)
    real = plane.lease.store.txn

    async def failing(*a, **k):
        raise StoreError("etcd member paused (test)")

    plane.lease.store.txn = failing
    try:
        async def one():
            await asyncio.sleep(0.3)  # past the slack: the renewal needs a write
            yield lease_pb2.KeepAliveRequest(seq=1, renewals=[lease_pb2.RenewRequest(conversation_id="c-s")])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in kv.lease.KeepAlive(one(), timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "store unavailable" in err.value.details() and "paused" in err.value.details()
    finally:
        plane.lease.store.txn = real
