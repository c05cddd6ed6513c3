"""Builders for valid messages, so each test changes only what it is about."""

from __future__ import annotations

import asyncio

from kvbaton.v1 import common_pb2, registrar_pb2


def engine_rank(engine_id: str, role=common_pb2.ENGINE_ROLE_DECODE, *, tp_size: int = 1, tp_rank: int = 0,
                num_blocks: int = 1000) -> registrar_pb2.EngineRank:
    return registrar_pb2.EngineRank(
        engine_id=engine_id, role=role, tp_size=tp_size, tp_rank=tp_rank,
        agent_name=f"{engine_id}-r{tp_rank}", agent_metadata=b"nixl-metadata-" + engine_id.encode(),
        geometry=common_pb2.KvGeometry(
            region_base_addrs=[0x10000, 0x20000], bytes_per_block=4096, num_blocks=num_blocks,
            tokens_per_block=16, dtype="float32", layout="test", fingerprint="tiny-llama-f32", device="cpu"),
        labels={"http": "127.0.0.1:8000"},
    )


async def register(kv, engine_id: str, role=common_pb2.ENGINE_ROLE_DECODE, *, ttl_ms: int = 0,
                   **kw) -> registrar_pb2.EngineRank:
    """``ttl_ms``: the registration's liveness TTL (0: the server's default, 10 s)."""
    resp = await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(
        rank=engine_rank(engine_id, role, **kw), ttl_ms=ttl_ms))
    return resp.rank


async def serve_rendezvous(servicer):
    """A bare gRPC server with only ``servicer`` (a fake or older control plane) on a free
    loopback port: (server, address). The caller stops it (``await server.stop(0)``)."""
    import grpc

    from kvbaton.v1 import rendezvous_pb2_grpc

    server = grpc.aio.server()
    rendezvous_pb2_grpc.add_RendezvousServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


class Gate:
    """Wraps a control-plane domain method (``plane.registrar.refresh_engine = Gate(...)``):
    holds its first ``hold`` calls until ``release`` is set (``arrived`` says one is held),
    so that a test can move a client while its call is in flight on the old channel; counts
    every call (``calls``) and wakes ``wait_calls`` on each, so a test waits for calls to
    arrive, not for time to pass."""

    def __init__(self, real, hold: int = 1) -> None:
        self.real, self.hold = real, hold
        self.calls = 0
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self._changed = asyncio.Condition()

    async def __call__(self, *args, **kwargs):
        self.calls += 1
        async with self._changed:
            self._changed.notify_all()
        if self.calls <= self.hold:
            self.arrived.set()
            await self.release.wait()
        return await self.real(*args, **kwargs)

    async def wait_calls(self, n: int, timeout_s: float) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.calls >= n), timeout_s)
