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


async def open_store(url: str) -> Store:
    """``memory://`` (default) or ``etcd://host:port[,host:port...]``."""
    if not url or url == "memory://" or url == "memory":
        return MemoryStore()
    if url.startswith("etcd://"):
        from .etcd import EtcdStore

        endpoints = [e for e in url[len("etcd://"):].split(",") if e]
        if not endpoints:
            raise ValueError(f"no etcd endpoints in {url!r}")
        return await EtcdStore.connect(endpoints)
    raise ValueError(f"unknown store {url!r}: use memory:// or etcd://host:port[,host:port...]")
