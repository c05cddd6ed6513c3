"""One client, several streams (the connector's: session, subscribe, renewals): when one of
them moves the client to the next replica, the others' calls on the old channel are
cancelled by its close. Each stream must re-open on the new channel, not end for good (a
dead session answered every later call "no answer on the session within 10 s"). Unary
calls in flight are sent again on the new channel, and the engine's registration keeper
goes on: it ended there once, and its engine's registration lapsed for good (the fleet
e2e's "a router sees one prefill of two")."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvbaton.client import KvbatonClient
from kvbaton.connector.control import ControlThread
from kvbaton.services.server import ControlPlane
from kvbaton.services.store.memory import MemoryStore
from kvbaton.v1 import common_pb2, lease_pb2
from kvbaton.v1 import registrar_pb2 as rgpb
from kvbaton.v1 import rendezvous_pb2 as rpb
from tests.services.conftest import fast_config
from tests.services.helpers import Gate, engine_rank, register


@pytest.fixture
async def kv():
    cp = ControlPlane(fast_config(), store=MemoryStore())
    await cp.start()
    # The same replica twice: reconnect() moves to "the next" (a new channel) and closes
    # the old one under whatever streams it carries, as a failover does.
    client = KvbatonClient([cp.address, cp.address], timeout_s=1)
    try:
        await register(client, "dec", common_pb2.ENGINE_ROLE_DECODE, ttl_ms=600_000)
        yield client
    finally:
        await client.close()
        await cp.stop()


async def test_session_survives_another_stream_moving_the_client(kv):
    first = await kv.session.offer(rpb.OfferRequest(transfer_id="t1", decode_engine_id="dec", block_ids=[1]))
    assert first.state.offer.engine_id == "dec"
    old = kv.channel
    await kv.reconnect()  # what a subscription's or a unary call's failure does
    assert kv.channel is not old
    # Answered on the new channel, well inside the call's own deadline (2 x timeout_s).
    second = await asyncio.wait_for(
        kv.session.offer(rpb.OfferRequest(transfer_id="t2", decode_engine_id="dec", block_ids=[1])), 1.5)
    assert second.state.offer.engine_id == "dec"
    assert kv.session.reconnects == 1


async def test_renewals_survive_another_stream_moving_the_client(kv):
    await kv.call(kv.lease.Grant, lease_pb2.GrantRequest(conversation_id="c", engine_id="dec", ttl_ms=60_000))
    assert (await kv.renew("c")).status == lease_pb2.RENEW_STATUS_OK
    await kv.reconnect()
    assert (await asyncio.wait_for(kv.renew("c"), 1.5)).status == lease_pb2.RENEW_STATUS_OK


# --- unary calls, and the connector's registration keeper (README "A fleet", Discovery) ----


@pytest.mark.parametrize("retries", [3, 0])
async def test_a_call_in_flight_when_another_stream_moves_the_client_is_sent_again(plane, retries):
    """Closing the old channel cancels the unary calls on it too, and gRPC raises
    ``CancelledError`` in their callers: ``KvbatonClient.call`` used to let it out, so the
    caller's task ended as if cancelled (the connector's registration keeper among them).
    The call is sent again on the new channel instead, as after UNAVAILABLE; a call allowed
    no retry fails UNAVAILABLE, an error its caller handles, not a cancellation."""
    client = KvbatonClient([plane.address, plane.address], timeout_s=3)
    gate = Gate(plane.registrar.get_engine)
    plane.registrar.get_engine = gate
    try:
        await register(client, "dec", common_pb2.ENGINE_ROLE_DECODE, ttl_ms=60_000)
        call = asyncio.create_task(client.call(client.registrar.GetEngine, rgpb.GetEngineRequest(engine_id="dec"),
                                               retries=retries))
        await asyncio.wait_for(gate.arrived.wait(), 5)
        await client.reconnect()  # what another stream's or call's UNAVAILABLE does
        gate.release.set()
        if retries:
            resp = await asyncio.wait_for(call, 5)
            assert [r.engine_id for r in resp.ranks] == ["dec"]
            assert gate.calls == 2  # the cancelled one and its resend on the new channel
        else:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(call, 5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "moved to another replica" in err.value.details()
            assert gate.calls == 1
    finally:
        await client.close()


async def test_the_registration_keeper_survives_an_unexpected_error(plane):
    """Anything but its own cancellation or a refusal of the registration itself
    (INVALID_ARGUMENT) is logged and retried: a keeper that ends leaves the engine
    unregistered for good one TTL later, with nothing in its log to say why."""
    gate = Gate(plane.registrar.refresh_engine, hold=0)
    plane.registrar.refresh_engine = gate
    control = ControlThread(plane.address, timeout_s=3)
    real_call, failed = control.client.call, []

    async def failing_once(method, request, **kw):
        if isinstance(request, rgpb.RefreshEngineRequest) and not failed:
            failed.append(request)
            raise RuntimeError("an error the keeper did not expect")
        return await real_call(method, request, **kw)

    control.client.call = failing_once  # type: ignore[method-assign]
    try:
        keeper = control.register_rank(engine_rank("p1", common_pb2.ENGINE_ROLE_PREFILL), ttl_ms=1_000)
        await gate.wait_calls(3, timeout_s=15)  # refreshes reach the server after the failure
        assert failed and not keeper.done()
    finally:
        control.close()
