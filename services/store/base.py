"""The storage contract every kvbaton service is written against.

It is the subset of etcd's v3 model the domain logic needs, so that the in-memory
backend (the embedded default) and the etcd backend are interchangeable:

- a flat, ordered key space of ``bytes`` keys and values;
- a store-wide ``revision`` that increases with every write, and per-key
  ``create_revision`` / ``mod_revision`` for compare-and-swap;
- ``txn``: compares, then a list of puts/deletes applied atomically if all compares
  hold (otherwise the ``failure`` ops), the only way the domain modules decide races;
  a branch may also ``Get`` keys (read after that branch's writes), e.g. the current
  value when a compare-and-swap lost;
- TTL leases (``grant_lease``/``keepalive``/``revoke_lease``): keys put under a lease
  vanish when it expires (engine liveness, tombstones);
- prefix watches that resume from a revision (``start_revision``), so a stream that
  reconnects to another replica loses nothing.

Values are opaque bytes (serialized protobuf messages in practice).

The values passed to and from a store (``KeyValue``, ``Compare``, the ops, ``TxnResult``,
``WatchEvent``) are immutable named tuples: a rendezvous match builds about a dozen of
them, and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) costs
two to three times a tuple's.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple


class StoreError(Exception):
    """The backend failed (unreachable, timed out); the operation may be retried."""


class CompactedError(StoreError):
    """A watch asked for a revision the backend no longer keeps; resync from a range."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted (oldest kept: {compact_revision})")
        self.compact_revision = compact_revision


class LeaseNotFoundError(StoreError):
    """The TTL lease does not exist (expired or revoked)."""


class RequestTooLargeError(Exception):
    """A write larger than the backend accepts (etcd: ``--max-request-bytes``, 1.5 MiB by
    default). Not a ``StoreError``: retrying can never succeed, so callers refuse the
    request (INVALID_ARGUMENT) instead of retrying it."""


class KeyValue(NamedTuple):
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0


class CompareTarget(enum.Enum):
    VALUE = "value"
    MOD_REVISION = "mod_revision"
    CREATE_REVISION = "create_revision"
    VERSION = "version"


class CompareOp(enum.Enum):
    EQUAL = "=="
    NOT_EQUAL = "!="
    GREATER = ">"
    LESS = "<"


class Compare(NamedTuple):
    """One condition of a transaction, as in etcd.

    A missing key has ``create_revision == mod_revision == version == 0`` and an empty
    value, so ``Compare(key, CREATE_REVISION, EQUAL, 0)`` means "does not exist".
    """

    key: bytes
    target: CompareTarget
    op: CompareOp
    operand: int | bytes

    @staticmethod
    def absent(key: bytes) -> Compare:
        return Compare(key, CompareTarget.CREATE_REVISION, CompareOp.EQUAL, 0)

    @staticmethod
    def at_revision(key: bytes, mod_revision: int) -> Compare:
        """True while the key was last written at ``mod_revision`` (a cached read's)."""
        return Compare(key, CompareTarget.MOD_REVISION, CompareOp.EQUAL, mod_revision)

    @staticmethod
    def unchanged(kv: KeyValue | None, key: bytes) -> Compare:
        """True while the key is as ``kv`` read it (or still absent if ``kv`` is None)."""
        if kv is None:
            return Compare.absent(key)
        return Compare.at_revision(key, kv.mod_revision)


class Put(NamedTuple):
    key: bytes
    value: bytes
    lease: int = 0


class Delete(NamedTuple):
    key: bytes
    # Delete every key starting with ``key`` when true.
    prefix: bool = False


class Get(NamedTuple):
    """Reads one key inside a transaction (etcd: a Range op), so a failed compare-and-swap
    returns the current value in the same round trip instead of needing another read."""

    key: bytes


Op = Put | Delete | Get


class TxnResult(NamedTuple):
    succeeded: bool
    # Store revision after the transaction (unchanged if nothing was written).
    revision: int
    # One entry per ``Get`` of the branch that ran, in order (None: the key is absent).
    values: tuple[KeyValue | None, ...] = ()


class EventType(enum.Enum):
    PUT = "put"
    DELETE = "delete"


class WatchEvent(NamedTuple):
    type: EventType
    # For DELETE, ``kv.value`` is empty and ``kv.mod_revision`` is the deletion's revision.
    kv: KeyValue
    # The value before this event, when the backend knows it (None for creations).
    prev_kv: KeyValue | None = None

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


class Watch(abc.ABC):
    """An open prefix watch: iterate for batches of events, ``close()`` to stop.

    Events arrive in revision order, each exactly once per watch. A backend that
    loses its connection re-establishes the watch from the last delivered revision
    itself; it raises ``CompactedError`` if that history is gone.
    """

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[list[WatchEvent]]: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


class Store(abc.ABC):
    """The key-value store the domain modules run on. All methods are coroutines."""

    # The largest write request the backend accepts, in bytes (0: no limit of its own).
    max_request_bytes: int = 0
    # Names the store's revision history: a revision means nothing under another
    # incarnation (a restarted embedded store starts again at 1, with nothing in it), so
    # clients that resume by revision start from scratch when it changes. "": unknown.
    incarnation: str = ""

    @abc.abstractmethod
    async def get(self, key: bytes) -> KeyValue | None: ...

    @abc.abstractmethod
    async def range(self, prefix: bytes, *, limit: int = 0) -> tuple[list[KeyValue], int]:
        """Keys starting with ``prefix`` in key order, and the store revision they were read at."""

    @abc.abstractmethod
    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Returns the new store revision."""

    @abc.abstractmethod
    async def delete(self, key: bytes, *, prefix: bool = False) -> int:
        """Returns the number of keys deleted."""

    @abc.abstractmethod
    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
    ) -> TxnResult: ...

    async def txn_batched(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
    ) -> TxnResult:
        """``txn``, for a write that may be committed together with other batched writes
        in one round trip and ONE store revision (etcd: nested transactions in one). Each
        keeps its own compares and outcome. Only for writes no watcher needs to tell apart
        by revision (e.g. ones that produce no subscriber event): resuming "after revision
        R" cannot separate two changes made at R. Backends without batching just ``txn``."""
        return await self.txn(compares, success, failure)

    @abc.abstractmethod
    async def grant_lease(self, ttl_s: float) -> int:
        """A new TTL lease id (the backend may round the TTL up to whole seconds)."""

    @abc.abstractmethod
    async def keepalive(self, lease_id: int) -> float:
        """Refreshes a lease; returns its TTL in seconds. Raises ``LeaseNotFoundError``."""

    @abc.abstractmethod
    async def revoke_lease(self, lease_id: int) -> None:
        """Revokes a lease and deletes its keys (no error if it is already gone)."""

    @abc.abstractmethod
    async def watch(self, prefix: bytes, *, start_revision: int = 0, prev_kv: bool = False) -> Watch:
        """Watches keys under ``prefix``; from ``start_revision`` (inclusive) if non-zero,
        else from now. The returned watch is already established when this returns."""

    async def current_revision(self) -> int:
        _, rev = await self.range(b"\x00__revision_probe__", limit=1)
        return rev

    @abc.abstractmethod
    async def close(self) -> None: ...

    @property
    def name(self) -> str:
        return type(self).__name__


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"
