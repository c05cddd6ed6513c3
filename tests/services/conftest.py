"""A real kvbaton server per test, over each store backend.

``plane`` runs the three services in-process on a free loopback port; ``kv`` is a client
connected to it. The ``store_kind`` parameter runs the suite on the in-memory store and,
where a real etcd server can be started, on etcd.
"""

from __future__ import annotations

import os
import shutil

import pytest

from kvbaton.client import KvbatonClient
from kvbaton.services.domain.clock import Clock, WallClock
from kvbaton.services.domain.lease import LeaseConfig
from kvbaton.services.domain.rendezvous import RendezvousConfig
from kvbaton.services.server import ControlPlane, ServerConfig
from kvbaton.services.store import MemoryStore


def _etcd_available() -> bool:
    return bool(shutil.which("etcd") or os.path.exists("/usr/bin/etcd"))


@pytest.fixture(params=["memory", "etcd"])
def store_kind(request):
    if request.param == "etcd" and not _etcd_available():
        pytest.skip("etcd binary not installed (scripts/test.sh installs it)")
    return request.param


@pytest.fixture
async def store(store_kind, request):
    if store_kind == "memory":
        s = MemoryStore()
        yield s
        await s.close()
        return
    cluster = request.getfixturevalue("etcd_cluster")
    from kvbaton.services.store.etcd import EtcdStore

    s = await EtcdStore.connect(cluster.endpoints)
    await s.delete(b"kvb/", prefix=True)
    await s.delete(b"election/", prefix=True)
    yield s
    await s.close()


def fast_config(**over) -> ServerConfig:
    cfg = ServerConfig(address="127.0.0.1:0", grace_s=0.5, insecure=True)
    cfg.lease = LeaseConfig(default_ttl_ms=2_000, expiry_tick_s=0.02)
    cfg.rendezvous = RendezvousConfig(sweep_tick_s=0.02, match_timeout_ms=2_000)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture
def clock() -> Clock:
    """The plane's clock: the wall clock; a module whose tests move time by hand (leases)
    overrides this fixture with a ``ManualClock``."""
    return WallClock()


@pytest.fixture
async def plane(store, clock):
    cp = ControlPlane(fast_config(), store=store, clock=clock)
    await cp.start()
    yield cp
    await cp.stop()


@pytest.fixture
async def kv(plane):
    client = KvbatonClient(plane.address, timeout_s=5.0)
    await client.wait_ready()
    yield client
    await client.close()
