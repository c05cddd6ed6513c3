"""A bounded soak of the lease protocol with its invariants (``services/domain/lease.py``) checked
continuously, through a real server.

A simulated decode engine owns blocks and frees a conversation's blocks only when the
lease service says EXPIRED or REVOKED (as the connector does). Agents renew at random
intervals (sometimes too slowly), readers pin and "read" (check their blocks are still
held), operators revoke at random, and decode re-grants new turns. Checked all along:

- no read of freed memory: a reader holding a pin never finds its blocks freed;
- no early expiry: no lease ends EXPIRED before the latest deadline a renewal acknowledged;
- no leak: once every conversation is revoked, every block is free again.

Short by default (the README's test command); ``KVBATON_SOAK_SECONDS=300`` for the full form.
"""

from __future__ import annotations

import asyncio
import os
import random

import grpc
import pytest

from kvbaton.v1 import lease_pb2 as pb

SECONDS = float(os.environ.get("KVBATON_SOAK_SECONDS", "8"))
CONVERSATIONS = int(os.environ.get("KVBATON_SOAK_CONVERSATIONS", "40"))


class DecodeEngine:
    """Blocks held per lease, freed only on the lease service's word."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}  # lease_id -> blocks
        self.freed: dict[str, int] = {}  # lease_id -> when the service ended it (its clock)
        self.next_block = 0

    def retain(self, lease_id: str, n: int) -> None:
        self.held[lease_id] = set(range(self.next_block, self.next_block + n))
        self.next_block += n

    def on_event(self, ev: pb.LeaseEvent) -> None:
        if ev.type in (pb.LeaseEvent.TYPE_EXPIRED, pb.LeaseEvent.TYPE_REVOKED):
            self.held.pop(ev.lease.lease_id, None)
            self.freed[ev.lease.lease_id] = ev.lease.ended_at_ms


@pytest.mark.timeout(SECONDS * 4 + 60)
async def test_lease_soak_keeps_invariants(kv, plane):
    rng = random.Random(1234)
    engine = DecodeEngine()
    acked_deadline: dict[str, int] = {}  # lease_id -> latest expires_at a renewal acknowledged
    violations: list[str] = []
    counts = {"overran_pin": 0, "renewals": 0, "pins": 0, "refused_pins": 0, "reads": 0, "revokes": 0, "grants": 0, "expired": 0}
    current: dict[str, str] = {}  # conversation -> lease id
    ready = asyncio.Event()

    async def watch() -> None:
        async for ev in kv.watch_leases("soak-dec", snapshot=False):
            ready.set()
            engine.on_event(ev)
            if ev.type == pb.LeaseEvent.TYPE_EXPIRED:
                counts["expired"] += 1
                promised = acked_deadline.get(ev.lease.lease_id, 0)
                if ev.lease.ended_at_ms < promised:
                    violations.append(f"{ev.lease.lease_id} expired at {ev.lease.ended_at_ms} before promised {promised}")

    async def grant(conv: str) -> None:
        g = await kv.call(kv.lease.Grant, pb.GrantRequest(conversation_id=conv, engine_id="soak-dec",
                                                          ttl_ms=rng.choice([300, 600, 1200]), num_blocks=4))
        engine.retain(g.lease.lease_id, 4)
        current[conv] = g.lease.lease_id
        counts["grants"] += 1

    async def agent(conv: str, stop_at: float) -> None:
        loop = asyncio.get_running_loop()
        while loop.time() < stop_at:
            await asyncio.sleep(rng.uniform(0.05, 0.9))  # sometimes slower than the TTL
            action = rng.random()
            lease_id = current.get(conv)
            if action < 0.6:
                r = await kv.renew(conv)
                if r.status == pb.RENEW_STATUS_OK:
                    counts["renewals"] += 1
                    acked_deadline[r.lease.lease_id] = max(acked_deadline.get(r.lease.lease_id, 0), r.lease.expires_at_ms)
            elif action < 0.85 and lease_id:
                try:
                    pin = await kv.call(kv.lease.Pin, pb.PinRequest(conversation_id=conv, lease_id=lease_id,
                                                                    reader="soak-prefill", ttl_ms=500))
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND), exc
                    counts["refused_pins"] += 1
                    continue
                counts["pins"] += 1
                for _ in range(3):  # the read takes a while; the blocks must stay held throughout
                    await asyncio.sleep(0.05)
                    if lease_id not in engine.held:
                        # Freed: only legitimate if the service ended the lease after the pin
                        # ran out (a reader that overruns its pin TTL loses the guarantee).
                        if engine.freed.get(lease_id, 0) < pin.pin.expires_at_ms:
                            violations.append(f"read of freed blocks: lease {lease_id} ended at "
                                              f"{engine.freed.get(lease_id)} under pin {pin.pin.pin_id} valid until "
                                              f"{pin.pin.expires_at_ms}")
                        else:
                            counts["overran_pin"] += 1
                        break
                counts["reads"] += 1
                await kv.call(kv.lease.Unpin, pb.UnpinRequest(conversation_id=conv, lease_id=lease_id, pin_id=pin.pin.pin_id))
            elif action < 0.93:
                await grant(conv)  # a new turn replaces the old lease
            else:
                with_revoke = await kv.call(kv.lease.Revoke, pb.RevokeRequest(conversation_id=conv, reason="soak"))
                counts["revokes"] += 1
                # Revoking a lease that already expired answers its (terminal) state.
                assert with_revoke.state in (pb.LEASE_STATE_REVOKED, pb.LEASE_STATE_DRAINING, pb.LEASE_STATE_EXPIRED)
                await grant(conv)

    from tests.services.helpers import register

    await register(kv, "soak-dec")  # pins need a live decode engine
    watcher = asyncio.ensure_future(watch())
    await grant("soak-warmup")
    await asyncio.wait_for(ready.wait(), 10)
    convs = [f"soak-{i}" for i in range(CONVERSATIONS)]
    for c in convs:
        await grant(c)
    stop_at = asyncio.get_running_loop().time() + SECONDS
    await asyncio.gather(*(agent(c, stop_at) for c in convs))
    # The end: every conversation finishes; every block must come back.
    for c in convs + ["soak-warmup"]:
        await kv.call(kv.lease.Revoke, pb.RevokeRequest(conversation_id=c, reason="done"))
    for _ in range(100):
        if not engine.held:
            break
        await asyncio.sleep(0.1)
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    assert not violations, violations[:5]
    assert not engine.held, f"leaked: {len(engine.held)} leases' blocks never freed"
    assert counts["reads"] > 10 and counts["renewals"] > 20 and counts["expired"] > 0, counts
