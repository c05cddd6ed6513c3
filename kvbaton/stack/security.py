"""Mutual TLS and bearer tokens for every process a stack starts, from one directory of
credentials laid out the way ``deploy/make-certs.sh`` writes it.

Why a directory and not objects: the deploy script, a test's throwaway CA and an
operator's own PKI all end up as files; naming them by role keeps every launcher (the
P/D stack, the fleet) configuring the control plane, the engines' connectors, the routers
and the CLI from the same place, so a secured stack cannot be half configured.

Layout (``NAME`` is an engine id, ``router`` or ``operator``)::

    ca.crt                       the CA every certificate below is signed by
    control-plane.crt/.key       the control plane's server certificate (127.0.0.1)
    etcd-client.crt/.key         the control plane's client certificate towards etcd
    NAME.crt/.key                a client certificate per engine, router and operator
    NAME.token                   that identity's bearer token
    tokens.json                  the control plane's token book (``kvbaton serve --tokens``)

The stack only reads these files; making them is the caller's business (the deploy
script, or the tests' certificate authority).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbaton.client import KvbatonClient
    from kvbaton.stack.etcd_cluster import EtcdServerTls

__all__ = ["StackSecurity"]


@dataclasses.dataclass(frozen=True)
class StackSecurity:
    """Credentials of a stack, by role, in the directory ``pki``."""

    pki: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "pki", Path(self.pki))
        missing = [n for n in ("ca.crt", "control-plane.crt", "control-plane.key", "tokens.json")
                   if not (self.pki / n).is_file()]
        if missing:
            raise ValueError(f"stack credentials in {self.pki} lack {', '.join(missing)}")

    @property
    def ca(self) -> str:
        return str(self.pki / "ca.crt")

    def cert(self, who: str) -> str:
        return str(self.pki / f"{who}.crt")

    def key(self, who: str) -> str:
        return str(self.pki / f"{who}.key")

    def token_file(self, who: str) -> str:
        return str(self.pki / f"{who}.token")

    def token(self, who: str) -> str:
        return Path(self.token_file(who)).read_text().strip()

    # ------------------------------------------------------------------ per process
    def serve_args(self, store: str = "") -> list[str]:
        """``kvbaton serve`` flags: server certificate, client certificates required
        (mutual TLS), the token book; on an ``etcds://`` store, the etcd client's."""
        args = ["--tls-cert", self.cert("control-plane"), "--tls-key", self.key("control-plane"),
                "--tls-client-ca", self.ca, "--tokens", str(self.pki / "tokens.json")]
        if store.startswith("etcds://"):
            args += ["--etcd-ca", self.ca, "--etcd-cert", self.cert("etcd-client"),
                     "--etcd-key", self.key("etcd-client")]
        return args

    def client_args(self, who: str, *, token: bool = True) -> list[str]:
        """The client flags the router, ``kvbaton`` CLI and ``kvbaton top`` take."""
        args = ["--tls-ca", self.ca, "--tls-cert", self.cert(who), "--tls-key", self.key(who)]
        return [*args, "--token-file", self.token_file(who)] if token else args

    def connector_config(self, engine_id: str) -> dict[str, Any]:
        """``kv_connector_extra_config`` keys of an engine's connector."""
        return {"control_tls_ca": self.ca, "control_tls_cert": self.cert(engine_id),
                "control_tls_key": self.key(engine_id), "control_token_file": self.token_file(engine_id)}

    def etcd_server(self) -> EtcdServerTls:
        """TLS for a local etcd (:class:`~kvbaton.stack.etcd_cluster.EtcdCluster`): its
        server certificate, client certificates required from this CA."""
        from kvbaton.stack.etcd_cluster import EtcdServerTls

        return EtcdServerTls(self.ca, self.cert("etcd"), self.key("etcd"), self.cert("etcd-client"),
                             self.key("etcd-client"))

    @staticmethod
    def child_env() -> dict[str, str]:
        """This environment without ``KVBATON_TLS_*`` / ``KVBATON_TOKEN*``: a child gets
        exactly the credentials its flags name, never the caller's."""
        return {k: v for k, v in os.environ.items() if not k.startswith(("KVBATON_TLS_", "KVBATON_TOKEN"))}

    def client(self, who: str, addresses: str | Sequence[str], *, timeout_s: float = 5.0) -> KvbatonClient:
        """An async control-plane client with ``who``'s certificate and token."""
        from kvbaton.security import ClientSecurity

        return ClientSecurity.resolve(tls_ca=self.ca, tls_cert=self.cert(who), tls_key=self.key(who),
                                      token=self.token(who), env={}).client(addresses, timeout_s=timeout_s)
