"""Clients back off on RESOURCE_EXHAUSTED: a real server forced to shed (its overload
shedding held on, its rate limit, its cap on pending transfers) answers with a retry hint;
``KvbatonClient.call`` and the session send the call again after the hint (jittered,
growing) and only inside the call's deadline; final refusals are never sent again."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvbaton.client import RETRY_AFTER_METADATA, KvbatonClient, ShedBackoff, retry_after_s
from kvbaton.services.server import ControlPlane
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import common_pb2
from kvbaton.v1 import rendezvous_pb2 as pb

from .conftest import fast_config
from .helpers import register

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def offer(tid: str, engine: str = "dec") -> pb.OfferRequest:
    return pb.OfferRequest(transfer_id=tid, decode_engine_id=engine, block_ids=[1, 2, 3], timeout_ms=30_000)


def complete(tid: str) -> pb.CompleteRequest:
    return pb.CompleteRequest(transfer_id=tid, prefill_engine_id="pre", block_ids=[4, 5, 6], timeout_ms=30_000)


async def _plane(**over) -> ControlPlane:
    cp = ControlPlane(fast_config(**over), store=MemoryStore())
    await cp.start()
    return cp


class HeldOverload:
    """Holds a plane's real load shedding (``LoopLag``) on: its measuring task is stopped
    and it is fed saturated ticks, with no new transfer admitted per tick, until released."""

    def __init__(self, cp: ControlPlane) -> None:
        self.load = cp.load

    async def hold(self) -> None:
        await self.load.stop()
        self.load.admit_per_tick = 0
        for _ in range(len(self.load._lags)):
            self.load.observe(late_ms=100.0, busy=1.0)
        assert self.load.overloaded

    def release(self) -> None:
        for _ in range(len(self.load._lags)):
            self.load.observe(late_ms=0.0, busy=0.0)
        assert not self.load.overloaded


@pytest.fixture
async def shedding():
    cp = await _plane(shed_lag_ms=20.0)
    kv = KvbatonClient(cp.address, timeout_s=3)
    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL)
    held = HeldOverload(cp)
    await held.hold()
    try:
        yield cp, kv, held
    finally:
        await kv.close()
        await cp.stop()


async def test_shed_unary_call_carries_a_hint_and_passes_once_the_overload_ends(shedding):
    cp, kv, held = shedding
    # The refusal itself (a raw stub: no retry): RESOURCE_EXHAUSTED, a reason and a hint.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.rendezvous.Offer(offer("raw"), timeout=3)
    assert err.value.code() == EXHAUSTED and "overloaded" in err.value.details()
    hint = retry_after_s(err.value)
    assert hint is not None and 0.02 <= hint <= 1.0, err.value.trailing_metadata()

    # Through the client: sent again until the overload ends, then answered OK.
    shed_before = cp.load.shed
    call = asyncio.ensure_future(kv.call(kv.rendezvous.Offer, offer("t1")))
    while cp.load.shed < shed_before + 2:  # refused at least twice: the client came back
        await asyncio.sleep(0.01)
    assert not call.done()
    held.release()
    r = await asyncio.wait_for(call, 5)
    assert r.state.phase == pb.TRANSFER_PHASE_OFFERED
    assert kv.shed_retries >= 2
    # Accepted work is always admitted, shed or not: the other side matches it.
    await held.hold()
    done = await kv.call(kv.rendezvous.Complete, complete("t1"))
    assert done.matched_now


async def test_shed_session_call_is_sent_again_on_the_same_stream(shedding):
    cp, kv, held = shedding
    call = asyncio.ensure_future(kv.session.offer(offer("s1")))
    while kv.session.stats["shed_retries"] < 2:
        await asyncio.sleep(0.01)
    held.release()
    r = await asyncio.wait_for(call, 5)
    assert r.state.phase == pb.TRANSFER_PHASE_OFFERED
    assert kv.session.reconnects == 0  # refusals never broke the stream


async def test_a_shed_call_gives_up_inside_its_deadline(shedding):
    cp, kv, held = shedding
    quick = KvbatonClient(cp.address, timeout_s=0.5)
    try:
        for send in (lambda: quick.call(quick.rendezvous.Offer, offer("late-u")),
                     lambda: quick.session.offer(offer("late-s"))):
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await send()
            # The last refusal is the answer, given before the deadline ran out.
            assert err.value.code() == EXHAUSTED and "overloaded" in err.value.details()
            assert time.monotonic() - t0 < 0.5 + 0.2
        assert quick.shed_retries >= 1 and quick.session.stats["shed_retries"] >= 1
    finally:
        await quick.close()


async def test_final_refusals_are_never_sent_again(shedding):
    cp, kv, held = shedding
    held.release()
    for bad in (offer(""), offer("x", engine="bad/id")):
        for send in (lambda r=bad: kv.call(kv.rendezvous.Offer, r), lambda r=bad: kv.session.offer(r)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await send()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert kv.shed_retries == 0 and kv.session.stats["shed_retries"] == 0


async def test_permission_denied_is_never_sent_again(tmp_path):
    import json

    path = tmp_path / "tokens.json"
    dec_token, op_token = "dec-token-0123456789", "operator-token-0123456789"
    path.write_text(json.dumps({"tokens": [
        {"token": dec_token, "name": "decode-0", "role": "engine", "engines": ["dec"]},
        {"token": op_token, "name": "operator", "role": "operator"},
    ]}))
    cp = await _plane(tokens_file=str(path))
    op = KvbatonClient(cp.address, timeout_s=3, token=op_token)
    dec = KvbatonClient(cp.address, timeout_s=3, token=dec_token)
    try:
        await register(op, "other", common_pb2.ENGINE_ROLE_DECODE)
        for send in (lambda: dec.call(dec.rendezvous.Offer, offer("p1", engine="other")),
                     lambda: dec.session.offer(offer("p2", engine="other"))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await send()
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert dec.shed_retries == 0 and dec.session.stats["shed_retries"] == 0
    finally:
        await op.close()
        await dec.close()
        await cp.stop()


async def test_rate_limited_calls_wait_for_the_bucket():
    """The rate limit's refusal says when the bucket holds a token again: a client sending
    faster than its rate gets every call through, later, instead of errors."""
    cp = await _plane(rate_limit=20.0)
    kv = KvbatonClient(cp.address, timeout_s=3)
    try:
        await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
        unary = [await kv.call(kv.rendezvous.Offer, offer(f"u{i}")) for i in range(30)]
        session = [await kv.session.offer(offer(f"s{i}")) for i in range(30)]
        assert all(r.state.phase == pb.TRANSFER_PHASE_OFFERED for r in unary + session)
        assert cp.guard.refused["rate_limited"] > 0
        assert kv.shed_retries > 0 and kv.session.stats["shed_retries"] > 0
        # The raw refusal carries the hint.
        codes = []
        for _ in range(40):
            try:
                await kv.rendezvous.GetTransfer(pb.GetTransferRequest(transfer_id="u0"), timeout=3)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc)
        assert codes and all(e.code() == EXHAUSTED for e in codes)
        assert all(0 < (retry_after_s(e) or 0) <= 0.1 for e in codes), [e.trailing_metadata() for e in codes]
    finally:
        await kv.close()
        await cp.stop()


async def test_full_pending_queue_is_retried_until_a_slot_frees(kv, plane):
    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL)
    plane.rendezvous.config.max_pending = 2
    for i in range(2):
        await kv.call(kv.rendezvous.Offer, offer(f"q{i}"))
    waiting = asyncio.ensure_future(kv.call(kv.rendezvous.Offer, offer("q2")))
    while kv.shed_retries < 1:
        await asyncio.sleep(0.01)
    assert not waiting.done()
    # A slot frees (q0 matched, then ended): the waiting offer goes through.
    await kv.call(kv.rendezvous.Complete, complete("q0"))
    await kv.call(kv.rendezvous.ReportOutcome, pb.ReportOutcomeRequest(
        transfer_id="q0", outcome=pb.Outcome(engine_id="pre", tp_rank=0, success=True)))
    r = await asyncio.wait_for(waiting, 5)
    assert r.state.phase == pb.TRANSFER_PHASE_OFFERED


def test_backoff_grows_with_jitter_honours_hints_and_stops_at_the_deadline():
    now = [0.0]
    b = ShedBackoff(2.0, base_s=0.02, cap_s=0.5, unhinted=2, clock=lambda: now[0], rng=lambda: 1.0)
    # Unhinted: doubling from the base, times the largest jitter; only two of them.
    assert b.next_wait(None) == pytest.approx(0.03)
    assert b.next_wait(None) == pytest.approx(0.06)
    assert b.next_wait(None) is None
    # A hint above the delay is honoured (never undercut by jitter); the delay keeps growing.
    assert b.next_wait(0.3) == pytest.approx(0.45)
    assert b.next_wait(0.0) == pytest.approx(0.24)  # the delay (0.16) once the hint is small
    now[0] = 1.8
    assert b.next_wait(0.3) is None  # would end past the deadline: give up now
    assert b.remaining(5.0) == pytest.approx(0.2)
    low = ShedBackoff(1.0, clock=lambda: 0.0, rng=lambda: 0.0)
    assert low.next_wait(0.1) == pytest.approx(0.1)  # jitter never shortens the hint
    assert RETRY_AFTER_METADATA == "kvbaton-retry-after-ms"


async def test_connector_control_thread_waits_out_a_shed(shedding):
    """The connector's calls (session, and unary when traced) go through the same client:
    shed ones are sent again on the control thread, inside their deadline; submit()
    returns at once, so the engine's loop never waits for the backoff."""
    from kvbaton.connector.control import ControlThread, rendezvous_call

    cp, kv, held = shedding
    ct = ControlThread(cp.address, timeout_s=5.0)
    try:
        tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        t0 = time.monotonic()
        futures = [ct.submit(rendezvous_call("Offer", offer("c1"))),
                   ct.submit(rendezvous_call("Offer", offer("c2"), tp))]
        assert time.monotonic() - t0 < 0.1 and not any(f.done() for f in futures)
        while cp.load.shed < 4:
            await asyncio.sleep(0.01)
        held.release()
        for f in futures:
            r = await asyncio.wait_for(asyncio.wrap_future(f), 5)
            assert r.state.phase == pb.TRANSFER_PHASE_OFFERED
        assert ct.client.session.stats["shed_retries"] >= 1 and ct.client.shed_retries >= 1
    finally:
        await asyncio.get_running_loop().run_in_executor(None, ct.close)


async def test_the_load_monitor_and_its_refusals_are_exported():
    """Operators see how close a replica is to capacity (the loop's busy share and lag, read
    at scrape time) and how many new transfers it refused, before and after overload."""
    from .test_metrics import scrape, val

    cp = await _plane(shed_lag_ms=20.0, metrics_address="127.0.0.1:0")
    kv = KvbatonClient(cp.address, timeout_s=0.5)
    try:
        await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)
        url = cp.web.metrics_url
        held = HeldOverload(cp)
        await held.hold()  # saturated ticks, 100 ms late
        s = await scrape(url)
        assert val(s, "kvbaton_server_loop_busy_ratio") == 1.0
        assert val(s, "kvbaton_server_loop_lag_seconds") == pytest.approx(0.1)
        assert val(s, "kvbaton_server_shed_total") == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv.rendezvous.Offer(offer("t-shed"), timeout=0.5)  # one try, no client retry
        assert err.value.code() == EXHAUSTED
        s = await scrape(url)
        assert val(s, "kvbaton_server_shed_total") == 1
        held.release()
        s = await scrape(url)
        assert val(s, "kvbaton_server_loop_busy_ratio") == 0.0 and val(s, "kvbaton_server_loop_lag_seconds") == 0.0
        await kv.call(kv.rendezvous.Offer, offer("t-after"))  # admitted again
        assert val(await scrape(url), "kvbaton_server_shed_total") == 1
    finally:
        await kv.close()
        await cp.stop()
