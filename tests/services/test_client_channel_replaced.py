"""One client, several streams (the connector's: session, subscribe, renewals): when one of
them moves the client to the next replica, the others' calls on the old channel are
cancelled by its close. Each stream must re-open on the new channel, not end for good (a
dead session answered every later call "no answer on the session within 10 s")."""

from __future__ import annotations

import asyncio

import pytest

from kvbaton.client import KvbatonClient
from kvbaton.services.server import ControlPlane
from kvbaton.services.store.memory import MemoryStore
from kvbaton.v1 import common_pb2, lease_pb2
from kvbaton.v1 import rendezvous_pb2 as rpb
from tests.services.conftest import fast_config
from tests.services.helpers import register


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
