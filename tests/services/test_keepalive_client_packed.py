"""The client library's KeepAlive (``KvbatonClient.renew``, what every LeaseKeeper uses)
sends renewals that name only a conversation packed, as
``KeepAliveRequest.conversation_ids``, and still renews everything against a server that
predates the field.

Each test runs against a real server (each store) in one of three shapes: the current
one; one that ignores ``conversation_ids`` (as a server between the compact answer and
packed ids did: the field is unknown to it); one that also ignores ``compact`` (answers
in full). The old shapes are the real servicer with those fields dropped from each
request as it arrives, which is what an older parser does with unknown fields. A spy
records what each message carried on the wire."""

from __future__ import annotations

import asyncio

import pytest

from kvbaton.services.api.lease import LeaseServicer
from kvbaton.services.domain.clock import ManualClock
from kvbaton.services.server import ControlPlane
from kvbaton.v1 import lease_pb2 as pb

from .conftest import fast_config

TTL = 4_000
OK, NOT_FOUND = pb.RENEW_STATUS_OK, pb.RENEW_STATUS_NOT_FOUND


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=["current", "predates-packed", "predates-compact"])
def wire(request, monkeypatch) -> tuple[str, list[tuple[int, int]]]:
    """The server's shape, and (len(renewals), len(conversation_ids)) of every KeepAlive
    message it was sent, as sent."""
    mode, seen = request.param, []
    original = LeaseServicer.KeepAlive

    async def KeepAlive(self, request_iterator, context):
        async def as_received():
            async for req in request_iterator:
                seen.append((len(req.renewals), len(req.conversation_ids)))
                if mode != "current":
                    req.ClearField("conversation_ids")
                if mode == "predates-compact":
                    req.compact = False
                yield req

        async for resp in original(self, as_received(), context):
            yield resp

    monkeypatch.setattr(LeaseServicer, "KeepAlive", KeepAlive)
    return mode, seen


@pytest.fixture
async def plane(store, clock, wire):
    """conftest's plane, started after ``wire`` patched the servicer."""
    cp = ControlPlane(fast_config(), store=store, clock=clock)
    await cp.start()
    yield cp
    await cp.stop()


async def test_renewals_hold_leases_on_every_server_shape(kv, clock, wire):
    mode, seen = wire
    leases = {c: (await kv.call(kv.lease.Grant, pb.GrantRequest(conversation_id=c, engine_id="dec", ttl_ms=TTL))).lease
              for c in ("p1", "p2", "p3")}
    clock.advance(2_000)  # past the slack: every renewal needs a write
    results = await asyncio.gather(kv.renew("p1"), kv.renew("p2"), kv.renew("p3", lease_id=leases["p3"].lease_id),
                                   kv.renew("nope"))
    assert [r.status for r in results] == [OK, OK, OK, NOT_FOUND]
    assert [r.conversation_id for r in results] == ["p1", "p2", "p3", "nope"]
    for conv, res in zip(("p1", "p2", "p3"), results):
        assert res.lease.lease_id == leases[conv].lease_id and res.lease.ttl_ms == TTL
        assert res.lease.expires_at_ms >= clock.now_ms() + TTL
    assert "nope" in results[3].error
    # Renewed for real: past the granted deadline each lease is ACTIVE until the answered one.
    clock.advance(TTL - 1_000)
    for conv, res in zip(("p1", "p2", "p3"), results):
        info = await kv.call(kv.lease.Get, pb.GetLeaseRequest(conversation_id=conv))
        assert info.state == pb.LEASE_STATE_ACTIVE and info.expires_at_ms >= res.lease.expires_at_ms
    renewer = kv._renewer
    spelled, packed = sum(r for r, _ in seen), sum(c for _, c in seen)
    if mode == "current":
        # The three naming only a conversation went packed; the one with a lease id spelled out.
        assert (spelled, packed) == (1, 3) and renewer.fallbacks == 0 and renewer.packed
    else:
        # The first message tried packed ids; the server ignored them, so they went again
        # spelled out, and the stream sends no more packed ids.
        assert packed == 3 and spelled == 4 and renewer.fallbacks == 1 and not renewer.packed
    # The next renewal on the same stream: packed to the current server, spelled out to an old one.
    before = len(seen)
    again = await kv.renew("p1")
    assert again.status == OK and again.lease.expires_at_ms >= clock.now_ms() + TTL
    assert seen[before:] == ([(0, 1)] if mode == "current" else [(1, 0)])


async def test_a_keeper_keeps_its_lease_past_the_ttl_on_an_old_server(kv, clock, wire):
    """A LeaseKeeper, renewing on its own schedule, holds the lease on every shape."""
    from kvbaton.client import LeaseKeeper

    mode, seen = wire
    g = await kv.call(kv.lease.Grant, pb.GrantRequest(conversation_id="k", engine_id="dec", ttl_ms=TTL))
    async with LeaseKeeper(kv, "k", interval_s=0.05) as keeper:
        assert keeper.last is not None and keeper.last.status == OK
        for _ in range(3):  # 1.5 TTL in all: past the granted deadline, only renewals keep it
            clock.advance(TTL // 2)
            renewals = keeper.renewals
            async with asyncio.timeout(10):
                while keeper.renewals < renewals + 2:  # renewed after the step (the keeper's own loop)
                    await asyncio.sleep(0.02)
    assert keeper.lost is None and keeper.last.status == OK
    assert keeper.last.lease.lease_id == g.lease.lease_id
    assert keeper.last.lease.expires_at_ms >= clock.now_ms() + TTL
    info = await kv.call(kv.lease.Get, pb.GetLeaseRequest(conversation_id="k"))
    assert info.state == pb.LEASE_STATE_ACTIVE
    assert all(r == 0 for r, _ in seen) if mode == "current" else seen[-1] == (1, 0)


async def test_every_message_in_flight_is_answered_when_the_server_ignores_packed_ids(kv, clock, wire):
    """2,500 renewals go as messages of up to 1,000, several sent before the first answer
    can say that the server ignores packed ids: every one is answered, none is lost."""
    mode, seen = wire
    convs = [f"m{i}" for i in range(5)]
    for c in convs:
        await kv.call(kv.lease.Grant, pb.GrantRequest(conversation_id=c, engine_id="dec", ttl_ms=TTL))
    clock.advance(2_000)
    results = await asyncio.wait_for(asyncio.gather(*(kv.renew(convs[i % 5]) for i in range(2_500))), 30)
    assert [r.status for r in results] == [OK] * 2_500
    assert [r.conversation_id for r in results] == [convs[i % 5] for i in range(2_500)]
    spelled, packed = sum(r for r, _ in seen), sum(c for _, c in seen)
    if mode == "current":
        assert (spelled, packed) == (0, 2_500) and kv._renewer.fallbacks == 0
    else:
        # What went packed before the first answer (at least its message) went again spelled
        # out, with whatever was queued after: each renewal spelled out exactly once.
        assert spelled == 2_500 and 1_000 <= packed <= 2_500 and kv._renewer.fallbacks == 1
