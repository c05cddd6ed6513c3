"""The pack path inside the worker (``staging``, :mod:`..transfer.staging`).

Fragmented transfers can go gather → one NIXL WRITE per chunk → scatter → ack instead of
one descriptor per coalesced run.

* Pools: at ``register_kv_caches`` the loop allocates one receive and one send pool
  (``staging_slot_bytes`` × ``staging_slots`` + ``staging_send_slots``, on the KV's device;
  256 MiB on GPUs by default) and registers them with the agent once; the receive pool is
  published with the rank (``EngineRank.staging``).
  ``staging: never`` allocates nothing and publishes nothing.
* Staged sends (a push's WRITE, or the answer to a peer's staged READ) queue here and run
  one at a time (they share the send pool's slots and address the receiver's by number),
  each advanced a step per loop turn (:class:`~..transfer.staging.StagedSend`), so a slow
  staged send never stalls other loads: runs transfers, notifications and other flows keep
  moving on every turn of the same loop. Why stepped and not a thread of its own: the
  NIXL agent runs in no-lock mode, so every post, poll and notification must come from its
  one owner thread (a second thread would need NIXL's locking mode on every call, and
  notification handlers would then run on either thread). What takes time off that thread
  already has its own: CPU packing runs on the ``kvbaton-pack`` thread, GPU gathers and
  scatters on side streams; the owner thread only posts, polls and acks.
* Receive slots are granted by their engine (:mod:`..transfer.staging_grants`): a pusher
  asks first, a reader's pull request (:class:`~kvbaton.connector.wire.StagedPull`) is
  followed by its grant, so any number of engines may pack into this one at once. The
  owner looks the reader up and answers a pull with a staged send.
* Staged messages from an agent we have no metadata for (push: decode never looked prefill
  up) wait for its registrar lookup before they are processed (acks need it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from ..settings import STAGING_NEVER
from ..transfer.nixl_agent import NixlEndpoint
from ..transfer.pools import default_pool
from ..transfer.staging import GPU_POLL_MAX_S, PREFIX, StagedPeer, StagedSend, StagingInfo
from .context import FlowContext, error_text
from .peers import engine_of_agent

log = logging.getLogger("kvbaton.connector.staged")

#: Prefix of every staged (pack path) wire message (:data:`..transfer.staging.PREFIX`).
STAGED_PREFIX = PREFIX


@dataclasses.dataclass
class SendJob:
    """A staged send, queued or running. ``finished``/``error`` tell its owner the end."""

    peer: str
    engine_id: str
    info: StagingInfo | None  # the peer's published pool (sizes the grant request); None: a pull's answer
    local: Any
    remote: Any
    xfer_id: str
    deadline: float
    t0: float
    serve: bool = False  # answering a peer's staged READ (else: a push of ours)
    send: StagedSend | None = None
    finished: bool = False
    error: BaseException | None = None
    chunks: int = 0
    nbytes: int = 0


@dataclasses.dataclass
class _Waiting:
    """A peer's staged READ request, or its messages, until we know the peer."""

    agent: str
    deadline: float
    t0: float
    msgs: list[bytes] = dataclasses.field(default_factory=list)
    request: tuple[str, StagingInfo | None, Any, Any] | None = None  # serve: (xfer id, its pool, src, dst)
    peer_future: concurrent.futures.Future[Any] | None = None


class StagedFlow:
    def __init__(self, ctx: FlowContext, tensors: Sequence[torch.Tensor]) -> None:
        self.ctx = ctx
        self._tensors = list(tensors)
        self.peer: StagedPeer | None = None
        self.info: StagingInfo | None = None  # our receive pool, published with the rank
        self._queue: list[SendJob] = []  # [0] runs, the rest wait
        self._serves: list[_Waiting] = []  # staged READs of our blocks waiting for their reader
        self._held_msgs: dict[str, _Waiting] = {}  # agent -> its messages, until we know it
        self._done: dict[str, float] = {}  # incoming staged transfers fully scattered
        self._sources: dict[str, int] = {}  # agent -> our staged READs it is answering

    @property
    def has_pool(self) -> bool:
        return self.peer is not None

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._serves or self._held_msgs)

    @property
    def sending_on_gpu(self) -> bool:
        """A staged send is running from GPU memory: the loop polls at the GPU pace (a 32 MiB
        chunk crosses NVLink in ~80 µs; a 1 ms poll would idle the link)."""
        return self.peer is not None and self.peer.cuda and bool(self._queue or self.peer.busy)

    poll_s = GPU_POLL_MAX_S

    def init_pools(self, ep: NixlEndpoint) -> None:
        """Allocate and register this engine's staging pools once, next to the KV cache."""
        s, layout = self.ctx.settings, self.ctx.layout
        if s.staging == STAGING_NEVER or not self._tensors:
            return
        slot, nslots, nsend, chunks = s.staging_pool(layout.device)
        slot = max(slot, layout.bytes_per_block)  # a tile holds at least one block row
        # Ours first (the first matching prefix wins): staged messages from an agent we
        # cannot answer yet wait for its registrar lookup.
        ep.on_notif(STAGED_PREFIX, self._on_notif)
        try:
            self.peer = StagedPeer(ep, self._tensors, layout, slot_bytes=slot, num_slots=nslots,
                                   send_slots=nsend, target_chunks=chunks, min_chunk_bytes=min(4 << 20, slot),
                                   shared=default_pool(layout.device).shared, on_complete=self._on_complete)
        except Exception:  # no pool: runs only (published as absent)
            log.exception("kvbaton: staging pool not available; moving KV with coalesced runs only")
            self.peer = None
            return
        self.info = self.peer.info()
        log.info("kvbaton: staging pools %d + %d x %d B (%s), mode %s", nslots, nsend,
                 self.peer.recv_pool.slot_bytes, self.info.mem_type, s.staging)

    def close(self) -> None:
        for job in self._queue:
            self.abandon(job)
        if self.peer is not None:
            self.peer.close()

    # ------------------------------------------------------------------ incoming messages
    def _on_notif(self, agent: str, msg: bytes) -> None:
        if self.peer is None:
            return
        wait = self._held_msgs.get(agent)
        if wait is None and agent in self.ctx.endpoint.peers:
            self.peer._on_notif(agent, msg)  # we own the routing of its prefix
            return
        if wait is None:
            now = self.ctx.clock()
            wait = self._held_msgs[agent] = _Waiting(agent, now + self.ctx.settings.timeout_s, now)
        wait.msgs.append(msg)

    def _on_complete(self, agent: str, xfer_id: str) -> None:
        """Receiver: every chunk of an incoming staged transfer is scattered into our blocks."""
        assert self.peer is not None
        self.peer.completed.pop(xfer_id, None)  # tracked here (bounded by expire)
        self._done[xfer_id] = self.ctx.clock()

    def _deliver_held(self, now: float) -> None:
        """Deliver held staged messages once their sender's metadata is known."""
        assert self.peer is not None
        for agent, wait in list(self._held_msgs.items()):
            try:
                if not self._known(agent, wait, now):
                    continue
                del self._held_msgs[agent]
                for m in wait.msgs:
                    self.peer._on_notif(agent, m)
            except Exception as exc:  # noqa: BLE001 - the sender times out, the load recomputes
                self._held_msgs.pop(agent, None)
                log.warning("kvbaton: dropped %d staged messages from %s: %r", len(wait.msgs), agent, exc)
                self.ctx.stats.record("staged_dropped", peer=agent, num_msgs=len(wait.msgs),
                                      reason=error_text(exc)[:300])

    def _known(self, agent: str, wait: _Waiting, now: float) -> bool:
        eid = engine_of_agent(agent)
        got = self.ctx.peers.lookup(eid, wait, now)
        if got is None:
            return False
        if got[0] != agent:
            raise LookupError(f"engine {eid} is registered as {got[0]}, not {agent}")
        return True

    # ------------------------------------------------------------------ sends
    def submit_send(self, agent: str, engine_id: str, info: StagingInfo | None, local: Any, remote: Any, xfer_id: str,
                    deadline: float, *, serve: bool = False) -> SendJob:
        job = SendJob(agent, engine_id, info, local, remote, xfer_id, deadline, time.monotonic(), serve)
        self._queue.append(job)
        return job

    def abandon(self, job: SendJob) -> None:
        if job.send is not None:
            job.send.close()
        if job in self._queue:
            self._queue.remove(job)

    def progress(self, now: float) -> None:
        """One turn: held messages, new staged READ requests, then a step of the running send."""
        if self.peer is None:
            return
        if self._held_msgs:
            self._deliver_held(now)
        self._take_requests(now)
        if self._serves:
            self._progress_serves(now)
        while self._queue and self._step_send(self._queue[0]):
            self._queue.pop(0)

    def _step_send(self, job: SendJob) -> bool:
        """Advance the running send; True when it is over (done or failed)."""
        assert self.peer is not None
        try:
            if job.send is None:
                job.send = self.peer.start_send(job.peer, job.info, job.local, job.remote, job.xfer_id,
                                                timeout_s=max(0.001, job.deadline - time.monotonic()))
            if not job.send.step():
                return False
            # the chunk count is known once the receiver's grant arrived (its slot size)
            job.nbytes, job.chunks, job.finished = job.send.nbytes, job.send.nchunks, True
        except Exception as exc:  # noqa: BLE001 - its owner decides (fail the transfer)
            job.error = exc
        if job.send is not None:
            job.send.close()
        if job.serve:
            self._record_serve(job)
        return True

    def _take_requests(self, now: float) -> None:
        assert self.peer is not None
        while True:
            got = self.peer.take_pull()
            if got is None:
                return
            agent, xid, info, src, dst = got
            self._serves.append(_Waiting(agent, now + self.ctx.settings.timeout_s, now, request=(xid, info, src, dst)))

    def _progress_serves(self, now: float) -> None:
        """Owner: answer staged READs with staged sends, once the requester's NIXL metadata
        is known (bounded by ``timeout_s``; a failure is logged and the reader fails its load
        at its own deadline: recompute)."""
        keep: list[_Waiting] = []
        delay = self.ctx.faults.value("delay_staged_serve_s") if self.ctx.faults.path else 0.0
        for sv in self._serves:
            assert sv.request is not None
            xid, info, src, dst = sv.request
            if delay and now < sv.t0 + delay:  # test-only fault
                keep.append(sv)
                continue
            try:
                if not self._known(sv.agent, sv, now):
                    keep.append(sv)
                    continue
            except Exception as exc:  # noqa: BLE001 - the reader gives up at its deadline
                self._serve_failed(xid, engine_of_agent(sv.agent), exc)
                assert self.peer is not None
                self.peer.drop_pull(sv.agent, xid)  # the reader's slots go back
                continue
            self.submit_send(sv.agent, engine_of_agent(sv.agent), info, src, dst, xid, sv.deadline + delay,
                             serve=True)
        self._serves = keep

    def _record_serve(self, job: SendJob) -> None:
        if job.error is not None:
            self._serve_failed(job.xfer_id, job.engine_id, job.error)
            return
        self.ctx.stats.record("staged_serve", xfer_id=job.xfer_id, peer=job.engine_id, strategy="pack",
                              nbytes=job.nbytes, num_blocks=int(len(job.local)), chunks=job.chunks,
                              duration_s=round(time.monotonic() - job.t0, 6))

    def _serve_failed(self, xid: str, engine_id: str, exc: BaseException) -> None:
        log.warning("kvbaton: staged answer %s to %s failed: %r", xid, engine_id, exc)
        self.ctx.stats.record("staged_serve_failed", xfer_id=xid, peer=engine_id, reason=error_text(exc)[:300])
        self.ctx.peers.forget(engine_id)

    # ------------------------------------------------------------------ staged READs (reader)
    def start_read(self, agent: str, remote_ids: Sequence[int], local_ids: Sequence[int],
                   timeout_s: float | None = None) -> str | None:
        """Ask ``agent`` to push its ``remote_ids`` into our ``local_ids`` through our receive
        pool (the request carries our grant of receive slots, valid ``timeout_s``: any number
        of engines may answer staged READs of ours at once); the transfer's id."""
        assert self.peer is not None
        xid = "s" + uuid.uuid4().hex
        self._sources[agent] = self._sources.get(agent, 0) + 1
        self.peer.request_pull(agent, remote_ids, local_ids, xid,
                               timeout_s=timeout_s if timeout_s is not None else self.ctx.settings.timeout_s)
        return xid

    def read_done(self, xid: str) -> bool:
        return self._done.pop(xid, None) is not None

    def completed_push(self, xid: str) -> bool:
        """Decode: a staged push arrived whole before its notification (strategy=pack)."""
        return self._done.pop(xid, None) is not None

    def end_read(self, agent: str, xid: str, *, ok: bool) -> None:
        n = self._sources.get(agent, 0) - 1
        if n > 0:
            self._sources[agent] = n
        else:
            self._sources.pop(agent, None)
        if not ok:
            self.cancel(xid)

    def cancel(self, xid: str) -> None:
        """We gave up on an incoming staged transfer: late chunks are acked, never scattered."""
        if self.peer is not None:
            self.peer.cancel(xid)

    def expire(self, now: float, max_age_s: float) -> None:
        for xid, t in list(self._done.items()):
            if now - t > max_age_s:
                del self._done[xid]
