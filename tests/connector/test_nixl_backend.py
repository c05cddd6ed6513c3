"""The ``nixl_backend`` setting reaches the NIXL agent; a backend this machine lacks
(LIBFABRIC here: no libfabric/EFA) fails engine start-up with a clear message. Real nixl."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("nixl")
torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvbaton.connector.metadata import KvbatonSettings  # noqa: E402
from kvbaton.connector.transfer.nixl_agent import NixlBackendUnavailable, NixlEndpoint  # noqa: E402

pytestmark = pytest.mark.nixl


def test_ucx_is_the_default_and_works():
    ep = NixlEndpoint("kvb-backend-ucx", net_devices="lo", ucx_tls="tcp,self,sm")
    try:
        assert ep.backend == "UCX" and ep.metadata()
    finally:
        ep.close()


def test_a_backend_this_machine_lacks_fails_with_the_reason():
    with pytest.raises(NixlBackendUnavailable) as err:
        NixlEndpoint("kvb-backend-libfabric", backend="LIBFABRIC")
    msg = str(err.value)
    assert "NIXL backend 'LIBFABRIC' cannot be created on this machine" in msg
    assert "UCX" in msg and "kv_connector_extra_config.nixl_backend" in msg


def _settings(**extra) -> KvbatonSettings:
    values = {"control_plane": "127.0.0.1:9", "engine_id": "backend-test", **extra}
    ktc = types.SimpleNamespace(engine_id="", get_from_extra_config=lambda k, default=None: values.get(k, default))
    return KvbatonSettings.from_vllm(ktc)


def test_setting_is_read_and_normalised():
    assert _settings().nixl_backend == "ucx"
    assert _settings(nixl_backend="LIBFABRIC").nixl_backend == "libfabric"
    with pytest.raises(ValueError, match="nixl_backend must be one of"):
        _settings(nixl_backend="UCX; rm -rf")


@pytest.mark.parametrize("backend,starts", [("libfabric", False), ("ucx", True)])
def test_engine_start_up_fails_on_a_missing_backend(backend, starts, tmp_path):
    """The worker's start-up (register_kv_caches, what vLLM calls before serving) creates
    the agent with the configured backend: a missing one stops the engine right there."""
    from kvbaton.connector.worker import KvbatonWorker

    w = KvbatonWorker(_settings(nixl_backend=backend, ucx_net_devices="lo", ucx_tls="tcp,self,sm"), "kv_producer", 0)
    caches = {f"layer{i}": torch.zeros(8, 2, 16, 64) for i in range(2)}
    try:
        if starts:
            w.register_kv_caches(caches, 16)
            assert w._xfer is not None and w._xfer.ctx.ep is not None and w._xfer.ctx.ep.backend == "UCX"
        else:
            with pytest.raises(RuntimeError) as err:
                w.register_kv_caches(caches, 16)
            assert "failed to start: NIXL backend 'LIBFABRIC' cannot be created" in str(err.value)
            assert isinstance(err.value.__cause__, NixlBackendUnavailable)
    finally:
        w.shutdown()
