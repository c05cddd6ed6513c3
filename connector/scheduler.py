"""Scheduler half of the kvbaton connector (runs in ``VLLM::EngineCore``, engine-loop thread).

Bookkeeping on the engine loop: it never blocks on the network (control-plane calls are
handed to a background :class:`~kvbaton.connector.control.ControlThread`; the only local
I/O is appending stats lines and the short ``idle_step_wait_ms`` sleep on empty steps) and
hands all KV work to the worker through the per-step
:class:`~kvbaton.connector.metadata.KvbatonMeta`. The ``kv_transfer_params`` keys it reads
and writes are named in :mod:`kvbaton.params` (shared with the router).

Push mode: decode offers its destination blocks (``Rendezvous.Offer``) and prefill
announces its held blocks (``Rendezvous.Complete``); both calls go out on a background
:class:`~kvbaton.connector.control.ControlThread` (fire-and-forget, errors logged — a lost
call ends in the worker's timeout and a local recompute, never a hang). Offers list
*all* the request's prompt blocks so the counts match prefill's; ``num_tokens`` is what
decode needs, so prefill skips the leading locally-cached blocks (never writes them).

Pull mode, as seen from here:

* **Prefill** (request carries ``do_remote_decode``): ``request_finished`` keeps the blocks
  (delay-free) and returns ``kv_transfer_params`` naming this engine, the block ids and
  the ``transfer_id``; the worker is told to hold them until decode's notification.
* **Decode** (request carries ``do_remote_prefill``): ``get_num_new_matched_tokens``
  claims the non-locally-cached prompt tokens as an async load, once per request (the
  flag is cleared so a failed load, which re-enters admission, recomputes instead of
  looping — ``connector/VLLM_API_NOTES.md`` §0.5).

Reuse (D→P across turns, see :mod:`.reuse`):

* **Decode**: a finished turn whose ``kv_transfer_params`` carry ``conversation_id`` keeps
  its full blocks under a lease (:class:`RetentionManager`); the response says so.
* **Prefill**: a request whose params carry ``reuse`` (the router's lookup of the
  conversation's retained blocks) compares hash chains; if at least
  ``kv_recompute_threshold`` tokens beyond its own prefix-cache hit are reusable it claims
  them as an async load (``MODE_REUSE``: the worker pins the lease and READs from decode).
  Offered once, like pull loads: a failed read re-enters admission and recomputes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import time
import uuid
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from kvbaton import params as P
from kvbaton.services.metrics import connector_metrics
from kvbaton.v1 import rendezvous_pb2 as rpb

from .control import ControlThread, complete_request, rendezvous_call, retry_while_unregistered, security_of
from .metadata import KvbatonMeta, LoadSpec, ReuseSource, SendSpec
from .reuse import RetentionManager, reusable_blocks
from .settings import MODE_PULL, MODE_PUSH, MODE_REUSE, KvbatonSettings
from .statslog import StatsLog
from .wakeup import WakeListener, find_engine_inbox, wake_name

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvbaton.connector.scheduler")


class KvbatonScheduler:
    """Scheduler-side state: which requests to load (decode) and which to hold (prefill)."""

    def __init__(self, settings: KvbatonSettings, block_size: int, tp_size: int = 1) -> None:
        self.settings = settings
        self.block_size = block_size
        self.tp_size = max(int(tp_size), 1)
        # Local prefix-hit tokens seen at admission, needed in update_state_after_alloc
        # (where `blocks` includes the locally cached blocks, VLLM_API_NOTES.md §0.6).
        self._local_hit: dict[str, int] = {}
        self._loads: dict[str, LoadSpec] = {}
        self._sends: dict[str, SendSpec] = {}
        self._control: ControlThread | None = None  # started on first use
        self._retention: RetentionManager | None = None
        self._reuse_pending: dict[str, tuple[int, P.ReuseOffer]] = {}  # req -> (blocks, offer)
        self.params_refused = 0  # requests whose kv_transfer_params had another version
        self.reuse_stats: dict[str, int] = {"reuse_claimed": 0, "reuse_below_threshold": 0,
                                            "reuse_no_match": 0, "reuse_claimed_tokens": 0}
        # Requests whose transfer the worker has not reported finished yet -> monotonic
        # deadline after which we stop counting them (the worker's own timeout is shorter).
        self._in_flight: dict[str, float] = {}
        self.idle_stats: dict[str, float] = {"idle_steps": 0, "idle_wait_s": 0.0, "long_waits": 0}
        self._stats = StatsLog(settings.stats_dir, settings.engine_id, part="scheduler")
        # At TP > 1 idle steps wait long and the ranks wake us (connector/wakeup.py). Bound
        # now, before any rank can report: a wake sent before the first wait is kept.
        self._wake: WakeListener | None = None
        self._inbox: queue.Queue[Any] | None = None
        self._long_waits = self.tp_size > 1 and settings.tp_idle_wait_max_ms > 0
        self._ended_unwoken = 0  # transfers that ended before any rank's wake came (see below)
        if self._long_waits:
            try:
                self._wake = WakeListener(wake_name(settings.engine_id, os.getpid()))
                self._stats.record("wake_listener", name=self._wake.name[1:].decode(), tp_size=self.tp_size)
            except OSError as exc:
                log.warning("kvbaton: no wake-up channel (%s): short idle steps at TP %d", exc, self.tp_size)
                self._long_waits = False

    def _mode(self, params: dict[str, Any]) -> str:
        return str(params.get(P.TRANSFER_MODE) or self.settings.mode)

    @staticmethod
    def _tp(params: dict[str, Any] | None) -> str:
        """The router's ``traceparent`` for this request ("" without tracing): passed on,
        as gRPC metadata, with every control-plane call made for the request."""
        return str((params or {}).get(P.TRACEPARENT) or "")

    def _control_thread(self) -> ControlThread:
        if self._control is None:
            # One control client per process: the rank-0 worker of a one-rank engine runs in
            # this process and holds the engine's sole subscription on the same client.
            self._control = ControlThread.shared(self.settings.control_plane, name="kvbaton-sched-control",
                                                 security=security_of(self.settings), unpin=self.settings.unpin_threads)
        return self._control

    def bind_block_pool(self, block_pool: Any) -> None:
        """Decode retention holds block references in vLLM's pool (see :mod:`.reuse`)."""
        if not self.settings.retain:
            return
        self._retention = RetentionManager(self.settings, self.block_size, self._control_thread())
        self._retention.bind(block_pool)

    def _rpc(self, what: str, fn: Any, transfer_id: str = "") -> None:
        """Fire-and-forget a control-plane call from the engine loop (never blocks it).

        Each call's submit→answer time goes to the ``scheduler`` stats file: how long the
        engine process took to get a message out is part of push's critical path."""
        t0 = time.monotonic()
        fut = self._control_thread().submit(fn)

        def _done(f: concurrent.futures.Future[Any]) -> None:
            err = "cancelled" if f.cancelled() else repr(f.exception()) if f.exception() is not None else ""
            if err:
                log.warning("kvbaton: %s failed: %s", what, err)
            self._stats.record("rpc", rpc=what, transfer_id=transfer_id, error=err,
                               latency_ms=round((time.monotonic() - t0) * 1000, 2))
        fut.add_done_callback(_done)

    def shutdown(self) -> None:
        if self._retention is not None:
            self._retention.close()
        if self._control is not None:
            self._control.close()
        if self._wake is not None:
            self._wake.close()

    # ------------------------------------------------------------------ decode side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self._retention is not None:
            self._retention.drain()  # ended leases give their blocks back before allocation
        params = request.kv_transfer_params
        if params and (refused := P.version_error(params)):
            # Another contract's params could mean anything: don't act on them at all.
            # The request is computed here like one without kv_transfer_params.
            log.error("kvbaton: request %s refused its kv_transfer_params: %s", request.request_id, refused)
            self.params_refused += 1
            self._stats.record("params_refused", request_id=request.request_id, error=refused)
            request.kv_transfer_params = None
            return 0, False
        if params and params.get(P.REUSE) and not params.get(P.DO_REMOTE_PREFILL):
            return self._claim_reuse(request, params, num_computed_tokens)
        if not params or not params.get(P.DO_REMOTE_PREFILL):
            return 0, False
        if self._mode(params) == MODE_PULL and not params.get(P.REMOTE_ENGINE_ID):
            return 0, False
        remote_tokens = int(params.get(P.REMOTE_NUM_TOKENS) or len(request.prompt_token_ids or ()))
        count = min(remote_tokens, request.num_prompt_tokens) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_hit[request.request_id] = num_computed_tokens
        return count, True

    def _claim_reuse(self, request: Request, params: dict[str, Any], num_computed_tokens: int) -> tuple[int, bool]:
        """Prefill: how many prompt tokens to READ from decode's retained blocks (once)."""
        offer = P.ReuseOffer.from_params(params.get(P.REUSE))
        if offer is None or offer.tokens_per_block != self.block_size:
            params.pop(P.REUSE, None)
            self.reuse_stats["reuse_no_match"] += 1
            return 0, False
        hashes = offer.block_hashes[: len(offer.block_ids)]
        k = reusable_blocks(request.prompt_token_ids or (), self.block_size, hashes)
        ext = k * self.block_size - num_computed_tokens
        claim = ext >= max(1, self.settings.kv_recompute_threshold)
        # Why a reuse turn did or did not READ: how much of the history this prefill's own
        # prefix cache already held (then a READ cannot win) and how much decode offered.
        self._stats.record("reuse_offer", conversation_id=offer.conversation_id, request_id=request.request_id,
                           prompt_tokens=int(request.num_prompt_tokens), local_hit_tokens=int(num_computed_tokens),
                           reusable_tokens=k * self.block_size, read_tokens=max(ext, 0) if claim else 0,
                           decision="read" if claim else ("below_threshold" if k else "no_match"))
        if not claim:
            params.pop(P.REUSE, None)
            self.reuse_stats["reuse_below_threshold" if k else "reuse_no_match"] += 1
            if ext > 0:  # reusable tokens beyond the local hit, too few to be worth a READ
                connector_metrics().recomputes.labels("below_threshold").inc()
            log.info("kvbaton: %s: %d reusable tokens beyond the local hit (%d): recomputing",
                     request.request_id, max(ext, 0), num_computed_tokens)
            return 0, False
        self._local_hit[request.request_id] = num_computed_tokens
        self._reuse_pending[request.request_id] = (k, offer)
        return ext, True

    def _alloc_reuse(self, request: Request, params: dict[str, Any], blocks: KVCacheBlocks,
                     num_external_tokens: int) -> None:
        params.pop(P.REUSE, None)  # offer once (VLLM_API_NOTES.md §0.5)
        k, offer = self._reuse_pending.pop(request.request_id)
        hit = self._local_hit.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            return
        local_all = blocks.get_block_ids()[0]
        first = hit // self.block_size
        last = min(k, len(local_all))
        remote = offer.block_ids[first:last]
        local = tuple(int(b) for b in local_all[first:last])
        src = ReuseSource(offer.conversation_id, offer.engine_id, offer.lease_id, offer.retention_id,
                          last * self.block_size)
        tid = f"reuse-{uuid.uuid4().hex[:12]}"
        self._loads[request.request_id] = LoadSpec(tid, src.engine_id, remote, local, True,
                                                   mode=MODE_REUSE, reuse=src, traceparent=self._tp(params))
        self.reuse_stats["reuse_claimed"] += 1
        self.reuse_stats["reuse_claimed_tokens"] += num_external_tokens

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params:
            self._stamp_admitted(request, params, num_external_tokens)
        if params is not None and request.request_id in self._reuse_pending:
            self._alloc_reuse(request, params, blocks, num_external_tokens)
            return
        if not params or not params.get(P.DO_REMOTE_PREFILL):
            return
        # Offer once: whatever happens next (load ok, load failed, nothing to load) this
        # request must never be offered for a remote load again.
        params[P.DO_REMOTE_PREFILL] = False
        tid = str(params.get(P.TRANSFER_ID) or "")
        remote_engine = str(params.get(P.REMOTE_ENGINE_ID) or "")
        remote_ids = [int(b) for b in (params.get(P.REMOTE_BLOCK_IDS) or ())]
        hit = self._local_hit.pop(request.request_id, 0)
        if self._mode(params) == MODE_PUSH:
            self._offer(request, blocks, num_external_tokens, hit, tid)
            return
        if num_external_tokens > 0:
            local_all = blocks.get_block_ids()[0]
            first = hit // self.block_size
            n_tokens = hit + num_external_tokens
            last = min(-(-n_tokens // self.block_size), len(local_all), len(remote_ids))
            local = tuple(int(b) for b in local_all[first:last])
            remote = tuple(remote_ids[first:last])
            self._loads[request.request_id] = LoadSpec(tid, remote_engine, remote, local, True,
                                                       traceparent=self._tp(params),
                                                       ledger_block_ids=tuple(int(b) for b in local_all[:last]))
        else:
            # Nothing to read (all cached locally): still let prefill free its blocks now.
            self._loads[request.request_id] = LoadSpec(tid, remote_engine, (), (), False,
                                                       traceparent=self._tp(params))

    def _stamp_admitted(self, request: Request, params: dict[str, Any], num_external_tokens: int) -> None:
        """An ``admitted`` stats line each time a P/D leg is scheduled (a leg whose KV was
        loaded is scheduled again when the load is over, and stamped again): when the engine got it
        (vLLM's ``arrival_time``) and when it left the waiting queue (now), how much of its
        prompt was a local prefix hit and how much comes from elsewhere (decode: the pull's
        size; prefill: the reuse READ). It splits a turn's TTFT into queueing, transfers and
        compute (``benchmarks/ttft_breakdown.py``); the waiting time is not otherwise visible.
        ``local_hit_tokens`` is -1 where this side did not look (a prefill offered no reuse:
        the router's ``X-Kvbaton-Prefill-Cached-Tokens`` says it)."""
        if not (params.get(P.DO_REMOTE_PREFILL) or params.get(P.DO_REMOTE_DECODE)):
            return
        self._stats.record("admitted", request_id=request.request_id,
                           role="decode" if params.get(P.DO_REMOTE_PREFILL) else "prefill",
                           transfer_id=str(params.get(P.TRANSFER_ID) or ""),
                           conversation_id=str(params.get(P.CONVERSATION_ID) or ""),
                           arrival_t=float(getattr(request, "arrival_time", 0.0) or 0.0),
                           prompt_tokens=int(request.num_prompt_tokens),
                           local_hit_tokens=int(self._local_hit.get(request.request_id, -1)),
                           external_tokens=int(num_external_tokens))

    def _offer(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int,
               hit: int, tid: str) -> None:
        if not tid:
            log.warning("kvbaton: push request %s has no transfer_id; computing locally", request.request_id)
            return
        tp = self._tp(request.kv_transfer_params)
        if num_external_tokens <= 0:
            # All of it is cached here: cancel so prefill frees its blocks.
            self._rpc("Cancel", rendezvous_call("Cancel", rpb.CancelRequest(
                transfer_id=tid, engine_id=self.settings.engine_id, reason="decode has the prefix cached"), tp), tid)
            return
        local_all = [int(b) for b in blocks.get_block_ids()[0]]
        last = min(-(-(hit + num_external_tokens) // self.block_size), len(local_all))
        first = hit // self.block_size
        self._loads[request.request_id] = LoadSpec(tid, "", (), tuple(local_all[first:last]), True,
                                                   mode=MODE_PUSH, traceparent=tp)
        offer = rpb.OfferRequest(transfer_id=tid, decode_engine_id=self.settings.engine_id,
                                 block_ids=local_all[:last], num_tokens=num_external_tokens,
                                 timeout_ms=int(self.settings.timeout_s * 1000),
                                 request_id=request.request_id,
                                 prefill_engine_id=str((request.kv_transfer_params or {}).get(P.PREFILL_ENGINE_ID) or ""))
        self._rpc("Offer", rendezvous_call("Offer", offer, tp), tid)

    # ------------------------------------------------------------------ prefill side
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        self._local_hit.pop(request.request_id, None)
        self._reuse_pending.pop(request.request_id, None)
        tp = self._tp(params)
        if params.get(P.DO_REMOTE_PREFILL):
            # Decode request finished (aborted) before it was ever allocated: tell the
            # prefill engine to free its held blocks instead of waiting for its timeout.
            params[P.DO_REMOTE_PREFILL] = False
            if self._mode(params) == MODE_PUSH and params.get(P.TRANSFER_ID):
                cancel = rpb.CancelRequest(transfer_id=str(params[P.TRANSFER_ID]),
                                           engine_id=self.settings.engine_id, reason="decode request aborted")
                self._rpc("Cancel", rendezvous_call("Cancel", cancel, tp), cancel.transfer_id)
            elif params.get(P.REMOTE_ENGINE_ID):
                self._loads[request.request_id] = LoadSpec(
                    str(params.get(P.TRANSFER_ID) or ""), str(params[P.REMOTE_ENGINE_ID]), (), (), False,
                    traceparent=tp)
            return False, None
        if not params.get(P.DO_REMOTE_DECODE):
            if params.get(P.CONVERSATION_ID) and self._retention is not None and request.status in (
                    RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
                retained = self._retention.retain(str(params[P.CONVERSATION_ID]), request.all_token_ids,
                                                  block_ids, int(request.num_computed_tokens))
                return False, ({P.RETAINED: retained} if retained else None)
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        if not block_ids:
            return False, None
        tid = str(params.get(P.TRANSFER_ID) or uuid.uuid4().hex)
        if self._mode(params) == MODE_PUSH:
            n_tokens = min(int(request.num_computed_tokens), int(request.num_prompt_tokens))
            ids = tuple(int(b) for b in block_ids[: -(-n_tokens // self.block_size)])
            here = self.settings.complete_from_worker
            peer = str(params.get(P.DECODE_ENGINE_ID) or "")
            self._sends[request.request_id] = SendSpec(tid, len(ids), self.settings.timeout_s, MODE_PUSH,
                                                       ids, n_tokens, traceparent=tp, complete_here=here,
                                                       request_id=request.request_id, peer_engine_id=peer)
            if not here:
                complete = complete_request(self.settings.engine_id, self.settings.timeout_s, tid, ids, n_tokens,
                                            request.request_id, peer)
                self._rpc("Complete", retry_while_unregistered(rendezvous_call("Complete", complete, tp),
                                                               self.settings.timeout_s / 2), tid)
            return True, P.push_handoff(self.settings.engine_id, tid)
        self._sends[request.request_id] = SendSpec(tid, len(block_ids), self.settings.timeout_s, traceparent=tp,
                                                   block_ids=tuple(int(b) for b in block_ids))
        # The hold on the ledger: decode's BeginRead names it (a read of a hold that expired
        # or was cancelled is refused), and its DONE or EXPIRED is when these blocks are freed.
        # Bound to the decode the router named (required where the control plane has tokens).
        hold = complete_request(self.settings.engine_id, self.settings.timeout_s, tid,
                                tuple(int(b) for b in block_ids), int(request.num_computed_tokens), request.request_id,
                                str(params.get(P.DECODE_ENGINE_ID) or ""))
        self._rpc("Complete", retry_while_unregistered(rendezvous_call("Complete", hold, tp),
                                                       self.settings.timeout_s / 2), tid)
        # this branch is pull whatever the engine default
        return True, P.pull_handoff(self.settings.engine_id, block_ids, int(request.num_computed_tokens), tid)

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvbatonMeta:
        if self._retention is not None:
            self._retention.drain()
        if self._loads or self._sends:
            deadline = time.monotonic() + self.settings.timeout_s + 5.0
            for rid, load in self._loads.items():
                if load.report_recv:
                    self._in_flight[rid] = deadline
            for rid in self._sends:
                self._in_flight[rid] = deadline
        elif scheduler_output is not None and not scheduler_output.total_num_scheduled_tokens:
            self._idle_wait()
        meta = KvbatonMeta(loads=self._loads, sends=self._sends)
        self._loads, self._sends = {}, {}
        if self._retention is not None:
            meta.retains = self._retention.take_retains()  # verify_kv: the worker fingerprints them
        return meta

    def _idle_wait(self) -> None:
        """Sleep briefly on an empty step that exists only because transfers are pending.

        While a request waits for its KV (decode) or holds blocks for a transfer
        (prefill), vLLM steps continuously with empty batches (~1.5 ms each, API notes
        ``VLLM_API_NOTES.md`` §0.4): the engine loop then holds the GIL almost all the time, and this process's
        control thread — the one sending Offer/Complete — waits up to a switch interval
        for every GIL hand-off of a gRPC call (measured: Complete reaching the rendezvous
        up to 230 ms after prefill finished). A short sleep here releases the GIL and the
        core; the cost is at most ``idle_step_wait_ms`` of delay for a request arriving
        during the sleep or a transfer finishing during it. Never sleeps when anything is
        scheduled, nor when no transfer of ours is pending (vLLM's own empty steps)."""
        wait_s = self.settings.idle_step_wait_ms / 1000.0
        if wait_s <= 0 or not self._in_flight:
            return
        now = time.monotonic()
        stale = [rid for rid, dl in self._in_flight.items() if dl < now]
        for rid in stale:
            del self._in_flight[rid]
        if not self._in_flight:
            return
        if self._long_waits and self._long_wait(now, min(self._in_flight.values()), wait_s):
            return
        time.sleep(wait_s)
        self.idle_stats["idle_steps"] += 1
        self.idle_stats["idle_wait_s"] += time.monotonic() - now

    def _long_wait(self, now: float, first_deadline: float, slice_s: float) -> bool:
        """TP > 1: wait until a rank reports a transfer ended (its wake), a request arrives,
        ``tp_idle_wait_max_ms`` passes or the first pending transfer's deadline does; False
        (the caller sleeps the short step) when the engine core's input queue cannot be found.

        Longer than vLLM's 1 s spin window, so the ranks' main threads stop busy-waiting on the
        shm queue (``connector/wakeup.py`` says why); a new request waits at most ``slice_s``,
        as with the short steps."""
        assert self._wake is not None
        if self._inbox is None:
            self._inbox = find_engine_inbox()
            if self._inbox is None:
                log.warning("kvbaton: the engine core's input queue was not found: short idle steps at TP %d",
                            self.tp_size)
                self._long_waits = False
                return False
        timeout_s = min(self.settings.tp_idle_wait_max_ms / 1000.0, first_deadline - now)
        reason = self._wake.wait(timeout_s, self._inbox, slice_s)
        waited = time.monotonic() - now
        self.idle_stats["idle_steps"] += 1
        self.idle_stats["long_waits"] += 1
        self.idle_stats["idle_wait_s"] += waited
        self.idle_stats[reason] = self.idle_stats.get(reason, 0) + 1
        if waited > 0.1:  # the long ones, to see how much the spinning stopped
            self._stats.record("idle_wait", reason=reason, waited_ms=round(waited * 1000, 1),
                               in_flight=len(self._in_flight))
        return True

    def update_connector_output(self, finished_sending: set[str] | None,
                                finished_recving: set[str] | None) -> None:
        """The worker's per-step report: these transfers are over (ok or failed)."""
        ended = False
        for ids in (finished_sending, finished_recving):
            for rid in ids or ():
                ended |= self._in_flight.pop(rid, None) is not None
        if ended and self._wake is not None and self._long_waits and not self._wake.wakes and not self._wake.pending():
            self._check_wakes_arrive()

    def _check_wakes_arrive(self) -> None:
        """A rank wakes us right after it reports a transfer ended, so a wake arrives before we
        can learn of the end here. Transfers ended twice and none came: the ranks cannot reach
        the socket (they are not this process's children in this vLLM, wakeup.wake_name), and
        long waits would add up to ``tp_idle_wait_max_ms`` to every transfer: back to short ones.
        (Twice: the first report can overtake its own wake by a thread switch.)"""
        assert self._wake is not None
        self._ended_unwoken += 1
        if self._ended_unwoken < 2:
            return
        log.warning("kvbaton: no wake-up from the ranks after %d ended transfers: short idle steps at TP %d",
                    self._ended_unwoken, self.tp_size)
        self._stats.record("wake_unreachable", name=self._wake.name[1:].decode(), ended=self._ended_unwoken)
        self._long_waits = False
