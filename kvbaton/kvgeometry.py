"""Can two engines exchange KV at all, and which KV heads does each tensor-parallel rank hold?

Pure (no vLLM, gRPC or torch imports) because two parties need the same answer: the control
plane refuses an incompatible pair when a push match or a reuse pin is formed — before a
byte moves — and the connector's data path (``kvbaton.connector.transfer.tp_mapping``)
builds its per-rank plan from the same rules, so the two can never disagree about what is
mappable.

The model: an engine of tensor-parallel size ``T`` serving a model with ``K`` KV heads
splits the heads across ranks when ``K % T == 0`` (rank ``r`` holds heads
``[r*K/T, (r+1)*K/T)``) and replicates them when ``T % K == 0`` (rank ``r`` holds head
``r*K//T``; ``T/K`` ranks hold each head; MLA is ``K = 1``, every rank holding the one
latent "head"). Anything else cannot be mapped and is refused. Within one block of one
region, a rank's heads must be laid out head-major (each head's slice one contiguous
chunk, e.g. vLLM's CPU layout ``[blocks, heads, block_size, 2*head_dim]`` or HND) for a
block to be split or merged across ranks; pairs that only ever move whole blocks accept
any layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class KvIncompatible(ValueError):
    """Two engines' KV caches cannot be mapped onto each other; ``str(exc)`` says why."""


@dataclasses.dataclass(frozen=True)
class EngineKv:
    """What one engine's ranks published about their KV cache (all ranks agree on it).

    ``bytes_per_block`` is one *rank's* block in one region (the heads it holds);
    ``total_kv_heads`` is the model's KV head count, 0 when the engine did not publish it
    (older connectors): then only same-TP, byte-identical pairs are accepted.
    """

    tp_size: int
    tokens_per_block: int
    bytes_per_block: int
    num_regions: int
    dtype: str
    layout: str
    total_kv_heads: int = 0
    head_major: bool = False
    fingerprint: str = ""

    @classmethod
    def from_rank(cls, rank: Any) -> EngineKv:
        """From a ``kvbaton.v1.EngineRank`` (duck-typed: this module imports no protobuf)."""
        g = rank.geometry
        return cls(tp_size=int(rank.tp_size) or 1, tokens_per_block=int(g.tokens_per_block),
                   bytes_per_block=int(g.bytes_per_block), num_regions=len(g.region_base_addrs),
                   dtype=str(g.dtype), layout=str(g.layout or "block_major"),
                   total_kv_heads=int(getattr(g, "total_kv_heads", 0) or 0),
                   head_major=bool(getattr(g, "head_major", False)), fingerprint=str(g.fingerprint))

    @property
    def heads_known(self) -> bool:
        return self.total_kv_heads > 0

    @property
    def heads_per_rank(self) -> int:
        """KV heads one rank holds (1 when heads are replicated across ranks)."""
        return max(self.total_kv_heads // self.tp_size, 1) if self.heads_known else 1

    @property
    def head_bytes(self) -> int:
        """Bytes of one head in one block of one region."""
        return self.bytes_per_block // self.heads_per_rank

    def heads_of(self, rank: int) -> range:
        """The KV heads rank ``rank`` holds (needs :attr:`heads_known` and a valid split)."""
        return rank_heads(self.tp_size, self.total_kv_heads, rank)


def split_reason(tp_size: int, total_kv_heads: int) -> str | None:
    """Why ``total_kv_heads`` cannot be spread over ``tp_size`` ranks, or None if it can."""
    if tp_size < 1 or total_kv_heads < 1:
        return f"tp_size {tp_size} and KV heads {total_kv_heads} must both be at least 1"
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        return (f"{total_kv_heads} KV heads cannot be spread over {tp_size} tensor-parallel ranks "
                "(neither divides the other)")
    return None


def rank_heads(tp_size: int, total_kv_heads: int, rank: int) -> range:
    """Heads of ``rank``: a contiguous split, or the one head it replicates."""
    reason = split_reason(tp_size, total_kv_heads)
    if reason:
        raise KvIncompatible(reason)
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not in [0, {tp_size})")
    if tp_size <= total_kv_heads:
        per = total_kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    head = rank * total_kv_heads // tp_size
    return range(head, head + 1)


def head_holders(tp_size: int, total_kv_heads: int, head: int) -> list[int]:
    """The ranks holding ``head``, ascending (more than one when heads are replicated)."""
    if tp_size <= total_kv_heads:
        return [head // (total_kv_heads // tp_size)]
    per = tp_size // total_kv_heads
    return list(range(head * per, (head + 1) * per))


def _needs_head_split(src: EngineKv, dst: EngineKv) -> bool:
    """True when some block moves partially (a rank pair shares only some of a block's heads)."""
    return src.heads_known and src.heads_per_rank != dst.heads_per_rank


def basic_incompatibility(src: EngineKv, dst: EngineKv) -> str | None:
    """The checks that need no head counts: dtype, layout, layer/region count, block size."""
    if src.dtype != dst.dtype:
        return f"KV dtype differs: {src.dtype} vs {dst.dtype}"
    if src.layout != dst.layout:
        return f"KV layout differs: {src.layout} vs {dst.layout}"
    if src.num_regions != dst.num_regions:
        return (f"KV region count differs: {src.num_regions} vs {dst.num_regions} "
                "(different layer count or K/V split: a different model?)")
    if src.tokens_per_block != dst.tokens_per_block:
        return (f"KV block sizes differ: {src.tokens_per_block} vs {dst.tokens_per_block} tokens per "
                "block; moving KV between different block sizes is not built: configure the same "
                "--block-size on both engines")
    return None


def incompatibility(src: EngineKv, dst: EngineKv) -> str | None:
    """Why KV held by ``src`` (the engine read from or writing) cannot land in ``dst``;
    None when every rank pair can be mapped. Symmetric in everything that is checked now.
    """
    basic = basic_incompatibility(src, dst)
    if basic:
        return basic
    if not (src.heads_known and dst.heads_known):
        if src.tp_size != dst.tp_size:
            return (f"tensor-parallel sizes differ ({src.tp_size} vs {dst.tp_size}) and an engine did "
                    "not publish its KV head count (an older connector): cannot map heads")
        if src.bytes_per_block != dst.bytes_per_block:
            return (f"KV bytes per block differ: {src.bytes_per_block} vs {dst.bytes_per_block} "
                    "(different heads/head size)")
        if src.fingerprint and dst.fingerprint and src.fingerprint != dst.fingerprint:
            return f"KV fingerprint differs: {src.fingerprint!r} vs {dst.fingerprint!r}"
        return None
    if src.total_kv_heads != dst.total_kv_heads:
        return (f"KV head counts differ: {src.total_kv_heads} vs {dst.total_kv_heads} "
                "(a different model?)")
    for side, e in (("first", src), ("second", dst)):
        reason = split_reason(e.tp_size, e.total_kv_heads)
        if reason:
            return f"{side} engine: {reason}"
        if e.bytes_per_block % e.heads_per_rank:
            return (f"{side} engine: {e.bytes_per_block} bytes per block do not split into "
                    f"{e.heads_per_rank} heads")
    if src.head_bytes != dst.head_bytes:
        return (f"KV bytes per head per block differ: {src.head_bytes} vs {dst.head_bytes} "
                "(different head size or a different model)")
    if _needs_head_split(src, dst) and not (src.head_major and dst.head_major):
        return (f"heads per rank differ ({src.heads_per_rank} vs {dst.heads_per_rank}: tensor-parallel "
                f"{src.tp_size} vs {dst.tp_size}) and a block is not head-major on both sides, so a "
                "rank's heads are not one contiguous chunk of a block")
    return None


def check_compatible(src: EngineKv, dst: EngineKv) -> None:
    """:func:`incompatibility` as an exception (:class:`KvIncompatible`)."""
    reason = incompatibility(src, dst)
    if reason:
        raise KvIncompatible(reason)


def source_rank(src: EngineKv, dst: EngineKv, dst_rank: int, head: int) -> int:
    """The ``src`` rank that supplies ``head`` to ``dst_rank`` (a compatible pair, heads known).

    Replicas are spread: the ``i``-th receiver rank holding a head gets it from the
    ``i mod n``-th of the ``n`` owner ranks holding it, so equal TP sizes map ``r`` to ``r``.
    """
    owners = head_holders(src.tp_size, src.total_kv_heads, head)
    replicas = head_holders(dst.tp_size, dst.total_kv_heads, head)
    return owners[replicas.index(dst_rank) % len(owners)]


def writer_ranks(src: EngineKv, dst: EngineKv) -> tuple[int, ...]:
    """The ``src`` ranks that move anything into ``dst`` (ascending), for a compatible pair:
    in push, the prefill ranks the rendezvous expects an outcome from."""
    if not (src.heads_known and dst.heads_known):
        return tuple(range(src.tp_size))
    return tuple(sorted({source_rank(src, dst, d, h) for d in range(dst.tp_size) for h in dst.heads_of(d)}))
