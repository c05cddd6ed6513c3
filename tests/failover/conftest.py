"""A 3-member etcd cluster per failover test module (real etcd processes on loopback)."""

from __future__ import annotations

import pytest

from kvbaton.stack.etcd_cluster import EtcdCluster


@pytest.fixture(scope="module")
def cluster():
    c = EtcdCluster(3).start()
    try:
        yield c
    finally:
        c.stop()
