"""Fixtures for the store contract suite: every test runs on memory and on a real etcd.

The etcd cluster (1 member) is started once per session; each test gets its own client
and a unique key prefix (``ns``), and its keys are wiped afterwards, so tests stay
isolated without restarting etcd.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from kvbaton.services.store import MemoryStore, Store
from kvbaton.stack.etcd_cluster import EtcdCluster, find_etcd

NO_ETCD = "etcd binary not found (need Debian's etcd-server): run scripts/ensure_etcd.sh"


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[EtcdCluster]:
    if find_etcd() is None:
        pytest.skip(NO_ETCD)
    cluster = EtcdCluster(1).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def ns() -> bytes:
    """A key prefix no other test uses."""
    return f"t/{uuid.uuid4().hex[:10]}/".encode()


@pytest.fixture(params=["memory", pytest.param("etcd", marks=pytest.mark.etcd)])
async def store(request: pytest.FixtureRequest, ns: bytes) -> AsyncIterator[Store]:
    if request.param == "memory":
        s: Store = MemoryStore()
        yield s
        await s.close()
        return
    from kvbaton.services.store.etcd import EtcdStore

    cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
    s = await EtcdStore.connect(cluster.endpoints, timeout_s=5.0)
    try:
        yield s
    finally:
        try:
            await s.delete(ns, prefix=True)
            await s.delete(b"election/" + ns, prefix=True)
        finally:
            await s.close()


@pytest.fixture
def backend(store: Store) -> str:
    return "etcd" if type(store).__name__ == "EtcdStore" else "memory"
