"""A throwaway certificate authority for tests: a CA, server certificates valid for
127.0.0.1/localhost, and client certificates, written as PEM files.

Made with the ``cryptography`` package (EC P-256, one day of validity); tests that need
it skip when it is missing (``pytest.importorskip`` at the caller).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

if TYPE_CHECKING:
    from kvbaton.stack.security import StackSecurity


@dataclasses.dataclass(frozen=True)
class Pair:
    cert: str
    key: str


class TestCA:
    """``TestCA(dir)``; ``.ca`` is the CA certificate's path; ``server(name)`` and
    ``client(name)`` write a key pair signed by it."""

    __test__ = False  # not a pytest class

    def __init__(self, root: pathlib.Path, name: str = "kvbaton-test-ca") -> None:
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._cert = self._builder(subject, subject, self._key.public_key()).add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(self._key, hashes.SHA256())
        self.ca = self._write(name, self._key, self._cert).cert

    @staticmethod
    def _builder(subject: x509.Name, issuer: x509.Name, public_key: Any) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))

    def _write(self, name: str, key: Any, cert: x509.Certificate) -> Pair:
        kp, cp = self.root / f"{name}.key", self.root / f"{name}.crt"
        kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
        cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return Pair(str(cp), str(kp))

    def _issue(self, name: str, *, server: bool) -> Pair:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        b = self._builder(subject, self._cert.subject, key.public_key()).add_extension(
            x509.BasicConstraints(ca=False, path_length=None), critical=True)
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        return self._write(name, key, b.sign(self._key, hashes.SHA256()))

    def server(self, name: str) -> Pair:
        """For 127.0.0.1 / localhost; also usable as a client certificate (etcd peers)."""
        return self._issue(name, server=True)

    def client(self, name: str) -> Pair:
        return self._issue(name, server=False)


def stack_credentials(root: pathlib.Path, engine_ids: list[str]) -> StackSecurity:
    """Everything a secured stack reads (:class:`kvbaton.stack.security.StackSecurity`),
    laid out as ``deploy/make-certs.sh`` writes it: a CA, the control plane's and etcd's
    server certificates, client certificates and random tokens for each engine, the
    router and the operator, etcd's client certificate for the control plane, and the
    token book scoping each engine's token to its own id."""
    import json
    import secrets

    from kvbaton.stack.security import StackSecurity

    ca = TestCA(root, "ca")
    for who in ("control-plane", "etcd"):
        ca.server(who)
    roles = {**{eid: "engine" for eid in engine_ids}, "router": "router", "operator": "operator"}
    book = []
    for who, role in roles.items():
        ca.client(who)
        token = f"tok-{who}-{secrets.token_hex(16)}"
        (root / f"{who}.token").write_text(token + "\n")
        book.append({"name": who, "role": role, "token": token, **({"engines": [who]} if role == "engine" else {})})
    ca.client("etcd-client")
    (root / "tokens.json").write_text(json.dumps({"tokens": book}))
    return StackSecurity(root)
