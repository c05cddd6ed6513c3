"""BeginRead over the engine session (``SessionCall.begin_read``), like offers and
completions: the same answers and fencing as the unary RPC, a refusal answering that call
alone, per-call authorization, and unary calls to a server whose sessions lack it."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from kvbaton.client import KvbatonClient
from kvbaton.connector.control import ControlThread, rendezvous_call
from kvbaton.services.server import ControlPlane
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import common_pb2, registrar_pb2
from kvbaton.v1 import rendezvous_pb2 as pb
from kvbaton.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.services.conftest import fast_config
from tests.services.helpers import register, serve_rendezvous

PULL, REUSE = pb.TRANSFER_KIND_PULL, pb.TRANSFER_KIND_REUSE


@pytest.fixture
async def engines(kv):
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL)
    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)


def pull(tid: str, attempt: int = 0) -> pb.BeginReadRequest:
    return pb.BeginReadRequest(transfer_id=tid, attempt=attempt, kind=PULL, reader_engine_id="dec", block_ids=[7, 8])


async def test_pull_and_reuse_reads_begin_on_the_session_and_fencing_answers_one_call(kv, engines):
    await kv.session.complete(pb.CompleteRequest(transfer_id="p1", prefill_engine_id="pre", block_ids=[1, 2],
                                                 timeout_ms=60_000))
    sent = kv.session.stats["sent_calls"]
    begun = await kv.session.begin_read(pull("p1"))
    assert (begun.kind, begun.phase, begun.generation) == (PULL, pb.TRANSFER_PHASE_MATCHED, "0")
    assert kv.session.stats["sent_calls"] == sent + 1 and not kv.session.unary_bodies
    assert (await kv.session.begin_read(pull("p1"))).phase == pb.TRANSFER_PHASE_MATCHED  # a duplicate
    # Fenced: no hold, and a hold freed by its owner. Each refusal answers its call only.
    for tid, why in (("never", "no hold"), ("p2", "cancelled")):
        if tid == "p2":
            await kv.session.complete(pb.CompleteRequest(transfer_id="p2", prefill_engine_id="pre", block_ids=[1]))
            await kv.session.cancel(pb.CancelRequest(transfer_id="p2", engine_id="pre", reason="evicted"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv.session.begin_read(pull(tid))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and why in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.session.begin_read(pb.BeginReadRequest(transfer_id="bad", kind=PULL, reader_engine_id="dec"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert kv.session.reconnects == 0
    # Reuse, fenced by the retention generation.
    ret = registrar_pb2.RetainedBlocks(conversation_id="conv", engine_id="dec", block_ids=[3, 4], num_tokens=32,
                                       tokens_per_block=16)
    first = (await kv.call(kv.registrar.RegisterRetained, registrar_pb2.RegisterRetainedRequest(retained=ret))).retained
    read = pb.BeginReadRequest(transfer_id="r1", kind=REUSE, reader_engine_id="pre", block_ids=[10, 11],
                               conversation_id="conv", generation=first.retention_id, source_block_ids=[3, 4])
    assert (await kv.session.begin_read(read)).phase == pb.TRANSFER_PHASE_MATCHED
    stale = pb.BeginReadRequest()
    stale.CopyFrom(read)
    stale.transfer_id, stale.generation = "r2", "not-" + first.retention_id
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.session.begin_read(stale)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "re-registered" in err.value.details()
    # The ledger has them, as with the unary RPC.
    got = await kv.call(kv.rendezvous.GetTransfer, pb.GetTransferRequest(transfer_id="r1"))
    assert got.kind == REUSE and got.completion.engine_id == "pre"


async def test_session_begin_read_is_authorized_per_call(tmp_path):
    tokens = {"dec": "dec-token-0123456789", "pre": "pre-token-0123456789"}
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": [
        {"token": tokens["dec"], "name": "decode-0", "role": "engine", "engines": ["dec"]},
        {"token": tokens["pre"], "name": "prefill-0", "role": "engine", "engines": ["pre"]},
    ]}))
    cp = ControlPlane(fast_config(tokens_file=str(path)), store=MemoryStore())
    await cp.start()
    dec = KvbatonClient(cp.address, timeout_s=3, token=tokens["dec"])
    pre = KvbatonClient(cp.address, timeout_s=3, token=tokens["pre"])
    try:
        await register(dec, "dec", common_pb2.ENGINE_ROLE_DECODE)
        await register(pre, "pre", common_pb2.ENGINE_ROLE_PREFILL)
        await pre.session.complete(pb.CompleteRequest(transfer_id="a1", prefill_engine_id="pre", block_ids=[1, 2],
                                                      decode_engine_id="dec", timeout_ms=60_000))
        # The prefill may not begin a read as the decode: refused, the stream stays up.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pre.session.begin_read(pull("a1"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (await dec.session.begin_read(pull("a1"))).phase == pb.TRANSFER_PHASE_MATCHED
        assert pre.session.reconnects == 0 and dec.session.reconnects == 0
    finally:
        await dec.close()
        await pre.close()
        await cp.stop()


async def test_a_server_whose_sessions_lack_begin_read_gets_it_as_a_unary_call():
    """A control plane from before begin_read was a session call: its session answers the
    unknown call 'no body' (INVALID_ARGUMENT); the client sends BeginRead as unary calls."""
    unary_reads: list[str] = []

    class Older(pb_grpc.RendezvousServicer):
        async def Session(self, request_iterator, context):
            async for req in request_iterator:
                results = []
                for call in req.calls:
                    # An older build parses field 6 as an unknown field: no body.
                    if call.WhichOneof("body") in (None, "begin_read"):
                        results.append(pb.SessionResult(
                            seq=call.seq, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                            reason="session call has no body (offer, complete, report_outcome or cancel)"))
                    else:
                        results.append(pb.SessionResult(seq=call.seq, rendezvous=pb.RendezvousResponse()))
                yield pb.SessionResponse(results=results)

        async def BeginRead(self, r, context):
            unary_reads.append(r.transfer_id)
            return pb.TransferState(transfer_id=r.transfer_id, kind=r.kind, phase=pb.TRANSFER_PHASE_MATCHED)

    server, address = await serve_rendezvous(Older())
    kv = KvbatonClient(address, timeout_s=3)
    try:
        r = await kv.session.begin_read(pull("o1"))
        assert r.transfer_id == "o1" and unary_reads == ["o1"] and "begin_read" in kv.session.unary_bodies
        await kv.session.offer(pb.OfferRequest(transfer_id="o2", decode_engine_id="dec", block_ids=[1]))
        assert not kv.session.unary_fallback  # offers still go over the session
        r = await kv.session.begin_read(pull("o3"))  # straight to the unary call now
        assert unary_reads == ["o1", "o3"]
    finally:
        await kv.close()
        await server.stop(0)


async def test_the_connector_begins_reads_on_its_session(kv, plane, engines):
    await kv.call(kv.rendezvous.Complete, pb.CompleteRequest(transfer_id="c1", prefill_engine_id="pre",
                                                             block_ids=[1, 2], timeout_ms=60_000))
    ct = ControlThread(plane.address, timeout_s=5.0)
    try:
        state = await asyncio.wrap_future(ct.submit(rendezvous_call("BeginRead", pull("c1"), retries=1)))
        assert state.phase == pb.TRANSFER_PHASE_MATCHED and state.kind == PULL
        assert ct.client.session.stats["sent_calls"] == 1
    finally:
        await asyncio.get_running_loop().run_in_executor(None, ct.close)
