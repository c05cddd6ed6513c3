"""The connector's counters on vLLM's own ``/metrics``.

Why this module: the connector counts into :class:`~kvbaton.services.metrics.ConnectorMetrics`
in the process where the work happens — the worker (``VLLM::Worker``) for transfers and
the scheduler (``VLLM::EngineCore``) for below-threshold recomputes. Neither process serves
HTTP; vLLM's ``/metrics`` lives in the API server. vLLM's way across is
``get_kv_connector_stats()`` (worker and scheduler, every step) →
:class:`KvbatonConnectorStats` (pickled with the step's output, summed with
:meth:`~KvbatonConnectorStats.aggregate`) → the API server's
:class:`KvbatonPromMetrics`, built by the connector class's ``build_prom_metrics``.

What travels is the *increase* of each counter since the previous step
(:class:`CounterDeltas`), so the sites that count don't change and nothing is counted
twice. The API server's series carry vLLM's own labels (``model_name``, ``engine``) before
the connector's (mode, role, outcome...).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbaton.services.metrics import ConnectorMetrics

#: What the API server exports: name -> (help, connector label names). Sample names of
#: the engine-side families map onto these in :func:`_series`.
EXPORTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "kvbaton_connector_transfers": (
        "KV transfers this engine took part in, by mode (push, pull, reuse), role and outcome.",
        ("mode", "role", "outcome")),
    "kvbaton_connector_transfer_bytes": (
        "KV bytes this engine moved over NIXL, by mode and direction (write, read).", ("mode", "direction")),
    "kvbaton_connector_transfer_time_seconds": (
        "Seconds spent in NIXL transfers (post to completion), by mode and direction; "
        "divide by kvbaton_connector_transfer_ops for the mean.", ("mode", "direction")),
    "kvbaton_connector_transfer_ops": (
        "NIXL transfers timed in kvbaton_connector_transfer_time_seconds.", ("mode", "direction")),
    "kvbaton_connector_recomputes": (
        "Times KV was recomputed instead of loaded, by reason: the 'no silent recompute' counter.", ("reason",)),
    "kvbaton_connector_reused_tokens": (
        "Prompt tokens whose KV was read back from a decode engine instead of recomputed.", ()),
    "kvbaton_connector_kv_verifications": (
        "Loads whose landed KV was checked against the owner's fingerprints (verify_kv), by mode "
        "and result (ok, mismatch, unavailable).", ("mode", "result")),
}

_SAMPLE_TO_EXPORTED = {
    "kvbaton_connector_transfers_total": "kvbaton_connector_transfers",
    "kvbaton_connector_transfer_bytes_total": "kvbaton_connector_transfer_bytes",
    "kvbaton_connector_transfer_seconds_sum": "kvbaton_connector_transfer_time_seconds",
    "kvbaton_connector_transfer_seconds_count": "kvbaton_connector_transfer_ops",
    "kvbaton_connector_recomputes_total": "kvbaton_connector_recomputes",
    "kvbaton_connector_reused_tokens_total": "kvbaton_connector_reused_tokens",
    "kvbaton_connector_kv_verifications_total": "kvbaton_connector_kv_verifications",
}


def _key(name: str, labels: dict[str, str]) -> str:
    return name + "|" + json.dumps([labels.get(k, "") for k in EXPORTED[name][1]])


def _series(metrics: ConnectorMetrics) -> dict[str, float]:
    """Current value of every exported series of this process, by ``name|[label values]``."""
    out: dict[str, float] = {}
    for collector in (metrics.transfers, metrics.transfer_bytes, metrics.transfer_seconds,
                      metrics.recomputes, metrics.reused_tokens, metrics.kv_verifications):
        for family in collector.collect():
            for sample in family.samples:
                name = _SAMPLE_TO_EXPORTED.get(sample.name)
                if name is not None:
                    out[_key(name, sample.labels)] = float(sample.value)
    return out


@dataclasses.dataclass
class KvbatonConnectorStats(KVConnectorStats):
    """Counter increases over an interval: ``data = {"deltas": {series: increase}}``."""

    def __post_init__(self) -> None:
        self.data.setdefault("deltas", {})

    @property
    def deltas(self) -> dict[str, float]:
        return self.data["deltas"]

    def reset(self) -> None:
        self.data: dict[str, Any] = {"deltas": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in (other.data.get("deltas") or {}).items():
            self.deltas[key] = self.deltas.get(key, 0.0) + float(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's periodic log line: ``transfers{push,decode,ok}: 3``."""
        out: dict[str, int | float] = {}
        for key, value in sorted(self.deltas.items()):
            name, _, labels = key.partition("|")
            try:
                tag = ",".join(str(v) for v in json.loads(labels)) if labels else ""
            except ValueError:
                tag = labels
            short = name.removeprefix("kvbaton_connector_")
            out[f"{short}{{{tag}}}" if tag else short] = round(value, 6)
        return out

    def is_empty(self) -> bool:
        return not any(self.deltas.values())


class CounterDeltas:
    """Per process: what each exported series gained since the last :meth:`take`."""

    def __init__(self, metrics: ConnectorMetrics) -> None:
        self.metrics = metrics
        self._last = _series(metrics)

    def take(self) -> KvbatonConnectorStats | None:
        now = _series(self.metrics)
        deltas = {k: v - self._last.get(k, 0.0) for k, v in now.items() if v != self._last.get(k, 0.0)}
        self._last = now
        return KvbatonConnectorStats(data={"deltas": deltas}) if deltas else None


class KvbatonPromMetrics(KVConnectorPromMetrics):
    """API-server side: one counter per exported name, labelled with vLLM's labels first."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, *labels])
            for name, (doc, labels) in EXPORTED.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for key, value in (transfer_stats_data.get("deltas") or {}).items():
            name, _, labels = key.partition("|")
            counter = self._counters.get(name)
            if counter is None or value <= 0:
                continue
            try:
                label_values = [str(v) for v in json.loads(labels)] if labels else []
            except ValueError:
                continue
            counter.labels(*engine_labels, *label_values).inc(value)
