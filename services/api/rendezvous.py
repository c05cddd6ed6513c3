"""gRPC adapter for the rendezvous domain (``services.domain.rendezvous``)."""

from __future__ import annotations


from kvbaton.v1 import rendezvous_pb2 as pb
from kvbaton.v1 import rendezvous_pb2_grpc as pb_grpc

from ..domain.rendezvous import RendezvousService
from .status import streaming, unary, with_heartbeats

HEARTBEAT_S = 5.0


class RendezvousServicer(pb_grpc.RendezvousServicer):
    def __init__(self, domain: RendezvousService) -> None:
        self.domain = domain

    @unary
    async def Offer(self, r: pb.OfferRequest, context):
        msg = self.domain.validate(is_offer=True, transfer_id=r.transfer_id, attempt=r.attempt,
                                   engine_id=r.decode_engine_id, block_ids=r.block_ids, num_tokens=r.num_tokens,
                                   timeout_ms=r.timeout_ms, request_id=r.request_id)
        state, matched, dup = await self.domain.submit(msg)
        return pb.RendezvousResponse(state=state, matched_now=matched, duplicate=dup)

    @unary
    async def Complete(self, r: pb.CompleteRequest, context):
        msg = self.domain.validate(is_offer=False, transfer_id=r.transfer_id, attempt=r.attempt,
                                   engine_id=r.prefill_engine_id, block_ids=r.block_ids, num_tokens=r.num_tokens,
                                   timeout_ms=r.timeout_ms, request_id=r.request_id, writers=r.writers)
        state, matched, dup = await self.domain.submit(msg)
        return pb.RendezvousResponse(state=state, matched_now=matched, duplicate=dup)

    @streaming
    async def Subscribe(self, r: pb.SubscribeRequest, context):
        # A heartbeat first: the subscriber knows it is registered before it offers.
        yield pb.RendezvousEvent(type=pb.RendezvousEvent.TYPE_HEARTBEAT, revision=self.domain.hub.revision)
        heartbeat = lambda: pb.RendezvousEvent(type=pb.RendezvousEvent.TYPE_HEARTBEAT, revision=self.domain.hub.revision)  # noqa: E731
        async for event in with_heartbeats(self.domain.subscribe(r.engine_id, r.tp_rank, r.after_revision), heartbeat, HEARTBEAT_S):
            yield event

    @unary
    async def ReportOutcome(self, r: pb.ReportOutcomeRequest, context):
        return await self.domain.report_outcome(r.transfer_id, r.attempt, r.outcome)

    @unary
    async def Cancel(self, r: pb.CancelRequest, context):
        return await self.domain.cancel(r.transfer_id, r.attempt, r.engine_id, r.reason)

    @unary
    async def GetTransfer(self, r: pb.GetTransferRequest, context):
        return await self.domain.get(r.transfer_id)

    @unary
    async def ListTransfers(self, r: pb.ListTransfersRequest, context):
        return pb.ListTransfersResponse(transfers=await self.domain.list(phases=r.phases, engine_id=r.engine_id, limit=r.limit))
