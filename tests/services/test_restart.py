"""The embedded store restarts (the server is killed with SIGKILL and started again on the
same port): revisions begin again at 1 and everything it held is gone. Clients notice
the new incarnation: a subscription starts from scratch instead of dropping new events
at or below its old revision, engines re-register within a second or two, and a
LeaseKeeper says that its lease is gone."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from kvbaton.client import KvbatonClient, LeaseKeeper, LeaseLost
from kvbaton.connector.control import ControlThread
from kvbaton.stack.ports import free_port
from kvbaton.v1 import common_pb2, lease_pb2, registrar_pb2, rendezvous_pb2
from tests.services.helpers import engine_rank, register

Ev = rendezvous_pb2.RendezvousEvent


class Server:
    """``kvbaton serve`` (memory store) in its own process, restartable on one port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    async def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbaton.cli", "serve", "--insecure", "--listen", self.address, "--log-level", "WARNING"],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = KvbatonClient(self.address, timeout_s=5)
        try:
            await probe.wait_ready(30)
        finally:
            await probe.close()

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
async def server():
    srv = Server()
    await srv.start()
    yield srv
    if srv.proc is not None and srv.proc.poll() is None:
        srv.kill()


async def test_subscription_restarts_from_scratch_under_a_new_store_incarnation(server):
    kv = KvbatonClient(server.address, timeout_s=5)
    events: asyncio.Queue = asyncio.Queue()

    async def consume() -> None:
        async for ev in kv.subscribe("dec", 0):
            await events.put(ev)

    async def expect(kind: int, transfer_id: str, timeout: float = 15.0) -> Ev:
        async def loop():
            while True:
                ev = await events.get()
                if ev.type == kind and ev.transfer.transfer_id == transfer_id:
                    return ev
        return await asyncio.wait_for(loop(), timeout)

    try:
        await register(kv, "dec")
        task = asyncio.ensure_future(consume())
        # Push the old incarnation's revision well up; the last one ends in an EXPIRED event.
        for i in range(60):
            await kv.call(kv.rendezvous.Offer, rendezvous_pb2.OfferRequest(
                transfer_id=f"old-{i}", decode_engine_id="dec", block_ids=[1], timeout_ms=600_000))
        await kv.call(kv.rendezvous.Offer, rendezvous_pb2.OfferRequest(
            transfer_id="old-exp", decode_engine_id="dec", block_ids=[1], timeout_ms=200))
        old = await expect(Ev.TYPE_EXPIRED, "old-exp")
        first_incarnation = kv.store_incarnation
        assert first_incarnation and old.revision > 60

        server.kill()
        await server.start()
        await register(kv, "dec")
        await kv.call(kv.rendezvous.Offer, rendezvous_pb2.OfferRequest(
            transfer_id="new-exp", decode_engine_id="dec", block_ids=[1], timeout_ms=200))
        new = await expect(Ev.TYPE_EXPIRED, "new-exp")
        # Under the old revision numbering this event would have been dropped as already seen.
        assert new.revision < old.revision
        assert kv.store_incarnation != first_incarnation and kv.incarnation_changes == 1
        task.cancel()
    finally:
        await kv.close()


async def test_lease_keeper_says_its_lease_is_gone_after_the_restart(server):
    kv = KvbatonClient(server.address, timeout_s=3)
    lost: asyncio.Queue = asyncio.Queue()
    try:
        await register(kv, "dec")
        await kv.call(kv.lease.Grant, lease_pb2.GrantRequest(conversation_id="conv", engine_id="dec", ttl_ms=30_000))
        async with LeaseKeeper(kv, "conv", on_lost=lost.put_nowait) as keeper:
            assert keeper.last.status == lease_pb2.RENEW_STATUS_OK
            keeper.check()
            server.kill()
            await server.start()
            # The keeper renews every 10 s; it learns of the restart from the new
            # incarnation (its KeepAlive stream reconnects) and renews at once.
            t0 = time.monotonic()
            result = await asyncio.wait_for(lost.get(), 15)
            assert result.status == lease_pb2.RENEW_STATUS_NOT_FOUND
            assert time.monotonic() - t0 < 8
            with pytest.raises(LeaseLost, match="conv"):
                keeper.check()
    finally:
        await kv.close()


async def test_engines_re_register_within_seconds_of_the_restart(server):
    control = ControlThread(server.address, timeout_s=3)
    rank = engine_rank("dec-c", common_pb2.ENGINE_ROLE_DECODE)
    kv = KvbatonClient(server.address, timeout_s=3)
    try:
        control.register_rank(rank, ttl_ms=30_000)  # refreshes only every 10 s
        control.subscribe("dec-c", 0, lambda ev: None)

        async def registered() -> None:
            while True:
                try:
                    await kv.registrar.GetEngine(registrar_pb2.GetEngineRequest(engine_id="dec-c"), timeout=2)
                    return
                except Exception:  # noqa: BLE001 - not yet (NOT_FOUND) or server not up
                    await asyncio.sleep(0.1)

        await asyncio.wait_for(registered(), 10)
        await asyncio.sleep(0.5)
        server.kill()
        await server.start()
        t0 = time.monotonic()
        await asyncio.wait_for(registered(), 10)
        took = time.monotonic() - t0
        assert took < 3.0, f"re-registered {took:.1f} s after the restart"
    finally:
        await kv.close()
        control.close()
