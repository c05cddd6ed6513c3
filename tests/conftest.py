"""Shared fixtures: a real control plane (in-process gRPC server on a loopback port)."""

from __future__ import annotations

import pytest

from kvbaton import logs

logs.configure("WARNING")


def pytest_collection_modifyitems(config, items):
    # Long end-to-end tests last, so quick failures show first.
    items.sort(key=lambda it: 1 if it.get_closest_marker("vllm") else 0)


@pytest.fixture(scope="session")
def etcd_cluster():
    """One real etcd member on loopback for the whole session (stopped by pid at the end)."""
    from tests.harness.etcd_cluster import EtcdCluster, find_etcd

    if find_etcd() is None:
        pytest.skip("etcd binary not found (scripts/test.sh installs Debian's etcd-server)")
    cluster = EtcdCluster(1).start()
    try:
        yield cluster
    finally:
        cluster.stop()
