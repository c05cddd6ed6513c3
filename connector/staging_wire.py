"""Typed, versioned messages of the pack path's slot-grant protocol (NIXL notifications).

Why a protocol at all: a staged WRITE lands in the *receiver's* staging slots, and a
one-sided WRITE cannot be refused once posted. So the receiver decides which of its slots
a sender may use (a grant), and a sender writes only into slots it holds. Any number of
senders into one receiver is then safe by construction.

Every message is ``KVBS/<kind><version> <space-separated header>[\\n<binary body>]``. The
version is part of the prefix so that a peer running another version is refused with a
clear error (:class:`WireError`) instead of being misparsed. Ids are little-endian int64.

=========  =============================================================================
``Q``      sender → receiver: please grant me up to ``want`` slots for ``xfer`` (ttl);
           carries the transfer's destination block ids, once
``G``      receiver → sender: these slots of my pool (base/slot size/memory) are yours
``C``      sender → receiver (the WRITE's own notification, after its data): chunk
           ``seq`` of ``nchunks`` in ``slot``: regions ``r0..r1`` of the transfer's
           destination ids ``b0..b1`` (from its ``Q`` or ``P``; no ids per chunk)
``A``      receiver → sender: chunk in ``slot`` scattered; ``keep`` = the slot is still
           yours (0: it went back to the receiver's pool: do not write it again)
``R``      sender → receiver: release the rest of my grant (transfer aborted, nothing of
           mine in flight)
``D``      receiver → sender: grant refused (the receiver gave up on ``xfer``)
``P``      reader → owner: push blocks ``src`` of yours into my blocks ``dst`` (a staged
           READ); the reader's grant for it follows as a ``G``
=========  =============================================================================
"""

from __future__ import annotations

import dataclasses

import numpy as np

PREFIX = b"KVBS/"
VERSION = 1


class WireError(ValueError):
    """A staging message that cannot be decoded (malformed, or another protocol version)."""


def _ids(body: bytes, what: str) -> np.ndarray:
    if len(body) % 8:
        raise WireError(f"{what}: id body of {len(body)} bytes is not a multiple of 8")
    return np.frombuffer(body, dtype="<i8")


def _xid(x: str) -> str:
    if not x or any(c.isspace() for c in x):
        raise ValueError(f"transfer id must be non-empty without whitespace: {x!r}")
    return x


@dataclasses.dataclass(frozen=True)
class GrantRequest:
    xfer_id: str
    want: int
    ttl_ms: int
    dst_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    KIND = b"Q"

    def encode(self) -> bytes:
        return (_head(self.KIND, f"{_xid(self.xfer_id)} {int(self.want)} {int(self.ttl_ms)}")
                + b"\n" + np.asarray(self.dst_ids).astype("<i8", copy=False).tobytes())

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, GrantRequest) and (self.xfer_id, self.want, self.ttl_ms)
                == (other.xfer_id, other.want, other.ttl_ms)
                and np.array_equal(self.dst_ids, other.dst_ids))


@dataclasses.dataclass(frozen=True)
class Grant:
    """Slots of the receiver's pool, with where that pool is (so the sender needs nothing
    else: a pool published elsewhere may be stale)."""

    xfer_id: str
    slots: tuple[int, ...]
    base_addr: int
    slot_bytes: int
    mem_type: str
    device_id: int
    KIND = b"G"

    def encode(self) -> bytes:
        if not self.slots:
            raise ValueError("a grant holds at least one slot")
        s = ",".join(str(int(x)) for x in self.slots)
        return _head(self.KIND, f"{_xid(self.xfer_id)} {int(self.base_addr)} {int(self.slot_bytes)} "
                                f"{self.mem_type} {int(self.device_id)} {s}")

    def slot_addr(self, slot: int) -> int:
        return self.base_addr + slot * self.slot_bytes


@dataclasses.dataclass(frozen=True)
class Chunk:
    xfer_id: str
    slot: int
    seq: int
    nchunks: int
    r0: int
    r1: int
    b0: int
    b1: int
    KIND = b"C"

    def encode(self) -> bytes:
        return _head(self.KIND, f"{_xid(self.xfer_id)} {self.slot} {self.seq} {self.nchunks} "
                                f"{self.r0} {self.r1} {self.b0} {self.b1}")


@dataclasses.dataclass(frozen=True)
class Ack:
    xfer_id: str
    slot: int
    seq: int
    keep: bool
    KIND = b"A"

    def encode(self) -> bytes:
        return _head(self.KIND, f"{_xid(self.xfer_id)} {self.slot} {self.seq} {int(self.keep)}")


@dataclasses.dataclass(frozen=True)
class Release:
    xfer_id: str
    KIND = b"R"

    def encode(self) -> bytes:
        return _head(self.KIND, _xid(self.xfer_id))


@dataclasses.dataclass(frozen=True)
class Deny:
    xfer_id: str
    reason: str
    KIND = b"D"

    def encode(self) -> bytes:
        return _head(self.KIND, f"{_xid(self.xfer_id)} {self.reason.replace(chr(10), ' ')}")


@dataclasses.dataclass(frozen=True)
class Pull:
    xfer_id: str
    src_ids: np.ndarray
    dst_ids: np.ndarray
    KIND = b"P"

    def encode(self) -> bytes:
        src, dst = np.asarray(self.src_ids), np.asarray(self.dst_ids)
        if src.shape != dst.shape:
            raise ValueError("pull: source and destination id counts differ")
        return (_head(self.KIND, f"{_xid(self.xfer_id)} {src.shape[0]}") + b"\n"
                + src.astype("<i8", copy=False).tobytes() + dst.astype("<i8", copy=False).tobytes())


Message = GrantRequest | Grant | Chunk | Ack | Release | Deny | Pull


def _head(kind: bytes, text: str) -> bytes:
    return PREFIX + kind + str(VERSION).encode() + b" " + text.encode()


def decode(msg: bytes) -> Message:
    """Parse one staging notification; :class:`WireError` when it is not a valid one."""
    if not msg.startswith(PREFIX) or len(msg) < len(PREFIX) + 3:
        raise WireError(f"not a staging message: {msg[:24]!r}")
    kind = msg[len(PREFIX):len(PREFIX) + 1]
    sp = msg.find(b" ", len(PREFIX))
    if sp < 0:
        raise WireError(f"staging message without a header: {msg[:24]!r}")
    ver = msg[len(PREFIX) + 1:sp]
    if ver != str(VERSION).encode():
        raise WireError(f"staging message {kind!r} of protocol version {ver!r}; this engine speaks "
                        f"{VERSION} (mixed kvbaton versions?)")
    head, _nl, body = msg[sp + 1:].partition(b"\n")
    try:
        f = head.decode().split()
        if kind == b"Q":
            return GrantRequest(f[0], int(f[1]), int(f[2]), _ids(body, "grant request"))
        if kind == b"G":
            return Grant(f[0], tuple(int(x) for x in f[5].split(",")), int(f[1]), int(f[2]), f[3],
                         int(f[4]))
        if kind == b"C":
            if len(f) != 8:
                raise WireError(f"malformed staging message b'C': {len(f)} fields, 8 expected")
            return Chunk(f[0], *(int(x) for x in f[1:8]))
        if kind == b"A":
            return Ack(f[0], int(f[1]), int(f[2]), f[3] == "1")
        if kind == b"R":
            return Release(f[0])
        if kind == b"D":
            return Deny(f[0], " ".join(f[1:]))
        if kind == b"P":
            ids = _ids(body, "pull")
            n = int(f[1])
            if ids.shape[0] != 2 * n:
                raise WireError(f"pull of {n} blocks carries {ids.shape[0]} ids")
            return Pull(f[0], ids[:n].copy(), ids[n:].copy())
    except (IndexError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, WireError):
            raise
        raise WireError(f"malformed staging message {kind!r}: {e}") from e
    raise WireError(f"unknown staging message kind {kind!r}")
