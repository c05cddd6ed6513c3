"""Where one worker's KV cache lives, as a peer needs it to address blocks remotely.

A :class:`KvLayout` is what a worker publishes to the registrar (protobuf ``KvGeometry``)
and what a peer needs to turn block ids into NIXL descriptors without asking the engine:
block ``b`` of region ``r`` starts at ``region_base_addrs[r] + b * block_stride_bytes`` and
is ``bytes_per_block`` long.

Two kinds of vLLM KV tensors are understood (see :meth:`KvLayout.from_tensors`):

* ``layout="kv_split"`` — the block dim is dim 1 behind a K/V dim of size 2, as in
  FlashAttention-style ``[2, num_blocks, block_size, heads, head_dim]``. K and V of one
  layer are two separate regions (``2 * layers`` regions), because the K block and the V
  block of one block id are ``num_blocks * stride`` apart and cannot be one descriptor.
* ``layout="block_major"`` — the block dim is dim 0, e.g. ``[num_blocks, 2, block_size,
  heads, head_dim]`` (FlashInfer / CPU backends) or MLA's ``[num_blocks, block_size, dim]``.
  One block id is one contiguous chunk holding K and V together, so a layer is one region
  (``layers`` regions) and a block costs half the descriptors of ``kv_split``.

Torch is imported lazily: the control plane only uses the dict conversion.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

LAYOUT_KV_SPLIT = "kv_split"
LAYOUT_BLOCK_MAJOR = "block_major"
_KNOWN_LAYOUTS = (LAYOUT_KV_SPLIT, LAYOUT_BLOCK_MAJOR)


class KvLayoutMismatch(ValueError):
    """Two workers' KV layouts cannot exchange blocks (the message says why)."""


@dataclasses.dataclass(frozen=True)
class KvLayout:
    """One worker's registered KV cache: regions of equally sized, equally strided blocks.

    Frozen because it is shared between the transfer thread and the control-plane thread
    and is published once per engine incarnation; a changed cache means a new layout.
    """

    region_base_addrs: tuple[int, ...]
    bytes_per_block: int
    num_blocks: int
    tokens_per_block: int
    dtype: str
    device: str = "cpu"
    device_id: int = 0
    block_stride_bytes: int = 0  # 0 → bytes_per_block (densely packed blocks)
    layout: str = LAYOUT_BLOCK_MAJOR
    fingerprint: str = ""

    def __post_init__(self) -> None:
        # Normalise so equality/hash and descriptor maths never see the "0 means dense" rule.
        object.__setattr__(self, "region_base_addrs", tuple(int(a) for a in self.region_base_addrs))
        if self.block_stride_bytes == 0:
            object.__setattr__(self, "block_stride_bytes", self.bytes_per_block)
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", self.structural_fingerprint())
        self._validate()

    def _validate(self) -> None:
        if not self.region_base_addrs:
            raise ValueError("KvLayout needs at least one region")
        if self.bytes_per_block <= 0 or self.num_blocks <= 0 or self.tokens_per_block <= 0:
            raise ValueError(
                f"KvLayout sizes must be positive: bytes_per_block={self.bytes_per_block} "
                f"num_blocks={self.num_blocks} tokens_per_block={self.tokens_per_block}")
        if self.block_stride_bytes < self.bytes_per_block:
            raise ValueError(
                f"block_stride_bytes={self.block_stride_bytes} < bytes_per_block="
                f"{self.bytes_per_block}: blocks would overlap")
        if self.bytes_per_block % self.tokens_per_block:
            raise ValueError(
                f"bytes_per_block={self.bytes_per_block} is not a multiple of "
                f"tokens_per_block={self.tokens_per_block}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.layout not in _KNOWN_LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; known: {_KNOWN_LAYOUTS}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_regions(self) -> int:
        return len(self.region_base_addrs)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token in one region; what must agree between P and D."""
        return self.bytes_per_block // self.tokens_per_block

    @property
    def region_span_bytes(self) -> int:
        """Bytes from a region's base to the end of its last block."""
        return (self.num_blocks - 1) * self.block_stride_bytes + self.bytes_per_block

    @property
    def nixl_mem_type(self) -> str:
        """NIXL memory segment name: host memory is DRAM, GPU memory is VRAM."""
        return "VRAM" if self.device == "cuda" else "DRAM"

    def structural_fingerprint(self) -> str:
        """A short digest of what two peers must share (not the addresses)."""
        key = (f"{self.dtype}|{self.layout}|{self.num_regions}|{self.bytes_per_block}|"
               f"{self.tokens_per_block}")
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def registration_regions(self) -> list[tuple[int, int, int]]:
        """(addr, nbytes, device_id) extents to register with NIXL.

        The K and V halves of one ``kv_split`` tensor are one allocation and are registered
        as one extent (half the UCX memory keys). Extents of *different* tensors are never
        merged even when their addresses touch: on GPUs they may be different CUDA
        allocations, and one registration spanning two breaks CUDA IPC
        (``cuMemcpyDtoDAsync: invalid argument`` on the peer).
        """
        span = self.region_span_bytes
        group = 2 if self.layout == LAYOUT_KV_SPLIT else 1
        addrs = list(self.region_base_addrs)
        out: list[tuple[int, int, int]] = []
        for i in range(0, len(addrs), group):
            members = sorted(addrs[i : i + group])
            start, end = members[0], members[0] + span
            for a in members[1:]:
                if a <= end:
                    end = max(end, a + span)
                else:
                    out.append((start, end - start, self.device_id))
                    start, end = a, a + span
            out.append((start, end - start, self.device_id))
        return out

    # ------------------------------------------------------------------ compatibility
    def compatible(self, other: KvLayout) -> None:
        """Raise unless blocks of ``self`` can be copied into blocks of ``other`` 1:1.

        Raises :class:`KvLayoutMismatch` (a ValueError) for a real mismatch and
        ``NotImplementedError`` for different tokens per block, which is a valid deployment
        (heterogeneous block sizes) that this data path cannot serve yet.
        """
        if self.dtype != other.dtype:
            raise KvLayoutMismatch(f"KV dtype differs: {self.dtype} vs {other.dtype}")
        if self.layout != other.layout:
            raise KvLayoutMismatch(f"KV layout differs: {self.layout} vs {other.layout}")
        if self.num_regions != other.num_regions:
            raise KvLayoutMismatch(
                f"KV region count differs: {self.num_regions} vs {other.num_regions} "
                "(different layer count, or a different K/V split or TP size)")
        if self.bytes_per_token != other.bytes_per_token:
            raise KvLayoutMismatch(
                f"KV bytes per token per region differ: {self.bytes_per_token} vs "
                f"{other.bytes_per_token} (different heads/head_dim/TP size)")
        if self.tokens_per_block != other.tokens_per_block:
            raise NotImplementedError(
                f"tokens_per_block differs ({self.tokens_per_block} vs "
                f"{other.tokens_per_block}): transfers between engines with different KV "
                "block sizes are not supported; configure the same --block-size on both")
        if self.fingerprint != other.fingerprint:
            raise KvLayoutMismatch(
                f"KV fingerprint differs: {self.fingerprint!r} vs {other.fingerprint!r} "
                "(different model or cache configuration)")

    # ------------------------------------------------------------------ wire format
    def to_proto_fields(self) -> dict[str, Any]:
        """Plain-typed kwargs for ``kvbaton.v1.common_pb2.KvGeometry(**fields)``."""
        return {
            "region_base_addrs": list(self.region_base_addrs),
            "bytes_per_block": self.bytes_per_block,
            "num_blocks": self.num_blocks,
            "tokens_per_block": self.tokens_per_block,
            "dtype": self.dtype,
            "layout": self.layout,
            "fingerprint": self.fingerprint,
            "device": self.device,
            "device_id": self.device_id,
            "block_stride_bytes": self.block_stride_bytes,
        }

    @classmethod
    def from_proto_fields(cls, **kw: Any) -> KvLayout:
        """Inverse of :meth:`to_proto_fields`; accepts proto3 defaults (0 / "")."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kw) - names
        if unknown:
            raise ValueError(f"unknown KvGeometry fields: {sorted(unknown)}")
        args = dict(kw)
        args["region_base_addrs"] = tuple(int(a) for a in kw.get("region_base_addrs", ()))
        for key in ("bytes_per_block", "num_blocks", "tokens_per_block", "device_id",
                    "block_stride_bytes"):
            if key in args:
                args[key] = int(args[key])
        args["device"] = kw.get("device") or "cpu"
        args["layout"] = kw.get("layout") or LAYOUT_BLOCK_MAJOR
        return cls(**args)

    # ------------------------------------------------------------------ from tensors
    @classmethod
    def from_tensors(
        cls,
        tensors: Sequence[torch.Tensor],
        tokens_per_block: int,
        *,
        block_dim: int | None = None,
        num_blocks: int | None = None,
        fingerprint: str = "",
    ) -> KvLayout:
        """Describe per-layer vLLM KV cache tensors (all the same shape, dtype and device).

        ``block_dim`` is the logical dim that indexes blocks: 1 for ``[2, num_blocks, ...]``
        (K and V become separate regions, ``kv_split``), 0 for ``[num_blocks, ...]`` (one
        region per tensor, ``block_major``). When omitted it is inferred: a leading dim of
        2 means ``[2, num_blocks, ...]`` unless ``num_blocks`` says dim 0 is the block dim.
        Permuted views (vLLM's ``kv_cache_stride_order``) are accepted as long as one block
        of one region is a dense chunk of memory, which is checked from the strides.
        """
        if not tensors:
            raise ValueError("from_tensors needs at least one tensor")
        t0 = tensors[0]
        if block_dim is None:
            block_dim = _infer_block_dim(tuple(t0.shape), num_blocks)
        if block_dim not in (0, 1):
            raise ValueError(f"block_dim must be 0 or 1, got {block_dim}")
        if block_dim == 1 and t0.shape[0] != 2:
            raise ValueError(f"block_dim=1 needs a leading K/V dim of 2, got shape {tuple(t0.shape)}")
        esize = t0.element_size()
        nblk = int(t0.shape[block_dim])
        if num_blocks is not None and num_blocks != nblk:
            raise ValueError(f"num_blocks={num_blocks} but tensor has {nblk} blocks on dim {block_dim}")

        addrs: list[int] = []
        for i, t in enumerate(tensors):
            if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device:
                raise ValueError(
                    f"KV tensor {i} differs from tensor 0: {tuple(t.shape)} {t.dtype} "
                    f"{t.device} vs {tuple(t0.shape)} {t0.dtype} {t0.device}")
            if t.stride() != t0.stride():
                raise ValueError(f"KV tensor {i} has strides {t.stride()} != {t0.stride()}")
            halves = [t.select(0, 0), t.select(0, 1)] if block_dim == 1 else [t]
            for h in halves:
                addrs.append(int(h.data_ptr()))
        region0 = t0.select(0, 0) if block_dim == 1 else t0
        block_elems = _dense_block_elems(region0)
        device = t0.device.type
        if device not in ("cpu", "cuda"):
            raise ValueError(f"unsupported KV device {t0.device}")
        return cls(
            region_base_addrs=tuple(addrs),
            bytes_per_block=block_elems * esize,
            num_blocks=nblk,
            tokens_per_block=int(tokens_per_block),
            dtype=str(t0.dtype).removeprefix("torch."),
            device=device,
            device_id=(t0.device.index or 0) if device == "cuda" else 0,
            block_stride_bytes=int(region0.stride(0)) * esize,
            layout=LAYOUT_KV_SPLIT if block_dim == 1 else LAYOUT_BLOCK_MAJOR,
            fingerprint=fingerprint,
        )


def _infer_block_dim(shape: tuple[int, ...], num_blocks: int | None) -> int:
    if len(shape) < 2:
        raise ValueError(f"KV tensor needs at least 2 dims, got shape {shape}")
    if num_blocks is not None:
        if shape[0] == 2 and shape[1] == num_blocks and num_blocks != 2:
            return 1
        if shape[0] == num_blocks and num_blocks != 2:
            return 0
        raise ValueError(f"cannot tell the block dim of shape {shape} from num_blocks="
                         f"{num_blocks}; pass block_dim")
    return 1 if shape[0] == 2 else 0


def _dense_block_elems(region: torch.Tensor) -> int:
    """Elements in one block of ``region`` (block dim 0), checking they are one dense chunk.

    A block must be one contiguous byte range, or it cannot be one NIXL descriptor. Dims
    after the block dim may be permuted (HND views) but must tile the chunk exactly.
    """
    inner = sorted((region.stride(d), region.shape[d]) for d in range(1, region.dim())
                    if region.shape[d] != 1)
    expect = 1
    for stride, size in inner:
        if stride != expect:
            raise ValueError(
                f"one KV block is not contiguous (shape {tuple(region.shape)}, strides "
                f"{region.stride()}): cannot address it as one descriptor")
        expect *= size
    if region.shape[0] > 1 and region.stride(0) < expect:
        raise ValueError(f"block stride {region.stride(0)} < block size {expect} elements")
    return expect

