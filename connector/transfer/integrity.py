"""KV integrity verification (``verify_kv``): fingerprints of KV blocks, owner vs reader.

Why: the invariant "no read of freed memory" is otherwise only observed indirectly (greedy
output equal to one engine). With ``verify_kv: true`` in ``kv_connector_extra_config`` the
*owner* of the bytes fingerprints the blocks it exposes, the *reader/receiver* fingerprints
what landed in its own blocks, and any difference fails the load (vLLM's
``kv_load_failure_policy=recompute`` path: the request is recomputed, every block freed,
``kvbaton_connector_kv_verifications_total{result="mismatch"}`` and a ``kv_verify`` stats
line counted, a warning logged). Corrupted or freed-and-reused KV is never served.

**What a fingerprint is.** One integer per block id, over *all regions* (layers; K and V
halves for ``kv_split``) of that block, in region order. Two algorithms:

* ``crc32`` (host memory): ``zlib.crc32`` chained over each region's block bytes, read in
  place through the block's address (no copy; zlib releases the GIL for large buffers, so
  it runs beside the engine's threads). Measured 2.1-3.5 GB/s on one core of the 2-core
  dev VM (``benchmarks/verify_cost.py``; table in ``docs/operators.md``): ~5 ms for a
  3,000-token reuse READ of the tiny model, ~0.6 ms per 2 MiB block of an 8B-class model.
* ``torch64`` (any device, the only one usable on CUDA): the block's bytes viewed as
  int32 words, ``sum(word[i] * W[i]) mod 2**64`` with fixed odd 64-bit weights ``W``, summed
  per region with a region multiplier. Computed with torch on the tensor's device, so only
  one int64 per block crosses to the host (nothing copies the cache). Any change of one
  word changes the sum (odd weights are invertible mod 2**64); it is not a cryptographic
  hash, it guards against bugs (wrong/freed blocks, torn copies), not adversaries. On CPU
  it runs at ~0.6 GB/s (measured; crc32 is the host default); not measured on a GPU here.

Both sides must use the same algorithm: the owner names it with its fingerprints and the
reader computes the same one (``crc32`` needs host memory on the reader too).

**Where it runs.** In the worker process on its ``kvbaton-verify`` thread
(:class:`Fingerprinter` wraps a one-thread executor): the NIXL transfer thread submits
jobs and polls their futures without waiting, the model-runner thread never sees them.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .geometry import KvLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

ALG_CRC32 = "crc32"
ALG_TORCH64 = "torch64"
ALGORITHMS = (ALG_CRC32, ALG_TORCH64)

_REGION_MULT = 0x9E3779B97F4A7C15  # odd: combines per-region sums order-sensitively
_MASK64 = (1 << 64) - 1
#: torch64: temporaries per chunk of blocks (the gathered int64 copy) stay under this.
TORCH_CHUNK_BYTES = 64 << 20


class KvIntegrityError(RuntimeError):
    """What landed differs from what the owner fingerprinted (or could not be checked)."""


def default_algorithm(layout: KvLayout) -> str:
    return ALG_CRC32 if layout.device == "cpu" else ALG_TORCH64


# ---------------------------------------------------------------------- host: crc32

def crc32_blocks(layout: KvLayout, block_ids: Sequence[int]) -> list[int]:
    """crc32 per block over every region of ``layout`` (host memory, read in place)."""
    if layout.device != "cpu":
        raise KvIntegrityError("crc32 fingerprints need host memory; use torch64 on GPUs")
    n = layout.bytes_per_block
    out: list[int] = []
    for b in block_ids:
        b = int(b)
        if not 0 <= b < layout.num_blocks:
            raise KvIntegrityError(f"block id {b} outside 0..{layout.num_blocks - 1}")
        crc = 0
        for base in layout.region_base_addrs:
            buf = (ctypes.c_char * n).from_address(base + b * layout.block_stride_bytes)
            crc = zlib.crc32(memoryview(buf), crc)
        out.append(crc)
    return out


# ---------------------------------------------------------------------- any device: torch64

class TorchBlockViews:
    """Per region, an ``int32`` view ``[num_blocks, bytes_per_block // 4]`` of the cache
    (strided over the real allocation: no copy), built from the registered tensors."""

    def __init__(self, layout: KvLayout, tensors: Sequence[torch.Tensor]) -> None:
        import torch

        if layout.bytes_per_block % 4 or layout.block_stride_bytes % 4:
            raise KvIntegrityError("torch64 fingerprints need 4-byte aligned blocks")
        self.layout = layout
        self.views: list[torch.Tensor] = []
        words, stride = layout.bytes_per_block // 4, layout.block_stride_bytes // 4
        for base in layout.region_base_addrs:
            owner = next((t for t in tensors if _contains(t, base, layout.region_span_bytes)), None)
            if owner is None:
                raise KvIntegrityError(f"no registered tensor holds region at {base:#x}")
            flat = _as_int32_storage(owner)
            off_bytes = base - flat.data_ptr()
            if off_bytes % 4:
                raise KvIntegrityError("region is not 4-byte aligned in its tensor")
            self.views.append(torch.as_strided(flat, (layout.num_blocks, words), (stride, 1), off_bytes // 4))
        g = torch.Generator().manual_seed(0x6B76)  # fixed: both peers derive the same weights
        w = torch.randint(-(1 << 62), 1 << 62, (words,), generator=g, dtype=torch.int64) | 1
        self.weights = w.to(self.views[0].device) if self.views else w

    def fingerprints(self, block_ids: Sequence[int]) -> list[int]:
        import torch

        if not block_ids:
            return []
        ids = torch.tensor([int(b) for b in block_ids], dtype=torch.long, device=self.weights.device)
        if int(ids.min()) < 0 or int(ids.max()) >= self.layout.num_blocks:
            raise KvIntegrityError(f"block ids outside 0..{self.layout.num_blocks - 1}")
        total = torch.zeros(len(block_ids), dtype=torch.int64, device=self.weights.device)
        # Chunks of blocks bound the temporaries (gathered int64 copies) to ~64 MiB.
        step = max(1, TORCH_CHUNK_BYTES // (8 * self.weights.numel()))
        for v in self.views:
            parts = []
            for i in range(0, len(block_ids), step):
                # int64 arithmetic wraps mod 2**64 (two's complement), which is what we want.
                parts.append((v.index_select(0, ids[i:i + step]).to(torch.int64) * self.weights).sum(dim=1))
            total = total * _signed64(_REGION_MULT) + torch.cat(parts)
        return [int(x) & _MASK64 for x in total.cpu().tolist()]


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _contains(t: torch.Tensor, addr: int, nbytes: int) -> bool:
    start = t.untyped_storage().data_ptr()
    return start <= addr and addr + nbytes <= start + t.untyped_storage().nbytes()


def _as_int32_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat int32 tensor over ``t``'s whole storage (shares memory)."""
    import torch

    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.int32, device=t.device).set_(st, 0, (st.nbytes() // 4,), (1,))


# ---------------------------------------------------------------------- the worker's helper

@dataclasses.dataclass(frozen=True)
class Fingerprints:
    """Fingerprints of ``block_ids`` (same order) made with ``alg``."""

    alg: str
    block_ids: tuple[int, ...]
    values: tuple[int, ...]

    def encode(self) -> str:
        """``alg=v1,v2,...`` (hex): what travels in a NIXL notification."""
        return f"{self.alg}=" + ",".join(f"{v:x}" for v in self.values)

    @staticmethod
    def decode(text: str, block_ids: Sequence[int]) -> Fingerprints:
        alg, _, vals = text.partition("=")
        if alg not in ALGORITHMS:
            raise KvIntegrityError(f"unknown fingerprint algorithm {alg!r}")
        values = tuple(int(v, 16) for v in vals.split(",")) if vals else ()
        return Fingerprints(alg, tuple(int(b) for b in block_ids), values)


def compare(owner: Sequence[int], landed: Sequence[int]) -> list[int]:
    """Positions whose fingerprints differ (a length difference counts every extra
    position as different): empty means verified."""
    bad = [i for i, (a, b) in enumerate(zip(owner, landed)) if a != b]
    bad += list(range(min(len(owner), len(landed)), max(len(owner), len(landed))))
    return bad


class Fingerprinter:
    """Computes fingerprints of this worker's blocks on a background thread."""

    def __init__(self, layout: KvLayout, tensors: Sequence[Any] = (), alg: str = "") -> None:
        self.layout = layout
        self.alg = alg or default_algorithm(layout)
        if self.alg not in ALGORITHMS:
            raise ValueError(f"verify_kv_alg must be one of {ALGORITHMS}, got {self.alg!r}")
        self._tensors = list(tensors)
        self._torch: TorchBlockViews | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvbaton-verify")

    def compute(self, block_ids: Sequence[int], alg: str = "") -> Fingerprints:
        """Synchronous (call it on a background thread: :meth:`submit`)."""
        alg = alg or self.alg
        ids = tuple(int(b) for b in block_ids)
        if alg == ALG_CRC32:
            return Fingerprints(alg, ids, tuple(crc32_blocks(self.layout, ids)))
        if alg == ALG_TORCH64:
            if self._torch is None:
                self._torch = TorchBlockViews(self.layout, self._tensors)
            return Fingerprints(alg, ids, tuple(self._torch.fingerprints(ids)))
        raise KvIntegrityError(f"unknown fingerprint algorithm {alg!r}")

    def submit(self, block_ids: Sequence[int], alg: str = "") -> concurrent.futures.Future[Fingerprints]:
        return self._pool.submit(self.compute, tuple(block_ids), alg)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def corrupt_block(layout: KvLayout, block_id: int, nbytes: int = 64) -> None:
    """Test-only fault: overwrite the first bytes of ``block_id`` in region 0 (host memory)."""
    if layout.device != "cpu":
        raise KvIntegrityError("corrupt_block only works on host memory")
    addr = layout.region_base_addrs[0] + int(block_id) * layout.block_stride_bytes
    buf = (ctypes.c_ubyte * nbytes).from_address(addr)
    for i in range(nbytes):
        buf[i] ^= 0xFF  # always a change
