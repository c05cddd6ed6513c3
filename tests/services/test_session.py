"""Rendezvous/Session (an engine's calls over one bidirectional stream) through a real
server on both stores: the same answers as the unary RPCs, per call, in batches; a bad or
refused call is answered alone and the stream keeps working."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import pytest

from kvbaton.client import KvbatonClient
from kvbaton.services.server import ControlPlane
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import common_pb2
from kvbaton.v1 import rendezvous_pb2 as pb
from tests.services.conftest import fast_config
from tests.services.helpers import register, serve_rendezvous
from tests.services.test_rendezvous import Collector, complete, offer

Ev = pb.RendezvousEvent
P = pb.TransferPhase
INVALID, PRECONDITION, NOT_FOUND = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                    grpc.StatusCode.NOT_FOUND)


@pytest.fixture
async def engines(kv):
    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL, tp_size=2, tp_rank=0)
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL, tp_size=2, tp_rank=1)


@pytest.fixture
async def pre_kv(plane, engines):
    """The prefill engine's own client (its own connection and session)."""
    client = KvbatonClient(plane.address, timeout_s=5.0)
    await client.wait_ready()
    yield client
    await client.close()


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("first", ["offer", "complete"])
async def test_both_orders_match_once_and_the_match_reaches_every_rank(kv, pre_kv, engines, first):
    ranks = [Collector(pre_kv, "pre", r) for r in (0, 1)]
    await asyncio.gather(*(c.ready.wait() for c in ranks))

    def send_offer():
        return kv.session.offer(offer("t1"))

    def send_complete():
        return pre_kv.session.complete(complete("t1"))

    one, two = (send_offer, send_complete) if first == "offer" else (send_complete, send_offer)
    r1 = await one()
    assert not r1.matched_now and not r1.duplicate
    assert r1.state.phase == (P.Value("TRANSFER_PHASE_OFFERED") if first == "offer" else P.Value("TRANSFER_PHASE_COMPLETED"))
    r2 = await two()
    assert r2.matched_now and r2.state.phase == P.Value("TRANSFER_PHASE_MATCHED") and r2.state.revision > 0
    assert list(r2.state.offer.block_ids) == [1, 2, 3] and list(r2.state.completion.block_ids) == [7, 8, 9]
    for c in ranks:
        await c.wait(lambda evs: any(e.type == Ev.TYPE_MATCH for e in evs))
    await asyncio.sleep(0.2)
    for c in ranks:
        assert [e.transfer.transfer_id for e in c.of(Ev.TYPE_MATCH)] == ["t1"]
        c.task.cancel()


async def test_hundreds_concurrent_each_matched_exactly_once(kv, pre_kv, engines):
    n = 300
    sub = Collector(pre_kv, "pre", 0)
    await sub.ready.wait()
    calls = [kv.session.offer(offer(f"c{i}", blocks=(i + 1,))) for i in range(n)]
    calls += [pre_kv.session.complete(complete(f"c{i}", blocks=(5000 + i,))) for i in range(n)]
    random.Random(7).shuffle(calls)
    results = await asyncio.gather(*calls)
    assert all(not r.duplicate for r in results)
    made = sorted(r.state.transfer_id for r in results if r.matched_now)
    assert made == sorted(f"c{i}" for i in range(n)), "each transfer matched by exactly one of its two calls"
    await sub.wait(lambda evs: len([e for e in evs if e.type == Ev.TYPE_MATCH]) >= n, timeout=20)
    await asyncio.sleep(0.3)  # would-be duplicates have time to arrive
    delivered = [e.transfer.transfer_id for e in sub.of(Ev.TYPE_MATCH)]
    assert sorted(delivered) == made
    # Concurrent calls went out in batches, not one gRPC message each.
    stats = kv.session.stats
    assert stats["sent_calls"] == n and stats["sent_batches"] < n
    assert stats["received_results"] == n
    sub.task.cancel()


async def test_duplicates_are_idempotent_and_conflicts_refused(kv, pre_kv, engines):
    first = await kv.session.offer(offer("d1"))
    again = await kv.session.offer(offer("d1"))
    assert again.duplicate and not again.matched_now and again.state.offer.engine_id == "dec"
    assert again.state.offer.received_at_ms == first.state.offer.received_at_ms  # not re-written
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.session.offer(offer("d1", blocks=(4, 5, 6)))
    assert err.value.code() == PRECONDITION and "different offer" in err.value.details()
    m = await pre_kv.session.complete(complete("d1"))
    dup = await pre_kv.session.complete(complete("d1"))
    assert m.matched_now and dup.duplicate and not dup.matched_now
    assert dup.state.phase == P.Value("TRANSFER_PHASE_MATCHED")


async def test_superseded_attempt_is_refused_per_call(kv, pre_kv, engines):
    await kv.session.offer(offer("s1", attempt=1))
    for call in (kv.session.offer(offer("s1", attempt=0)), pre_kv.session.complete(complete("s1", attempt=0))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == PRECONDITION and "superseded by attempt 1" in err.value.details()
    # The stream is still good: the current attempt matches.
    r = await pre_kv.session.complete(complete("s1", attempt=1))
    assert r.matched_now and r.state.attempt == 1
    # A newer attempt supersedes the matched one... only when it is newer.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pre_kv.session.report_outcome(pb.ReportOutcomeRequest(
            transfer_id="s1", attempt=0, outcome=pb.Outcome(engine_id="pre", tp_rank=0, success=True)))
    assert err.value.code() == PRECONDITION


async def test_bad_calls_in_one_batch_are_answered_alone_and_the_stream_keeps_working(kv, engines):
    call = kv.rendezvous.Session()
    good = offer("b1")
    batch = pb.SessionRequest(calls=[
        pb.SessionCall(seq=1),  # no body
        pb.SessionCall(seq=2, offer=offer("")),
        pb.SessionCall(seq=3, offer=offer("b2", blocks=(1, 1))),
        pb.SessionCall(seq=4, offer=pb.OfferRequest(transfer_id="b3", decode_engine_id="dec", block_ids=[1],
                                                      timeout_ms=10**9)),
        pb.SessionCall(seq=5, offer=offer("b4", engine="ghost")),
        pb.SessionCall(seq=6, offer=good),
    ])
    await call.write(batch)
    results: dict[int, pb.SessionResult] = {}
    while len(results) < 6:
        resp = await asyncio.wait_for(call.read(), 5)
        results.update({r.seq: r for r in resp.results})

    def code(seq):
        return grpc.StatusCode(next(s for s in grpc.StatusCode if s.value[0] == results[seq].code))

    assert code(1) == INVALID and "no body" in results[1].reason
    assert code(2) == INVALID and "transfer_id is required" in results[2].reason
    assert code(3) == INVALID and "duplicate" in results[3].reason
    assert code(4) == INVALID and "timeout_ms" in results[4].reason
    assert code(5) == NOT_FOUND and "ghost" in results[5].reason
    assert code(6) == grpc.StatusCode.OK and results[6].rendezvous.state.offer.engine_id == "dec"
    # Still open: a later batch on the same stream is answered.
    await call.write(pb.SessionRequest(calls=[pb.SessionCall(seq=7, complete=complete("b1"))]))
    resp = await asyncio.wait_for(call.read(), 5)
    assert [r.seq for r in resp.results] == [7] and resp.results[0].rendezvous.matched_now
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    # Nothing of the refused calls was written.
    for tid in ("b2", "b3", "b4"):
        assert await _code(kv.call(kv.rendezvous.GetTransfer, pb.GetTransferRequest(transfer_id=tid))) == NOT_FOUND


async def test_outcomes_and_cancels_over_the_session(kv, pre_kv, engines):
    dec_events = Collector(kv, "dec", 0)
    await dec_events.ready.wait()
    await kv.session.offer(offer("o1"))
    await pre_kv.session.complete(complete("o1"))
    for rank in (0, 1):
        state = await pre_kv.session.report_outcome(pb.ReportOutcomeRequest(
            transfer_id="o1", outcome=pb.Outcome(engine_id="pre", tp_rank=rank, success=True, bytes=100)))
    assert state.phase == P.Value("TRANSFER_PHASE_SUCCEEDED") and len(state.outcomes) == 2
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pre_kv.session.report_outcome(pb.ReportOutcomeRequest(
            transfer_id="nope", outcome=pb.Outcome(engine_id="pre", tp_rank=0, success=True)))
    assert err.value.code() == NOT_FOUND
    # A pending offer is cancelled by its owner; decode may not cancel a matched transfer.
    await kv.session.offer(offer("o2"))
    cancelled = await kv.session.cancel(pb.CancelRequest(transfer_id="o2", engine_id="dec", reason="client gone"))
    assert cancelled.phase == P.Value("TRANSFER_PHASE_CANCELLED") and "client gone" in cancelled.reason
    await kv.session.offer(offer("o3"))
    await pre_kv.session.complete(complete("o3"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.session.cancel(pb.CancelRequest(transfer_id="o3", engine_id="dec"))
    assert err.value.code() == PRECONDITION and "matched" in err.value.details()
    await dec_events.wait(lambda evs: any(e.type == Ev.TYPE_DONE and e.transfer.transfer_id == "o1" for e in evs))
    dec_events.task.cancel()


# -- auth and rate limits (memory store; the guard does not depend on the store) ----------

TOKENS = {"dec": "tok-decode-engine-0123456789", "pre": "tok-prefill-engine-0123456789",
          "agent": "tok-agent-acme-0123456789abc"}


async def _plane(**over) -> ControlPlane:
    cp = ControlPlane(fast_config(**over), store=MemoryStore())
    await cp.start()
    return cp

async def test_session_calls_are_authorized_one_by_one(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": [
        {"token": TOKENS["dec"], "name": "decode-0", "role": "engine", "engines": ["dec"]},
        {"token": TOKENS["pre"], "name": "prefill-0", "role": "engine", "engines": ["pre"]},
        {"token": TOKENS["agent"], "name": "acme-agent", "role": "agent", "conversations": ["acme-*"]},
    ]}))
    cp = await _plane(tokens_file=str(path))
    clients = {who: KvbatonClient(cp.address, timeout_s=3, token=TOKENS[who]) for who in ("dec", "pre", "agent")}
    clients["none"] = KvbatonClient(cp.address, timeout_s=3)
    try:
        await register(clients["dec"], "dec", common_pb2.ENGINE_ROLE_DECODE)
        await register(clients["pre"], "pre", common_pb2.ENGINE_ROLE_PREFILL)
        dec, pre = clients["dec"].session, clients["pre"].session
        # Out of scope: refused with the reason; in scope on the same stream: answered.
        # (With tokens every transfer is bound: each side names its peer.)
        codes = await asyncio.gather(*(_code(c) for c in (
            dec.offer(offer("a1", peer="pre")),
            dec.complete(complete("a1", peer="dec")),                                   # decode acting as prefill
            dec.offer(offer("a2", engine="pre", peer="pre")),                           # as another engine
            pre.cancel(pb.CancelRequest(transfer_id="a1", engine_id="dec")),
        )))
        assert codes == [grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED,
                         grpc.StatusCode.PERMISSION_DENIED]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await dec.offer(offer("a2", engine="pre", peer="pre"))
        assert "may not offer for engine 'pre'" in err.value.details()
        r = await pre.complete(complete("a1", writers=1, peer="dec"))
        assert r.matched_now  # the refused calls changed nothing
        assert dec.reconnects == 0 and pre.reconnects == 0  # refusals did not break the streams
        # An agent may open the stream but none of its calls pass.
        assert await _code(clients["agent"].session.offer(offer("a3", engine="dec", peer="pre"))) == grpc.StatusCode.PERMISSION_DENIED
        # No token: the stream itself is refused.
        assert await _code(clients["none"].session.offer(offer("a4", peer="pre"))) == grpc.StatusCode.UNAUTHENTICATED
        state = await clients["dec"].call(clients["dec"].rendezvous.GetTransfer, pb.GetTransferRequest(transfer_id="a1"))
        assert state.phase == P.Value("TRANSFER_PHASE_MATCHED")
        assert await _code(clients["dec"].call(clients["dec"].rendezvous.GetTransfer,
                                               pb.GetTransferRequest(transfer_id="a2"))) == NOT_FOUND
    finally:
        for c in clients.values():
            await c.close()
        await cp.stop()


async def test_session_calls_are_rate_limited_one_by_one():
    cp = await _plane(rate_limit=20.0)
    kv = KvbatonClient(cp.address, timeout_s=3)
    try:
        await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
        await asyncio.sleep(1.0)  # the bucket refills after the registration
        codes = [await _code(kv.session.offer(offer(f"r{i}"))) for i in range(60)]
        # Calls past the rate were refused one by one (RESOURCE_EXHAUSTED with a retry
        # hint) and the client sent each again after the hint, on the same stream: every
        # call passed, later (tests/services/test_shed_retry.py has the refusals themselves).
        assert codes == [grpc.StatusCode.OK] * 60
        assert cp.guard.refused["rate_limited"] > 0 and kv.session.stats["shed_retries"] > 0
        assert kv.session.reconnects == 0
    finally:
        await kv.close()
        await cp.stop()


async def test_a_server_without_sessions_is_spoken_to_with_unary_calls():
    """An older control plane answers Session with UNIMPLEMENTED: the client falls back."""
    from kvbaton.v1 import rendezvous_pb2_grpc as pb_grpc

    class Older(pb_grpc.RendezvousServicer):  # Session left unimplemented
        async def Offer(self, r, context):
            return pb.RendezvousResponse(state=pb.TransferState(transfer_id=r.transfer_id, phase=P.Value("TRANSFER_PHASE_OFFERED")))

        async def Cancel(self, r, context):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"transfer {r.transfer_id} not found")

    server, address = await serve_rendezvous(Older())
    kv = KvbatonClient(address, timeout_s=3)
    try:
        r = await kv.session.offer(offer("u1"))
        assert r.state.transfer_id == "u1" and kv.session.unary_fallback
        assert await _code(kv.session.cancel(pb.CancelRequest(transfer_id="u2", engine_id="dec"))) == NOT_FOUND
        r = await kv.session.offer(offer("u3"))  # straight to the unary call now
        assert r.state.transfer_id == "u3"
    finally:
        await kv.close()
        await server.stop(0)


async def test_a_session_routes_around_a_replica_that_never_answers(kv, plane, engines):
    """The session starts on a replica that accepts the stream and reads it but never
    answers (hung process, half-open connection): after the client's timeout the stream is
    abandoned, the unanswered call is resent on the next replica and answered there."""
    from kvbaton.v1 import rendezvous_pb2_grpc

    seen = []

    async def silent_session(request_iterator, context):
        async for req in request_iterator:
            seen.extend(c.seq for c in req.calls)
        await asyncio.sleep(3600)

    server = grpc.aio.server()
    servicer = type("S", (rendezvous_pb2_grpc.RendezvousServicer,), {"Session": staticmethod(silent_session)})()
    rendezvous_pb2_grpc.add_RendezvousServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    # 1 s: the real replica (etcd) must answer within the client's timeout too, which 0.5 s
    # missed once under a load average of 20+ (i17-cpu3), sending the call round again.
    client = KvbatonClient([f"127.0.0.1:{port}", plane.address], timeout_s=1.0)
    try:
        resp = await asyncio.wait_for(client.session.offer(offer("hung-1", (1, 2))), 10.0)
        assert resp.state.phase == P.Value("TRANSFER_PHASE_OFFERED")
        assert seen, "the call went to the silent replica first"
        assert client.address == plane.address
        assert client.session.reconnects >= 1
    finally:
        await client.close()
        await server.stop(0)
