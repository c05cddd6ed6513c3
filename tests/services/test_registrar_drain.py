"""Registrar: engines publish the URL they serve on; operators drain engines (issue 13)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvbaton.v1 import common_pb2
from kvbaton.v1 import registrar_pb2 as pb
from tests.services.helpers import engine_rank


async def _register(kv, engine_id: str, url: str = "", role=common_pb2.ENGINE_ROLE_DECODE, **kw):
    rank = engine_rank(engine_id, role, **kw)
    rank.serve_url = url
    return (await kv.call(kv.registrar.RegisterEngine, pb.RegisterEngineRequest(rank=rank))).rank


async def test_serve_url_is_published_and_checked(kv):
    await _register(kv, "d-url", "http://127.0.0.1:8200")
    got = await kv.call(kv.registrar.GetEngine, pb.GetEngineRequest(engine_id="d-url"))
    assert got.ranks[0].serve_url == "http://127.0.0.1:8200" and not got.ranks[0].draining
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _register(kv, "d-bad", "ftp://x")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "serve_url" in err.value.details()


async def test_drain_marks_ranks_survives_reregistration_refuses_retention_and_undoes(kv):
    await _register(kv, "d-dr", "http://127.0.0.1:8201", tp_size=2, tp_rank=0)
    await _register(kv, "d-dr", "http://127.0.0.1:8201", tp_size=2, tp_rank=1)
    stream = kv.registrar.WatchEngines(pb.WatchEnginesRequest())
    seen: list[tuple[int, int, bool]] = []
    got_both = asyncio.Event()

    async def read():
        async for ev in stream:
            seen.append((ev.type, ev.rank.tp_rank, ev.rank.draining))
            if sum(1 for s in seen if s[2]) == 2:
                got_both.set()

    reader = asyncio.ensure_future(read())
    resp = await kv.call(kv.registrar.DrainEngine, pb.DrainEngineRequest(engine_id="d-dr", reason="maintenance"))
    assert [(r.tp_rank, r.draining) for r in resp.ranks] == [(0, True), (1, True)]
    await asyncio.wait_for(got_both.wait(), 5)  # watchers (routers) see both ranks draining
    stream.cancel()
    reader.cancel()
    # The liveness lease is kept: the rank still refreshes.
    inc = resp.ranks[0].incarnation
    await kv.call(kv.registrar.RefreshEngine, pb.RefreshEngineRequest(engine_id="d-dr", tp_rank=0, incarnation=inc))
    # Re-registering (a restart) keeps the drain.
    again = await _register(kv, "d-dr", "http://127.0.0.1:8201", tp_size=2, tp_rank=0)
    assert again.draining
    # A draining decode retains no new conversation.
    ret = pb.RetainedBlocks(conversation_id="c-dr", engine_id="d-dr", block_ids=[1], num_tokens=16,
                            tokens_per_block=16)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.registrar.RegisterRetained, pb.RegisterRetainedRequest(retained=ret))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "draining" in err.value.details()
    # Undo: new work again.
    undone = await kv.call(kv.registrar.DrainEngine, pb.DrainEngineRequest(engine_id="d-dr", undo=True))
    assert [r.draining for r in undone.ranks] == [False, False]
    await kv.call(kv.registrar.RegisterRetained, pb.RegisterRetainedRequest(retained=ret))


async def test_drain_of_unknown_engine_is_remembered_and_bad_id_refused(kv):
    resp = await kv.call(kv.registrar.DrainEngine, pb.DrainEngineRequest(engine_id="d-later"))
    assert list(resp.ranks) == []
    assert (await _register(kv, "d-later")).draining
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.registrar.DrainEngine, pb.DrainEngineRequest(engine_id="a/b"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_cli_drain_releases_conversations_and_lists_the_drain(kv, plane, capsys):
    import json

    from kvbaton import cli
    from kvbaton.v1 import lease_pb2

    await _register(kv, "d-cli", "http://127.0.0.1:8202")
    for conv in ("c1", "c2"):
        reg = await kv.call(kv.registrar.RegisterRetained, pb.RegisterRetainedRequest(retained=pb.RetainedBlocks(
            conversation_id=conv, engine_id="d-cli", block_ids=[1, 2], num_tokens=32, tokens_per_block=16)))
        await kv.call(kv.lease.Grant, lease_pb2.GrantRequest(
            conversation_id=conv, engine_id="d-cli", ttl_ms=30_000, num_blocks=2,
            retention_id=reg.retained.retention_id))
    args = cli.build_parser().parse_args(["engines", "drain", "d-cli", "--addr", plane.address, "--wait", "1",
                                          "--reason", "node upgrade", "--json"])
    assert await cli._engines(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"engine_id": "d-cli", "draining": True, "ranks": 1, "in_flight_left": 0,
                   "conversations_released": 2}
    left = await kv.call(kv.lease.List, lease_pb2.ListLeasesRequest(engine_id="d-cli"))
    assert list(left.leases) == []
    got = await kv.call(kv.lease.Get, lease_pb2.GetLeaseRequest(conversation_id="c1"))
    assert got.state == lease_pb2.LEASE_STATE_REVOKED and "node upgrade" in got.reason
    args = cli.build_parser().parse_args(["engines", "list", "--addr", plane.address])
    assert await cli._engines(args) == 0
    table = capsys.readouterr().out
    assert "draining" in table and "http://127.0.0.1:8202" in table
