"""The session client's Nagle window (``RendezvousSession.max_in_flight``), against a
scripted server (logic only: the server decides when answers go out): a call made while
nothing is in flight goes out at once, calls made while a message is unanswered go out
together in the next one, and one slow call holds the others back for at most
``max_hold_s``."""

from __future__ import annotations

import asyncio
import contextlib

from kvbaton.client import KvbatonClient
from kvbaton.v1 import rendezvous_pb2 as pb
from kvbaton.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.services.helpers import serve_rendezvous
from tests.services.test_rendezvous import offer


class Scripted(pb_grpc.RendezvousServicer):
    """Records each message's calls; answers a message only once ``release`` is set for it
    (by its first call's transfer id), or at once when it is not held."""

    def __init__(self, held: set[str]) -> None:
        self.held = held
        self.release: dict[str, asyncio.Event] = {t: asyncio.Event() for t in held}
        self.messages: list[list[str]] = []
        self.arrived = asyncio.Event()

    async def Session(self, request_iterator, context):
        queue: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            async for req in request_iterator:
                tids = [c.offer.transfer_id for c in req.calls]
                self.messages.append(tids)
                self.arrived.set()
                asyncio.ensure_future(answer(req, tids))

        async def answer(req, tids) -> None:
            if tids[0] in self.held:
                await self.release[tids[0]].wait()
            await queue.put(pb.SessionResponse(results=[
                pb.SessionResult(seq=c.seq, rendezvous=pb.RendezvousResponse(state=pb.TransferState(
                    transfer_id=c.offer.transfer_id))) for c in req.calls]))

        reader = asyncio.ensure_future(read())
        try:
            while True:
                yield await queue.get()
        finally:
            reader.cancel()

    async def wait_messages(self, n: int) -> None:
        async def loop() -> None:
            while len(self.messages) < n:
                self.arrived.clear()
                await self.arrived.wait()
        await asyncio.wait_for(loop(), 5)


@contextlib.asynccontextmanager
async def scripted(held: set[str]):
    """(the scripted server, a client of it)."""
    server_impl = Scripted(held)
    server, address = await serve_rendezvous(server_impl)
    kv = KvbatonClient(address, timeout_s=5)
    try:
        yield server_impl, kv
    finally:
        await kv.close()
        await server.stop(0)


async def test_calls_made_while_a_message_is_in_flight_go_together_in_the_next():
    async with scripted({"a"}) as (server_impl, kv):
        kv.session.max_hold_s = 30.0  # only the answer frees the window here
        first = asyncio.ensure_future(kv.session.offer(offer("a")))
        await server_impl.wait_messages(1)  # nothing was in flight: sent at once, alone
        rest = [asyncio.ensure_future(kv.session.offer(offer(t))) for t in ("b", "c", "d")]
        await asyncio.sleep(0.2)
        assert server_impl.messages == [["a"]]  # held back while "a" is unanswered
        server_impl.release["a"].set()
        answers = await asyncio.wait_for(asyncio.gather(first, *rest), 5)
        assert [r.state.transfer_id for r in answers] == ["a", "b", "c", "d"]
        assert server_impl.messages == [["a"], ["b", "c", "d"]]
        assert kv.session.stats["sent_batches"] == 2 and kv.session.stats["sent_calls"] == 4


async def test_a_slow_call_holds_the_next_ones_back_for_at_most_max_hold():
    async with scripted({"slow"}) as (server_impl, kv):
        kv.session.max_hold_s = 0.1
        slow = asyncio.ensure_future(kv.session.offer(offer("slow")))
        await server_impl.wait_messages(1)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        fast = await asyncio.wait_for(kv.session.offer(offer("fast")), 5)
        assert fast.state.transfer_id == "fast" and not slow.done()
        assert 0.09 <= loop.time() - t0 < 2.0  # held for max_hold_s, then sent anyway
        assert server_impl.messages == [["slow"], ["fast"]]
        server_impl.release["slow"].set()
        assert (await asyncio.wait_for(slow, 5)).state.transfer_id == "slow"


async def test_without_a_window_every_call_goes_out_at_once():
    async with scripted({"x"}) as (server_impl, kv):
        kv.session.max_in_flight = 0
        held = asyncio.ensure_future(kv.session.offer(offer("x")))
        await server_impl.wait_messages(1)
        assert (await asyncio.wait_for(kv.session.offer(offer("y")), 5)).state.transfer_id == "y"
        assert server_impl.messages == [["x"], ["y"]]
        server_impl.release["x"].set()
        await asyncio.wait_for(held, 5)
