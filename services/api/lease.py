"""gRPC adapter for the lease domain (``services.domain.lease``)."""

from __future__ import annotations

import asyncio

import grpc

from kvbaton.v1 import lease_pb2 as pb
from kvbaton.v1 import lease_pb2_grpc as pb_grpc

from ..domain.errors import DomainError
from ..domain.lease import LeaseService
from ..store import StoreError
from . import incarnation
from .budget import ByteBudget
from .ownership import Ownership
from .status import grpc_code, store_unavailable, streaming, unary, with_heartbeats

HEARTBEAT_S = 5.0
# What one renewal's answer is reckoned to take (a RenewResult with its LeaseInfo), or
# in a compact answer (a lease id, a deadline and a TTL, packed).
RENEW_REPLY_BYTES = 160
RENEW_COMPACT_REPLY_BYTES = 40


class LeaseServicer(pb_grpc.LeaseServicer):
    def __init__(self, domain: LeaseService, ownership: Ownership | None = None) -> None:
        self.domain = domain
        self.ownership = ownership or Ownership(None, domain)

    @unary
    async def Grant(self, r: pb.GrantRequest, context):
        await self.ownership.may_take(r.conversation_id, r.engine_id, "grant a lease")
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
        # doesn't stall the stream. The replies' bytes are reserved before a batch is read
        # on and freed once written, so a client that stops reading stops being read.
        results: asyncio.Queue = asyncio.Queue(maxsize=64)
        budget = ByteBudget()

        async def pump() -> None:
            try:
                async for req in request_iterator:
                    n = len(req.renewals) + len(req.conversation_ids)
                    cost = (RENEW_COMPACT_REPLY_BYTES if req.compact else RENEW_REPLY_BYTES) * max(1, n)
                    await budget.acquire(cost)
                    resp = pb.KeepAliveResponse(seq=req.seq)
                    await results.put((resp, cost, asyncio.ensure_future(
                        self.domain.keepalive(req.renewals, into=resp, compact=req.compact,
                                              conversation_ids=req.conversation_ids))))
            except Exception as exc:  # noqa: BLE001 - a refused message (the guard): the handler task ends the call
                await results.put(exc)
            finally:
                await results.put(None)

        await incarnation.announce(context, self.domain.store)
        reader = asyncio.ensure_future(pump())
        try:
            while True:
                item = await results.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                resp, cost, fut = item
                try:
                    await fut
                except DomainError as exc:
                    await context.abort(grpc_code(exc.code), exc.message)
                except StoreError as exc:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, store_unavailable(exc))
                yield resp
                budget.release(cost)
        finally:
            reader.cancel()

    @unary
    async def Pin(self, r: pb.PinRequest, context):
        pin, lease = await self.domain.pin(r.conversation_id, r.lease_id, r.reader, r.ttl_ms, r.reader_engine_id)
        return pb.PinResponse(pin=pin, lease=lease)

    @unary
    async def Unpin(self, r: pb.UnpinRequest, context):
        return await self.domain.unpin(r.conversation_id, r.lease_id, r.pin_id)

    @unary
    async def Revoke(self, r: pb.RevokeRequest, context):
        lease_id = await self.ownership.may_revoke(r.conversation_id, r.lease_id)
        return await self.domain.revoke(r.conversation_id, lease_id, r.reason)

    @unary
    async def Get(self, r: pb.GetLeaseRequest, context):
        return await self.domain.get(r.conversation_id)

    @unary
    async def List(self, r: pb.ListLeasesRequest, context):
        leases, token = await self.domain.list_page(engine_id=r.engine_id, states=r.states,
                                                    expiring_within_ms=r.expiring_within_ms, limit=r.limit,
                                                    page_size=r.page_size, page_token=r.page_token)
        return pb.ListLeasesResponse(leases=leases, next_page_token=token)

    @streaming
    async def Watch(self, r: pb.WatchLeasesRequest, context):
        def heartbeat() -> pb.LeaseEvent:
            return pb.LeaseEvent(type=pb.LeaseEvent.TYPE_HEARTBEAT, revision=self.domain.hub.revision)

        after = await incarnation.resume_from(self.domain.store, r.after_revision, r.incarnation, "lease_watch")
        if after == incarnation.FIRST_REVISION and r.after_revision != after:
            after = 0  # a new store incarnation: start from what is live now (a snapshot)
        snapshot = r.snapshot or (r.after_revision > 0 and after == 0)
        await incarnation.announce(context, self.domain.store)
        async for event in with_heartbeats(self.domain.watch(r.engine_id, snapshot=snapshot, after_revision=after), heartbeat, HEARTBEAT_S):
            yield event
