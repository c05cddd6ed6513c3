"""Storage backends behind one interface (see ``base``): memory (default) and etcd."""

from __future__ import annotations

from .base import (
    CompactedError,
    Compare,
    CompareOp,
    CompareTarget,
    Delete,
    EventType,
    Get,
    KeyValue,
    LeaseNotFoundError,
    Put,
    RequestTooLargeError,
    Store,
    StoreError,
    TxnResult,
    Watch,
    WatchEvent,
    prefix_end,
)
from .memory import MemoryStore

__all__ = [
    "CompactedError", "Compare", "CompareOp", "CompareTarget", "Delete", "EventType", "Get", "KeyValue",
    "LeaseNotFoundError", "MemoryStore", "Put", "RequestTooLargeError", "Store", "StoreError", "TxnResult", "Watch",
    "WatchEvent", "open_store", "prefix_end",
]


async def open_store(url: str, *, etcd_ca: str = "", etcd_cert: str = "", etcd_key: str = "",
                     timeout_s: float = 10.0) -> Store:
    """``memory://`` (default), ``etcd://host:port[,host:port...]`` (plaintext) or
    ``etcds://host:port[,...]`` (TLS: ``etcd_ca`` verifies etcd, ``etcd_cert``/``etcd_key``
    are the client certificate for etcd's ``--client-cert-auth``; each defaults to
    ``$KVBATON_ETCD_CA`` / ``_CERT`` / ``_KEY``). A CA given with ``etcd://`` also turns TLS on.
    ``timeout_s``: how long each etcd operation, connecting included, may retry before it
    raises ``StoreError``."""
    import os

    if not url or url == "memory://" or url == "memory":
        return MemoryStore()
    scheme, sep, rest = url.partition("://")
    if sep and scheme in ("etcd", "etcds"):
        from .etcd import EtcdStore, EtcdTls

        endpoints = [e for e in rest.split(",") if e]
        if not endpoints:
            raise ValueError(f"no etcd endpoints in {url!r}")
        ca = etcd_ca or os.environ.get("KVBATON_ETCD_CA", "")
        cert = etcd_cert or os.environ.get("KVBATON_ETCD_CERT", "")
        key = etcd_key or os.environ.get("KVBATON_ETCD_KEY", "")
        if scheme == "etcds" and not ca:
            raise ValueError(f"{url!r} is TLS: pass --etcd-ca (or $KVBATON_ETCD_CA), the CA that signed etcd's certificate")
        if bool(cert) != bool(key):
            raise ValueError("an etcd client certificate needs its key (--etcd-cert/--etcd-key)")
        for what, path in (("CA", ca), ("certificate", cert), ("key", key)):
            if path and not os.path.isfile(path):
                raise ValueError(f"etcd TLS {what} file {path!r} does not exist")
        tls = EtcdTls(ca, cert, key) if ca else None
        return await EtcdStore.connect(endpoints, tls=tls, timeout_s=timeout_s)
    raise ValueError(f"unknown store {url!r}: use memory://, etcd://host:port[,host:port...] or etcds://...")
