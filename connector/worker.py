"""Worker half of the kvbaton connector (runs in ``VLLM::Worker``): the vLLM-facing state.

vLLM calls it on the model-runner thread, which must never block: it hands each step's
specs to the transfer thread (:class:`~kvbaton.connector.loop.TransferLoop`, which owns
NIXL and runs the flows in :mod:`kvbaton.connector.flows`) through a queue, and collects
finished transfers from another queue in ``get_finished``. gRPC to the control plane runs
on ``kvbaton-control`` (:mod:`.control`). Where to read next: ``loop.py``, then
``flows/sequence.py`` and the flow you care about.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import time
from typing import TYPE_CHECKING, Any

from kvbaton.kvgeometry import EngineKv
from kvbaton.v1 import common_pb2, registrar_pb2

from .control import ControlThread, complete_request, rendezvous_call, role_of, security_of
from .loop import TransferLoop
from .metadata import KvbatonMeta, SendSpec
from .settings import KvbatonSettings
from .statslog import StatsLog
from .transfer.geometry import KvLayout
from .transfer.integrity import Fingerprinter
from .wakeup import WakeSender, engine_core_pid_of_worker, wake_name

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("kvbaton.connector.worker")


class KvbatonWorker:
    """Worker-side facade state: hands specs to the transfer thread, reports results."""

    def __init__(self, settings: KvbatonSettings, kv_role: str, tp_rank: int = 0, *, tp_size: int = 1,
                 total_kv_heads: int = 0) -> None:
        self.settings = settings
        self.kv_role = kv_role
        self.tp_rank = tp_rank
        self.tp_size = max(int(tp_size), 1)
        self.total_kv_heads = int(total_kv_heads)  # the model's (0: unknown), published with the rank
        self.stats = StatsLog(settings.stats_dir, settings.engine_id, tp_rank=tp_rank if tp_size > 1 else None)
        self._control: ControlThread | None = None
        self._xfer: TransferLoop | None = None
        self._expect_send: set[str] = set()  # held on the scheduler side for a transfer
        self._seen_finished: set[str] = set()
        self._sent_pending: set[str] = set()  # done sending, not yet seen in finished_req_ids
        self._load_errors: set[int] = set()
        self._wake: WakeSender | None = None  # TP > 1: wakes the engine loop's long idle steps

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        # All layers' tensors share one allocation on CPU; KvLayout merges adjacent regions
        # into one NIXL registration.
        tensors = list(kv_caches.values())
        layout = KvLayout.from_tensors(tensors, block_size, block_dim=0)
        # Shared with this process's scheduler connector (TP 1): its completions then get
        # the MATCH on their answer, the subscription below being the engine's only one.
        self._control = ControlThread.shared(self.settings.control_plane, security=security_of(self.settings),
                                             unpin=self.settings.unpin_threads)
        fp = Fingerprinter(layout, tensors, self.settings.verify_kv_alg) if self.settings.verify_kv else None
        self._xfer = TransferLoop(self.settings, self.tp_rank, layout, self._control, self.stats, fp,
                                  tensors=tensors, tp_size=self.tp_size)
        if self.tp_size > 1 and self.settings.tp_idle_wait_max_ms > 0:
            self._wake = WakeSender(wake_name(self.settings.engine_id, engine_core_pid_of_worker()))
            self._xfer.ctx.wake = self._wake.wake
        self._xfer.start()
        rank = registrar_pb2.EngineRank(
            engine_id=self.settings.engine_id, tp_size=self.tp_size,
            role=role_of({"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}.get(
                self.settings.serve_role, self.kv_role)),
            tp_rank=self.tp_rank, agent_name=self._xfer.name, agent_metadata=self._xfer.metadata,
            geometry=common_pb2.KvGeometry(**layout.to_proto_fields(), **self._head_fields(tensors)),
            labels={"mode": self.settings.mode}, serve_url=self.settings.serve_url)
        si = self._xfer.staging_info
        if si is not None:  # where peers WRITE staged chunks into us (pack path)
            rank.staging.CopyFrom(common_pb2.KvStaging(base_addr=si.base_addr, slot_bytes=si.slot_bytes,
                                                       num_slots=si.num_slots, mem_type=si.mem_type,
                                                       device_id=si.device_id))
        # what the per-rank plan with each peer is computed from (flows/peers.py)
        self._xfer.ctx.peers.me = EngineKv.from_rank(rank)
        self._control.register_rank(rank, self.settings.ttl_ms)
        inbox = self._xfer.inbox
        self._control.subscribe(self.settings.engine_id, self.tp_rank,
                                lambda ev: inbox.put(("event", ev.transfer.transfer_id, ev)),
                                sole_subscriber=self.tp_size == 1)
        log.info("kvbaton: worker ready: engine %s agent %s, %d regions x %d blocks x %d B",
                 self.settings.engine_id, self._xfer.name, layout.num_regions, layout.num_blocks,
                 layout.bytes_per_block)
        # which cores the rank's model thread and the connector's threads may use (affinity.py)
        self.stats.record("worker_threads", main_cpus=sorted(os.sched_getaffinity(0)),
                          control_cpus=sorted(self._control.cpus or ()), xfer_cpus=sorted(self._xfer.cpus or ()),
                          wakes_engine=self._wake.name[1:].decode() if self._wake is not None else "")

    def _head_fields(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """The model's KV head count and whether blocks are head-major, for the control
        plane's pairing check (kvbaton/kvgeometry.py); nothing when the head count is unknown."""
        if self.total_kv_heads <= 0 or not tensors:
            return {}
        from .transfer.tp_mapping import head_major_blocks

        local = max(self.total_kv_heads // self.tp_size, 1)
        t = tensors[0]
        return {"total_kv_heads": self.total_kv_heads,
                "head_major": head_major_blocks(tuple(t.shape), tuple(t.stride()), local)}

    def on_meta(self, meta: KvbatonMeta | None) -> None:
        """Hand this step's specs to the transfer thread (called from bind_connector_metadata,
        which vLLM calls every step, empty ones included)."""
        if meta is None or self._xfer is None:
            return
        for req_id, spec in meta.loads.items():
            self._xfer.inbox.put(("load", req_id, spec))
        for req_id, sspec in meta.sends.items():
            self._expect_send.add(req_id)
            self._xfer.inbox.put(("send", req_id, sspec))
            if sspec.complete_here and self.tp_rank == 0:
                self._send_complete(sspec)
        if self._xfer.fp is not None:
            for hold_id, retained in getattr(meta, "retains", {}).items():  # or freed: empty ids
                self._xfer.inbox.put(("retain", hold_id, retained))

    def _send_complete(self, sspec: SendSpec) -> None:
        """Push: tell the rendezvous these blocks are ready, from this process's control
        thread (``complete_from_worker``). Fire-and-forget like the scheduler's: a lost
        Complete ends in the hold's timeout and decode's recompute."""
        assert self._control is not None
        req = complete_request(self.settings.engine_id, self.settings.timeout_s, sspec.transfer_id, sspec.block_ids,
                               sspec.num_tokens, sspec.request_id, sspec.peer_engine_id)
        t0 = time.monotonic()
        fut = self._control.submit(rendezvous_call("Complete", req, sspec.traceparent))

        def _done(f: concurrent.futures.Future[Any]) -> None:
            err = "cancelled" if f.cancelled() else repr(f.exception()) if f.exception() is not None else ""
            if err:
                log.warning("kvbaton: Complete for %s failed: %s", sspec.transfer_id, err)
            self.stats.record("rpc", rpc="Complete", transfer_id=sspec.transfer_id, error=err,
                              latency_ms=round((time.monotonic() - t0) * 1000, 2))
        fut.add_done_callback(_done)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._seen_finished |= finished_req_ids & self._expect_send
        recving: set[str] = set()
        if self._xfer is not None:
            while True:
                try:
                    kind, req_id, ok, blocks = self._xfer.results.get_nowait()
                except queue.Empty:
                    break
                if kind == "sent":
                    self._sent_pending.add(req_id)
                else:
                    recving.add(req_id)
                    if not ok:
                        self._load_errors.update(blocks)
        # vLLM asserts finished_sending ids were seen finished (VLLM_API_NOTES.md §4.7).
        sending = self._sent_pending & self._seen_finished
        self._sent_pending -= sending
        self._seen_finished -= sending
        self._expect_send -= sending
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def shutdown(self) -> None:
        if self._xfer is not None:
            self._xfer.stop()
            if self._xfer.fp is not None:
                self._xfer.fp.close()
        if self._control is not None:
            self._control.close()
        if self._wake is not None:
            self._wake.close()
