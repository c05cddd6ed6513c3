"""Receiver side of the slot-grant protocol: who may WRITE into which of our staging slots.

Why: NIXL WRITEs are one-sided, so a receiver cannot refuse bytes once a sender posts
them. Safety with many senders therefore comes from never letting two senders hold the
same slot: the receiver owns its pool and hands slots out (:class:`SlotGrants`); a sender
writes only slots it holds. A slot changes hands only

* when the chunk in it has been scattered and the ack says ``keep=0`` (the sender never
  writes a slot between posting a chunk into it and receiving that chunk's ack), or
* when the whole transfer is finished, released by its sender, or its grant expired
  (``ttl`` from the sender's request plus ``margin_s``; the sender stops posting at its
  own deadline, which starts earlier, and a margin covers WRITEs still in flight).

Fairness: a new request is served from free slots first; while others wait, an active
grant gives back each slot whose chunk was scattered once it holds more than its fair
share (pool / grants). A grant never holds more slots than its remaining chunks need.
Pure logic with an injected clock: unit-tested without NIXL.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

Key = tuple[str, str]  # (sender agent, transfer id)


@dataclasses.dataclass
class _Grant:
    peer: str
    xfer_id: str
    want: int
    deadline: float
    slots: set[int] = dataclasses.field(default_factory=set)
    nchunks: int = 0  # learnt from the first chunk (0: not yet known)
    done: int = 0

    def useful(self) -> int:
        """Slots this transfer can still use at once."""
        left = self.want if not self.nchunks else min(self.want, self.nchunks - self.done)
        return max(0, left)


@dataclasses.dataclass(frozen=True)
class Handout:
    """Slots newly given to a sender (send them as a ``Grant`` message)."""

    peer: str
    xfer_id: str
    slots: tuple[int, ...]


class SlotGrants:
    """The receive pool's slot ownership. All methods run on the endpoint's owner thread."""

    def __init__(self, num_slots: int, *, margin_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, local: str | None = None,
                 sending: Callable[[], bool] | None = None) -> None:
        """``local``: the pool is shared with our own sends, granted as the grantee
        ``local``. While both directions use the pool, our sends hold at most
        ``num_slots - 1`` slots and the peers' grants together at most ``num_slots - 1``
        too, so each side always has a slot to make progress with: two engines sending to
        each other at once could otherwise each grant the other its whole pool and wait
        forever for a slot of their own (our gathered chunks hold our slots until the peer
        has a slot for them).

        With one direction alone the whole pool goes to it (one slot more in flight: a
        quarter more of the shipped 4-slot pool). That stays deadlock-free:

        * our sends take the last slot only while no peer grant is active or waiting. Our
          send asks for our slots only after the receiver granted its own, so if two
          engines' sends each held a whole pool, each receiver's grant would have come
          before the other's request arrived, and each request after its own grant: a
          cycle in time, impossible (the same for longer cycles of engines);
        * peers take the last slot only while we have no grant of our own and
          ``sending()`` says we start no send (the owner's outgoing transfers, including
          ones not yet granted). A peer's request arrives after its send started, so a
          cycle of engines each lending its whole pool before its own send started is
          impossible in the same way.

        Either way, once the other direction asks, the holder gives slots back as its
        chunks finish (fair share), and the caps apply again."""
        if num_slots <= 0:
            raise ValueError("a staging pool needs at least one slot")
        if local is not None and num_slots < 2:
            raise ValueError("a pool shared by both directions needs at least two slots")
        self.local = local
        self._sending = sending
        self.num_slots = int(num_slots)
        self.margin_s = float(margin_s)
        self._clock = clock
        self._free: collections.deque[int] = collections.deque(range(self.num_slots))
        self._active: dict[Key, _Grant] = {}
        self._waiting: collections.OrderedDict[Key, _Grant] = collections.OrderedDict()
        self.expired = 0  # grants reclaimed at their deadline (a sender that never finished)

    # ------------------------------------------------------------------ queries
    @property
    def busy(self) -> bool:
        return bool(self._active or self._waiting)

    def holder(self, slot: int) -> Key | None:
        for k, g in self._active.items():
            if slot in g.slots:
                return k
        return None

    def slots_of(self, peer: str, xfer_id: str) -> frozenset[int]:
        g = self._active.get((peer, xfer_id))
        return frozenset(g.slots) if g else frozenset()

    def owns(self, peer: str, xfer_id: str, slot: int) -> bool:
        g = self._active.get((peer, xfer_id))
        return g is not None and slot in g.slots

    def free_slots(self) -> int:
        return len(self._free)

    # ------------------------------------------------------------------ events
    def request(self, peer: str, xfer_id: str, want: int, ttl_s: float) -> list[Handout]:
        """A sender asks for up to ``want`` slots, valid ``ttl_s`` (plus our margin).

        Returns the handouts to send now (this one if slots are free, else it waits in
        FIFO order). A repeated request for a known transfer changes nothing."""
        key = (peer, xfer_id)
        if key in self._active or key in self._waiting:
            return []
        if want <= 0 or ttl_s <= 0:
            raise ValueError(f"grant request needs want > 0 and ttl > 0 (got {want}, {ttl_s})")
        g = _Grant(peer, xfer_id, int(want), self._clock() + float(ttl_s) + self.margin_s)
        self._waiting[key] = g
        return self._distribute()

    def chunk_done(self, peer: str, xfer_id: str, slot: int, nchunks: int) -> tuple[bool, list[Handout]]:
        """The chunk in ``slot`` is scattered: does the sender keep the slot, and which
        handouts follow. Finishing the last chunk frees the whole grant."""
        g = self._active.get((peer, xfer_id))
        if g is None or slot not in g.slots:
            return False, []
        g.done += 1
        if nchunks > 0:
            g.nchunks = nchunks
        if g.nchunks and g.done >= g.nchunks:
            return False, self._finish((peer, xfer_id))
        if len(g.slots) > g.useful() or (len(g.slots) > 1 and self._starving(g)):
            g.slots.discard(slot)
            self._free.append(slot)
            return False, self._distribute()
        return True, []

    def release(self, peer: str, xfer_id: str) -> list[Handout]:
        """The sender is done with this transfer (finished elsewhere, or aborted with
        nothing in flight): every slot it holds comes back."""
        self._waiting.pop((peer, xfer_id), None)
        return self._finish((peer, xfer_id))

    def expire(self) -> list[Handout]:
        """Reclaim grants past their deadline (a sender that vanished) and drop waiters
        whose sender has given up by now."""
        now = self._clock()
        for key in [k for k, g in self._waiting.items() if now >= g.deadline]:
            del self._waiting[key]
        gone = [k for k, g in self._active.items() if now >= g.deadline]
        for key in gone:  # all first: no handout may go to a grant expiring in this call
            self.expired += 1
            self._free.extend(sorted(self._active.pop(key).slots))
        return self._distribute() if gone else []

    # ------------------------------------------------------------------ internals
    def _fair(self) -> int:
        return max(1, self.num_slots // max(1, len(self._active) + len(self._waiting)))

    def _starving(self, g: _Grant) -> bool:
        """Someone else needs slots and ``g`` holds more than its share."""
        if len(g.slots) <= self._fair():
            return False
        if self._waiting:
            return True
        fair = self._fair()
        return any(len(h.slots) < min(h.useful(), fair) for h in self._active.values() if h is not g)

    def _room(self, g: _Grant) -> int:
        """How many more slots ``g`` may hold (the shared pool's caps, see ``local``)."""
        if self.local is None:
            return self.num_slots
        grants = (*self._active.values(), *self._waiting.values())
        if g.peer == self.local:
            peers = any(h.peer != self.local for h in grants)
            return self.num_slots - (1 if peers else 0) - len(g.slots)
        ours = any(h.peer == self.local for h in grants) or (
            self._sending is None or self._sending())
        held = sum(len(h.slots) for h in self._active.values() if h.peer != self.local)
        return self.num_slots - (1 if ours else 0) - held

    def _finish(self, key: Key) -> list[Handout]:
        g = self._active.pop(key, None)
        if g is None:
            return []
        self._free.extend(sorted(g.slots))
        g.slots.clear()
        return self._distribute()

    def _distribute(self) -> list[Handout]:
        """Free slots to waiters (oldest first, up to a fair share each), then to active
        grants that could use more (fewest slots first)."""
        given: dict[Key, list[int]] = {}
        now = self._clock() if self._free and self._waiting else 0.0
        for key, g in list(self._waiting.items()):
            if not self._free:
                break
            if now >= g.deadline:  # its sender has given up by now
                del self._waiting[key]
                continue
            room = self._room(g)
            if room <= 0:  # the shared pool's cap: it waits (others behind it may not)
                continue
            del self._waiting[key]
            self._active[key] = g
            n = max(1, min(g.useful(), self._fair(), len(self._free), room))
            for _ in range(n):
                s = self._free.popleft()
                g.slots.add(s)
                given.setdefault(key, []).append(s)
        while self._free:
            hungry = [g for g in self._active.values() if len(g.slots) < g.useful() and self._room(g) > 0]
            if not hungry:
                break
            g = min(hungry, key=lambda h: len(h.slots))
            s = self._free.popleft()
            g.slots.add(s)
            given.setdefault((g.peer, g.xfer_id), []).append(s)
        return [Handout(p, x, tuple(s)) for (p, x), s in given.items()]
