"""Which rank moves which KV heads to which rank, between engines of different TP sizes.

A :class:`TpMapping` is computed once per (owner engine, receiver engine) pair from what both
published to the registrar (:class:`kvbaton.kvgeometry.EngineKv`), and answers, for every
block of a request and every region (layer, or layer and K/V):

* which owner rank(s) a receiver rank gets its heads from (pull and reuse: whom it READs;
  push: who WRITEs into it, hence how many notifications it waits for — :meth:`writers_of`);
* which slice of the block that is, at which byte offset on each side (:class:`HeadSlice`);
* which owner ranks write at all (:attr:`TpMapping.writer_ranks`: the rendezvous expects one
  outcome from each).

Every (receiver rank, head) pair gets exactly one source, so every head lands exactly once
on every receiver rank that holds it, and the bytes add up to the receiver's whole KV. When
heads are replicated (more ranks than KV heads), sources are spread over the replicas
(receiver replica ``i`` of a head reads owner replica ``i mod n``), so equal TP sizes map
rank ``r`` to rank ``r`` and nothing moves twice. Heads that share a source and are adjacent
on both sides become one slice: one byte range per block per region.

The owner is whichever side holds the KV: prefill for push and pull, decode for reuse.
The rules of what is mappable live in :mod:`kvbaton.kvgeometry` (shared with the control
plane, which refuses a pair before any transfer); :func:`compute_tp_mapping` raises
:class:`~kvbaton.kvgeometry.KvIncompatible` for exactly the pairs the control plane refuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvbaton.kvgeometry import EngineKv, KvIncompatible, check_compatible, source_rank

__all__ = ["HeadSlice", "KvIncompatible", "TpMapping", "compute_tp_mapping"]


@dataclasses.dataclass(frozen=True)
class HeadSlice:
    """Heads ``[first_head, first_head + num_heads)`` of every block move from owner rank
    ``src_rank`` to receiver rank ``dst_rank``: ``nbytes`` at ``src_offset`` inside the owner's
    block land at ``dst_offset`` inside the receiver's block (the same in every region)."""

    src_rank: int
    dst_rank: int
    first_head: int
    num_heads: int
    src_offset: int
    dst_offset: int
    nbytes: int
    #: The slice is a whole block on both sides (one descriptor per block run, any layout).
    whole_block: bool = False


@dataclasses.dataclass(frozen=True)
class TpMapping:
    """The per-rank plan for one owner/receiver engine pair (see the module docstring)."""

    src: EngineKv
    dst: EngineKv
    slices: tuple[HeadSlice, ...]

    @property
    def writer_ranks(self) -> tuple[int, ...]:
        """Owner ranks that move anything (ascending): in push, the ranks that report."""
        return tuple(sorted({s.src_rank for s in self.slices}))

    def into(self, dst_rank: int) -> list[HeadSlice]:
        """What receiver rank ``dst_rank`` gets, in head order (pull/reuse: what it READs)."""
        self._check_rank(dst_rank, self.dst.tp_size, "receiver")
        return [s for s in self.slices if s.dst_rank == dst_rank]

    def out_of(self, src_rank: int) -> list[HeadSlice]:
        """What owner rank ``src_rank`` sends, by receiver rank (push: what it WRITEs)."""
        self._check_rank(src_rank, self.src.tp_size, "owner")
        return [s for s in self.slices if s.src_rank == src_rank]

    def writers_of(self, dst_rank: int) -> int:
        """How many owner ranks write into ``dst_rank`` (push notifications it waits for)."""
        return len({s.src_rank for s in self.into(dst_rank)})

    def readers_of(self, src_rank: int) -> int:
        """How many receiver ranks read from ``src_rank`` (pull: done-notices it waits for
        before freeing the request's blocks)."""
        return len({s.dst_rank for s in self.out_of(src_rank)})

    def bytes_into(self, dst_rank: int, num_blocks: int) -> int:
        """Bytes ``dst_rank`` receives for ``num_blocks`` blocks, over all regions."""
        return sum(s.nbytes for s in self.into(dst_rank)) * num_blocks * self.dst.num_regions

    def bytes_out_of(self, src_rank: int, num_blocks: int) -> int:
        """Bytes ``src_rank`` sends for ``num_blocks`` blocks, over all regions."""
        return sum(s.nbytes for s in self.out_of(src_rank)) * num_blocks * self.src.num_regions

    def request_bytes(self, num_blocks: int) -> int:
        """The request's KV on the receiving engine: every rank's blocks, every region."""
        return self.dst.bytes_per_block * num_blocks * self.dst.num_regions * self.dst.tp_size

    def extents(self, piece: HeadSlice, src_blocks: list[int] | tuple[int, ...],
                dst_blocks: list[int] | tuple[int, ...], src_stride: int,
                dst_stride: int) -> Iterator[tuple[int, int, int]]:
        """``(src_offset, dst_offset, nbytes)`` from the start of a region, one per block
        pair (the caller adds each side's region base, and coalesces runs if it likes)."""
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} owner blocks for {len(dst_blocks)} receiver blocks")
        for sb, db in zip(src_blocks, dst_blocks, strict=True):
            yield sb * src_stride + piece.src_offset, db * dst_stride + piece.dst_offset, piece.nbytes

    def descs(self, piece: HeadSlice, src_layout: Any, src_blocks: Sequence[int], dst_layout: Any,
              dst_blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """NIXL descriptor rows ``[addr, nbytes, device_id]`` (uint64, region-major, row i of
        one side paired with row i of the other) moving ``piece`` of every block pair.

        The layouts are the two ranks' ``KvLayout`` (duck-typed: ``region_base_addrs``,
        ``block_stride_bytes``, ``bytes_per_block``, ``device_id``). A whole-block piece
        between densely packed regions is coalesced into runs of consecutive ids on both
        sides; a head slice is one row per block per region (its bytes are strided)."""
        s = np.asarray(src_blocks, dtype=np.int64)
        d = np.asarray(dst_blocks, dtype=np.int64)
        if s.shape != d.shape or s.ndim != 1:
            raise ValueError(f"{s.shape} owner blocks for {d.shape} receiver blocks")
        n = np.full(s.shape, piece.nbytes, dtype=np.int64)
        dense = (src_layout.block_stride_bytes == src_layout.bytes_per_block
                 and dst_layout.block_stride_bytes == dst_layout.bytes_per_block)
        if piece.whole_block and dense and s.size > 1:
            brk = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
            starts = np.concatenate(([0], brk))
            lengths = np.diff(np.concatenate((starts, [s.size])))
            s, d, n = s[starts], d[starts], lengths * piece.nbytes
        out = []
        for layout, ids, off in ((src_layout, s, piece.src_offset), (dst_layout, d, piece.dst_offset)):
            bases = np.asarray(layout.region_base_addrs, dtype=np.int64)[:, None]
            addr = bases + ids[None, :] * int(layout.block_stride_bytes) + off
            rows = np.empty((addr.size, 3), dtype=np.uint64)
            rows[:, 0] = addr.ravel()
            rows[:, 1] = np.broadcast_to(n, addr.shape).ravel()
            rows[:, 2] = int(layout.device_id)
            out.append(rows)
        return out[0], out[1]

    @staticmethod
    def _check_rank(rank: int, size: int, what: str) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"{what} rank {rank} is not in [0, {size})")


def compute_tp_mapping(src: EngineKv, dst: EngineKv) -> TpMapping:
    """The plan for moving KV held by ``src`` (owner) into ``dst`` (receiver).

    Raises :class:`KvIncompatible` (with the reason) for a pair that cannot be mapped.
    """
    check_compatible(src, dst)
    if not src.heads_known:  # compatible only when equal TP and identical blocks: rank r -> r
        n = src.bytes_per_block
        return TpMapping(src, dst, tuple(HeadSlice(r, r, 0, 0, 0, 0, n, whole_block=True)
                                         for r in range(dst.tp_size)))
    slices: list[HeadSlice] = []
    hb = src.head_bytes
    for d in range(dst.tp_size):
        run: list[int] = []  # [src rank, first head, count]
        for h in dst.heads_of(d):
            s = source_rank(src, dst, d, h)
            if run and run[0] == s and run[1] + run[2] == h:
                run[2] += 1
                continue
            if run:
                slices.append(_slice(src, dst, run, d, hb))
            run = [s, h, 1]
        slices.append(_slice(src, dst, run, d, hb))
    return TpMapping(src, dst, tuple(slices))


def _slice(src: EngineKv, dst: EngineKv, run: list[int], d: int, hb: int) -> HeadSlice:
    s, first, count = run
    src_off = (first - src.heads_of(s).start) * hb
    dst_off = (first - dst.heads_of(d).start) * hb
    nbytes = count * hb
    whole = src_off == 0 and dst_off == 0 and nbytes == src.bytes_per_block == dst.bytes_per_block
    return HeadSlice(s, d, first, count, src_off, dst_off, nbytes, whole_block=whole)


def head_major_blocks(shape: tuple[int, ...], strides: tuple[int, ...], local_heads: int) -> bool:
    """Is every head's slice of one block (block dim 0) a single contiguous chunk?

    True for one head per rank (the whole block is the head) and for vLLM's CPU layout
    ``[blocks, heads, block_size, 2 * head_dim]`` stored densely; False for anything else
    (NHD, a K/V dim outside the heads...), which keeps such engines to whole-block pairs
    (equal heads per rank) instead of guessing from a shape where dims can coincide.
    """
    if local_heads <= 1:
        return True
    if len(shape) != 4 or shape[1] != local_heads:
        return False
    _, _, t, x = shape
    return strides[3] == 1 and strides[2] == x and strides[1] == t * x
