"""A prefill engine's rendezvous events from two sources, merged for its one subscriber.

Why: a match costs the server about five gRPC messages (two calls in, two answers out, the
MATCH event out), and at these sizes gRPC costs per message, not per byte
(``benchmarks/grpc_floor.py``). When the engine's only subscriber and its completions
share one :class:`kvbaton.client.KvbatonClient`, the answer of the completion that made the
match already holds the match: the client asks the server to let that answer *be* the
MATCH (``CompleteRequest.match_in_answer``), and the server then sends no separate event on
the engine's Subscribe stream. This inbox hands the subscriber both the stream's events and
those answered MATCHes, as one sequence.

Ordering: an answer can arrive after a later event of the same transfer on the stream (the
decode cancelled right after the match). An answered MATCH whose transfer already ended on
the stream is dropped, so prefill never writes into blocks decode has let go.
Duplicates: a completion sent again after a broken stream is answered with the MATCH
again; it is delivered once.
The inbox outlives one subscription (a subscriber that re-subscribes after a failure still
gets the MATCHes answered meanwhile); stream events left unread when a subscription ends
are dropped, since the next subscription replays or resumes them itself.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator, AsyncIterator

from kvbaton.v1 import rendezvous_pb2

Ev = rendezvous_pb2.RendezvousEvent
_ENDED = (Ev.TYPE_EXPIRED, Ev.TYPE_CANCELLED, Ev.TYPE_DONE)


def _remember(seen: collections.OrderedDict[tuple[str, int], None], key: tuple[str, int], limit: int) -> None:
    seen[key] = None
    seen.move_to_end(key)
    while len(seen) > limit:
        seen.popitem(last=False)


class MatchInbox:
    """Events for one engine's sole subscriber: stream events and answered MATCHes."""

    # Stream events buffered before the stream's reader waits (the server's back-pressure
    # on a subscriber that does not read still applies).
    MAX_QUEUED = 1024
    # Transfers remembered as delivered or ended (bounded memory).
    REMEMBER = 8192

    def __init__(self) -> None:
        self._items: collections.deque[tuple[bool, rendezvous_pb2.RendezvousEvent]] = collections.deque()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        # Transfers whose MATCH came on an answer; those that ended on the stream.
        self._delivered: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self._ended: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self.subscribed = 0  # subscriptions open now: while none is, completions do not ask
        self.stats = {"answered_matches": 0, "stream_events": 0, "dropped_ended": 0, "dropped_duplicate": 0}

    def answered(self, state: rendezvous_pb2.TransferState) -> None:
        """A completion's answer that was its engine's MATCH (``match_delivered``)."""
        key = (state.transfer_id, state.attempt)
        if key in self._ended:
            self.stats["dropped_ended"] += 1
            return
        if key in self._delivered:
            self.stats["dropped_duplicate"] += 1
            return
        _remember(self._delivered, key, self.REMEMBER)
        self.stats["answered_matches"] += 1
        # Revision 0: it came on an answer, not the stream (resume positions ignore it).
        self._items.append((False, Ev(type=Ev.TYPE_MATCH, transfer=state, revision=0)))
        self._wake.set()

    async def _put_stream(self, event: rendezvous_pb2.RendezvousEvent) -> None:
        key = (event.transfer.transfer_id, event.transfer.attempt)
        if event.type in _ENDED:
            _remember(self._ended, key, self.REMEMBER)
        elif event.type == Ev.TYPE_MATCH and key in self._delivered:
            # Already delivered from an answer (a server that sent both): once is enough.
            self.stats["dropped_duplicate"] += 1
            return
        while len(self._items) >= self.MAX_QUEUED:
            self._room.clear()
            await self._room.wait()
        self.stats["stream_events"] += 1
        self._items.append((True, event))
        self._wake.set()

    async def merge(self, stream: AsyncIterator[rendezvous_pb2.RendezvousEvent]
                    ) -> AsyncGenerator[rendezvous_pb2.RendezvousEvent, None]:
        """The subscription: ``stream``'s events and answered MATCHes, as they come. What
        ends ``stream`` (an error) ends this too, after what was already queued."""
        failure: list[BaseException] = []

        async def pump() -> None:
            try:
                async for event in stream:
                    await self._put_stream(event)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the subscriber below
                failure.append(exc)
            else:
                failure.append(StopAsyncIteration())
            self._wake.set()

        self.subscribed += 1
        task = asyncio.get_running_loop().create_task(pump(), name="kvbaton-match-inbox")
        try:
            while True:
                while not self._items:
                    if failure:
                        if isinstance(failure[0], StopAsyncIteration):
                            return
                        raise failure[0]
                    self._wake.clear()
                    await self._wake.wait()
                _, event = self._items.popleft()
                if len(self._items) < self.MAX_QUEUED // 2:
                    self._room.set()
                yield event
        finally:
            self.subscribed -= 1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
            # The next subscription replays or resumes the stream's own events.
            self._items = collections.deque(item for item in self._items if not item[0])
            self._room.set()
