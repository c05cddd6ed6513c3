"""Registrar over a real gRPC server: engines, liveness, retained blocks, bad input."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvbaton.v1 import common_pb2
from kvbaton.v1 import registrar_pb2 as pb
from tests.services.helpers import engine_rank, register


async def test_register_get_list_deregister(kv):
    r0 = await register(kv, "dec-1", tp_size=2, tp_rank=0)
    r1 = await register(kv, "dec-1", tp_size=2, tp_rank=1)
    await register(kv, "pre-1", common_pb2.ENGINE_ROLE_PREFILL)
    assert r0.incarnation and r0.incarnation != r1.incarnation
    got = await kv.call(kv.registrar.GetEngine, pb.GetEngineRequest(engine_id="dec-1"))
    assert [r.tp_rank for r in got.ranks] == [0, 1]
    assert got.ranks[0].agent_metadata == b"nixl-metadata-dec-1"
    listed = await kv.call(kv.registrar.ListEngines, pb.ListEnginesRequest(role=common_pb2.ENGINE_ROLE_PREFILL))
    assert [r.engine_id for r in listed.ranks] == ["pre-1"]
    removed = await kv.call(kv.registrar.DeregisterEngine, pb.DeregisterEngineRequest(engine_id="dec-1"))
    assert removed.removed == 2
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.registrar.GetEngine, pb.GetEngineRequest(engine_id="dec-1"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_liveness_lapses_without_refresh_and_refresh_keeps_it(kv):
    req = pb.RegisterEngineRequest(rank=engine_rank("live-1"), ttl_ms=1000)
    rank = (await kv.call(kv.registrar.RegisterEngine, req)).rank
    req2 = pb.RegisterEngineRequest(rank=engine_rank("dead-1"), ttl_ms=1000)
    await kv.call(kv.registrar.RegisterEngine, req2)
    for _ in range(8):  # 2.4 s: more than two TTLs
        await asyncio.sleep(0.3)
        await kv.call(kv.registrar.RefreshEngine, pb.RefreshEngineRequest(
            engine_id="live-1", tp_rank=0, incarnation=rank.incarnation))
    names = {r.engine_id for r in (await kv.call(kv.registrar.ListEngines, pb.ListEnginesRequest())).ranks}
    assert "live-1" in names and "dead-1" not in names
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.registrar.RefreshEngine, pb.RefreshEngineRequest(engine_id="dead-1", tp_rank=0))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "register again" in err.value.details()


async def test_watch_engines_sees_put_and_delete(kv):
    await register(kv, "w-1")
    stream = kv.registrar.WatchEngines(pb.WatchEnginesRequest())
    events = []

    async def read():
        async for ev in stream:
            events.append((ev.type, ev.rank.engine_id))
            if len(events) == 3:
                return

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0.2)
    await register(kv, "w-2")
    await kv.call(kv.registrar.DeregisterEngine, pb.DeregisterEngineRequest(engine_id="w-1"))
    await asyncio.wait_for(reader, 5)
    stream.cancel()
    assert events == [(pb.EngineEvent.TYPE_PUT, "w-1"), (pb.EngineEvent.TYPE_PUT, "w-2"), (pb.EngineEvent.TYPE_DELETE, "w-1")]


async def test_retained_register_replace_lookup_release(kv):
    await register(kv, "dec-r")
    ret = pb.RetainedBlocks(conversation_id="conv-1", engine_id="dec-r", block_ids=[3, 4, 5], num_tokens=40,
                            tokens_per_block=16, block_hashes=[b"h1", b"h2"])
    first = await kv.call(kv.registrar.RegisterRetained, pb.RegisterRetainedRequest(retained=ret))
    assert first.retained.retention_id and not first.HasField("replaced")
    ret.block_ids[:] = [7, 8, 9]
    second = await kv.call(kv.registrar.RegisterRetained, pb.RegisterRetainedRequest(retained=ret))
    assert second.replaced.retention_id == first.retained.retention_id
    assert list(second.replaced.block_ids) == [3, 4, 5]
    look = await kv.call(kv.registrar.LookupRetained, pb.LookupRetainedRequest(conversation_id="conv-1"))
    assert list(look.retained.block_ids) == [7, 8, 9]
    stale = await kv.call(kv.registrar.ReleaseRetained, pb.ReleaseRetainedRequest(
        conversation_id="conv-1", retention_id=first.retained.retention_id))
    assert not stale.released  # an old turn's release never drops the new turn's blocks
    done = await kv.call(kv.registrar.ReleaseRetained, pb.ReleaseRetainedRequest(conversation_id="conv-1"))
    assert done.released


@pytest.mark.parametrize("mutate, code, words", [
    (lambda r: setattr(r, "engine_id", ""), grpc.StatusCode.INVALID_ARGUMENT, "engine_id is required"),
    (lambda r: setattr(r, "engine_id", "x" * 300), grpc.StatusCode.INVALID_ARGUMENT, "limit is 256"),
    (lambda r: setattr(r, "engine_id", "a/b"), grpc.StatusCode.INVALID_ARGUMENT, "without spaces or '/'"),
    (lambda r: setattr(r, "role", 0), grpc.StatusCode.INVALID_ARGUMENT, "role is required"),
    (lambda r: setattr(r, "tp_rank", 5), grpc.StatusCode.INVALID_ARGUMENT, "not below tp_size"),
    (lambda r: setattr(r, "agent_metadata", b""), grpc.StatusCode.INVALID_ARGUMENT, "agent_metadata is empty"),
    (lambda r: setattr(r, "agent_metadata", b"m" * (4 * 1024 * 1024 + 1)), grpc.StatusCode.INVALID_ARGUMENT, "agent_metadata is"),
    (lambda r: r.geometry.ClearField("region_base_addrs"), grpc.StatusCode.INVALID_ARGUMENT, "region_base_addrs is empty"),
    (lambda r: setattr(r.geometry, "bytes_per_block", 0), grpc.StatusCode.INVALID_ARGUMENT, "bytes_per_block"),
    (lambda r: setattr(r.geometry, "dtype", "complex128"), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    (lambda r: setattr(r.geometry, "fingerprint", ""), grpc.StatusCode.INVALID_ARGUMENT, "fingerprint is required"),
])
async def test_bad_engine_registrations_are_refused_and_write_nothing(kv, mutate, code, words):
    rank = engine_rank("bad-1")
    mutate(rank)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.registrar.RegisterEngine, pb.RegisterEngineRequest(rank=rank))
    assert err.value.code() == code and words in err.value.details()
    listed = await kv.call(kv.registrar.ListEngines, pb.ListEnginesRequest())
    assert not listed.ranks


async def test_retained_bad_input(kv):
    await register(kv, "pre-x", common_pb2.ENGINE_ROLE_PREFILL)
    cases = [
        (pb.RetainedBlocks(conversation_id="c", engine_id="nobody", block_ids=[1], num_tokens=16, tokens_per_block=16),
         grpc.StatusCode.NOT_FOUND, "not registered"),
        (pb.RetainedBlocks(conversation_id="c", engine_id="pre-x", block_ids=[1], num_tokens=16, tokens_per_block=16),
         grpc.StatusCode.FAILED_PRECONDITION, "not a decode engine"),
        (pb.RetainedBlocks(conversation_id="c", engine_id="pre-x", block_ids=list(range(70_000)), num_tokens=16,
                           tokens_per_block=16), grpc.StatusCode.INVALID_ARGUMENT, "limit is 65536"),
        (pb.RetainedBlocks(conversation_id="c", engine_id="pre-x", block_ids=[1, 1], num_tokens=16, tokens_per_block=16),
         grpc.StatusCode.INVALID_ARGUMENT, "duplicate"),
        (pb.RetainedBlocks(conversation_id="c", engine_id="pre-x", block_ids=[1], num_tokens=99, tokens_per_block=16),
         grpc.StatusCode.INVALID_ARGUMENT, "does not fit"),
    ]
    for ret, code, words in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv.call(kv.registrar.RegisterRetained, pb.RegisterRetainedRequest(retained=ret))
        assert err.value.code() == code and words in err.value.details(), (ret, err.value.details())


async def test_engine_keeper_reregisters_after_liveness_is_lost(kv, plane):
    from kvbaton.client import EngineKeeper

    keeper = EngineKeeper(kv, engine_rank("kept-1"), ttl_ms=1000)
    await keeper.start()
    first = keeper.registered.incarnation
    # The liveness lease vanishes behind the engine's back (a store failover, an operator).
    ranks, _ = await plane.store.range(b"kvb/reg/e/kept-1/")
    await plane.store.revoke_lease(ranks[0].lease)
    for _ in range(50):
        await asyncio.sleep(0.1)
        if keeper.registrations >= 2:
            break
    got = await kv.call(kv.registrar.GetEngine, pb.GetEngineRequest(engine_id="kept-1"))
    assert keeper.registrations >= 2 and got.ranks[0].incarnation != first
    await keeper.stop(deregister=True)
    listed = await kv.call(kv.registrar.ListEngines, pb.ListEnginesRequest())
    assert "kept-1" not in {r.engine_id for r in listed.ranks}


async def test_metadata_the_store_cannot_hold_is_refused_up_front(kv, store_kind):
    """2 MiB of agent metadata is within the API limit (4 MiB) but over etcd's request
    limit (1.5 MiB): refused with INVALID_ARGUMENT and the reason, not UNAVAILABLE (which
    clients retry forever). The memory store holds it."""
    rank = engine_rank("big-meta")
    rank.agent_metadata = b"m" * (2 * 1024 * 1024)
    req = pb.RegisterEngineRequest(rank=rank)
    if store_kind == "memory":
        assert (await kv.call(kv.registrar.RegisterEngine, req)).rank.engine_id == "big-meta"
        return
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.registrar.RegisterEngine, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "agent_metadata 2097152 bytes" in err.value.details() and "at most" in err.value.details()
