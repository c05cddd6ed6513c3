"""Renewal journal: one store record per batch of lease renewals.

Why: a KeepAlive message of 10,000 renewals that each rewrote its lease's record cost
10,000 compare-and-swaps, store events and cache updates (~30 µs each here). Instead the
flusher writes ONE record per batch — ``<prefix>j/<writer>-<seq>`` holding lease id →
new deadline — and every replica merges the journal into what it reads as a lease's
deadline: ``max(record.expires_at_ms, journal deadline)``. The lease record's own
deadline is therefore conservative (never later than the truth), so a reader that misses
the journal can only end a lease late, never early.

Fences (two keys nobody watches; only their ``mod_revision`` matters):

- every write that ends a lease or makes it DRAINING also puts ``<prefix>f/ends``; a
  journal write commits only if ``f/ends`` did not change after the revision of the cache
  the renewals were checked against (so an acknowledged renewal is never of a lease that
  had already ended);
- every journal write also puts ``<prefix>f/renewals``; the expiry leader's end commits
  only if ``f/renewals`` did not change after the revision its journal view has applied
  (so it never ends a lease whose renewal it has not seen).

Garbage: a record is deletable once it holds no lease's latest deadline (every entry
superseded by a later record, or its lease ended) or once its latest deadline is past
(a deadline in the past says nothing a lease's own record does not: the lease is due
either way). The expiry leader deletes such records; a replica that starts (or a new
leader taking over) reads the records left and so never expires a lease early.

Record value: the lease ids, newline-separated ASCII, a NUL, then the deadlines as
little-endian int64 (``array('q')``): encoding and decoding 10,000 entries stays in C.
"""

from __future__ import annotations

import array
import sys
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from itertools import compress, repeat
from operator import lt
from typing import NamedTuple

from .deadlines import DeadlineIndex

# Entries per record: 32,768 × ~25 bytes stays well under etcd's 1.5 MiB request limit.
MAX_ENTRIES = 32_768
_BIG_ENDIAN = sys.byteorder == "big"
# A past-deadline record whose delete has not come back yet is offered again after this.
_RETRY_DELETE_MS = 1_000


class JournalBatch(NamedTuple):
    ids: list[str]
    deadlines: array.array


def encode(ids: Sequence[str], deadlines: Sequence[int]) -> bytes:
    dl = array.array("q", deadlines)
    if _BIG_ENDIAN:
        dl.byteswap()
    return "\n".join(ids).encode() + b"\0" + dl.tobytes()


def decode(value: bytes) -> JournalBatch:
    head, sep, tail = value.partition(b"\0")
    dl = array.array("q")
    if not sep or len(tail) % 8:
        return JournalBatch([], dl)  # not a journal record: contributes nothing
    dl.frombytes(tail)
    if _BIG_ENDIAN:
        dl.byteswap()
    ids = head.decode().split("\n") if head else []
    if len(ids) != len(dl):
        return JournalBatch([], array.array("q"))
    return JournalBatch(ids, dl)


class LeaseJournal:
    """One replica's merge of the journal records it has seen (fed by a watch).

    ``deadline[lease_id]`` is the latest journal deadline known for a lease (also raised
    at once by this replica's own successful writes, before the watch brings them back).
    Records are reference-counted by the leases whose latest deadline they hold, so the
    ones that hold none can be deleted.

    A record holds up to 32,768 entries and every KeepAlive flush writes one, so the
    common case (every entry new to this view or later than what it held, no duplicates)
    is merged with dictionary bulk operations run in C (``update``, ``map``, ``Counter``)
    rather than a Python statement per entry; anything else takes the per-entry loop."""

    def __init__(self) -> None:
        self.deadline: dict[str, int] = {}
        # lease id -> the latest deadline the records seen hold, and the record holding it
        self._owner_dl: dict[str, int] = {}
        self._owner_key: dict[str, bytes] = {}
        self._ids: dict[bytes, list[str]] = {}  # record key -> its lease ids
        self._live: dict[bytes, int] = {}  # record key -> entries it still owns
        self.dead: set[bytes] = set()  # records that own nothing: deletable
        self._latest: DeadlineIndex[bytes] = DeadlineIndex()  # record key -> its latest deadline
        # This replica's own records already merged into ``deadline`` by ``note`` (their
        # watch event then skips that pass); each leaves when its event is applied.
        self._noted: set[bytes] = set()

    def __len__(self) -> int:
        """Records held."""
        return len(self._ids)

    def note(self, ids: Sequence[str], deadlines: Sequence[int], key: bytes | None = None, *,
             unique: bool = False) -> None:
        """This replica's own write (of record ``key``) just committed: read your writes
        before the watch. ``unique``: each lease is named once (no need to check)."""
        _raise(self.deadline, ids, deadlines, unique=unique)
        if key is not None:
            self._noted.add(key)

    def apply_put(self, key: bytes, batch: JournalBatch, revision: int,
                  ended: Callable[[list[str]], Collection[str]] | None = None) -> None:
        """A record was written. ``ended(lease_ids)`` (when the caller's lease cache is at
        least as new as ``revision``) says which of those leases have already ended: their
        entries are dead."""
        if key in self._ids:
            self.apply_delete(key)  # rewritten (not done by kvbaton): replace what it held
        ids, dls = batch.ids, batch.deadlines
        noted = key in self._noted
        self._noted.discard(key)
        prev = list(map(self._owner_dl.get, ids, repeat(-1, len(ids))))
        # (An own record names each lease once: its flush wrote unique ids.)
        if (noted or len(set(ids)) == len(ids)) and all(map(lt, prev, dls)):
            live = self._put_bulk(key, ids, dls, prev, ended, noted=noted)
        else:
            live = self._put_each(key, ids, dls, ended)
        self._ids[key] = ids
        self._live[key] = live
        if not live:
            self.dead.add(key)
        if ids:
            self._latest.arm(key, max(dls), revision)

    def _put_bulk(self, key: bytes, ids: list[str], dls: Sequence[int], prev: list[int],
                  ended: Callable[[list[str]], Collection[str]] | None, *, noted: bool = False) -> int:
        """Every entry is later than what this view held (or new), each lease once.
        ``noted``: ``deadline`` already holds these entries (this replica's own write)."""
        owner_key = self._owner_key
        gone: Collection[str] = ()
        if ended is not None:
            new = list(compress(ids, map(lt, prev, repeat(0, len(ids)))))
            gone = ended(new) if new else ()
        if gone:
            keep = [lid not in gone for lid in ids]
            ids, dls = list(compress(ids, keep)), list(compress(dls, keep))
        superseded: Counter[bytes | None] = Counter(map(owner_key.get, ids))
        superseded.pop(None, None)
        for old, n in superseded.items():
            if old is not None:
                self._release(old, n)
        owner_key.update(dict.fromkeys(ids, key))
        self._owner_dl.update(zip(ids, dls))
        if not noted:
            _raise(self.deadline, ids, dls)
        return len(ids)

    def _put_each(self, key: bytes, ids: list[str], dls: Sequence[int],
                  ended: Callable[[list[str]], Collection[str]] | None) -> int:
        owner_dl, owner_key, known = self._owner_dl, self._owner_key, self.deadline
        gone = ended([lid for lid in ids if lid not in owner_key]) if ended is not None else ()
        live = 0
        for lid, dl in zip(ids, dls):
            cur = owner_dl.get(lid)
            if cur is not None:
                if cur >= dl:
                    continue
                self._release(owner_key[lid])  # superseded there
            elif lid in gone:
                continue
            owner_dl[lid] = dl
            owner_key[lid] = key
            live += 1
            if known.get(lid, 0) < dl:
                known[lid] = dl
        return live

    def apply_delete(self, key: bytes) -> None:
        owner_dl, owner_key, known = self._owner_dl, self._owner_key, self.deadline
        ids = self._ids.pop(key, ())
        if self._live.get(key) == 0:
            # It holds no lease's latest deadline (the usual record deleted: superseded by a
            # later batch of the same renewals): nothing points at it, no per-entry pass.
            ids = ()
        for lid in ids:
            if owner_key.get(lid) == key:
                dl = owner_dl.pop(lid)
                del owner_key[lid]
                if known.get(lid) == dl:
                    del known[lid]
        self._live.pop(key, None)
        self.dead.discard(key)
        self._latest.drop(key)

    def forget(self, lease_id: str) -> None:
        """The lease ended: its entries say nothing any more."""
        self.deadline.pop(lease_id, None)
        self._owner_dl.pop(lease_id, None)
        key = self._owner_key.pop(lease_id, None)
        if key is not None:
            self._release(key)

    def _release(self, key: bytes, n: int = 1) -> None:
        """``n`` entries of record ``key`` no longer hold their lease's latest deadline."""
        left = self._live.get(key)
        if left is not None:
            self._live[key] = left - n
            if left - n <= 0:
                self.dead.add(key)

    def deletable(self, now_ms: int, limit: int) -> list[bytes]:
        """Up to ``limit`` records to delete: those owning nothing, then those whose latest
        deadline is past. They stay held until their deletion comes back from the watch
        (a failed delete is simply found again on the next call)."""
        out = list(self.dead)[:limit]
        popped: list[tuple[bytes, int]] = []
        if len(out) < limit:
            for key, version in self._latest.pop_due(now_ms):
                popped.append((key, version))
                if key not in self.dead:
                    out.append(key)
                if len(out) >= limit:
                    break
        for key, version in popped:
            self._latest.arm(key, now_ms + _RETRY_DELETE_MS, version)  # until the delete is seen
        return out

    def clear(self) -> None:
        self.deadline.clear()
        self._noted.clear()
        self._owner_dl.clear()
        self._owner_key.clear()
        self._ids.clear()
        self._live.clear()
        self.dead.clear()
        self._latest.clear()


def _raise(known: dict[str, int], ids: Sequence[str], deadlines: Sequence[int], *, unique: bool = False) -> None:
    """``known[id] = max(known[id], deadline)`` for each entry: one C-level update when
    every deadline is later (the usual case: renewals only move deadlines on)."""
    if (unique or len(set(ids)) == len(ids)) and all(map(lt, map(known.get, ids, repeat(0, len(ids))), deadlines)):
        known.update(zip(ids, deadlines))
        return
    for lid, dl in zip(ids, deadlines):
        if known.get(lid, 0) < dl:
            known[lid] = dl
