"""Overload is clean: past capacity a real `kvbaton serve` answers OK or RESOURCE_EXHAUSTED
with a reason, never CANCELLED, and loses no transfer it accepted.

Before the fix, a burst of a few thousand unary calls overflowed gRPC core's pending
list (``grpc.server.max_pending_requests``, 1,000) and core answered part of it
``CANCELLED`` before any handler ran (services/api/overload.py says why).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import grpc
import pytest

from kvbaton.client import KvbatonClient
from kvbaton.services.api.overload import LoopLag
from kvbaton.stack.pd_stack import stop_group
from kvbaton.v1 import common_pb2, rendezvous_pb2, rendezvous_pb2_grpc

from .helpers import register

OK, SHED = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED
BURST = 1_500  # transfers at once: 3,000 unary calls, past core's old 1,000 pending


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server_address():
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, KVBATON_LOG_LEVEL="WARNING")
    proc = subprocess.Popen([sys.executable, "-m", "kvbaton.cli", "serve", "--insecure", "--listen", address],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        yield address
    finally:
        stop_group(proc)


async def _burst(kv: KvbatonClient, send, tag: str) -> None:
    """Sends BURST transfers at once through ``send(tid, offer, complete) -> (code, details)``
    pairs and checks the answers, the matches and the ledger."""
    pre, dec = f"pre-{tag}", f"dec-{tag}"
    await register(kv, pre, common_pb2.ENGINE_ROLE_PREFILL)
    await register(kv, dec, common_pb2.ENGINE_ROLE_DECODE)
    matched: set[str] = set()
    ready = asyncio.Event()
    all_matched = asyncio.Event()
    expected: set[str] = set()

    async def consume() -> None:
        async for ev in kv.subscribe(pre, 0, heartbeats=True):
            if ev.type == rendezvous_pb2.RendezvousEvent.TYPE_HEARTBEAT:
                ready.set()
            elif ev.type == rendezvous_pb2.RendezvousEvent.TYPE_MATCH:
                matched.add(ev.transfer.transfer_id)
                if expected and expected <= matched:
                    all_matched.set()

    consumer = asyncio.ensure_future(consume())
    try:
        await asyncio.wait_for(ready.wait(), 10)
        blocks = [1, 2, 3]
        tids = [f"{tag}-{i}" for i in range(BURST)]
        answers = await asyncio.gather(*(send(
            tid, rendezvous_pb2.OfferRequest(transfer_id=tid, decode_engine_id=dec, block_ids=blocks, timeout_ms=60_000),
            rendezvous_pb2.CompleteRequest(transfer_id=tid, prefill_engine_id=pre, block_ids=blocks, timeout_ms=60_000))
            for tid in tids))
        codes = [code for pair in answers for code, _ in pair]
        counts = {c.name: codes.count(c) for c in set(codes)}
        assert set(codes) <= {OK, SHED}, (counts, [d for pair in answers for c, d in pair if c not in (OK, SHED)][:3])
        assert codes.count(OK) > 0, counts
        for pair in answers:
            for code, details in pair:
                if code == SHED:
                    assert "overloaded" in details, details
        accepted = {tid for tid, pair in zip(tids, answers) if all(code == OK for code, _ in pair)}
        expected.update(accepted)
        if accepted and not accepted <= matched:
            await asyncio.wait_for(all_matched.wait(), 60)
        assert accepted <= matched, f"{len(accepted - matched)} accepted transfers never matched"
        # A transfer with one side accepted is in the ledger, waiting, with a deadline: it
        # will expire with an outcome (EXPIRED), not vanish.
        for tid, pair in zip(tids, answers):
            if [code for code, _ in pair].count(OK) == 1:
                t = await kv.call(kv.rendezvous.GetTransfer, rendezvous_pb2.GetTransferRequest(transfer_id=tid))
                side = t.offer if t.offer.engine_id else t.completion
                assert t.phase in (rendezvous_pb2.TRANSFER_PHASE_OFFERED, rendezvous_pb2.TRANSFER_PHASE_COMPLETED), t
                assert side.deadline_ms > 0
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)


@pytest.mark.timeout(180)
async def test_burst_past_capacity_is_ok_or_resource_exhausted(server_address):
    channels = [grpc.aio.insecure_channel(server_address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(2)]
    stubs = [rendezvous_pb2_grpc.RendezvousStub(c) for c in channels]
    try:
        async with KvbatonClient(server_address, timeout_s=30) as kv, \
                KvbatonClient(server_address, timeout_s=30) as peer:
            await kv.wait_ready(60)

            async def unary(tid, offer, complete):
                stub = stubs[hash(tid) % len(stubs)]

                async def one(method, req):
                    try:
                        await method(req, timeout=60)
                        return OK, ""
                    except grpc.aio.AioRpcError as exc:
                        return exc.code(), exc.details() or ""
                return await asyncio.gather(one(stub.Offer, offer), one(stub.Complete, complete))

            async def session(tid, offer, complete):
                async def one(fn, req):
                    try:
                        await fn(req)
                        return OK, ""
                    except grpc.aio.AioRpcError as exc:
                        return exc.code(), exc.details() or ""
                return await asyncio.gather(one(peer.session.offer, offer), one(kv.session.complete, complete))

            await _burst(kv, unary, "u")
            await _burst(kv, session, "s")
    finally:
        for c in channels:
            await c.close(grace=0)


def test_loop_lag_sheds_only_while_behind():
    load = LoopLag(max_lag_ms=20, max_busy=0.95, window=2, admit_per_tick=1)
    assert load.refuse() is None
    load.observe(1.0, 0.99)
    load.observe(1.0, 0.97)  # busy for the whole window: behind
    assert load.refuse() is None  # the tick's one admission: a saturated server still makes progress
    reason = load.refuse()
    assert reason is not None and "overloaded" in reason and "97% busy" in reason
    load.observe(1.0, 0.30)  # it waited again: caught up
    assert not load.overloaded
    load.observe(45.0, 0.10)  # late but idle: starved by other processes, not behind on calls
    assert not load.overloaded and load.refuse() is None
    load.observe(45.0, 0.80)  # one very late timer in a busy loop: a long turn
    assert load.overloaded and load.refuse() is None and "45 ms behind" in load.refuse()
    load.observe(1.0, 0.1)
    load.observe(1.0, 0.1)
    assert load.refuse() is None
    assert load.shed == 2
    assert not LoopLag(max_lag_ms=0).overloaded  # 0: never shed


def test_on_uvloop_a_saturated_loop_reads_busy_and_an_idle_one_does_not():
    """uvloop has no selector to time: busy is CPU time over the time the thread was not
    waiting for a CPU (schedstat), so a loop with work all the time reads saturated even
    when the machine gives it only part of a core, and an idle one reads idle."""
    import time

    uvloop = pytest.importorskip("uvloop")

    async def main() -> tuple[float, list[bool]]:
        load = LoopLag(max_lag_ms=20, tick_s=0.01, window=3)
        load.start()
        await asyncio.sleep(0.3)
        idle = load.busy
        loop = asyncio.get_running_loop()
        stop = time.monotonic() + 0.6

        def spin() -> None:  # callbacks back to back, 3 ms each: calls queued faster than served
            t = time.monotonic()
            while time.monotonic() - t < 0.003:
                pass
            if time.monotonic() < stop:
                loop.call_soon(spin)

        loop.call_soon(spin)
        seen = []
        while time.monotonic() < stop:
            await asyncio.sleep(0.02)
            seen.append(load.overloaded)
        await load.stop()
        return idle, seen

    idle, seen = uvloop.run(main())
    assert idle < 0.5, idle
    assert any(seen), seen


def test_serve_picks_uvloop_where_it_imports_and_falls_back_to_asyncio(monkeypatch):
    import sys

    from kvbaton.cli import loop_runner

    uvloop = pytest.importorskip("uvloop")
    assert loop_runner("auto") is uvloop.run and loop_runner("uvloop") is uvloop.run
    assert loop_runner("asyncio") is asyncio.run
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: the import fails
    assert loop_runner("auto") is asyncio.run
    assert loop_runner("uvloop") is None  # asked for by name: `serve` says so and exits 2
