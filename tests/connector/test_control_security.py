"""The connector's control thread reaches a control plane that requires mutual TLS and
tokens, from settings or from the environment (kvbaton/security.py), and a half-configured
engine fails at start with a message instead of on its first call."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("cryptography")

from kvbaton.connector.control import ControlThread
from kvbaton.security import ClientSecurity
from kvbaton.services.server import ControlPlane
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import common_pb2, registrar_pb2
from tests.harness.pki import TestCA
from tests.services.conftest import fast_config
from tests.services.helpers import engine_rank

TOKEN = "tok-engine-e1-0123456789abcdef"


@pytest.fixture
async def secured(tmp_path):
    ca = TestCA(tmp_path / "pki")
    server, engine = ca.server("cp"), ca.client("e1")
    (tmp_path / "tokens.json").write_text(json.dumps({"tokens": [
        {"token": TOKEN, "name": "e1", "role": "engine", "engines": ["e1"]}]}))
    (tmp_path / "e1.token").write_text(TOKEN + "\n")
    cp = ControlPlane(fast_config(tls_cert=server.cert, tls_key=server.key, tls_client_ca=ca.ca, insecure=False,
                                  tokens_file=str(tmp_path / "tokens.json")), store=MemoryStore())
    await cp.start()
    yield cp, ca, engine, tmp_path / "e1.token"
    await cp.stop()


def _register(ctl: ControlThread) -> registrar_pb2.RegisterEngineResponse:
    return ctl.submit(lambda c: c.call(c.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(
        rank=engine_rank("e1", common_pb2.ENGINE_ROLE_DECODE)))).result(timeout=20)


async def test_control_thread_with_settings_and_with_environment(secured, monkeypatch):
    import asyncio

    cp, ca, engine, token_file = secured
    sec = ClientSecurity.resolve(tls_ca=ca.ca, tls_cert=engine.cert, tls_key=engine.key, token_file=str(token_file))
    assert sec.describe() == "mTLS, token" and TOKEN not in repr(sec)
    ctl = ControlThread(cp.address, timeout_s=5, security=sec)
    try:
        resp = await asyncio.to_thread(_register, ctl)
        assert resp.rank.engine_id == "e1"
    finally:
        ctl.close()
    for k, v in {"KVBATON_TLS_CA": ca.ca, "KVBATON_TLS_CERT": engine.cert, "KVBATON_TLS_KEY": engine.key,
                 "KVBATON_TOKEN_FILE": str(token_file)}.items():
        monkeypatch.setenv(k, v)
    ctl = ControlThread(cp.address, timeout_s=5)  # nothing passed: the environment
    try:
        resp = await asyncio.to_thread(_register, ctl)
        assert resp.rank.incarnation
    finally:
        ctl.close()


def test_half_configured_clients_fail_at_start(tmp_path):
    with pytest.raises(ValueError, match="both a client certificate and its key"):
        ClientSecurity.resolve(tls_ca="ca.crt", tls_cert="c.crt", env={})
    with pytest.raises(ValueError, match="needs the CA"):
        ClientSecurity.resolve(tls_cert="c.crt", tls_key="c.key", env={})
    with pytest.raises(ValueError, match="does not exist"):
        ClientSecurity.resolve(tls_ca=str(tmp_path / "missing.crt"), env={})
    with pytest.raises(ValueError, match="cannot read token file"):
        ClientSecurity.resolve(token_file=str(tmp_path / "nope"), env={})
    # Explicit values win over the environment; the environment fills what is unset.
    sec = ClientSecurity.resolve(token="explicit", env={"KVBATON_TOKEN": "from-env"})
    assert sec.token == "explicit" and sec.tls is None and sec.describe() == "plaintext, token"
    assert ClientSecurity.resolve(env={"KVBATON_TOKEN": "from-env"}).token == "from-env"
