"""Slot grants (receiver side of the pack path) and the staging wire format: pure logic."""

from __future__ import annotations

import numpy as np
import pytest

from kvbaton.connector import wire
from kvbaton.connector.transfer.staging_grants import SlotGrants


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def held(g: SlotGrants, peer: str, x: str) -> set[int]:
    return set(g.slots_of(peer, x))


def test_single_sender_gets_what_it_can_use() -> None:
    g = SlotGrants(4)
    (h,) = g.request("a", "x", want=2, ttl_s=10)
    assert (h.peer, h.xfer_id, sorted(h.slots)) == ("a", "x", [0, 1])
    assert g.free_slots() == 2
    # a grant never holds more than its remaining chunks need: slots come back at the tail
    keep, more = g.chunk_done("a", "x", 0, nchunks=3)
    assert keep and not more
    keep, _ = g.chunk_done("a", "x", 1, nchunks=3)  # 1 chunk left, 2 slots held
    assert not keep and held(g, "a", "x") == {0}
    keep, _ = g.chunk_done("a", "x", 0, nchunks=3)  # last chunk: the grant ends
    assert not keep and not g.busy and g.free_slots() == 4


def test_two_senders_never_share_a_slot_and_both_progress() -> None:
    g = SlotGrants(4)
    (h1,) = g.request("a", "x", want=8, ttl_s=10)
    assert len(h1.slots) == 4  # alone: the whole pool
    assert g.request("b", "y", want=8, ttl_s=10) == []  # waits
    # a's next scattered chunk goes to b (a holds more than its fair share of 2)
    keep, handed = g.chunk_done("a", "x", sorted(h1.slots)[0], nchunks=20)
    assert not keep and [(h.peer, h.xfer_id, len(h.slots)) for h in handed] == [("b", "y", 1)]
    keep, handed = g.chunk_done("a", "x", sorted(h1.slots)[1], nchunks=20)
    assert not keep and [(h.peer, len(h.slots)) for h in handed] == [("b", 1)]
    # now 2 + 2: fair, both keep their slots
    a, b = held(g, "a", "x"), held(g, "b", "y")
    assert len(a) == len(b) == 2 and not a & b
    keep, handed = g.chunk_done("a", "x", min(a), nchunks=20)
    assert keep and not handed
    # every slot has exactly one holder (or is free)
    for s in range(4):
        assert g.holder(s) in (("a", "x"), ("b", "y"))
    # b finishes: its slots go back to a
    g.release("b", "y")
    assert len(held(g, "a", "x")) == 4


def test_shared_pool_keeps_a_slot_for_each_direction() -> None:
    """A pool shared with our own sends (grantee "" here): our sends hold at most N-1
    slots and the peers together at most N-1, so neither direction can take the whole
    pool while the other waits for a slot forever (two engines sending to each other)."""
    g = SlotGrants(4, local="")
    (h,) = g.request("peer1", "x", want=8, ttl_s=10)
    assert len(h.slots) == 3 and g.free_slots() == 1  # one kept for our own sends
    assert g.request("peer2", "y", want=8, ttl_s=10) == []  # the peers' 3 are taken: waits
    (mine,) = g.request("", "s", want=8, ttl_s=10)  # our send still gets the kept slot
    assert (mine.peer, len(mine.slots)) == ("", 1)
    # peer1's scattered chunk goes to the waiting peer2 (peers stay at 3 in all)
    keep, handed = g.chunk_done("peer1", "x", sorted(h.slots)[0], nchunks=20)
    assert not keep and [(x.peer, len(x.slots)) for x in handed] == [("peer2", 1)]
    peers = held(g, "peer1", "x") | held(g, "peer2", "y")
    assert len(peers) == 3 and not peers & held(g, "", "s")
    with pytest.raises(ValueError, match="two slots"):
        SlotGrants(1, local="")


def test_shared_pool_lends_everything_to_one_direction_alone() -> None:
    """One direction alone gets the whole shared pool (one slot more in flight); once the
    other direction asks, the holder gives slots back as its chunks finish, down to the
    caps of both directions at once."""
    sending = [False]
    # a peer alone (we send nothing): all 4 slots
    g = SlotGrants(4, local="", sending=lambda: sending[0])
    (h,) = g.request("peer", "x", want=8, ttl_s=10)
    assert len(h.slots) == 4 and g.free_slots() == 0
    # our send starts: it waits, and gets the peer's slots as the peer's chunks finish
    sending[0] = True
    assert g.request("", "s", want=8, ttl_s=10) == []
    got: list[int] = []
    for s in sorted(h.slots):
        keep, handed = g.chunk_done("peer", "x", s, nchunks=20)
        got += [x for ho in handed if ho.peer == "" for x in ho.slots]
        if keep:
            break
    assert got and len(held(g, "peer", "x")) >= 1
    assert len(held(g, "peer", "x")) + len(held(g, "", "s")) <= 4
    assert not held(g, "peer", "x") & held(g, "", "s")
    # while we send (even before our own grant exists), a peer gets at most 3
    g3 = SlotGrants(4, local="", sending=lambda: True)
    (h3,) = g3.request("peer", "x", want=8, ttl_s=10)
    assert len(h3.slots) == 3
    # without a sending() hook the peers' cap always holds
    (h4,) = SlotGrants(4, local="").request("peer", "x", want=8, ttl_s=10)
    assert len(h4.slots) == 3
    # our send alone: all 4; a peer's request then waits for one of them
    g2 = SlotGrants(4, local="", sending=lambda: True)
    (m2,) = g2.request("", "s", want=8, ttl_s=10)
    assert len(m2.slots) == 4
    assert g2.request("peer", "x", want=8, ttl_s=10) == []
    keep, handed = g2.chunk_done("", "s", sorted(m2.slots)[0], nchunks=20)
    assert not keep and [(x.peer, len(x.slots)) for x in handed] == [("peer", 1)]
    assert len(held(g2, "", "s")) == 3 and len(held(g2, "peer", "x")) == 1


def test_waiters_are_served_in_order_and_a_finished_grant_frees_everything() -> None:
    g = SlotGrants(2)
    g.request("a", "x", want=2, ttl_s=10)
    assert g.request("b", "y", want=2, ttl_s=10) == []
    assert g.request("c", "z", want=2, ttl_s=10) == []
    for s in (0, 1):
        g.chunk_done("a", "x", s, nchunks=2)  # a finishes
    assert held(g, "b", "y") and held(g, "c", "z")  # one slot each (fair share of 2 over 2)
    assert g.request("b", "y", want=2, ttl_s=10) == []  # repeated request: no change


def test_unused_grant_expires_and_goes_to_the_next_sender() -> None:
    clock = Clock()
    g = SlotGrants(3, margin_s=1.0, clock=clock)
    g.request("ghost", "x", want=3, ttl_s=5)  # never writes, never releases
    clock.t += 3
    assert g.request("b", "y", want=3, ttl_s=5) == []
    clock.t += 2.9
    assert g.expire() == []  # deadline = ttl + margin
    clock.t += 0.2
    (h,) = g.expire()
    assert (h.peer, len(h.slots)) == ("b", 3) and g.expired == 1
    assert not g.owns("ghost", "x", 0)
    # a late chunk from the ghost is not acknowledged as its own
    assert g.chunk_done("ghost", "x", 0, nchunks=1) == (False, [])
    # a waiter whose sender gave up long ago is dropped, not granted
    g2 = SlotGrants(1, margin_s=0.0, clock=clock)
    g2.request("a", "x", want=1, ttl_s=100)
    g2.request("late", "w", want=1, ttl_s=1)
    clock.t += 2
    g2.release("a", "x")
    assert not g2.busy and g2.free_slots() == 1


def test_bad_requests() -> None:
    g = SlotGrants(2)
    with pytest.raises(ValueError):
        g.request("a", "x", want=0, ttl_s=1)
    with pytest.raises(ValueError):
        SlotGrants(0)


def test_wire_round_trip() -> None:
    ids = np.array([5, 1, 9], dtype=np.int64)
    msgs = [wire.StagedGrant("x1", [0, 3], 1 << 40, 32 << 20, "VRAM", 1),
            wire.StagedChunk("x1", 2, 5, 9, 0, 128, 16, 19), wire.StagedAck("x1", 3, 7, True),
            wire.StagedAck("x1", 2, 8, False), wire.StagedRelease("x1"),
            wire.StagedDeny("x1", "cancelled by the receiver")]
    for m in msgs:
        assert wire.decode(wire.encode(m)) == m
    q = wire.decode(wire.encode(wire.StagedGrantRequest("x1", 4, 30000, ids)))
    assert isinstance(q, wire.StagedGrantRequest) and (q.want, q.ttl_ms, q.dst.tolist()) == (4, 30000, [5, 1, 9])
    p = wire.decode(wire.encode(wire.StagedPull("x2", ids, ids[::-1])))
    assert isinstance(p, wire.StagedPull) and p.src.tolist() == [5, 1, 9] and p.dst.tolist() == [9, 1, 5]
    assert all(wire.encode(m).startswith(wire.staged_prefix()) for m in msgs)


@pytest.mark.parametrize("raw,match", [
    (b"KVBS/C x 1 2 3 0 1\n", "unversioned"),   # the pre-release staged format
    (wire.encode(wire.StagedGrant("x", [1], 0, 1, "DRAM", 0)).replace(b"kvb/1", b"kvb/2"), "version 2"),
    (wire.prefix("s.grant") + b'{"xfer_id":"x","slots":[],"base_addr":0,"slot_bytes":1,'
     b'"mem_type":"DRAM","device_id":0}', "at least one slot"),
    (wire.prefix("s.want") + b'{"xfer_id":"x","want":1,"ttl_ms":1}\nabc', "int64"),
    (wire.prefix("s.pull") + b'{"xfer_id":"x","n":3}\n' + b"\0" * 16, "carries"),
    (wire.prefix("s.chunk") + b'{"xfer_id":"x"}', "malformed"),
])
def test_wire_rejects_bad_messages(raw: bytes, match: str) -> None:
    with pytest.raises(wire.WireError, match=match):
        wire.decode(raw)
