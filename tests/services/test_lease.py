"""Leases over a real gRPC server: expiry, renewal, KeepAlive, pins, revoke, replace,
watch, list, LeaseKeeper and bad input.

Lease time is a ``ManualClock`` (the ``clock`` fixture below, injected into the plane):
a test passes a TTL by advancing it, never by sleeping it out, and waits for what the
service does in response (the expiry loop, a keeper's renewal) with a bounded wait.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvbaton.client import LeaseKeeper
from kvbaton.services.domain.clock import ManualClock
from kvbaton.v1 import lease_pb2 as pb
from kvbaton.v1 import registrar_pb2

E = pb.LeaseEvent


@pytest.fixture
def clock() -> ManualClock:
    """The plane's clock (overrides tests/services/conftest.py's wall clock)."""
    return ManualClock()


@pytest.fixture(autouse=True)
async def decode_engines(kv):
    """Pins need the lease's decode engine to be alive (registered)."""
    from tests.services.helpers import register

    for eid in ("dec", "dec-w", "e1", "e2"):
        await register(kv, eid)


async def test_pin_refused_when_the_decode_engine_is_gone(kv):
    g = await grant(kv, "c-gone", ttl_ms=60_000)
    await kv.call(kv.registrar.DeregisterEngine, registrar_pb2.DeregisterEngineRequest(engine_id="dec"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.lease.Pin, pb.PinRequest(conversation_id="c-gone", lease_id=g.lease.lease_id, reader="p"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "liveness lapsed" in err.value.details()


async def grant(kv, conv, ttl_ms=600, engine="dec"):
    return await kv.call(kv.lease.Grant, pb.GrantRequest(conversation_id=conv, engine_id=engine, ttl_ms=ttl_ms, num_blocks=4))


async def get(kv, conv):
    return await kv.call(kv.lease.Get, pb.GetLeaseRequest(conversation_id=conv))


async def wait_state(kv, conv, state, timeout=5.0):
    """Until the lease is in ``state`` (the service's expiry loop acts on its own; bounded)."""
    async def loop():
        while (await get(kv, conv)).state != state:
            await asyncio.sleep(0.02)
    await asyncio.wait_for(loop(), timeout)


async def renewed(keeper: LeaseKeeper, after: int, timeout: float = 5.0) -> None:
    """Until ``keeper`` has made a successful renewal beyond its ``after``-th (its own timer
    sends them; bounded)."""
    async def loop():
        while keeper.renewals <= after:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(loop(), timeout)


async def past_deadline(kv, clock: ManualClock, conv: str) -> None:
    """Moves the clock to the lease's deadline (the first instant it is due)."""
    info = await get(kv, conv)
    clock.advance(max(0, info.expires_at_ms - clock.now_ms()))


async def test_expires_without_renewal_but_not_before_its_deadline(kv, plane, clock):
    g = await grant(kv, "c-exp", ttl_ms=500)
    assert g.lease.state == pb.LEASE_STATE_ACTIVE and 0 < g.lease.remaining_ms <= 500
    clock.advance(g.lease.expires_at_ms - clock.now_ms() - 1)  # one millisecond before the deadline
    assert await plane.lease.expire_due() == 0
    assert (await get(kv, "c-exp")).state == pb.LEASE_STATE_ACTIVE
    clock.advance(1)
    await wait_state(kv, "c-exp", pb.LEASE_STATE_EXPIRED)
    info = await get(kv, "c-exp")
    assert info.ended_at_ms >= info.expires_at_ms and "without renewal" in info.reason


async def test_renewal_keeps_lease_alive_past_several_ttls(kv, clock):
    await grant(kv, "c-ren", ttl_ms=1000)
    for _ in range(12):  # 3.6 s = 3.6 TTLs
        clock.advance(300)
        r = await kv.call(kv.lease.Renew, pb.RenewRequest(conversation_id="c-ren"))
        assert r.status == pb.RENEW_STATUS_OK and r.lease.remaining_ms >= 900
    assert (await get(kv, "c-ren")).state == pb.LEASE_STATE_ACTIVE
    await past_deadline(kv, clock, "c-ren")
    await wait_state(kv, "c-ren", pb.LEASE_STATE_EXPIRED)
    r = await kv.call(kv.lease.Renew, pb.RenewRequest(conversation_id="c-ren"))
    assert r.status == pb.RENEW_STATUS_ENDED  # renewing can't bring it back


async def test_keepalive_stream_renews_many_conversations(kv, clock):
    convs = [f"k{i}" for i in range(50)]
    for c in convs:
        await grant(kv, c, ttl_ms=1000)
    answered = asyncio.Queue()  # the stream's answers, in order: each lets the next batch go

    async def requests():
        for seq in range(8):  # 3.2 s, over three TTLs
            yield pb.KeepAliveRequest(seq=seq, renewals=[pb.RenewRequest(conversation_id=c) for c in convs + ["nope"]])
            assert await asyncio.wait_for(answered.get(), 10) == seq
            clock.advance(400)

    seqs = []
    async for resp in kv.lease.KeepAlive(requests()):
        seqs.append(resp.seq)
        answered.put_nowait(resp.seq)
        statuses = [r.status for r in resp.results]
        assert statuses[:-1] == [pb.RENEW_STATUS_OK] * 50 and statuses[-1] == pb.RENEW_STATUS_NOT_FOUND
    assert seqs == list(range(8))
    listed = await kv.call(kv.lease.List, pb.ListLeasesRequest())
    assert {x.conversation_id for x in listed.leases} >= set(convs)


async def test_pin_holds_off_expiry_and_unpin_releases(kv, plane, clock):
    g = await grant(kv, "c-pin", ttl_ms=300)
    pin = await kv.call(kv.lease.Pin, pb.PinRequest(conversation_id="c-pin", lease_id=g.lease.lease_id,
                                                     reader="prefill-0", ttl_ms=2000))
    clock.advance(800)  # well past the TTL
    assert await plane.lease.expire_due() == 0
    info = await get(kv, "c-pin")
    assert info.state == pb.LEASE_STATE_ACTIVE and len(info.pins) == 1
    # Past its deadline: no new pin, even though it is still held.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.lease.Pin, pb.PinRequest(conversation_id="c-pin", lease_id=g.lease.lease_id, reader="p2"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "past its deadline" in err.value.details()
    after = await kv.call(kv.lease.Unpin, pb.UnpinRequest(conversation_id="c-pin", lease_id=g.lease.lease_id,
                                                           pin_id=pin.pin.pin_id))
    assert after.state == pb.LEASE_STATE_EXPIRED


async def test_pin_expires_by_itself(kv, plane, clock):
    g = await grant(kv, "c-pin2", ttl_ms=300)
    pin = await kv.call(kv.lease.Pin, pb.PinRequest(conversation_id="c-pin2", lease_id=g.lease.lease_id, reader="r",
                                                     ttl_ms=2000))
    clock.advance(600)  # past the TTL, well inside the pin
    assert await plane.lease.expire_due() == 0
    assert (await get(kv, "c-pin2")).state == pb.LEASE_STATE_ACTIVE
    clock.advance(pin.pin.expires_at_ms - clock.now_ms())  # the pin lapses
    await wait_state(kv, "c-pin2", pb.LEASE_STATE_EXPIRED, timeout=3)


async def test_pin_refused_after_expiry_and_after_revoke(kv, clock):
    g = await grant(kv, "c-pe", ttl_ms=200)
    clock.advance(200)
    await wait_state(kv, "c-pe", pb.LEASE_STATE_EXPIRED)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.lease.Pin, pb.PinRequest(conversation_id="c-pe", lease_id=g.lease.lease_id, reader="r"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "EXPIRED" in err.value.details()
    g2 = await grant(kv, "c-pr", ttl_ms=5000)
    await kv.call(kv.lease.Revoke, pb.RevokeRequest(conversation_id="c-pr", reason="agent done"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.lease.Pin, pb.PinRequest(conversation_id="c-pr", lease_id=g2.lease.lease_id, reader="r"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "REVOKED" in err.value.details()


async def test_revoke_while_pinned_drains_then_revokes(kv):
    g = await grant(kv, "c-dr", ttl_ms=5000)
    pin = await kv.call(kv.lease.Pin, pb.PinRequest(conversation_id="c-dr", lease_id=g.lease.lease_id, reader="r"))
    info = await kv.call(kv.lease.Revoke, pb.RevokeRequest(conversation_id="c-dr", reason="operator"))
    assert info.state == pb.LEASE_STATE_DRAINING
    after = await kv.call(kv.lease.Unpin, pb.UnpinRequest(conversation_id="c-dr", lease_id=g.lease.lease_id,
                                                           pin_id=pin.pin.pin_id))
    assert after.state == pb.LEASE_STATE_REVOKED and after.reason == "operator"


async def test_regrant_replaces_previous_and_says_so(kv):
    first = await grant(kv, "c-rg", ttl_ms=5000)
    second = await grant(kv, "c-rg", ttl_ms=5000)
    assert second.replaced.lease_id == first.lease.lease_id
    assert second.replaced.state == pb.LEASE_STATE_REVOKED and "replaced by" in second.replaced.reason
    r = await kv.call(kv.lease.Renew, pb.RenewRequest(conversation_id="c-rg", lease_id=first.lease.lease_id))
    assert r.status == pb.RENEW_STATUS_SUPERSEDED
    assert (await get(kv, "c-rg")).lease_id == second.lease.lease_id


async def test_watch_reports_granted_expired_revoked_for_engine(kv, clock):
    events = []

    async def read():
        async for ev in kv.watch_leases("dec-w", snapshot=False):
            events.append((ev.type, ev.lease.conversation_id))
            if len(events) == 4:
                return

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0.3)
    await grant(kv, "w1", ttl_ms=300, engine="dec-w")
    await grant(kv, "w-other", ttl_ms=300, engine="someone-else")
    await grant(kv, "w2", ttl_ms=5000, engine="dec-w")
    await kv.call(kv.lease.Revoke, pb.RevokeRequest(conversation_id="w2"))
    clock.advance(300)  # w1 (and w-other) are due
    await asyncio.wait_for(reader, 5)
    assert sorted(events) == sorted([(E.TYPE_GRANTED, "w1"), (E.TYPE_GRANTED, "w2"), (E.TYPE_REVOKED, "w2"),
                                     (E.TYPE_EXPIRED, "w1")])


async def test_list_filters(kv):
    await grant(kv, "l1", ttl_ms=1000, engine="e1")
    await grant(kv, "l2", ttl_ms=60_000, engine="e1")
    await grant(kv, "l3", ttl_ms=60_000, engine="e2")
    by_engine = await kv.call(kv.lease.List, pb.ListLeasesRequest(engine_id="e1"))
    assert [x.conversation_id for x in by_engine.leases] == ["l1", "l2"]  # soonest first
    soon = await kv.call(kv.lease.List, pb.ListLeasesRequest(expiring_within_ms=5000))
    assert [x.conversation_id for x in soon.leases] == ["l1"]
    await kv.call(kv.lease.Revoke, pb.RevokeRequest(conversation_id="l3"))
    revoked = await kv.call(kv.lease.List, pb.ListLeasesRequest(states=[pb.LEASE_STATE_REVOKED]))
    assert [x.conversation_id for x in revoked.leases] == ["l3"]


async def test_lease_keeper_renews_until_exit_and_release_revokes(kv, clock):
    await grant(kv, "agent-1", ttl_ms=1000)
    async with LeaseKeeper(kv, "agent-1", interval_s=0.05) as keeper:
        for _ in range(7):  # three and a half TTLs, half a TTL after each renewal
            await renewed(keeper, keeper.renewals)
            clock.advance(500)
        assert (await get(kv, "agent-1")).state == pb.LEASE_STATE_ACTIVE
    assert keeper.renewals >= 6
    await past_deadline(kv, clock, "agent-1")
    await wait_state(kv, "agent-1", pb.LEASE_STATE_EXPIRED)
    await grant(kv, "agent-2", ttl_ms=5000)
    async with LeaseKeeper(kv, "agent-2") as keeper:
        info = await keeper.release()
    assert info.state == pb.LEASE_STATE_REVOKED and info.reason == "conversation finished"


@pytest.mark.parametrize("req, words", [
    (pb.GrantRequest(conversation_id="", engine_id="d", ttl_ms=1000), "conversation_id is required"),
    (pb.GrantRequest(conversation_id="c", engine_id="", ttl_ms=1000), "engine_id is required"),
    (pb.GrantRequest(conversation_id="c", engine_id="d", ttl_ms=50), "ttl_ms is 50"),
    (pb.GrantRequest(conversation_id="c", engine_id="d", ttl_ms=4_000_000_000), "ttl_ms"),
    (pb.GrantRequest(conversation_id="c" * 257, engine_id="d", ttl_ms=1000), "limit is 256"),
    (pb.GrantRequest(conversation_id="c d", engine_id="d", ttl_ms=1000), "printable ASCII"),
    # A final newline too (a "$"-anchored pattern let "c\n" through into the store's keys).
    (pb.GrantRequest(conversation_id="c\n", engine_id="d", ttl_ms=1000), "printable ASCII"),
    (pb.GrantRequest(conversation_id="c", engine_id="d\n", ttl_ms=1000), "printable ASCII"),
])
async def test_bad_grants(kv, req, words):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.lease.Grant, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    assert not (await kv.call(kv.lease.List, pb.ListLeasesRequest())).leases


async def test_bad_pins_and_unknowns(kv):
    g = await grant(kv, "c-b", ttl_ms=5000)
    cases = [
        (pb.PinRequest(conversation_id="c-b", lease_id=g.lease.lease_id, reader="r", ttl_ms=120_000), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.PinRequest(conversation_id="c-b", lease_id="0000", reader="r"), grpc.StatusCode.NOT_FOUND),
        (pb.PinRequest(conversation_id="other", lease_id=g.lease.lease_id, reader="r"), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.PinRequest(conversation_id="c-b", lease_id=g.lease.lease_id, reader=""), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for req, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv.call(kv.lease.Pin, req)
        assert err.value.code() == code, (req, err.value.details())
    assert not (await get(kv, "c-b")).pins
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await get(kv, "never")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    r = await kv.call(kv.lease.Renew, pb.RenewRequest(conversation_id="bad id"))
    assert r.status == pb.RENEW_STATUS_INVALID


async def test_live_leases_are_bounded(kv, plane):
    plane.lease.config.max_live_leases = 2
    await grant(kv, "m1", ttl_ms=60_000)
    await grant(kv, "m2", ttl_ms=60_000)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await grant(kv, "m3", ttl_ms=60_000)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit 2" in err.value.details()
    again = await grant(kv, "m1", ttl_ms=60_000)  # a new turn of a live conversation is fine
    assert again.replaced.conversation_id == "m1"
    await kv.call(kv.lease.Revoke, pb.RevokeRequest(conversation_id="m2"))
    assert (await grant(kv, "m3", ttl_ms=60_000)).lease.state == pb.LEASE_STATE_ACTIVE


class _SilentLease:
    """A replica that accepts KeepAlive streams and reads them but never answers (hung
    process, half-open connection): what a client must route around."""

    def __init__(self) -> None:
        self.batches = 0

    async def KeepAlive(self, request_iterator, context):
        async for _ in request_iterator:
            self.batches += 1
        await asyncio.sleep(3600)


async def test_keepalive_routes_around_a_replica_that_never_answers(kv, plane, clock):
    from kvbaton.client import KvbatonClient
    from kvbaton.v1 import lease_pb2_grpc

    silent = _SilentLease()
    server = grpc.aio.server()
    handler = lease_pb2_grpc.add_LeaseServicer_to_server  # generic registration of one method
    servicer = type("S", (lease_pb2_grpc.LeaseServicer,), {"KeepAlive": silent.KeepAlive})()
    handler(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = KvbatonClient([f"127.0.0.1:{port}", plane.address], timeout_s=0.5)
    try:
        await grant(kv, "hung-1", ttl_ms=1500)
        # The first renewal goes to the silent replica: the client must abandon the stuck
        # stream (its 0.5 s timeout) and reach the real replica within the 3 s bound.
        first = asyncio.ensure_future(client.renew("hung-1"))
        result = await asyncio.wait_for(first, 3.0)
        assert result.status == pb.RENEW_STATUS_OK
        assert silent.batches >= 1  # it really went to the silent replica first
        assert client.address == plane.address
        async with LeaseKeeper(client, "hung-1", interval_s=0.3) as keeper:
            for _ in range(6):  # two TTLs of lease time, a third of a TTL after each renewal
                await renewed(keeper, keeper.renewals)
                clock.advance(500)
            assert (await get(kv, "hung-1")).state == pb.LEASE_STATE_ACTIVE
        assert keeper.renewals >= 5
    finally:
        await client.close()
        await server.stop(0)
