"""Prometheus metrics for the control plane, plus the definitions the router and the
vLLM connector use in their own processes.

Naming follows Prometheus conventions: everything starts with ``kvbaton_``, counters end
in ``_total``, durations are histograms in ``_seconds``, sizes in ``_bytes``; labels have
small, fixed value sets (never a transfer or conversation id: those belong in logs).

Why a class and not module globals: one process may run several control planes (the
tests do; so could an embedded deployment), and each must count only its own traffic.
``ControlPlane`` makes one ``ServiceMetrics`` over its own ``CollectorRegistry`` and
hands it to the domain services. A domain service built without one gets an
*unregistered* instance: it counts into objects nobody scrapes, so the domain code never
needs an ``if metrics:`` branch. This module imports nothing from gRPC, so the domain
modules stay free of it.

Gauges that describe state (leases, pending transfers, retained blocks, engines, who
leads) are *read at scrape time* from the replica's caches rather than kept with
inc/dec: the state also changes through other replicas, restarts and watch resyncs, and
an inc/dec gauge would drift. Counters and histograms are updated where the event
happens, after the store accepted the write (so a CAS retry is never counted twice).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector

from .store.base import Compare, KeyValue, Op, Store, TxnResult, Watch

# Control-plane operations are sub-millisecond on the memory store and a few ms on etcd;
# the tail (a failing-over etcd) reaches seconds.
STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# Waiting for the other side of a rendezvous spans a prefill (ms .. tens of seconds).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# A KV write: 10 ms (coalesced, NVLink) to seconds (scattered descriptors, TCP).
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
HTTP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# name -> (help, label names): the gauges ``StateCollector`` produces at scrape time.
STATE_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "kvbaton_leases": ("Live leases on retained blocks, by state (active, draining).", ("state",)),
    "kvbaton_retained_blocks": ("Decode KV blocks held under live leases, per decode engine.", ("engine",)),
    "kvbaton_transfers_pending": ("Transfers not yet ended, by phase (offered, completed, matched).", ("phase",)),
    "kvbaton_engines": ("Registered engines (distinct engine ids) by role.", ("role",)),
    "kvbaton_engine_ranks": ("Registered engine worker ranks by role.", ("role",)),
    "kvbaton_leader": ("1 while this replica is the elected leader of a background duty (lease-expiry, "
                       "rendezvous-sweeper), else 0.", ("duty",)),
    # How close this replica's event loop is to capacity (services/api/overload.py): read
    # from the load monitor at scrape time, nothing per tick.
    "kvbaton_server_loop_busy_ratio": ("Share of wall time the server's event loop was busy, the least over the "
                                       "load monitor's last ticks (about 50 ms): at 1 the replica is at capacity "
                                       "and new transfers are shed.", ()),
    "kvbaton_server_loop_lag_seconds": ("How late the event loop ran its timer, the most over the load monitor's "
                                        "last ticks.", ()),
}

StateSource = Callable[[], Mapping[tuple[str, ...], float]]


class StateCollector(Collector):
    """Builds the ``STATE_GAUGES`` from callbacks at scrape time.

    A gauge with no source (its service does not run in this process) is exported with
    no samples, so dashboards see "no data" rather than a misleading zero."""

    def __init__(self) -> None:
        self.sources: dict[str, StateSource] = {}

    def describe(self) -> Iterable[Metric]:
        # Declaring the names lets the registry detect clashes without calling collect().
        return [GaugeMetricFamily(name, doc, labels=list(labels)) for name, (doc, labels) in STATE_GAUGES.items()]

    def collect(self) -> Iterable[Metric]:
        for name, (doc, labels) in STATE_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=list(labels))
            source = self.sources.get(name)
            if source is not None:
                for label_values, value in sorted(source().items()):
                    family.add_metric(list(label_values), value)
            yield family


class ServiceMetrics:
    """Every control-plane metric, bound to one registry (``None``: counted, not exported)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry
        r = registry

        # -- rendezvous ------------------------------------------------------
        self.matches = Counter("kvbaton_rendezvous_matches_total",
                               "Offers and completions matched (the second side's arrival made the match).",
                               registry=r)
        self.match_wait = Histogram(
            "kvbaton_rendezvous_match_wait_seconds",
            "From the first side's arrival to the match (the second side's arrival), by which side came first.",
            ["first_side"], buckets=WAIT_BUCKETS, registry=r)
        self.match_to_outcome = Histogram(
            "kvbaton_rendezvous_match_to_outcome_seconds",
            "From the match to the transfer's end (every writer reported, or the match timeout), by outcome.",
            ["outcome"], buckets=WAIT_BUCKETS, registry=r)
        self.unmatched_expired = Counter(
            "kvbaton_rendezvous_expired_total",
            "Offers (side=offer) or completions (side=completion) that expired unmatched.",
            ["side"], registry=r)
        self.transfers = Counter(
            "kvbaton_transfers_total",
            "Transfers (attempts) that ended, by outcome (succeeded, failed, expired, cancelled) and reason "
            "(reported, match_timeout, block_count_mismatch, unmatched, cancelled, superseded).",
            ["outcome", "reason"], registry=r)
        self.transfer_bytes = Counter(
            "kvbaton_transfer_bytes_total",
            "KV bytes the writers reported moving (ReportOutcome), by mode and per-rank outcome.",
            ["mode", "outcome"], registry=r)
        self.transfer_write = Histogram(
            "kvbaton_transfer_write_seconds",
            "Per-rank write duration the writers reported (ReportOutcome duration_us), by mode.",
            ["mode"], buckets=TRANSFER_BUCKETS, registry=r)

        # -- leases ----------------------------------------------------------
        self.lease_grants = Counter("kvbaton_lease_grants_total", "Leases granted.", registry=r)
        self.lease_late_grants_refused = Counter(
            "kvbaton_lease_late_grants_refused_total",
            "Grants refused because the conversation's lease was revoked after the blocks were registered "
            "(a Grant that arrived after the client's Revoke; decode frees the blocks).", registry=r)
        self.lease_renewals = Counter(
            "kvbaton_lease_renewals_total",
            "Renewals answered (Renew and each KeepAlive item), by status (ok, not_found, superseded, ended, invalid).",
            ["status"], registry=r)
        self.lease_renewal_writes = Counter(
            "kvbaton_lease_renewal_writes_total",
            "Renewals that wrote a new deadline to the store (journaled, or a lease record rewritten); the rest "
            "were answered from the cache.",
            registry=r)
        self.lease_renewal_txns = Counter(
            "kvbaton_lease_renewal_txns_total",
            "Store transactions the renewal flusher committed (a journal write carries a whole flush).", registry=r)
        self.lease_pins = Counter("kvbaton_lease_pins_total", "Pins granted to readers.", registry=r)
        self.lease_pin_refusals = Counter(
            "kvbaton_lease_pin_refusals_total",
            "Pins refused, by reason (ended, past_deadline, too_many, engine_gone, incompatible): each is a read "
            "that did not happen.",
            ["reason"], registry=r)
        self.lease_ends = Counter(
            "kvbaton_lease_ends_total",
            "Leases that ended (blocks may be freed), by reason (expired, revoked, replaced).",
            ["reason"], registry=r)

        # -- registrar -------------------------------------------------------
        self.engine_registrations = Counter(
            "kvbaton_engine_registrations_total",
            "Engine rank registrations (a restart or a lapsed liveness registers again), by role.",
            ["role"], registry=r)

        # -- store -----------------------------------------------------------
        self.store_op = Histogram(
            "kvbaton_store_operation_seconds",
            "Latency of store operations as the services see them, by op and backend (memory, etcd).",
            ["op", "backend"], buckets=STORE_BUCKETS, registry=r)
        self.store_errors = Counter(
            "kvbaton_store_errors_total",
            "Store operations that raised, by op, backend and error class.",
            ["op", "backend", "error"], registry=r)

        # Known label values start at 0, so rate() and dashboards see a series from the
        # first scrape instead of "no data" until the first event.
        for side in ("offer", "completion"):
            self.match_wait.labels(side)
            self.unmatched_expired.labels(side)
        # Bound children for the per-match path: ``labels()`` costs a lock and a dict
        # lookup with tuple building on every call.
        self.match_wait_by_first = {side: self.match_wait.labels(side) for side in ("offer", "completion")}
        for outcome, reason in (("succeeded", "reported"), ("failed", "reported"), ("failed", "match_timeout"),
                                ("failed", "block_count_mismatch"), ("failed", "incompatible"), ("expired", "unmatched"),
                                ("cancelled", "cancelled"), ("cancelled", "superseded")):
            self.transfers.labels(outcome, reason)
        for outcome in ("succeeded", "failed"):
            self.match_to_outcome.labels(outcome)
            self.transfer_bytes.labels("push", outcome)
        for status in ("ok", "not_found", "superseded", "ended", "invalid"):
            self.lease_renewals.labels(status)
        for reason in ("ended", "past_deadline", "too_many", "incompatible"):
            self.lease_pin_refusals.labels(reason)
        for reason in ("expired", "revoked", "replaced"):
            self.lease_ends.labels(reason)
        for role in ("prefill", "decode", "both"):
            self.engine_registrations.labels(role)

        # -- load ----------------------------------------------------------------
        self.shed = Counter(
            "kvbaton_server_shed_total",
            "Messages that would have opened a new transfer, refused with RESOURCE_EXHAUSTED because the event "
            "loop was past capacity (the load monitor's verdict; see docs/operators.md \"Overload\").",
            registry=r)

        self.state = StateCollector()
        if r is not None:
            r.register(self.state)


class InstrumentedStore(Store):
    """A ``Store`` that times every operation into ``kvbaton_store_operation_seconds``.

    A wrapper rather than code in each backend: both backends get identical, comparable
    numbers, and the backends stay free of metrics. Anything not part of the ``Store``
    interface (``EtcdStore.status``...) is passed through untouched."""

    def __init__(self, inner: Store, metrics: ServiceMetrics) -> None:
        self.inner = inner
        self.metrics = metrics
        self.backend = type(inner).__name__.removesuffix("Store").lower() or "unknown"
        self._observe: dict[str, Any] = {}  # op -> bound Histogram child's observe (labels() per call is costly)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def max_request_bytes(self) -> int:  # type: ignore[override]
        return self.inner.max_request_bytes

    @property
    def incarnation(self) -> str:  # type: ignore[override]
        return self.inner.incarnation

    async def _timed(self, op: str, aw: Any) -> Any:
        start = time.perf_counter()
        try:
            return await aw
        except BaseException as exc:
            if isinstance(exc, Exception):
                self.metrics.store_errors.labels(op, self.backend, type(exc).__name__).inc()
            raise
        finally:
            observe = self._observe.get(op)
            if observe is None:
                observe = self._observe[op] = self.metrics.store_op.labels(op, self.backend).observe
            observe(time.perf_counter() - start)

    async def get(self, key: bytes) -> KeyValue | None:
        return await self._timed("get", self.inner.get(key))

    async def range(self, prefix: bytes, *, limit: int = 0) -> tuple[list[KeyValue], int]:
        return await self._timed("range", self.inner.range(prefix, limit=limit))

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        return await self._timed("put", self.inner.put(key, value, lease=lease))

    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        return await self._timed("delete", self.inner.delete(key, prefix=prefix))

    # Transactions are timed inline rather than through ``_timed``: one coroutine fewer per
    # write (a rendezvous match is two), with the same histogram and error counter.
    async def txn(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        start = time.perf_counter()
        try:
            return await self.inner.txn(compares, success, failure)
        except Exception as exc:
            self.metrics.store_errors.labels("txn", self.backend, type(exc).__name__).inc()
            raise
        finally:
            self._observe_txn(start)

    async def txn_batched(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> TxnResult:
        start = time.perf_counter()
        try:
            return await self.inner.txn_batched(compares, success, failure)
        except Exception as exc:
            self.metrics.store_errors.labels("txn", self.backend, type(exc).__name__).inc()
            raise
        finally:
            self._observe_txn(start)

    def _observe_txn(self, start: float) -> None:
        observe = self._observe.get("txn")
        if observe is None:
            observe = self._observe["txn"] = self.metrics.store_op.labels("txn", self.backend).observe
        observe(time.perf_counter() - start)

    async def grant_lease(self, ttl_s: float) -> int:
        return await self._timed("grant_lease", self.inner.grant_lease(ttl_s))

    async def keepalive(self, lease_id: int) -> float:
        return await self._timed("keepalive", self.inner.keepalive(lease_id))

    async def revoke_lease(self, lease_id: int) -> None:
        return await self._timed("revoke_lease", self.inner.revoke_lease(lease_id))

    async def watch(self, prefix: bytes, *, start_revision: int = 0, prev_kv: bool = False) -> Watch:
        # Only establishing the watch is timed; its lifetime is not a latency.
        return await self._timed("watch", self.inner.watch(prefix, start_revision=start_revision, prev_kv=prev_kv))

    async def current_revision(self) -> int:
        return await self._timed("current_revision", self.inner.current_revision())

    async def close(self) -> None:
        await self.inner.close()


# ---------------------------------------------------------------------------------------
# Router and connector metrics. They live in other processes (the aiohttp router, the
# vLLM engines), so they register in prometheus_client's default REGISTRY once per
# process (``functools.cache``); those processes expose it their own way (the router on
# its HTTP port at /metrics, vLLM on its /metrics).
# ---------------------------------------------------------------------------------------


class RouterMetrics:
    """Metrics for ``services/router/app.py``."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.requests = Counter(
            "kvbaton_router_requests_total",
            "Client requests the router relayed, by P/D mode and the HTTP status returned.",
            ["mode", "status"], registry=registry)
        self.request_seconds = Histogram(
            "kvbaton_router_request_seconds",
            "Router latency by leg (prefill, decode, total) and mode; decode is time to the full response.",
            ["mode", "leg"], buckets=HTTP_BUCKETS, registry=registry)
        self.upstream_errors = Counter(
            "kvbaton_router_upstream_errors_total",
            "Upstream engine calls that failed (non-200 or transport error), by leg.",
            ["leg"], registry=registry)
        self.missing_transfer_params = Counter(
            "kvbaton_router_missing_transfer_params_total",
            "Pull dispatches where prefill returned no kv_transfer_params (decode recomputes the prompt).",
            registry=registry)
        self.decode_choices = Counter(
            "kvbaton_router_decode_choices_total",
            "Decode engine choices by reason (affinity: the engine holding the conversation's KV; "
            "no_history, holder_overloaded, holder_unavailable: the least loaded).",
            ["reason"], registry=registry)
        self.retries = Counter(
            "kvbaton_router_retries_total",
            "Requests re-sent (new transfer attempt, another engine) after an engine failed before "
            "any token was streamed, by the leg that failed.",
            ["leg"], registry=registry)
        self.decision_seconds = Histogram(
            "kvbaton_router_decision_seconds",
            "Time the router spends choosing a prefill and a decode engine (in-process, no I/O).",
            buckets=(1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3), registry=registry)
        self.role_waits = Counter(
            "kvbaton_router_role_waits_total",
            "Requests that found no routable engine of a role and waited for one (--role-wait-s), by role "
            "and outcome: served (one came), timed_out (503), shed (--role-wait-max already waiting: 503 "
            "at once), client_gone.",
            ["role", "outcome"], registry=registry)
        self.role_waiting = Gauge(
            "kvbaton_router_role_waiting",
            "Requests waiting now for an engine of a role to become routable.",
            ["role"], registry=registry)


class ConnectorMetrics:
    """Metrics for the vLLM connector (``connector/*``), one set per engine process."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.transfers = Counter(
            "kvbaton_connector_transfers_total",
            "KV transfers this engine took part in, by mode (push, pull, reuse), role (prefill, decode) "
            "and outcome (ok, failed, timeout).",
            ["mode", "role", "outcome"], registry=registry)
        self.transfer_bytes = Counter(
            "kvbaton_connector_transfer_bytes_total",
            "KV bytes this engine moved over NIXL, by mode and direction (write, read).",
            ["mode", "direction"], registry=registry)
        self.transfer_seconds = Histogram(
            "kvbaton_connector_transfer_seconds",
            "Wall time of one NIXL transfer (post to completion), by mode and direction.",
            ["mode", "direction"], buckets=TRANSFER_BUCKETS, registry=registry)
        self.recomputes = Counter(
            "kvbaton_connector_recomputes_total",
            "Tokens' KV recomputed instead of loaded, by reason (load_failed, timeout, below_threshold, "
            "lease_ended, pin_refused, verify_failed, fenced): the 'no silent recompute' counter.",
            ["reason"], registry=registry)
        self.kv_verifications = Counter(
            "kvbaton_connector_kv_verifications_total",
            "Loads whose landed KV was checked against the owner's fingerprints (verify_kv), by mode "
            "and result (ok, mismatch, unavailable); anything but ok was recomputed.",
            ["mode", "result"], registry=registry)
        self.reused_tokens = Counter(
            "kvbaton_connector_reused_tokens_total",
            "Prompt tokens whose KV was read back from a decode engine instead of recomputed.",
            registry=registry)


@functools.cache
def router_metrics() -> RouterMetrics:
    """The router process's metrics (registered once in the default registry)."""
    return RouterMetrics()


@functools.cache
def connector_metrics() -> ConnectorMetrics:
    """The engine process's connector metrics (registered once in the default registry)."""
    return ConnectorMetrics()


def metric_names() -> set[str]:
    """Every sample name any kvbaton process can export (``_bucket``/``_sum``/``_count``/
    ``_created`` included): what dashboards and alerts may query."""
    registry = CollectorRegistry()
    ServiceMetrics(registry)
    RouterMetrics(registry)
    ConnectorMetrics(registry)
    names: set[str] = set()
    for family in registry.collect():
        names.add(family.name)
        if family.type == "counter":
            names.update({family.name + "_total", family.name + "_created"})
        elif family.type == "histogram":
            names.update({family.name + s for s in ("_bucket", "_sum", "_count", "_created")})
    return names

