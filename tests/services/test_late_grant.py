"""A Grant that arrives after the client's Revoke does not outlive it.

Decode registers a finished turn's blocks (``RegisterRetained``) and then leases them
(``Grant``) from its control thread, after the answer left the engine. A client that ends
the conversation in between revokes the *previous* turn's lease. Before this fix the late
Grant then started a fresh lease and decode held the last turn's blocks for a whole TTL
after the client let go (session 21's note). Now the store's revisions order the two: blocks
registered before the revoke are covered by it. Real server, both stores.
"""

from __future__ import annotations

import grpc
import pytest

from kvbaton.v1 import lease_pb2 as lpb
from kvbaton.v1 import registrar_pb2 as rpb

from .helpers import register

DEC = "dec-late"


async def _retain(kv, conv: str, blocks: list[int]) -> str:
    resp = await kv.call(kv.registrar.RegisterRetained, rpb.RegisterRetainedRequest(retained=rpb.RetainedBlocks(
        conversation_id=conv, engine_id=DEC, block_ids=blocks, num_tokens=16 * len(blocks), tokens_per_block=16)))
    return resp.retained.retention_id


async def _grant(kv, conv: str, retention_id: str) -> lpb.LeaseInfo:
    resp = await kv.call(kv.lease.Grant, lpb.GrantRequest(
        conversation_id=conv, engine_id=DEC, ttl_ms=30_000, num_blocks=1, retention_id=retention_id))
    return resp.lease


async def test_a_grant_for_blocks_registered_before_the_revoke_is_refused(kv, plane):
    await register(kv, DEC)
    conv = "late-1"
    turn1 = await _retain(kv, conv, [1])
    await _grant(kv, conv, turn1)
    turn2 = await _retain(kv, conv, [1, 2])    # decode registered turn 2 ...
    await kv.call(kv.lease.Revoke, lpb.RevokeRequest(conversation_id=conv, reason="agent done"))  # ... the client ended it
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _grant(kv, conv, turn2)          # ... and decode's Grant comes last
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "was revoked (agent done) after retention" in (err.value.details() or "")
    lease = await kv.call(kv.lease.Get, lpb.GetLeaseRequest(conversation_id=conv))
    assert lease.state == lpb.LEASE_STATE_REVOKED  # nothing live holds decode's blocks
    assert plane.metrics.lease_late_grants_refused._value.get() == 1


async def test_blocks_registered_after_the_revoke_are_granted(kv):
    """The conversation went on after the revoke: its new turn is leased as usual."""
    await register(kv, DEC)
    conv = "late-2"
    await _grant(kv, conv, await _retain(kv, conv, [1]))
    await kv.call(kv.lease.Revoke, lpb.RevokeRequest(conversation_id=conv))
    lease = await _grant(kv, conv, await _retain(kv, conv, [3, 4]))
    assert lease.state == lpb.LEASE_STATE_ACTIVE


async def test_a_grant_that_replaces_a_live_lease_is_not_a_late_grant(kv):
    """Turn after turn, each Grant replaces the previous lease: never refused."""
    await register(kv, DEC)
    conv = "late-3"
    first = await _grant(kv, conv, await _retain(kv, conv, [1]))
    second = await _grant(kv, conv, await _retain(kv, conv, [1, 2]))
    assert second.state == lpb.LEASE_STATE_ACTIVE and second.lease_id != first.lease_id
    old = await kv.call(kv.lease.Get, lpb.GetLeaseRequest(conversation_id=conv, ))
    assert old.lease_id == second.lease_id


async def test_a_first_grant_after_a_revoke_that_found_no_lease_is_refused(kv, plane):
    """A one-turn conversation ended at once: the revoke finds no lease yet (NOT_FOUND, as
    before) but is remembered, so decode's late first Grant is refused too."""
    await register(kv, DEC)
    conv = "late-4"
    turn1 = await _retain(kv, conv, [1])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.lease.Revoke, lpb.RevokeRequest(conversation_id=conv))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _grant(kv, conv, turn1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "was revoked before its first lease" in (err.value.details() or "")
    assert plane.metrics.lease_late_grants_refused._value.get() == 1
    # the conversation goes on later: a turn registered after the revoke is granted
    lease = await _grant(kv, conv, await _retain(kv, conv, [1, 2]))
    assert lease.state == lpb.LEASE_STATE_ACTIVE


async def test_a_revoke_of_an_unknown_conversation_does_not_block_its_later_turns(kv):
    await register(kv, DEC)
    conv = "late-5"
    with pytest.raises(grpc.aio.AioRpcError):
        await kv.call(kv.lease.Revoke, lpb.RevokeRequest(conversation_id=conv))
    lease = await _grant(kv, conv, await _retain(kv, conv, [1]))
    assert lease.state == lpb.LEASE_STATE_ACTIVE
