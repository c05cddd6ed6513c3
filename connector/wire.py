"""Typed, versioned messages between two engines' connectors (NIXL notifications).

Why one module: these bytes cross process and version boundaries. Before, each was a
hand-parsed string (``kvb:done:<tid>``, ``KVBS/C <xfer> ...``) with no version, and the
transfer id was cut at the first ``:`` although ids may contain one. Now every message is

    b"kvb/<version> <kind>\\n" + <JSON object of its fields> [+ b"\\n" + <binary payload>]

JSON quotes any id; block-id arrays that can be large (staged chunks) travel as a
little-endian int64 payload after the JSON line. :func:`decode` checks the version first:
a peer speaking another version (or the old unversioned ``kvb:`` / ``KVBS/`` strings) gets
:class:`WireVersionError`, never a misparse; the receiver logs it and the transfer fails
by its deadline (recompute), exactly like a silent peer.

No vLLM, torch, NIXL or gRPC here (an import contract): numpy only.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import numpy as np

WIRE_VERSION = 1
MAGIC = b"kvb/"
#: Unversioned formats of connectors before this module: refused with a clear error.
LEGACY_PREFIXES = (b"kvb:", b"KVBS/")


class WireError(ValueError):
    """A notification that is not a well-formed kvbaton message."""


class WireVersionError(WireError):
    """A kvbaton message of another protocol version (the peer runs another release)."""


def prefix(kind: str, version: int = WIRE_VERSION) -> bytes:
    """Bytes every message of ``kind`` starts with (for :meth:`NixlEndpoint.on_notif`)."""
    return b"%s%d %s\n" % (MAGIC, version, kind.encode())


@dataclasses.dataclass(frozen=True)
class Message:
    KIND: ClassVar[str] = ""

    def fields(self) -> dict[str, Any]:
        # shallow (every field is a plain value, list or tuple): asdict's deep copy cost
        # ~20 µs per staged chunk and ack on the GPU path's per-chunk critical path
        return dict(self.__dict__)

    def payload(self) -> bytes:
        return b""

    @classmethod
    def build(cls, fields: dict[str, Any], payload: bytes) -> Message:
        return cls(**fields)


# ---------------------------------------------------------------------------- transfers
@dataclasses.dataclass(frozen=True)
class Done(Message):
    """Decode → prefill: done with (or gave up on) ``transfer_id``: free the held blocks.
    Rides on decode's READ (NIXL delivers it after the data) or goes alone.

    ``readers``: how many decode ranks read from the receiving prefill rank (tensor
    parallelism): that rank frees only once a ``Done`` from each of them arrived."""

    KIND: ClassVar[str] = "done"
    transfer_id: str
    readers: int = 1


@dataclasses.dataclass(frozen=True)
class Pushed(Message):
    """Prefill → decode, on the push WRITE (after the data): the blocks are complete.
    ``fingerprints``: the writer's (``verify_kv``), encoded by :class:`Fingerprints`.
    ``nbytes``: what this writer rank wrote into the receiving rank; ``writers``: how many
    prefill ranks write into it (tensor parallelism): the receiving decode rank's blocks
    are complete only once a ``Pushed`` from each of them arrived."""

    KIND: ClassVar[str] = "push"
    transfer_id: str
    nbytes: int
    fingerprints: str = ""
    writers: int = 1


@dataclasses.dataclass(frozen=True)
class ReuseServed(Message):
    """Prefill → decode, on a reuse READ of retained blocks (decode only counts it)."""

    KIND: ClassVar[str] = "reuse"
    conversation_id: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class FpQuestion(Message):
    """Reader → owner (``verify_kv``): your fingerprints of these blocks, please.

    ``key``: ``t:<transfer_id>`` (pull) or ``r:<conversation_id>`` (reuse); ``first``: the
    position of the first id in the owner's record when the reader knows it, else -1."""

    KIND: ClassVar[str] = "fpq"
    key: str
    reader: str
    first: int
    block_ids: tuple[int, ...]

    @classmethod
    def build(cls, fields: dict[str, Any], payload: bytes) -> Message:
        return cls(str(fields["key"]), str(fields["reader"]), int(fields["first"]),
                   tuple(int(b) for b in fields["block_ids"]))


@dataclasses.dataclass(frozen=True)
class FpAnswer(Message):
    """Owner → reader: the fingerprints, or why it cannot vouch for the blocks."""

    KIND: ClassVar[str] = "fpa"
    key: str
    fingerprints: str = ""
    refused: str = ""


# ---------------------------------------------------------------------------- pack path
#: Every staged (pack path) message starts with this (one handler routes them).
STAGED_KIND_PREFIX = "s."


def staged_prefix(version: int = WIRE_VERSION) -> bytes:
    return b"%s%d %s" % (MAGIC, version, STAGED_KIND_PREFIX.encode())


def _ids(a: Any) -> bytes:
    return np.asarray(a, dtype="<i8").tobytes()


@dataclasses.dataclass(frozen=True, eq=False)
class StagedGrantRequest(Message):
    """Sender → receiver: grant me up to ``want`` of your receive slots for ``xfer_id``,
    valid ``ttl_ms``; the transfer's destination block ids travel here, once."""

    KIND: ClassVar[str] = "s.want"
    xfer_id: str
    want: int
    ttl_ms: int
    dst: np.ndarray

    def fields(self) -> dict[str, Any]:
        return {"xfer_id": self.xfer_id, "want": self.want, "ttl_ms": self.ttl_ms}

    def payload(self) -> bytes:
        return _ids(self.dst)

    @classmethod
    def build(cls, fields: dict[str, Any], payload: bytes) -> Message:
        if len(payload) % 8:
            raise WireError("grant request ids are not int64")
        return cls(str(fields["xfer_id"]), int(fields["want"]), int(fields["ttl_ms"]),
                   np.frombuffer(payload, dtype="<i8"))


@dataclasses.dataclass(frozen=True)
class StagedGrant(Message):
    """Receiver → sender: these receive slots are yours for ``xfer_id`` (with where the
    pool is, so a published pool that went stale cannot misdirect a WRITE)."""

    KIND: ClassVar[str] = "s.grant"
    xfer_id: str
    slots: list[int]
    base_addr: int
    slot_bytes: int
    mem_type: str
    device_id: int

    @classmethod
    def build(cls, fields: dict[str, Any], payload: bytes) -> Message:
        slots = [int(x) for x in fields["slots"]]
        if not slots:
            raise WireError("a grant holds at least one slot")
        return cls(str(fields["xfer_id"]), slots, int(fields["base_addr"]), int(fields["slot_bytes"]),
                   str(fields["mem_type"]), int(fields["device_id"]))

    def slot_addr(self, slot: int) -> int:
        return self.base_addr + slot * self.slot_bytes


@dataclasses.dataclass(frozen=True)
class StagedChunk(Message):
    """Sender → receiver, on a chunk's WRITE: regions ``r0..r1`` of the transfer's
    destination ids ``b0..b1`` (sent once, with the grant request or the pull) landed in
    receive slot ``slot``; chunk ``seq`` of ``nchunks``."""

    KIND: ClassVar[str] = "s.chunk"
    xfer_id: str
    slot: int
    seq: int
    nchunks: int
    r0: int
    r1: int
    b0: int
    b1: int


@dataclasses.dataclass(frozen=True)
class StagedAck(Message):
    """Receiver → sender: chunk ``seq`` is scattered; ``keep``: slot ``slot`` is still the
    sender's (else it went back to the receiver's pool: never write it again)."""

    KIND: ClassVar[str] = "s.ack"
    xfer_id: str
    slot: int
    seq: int
    keep: bool = True


@dataclasses.dataclass(frozen=True)
class StagedRelease(Message):
    """Sender → receiver: give the rest of my grant back (aborted, nothing in flight)."""

    KIND: ClassVar[str] = "s.release"
    xfer_id: str


@dataclasses.dataclass(frozen=True)
class StagedDeny(Message):
    """Receiver → sender: no grant (the receiver gave up on the transfer)."""

    KIND: ClassVar[str] = "s.deny"
    xfer_id: str
    reason: str = ""


@dataclasses.dataclass(frozen=True, eq=False)
class StagedPull(Message):
    """Reader → owner: push blocks ``src`` into my ``dst`` (the staged form of a READ); my
    grant of receive slots for it follows as a :class:`StagedGrant`."""

    KIND: ClassVar[str] = "s.pull"
    xfer_id: str
    src: np.ndarray
    dst: np.ndarray

    def fields(self) -> dict[str, Any]:
        return {"xfer_id": self.xfer_id, "n": int(len(self.src))}

    def payload(self) -> bytes:
        return _ids(self.src) + _ids(self.dst)

    @classmethod
    def build(cls, fields: dict[str, Any], payload: bytes) -> Message:
        if len(payload) % 8:
            raise WireError("staged pull ids are not int64")
        ids = np.frombuffer(payload, dtype="<i8")
        n = int(fields["n"])
        if ids.shape[0] != 2 * n:
            raise WireError(f"staged pull carries {ids.shape[0]} ids, expected {2 * n}")
        return cls(str(fields["xfer_id"]), ids[:n].copy(), ids[n:].copy())


KINDS: dict[str, type[Message]] = {c.KIND: c for c in (Done, Pushed, ReuseServed, FpQuestion, FpAnswer,
                                                      StagedGrantRequest, StagedGrant, StagedChunk, StagedAck,
                                                      StagedRelease, StagedDeny, StagedPull)}


def encode(msg: Message) -> bytes:
    head = prefix(msg.KIND) + json.dumps(msg.fields(), separators=(",", ":")).encode()
    body = msg.payload()
    return head + b"\n" + body if body else head


def version_of(raw: bytes) -> int | None:
    """The protocol version a notification claims (0: an unversioned legacy one), or None
    when it is not a kvbaton message at all."""
    if raw.startswith(LEGACY_PREFIXES):
        return 0
    if not raw.startswith(MAGIC):
        return None
    head = raw[len(MAGIC):raw.find(b" ", len(MAGIC))]
    return int(head) if head.isdigit() else 0


def decode(raw: bytes) -> Message:
    """The message in ``raw``; :class:`WireVersionError` for another version, :class:`WireError`
    for anything malformed."""
    v = version_of(raw)
    if v is None:
        raise WireError(f"not a kvbaton message: {raw[:40]!r}")
    if v != WIRE_VERSION:
        what = "the unversioned pre-release format" if v == 0 else f"version {v}"
        raise WireVersionError(f"peer speaks kvbaton wire {what}, this engine speaks version {WIRE_VERSION}: "
                               f"refused (run the same kvbaton release on both engines)")
    line, _, rest = raw.partition(b"\n")
    kind = line.split(b" ", 1)[1].decode(errors="replace") if b" " in line else ""
    cls = KINDS.get(kind)
    if cls is None:
        raise WireError(f"unknown kvbaton message kind {kind!r}")
    js, _, payload = rest.partition(b"\n")
    try:
        fields = json.loads(js)
        if not isinstance(fields, dict):
            raise TypeError("fields are not an object")
        return cls.build(fields, payload)
    except (ValueError, TypeError, KeyError) as exc:
        raise WireError(f"malformed kvbaton {kind} message: {exc}") from None
