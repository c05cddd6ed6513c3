"""Paging on every List over a real server: pages bounded by count and by bytes, tokens
that resume, the client library following pages, and bad tokens refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvbaton.services.domain import paging
from kvbaton.v1 import common_pb2, lease_pb2, registrar_pb2, rendezvous_pb2
from tests.services.helpers import engine_rank, register


async def test_lease_list_pages_by_deadline_and_the_client_follows(kv):
    await register(kv, "dec")
    n = paging.DEFAULT_PAGE_SIZE + 150
    sem = asyncio.Semaphore(32)

    async def grant(i: int) -> None:
        async with sem:
            await kv.call(kv.lease.Grant, lease_pb2.GrantRequest(conversation_id=f"c{i}", engine_id="dec", ttl_ms=600_000))

    await asyncio.gather(*(grant(i) for i in range(n)))
    first = await kv.call(kv.lease.List, lease_pb2.ListLeasesRequest())
    assert len(first.leases) == paging.DEFAULT_PAGE_SIZE and first.next_page_token
    second = await kv.call(kv.lease.List, lease_pb2.ListLeasesRequest(page_token=first.next_page_token))
    assert len(second.leases) == 150 and not second.next_page_token
    assert not {ls.lease_id for ls in first.leases} & {ls.lease_id for ls in second.leases}
    everything = await kv.list_leases(page_size=100)
    assert len({ls.conversation_id for ls in everything}) == n
    keys = [(ls.expires_at_ms, ls.lease_id) for ls in everything]
    assert keys == sorted(keys)
    # The old ``limit`` is a page size; a page size over the server's maximum is capped.
    assert len((await kv.call(kv.lease.List, lease_pb2.ListLeasesRequest(limit=7))).leases) == 7
    capped = await kv.call(kv.lease.List, lease_pb2.ListLeasesRequest(page_size=10 * paging.MAX_PAGE_SIZE))
    assert len(capped.leases) == min(n, paging.MAX_PAGE_SIZE)
    assert len(await kv.list_leases(engine_id="dec", limit=42)) == 42


async def test_transfers_page_and_bad_tokens_are_refused(kv):
    await register(kv, "dec")
    for i in range(25):
        await kv.call(kv.rendezvous.Offer, rendezvous_pb2.OfferRequest(
            transfer_id=f"t{i}", decode_engine_id="dec", block_ids=[1, 2], timeout_ms=600_000))
    page = await kv.call(kv.rendezvous.ListTransfers, rendezvous_pb2.ListTransfersRequest(page_size=10))
    assert len(page.transfers) == 10 and page.next_page_token
    assert {t.transfer_id for t in await kv.list_transfers(page_size=10)} == {f"t{i}" for i in range(25)}
    for bad in ("garbage!", paging.encode_token("leases", (1, "x"))):  # not a token, another list's token
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv.call(kv.rendezvous.ListTransfers, rendezvous_pb2.ListTransfersRequest(page_token=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in err.value.details()


async def test_engines_with_big_metadata_page_by_bytes(kv, store_kind):
    if store_kind != "memory":
        pytest.skip("etcd refuses a 3 MiB request (its limit is 1.5 MiB)")
    # Six ranks of 3 MiB are 18 MiB: over the 16 MiB message limit in one answer.
    for i in range(6):
        rank = engine_rank(f"big{i}", common_pb2.ENGINE_ROLE_DECODE)
        rank.agent_metadata = bytes([i]) * (3 * 1024 * 1024)
        await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(rank=rank))
    page = await kv.call(kv.registrar.ListEngines, registrar_pb2.ListEnginesRequest())
    assert 1 <= len(page.ranks) < 6 and page.next_page_token
    assert page.ByteSize() <= paging.MAX_PAGE_BYTES + 4 * 1024 * 1024
    ranks = await kv.list_engines()
    assert sorted(r.engine_id for r in ranks) == [f"big{i}" for i in range(6)]
    assert all(r.agent_metadata[:1] == bytes([int(r.engine_id[3:])]) for r in ranks)
