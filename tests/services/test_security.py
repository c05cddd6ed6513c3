"""Transport security and authorization through a real server: mutual TLS with
certificates made here, bearer tokens with scopes, rate and stream limits."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvbaton.client import ClientTls, KvbatonClient
from kvbaton.services.server import ControlPlane
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import common_pb2, lease_pb2, registrar_pb2, rendezvous_pb2
from tests.services.conftest import fast_config
from tests.services.helpers import engine_rank

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _cert(subject: str, issuer_key, issuer_name, *, ca: bool = False, san: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(tmp, name, key, cert):
    (tmp / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    (tmp / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(tmp / f"{name}.crt"), str(tmp / f"{name}.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pki")
    ca_key, ca = _cert("kvbaton-test-ca", None, None, ca=True)
    _write(tmp, "ca", ca_key, ca)
    _write(tmp, "server", *_cert("kvbaton-server", ca_key, ca.subject, san=True))
    _write(tmp, "client", *_cert("engine-dec", ca_key, ca.subject))
    rogue_key, rogue = _cert("rogue-ca", None, None, ca=True)
    _write(tmp, "rogue", *_cert("intruder", rogue_key, rogue.subject))
    return tmp


async def _plane(**over) -> ControlPlane:
    cp = ControlPlane(fast_config(**over), store=MemoryStore())
    await cp.start()
    return cp


async def test_mutual_tls_admits_only_clients_signed_by_the_ca(pki):
    cp = await _plane(tls_cert=str(pki / "server.crt"), tls_key=str(pki / "server.key"),
                      tls_client_ca=str(pki / "ca.crt"), insecure=False)
    try:
        good = KvbatonClient(cp.address, timeout_s=3, tls=ClientTls(
            str(pki / "ca.crt"), str(pki / "client.crt"), str(pki / "client.key")))
        listed = await good.call(good.registrar.ListEngines, registrar_pb2.ListEnginesRequest())
        assert list(listed.ranks) == []
        await good.close()
        for tls in (ClientTls(str(pki / "ca.crt")),  # no client certificate
                    ClientTls(str(pki / "ca.crt"), str(pki / "rogue.crt"), str(pki / "rogue.key"))):
            bad = KvbatonClient(cp.address, timeout_s=2, tls=tls)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await bad.registrar.ListEngines(registrar_pb2.ListEnginesRequest(), timeout=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await bad.close()
        plain = KvbatonClient(cp.address, timeout_s=2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await plain.registrar.ListEngines(registrar_pb2.ListEnginesRequest(), timeout=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await plain.close()
    finally:
        await cp.stop()


async def test_plaintext_only_on_loopback_or_when_asked_for():
    # Off loopback, plaintext needs --insecure (a person wrote it) ...
    for address in ("0.0.0.0:0", "[::]:0", "kvbaton.example:0"):
        with pytest.raises(ValueError, match="--insecure"):
            await _plane(insecure=False, address=address)
    # ... on loopback (a laptop) it is the default, with its warning.
    cp = await _plane(insecure=False, address="127.0.0.1:0")
    try:
        assert cp.port > 0
    finally:
        await cp.stop()


TOKENS = {
    "dec": "tok-decode-engine-0123456789",
    "pre": "tok-prefill-engine-0123456789",
    "agent": "tok-agent-acme-0123456789abc",
    "router": "tok-router-0123456789abcdef",
    "ops": "tok-operator-0123456789abcd",
}


@pytest.fixture
async def secured(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": [
        {"token": TOKENS["dec"], "name": "decode-0", "role": "engine", "engines": ["dec"]},
        {"token": TOKENS["pre"], "name": "prefill-0", "role": "engine", "engines": ["pre"]},
        {"token": TOKENS["agent"], "name": "acme-agent", "role": "agent", "conversations": ["acme-*", "shared"]},
        {"token": TOKENS["router"], "name": "router", "role": "router"},
        {"token": TOKENS["ops"], "name": "oncall", "role": "operator"},
    ]}))
    cp = await _plane(tokens_file=str(path))
    clients = {who: KvbatonClient(cp.address, timeout_s=3, token=tok) for who, tok in TOKENS.items()}
    clients["none"] = KvbatonClient(cp.address, timeout_s=3)
    clients["forged"] = KvbatonClient(cp.address, timeout_s=3, token="not-a-real-token-at-all")
    yield cp, clients
    for c in clients.values():
        await c.close()
    await cp.stop()


async def _code(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_tokens_authenticate_and_scope(secured):
    cp, c = secured
    reg = lambda kv, eid, role: kv.registrar.RegisterEngine(  # noqa: E731
        registrar_pb2.RegisterEngineRequest(rank=engine_rank(eid, role)), timeout=3)
    assert await _code(reg(c["none"], "dec", common_pb2.ENGINE_ROLE_DECODE)) == grpc.StatusCode.UNAUTHENTICATED
    assert await _code(reg(c["forged"], "dec", common_pb2.ENGINE_ROLE_DECODE)) == grpc.StatusCode.UNAUTHENTICATED
    # An engine registers and offers only as itself.
    assert await _code(reg(c["pre"], "dec", common_pb2.ENGINE_ROLE_DECODE)) == grpc.StatusCode.PERMISSION_DENIED
    assert await _code(reg(c["dec"], "dec", common_pb2.ENGINE_ROLE_DECODE)) == grpc.StatusCode.OK
    assert await _code(reg(c["pre"], "pre", common_pb2.ENGINE_ROLE_PREFILL)) == grpc.StatusCode.OK
    # (With tokens a transfer must be bound: the offer names its prefill; ownership tests in
    # tests/services/test_ownership.py.)
    offer = rendezvous_pb2.OfferRequest(transfer_id="t1", decode_engine_id="dec", block_ids=[1],
                                        prefill_engine_id="pre")
    assert await _code(c["pre"].rendezvous.Offer(offer, timeout=3)) == grpc.StatusCode.PERMISSION_DENIED
    assert await _code(c["dec"].rendezvous.Offer(offer, timeout=3)) == grpc.StatusCode.OK
    # The refused offer wrote nothing: the only offer is decode's own.
    state = await c["ops"].rendezvous.GetTransfer(rendezvous_pb2.GetTransferRequest(transfer_id="t1"), timeout=3)
    assert state.offer.engine_id == "dec"
    # Leases: decode grants on its own engine; the agent renews and revokes only its own.
    for conv in ("acme-1", "other-1"):
        await c["dec"].lease.Grant(lease_pb2.GrantRequest(conversation_id=conv, engine_id="dec", ttl_ms=60_000), timeout=3)
    renew = lambda kv, conv: kv.lease.Renew(lease_pb2.RenewRequest(conversation_id=conv), timeout=3)  # noqa: E731
    assert await _code(renew(c["agent"], "acme-1")) == grpc.StatusCode.OK
    assert await _code(renew(c["agent"], "other-1")) == grpc.StatusCode.PERMISSION_DENIED
    revoke = lambda kv, conv: kv.lease.Revoke(lease_pb2.RevokeRequest(conversation_id=conv), timeout=3)  # noqa: E731
    assert await _code(revoke(c["agent"], "other-1")) == grpc.StatusCode.PERMISSION_DENIED
    assert await _code(revoke(c["router"], "acme-1")) == grpc.StatusCode.PERMISSION_DENIED
    assert await _code(c["agent"].lease.List(lease_pb2.ListLeasesRequest(), timeout=3)) == grpc.StatusCode.PERMISSION_DENIED
    # The router looks up; the operator lists and revokes anything.
    assert await _code(c["router"].registrar.ListEngines(registrar_pb2.ListEnginesRequest(), timeout=3)) == grpc.StatusCode.OK
    listed = await c["ops"].lease.List(lease_pb2.ListLeasesRequest(), timeout=3)
    assert {x.conversation_id for x in listed.leases} == {"acme-1", "other-1"}
    assert await _code(revoke(c["ops"], "other-1")) == grpc.StatusCode.OK
    # KeepAlive: one renewal out of scope refuses the stream with the reason.
    async def batches():
        yield lease_pb2.KeepAliveRequest(seq=1, renewals=[lease_pb2.RenewRequest(conversation_id="acme-1")])
        yield lease_pb2.KeepAliveRequest(seq=2, renewals=[lease_pb2.RenewRequest(conversation_id="other-1")])
    seen = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for resp in c["agent"].lease.KeepAlive(batches()):
            seen.append(resp.seq)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "other-1" in err.value.details()
    assert seen in ([], [1])  # batch 1 may or may not be answered before the refusal

    # ...and so does one of the packed renewals (conversation ids only).
    async def packed():
        yield lease_pb2.KeepAliveRequest(seq=3, compact=True, conversation_ids=["acme-1", "other-1"])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in c["agent"].lease.KeepAlive(packed()):
            pass
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "other-1" in err.value.details()
    # Health probes carry no token.
    health = health_pb2_grpc.HealthStub(c["none"].channel)
    assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=3)).status == health_pb2.HealthCheckResponse.SERVING


async def test_rate_limit_and_stream_cap_answer_resource_exhausted():
    cp = await _plane(rate_limit=20.0, max_streams_per_client=2)
    kv = KvbatonClient(cp.address, timeout_s=3)
    try:
        codes = [await _code(kv.registrar.ListEngines(registrar_pb2.ListEnginesRequest(), timeout=3)) for _ in range(60)]
        assert codes.count(grpc.StatusCode.OK) >= 15 and grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        await asyncio.sleep(1.0)  # the bucket refills
        assert await _code(kv.registrar.ListEngines(registrar_pb2.ListEnginesRequest(), timeout=3)) == grpc.StatusCode.OK
        streams = [kv.lease.Watch(lease_pb2.WatchLeasesRequest()) for _ in range(3)]
        results = []
        for s in streams:
            try:
                results.append(await asyncio.wait_for(s.read(), 6))
            except grpc.aio.AioRpcError as exc:
                results.append(exc.code())
        assert results.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 1
        for s in streams:
            s.cancel()
    finally:
        await kv.close()
        await cp.stop()
