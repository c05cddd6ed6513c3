"""One ledger: pull and reuse READs recorded as transfers (kind, sides, attempt, bytes,
outcome) beside push, over a real server; generation fencing refuses a read of blocks
the owner has freed or re-leased before the READ is posted."""

from __future__ import annotations

import asyncio
import sys

import grpc
import pytest

from kvbaton.services.domain.rendezvous import derive_events
from kvbaton.services.store.base import EventType, KeyValue, WatchEvent
from kvbaton.v1 import common_pb2, registrar_pb2
from kvbaton.v1 import rendezvous_pb2 as pb
from tests.services.helpers import register

PULL, REUSE = pb.TRANSFER_KIND_PULL, pb.TRANSFER_KIND_REUSE
Ev = pb.RendezvousEvent


async def _refused(coro) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    return err.value.details()


@pytest.fixture
async def engines(kv):
    await register(kv, "pre", common_pb2.ENGINE_ROLE_PREFILL)
    await register(kv, "dec", common_pb2.ENGINE_ROLE_DECODE)


async def test_a_pull_read_is_a_transfer_with_its_outcome_and_bytes(kv, engines):
    events: list[Ev] = []
    ready = asyncio.Event()

    async def watch(engine: str) -> None:
        async for ev in kv.subscribe(engine, 0, heartbeats=True):
            ready.set()
            if ev.type != Ev.TYPE_HEARTBEAT:
                events.append(ev)

    watchers = [asyncio.ensure_future(watch("pre")), asyncio.ensure_future(watch("dec"))]
    await asyncio.wait_for(ready.wait(), 5)
    # The prefill holds its blocks for the pull (its completion); decode begins the read.
    await kv.call(kv.rendezvous.Complete, pb.CompleteRequest(transfer_id="p1", prefill_engine_id="pre",
                                                             block_ids=[1, 2, 3], timeout_ms=60_000))
    begun = await kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
        transfer_id="p1", kind=PULL, reader_engine_id="dec", block_ids=[7, 8, 9]))
    assert begun.phase == pb.TRANSFER_PHASE_MATCHED and begun.kind == PULL and begun.generation == "0"
    assert begun.offer.engine_id == "dec" and list(begun.completion.block_ids) == [1, 2, 3]
    again = await kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
        transfer_id="p1", kind=PULL, reader_engine_id="dec", block_ids=[7, 8, 9]))
    assert again.phase == pb.TRANSFER_PHASE_MATCHED  # the same read twice is a duplicate
    # Only the reader reports (the prefill did not move the bytes).
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.rendezvous.ReportOutcome, pb.ReportOutcomeRequest(
            transfer_id="p1", outcome=pb.Outcome(engine_id="pre", success=True)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    done = await kv.call(kv.rendezvous.ReportOutcome, pb.ReportOutcomeRequest(
        transfer_id="p1", outcome=pb.Outcome(engine_id="dec", success=True, bytes=3 * 4096)))
    assert done.phase == pb.TRANSFER_PHASE_SUCCEEDED
    got = await kv.call(kv.rendezvous.GetTransfer, pb.GetTransferRequest(transfer_id="p1"))
    assert got.kind == PULL and got.outcomes[0].bytes == 3 * 4096
    listed = await kv.list_transfers(phases=[pb.TRANSFER_PHASE_SUCCEEDED])
    assert [t.transfer_id for t in listed if t.kind == PULL] == ["p1"]

    async def both_told() -> None:
        while {(e.transfer.transfer_id, e.type) for e in events} != {("p1", Ev.TYPE_DONE)} or len(events) < 2:
            await asyncio.sleep(0.02)
    await asyncio.wait_for(both_told(), 5)  # DONE to the prefill (free the hold) and decode; no MATCH
    assert all(e.type == Ev.TYPE_DONE for e in events)
    for w in watchers:
        w.cancel()
    # The operator's table shows the kind and the bytes moved.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvbaton.cli", "transfers", "list", "--addr", kv.address, "--phase", "succeeded",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    row = next(line for line in out.decode().splitlines() if line.startswith("p1 "))
    assert proc.returncode == 0 and " pull " in row and " 12288 " in row, (out, err)


async def test_a_pull_of_a_freed_or_superseded_hold_is_refused(kv, engines):
    await kv.call(kv.rendezvous.Complete, pb.CompleteRequest(transfer_id="p2", prefill_engine_id="pre",
                                                             block_ids=[1], timeout_ms=100))

    async def expired() -> None:
        while (await kv.call(kv.rendezvous.GetTransfer, pb.GetTransferRequest(transfer_id="p2"))).phase != pb.TRANSFER_PHASE_EXPIRED:
            await asyncio.sleep(0.05)
    await asyncio.wait_for(expired(), 5)
    why = await _refused(kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
        transfer_id="p2", kind=PULL, reader_engine_id="dec", block_ids=[5])))
    assert "expired" in why and "recompute" in why
    # Freed by its owner.
    await kv.call(kv.rendezvous.Complete, pb.CompleteRequest(transfer_id="p3", prefill_engine_id="pre", block_ids=[1]))
    await kv.call(kv.rendezvous.Cancel, pb.CancelRequest(transfer_id="p3", engine_id="pre", reason="evicted"))
    assert "cancelled" in await _refused(kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
        transfer_id="p3", kind=PULL, reader_engine_id="dec", block_ids=[5])))
    # Re-held under a newer attempt: a read naming the old one is stale.
    await kv.call(kv.rendezvous.Complete, pb.CompleteRequest(transfer_id="p4", prefill_engine_id="pre", block_ids=[1]))
    await kv.call(kv.rendezvous.Complete, pb.CompleteRequest(transfer_id="p4", attempt=1, prefill_engine_id="pre",
                                                             block_ids=[2]))
    assert "superseded" in await _refused(kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
        transfer_id="p4", attempt=0, kind=PULL, reader_engine_id="dec", block_ids=[5])))
    assert "no hold" in await _refused(kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
        transfer_id="never", kind=PULL, reader_engine_id="dec", block_ids=[5])))


async def test_a_reuse_read_is_fenced_by_the_retention_generation(kv, engines):
    ret = registrar_pb2.RetainedBlocks(conversation_id="conv", engine_id="dec", block_ids=[3, 4, 5], num_tokens=48,
                                       tokens_per_block=16)
    first = (await kv.call(kv.registrar.RegisterRetained, registrar_pb2.RegisterRetainedRequest(retained=ret))).retained
    read = pb.BeginReadRequest(transfer_id="r1", kind=REUSE, reader_engine_id="pre", block_ids=[10, 11],
                               conversation_id="conv", generation=first.retention_id, source_block_ids=[3, 4])
    begun = await kv.call(kv.rendezvous.BeginRead, read)
    assert (begun.kind, begun.phase, begun.offer.engine_id, begun.completion.engine_id) == (REUSE, pb.TRANSFER_PHASE_MATCHED, "dec", "pre")
    assert begun.conversation_id == "conv" and begun.generation == first.retention_id
    done = await kv.call(kv.rendezvous.ReportOutcome, pb.ReportOutcomeRequest(
        transfer_id="r1", outcome=pb.Outcome(engine_id="pre", success=True, bytes=8192)))
    assert done.phase == pb.TRANSFER_PHASE_SUCCEEDED
    # The decode re-registered the conversation (a newer turn): the old generation is stale.
    await kv.call(kv.registrar.RegisterRetained, registrar_pb2.RegisterRetainedRequest(retained=ret))
    read.transfer_id = "r2"
    assert "re-registered" in await _refused(kv.call(kv.rendezvous.BeginRead, read))
    # Released: nothing to read.
    await kv.call(kv.registrar.ReleaseRetained, registrar_pb2.ReleaseRetainedRequest(conversation_id="conv"))
    read.transfer_id = "r3"
    assert "no retained blocks" in await _refused(kv.call(kv.rendezvous.BeginRead, read))
    with pytest.raises(grpc.aio.AioRpcError) as err:  # a reuse read must name its generation
        await kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
            transfer_id="r4", kind=REUSE, reader_engine_id="pre", block_ids=[1], conversation_id="conv",
            source_block_ids=[3]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "generation" in err.value.details()


def test_a_read_match_is_not_routed_to_the_prefill_as_a_write():
    def put(state: pb.TransferState, prev: pb.TransferState | None) -> WatchEvent:
        kv = KeyValue(b"kvb/rdv/t/x", state.SerializeToString(), 1, 5, 1)
        old = KeyValue(b"kvb/rdv/t/x", prev.SerializeToString(), 1, 4, 1) if prev is not None else None
        return WatchEvent(EventType.PUT, kv, old)

    held = pb.TransferState(transfer_id="x", phase=pb.TRANSFER_PHASE_COMPLETED, completion=pb.TransferSide(engine_id="pre"))
    for kind, routes in ((pb.TRANSFER_KIND_PUSH, {"pre", "*"}), (PULL, {"*"})):
        read = pb.TransferState(transfer_id="x", phase=pb.TRANSFER_PHASE_MATCHED, kind=kind,
                                offer=pb.TransferSide(engine_id="dec"), completion=pb.TransferSide(engine_id="pre"))
        assert {r for r, _ in derive_events(put(read, held))} == routes


async def test_a_pull_may_read_a_prefix_of_the_hold_but_not_more(kv, engines):
    """Decode's leading blocks may be its own prefix-cache hits: it names fewer blocks."""
    for tid in ("p2", "p3"):
        await kv.call(kv.rendezvous.Complete, pb.CompleteRequest(transfer_id=tid, prefill_engine_id="pre",
                                                                 block_ids=[1, 2, 3], timeout_ms=60_000))
    begun = await kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
        transfer_id="p2", kind=PULL, reader_engine_id="dec", block_ids=[7, 8]))
    assert begun.phase == pb.TRANSFER_PHASE_MATCHED and list(begun.offer.block_ids) == [7, 8]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
            transfer_id="p3", kind=PULL, reader_engine_id="dec", block_ids=[7, 8, 9, 10]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "the hold has only 3" in err.value.details()


async def test_a_pull_of_a_hold_its_prefill_cancelled_is_fenced(kv, engines):
    """What the e2e fenced-read test relies on: the prefill may end its own unread hold,
    and a read begun after that is refused naming why."""
    await kv.call(kv.rendezvous.Complete, pb.CompleteRequest(transfer_id="p4", prefill_engine_id="pre",
                                                             block_ids=[1, 2], timeout_ms=60_000))
    await kv.call(kv.rendezvous.Cancel, pb.CancelRequest(transfer_id="p4", engine_id="pre", reason="the hold ends"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.call(kv.rendezvous.BeginRead, pb.BeginReadRequest(
            transfer_id="p4", kind=PULL, reader_engine_id="dec", block_ids=[7, 8]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cancelled" in err.value.details() and "no hold" not in err.value.details()
    (t,) = [t for t in await kv.list_transfers(phases=[pb.TRANSFER_PHASE_CANCELLED]) if t.transfer_id == "p4"]
    assert not t.outcomes
