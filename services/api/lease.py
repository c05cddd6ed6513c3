"""gRPC adapter for the lease domain (``services.domain.lease``)."""

from __future__ import annotations

import asyncio

import grpc

from kvbaton.v1 import lease_pb2 as pb
from kvbaton.v1 import lease_pb2_grpc as pb_grpc

from ..domain.errors import DomainError
from ..domain.lease import LeaseService
from .status import grpc_code, streaming, unary, with_heartbeats

HEARTBEAT_S = 5.0


class LeaseServicer(pb_grpc.LeaseServicer):
    def __init__(self, domain: LeaseService) -> None:
        self.domain = domain

    @unary
    async def Grant(self, r: pb.GrantRequest, context):
        lease, replaced = await self.domain.grant(
            r.conversation_id, r.engine_id, ttl_ms=r.ttl_ms, num_blocks=r.num_blocks,
            retention_id=r.retention_id, labels=dict(r.labels))
        resp = pb.GrantResponse(lease=lease)
        if replaced is not None:
            resp.replaced.CopyFrom(replaced)
        return resp

    @unary
    async def Renew(self, r: pb.RenewRequest, context):
        return await self.domain.renew(r.conversation_id, r.lease_id, r.ttl_ms)

    async def KeepAlive(self, request_iterator, context: grpc.aio.ServicerContext):
        # Batches are answered in order, but several may be in flight, so one slow write
        # doesn't stall the stream.
        results: asyncio.Queue = asyncio.Queue(maxsize=64)

        async def pump() -> None:
            try:
                async for req in request_iterator:
                    await results.put((req.seq, asyncio.ensure_future(self.domain.keepalive(req.renewals))))
            finally:
                await results.put(None)

        reader = asyncio.ensure_future(pump())
        try:
            while True:
                item = await results.get()
                if item is None:
                    break
                seq, fut = item
                try:
                    renewed = await fut
                except DomainError as exc:
                    await context.abort(grpc_code(exc.code), exc.message)
                yield pb.KeepAliveResponse(results=renewed, seq=seq)
        finally:
            reader.cancel()

    @unary
    async def Pin(self, r: pb.PinRequest, context):
        pin, lease = await self.domain.pin(r.conversation_id, r.lease_id, r.reader, r.ttl_ms)
        return pb.PinResponse(pin=pin, lease=lease)

    @unary
    async def Unpin(self, r: pb.UnpinRequest, context):
        return await self.domain.unpin(r.conversation_id, r.lease_id, r.pin_id)

    @unary
    async def Revoke(self, r: pb.RevokeRequest, context):
        return await self.domain.revoke(r.conversation_id, r.lease_id, r.reason)

    @unary
    async def Get(self, r: pb.GetLeaseRequest, context):
        return await self.domain.get(r.conversation_id)

    @unary
    async def List(self, r: pb.ListLeasesRequest, context):
        leases = await self.domain.list(engine_id=r.engine_id, states=r.states,
                                        expiring_within_ms=r.expiring_within_ms, limit=r.limit)
        return pb.ListLeasesResponse(leases=leases)

    @streaming
    async def Watch(self, r: pb.WatchLeasesRequest, context):
        def heartbeat() -> pb.LeaseEvent:
            return pb.LeaseEvent(type=pb.LeaseEvent.TYPE_HEARTBEAT, revision=self.domain.hub.revision)

        async for event in with_heartbeats(self.domain.watch(r.engine_id, snapshot=r.snapshot, after_revision=r.after_revision), heartbeat, HEARTBEAT_S):
            yield event
