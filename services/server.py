"""Runs the services: all three in one process (the embedded default) or one each.

Lifecycle as in gRPC's route_guide: build the ``grpc.aio`` server, add servicers, health
and reflection, ``start()``, then wait for a signal and ``stop(grace)`` so in-flight RPCs
finish and streams close cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import signal
from collections.abc import Sequence

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvbaton.v1 import lease_pb2, lease_pb2_grpc, registrar_pb2, registrar_pb2_grpc, rendezvous_pb2, rendezvous_pb2_grpc

from . import gc_policy, tracing
from .api.lease import LeaseServicer
from .api.overload import CORE_BACKLOG_OPTIONS, LoopLag
from .api.registrar import RegistrarServicer
from .api.rendezvous import RendezvousServicer
from .domain.clock import Clock, WallClock
from .domain.lease import ACTIVE as LEASE_ACTIVE
from .domain.lease import DRAINING as LEASE_DRAINING
from .domain.lease import LeaseConfig, LeaseService
from .domain.registrar import RegistrarService, role_name
from .domain.rendezvous import PENDING as RDV_PENDING
from .domain.rendezvous import RendezvousConfig, RendezvousService
from .metrics import InstrumentedStore, ServiceMetrics
from .store import Store, open_store
from .web import WebServer

log = structlog.get_logger(__name__)

ALL_SERVICES = ("registrar", "rendezvous", "lease")
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_NAMES = {
    "registrar": registrar_pb2.DESCRIPTOR.services_by_name["Registrar"].full_name,
    "rendezvous": rendezvous_pb2.DESCRIPTOR.services_by_name["Rendezvous"].full_name,
    "lease": lease_pb2.DESCRIPTOR.services_by_name["Lease"].full_name,
}


@dataclasses.dataclass
class ServerConfig:
    address: str = "127.0.0.1:50051"
    store_url: str = "memory://"
    # etcd over TLS (etcds://): CA, and client cert/key for --client-cert-auth; "" = env.
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    services: Sequence[str] = ALL_SERVICES
    lease: LeaseConfig = dataclasses.field(default_factory=LeaseConfig)
    rendezvous: RendezvousConfig = dataclasses.field(default_factory=RendezvousConfig)
    grace_s: float = 5.0
    # Expiry leadership: a dead leader is replaced within about this long.
    leader_ttl_s: float = 3.0
    # Transport security: server cert/key; a client CA turns on mutual TLS (client certs
    # required). Without TLS the server refuses to start unless ``insecure`` is set.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    insecure: bool = False
    tokens_file: str = ""
    rate_limit: float = 0.0
    max_streams_per_client: int = 256
    # host:port for /metrics, the status page and /api/state (port 0: any free port); None: off.
    metrics_address: str | None = None
    # A separate host:port for the status page and /api/state; None: served with /metrics.
    web_address: str | None = None
    # Load shedding (services/api/overload.py): while the event loop is saturated or runs
    # more than this many ms behind, messages that would open a new transfer are refused
    # with RESOURCE_EXHAUSTED. 0: never. Off for planes built in-process (tests drive them
    # from their own loop); `kvbaton serve` turns it on (--shed-lag-ms, default 20).
    shed_lag_ms: float = 0.0
    # OpenTelemetry collector (OTLP/gRPC) for traces; None: $KVBATON_OTLP_ENDPOINT; "": off.
    # Tracing already configured in this process (tests: an in-memory exporter) is kept.
    otlp_endpoint: str | None = None
    # The garbage collector's thresholds that ``serve()`` sets (services/gc_policy.py says
    # why these); planes built in-process leave their process's collector alone.
    gc_threshold: tuple[int, int, int] = gc_policy.SERVE_THRESHOLD


class ControlPlane:
    """The services of one process, over one store. ``await start()``, ``await stop()``."""

    def __init__(self, config: ServerConfig, *, store: Store | None = None, clock: Clock | None = None) -> None:
        unknown = set(config.services) - set(ALL_SERVICES)
        if unknown:
            raise ValueError(f"unknown services {sorted(unknown)}; choose from {ALL_SERVICES}")
        self.config = config
        self.store = store
        self.clock = clock or WallClock()
        self.registrar: RegistrarService | None = None
        self.rendezvous: RendezvousService | None = None
        self.lease: LeaseService | None = None
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._owns_store = store is None
        self._leadership: list = []
        # One registry per plane: several planes in one process each count only their own.
        self.metrics = ServiceMetrics(CollectorRegistry())
        self._engine_counts: tuple[dict[tuple[str, ...], float], dict[tuple[str, ...], float]] = ({}, {})
        self.web: WebServer | None = None  # once started (metrics_address or web_address set)
        self.load = LoopLag(max_lag_ms=config.shed_lag_ms, on_shed=self.metrics.shed.inc)

    @property
    def address(self) -> str:
        host = self.config.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        self._check_transport()
        if self.store is None:
            self.store = await open_store(self.config.store_url, etcd_ca=self.config.etcd_ca,
                                          etcd_cert=self.config.etcd_cert, etcd_key=self.config.etcd_key)
        # The domains see the store through a timing wrapper; ``self.store`` stays the
        # backend itself (tests and tools poke it directly).
        store = InstrumentedStore(self.store, self.metrics)
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.keepalive_time_ms", 20_000), ("grpc.http2.max_pings_without_data", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                # Clients ping every 10 s (kvbaton/client.py); without this the server's
                # default (5 min) answers their pings with GOAWAY "Too many pings".
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000), *CORE_BACKLOG_OPTIONS]
        from .api.guard import Guard, GuardConfig
        from .auth import TokenBook

        tokens = TokenBook.load(self.config.tokens_file) if self.config.tokens_file else None
        self.guard = Guard(GuardConfig(tokens=tokens, rate_limit=self.config.rate_limit,
                                       max_streams_per_client=self.config.max_streams_per_client,
                                       mtls=bool(self.config.tls_client_ca)))
        self.tokens = tokens  # the status page and /api/state ask for an operator token when set
        if tokens is not None and self.config.rendezvous.require_binding is None:
            # With tokens, a push transfer must name both engines (the router does).
            self.config.rendezvous.require_binding = True
        if not tracing.enabled():
            tracing.configure(self.config.otlp_endpoint, service_name="kvbaton" if set(self.config.services) == set(ALL_SERVICES)
                              else "kvbaton-" + "-".join(self.config.services))
        # Tracing first, so calls the guard refuses are traced too; nothing when tracing is off.
        self.server = grpc.aio.server(options=opts, interceptors=[*tracing.server_interceptors(), self.guard])
        health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        names = [reflection.SERVICE_NAME, health.SERVICE_NAME]
        # The registrar domain is also what rendezvous asks "is this engine known?".
        self.registrar = RegistrarService(store, clock=self.clock, metrics=self.metrics)
        # Checks against the records (whose lease, whose retention): services/api/ownership.py.
        # The lease domain, when this process runs it, is filled in below.
        from .api.ownership import Ownership

        self._ownership = Ownership(self.registrar, None)
        if "registrar" in self.config.services:
            registrar_pb2_grpc.add_RegistrarServicer_to_server(RegistrarServicer(self.registrar, self._ownership),
                                                               self.server)
        if "rendezvous" in self.config.services:
            self.rendezvous = RendezvousService(store, clock=self.clock, config=self.config.rendezvous,
                                                engine_exists=self.registrar.engine_exists,
                                                pair_check=self.registrar.pair_verdict, metrics=self.metrics,
                                                retained_lookup=self.registrar.find_retained)
            await self.rendezvous.start(run_sweeper=True)
            self.load.start()
            rendezvous_pb2_grpc.add_RendezvousServicer_to_server(RendezvousServicer(self.rendezvous, load=self.load),
                                                                 self.server)
        if "lease" in self.config.services:
            self.lease = LeaseService(store, clock=self.clock, config=self.config.lease, metrics=self.metrics,
                                      engine_alive=self.registrar.engine_exists,
                                      pair_check=self.registrar.pair_verdict, on_refused=self._record_refused,
                                      retention_revision=self.registrar.retention_revision)
            await self.lease.start(run_expiry=True)
            self._ownership.lease = self.lease
            lease_pb2_grpc.add_LeaseServicer_to_server(LeaseServicer(self.lease, self._ownership), self.server)
        await self._elect(store)
        self._wire_state_gauges()
        for svc in self.config.services:
            names.append(_NAMES[svc])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        reflection.enable_server_reflection(names, self.server)
        self.port = self._bind()
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.address}")
        await self.server.start()
        for svc in self.config.services:
            await _set(health_servicer, _NAMES[svc], health_pb2.HealthCheckResponse.SERVING)
        await _set(health_servicer, "", health_pb2.HealthCheckResponse.SERVING)
        self.health = health_servicer
        if self.config.metrics_address is not None or self.config.web_address is not None:
            self.web = WebServer(self)
            await self.web.start()
        log.info("kvbaton.serving", address=self.address, store=store.name, services=list(self.config.services),
                 metrics=self.web.metrics_url if self.web else None)

    async def _record_refused(self, transfer_id: str, owner: str, reader: str, reason: str) -> None:
        """A reuse READ refused at its pin (incompatible KV) becomes a failed transfer, seen
        in ``kvbaton transfers list --phase failed`` next to refused push matches. Without
        the rendezvous service in this process, the refusal is only in the pin's status."""
        if self.rendezvous is not None:
            await self.rendezvous.record_refused(transfer_id, owner_engine_id=owner, reader_engine_id=reader,
                                                 reason=reason)

    def _wire_state_gauges(self) -> None:
        """Points the scrape-time gauges at this replica's caches. Each is exported only by
        a process that runs the service owning it, so a split deployment does not report the
        same state three times."""
        sources = self.metrics.state.sources
        lease, rdv = self.lease, self.rendezvous
        if lease is not None:
            def leases() -> dict[tuple[str, ...], float]:
                out: dict[tuple[str, ...], float] = {("active",): 0.0, ("draining",): 0.0}
                for info, _ in list(lease.hub.records.values()):
                    if info.state in (LEASE_ACTIVE, LEASE_DRAINING):
                        out[("active" if info.state == LEASE_ACTIVE else "draining",)] += 1
                return out

            def retained() -> dict[tuple[str, ...], float]:
                out: dict[tuple[str, ...], float] = {}
                for info, _ in list(lease.hub.records.values()):
                    out[(info.engine_id,)] = out.get((info.engine_id,), 0.0) + info.num_blocks
                return out

            sources["kvbaton_leases"] = leases
            sources["kvbaton_retained_blocks"] = retained
        if rdv is not None:
            from .domain.rendezvous import MATCHED, P

            def pending() -> dict[tuple[str, ...], float]:
                out: dict[tuple[str, ...], float] = {
                    (P.Name(p).removeprefix("TRANSFER_PHASE_").lower(),): 0.0 for p in (*RDV_PENDING, MATCHED)}
                for t, _ in list(rdv.hub.records.values()):
                    key = (P.Name(t.phase).removeprefix("TRANSFER_PHASE_").lower(),)
                    if key in out:
                        out[key] += 1
                return out

            sources["kvbaton_transfers_pending"] = pending
            if self.load.max_lag_ms > 0:  # the load monitor runs (with the rendezvous service): its view of the loop
                load = self.load
                sources["kvbaton_server_loop_busy_ratio"] = lambda: {(): load.busy}
                sources["kvbaton_server_loop_lag_seconds"] = lambda: {(): load.lag_ms / 1000}
        if "registrar" in self.config.services:
            sources["kvbaton_engines"] = lambda: self._engine_counts[0]
            sources["kvbaton_engine_ranks"] = lambda: self._engine_counts[1]
        sources["kvbaton_leader"] = lambda: {(name,): float(lead) for name, lead in self.leadership().items()}

    def leadership(self) -> dict[str, bool]:
        """Election name (``lease-expiry``, ``rendezvous-sweeper``) -> whether this replica leads it."""
        return {e.name: bool(e.is_leader) for e, _ in self._leadership}

    async def refresh_state_gauges(self, timeout_s: float = 2.0) -> None:
        """Re-reads what no cache holds (registered engines) for the next scrape. Bounded: a
        scrape during a store outage gets the last known values rather than hanging."""
        if self.registrar is None or "registrar" not in self.config.services:
            return
        try:
            ranks = await asyncio.wait_for(self.registrar.list_engines(), timeout_s)
        except Exception as exc:  # noqa: BLE001 - store down: keep the last values; store_errors says why
            log.debug("metrics.engine_refresh_failed", error=repr(exc))
            return
        engines: dict[tuple[str, ...], set[str]] = {}
        rank_counts: dict[tuple[str, ...], float] = {}
        for r in ranks:
            key = (role_name(r.role),)
            engines.setdefault(key, set()).add(r.engine_id)
            rank_counts[key] = rank_counts.get(key, 0.0) + 1
        for role in ("prefill", "decode", "both"):
            engines.setdefault((role,), set())
            rank_counts.setdefault((role,), 0.0)
        self._engine_counts = ({k: float(len(v)) for k, v in engines.items()}, rank_counts)

    def _check_transport(self) -> None:
        """Plaintext only on loopback (a laptop), or where a person wrote ``--insecure``;
        checked before anything is opened."""
        cfg = self.config
        if not (cfg.tls_cert or cfg.tls_key) and not cfg.insecure and not is_loopback(cfg.address):
            raise ValueError(f"no TLS certificate configured for {cfg.address}, which is not a loopback address: "
                             "pass --tls-cert/--tls-key (and --tls-client-ca for mutual TLS), or --insecure to "
                             "serve plaintext")

    def _bind(self) -> int:
        if self.server is None:
            raise RuntimeError("_bind() before start() built the gRPC server")
        cfg = self.config
        if cfg.tls_cert or cfg.tls_key:
            if not (cfg.tls_cert and cfg.tls_key):
                raise ValueError("TLS needs both a certificate and a key")
            read = lambda p: open(p, "rb").read()  # noqa: E731
            creds = grpc.ssl_server_credentials(
                [(read(cfg.tls_key), read(cfg.tls_cert))],
                root_certificates=read(cfg.tls_client_ca) if cfg.tls_client_ca else None,
                require_client_auth=bool(cfg.tls_client_ca))
            log.info("kvbaton.tls", mutual=bool(cfg.tls_client_ca))
            return self.server.add_secure_port(cfg.address, creds)
        log.warning("kvbaton.PLAINTEXT", address=cfg.address,
                    message="serving WITHOUT TLS: anyone who can reach this port can read and change KV hand-offs")
        return self.server.add_insecure_port(cfg.address)

    async def _elect(self, store: Store) -> None:
        """Expiry and sweeping run on one replica at a time (an election over the store);
        a replica that loses leadership campaigns again, so a standby is always waiting."""
        from .store.election import Election

        for name, domain in (("lease-expiry", self.lease), ("rendezvous-sweeper", self.rendezvous)):
            if domain is None:
                continue
            election = Election(store, name, ttl_s=self.config.leader_ttl_s)

            def leads(e: Election = election) -> bool:
                return e.is_leader

            domain.is_leader = leads
            self._leadership.append((election, asyncio.get_running_loop().create_task(
                _campaign_forever(election), name=f"campaign-{name}")))

    async def stop(self) -> None:
        """Graceful: in-flight RPCs get ``grace_s``; every later step is bounded too."""
        async def bounded(aw, what: str) -> None:
            try:
                await asyncio.wait_for(aw, 5.0)
            except Exception as exc:  # noqa: BLE001 - shutting down: log and go on
                log.warning("kvbaton.stop_step_failed", step=what, error=repr(exc))

        if self.web is not None:
            await bounded(self.web.stop(), "web")
        if self.server is not None:
            if hasattr(self, "health"):
                await bounded(_set(self.health, "", health_pb2.HealthCheckResponse.NOT_SERVING), "health")
            await bounded(self.server.stop(self.config.grace_s), "grpc")
        for election, task in self._leadership:
            task.cancel()
            await bounded(asyncio.gather(task, return_exceptions=True), "campaign")
            await bounded(election.resign(), "resign")
        await bounded(self.load.stop(), "loop-lag")
        for domain in (self.lease, self.rendezvous):
            if domain is not None:
                await bounded(domain.stop(), type(domain).__name__)
        if self._owns_store and self.store is not None:
            await bounded(self.store.close(), "store")


def is_loopback(address: str) -> bool:
    """``host:port`` on 127.0.0.0/8, ::1 or ``localhost``: reachable from this host only."""
    import ipaddress

    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name, "" or 0.0.0.0-like wildcards: not provably loopback


async def _campaign_forever(election) -> None:
    while True:
        try:
            await election.campaign()
            log.info("leader.elected", name=election.name)
            await election.lost.wait()
            log.warning("leader.lost", name=election.name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - store unreachable: try again shortly
            log.warning("leader.campaign_failed", name=election.name, error=str(exc))
            await asyncio.sleep(0.5)


async def _set(servicer, name: str, status) -> None:
    result = servicer.set(name, status)
    if asyncio.iscoroutine(result):
        await result


async def serve(config: ServerConfig) -> None:
    """Runs until SIGINT/SIGTERM, then shuts down gracefully."""
    gc_policy.set_threshold(config.gc_threshold)  # a bad value fails here, before anything starts
    plane = ControlPlane(config)
    await plane.start()
    # Everything loaded so far (modules, stubs, caches) lives as long as the process:
    # keep it out of the collector's full passes, which otherwise pause every call for
    # tens of milliseconds from time to time.
    gc.freeze()
    # ...and so is most of what each full collection finds alive later (leases, cached
    # records): freeze those survivors too, so full passes stay proportional to what changed.
    gc_policy.install(asyncio.get_running_loop())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(f"kvbaton listening on {plane.address} (store {config.store_url})", flush=True)
    if plane.web is not None:
        print(f"kvbaton metrics on {plane.web.metrics_url}, status page on {plane.web.page_url}", flush=True)
    await stop.wait()
    log.info("kvbaton.stopping", grace_s=config.grace_s)
    await plane.stop()
    tracing.shutdown()  # flush the last spans
