"""gRPC adapter for the registrar domain (``services.domain.registrar``)."""

from __future__ import annotations

import grpc

from kvbaton.v1 import registrar_pb2 as pb
from kvbaton.v1 import registrar_pb2_grpc as pb_grpc

from ..domain.registrar import RegistrarService
from . import incarnation
from .ownership import Ownership, owner_identity
from .status import streaming, unary


class RegistrarServicer(pb_grpc.RegistrarServicer):
    def __init__(self, domain: RegistrarService, ownership: Ownership | None = None) -> None:
        self.domain = domain
        self.ownership = ownership or Ownership(domain, None)

    @unary
    async def RegisterEngine(self, request: pb.RegisterEngineRequest, context: grpc.aio.ServicerContext):
        rank, ttl = await self.domain.register_engine(request.rank, request.ttl_ms, owner=owner_identity())
        return pb.RegisterEngineResponse(rank=rank, ttl_ms=ttl)

    @unary
    async def RefreshEngine(self, request: pb.RefreshEngineRequest, context):
        ttl = await self.domain.refresh_engine(request.engine_id, request.tp_rank, request.incarnation)
        return pb.RefreshEngineResponse(ttl_ms=ttl)

    @unary
    async def DeregisterEngine(self, request: pb.DeregisterEngineRequest, context):
        rank = request.tp_rank if request.HasField("tp_rank") else None
        return pb.DeregisterEngineResponse(removed=await self.domain.deregister_engine(
            request.engine_id, rank, owner=owner_identity()))

    @unary
    async def GetEngine(self, request: pb.GetEngineRequest, context):
        return pb.GetEngineResponse(ranks=await self.domain.get_engine(request.engine_id))

    @unary
    async def ListEngines(self, request: pb.ListEnginesRequest, context):
        ranks, token, revision = await self.domain.list_engines_page(request.role, page_size=request.page_size,
                                                                    page_token=request.page_token)
        return pb.ListEnginesResponse(ranks=ranks, next_page_token=token, revision=revision,
                                      incarnation=self.domain.store.incarnation)

    @streaming
    async def WatchEngines(self, request: pb.WatchEnginesRequest, context):
        await incarnation.announce(context, self.domain.store)
        async for event in self.domain.watch_engines(request.role, after_revision=request.after_revision,
                                                     incarnation=request.incarnation):
            yield event

    @unary
    async def RegisterRetained(self, request: pb.RegisterRetainedRequest, context):
        await self.ownership.may_take(request.retained.conversation_id, request.retained.engine_id, "retain blocks")
        rec, replaced = await self.domain.register_retained(request.retained)
        resp = pb.RegisterRetainedResponse(retained=rec)
        if replaced is not None:
            resp.replaced.CopyFrom(replaced)
        return resp

    @unary
    async def LookupRetained(self, request: pb.LookupRetainedRequest, context):
        return pb.LookupRetainedResponse(retained=await self.domain.lookup_retained(request.conversation_id))

    @unary
    async def ReleaseRetained(self, request: pb.ReleaseRetainedRequest, context):
        retention_id = await self.ownership.may_release(request.conversation_id, request.retention_id)
        released = await self.domain.release_retained(request.conversation_id, retention_id)
        return pb.ReleaseRetainedResponse(released=released)

    @unary
    async def DrainEngine(self, request: pb.DrainEngineRequest, context):
        ranks = await self.domain.drain_engine(request.engine_id, undo=request.undo, reason=request.reason)
        return pb.DrainEngineResponse(ranks=ranks)
