"""One way for every client to say how it reaches the control plane securely.

The connector (``control_tls_*`` / ``control_token*`` settings), the router, the
``kvbaton`` CLI and ``kvbaton top`` (``--tls-ca --tls-cert --tls-key --token
--token-file`` flags) all resolve their settings through :meth:`ClientSecurity.resolve`,
which falls back to the same environment variables everywhere:

====================  ============================================================
``KVBATON_TLS_CA``    CA that signed the control plane's certificate (turns TLS on)
``KVBATON_TLS_CERT``  this client's certificate (mutual TLS)
``KVBATON_TLS_KEY``   this client's key (mutual TLS)
``KVBATON_TOKEN``     bearer token (``KVBATON_TOKEN_FILE``: a file holding it)
====================  ============================================================

and build the same channel (TLS credentials) and call credentials (the bearer token on
every call) from them, so a component cannot end up half-configured differently from
the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbaton.client import ClientTls, KvbatonClient

ENV_CA, ENV_CERT, ENV_KEY = "KVBATON_TLS_CA", "KVBATON_TLS_CERT", "KVBATON_TLS_KEY"
ENV_TOKEN, ENV_TOKEN_FILE = "KVBATON_TOKEN", "KVBATON_TOKEN_FILE"


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """TLS files and a bearer token for a control-plane client; empty strings: unset."""

    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    token: str = dataclasses.field(default="", repr=False)  # never logged

    @classmethod
    def resolve(cls, *, tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                token: str | None = None, token_file: str | None = None,
                env: Mapping[str, str] | None = None) -> ClientSecurity:
        """Explicit values win; anything unset falls back to the environment.

        Raises ``ValueError`` for a half-configured client (a certificate without its key,
        a client certificate without a CA, an unreadable token file), so a mistake shows
        at start, not as UNAVAILABLE on the first call.
        """
        env = os.environ if env is None else env
        ca = tls_ca or env.get(ENV_CA, "")
        cert = tls_cert or env.get(ENV_CERT, "")
        key = tls_key or env.get(ENV_KEY, "")
        tok = token or ""
        if not tok and token_file:
            tok = _read_token(token_file)
        if not tok:
            tok = env.get(ENV_TOKEN, "")
        if not tok and env.get(ENV_TOKEN_FILE):
            tok = _read_token(env[ENV_TOKEN_FILE])
        if bool(cert) != bool(key):
            raise ValueError("mutual TLS needs both a client certificate and its key "
                             f"(--tls-cert/--tls-key, ${ENV_CERT}/${ENV_KEY})")
        if cert and not ca:
            raise ValueError(f"a client certificate needs the CA that signed the server (--tls-ca, ${ENV_CA})")
        for what, path in (("CA", ca), ("certificate", cert), ("key", key)):
            if path and not os.path.isfile(path):
                raise ValueError(f"TLS {what} file {path!r} does not exist")
        return cls(tls_ca=ca, tls_cert=cert, tls_key=key, token=tok.strip())

    @property
    def tls(self) -> ClientTls | None:
        from kvbaton.client import ClientTls

        return ClientTls(self.tls_ca, self.tls_cert, self.tls_key) if self.tls_ca else None

    def describe(self) -> str:
        """For logs: what is on, never the token itself."""
        transport = ("mTLS" if self.tls_cert else "TLS") if self.tls_ca else "plaintext"
        return f"{transport}, {'token' if self.token else 'no token'}"

    def client(self, addresses: str | Sequence[str], *, timeout_s: float = 5.0) -> KvbatonClient:
        from kvbaton.client import KvbatonClient

        return KvbatonClient(addresses, timeout_s=timeout_s, tls=self.tls, token=self.token or None)


def _read_token(path: str) -> str:
    try:
        return pathlib.Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read token file {path!r}: {exc.strerror}") from exc


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """The same four (five) flags on every command that talks to the control plane."""
    parser.add_argument("--tls-ca", help=f"CA certificate that signed the server's; turns TLS on (default ${ENV_CA})")
    parser.add_argument("--tls-cert", help=f"client certificate, for mutual TLS (default ${ENV_CERT})")
    parser.add_argument("--tls-key", help=f"client key, for mutual TLS (default ${ENV_KEY})")
    parser.add_argument("--token", help=f"bearer token (default ${ENV_TOKEN})")
    parser.add_argument("--token-file", help=f"file holding the bearer token (default ${ENV_TOKEN_FILE})")


def from_args(args: argparse.Namespace) -> ClientSecurity:
    return ClientSecurity.resolve(tls_ca=getattr(args, "tls_ca", None), tls_cert=getattr(args, "tls_cert", None),
                                  tls_key=getattr(args, "tls_key", None), token=getattr(args, "token", None),
                                  token_file=getattr(args, "token_file", None))
