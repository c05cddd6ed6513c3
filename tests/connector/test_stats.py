"""The connector's counters travel to vLLM's /metrics as per-step increases."""

from __future__ import annotations

import functools
import pickle
import types

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbaton.connector.stats import (
    CounterDeltas,
    KvbatonConnectorStats,
    KvbatonPromMetrics,
)
from kvbaton.services.metrics import ConnectorMetrics


def _prom(registry: CollectorRegistry) -> KvbatonPromMetrics:
    types_ = {Counter: functools.partial(Counter, registry=registry),
              Gauge: functools.partial(Gauge, registry=registry),
              Histogram: functools.partial(Histogram, registry=registry)}
    cfg = types.SimpleNamespace(kv_transfer_config=None)
    return KvbatonPromMetrics(cfg, types_, ["model_name", "engine"], {0: ["tiny", "0"], 1: ["tiny", "1"]})


def test_increases_cross_processes_once_and_add_up() -> None:
    worker, scheduler = ConnectorMetrics(CollectorRegistry()), ConnectorMetrics(CollectorRegistry())
    wd, sd = CounterDeltas(worker), CounterDeltas(scheduler)
    assert wd.take() is None  # nothing happened yet
    worker.transfers.labels("push", "decode", "ok").inc(3)
    worker.transfer_bytes.labels("push", "write").inc(1000)
    worker.transfer_seconds.labels("push", "write").observe(0.25)
    scheduler.recomputes.labels("below_threshold").inc()
    worker.kv_verifications.labels("pull", "ok").inc()
    step = wd.take()
    assert step is not None and not step.is_empty()
    assert wd.take() is None  # taken once: the next step carries nothing
    # Across the process boundary (pickled with the step output), then summed.
    step = pickle.loads(pickle.dumps(step))
    total = step.aggregate(sd.take())
    worker.transfers.labels("push", "decode", "ok").inc(2)
    total = total.aggregate(wd.take())
    assert total.reduce()["transfers{push,decode,ok}"] == 5
    reg = CollectorRegistry()
    _prom(reg).observe(total.data, engine_idx=1)
    labels = {"model_name": "tiny", "engine": "1"}
    get = reg.get_sample_value
    assert get("kvbaton_connector_transfers_total", {**labels, "mode": "push", "role": "decode", "outcome": "ok"}) == 5
    assert get("kvbaton_connector_transfer_bytes_total", {**labels, "mode": "push", "direction": "write"}) == 1000
    assert get("kvbaton_connector_transfer_time_seconds_total", {**labels, "mode": "push", "direction": "write"}) == 0.25
    assert get("kvbaton_connector_transfer_ops_total", {**labels, "mode": "push", "direction": "write"}) == 1
    assert get("kvbaton_connector_recomputes_total", {**labels, "reason": "below_threshold"}) == 1
    assert get("kvbaton_connector_kv_verifications_total", {**labels, "mode": "pull", "result": "ok"}) == 1


def test_bad_or_empty_payloads_change_nothing() -> None:
    reg = CollectorRegistry()
    prom = _prom(reg)
    prom.observe({}, 0)
    prom.observe({"deltas": {"nope|[]": 4, "kvbaton_connector_recomputes|not json": 1,
                             "kvbaton_connector_reused_tokens|[]": -3}}, 0)
    assert reg.get_sample_value("kvbaton_connector_reused_tokens_total", {"model_name": "tiny", "engine": "0"}) is None
    assert KvbatonConnectorStats().is_empty()
    s = KvbatonConnectorStats(data={"deltas": {"a": 1.0}})
    s.reset()
    assert s.is_empty() and s.reduce() == {}
