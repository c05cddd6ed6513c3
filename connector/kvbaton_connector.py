"""vLLM entry point: ``KvbatonConnector``, a thin facade over the two halves.

Load it with::

    --kv-transfer-config '{"kv_connector": "KvbatonConnector",
        "kv_connector_module_path": "kvbaton.connector.kvbaton_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"control_plane": "127.0.0.1:50051", "mode": "pull",
                                      "engine_id": "p0", "timeout_s": 30, "stats_dir": "/tmp/s",
                                      "lease_ttl_s": 30, "max_retained_fraction": 0.5,
                                      "kv_recompute_threshold": 64}}'

vLLM imports this module in three processes (API server, EngineCore, Worker), so nothing
happens at import time; the SCHEDULER role gets a :class:`KvbatonScheduler` (pure
bookkeeping on the engine loop) and the WORKER role a :class:`KvbatonWorker` (NIXL and
gRPC on background threads). See ``connector/VLLM_API_NOTES.md`` for the contracts.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvbaton.services.metrics import connector_metrics

from .metadata import KvbatonMeta
from .scheduler import KvbatonScheduler
from .settings import KvbatonSettings
from .stats import CounterDeltas, KvbatonConnectorStats, KvbatonPromMetrics
from .worker import KvbatonWorker

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvbaton.connector")


class KvbatonConnector(KVConnectorBase_V1):
    """P/D KV hand-off through the kvbaton control plane and NIXL (pull and push)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.settings = KvbatonSettings.from_vllm(ktc)
        self.block_size = int(vllm_config.cache_config.block_size)
        if self.settings.gil_switch_interval_ms > 0:
            # Our background threads (gRPC, NIXL) need the GIL several times per call;
            # while the engine loop runs Python, each hand-off waits up to one switch
            # interval (5 ms by default). Measured with a busy main thread: a unary call
            # from the control thread took 13.3 ms (median) at 5 ms, 3.1 ms at 0.5 ms
            # (benchmarks/results/gil_handoff.json).
            sys.setswitchinterval(self.settings.gil_switch_interval_ms / 1000.0)
        self._sched: KvbatonScheduler | None = None
        self._worker: KvbatonWorker | None = None
        # Increases of this process's connector counters, shipped to vLLM's /metrics.
        self._deltas = CounterDeltas(connector_metrics())
        pc = vllm_config.parallel_config
        tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        if role == KVConnectorRole.SCHEDULER:
            self._sched = KvbatonScheduler(self.settings, self.block_size, tp_size=tp_size)
        else:
            tp_rank = int(getattr(pc, "rank", 0) or 0)
            self._worker = KvbatonWorker(self.settings, str(ktc.kv_role), tp_rank, tp_size=tp_size,
                                         total_kv_heads=_total_kv_heads(vllm_config))

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, self.block_size)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvbatonMeta):
            self._worker.on_meta(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing: loads are async, started from bind_connector_metadata."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: async loads complete before the request is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Nothing: in pull mode decode reads the held blocks after prefill finishes."""

    def wait_for_save(self) -> None:
        """Nothing to wait for (see save_kv_layer)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    # ================================================================== both sides: stats
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counter increases since the last step (worker and scheduler processes alike)."""
        return self._deltas.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvbatonConnectorStats(data=dict(data)) if data is not None else KvbatonConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        """The API server's ``/metrics`` gets the ``kvbaton_connector_*`` counters (see stats.py)."""
        return KvbatonPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()

    # ================================================================== scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Decode retention keeps its own references in the block pool (see reuse.py)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.bind_block_pool(kv_cache_manager.block_pool)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        if self._sched is not None:
            self._sched.update_connector_output(connector_output.finished_sending,
                                                connector_output.finished_recving)


def _total_kv_heads(vllm_config: Any) -> int:
    """The model's KV head count (1 for MLA: one latent per token on every rank), published
    with each rank so the control plane can pair engines of different TP sizes; 0 if vLLM
    cannot say (the control plane then judges the pair without heads)."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return 0
    try:
        if getattr(mc, "use_mla", False):
            return 1
        return int(mc.get_total_num_kv_heads())
    except Exception:  # noqa: BLE001 - a config vLLM cannot answer for: publish nothing
        return 0
