"""The main job on the embedded default: start the control plane and walk one P/D hand-off
and one agent conversation through its real gRPC API, printing what it saw.

    python -m kvbaton.demo            (README's first command runs this)

It plays the engines' parts with the same client calls the vLLM connector makes, so it
needs no model; ``--serve`` keeps the services running afterwards for ``kvbaton`` CLI
commands in another terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from kvbaton import logs
from kvbaton.client import KvbatonClient, LeaseKeeper
from kvbaton.services.server import ControlPlane, ServerConfig
from kvbaton.v1 import common_pb2, lease_pb2, registrar_pb2, rendezvous_pb2


def _rank(engine_id: str, role: common_pb2.EngineRole) -> registrar_pb2.EngineRank:
    return registrar_pb2.EngineRank(
        engine_id=engine_id, role=role, tp_size=1, agent_name=f"{engine_id}-0", agent_metadata=b"<nixl agent metadata>",
        geometry=common_pb2.KvGeometry(region_base_addrs=[0x7F0000000000 + i * 2**26 for i in range(4)],
                                       bytes_per_block=32768, num_blocks=2048, tokens_per_block=16, dtype="bfloat16",
                                       layout="block_major", fingerprint="demo-model-bf16", device="cpu"))


async def run(address: str, serve: bool) -> None:
    plane = ControlPlane(ServerConfig(address=address, insecure=True))  # loopback demo
    await plane.start()
    print(f"control plane on {plane.address} (in-memory store)")
    async with KvbatonClient(plane.address) as kv:
        for eid, role in (("prefill-0", common_pb2.ENGINE_ROLE_PREFILL), ("decode-0", common_pb2.ENGINE_ROLE_DECODE)):
            await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(rank=_rank(eid, role)))
        engines = await kv.call(kv.registrar.ListEngines, registrar_pb2.ListEnginesRequest())
        print("engines:", ", ".join(f"{r.engine_id}({common_pb2.EngineRole.Name(r.role)[12:].lower()})" for r in engines.ranks))

        # Push: decode offers while prefill computes; prefill completes; the match streams to P.
        events = kv.subscribe("prefill-0", 0, heartbeats=True)
        await anext(events)  # subscribed
        t0 = time.perf_counter()
        await kv.call(kv.rendezvous.Offer, rendezvous_pb2.OfferRequest(
            transfer_id="xfer-1", decode_engine_id="decode-0", block_ids=[40, 41, 42, 43], num_tokens=60))
        done = await kv.call(kv.rendezvous.Complete, rendezvous_pb2.CompleteRequest(
            transfer_id="xfer-1", prefill_engine_id="prefill-0", block_ids=[7, 8, 9, 10], num_tokens=60))
        match = await asyncio.wait_for(anext(events), 5)
        ms = (time.perf_counter() - t0) * 1000
        print(f"push xfer-1: matched_now={done.matched_now}; prefill rank 0 got "
              f"{rendezvous_pb2.RendezvousEvent.Type.Name(match.type)} in {ms:.1f} ms: write P blocks "
              f"{list(match.transfer.completion.block_ids)} -> D blocks {list(match.transfer.offer.block_ids)}")
        final = await kv.call(kv.rendezvous.ReportOutcome, rendezvous_pb2.ReportOutcomeRequest(
            transfer_id="xfer-1", outcome=rendezvous_pb2.Outcome(engine_id="prefill-0", success=True, bytes=4 * 4 * 32768)))
        print(f"push xfer-1: {rendezvous_pb2.TransferPhase.Name(final.phase)}, {final.outcomes[0].bytes} bytes")
        await events.aclose()

        # Bidirectional: decode retains the turn, takes a lease; the agent keeps it alive.
        ret = await kv.call(kv.registrar.RegisterRetained, registrar_pb2.RegisterRetainedRequest(
            retained=registrar_pb2.RetainedBlocks(conversation_id="agent-42", engine_id="decode-0",
                                                  block_ids=[40, 41, 42, 43], num_tokens=64, tokens_per_block=16)))
        grant = await kv.call(kv.lease.Grant, lease_pb2.GrantRequest(
            conversation_id="agent-42", engine_id="decode-0", ttl_ms=1500, num_blocks=4,
            retention_id=ret.retained.retention_id))
        print(f"lease {grant.lease.lease_id} on agent-42: ttl {grant.lease.ttl_ms} ms")
        async with LeaseKeeper(kv, "agent-42") as keeper:
            await asyncio.sleep(3.0)  # the agent calls a tool for two TTLs
        info = await kv.call(kv.lease.Get, lease_pb2.GetLeaseRequest(conversation_id="agent-42"))
        print(f"after 3 s of tool calls: {lease_pb2.LeaseState.Name(info.state)}, {keeper.renewals} renewals")
        pin = await kv.call(kv.lease.Pin, lease_pb2.PinRequest(conversation_id="agent-42", lease_id=info.lease_id,
                                                               reader="prefill-0"))
        print(f"next turn: prefill pinned {pin.pin.pin_id} and may READ blocks {list(ret.retained.block_ids)} from decode")
        await kv.call(kv.lease.Unpin, lease_pb2.UnpinRequest(conversation_id="agent-42", lease_id=info.lease_id,
                                                              pin_id=pin.pin.pin_id))
        if not serve:
            await keeper.release("demo finished")
            info = await kv.call(kv.lease.Get, lease_pb2.GetLeaseRequest(conversation_id="agent-42"))
            print(f"agent finished: lease {lease_pb2.LeaseState.Name(info.state)} ({info.reason}); decode may free its blocks")
    if serve:
        print(f"serving on {plane.address}; try: kvbaton leases list --addr {plane.address}   (Ctrl-C stops)")
        try:
            await asyncio.Event().wait()
        finally:
            await plane.stop()
    else:
        await plane.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--serve", action="store_true", help="keep serving afterwards")
    args = p.parse_args()
    logs.configure("WARNING")
    try:
        asyncio.run(run(args.listen, args.serve))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
