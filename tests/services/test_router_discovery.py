"""Router discovery against a real registrar (memory and etcd stores): an engine whose
registration lapses leaves the router's rotation, and one that registers again is back,
each within 1 s of the registrar's change, also after the router's control-plane client
moved replica under its watch (the issue-13 gap: the watch loop stopped for good then).
The listing / watch hand-off by revision, and its refusals, are checked on the wire, and
an engine whose own client moves replica stays in rotation (the fleet e2e's "one prefill
of two": its registration keeper ended then, and the registration lapsed for good)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from kvbaton.client import KvbatonClient
from kvbaton.connector.control import ControlThread
from kvbaton.services.router.choice import ROLE_PREFILL, Fleet
from kvbaton.services.router.discovery import DiscoveryState, follow_registrar
from kvbaton.v1 import common_pb2, registrar_pb2

from .helpers import Gate, engine_rank

PREFILL = common_pb2.ENGINE_ROLE_PREFILL
WITHIN_S = 1.0  # the bound the router must meet after each registrar change


async def _register(kv: KvbatonClient, name: str, ttl_ms: int) -> registrar_pb2.EngineRank:
    rank = engine_rank(name, PREFILL)
    rank.serve_url = f"http://127.0.0.1:1/{name}"
    resp = await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(rank=rank, ttl_ms=ttl_ms))
    return resp.rank


def _routable(fleet: Fleet) -> set[str]:
    return {e.engine_id for e in fleet.routable(ROLE_PREFILL, time.monotonic())}


async def _until(pred, timeout_s: float, what: str) -> float:
    """Waits (bounded) for ``pred()``; returns the seconds it took."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


@contextlib.asynccontextmanager
async def _router(address: str) -> AsyncIterator[tuple[Fleet, KvbatonClient, DiscoveryState]]:
    """A router's discovery: its own client, over two addresses (as the fleet's routers,
    so that a failed call moves it to the "next replica", here the same server)."""
    kv = KvbatonClient(f"{address},{address}", timeout_s=5.0)
    fleet = Fleet(discovering=True)
    state = DiscoveryState()
    ready = asyncio.Event()
    task = asyncio.create_task(follow_registrar(kv, fleet, ready=ready, state=state, max_backoff_s=0.2))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        yield fleet, kv, state
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled(), "discovery ended before the router stopped it"
        await kv.close()


async def _deletes(kv: KvbatonClient, name: str, seen: list[float]) -> None:
    """Records when the registrar announces the end of ``name``'s registration."""
    async for ev in kv.registrar.WatchEngines(registrar_pb2.WatchEnginesRequest()):
        if ev.type == registrar_pb2.EngineEvent.TYPE_DELETE and ev.rank.engine_id == name:
            seen.append(time.monotonic())


@pytest.mark.parametrize("client_moves", [False, True], ids=["steady", "client-moved-replica"])
async def test_a_lapsed_engine_leaves_and_its_re_registration_is_routable_within_1s(plane, kv, client_moves):
    await _register(kv, "p0", ttl_ms=60_000)
    async with _router(plane.address) as (fleet, router_kv, state):
        ended: list[float] = []
        watcher = asyncio.create_task(_deletes(kv, "p1", ended))
        try:
            first = await _register(kv, "p1", ttl_ms=1_000)  # never refreshed: it lapses
            await _until(lambda: _routable(fleet) == {"p0", "p1"}, 5, "p1 routable after registering")
            if client_moves:
                # What a lookup's retry after UNAVAILABLE does: the watch's channel closes.
                await router_kv.reconnect()
            await _until(lambda: bool(ended), 15, "p1's registration lapsing at the registrar")
            took = await _until(lambda: _routable(fleet) == {"p0"}, 5, "p1 out of rotation")
            assert time.monotonic() - ended[0] <= WITHIN_S, f"p1 routable {took:.2f} s after it lapsed"
            again = await _register(kv, "p1", ttl_ms=60_000)
            t_reg = time.monotonic()
            await _until(lambda: _routable(fleet) == {"p0", "p1"}, 5, "p1 routable after re-registering")
            assert time.monotonic() - t_reg <= WITHIN_S
            assert again.incarnation != first.incarnation
            assert fleet.engines["p1"].incarnations == {0: again.incarnation}
            assert state.listings >= 2 if client_moves else state.listings == 1
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


async def test_a_listing_then_a_watch_from_its_revision_misses_no_change(plane, kv):
    await _register(kv, "p0", ttl_ms=60_000)
    listed, revision, _ = await kv.list_engines_at()
    assert [r.engine_id for r in listed] == ["p0"] and revision > 0
    # Changes between the listing and the watch: the watch after the revision has them.
    await _register(kv, "p1", ttl_ms=60_000)
    await kv.call(kv.registrar.DeregisterEngine, registrar_pb2.DeregisterEngineRequest(engine_id="p0"))
    stream = kv.registrar.WatchEngines(registrar_pb2.WatchEnginesRequest(after_revision=revision))
    got = []
    async for ev in stream:
        got.append((ev.type, ev.rank.engine_id))
        assert ev.revision > revision
        if len(got) == 2:
            break
    stream.cancel()
    assert got == [(registrar_pb2.EngineEvent.TYPE_PUT, "p1"), (registrar_pb2.EngineEvent.TYPE_DELETE, "p0")]


async def test_a_revision_the_store_no_longer_keeps_or_has_not_reached_is_refused(plane, kv, store_kind):
    await _register(kv, "p0", ttl_ms=60_000)
    _, revision, incarnation = await kv.list_engines_at()
    for _ in range(3):
        await _register(kv, "p0", ttl_ms=60_000)  # new incarnations: history moves on
    if store_kind == "memory":
        plane.store.history_bytes = 1  # keeps only the newest event from the next write on
        await _register(kv, "p0", ttl_ms=60_000)
    else:
        await plane.store.compact(await plane.store.current_revision())
    cases = {"compacted": registrar_pb2.WatchEnginesRequest(after_revision=revision, incarnation=incarnation),
             "beyond": registrar_pb2.WatchEnginesRequest(after_revision=revision + 10_000)}
    for what, request in cases.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in kv.registrar.WatchEngines(request):
                pass
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, what
        assert "list the engines again" in err.value.details(), what


async def test_a_follower_whose_revision_was_compacted_lists_again(plane, kv, store_kind):
    """Between the follower's first listing and its watch the history it needs goes
    (compacted): the watch is refused, it lists again and follows from there."""
    await _register(kv, "p0", ttl_ms=60_000)

    class CompactAfterFirstListing:
        def __init__(self, real: KvbatonClient) -> None:
            self.real, self.registrar, self.addresses, self.lists = real, real.registrar, real.addresses, 0

        async def list_engines_at(self):
            self.lists += 1
            out = await self.real.list_engines_at()
            if self.lists == 1:
                await _register(kv, "p1", ttl_ms=60_000)
                await _register(kv, "p2", ttl_ms=60_000)
                if store_kind == "memory":
                    plane.store.history_bytes = 1
                    await _register(kv, "p2", ttl_ms=60_000)
                else:
                    await plane.store.compact(await plane.store.current_revision())
            return out

        async def reconnect(self, **kw) -> None:
            await self.real.reconnect(**kw)
            self.registrar = self.real.registrar

    router_kv = KvbatonClient(plane.address, timeout_s=5.0)
    fleet, state = Fleet(discovering=True), DiscoveryState()
    task = asyncio.create_task(follow_registrar(CompactAfterFirstListing(router_kv), fleet, state=state,
                                                max_backoff_s=0.2))
    try:
        await _until(lambda: _routable(fleet) == {"p0", "p1", "p2"}, 5, "the follower current again")
        assert state.listings == 2 and "list the engines again" in state.last_error
        await _until(lambda: state.following, 5, "the follower watching again")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await router_kv.close()


async def test_a_resumed_stream_survives_its_client_moving_replica(plane, kv):
    """``KvbatonClient``'s resumed streams (subscribe, watch_leases) had the same gap: a
    call that moved the client to the next replica closed the channel under the stream,
    gRPC raised ``CancelledError`` and the consumer's loop ended. Now the stream resumes."""
    from kvbaton.v1 import lease_pb2

    mover = KvbatonClient(f"{plane.address},{plane.address}", timeout_s=5.0)
    got: list[str] = []
    arrived = asyncio.Event()

    async def read() -> None:
        async for ev in mover.watch_leases("dec-m"):  # the live leases first
            got.append(ev.lease.conversation_id)
            arrived.set()

    async def grant(conv: str) -> None:
        await kv.call(kv.lease.Grant, lease_pb2.GrantRequest(conversation_id=conv, engine_id="dec-m",
                                                             ttl_ms=60_000, num_blocks=4))

    await grant("before")
    reader = asyncio.create_task(read())
    try:
        await asyncio.wait_for(arrived.wait(), 5)
        arrived.clear()
        await mover.reconnect()  # as a unary call's retry after UNAVAILABLE does
        await grant("after")
        await asyncio.wait_for(arrived.wait(), 5)
        assert got == ["before", "after"] and not reader.done()
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        assert reader.cancelled()
        await mover.close()


async def test_a_re_registration_over_a_live_one_keeps_the_engine_routable(plane, kv):
    """The connector registers again while its previous registration still lives (an answer
    lost under load, a retry on the other replica): the registrar moves the record to a new
    liveness lease and revokes the old one. Ruled out as the fleet e2e's "one prefill of
    two": that revoke ends nothing (the record left the old lease when it was rewritten),
    the router sees only PUTs, and keeps the engine under the new incarnation."""
    async with _router(plane.address) as (fleet, _, state):
        first = await _register(kv, "p1", ttl_ms=60_000)
        await _until(lambda: fleet.engines.get("p1") is not None
                     and fleet.engines["p1"].incarnations == {0: first.incarnation}, 5, "p1 listed")
        again = await _register(kv, "p1", ttl_ms=60_000)
        await _until(lambda: fleet.engines["p1"].incarnations == {0: again.incarnation}, 5, "p1's new incarnation")
        revision = state.revision
        # A later change the router must see, so that anything before it has been applied.
        await _register(kv, "p0", ttl_ms=60_000)
        await _until(lambda: state.revision > revision and "p0" in _routable(fleet), 5, "p0 seen")
        assert _routable(fleet) == {"p0", "p1"}
        ranks = (await kv.call(kv.registrar.GetEngine, registrar_pb2.GetEngineRequest(engine_id="p1"))).ranks
        assert [r.incarnation for r in ranks] == [again.incarnation]


async def test_a_prefill_stays_routable_after_its_client_moved_replica_mid_refresh(plane, kv):
    """The fleet e2e's "a router sees one prefill of two for over 60 s", without vLLM: the
    engine's registration keeper (``ControlThread.register_rank``, the connector's) shares
    its client with the engine's session and streams; one of those moved the client to the
    other replica while a RefreshEngine was in flight, closing the channel cancelled the
    call, ``KvbatonClient.call`` let the ``CancelledError`` out and the keeper ended. One TTL
    later the registration lapsed for good and every router rightly dropped the engine.
    Now the refresh is sent again on the new channel and the engine stays in rotation."""
    gate = Gate(plane.registrar.refresh_engine)
    plane.registrar.refresh_engine = gate
    ttl_ms = 3_000  # refreshed every second
    await _register(kv, "p0", ttl_ms=60_000)
    async with _router(plane.address) as (fleet, _, _state):
        control = ControlThread(f"{plane.address},{plane.address}", timeout_s=3)
        try:
            rank = engine_rank("p1", PREFILL)
            rank.serve_url = "http://127.0.0.1:1/p1"
            keeper = control.register_rank(rank, ttl_ms=ttl_ms)
            await asyncio.wait_for(gate.arrived.wait(), 10)  # its first refresh, held at the server
            await _until(lambda: _routable(fleet) == {"p0", "p1"}, 5, "p1 routable after registering")
            # What a failed call or stream of the engine's client does: move to the next replica.
            await asyncio.wait_for(asyncio.wrap_future(control.submit(lambda c: c.reconnect())), 5)
            gate.release.set()
            # Two TTLs' worth of refreshes after the move, or p1 gone from the router's view
            # (its registration lapsed: what happened before the fix), whichever comes first.
            await _until(lambda: gate.calls >= 1 + 2 * ttl_ms // 1000 or "p1" not in _routable(fleet), 20,
                         "p1's refreshes after the move")
            assert _routable(fleet) == {"p0", "p1"}, "the router sees one prefill of two: p1's registration lapsed"
            assert not keeper.done(), "p1's registration keeper ended"
        finally:
            control.close()
