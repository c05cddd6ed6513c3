"""The control plane on a real etcd 3.4 that speaks only TLS and requires client
certificates (``--cert-file --key-file --client-cert-auth --trusted-ca-file``)."""

from __future__ import annotations

import pytest

from kvbaton.client import KvbatonClient
from kvbaton.services.server import ControlPlane
from kvbaton.services.store import StoreError, open_store
from kvbaton.stack.etcd_cluster import EtcdCluster, EtcdServerTls, find_etcd
from kvbaton.v1 import common_pb2, registrar_pb2
from tests.services.conftest import fast_config
from tests.services.helpers import engine_rank

pytest.importorskip("cryptography")
from tests.harness.pki import TestCA

pytestmark = [pytest.mark.etcd, pytest.mark.skipif(find_etcd() is None, reason="etcd not installed (scripts/ensure_etcd.sh)")]
# A refused store retries until its timeout: 2 s here is enough to be refused for good
# (the 10 s default was waited out three times, 30 s of the file's 40).
REFUSED_S = 2.0


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    ca = TestCA(tmp_path_factory.mktemp("etcd-pki"))
    server, client = ca.server("etcd-0"), ca.client("kvbaton-control-plane")
    cluster = EtcdCluster(1, tls=EtcdServerTls(ca.ca, server.cert, server.key, client.cert, client.key)).start()
    yield cluster, ca, client
    cluster.stop()


async def test_control_plane_runs_on_etcd_over_mutual_tls(tls_etcd):
    cluster, ca, client = tls_etcd
    assert cluster.url.startswith("etcds://")
    cp = ControlPlane(fast_config(store_url=cluster.url, etcd_ca=ca.ca, etcd_cert=client.cert, etcd_key=client.key))
    await cp.start()
    try:
        async with KvbatonClient(cp.address, timeout_s=5) as kv:
            await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(
                rank=engine_rank("dec-tls", common_pb2.ENGINE_ROLE_DECODE)))
            listed = await kv.call(kv.registrar.ListEngines, registrar_pb2.ListEnginesRequest())
            assert [r.engine_id for r in listed.ranks] == ["dec-tls"]
        assert cp.store.tls is not None
        # The record went through TLS into etcd.
        assert await cp.store.get(b"kvb/reg/e/dec-tls/00000") is not None
    finally:
        await cp.stop()


async def test_etcd_refuses_a_store_without_the_client_certificate(tls_etcd, tmp_path):
    cluster, ca, client = tls_etcd
    # TLS without a client certificate: etcd's --client-cert-auth refuses the handshake.
    with pytest.raises(StoreError):
        store = await open_store(cluster.url, etcd_ca=ca.ca, timeout_s=REFUSED_S)
        await store.close()
    # A client certificate from another CA is refused too.
    rogue = TestCA(tmp_path / "rogue").client("intruder")
    with pytest.raises(StoreError):
        store = await open_store(cluster.url, etcd_ca=ca.ca, etcd_cert=rogue.cert, etcd_key=rogue.key,
                                 timeout_s=REFUSED_S)
        await store.close()
    # etcds:// without a CA is a configuration error, said at once.
    with pytest.raises(ValueError, match="etcd-ca"):
        await open_store(cluster.url, etcd_ca="")


async def test_plaintext_clients_cannot_read_the_tls_etcd(tls_etcd):
    cluster, _, _ = tls_etcd
    with pytest.raises(StoreError):
        store = await open_store("etcd://" + ",".join(cluster.endpoints), timeout_s=REFUSED_S)
        await store.close()


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory):
    """etcd with TLS and auth enabled: a client certificate's CN is its etcd user
    (--client-cert-auth), and user kvbaton-control-plane may read and write only kvb/."""
    import subprocess

    ca = TestCA(tmp_path_factory.mktemp("etcd-auth-pki"))
    server, root = ca.server("etcd-0"), ca.client("root")
    cluster = EtcdCluster(1, tls=EtcdServerTls(ca.ca, server.cert, server.key, root.cert, root.key)).start()

    def etcdctl(*args: str) -> None:
        subprocess.run(["etcdctl", "--endpoints", "https://" + cluster.endpoints[0], "--cacert", ca.ca,
                        "--cert", root.cert, "--key", root.key, *args], check=True, capture_output=True, timeout=60)
    try:
        etcdctl("user", "add", "root", "--new-user-password=root-password-0123456789")
        etcdctl("role", "add", "kvbaton")
        etcdctl("role", "grant-permission", "kvbaton", "--prefix=true", "readwrite", "kvb/")
        etcdctl("user", "add", "kvbaton-control-plane", "--new-user-password=unused-0123456789")
        etcdctl("user", "grant-role", "kvbaton-control-plane", "kvbaton")
        etcdctl("auth", "enable")
    except BaseException:
        cluster.stop()
        raise
    yield cluster, ca
    cluster.stop()


async def test_control_plane_on_etcd_with_auth_by_certificate(auth_etcd):
    cluster, ca = auth_etcd
    cp_cert, intruder = ca.client("kvbaton-control-plane"), ca.client("intruder")
    cp = ControlPlane(fast_config(store_url=cluster.url, etcd_ca=ca.ca, etcd_cert=cp_cert.cert, etcd_key=cp_cert.key))
    await cp.start()  # elections, caches and watches all live under kvb/
    try:
        async with KvbatonClient(cp.address, timeout_s=5) as kv:
            await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(
                rank=engine_rank("dec-auth", common_pb2.ENGINE_ROLE_DECODE)))
            listed = await kv.call(kv.registrar.ListEngines, registrar_pb2.ListEnginesRequest())
            assert [r.engine_id for r in listed.ranks] == ["dec-auth"]
        with pytest.raises(StoreError, match="PERMISSION_DENIED"):
            await cp.store.put(b"elsewhere/x", b"1")  # the role covers kvb/ only
    finally:
        await cp.stop()
    # Signed by the same CA but not an etcd user with that role: every read is refused.
    store = await open_store(cluster.url, etcd_ca=ca.ca, etcd_cert=intruder.cert, etcd_key=intruder.key)
    try:
        with pytest.raises(StoreError, match="PERMISSION_DENIED"):
            await store.get(b"kvb/reg/e/dec-auth/00000")
    finally:
        await store.close()
