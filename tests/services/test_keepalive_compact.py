"""The compact KeepAlive answer (``KeepAliveRequest.compact``), over a real gRPC server
on each store: a result only for each renewal that was NOT renewed (with its index and
reason), packed lease ids / deadlines / TTLs for the rest — the same facts the full answer
gives, so an agent still learns exactly which leases are gone. Old clients (no
``compact``) keep getting one result per renewal, and the client library reads either
answer (a server that predates the field answers in full)."""

from __future__ import annotations

import asyncio

import pytest

from kvbaton.client import renew_results
from kvbaton.services.domain.clock import ManualClock
from kvbaton.v1 import lease_pb2 as pb

TTL = 4_000


@pytest.fixture
def clock() -> ManualClock:
    """The plane's clock (overrides tests/services/conftest.py's wall clock)."""
    return ManualClock()


async def keepalive(kv, renewals: list[pb.RenewRequest], *, compact: bool, packed: list[str] = ()) -> pb.KeepAliveResponse:
    async def requests():
        yield pb.KeepAliveRequest(seq=7, renewals=renewals, compact=compact, conversation_ids=packed)

    call = kv.lease.KeepAlive(requests())
    try:
        return await asyncio.wait_for(call.read(), 10)
    finally:
        call.cancel()


async def scene(kv) -> tuple[list[pb.RenewRequest], dict[str, pb.LeaseInfo]]:
    """Renewals of every kind: live (some needing a write), unknown, revoked, superseded,
    a bad TTL, a new TTL (the slow path, still OK)."""
    leases = {}
    for conv in ("a", "b", "c", "gone", "old"):
        leases[conv] = (await kv.call(kv.lease.Grant, pb.GrantRequest(conversation_id=conv, engine_id="dec",
                                                                       ttl_ms=TTL))).lease
    await kv.call(kv.lease.Revoke, pb.RevokeRequest(conversation_id="gone", reason="conversation over"))
    first = leases["old"].lease_id
    leases["old"] = (await kv.call(kv.lease.Grant, pb.GrantRequest(conversation_id="old", engine_id="dec",
                                                                    ttl_ms=TTL))).lease
    renewals = [pb.RenewRequest(conversation_id="a"), pb.RenewRequest(conversation_id="nope"),
                pb.RenewRequest(conversation_id="b", lease_id=leases["b"].lease_id),
                pb.RenewRequest(conversation_id="gone"), pb.RenewRequest(conversation_id="old", lease_id=first),
                pb.RenewRequest(conversation_id="c", ttl_ms=TTL * 2), pb.RenewRequest(conversation_id="a", ttl_ms=1),
                pb.RenewRequest(conversation_id="old")]
    return renewals, leases


async def test_compact_answer_says_what_the_full_one_says(kv, clock):
    renewals, leases = await scene(kv)
    clock.advance(2_000)  # past the slack: the live renewals need a write
    compact = await keepalive(kv, renewals, compact=True)
    full = await keepalive(kv, renewals, compact=False)  # at the same clock: the same deadlines
    assert compact.compact and not full.compact and compact.seq == full.seq == 7
    assert len(full.results) == len(renewals) and not full.result_index and not full.lease_ids
    statuses = [r.status for r in full.results]
    ok, nf, ended, sup, bad = (pb.RENEW_STATUS_OK, pb.RENEW_STATUS_NOT_FOUND, pb.RENEW_STATUS_ENDED,
                               pb.RENEW_STATUS_SUPERSEDED, pb.RENEW_STATUS_INVALID)
    assert statuses == [ok, nf, ok, ended, sup, ok, bad, ok]
    # Only the renewals not renewed have a result, each with its index and reason.
    assert list(compact.result_index) == [1, 3, 4, 6]
    assert [r.status for r in compact.results] == [nf, ended, sup, bad]
    assert "conversation over" in compact.results[1].error and leases["old"].lease_id in compact.results[2].error
    assert compact.renewed == 4 and compact.now_ms == clock.now_ms()
    # The packed columns carry what the full answer's LeaseInfo does, for every renewal.
    for i, res in enumerate(full.results):
        if res.status == ok:
            assert (compact.lease_ids[i], compact.expires_at_ms[i], compact.ttl_ms[i]) == \
                (res.lease.lease_id, res.lease.expires_at_ms, res.lease.ttl_ms)
            assert compact.expires_at_ms[i] >= clock.now_ms() + res.lease.ttl_ms  # promised a full TTL
        else:
            assert (compact.lease_ids[i], compact.expires_at_ms[i], compact.ttl_ms[i]) == ("", 0, 0)
    assert compact.expires_at_ms[5] >= clock.now_ms() + 2 * TTL  # renewed for the TTL it asked for
    assert compact.lease_ids[7] == leases["old"].lease_id
    # The client library rebuilds one result per renewal from it, as from the full one.
    rebuilt = renew_results(compact, renewals)
    assert [r.status for r in rebuilt] == statuses
    for mine, theirs in zip(rebuilt, full.results):
        assert mine.conversation_id == theirs.conversation_id
        if theirs.status == ok:
            assert (mine.lease.lease_id, mine.lease.expires_at_ms, mine.lease.ttl_ms, mine.lease.remaining_ms) == \
                (theirs.lease.lease_id, theirs.lease.expires_at_ms, theirs.lease.ttl_ms, theirs.lease.remaining_ms)
    assert renew_results(full, renewals) == list(full.results)  # a server that predates `compact`


async def test_a_compact_renewal_holds_the_lease(kv, clock):
    """What the compact answer acknowledges is renewed: past the first TTL the lease lives,
    and its deadline is the one the answer gave."""
    await kv.call(kv.lease.Grant, pb.GrantRequest(conversation_id="k", engine_id="dec", ttl_ms=TTL))
    clock.advance(TTL - 500)
    resp = await keepalive(kv, [pb.RenewRequest(conversation_id="k")], compact=True)
    assert resp.renewed == 1 and not resp.results
    clock.advance(1_000)  # past the granted deadline
    info = await kv.call(kv.lease.Get, pb.GetLeaseRequest(conversation_id="k"))
    assert info.state == pb.LEASE_STATE_ACTIVE and info.expires_at_ms == resp.expires_at_ms[0]


async def test_client_renew_goes_compact_and_reads_back_a_full_result(kv, clock):
    g = await kv.call(kv.lease.Grant, pb.GrantRequest(conversation_id="cl", engine_id="dec", ttl_ms=TTL))
    clock.advance(2_000)
    res, missing = await asyncio.gather(kv.renew("cl"), kv.renew("missing"))
    assert res.status == pb.RENEW_STATUS_OK and res.conversation_id == "cl"
    assert res.lease.lease_id == g.lease.lease_id and res.lease.ttl_ms == TTL
    assert res.lease.expires_at_ms >= clock.now_ms() + TTL and res.lease.remaining_ms >= TTL
    assert missing.status == pb.RENEW_STATUS_NOT_FOUND and "missing" in missing.error


@pytest.mark.parametrize("head", [0, 2, 8], ids=["packed-only", "plain-head", "mixed-head"])
async def test_packed_conversation_ids_renew_like_renewals(kv, clock, head):
    """``conversation_ids`` renew like RenewRequests naming only the conversation, after
    ``renewals`` in the answer's order, whichever path (column scan or per-renewal loop)
    the head of the message takes."""
    renewals, _ = await scene(kv)
    plain = [r.conversation_id for r in renewals if not r.lease_id and not r.ttl_ms]
    head_part = renewals[:head] if head != 2 else [pb.RenewRequest(conversation_id=c) for c in plain[:2]]
    tail = plain + ["nope"]
    clock.advance(2_000)
    packed = await keepalive(kv, head_part, compact=True, packed=tail)
    spelled = await keepalive(kv, head_part + [pb.RenewRequest(conversation_id=c) for c in tail], compact=True)
    for field in ("result_index", "renewed", "lease_ids", "expires_at_ms", "ttl_ms"):
        assert getattr(packed, field) == getattr(spelled, field), field
    assert [r.status for r in packed.results] == [r.status for r in spelled.results]
    assert packed.results[-1].conversation_id == "nope" and packed.result_index[-1] == len(head_part) + len(tail) - 1
    full = await keepalive(kv, head_part, compact=False, packed=tail)  # a full answer covers them too
    assert len(full.results) == len(head_part) + len(tail) and full.results[-1].status == pb.RENEW_STATUS_NOT_FOUND
