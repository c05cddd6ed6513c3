"""gRPC adapter for the rendezvous domain (``services.domain.rendezvous``)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import structlog

from kvbaton.v1 import rendezvous_pb2 as pb
from kvbaton.v1 import rendezvous_pb2_grpc as pb_grpc

from ..domain import limits
from ..domain.errors import DomainError, exhausted
from ..domain.hub import SubscriberOverflow
from ..domain.rendezvous import RendezvousService, match_delivered
from ..store import RequestTooLargeError, StoreError
from . import eager, incarnation
from .budget import ByteBudget
from .guard import SESSION_GATE
from .overload import LoopLag
from .status import grpc_code, store_unavailable, streaming, too_large, unary

log = structlog.get_logger(__name__)

HEARTBEAT_S = 5.0
# Messages of one session being worked on at once; the stream is not read beyond that.
SESSION_IN_FLIGHT = 1024
_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
# The answer to a session call this server does not know (an empty body, or a newer
# client's call type: the client then sends that type as unary calls).
NO_BODY = "session call has no body (offer, complete, report_outcome, cancel or begin_read)"


def _failed(result: pb.SessionResult, seq: int, code: int, reason: str, retry_after_ms: int = 0) -> pb.SessionResult:
    """``result`` as an error answer only: whatever the call wrote into it first is dropped."""
    result.Clear()
    result.seq, result.code, result.reason, result.retry_after_ms = seq, code, reason, retry_after_ms
    return result


class RendezvousServicer(pb_grpc.RendezvousServicer):
    def __init__(self, domain: RendezvousService, *, load: LoopLag | None = None) -> None:
        self.domain = domain
        # Past capacity, messages that would open a new transfer are refused (see overload.py).
        self.load = load

    def _admit(self, transfer_id: str) -> None:
        """Refuses a message that would open a new transfer while the server is overloaded.
        One for a transfer already known here (its other side arrived) finishes accepted
        work and is always admitted."""
        load = self.load
        if load is not None and load.overloaded and self.domain.hub.records.get(self.domain._key(transfer_id)) is None:
            reason = load.refuse()
            if reason is not None:
                raise exhausted(reason, retry_after_ms=load.retry_after_ms())

    # The answers are written into a response the caller made (``out``): a session call's
    # is the one inside its SessionResult, so the transfer's state is copied once, not
    # into a RendezvousResponse and then again into the SessionResult around it.
    async def _offer(self, r: pb.OfferRequest, out: pb.RendezvousResponse | None = None) -> pb.RendezvousResponse:
        self._admit(r.transfer_id)
        msg = self.domain.validate(is_offer=True, transfer_id=r.transfer_id, attempt=r.attempt,
                                   engine_id=r.decode_engine_id, block_ids=r.block_ids, num_tokens=r.num_tokens,
                                   timeout_ms=r.timeout_ms, request_id=r.request_id, peer=r.prefill_engine_id)
        state, matched, dup = await self.domain.submit(msg)
        out = pb.RendezvousResponse() if out is None else out
        out.state.CopyFrom(state)
        out.matched_now, out.duplicate = matched, dup
        return out

    async def _complete(self, r: pb.CompleteRequest, out: pb.RendezvousResponse | None = None) -> pb.RendezvousResponse:
        self._admit(r.transfer_id)
        msg = self.domain.validate(is_offer=False, transfer_id=r.transfer_id, attempt=r.attempt,
                                   engine_id=r.prefill_engine_id, block_ids=r.block_ids, num_tokens=r.num_tokens,
                                   timeout_ms=r.timeout_ms, request_id=r.request_id, writers=r.writers,
                                   peer=r.decode_engine_id, match_in_answer=r.match_in_answer)
        state, matched, dup = await self.domain.submit(msg)
        # A duplicate of the completion that was answered with the MATCH is answered with it
        # again (its first answer may have been lost with a broken stream).
        delivered = r.match_in_answer and (matched or dup) and match_delivered(state, r.prefill_engine_id)
        out = pb.RendezvousResponse() if out is None else out
        out.state.CopyFrom(state)
        out.matched_now, out.duplicate, out.match_delivered = matched, dup, delivered
        return out

    @unary
    async def Offer(self, r: pb.OfferRequest, context):
        return await self._offer(r)

    @unary
    async def Complete(self, r: pb.CompleteRequest, context):
        return await self._complete(r)

    @streaming
    async def Subscribe(self, r: pb.SubscribeRequest, context):
        limits.check_engine_id("engine_id", r.engine_id)  # "*" (every engine's events) is no engine's id
        after = await incarnation.resume_from(self.domain.store, r.after_revision, r.incarnation, "subscribe")
        await incarnation.announce(context, self.domain.store)
        # A heartbeat first: the subscriber knows it is registered before it offers. Its
        # revision is where the stream starts (events replayed after a restart come next).
        yield pb.RendezvousEvent(type=pb.RendezvousEvent.TYPE_HEARTBEAT, revision=after or self.domain.hub.revision)

        # Heartbeats come from the hub's idle timer (one per stream every HEARTBEAT_S), not
        # from a timeout around each event: a busy stream pays nothing per event for them.
        # A subscriber that fell behind ends quietly (the client resumes from its revision).
        with contextlib.suppress(SubscriberOverflow):
            async for event in self.domain.subscribe(r.engine_id, r.tp_rank, after, idle_s=HEARTBEAT_S):
                if event is None:
                    yield pb.RendezvousEvent(type=pb.RendezvousEvent.TYPE_HEARTBEAT, revision=self.domain.hub.revision)
                else:
                    yield event

    async def _begin_read(self, r: pb.BeginReadRequest) -> pb.TransferState:
        return await self.domain.begin_read(
            kind=r.kind, transfer_id=r.transfer_id, attempt=r.attempt, reader_engine_id=r.reader_engine_id,
            block_ids=r.block_ids, readers=r.readers, generation=r.generation, conversation_id=r.conversation_id,
            source_block_ids=r.source_block_ids, request_id=r.request_id)

    @unary
    async def BeginRead(self, r: pb.BeginReadRequest, context):
        return await self._begin_read(r)

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
        transfers, token = await self.domain.list_page(phases=r.phases, engine_id=r.engine_id, limit=r.limit,
                                                       page_size=r.page_size, page_token=r.page_token)
        return pb.ListTransfersResponse(transfers=transfers, next_page_token=token)

    async def _session_one(self, call: pb.SessionCall, gate, result: pb.SessionResult) -> pb.SessionResult:
        """One session call, answered like its unary RPC would be (errors in the result),
        into ``result`` (a fresh one: the slot of the batch it goes out in, see ``Session``)."""
        seq = call.seq
        result.seq = seq
        try:
            if gate is not None:
                refused = gate(call)
                if refused is not None:
                    result.code, result.reason = refused[0].value[0], refused[1]
                    result.retry_after_ms = refused[2] if len(refused) > 2 else 0
                    return result
            body = call.WhichOneof("body")
            if body == "offer":
                await self._offer(call.offer, result.rendezvous)
            elif body == "complete":
                await self._complete(call.complete, result.rendezvous)
            elif body == "report_outcome":
                r = call.report_outcome
                result.state.CopyFrom(await self.domain.report_outcome(r.transfer_id, r.attempt, r.outcome))
            elif body == "cancel":
                c = call.cancel
                result.state.CopyFrom(await self.domain.cancel(c.transfer_id, c.attempt, c.engine_id, c.reason))
            elif body == "begin_read":
                result.state.CopyFrom(await self._begin_read(call.begin_read))
            else:
                result.code, result.reason = _INVALID, NO_BODY
            return result
        except DomainError as exc:
            return _failed(result, seq, grpc_code(exc.code).value[0], exc.message, exc.retry_after_ms)
        except RequestTooLargeError as exc:
            return _failed(result, seq, _INVALID, too_large(exc))
        except StoreError as exc:
            log.warning("store.unavailable", rpc="Session", error=str(exc))
            return _failed(result, seq, grpc.StatusCode.UNAVAILABLE.value[0], store_unavailable(exc))
        except Exception as exc:  # one call's bug must not end every other call's stream
            log.exception("rendezvous.session_error", seq=seq)
            return _failed(result, seq, grpc.StatusCode.INTERNAL.value[0], repr(exc)[:500])

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        # Set by the guard in this RPC's task: per-call authorization and rate limits.
        gate = SESSION_GATE.get()
        loop = asyncio.get_running_loop()
        # The next response to go out. A call is answered into a slot added to it before
        # the call starts, so an answer made without waiting is written once, in place: a
        # response built from a list of answers copies each of them (the whole transfer
        # state, twice per match). An answer that waited is made apart and copied in.
        batch = [pb.SessionResponse()]
        held = [0]  # bytes of the batch's answers reserved in the budget (each sized once)
        ready = asyncio.Event()
        working: set[asyncio.Task] = set()
        slots = asyncio.Semaphore(SESSION_IN_FLIGHT)
        state = {"finished": False}

        budget = ByteBudget()
        inline = [0]  # answers in the batch that hold no slot (answered without a task)

        def deliver(result: pb.SessionResult | None, size: int) -> None:
            if result is not None:  # (None: already in the batch, in its slot)
                batch[0].results.append(result)
            held[0] += size
            ready.set()

        async def answer(pending: eager.Suspended) -> None:
            # A call that had to wait (an etcd round trip): its slot and its answer's bytes
            # are held until the answer is written, so a client that stops reading stops
            # being read (bounded server memory).
            try:
                result = await pending.drive()
                size = result.ByteSize()
                await budget.acquire(size)
                deliver(result, size)
            except BaseException:
                slots.release()
                raise

        async def pump() -> None:
            # Calls are worked on concurrently (each decided by its own CAS) and answered as
            # they finish, batched: whatever finished while the last batch was being written
            # goes out in the next. A call that finishes without waiting (the memory store)
            # is answered inline, with no task; one that waits gets a task and a slot. When
            # the client half-closes, what is in flight finishes.
            try:
                async for req in request_iterator:
                    for call in req.calls:
                        # Nothing else runs until ``start`` returns: the slot stays the batch's
                        # last, and is taken out again unless the answer is final and fits.
                        results = batch[0].results
                        try:
                            done, value = eager.start(self._session_one(call, gate, results.add()))
                        except BaseException:
                            del results[-1]
                            raise
                        if done:
                            size = value.ByteSize()  # type: ignore[union-attr]
                            if budget.try_acquire(size):
                                deliver(None, size)
                            else:  # the client is not reading: stop reading it, the answer held apart
                                del results[-1]
                                await budget.acquire(size)
                                deliver(value, size)  # type: ignore[arg-type]
                            inline[0] += 1
                            continue
                        del results[-1]  # it is answered when it finishes (into the slot it holds)
                        await slots.acquire()
                        task = loop.create_task(answer(value))  # type: ignore[arg-type]
                        working.add(task)
                        task.add_done_callback(working.discard)
                if working:
                    await asyncio.wait(set(working))
            finally:
                state["finished"] = True
                ready.set()

        reader = loop.create_task(pump())
        try:
            while True:
                await ready.wait()
                ready.clear()
                if batch[0].results:
                    out, batch[0] = batch[0], pb.SessionResponse()
                    size, held[0] = held[0], 0
                    slotted, inline[0] = len(out.results) - inline[0], 0
                    yield out
                    budget.release(size)
                    for _ in range(slotted):
                        slots.release()
                elif state["finished"]:
                    break
                else:
                    continue
                if state["finished"] and not batch[0].results:
                    break
        finally:
            reader.cancel()
            for task in list(working):
                task.cancel()
