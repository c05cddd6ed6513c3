"""The KeepAlive batch scan (``renewal_scan``): the column-wise pass decides exactly what
the per-renewal loop decides, on batches mixing every case; and the index it reads
(``LeaseService._active``) forgets a live lease whose record is deleted, so such a lease
is never acknowledged as renewed."""

from __future__ import annotations

import random

import pytest

from kvbaton.services.domain import renewal_scan
from kvbaton.services.domain.clock import ManualClock
from kvbaton.services.domain.lease import LeaseConfig, LeaseService
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import lease_pb2 as pb

PREFIX = b"p/l/"
NOW = 1_000_000


def world(rng: random.Random, n: int):
    """Leases with mixed TTLs and deadlines (some due a write, some within their slack),
    some with a later journal deadline; a few conversations without a lease."""
    active, records, journal = {}, {}, {}
    for i in range(n):
        if rng.random() < 0.1:
            continue  # no ACTIVE lease: the slow path
        lid, ttl = f"{i:016x}", rng.choice([400, 4_000, 60_000])
        deadline = NOW + rng.randint(-ttl, 2 * ttl)
        active[f"c{i}"] = (lid, ttl, deadline)
        records[PREFIX + lid.encode()] = (pb.LeaseInfo(lease_id=lid, conversation_id=f"c{i}", ttl_ms=ttl,
                                                        expires_at_ms=deadline, state=pb.LEASE_STATE_ACTIVE), i + 1)
        if rng.random() < 0.3:
            journal[lid] = deadline + rng.randint(-500, 3_000)
    return active, records, journal


def decided(sc: renewal_scan.Scan) -> tuple:
    """What a scan decides (deadlines of renewals due a write are set after the write)."""
    due = set(sc.w_at)
    dls = [0 if i in due else d for i, d in enumerate(sc.dls)]
    return sc.lids, sc.ttls, dls, sc.slow, sc.w_at, sc.w_lids, sc.w_dls


@pytest.mark.parametrize("seed", range(6))
def test_column_scan_decides_what_the_loop_decides(seed):
    rng = random.Random(seed)
    active, records, journal = world(rng, 400)
    batch = [pb.RenewRequest(conversation_id=f"c{rng.randrange(450)}") for _ in range(300)]
    args = (batch, NOW, active, records, PREFIX, journal.get, 1_000)
    each = renewal_scan.scan_each(*args)
    columns = renewal_scan.scan(*args)
    assert decided(columns) == decided(each)
    assert columns.infos == each.infos
    assert each.slow and each.w_at and len(each.w_at) + len(each.slow) < len(batch)  # every case occurs
    lean = renewal_scan.scan(*args, with_records=False)
    assert decided(lean) == decided(each) and lean.infos == [None] * len(batch)


def test_scan_falls_back_to_the_loop_when_a_renewal_names_a_lease_or_ttl():
    active, records, journal = world(random.Random(7), 50)
    conv, (lid, _, _) = next(iter(active.items()))
    for odd in (pb.RenewRequest(conversation_id=conv, lease_id="other"), pb.RenewRequest(conversation_id=conv, ttl_ms=9_000),
                pb.RenewRequest(conversation_id=conv, lease_id=lid)):
        batch = [pb.RenewRequest(conversation_id=c) for c in list(active)[:20]] + [odd]
        args = (batch, NOW, active, records, PREFIX, journal.get, 1_000)
        assert decided(renewal_scan.scan(*args)) == decided(renewal_scan.scan_each(*args))
    # A record `active` names but the cache lost: decided one by one (that renewal is slow).
    del records[PREFIX + lid.encode()]
    batch = [pb.RenewRequest(conversation_id=conv)]
    assert renewal_scan.scan(batch, NOW, active, records, PREFIX, journal.get, 1_000).slow == [0]


async def test_a_deleted_live_record_is_not_renewed():
    store = MemoryStore()
    svc = LeaseService(store, clock=ManualClock(), config=LeaseConfig(default_ttl_ms=10_000))
    await svc.start(run_expiry=False)
    try:
        info, _ = await svc.grant("conv", "dec")
        (ok,) = await svc.keepalive([pb.RenewRequest(conversation_id="conv")], compact=False)
        assert ok.status == pb.RENEW_STATUS_OK
        before = await store.current_revision()
        await store.delete(svc._lkey(info.lease_id))  # not something kvbaton does: an operator, a restore
        assert await svc.hub.wait_for(before + 1)
        assert "conv" not in svc._active
        resp = pb.KeepAliveResponse()
        (gone,) = await svc.keepalive([pb.RenewRequest(conversation_id="conv")], resp, compact=True)
        assert gone.status == pb.RENEW_STATUS_NOT_FOUND and list(resp.result_index) == [0] and resp.renewed == 0
    finally:
        await svc.stop()
        await store.close()
