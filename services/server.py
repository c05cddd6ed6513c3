"""Runs the services: all three in one process (the embedded default) or one each.

Lifecycle as in gRPC's route_guide: build the ``grpc.aio`` server, add servicers, health
and reflection, ``start()``, then wait for a signal and ``stop(grace)`` so in-flight RPCs
finish and streams close cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import Sequence

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvbaton.v1 import lease_pb2, lease_pb2_grpc, registrar_pb2, registrar_pb2_grpc, rendezvous_pb2, rendezvous_pb2_grpc

from .api.lease import LeaseServicer
from .api.registrar import RegistrarServicer
from .api.rendezvous import RendezvousServicer
from .domain.clock import Clock, WallClock
from .domain.lease import LeaseConfig, LeaseService
from .domain.registrar import RegistrarService
from .domain.rendezvous import RendezvousConfig, RendezvousService
from .store import Store, open_store

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
    services: Sequence[str] = ALL_SERVICES
    lease: LeaseConfig = dataclasses.field(default_factory=LeaseConfig)
    rendezvous: RendezvousConfig = dataclasses.field(default_factory=RendezvousConfig)
    grace_s: float = 5.0
    # Expiry leadership: a dead leader is replaced within about this long.
    leader_ttl_s: float = 3.0


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

    @property
    def address(self) -> str:
        host = self.config.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        if self.store is None:
            self.store = await open_store(self.config.store_url)
        store = self.store
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.keepalive_time_ms", 20_000), ("grpc.http2.max_pings_without_data", 0),
                ("grpc.keepalive_permit_without_calls", 1)]
        self.server = grpc.aio.server(options=opts)
        health_servicer = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        names = [reflection.SERVICE_NAME, health.SERVICE_NAME]
        # The registrar domain is also what rendezvous asks "is this engine known?".
        self.registrar = RegistrarService(store, clock=self.clock)
        if "registrar" in self.config.services:
            registrar_pb2_grpc.add_RegistrarServicer_to_server(RegistrarServicer(self.registrar), self.server)
        if "rendezvous" in self.config.services:
            self.rendezvous = RendezvousService(store, clock=self.clock, config=self.config.rendezvous,
                                                engine_exists=self.registrar.engine_exists)
            await self.rendezvous.start(run_sweeper=True)
            rendezvous_pb2_grpc.add_RendezvousServicer_to_server(RendezvousServicer(self.rendezvous), self.server)
        if "lease" in self.config.services:
            self.lease = LeaseService(store, clock=self.clock, config=self.config.lease)
            await self.lease.start(run_expiry=True)
            lease_pb2_grpc.add_LeaseServicer_to_server(LeaseServicer(self.lease), self.server)
        await self._elect()
        for svc in self.config.services:
            names.append(_NAMES[svc])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        reflection.enable_server_reflection(names, self.server)
        self.port = self.server.add_insecure_port(self.config.address)
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.address}")
        await self.server.start()
        for svc in self.config.services:
            await _set(health_servicer, _NAMES[svc], health_pb2.HealthCheckResponse.SERVING)
        await _set(health_servicer, "", health_pb2.HealthCheckResponse.SERVING)
        self.health = health_servicer
        log.info("kvbaton.serving", address=self.address, store=store.name, services=list(self.config.services))

    async def _elect(self) -> None:
        """Expiry and sweeping run on one replica at a time (an election over the store);
        a replica that loses leadership campaigns again, so a standby is always waiting."""
        from .store.election import Election

        for name, domain in (("lease-expiry", self.lease), ("rendezvous-sweeper", self.rendezvous)):
            if domain is None:
                continue
            election = Election(self.store, name, ttl_s=self.config.leader_ttl_s)
            domain.is_leader = lambda e=election: e.is_leader
            self._leadership.append((election, asyncio.get_running_loop().create_task(
                _campaign_forever(election), name=f"campaign-{name}")))

    async def stop(self) -> None:
        """Graceful: in-flight RPCs get ``grace_s``; every later step is bounded too."""
        async def bounded(aw, what: str) -> None:
            try:
                await asyncio.wait_for(aw, 5.0)
            except Exception as exc:  # shutting down: log and go on
                log.warning("kvbaton.stop_step_failed", step=what, error=repr(exc))

        if self.server is not None:
            if hasattr(self, "health"):
                await bounded(_set(self.health, "", health_pb2.HealthCheckResponse.NOT_SERVING), "health")
            await bounded(self.server.stop(self.config.grace_s), "grpc")
        for election, task in self._leadership:
            task.cancel()
            await bounded(asyncio.gather(task, return_exceptions=True), "campaign")
            await bounded(election.resign(), "resign")
        for domain in (self.lease, self.rendezvous):
            if domain is not None:
                await bounded(domain.stop(), type(domain).__name__)
        if self._owns_store and self.store is not None:
            await bounded(self.store.close(), "store")


async def _campaign_forever(election) -> None:
    while True:
        try:
            await election.campaign()
            log.info("leader.elected", name=election.name)
            await election.lost.wait()
            log.warning("leader.lost", name=election.name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # store unreachable: try again shortly
            log.warning("leader.campaign_failed", name=election.name, error=str(exc))
            await asyncio.sleep(0.5)


async def _set(servicer, name: str, status) -> None:
    result = servicer.set(name, status)
    if asyncio.iscoroutine(result):
        await result


async def serve(config: ServerConfig) -> None:
    """Runs until SIGINT/SIGTERM, then shuts down gracefully."""
    plane = ControlPlane(config)
    await plane.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    print(f"kvbaton listening on {plane.address} (store {config.store_url})", flush=True)
    await stop.wait()
    log.info("kvbaton.stopping", grace_s=config.grace_s)
    await plane.stop()
