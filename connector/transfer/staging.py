"""Pack path for fragmented KV: gather → one large NIXL WRITE per chunk → scatter.

Why: NIXL/UCX costs µs per descriptor, so 131k scattered 32 KiB blocks move at ~4 GB/s
while the same bytes in 128 large descriptors move at link speed. When a transfer's
blocks are fragmented (real decode allocations are), the sender gathers them with one
``index_select`` per region into a registered staging slot, WRITEs the whole slot into
the receiver's staging slot with one descriptor, and the receiver scatters it with one
``index_copy_`` per region.

Pipelining: transfers are cut into tiles (a range of regions × a range of blocks) that
fit a slot, regions first: a tile holds whole regions whenever one region's blocks fit,
so the number of gather/scatter kernels stays one per region however many chunks there
are (measured on an H200: per-kernel launch cost, ~11 µs, not bandwidth, is what limits
small chunks). On CPU a single packer thread packs chunk i+1 while the owner thread
posts and waits for chunk i's WRITE (UCX copies inside the post call with the GIL
released). On CUDA nothing blocks: each chunk's gather is one Triton launch for all of
its regions (:class:`GpuRowCopier`; tiles of fewer than 4 regions, e.g. one layer's K and
V, use torch, one launch per layer: :func:`region_groups`) on a side stream, its
WRITE is posted when the chunk's event fires, and the receiver enqueues the scatter on
another stream and acks only when that event fires (:meth:`StagedPeer.progress`). Slots are a
fixed pool on both sides, reused: a send slot once its WRITE is done, a receive slot once
the receiver scattered the chunk in it.

Slot grants (:mod:`.staging_grants`; messages typed and versioned in :mod:`kvbaton.connector.wire`): the receiver owns
its receive slots and hands them out; a sender WRITEs only into slots granted to it, and
each chunk's ack says whether the sender keeps that slot. Many senders can pack into one
receiver at once. A staged READ is a pull request the owner answers with a staged WRITE
(the owner of the data must pack); the reader sends its grant with the request.

The same code runs on CPU tensors (CI) and CUDA tensors (a side stream per direction).
All methods run on the endpoint's owner thread except the packing itself.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from .. import wire
from .descriptors import as_ids, check_ids, plan_contiguous
from .geometry import LAYOUT_KV_SPLIT, KvLayout
from .nixl_agent import POLL_MAX_S, POLL_MIN_S, NixlEndpoint, Transfer
from .pools import GPU_POOL, HOST_POOL, PoolDefaults, default_pool
from .staging_grants import Handout, SlotGrants
from .timerslack import set_timer_slack

Strategy = Literal["runs", "pack"]
#: the grantee name of our own sends in a shared pool (NIXL agent names are never empty)
LOCAL = ""
PREFIX = wire.staged_prefix()
log = logging.getLogger(__name__)
__all__ = ["GPU_POOL", "HOST_POOL", "PREFIX", "PoolDefaults", "StagedPeer", "StagedSend", "StagingInfo",
           "StagingPool", "choose_strategy", "default_pool"]


# ---------------------------------------------------------------------------- policy
@dataclasses.dataclass(frozen=True)
class PathCosts:
    """Rough cost model; defaults from measurements in shared/nixl-notes.md."""

    desc_s: float        # fixed cost per NIXL descriptor
    link_bps: float      # large-descriptor NIXL bandwidth
    pack_bps: float      # end-to-end bandwidth of the pipelined pack path
    pack_fixed_s: float  # per-transfer protocol latency of the pack path (chunk + ack)


# while GPU chunks are in flight the sender polls at least every ~50 µs (a 32 MiB chunk
# crosses NVLink in ~80 µs; the default 2 ms backoff cap would idle the link)
GPU_POLL_MAX_S = 50e-6

HOST_COSTS = PathCosts(desc_s=3e-6, link_bps=10e9, pack_bps=4e9, pack_fixed_s=300e-6)
GPU_COSTS = PathCosts(desc_s=7e-6, link_bps=300e9, pack_bps=150e9, pack_fixed_s=100e-6)


def choose_strategy(num_runs: int, total_bytes: int, *, device: str = "cpu",
                    costs: PathCosts | None = None) -> Strategy:
    """Pick ``"runs"`` (one descriptor per coalesced run) or ``"pack"`` (staging).

    ``num_runs`` is the number of descriptors the per-run path would post (runs × regions).
    Per-run time ≈ ``num_runs·desc_s + bytes/link``; pack time ≈ ``fixed + bytes/pack_bps``.
    Few large runs → runs (no extra copies); many small runs → pack. With the defaults the
    break-even mean run size is ~8 KiB on host memory and ~2 MiB on GPUs.
    """
    if num_runs <= 0 or total_bytes <= 0:
        return "runs"
    c = costs or (GPU_COSTS if device == "cuda" else HOST_COSTS)
    t_runs = num_runs * c.desc_s + total_bytes / c.link_bps
    t_pack = c.pack_fixed_s + total_bytes / c.pack_bps
    return "pack" if t_pack < t_runs else "runs"


# ---------------------------------------------------------------------------- memory
_WORDS = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16),
          (1, torch.uint8))
SLOT_ALIGN = 256


def copy_word(layout: KvLayout, storage_offsets: Sequence[int] = ()) -> tuple[int, torch.dtype]:
    """Widest element (bytes, dtype) that tiles blocks, strides and region offsets.

    Torch's CPU scatter (``index_copy_``) moves one element at a time: on 32 KiB blocks it
    is ~10× faster on 16-byte elements than on bytes (measured 1.5 ms vs 0.16 ms per 2 MiB),
    and gathers gain too. The element type is only a container: copies move bits as-is.
    """
    for w, dt in _WORDS:
        if (layout.bytes_per_block % w == 0 and layout.block_stride_bytes % w == 0
                and all(o % w == 0 for o in storage_offsets)):
            return w, dt
    return 1, torch.uint8


def region_byte_views(tensors: Sequence[torch.Tensor], layout: KvLayout) -> list[torch.Tensor]:
    """``[num_blocks, bytes_per_block / w]`` views of every region, in layout order.

    Built on the tensors' storage with the layout's stride, so they work for any dtype and
    for permuted (HND) tensors; the element type is the widest word that tiles a block
    (:func:`copy_word`), so gathers and scatters on them move raw bits, fast.
    """
    per = 2 if layout.layout == LAYOUT_KV_SPLIT else 1
    if len(tensors) * per != layout.num_regions:
        raise ValueError(f"{len(tensors)} tensors do not match a layout of {layout.num_regions} regions")
    offsets: list[tuple[torch.Tensor, int]] = []
    for i, t in enumerate(tensors):
        storage = t.untyped_storage()
        for j in range(per):
            off = layout.region_base_addrs[i * per + j] - storage.data_ptr()
            if off < 0 or off + layout.region_span_bytes > storage.nbytes():
                raise ValueError(f"region {i * per + j} is not inside tensor {i}'s storage")
            offsets.append((t, off))
    w, dt = copy_word(layout, [o for _, o in offsets])
    views: list[torch.Tensor] = []
    for t, off in offsets:
        storage = t.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        flat = flat[:storage.nbytes() // w * w].view(dt)
        views.append(flat.as_strided((layout.num_blocks, layout.bytes_per_block // w),
                                     (layout.block_stride_bytes // w, 1), off // w))
    return views


@dataclasses.dataclass(frozen=True)
class StagingInfo:
    """What a peer needs to WRITE into our staging slots (carried by the control plane)."""

    base_addr: int
    slot_bytes: int
    num_slots: int
    mem_type: str = "DRAM"
    device_id: int = 0

    def slot_addr(self, slot: int) -> int:
        return self.base_addr + slot * self.slot_bytes


class StagingPool:
    """A fixed number of equal slots in one buffer, allocated and registered once.

    Bounded on purpose: staging memory competes with the KV cache for GPU memory.
    """

    def __init__(self, slot_bytes: int, num_slots: int, device: torch.device | str = "cpu") -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError("staging pool needs positive slot_bytes and num_slots")
        self.device = torch.device(device)
        # aligned slots, so any copy word (≤ 16 B) can view them
        self.slot_bytes = -(-int(slot_bytes) // SLOT_ALIGN) * SLOT_ALIGN
        self.num_slots = int(num_slots)
        self.buffer = torch.empty(self.slot_bytes * self.num_slots, dtype=torch.uint8,
                                  device=self.device)
        self._reg: object | None = None

    def slot(self, k: int) -> torch.Tensor:
        return self.buffer[k * self.slot_bytes:(k + 1) * self.slot_bytes]

    def info(self) -> StagingInfo:
        cuda = self.device.type == "cuda"
        return StagingInfo(int(self.buffer.data_ptr()), self.slot_bytes, self.num_slots,
                           "VRAM" if cuda else "DRAM", (self.device.index or 0) if cuda else 0)

    def register(self, endpoint: NixlEndpoint) -> None:
        if self._reg is None:
            self._reg = endpoint.register_tensors([self.buffer])


def plan_tiles(num_blocks: int, num_regions: int, bytes_per_block: int,
               slot_bytes: int) -> list[tuple[int, int, int, int]]:
    """Cut ``num_blocks × num_regions`` blocks into slot-sized tiles ``(r0, r1, b0, b1)``.

    Whole regions first (all blocks of several regions per tile) so each region is
    gathered by one kernel; only when one region's blocks exceed a slot are blocks split.
    """
    per_slot = slot_bytes // bytes_per_block
    if per_slot < 1:
        raise ValueError(f"staging slot ({slot_bytes} B) smaller than one block ({bytes_per_block} B)")
    if num_blocks == 0:
        return []
    nb = min(num_blocks, per_slot)
    g = max(1, per_slot // nb)
    return [(r0, min(num_regions, r0 + g), b0, min(num_blocks, b0 + nb))
            for b0 in range(0, num_blocks, nb) for r0 in range(0, num_regions, g)]


def chunk_bytes_for(total_bytes: int, slot_bytes: int, bytes_per_block: int, *,
                    target_chunks: int, min_chunk_bytes: int) -> int:
    """Tile size for a transfer: about ``target_chunks`` chunks, within ``[min, slot]``.

    More chunks shorten the pipeline's fill and drain (one chunk's gather before the
    first WRITE, one chunk's scatter after the last), fewer chunks cost fewer posts,
    notifications and acks. Always at least one block.
    """
    want = -(-int(total_bytes) // max(1, int(target_chunks)))
    size = min(int(slot_bytes), max(int(min_chunk_bytes), want))
    return max(size, int(bytes_per_block))


def _packed(views: Sequence[torch.Tensor], n: int, buf: torch.Tensor) -> torch.Tensor:
    """``buf`` (uint8, 16-byte aligned) seen as ``[regions, n, row]`` of the views' dtype."""
    row, esize = int(views[0].shape[1]), views[0].element_size()
    nbytes = len(views) * n * row * esize
    return buf[:nbytes].view(views[0].dtype).view(len(views), n, row)


RegionGroups = list[tuple[int, int, torch.Tensor]]


def region_groups(views: Sequence[torch.Tensor]) -> RegionGroups:
    """Runs of consecutive regions evenly spaced in one storage, each as one
    ``[k, blocks, row]`` view: ``(first, end, view)``.

    Why: a kernel launch costs ~20-25 µs of CPU on CUDA (benchmarks/results/
    launch_cost_h200x1.json) and a staged chunk's gather and scatter sit on its round
    trip. vLLM keeps a layer's K and V in one tensor (K and V regions evenly spaced), so
    a tile of whole layers is one ``index_select`` / ``index_copy_`` per layer, not per
    region. Regions of separate tensors stay one view each.
    """
    groups: RegionGroups = []
    i = 0
    while i < len(views):
        v, j, delta = views[i], i + 1, 0
        ptr = v.untyped_storage().data_ptr()
        while j < len(views):
            w = views[j]
            d = w.storage_offset() - views[j - 1].storage_offset()
            if (w.untyped_storage().data_ptr() != ptr or w.shape != v.shape or w.stride() != v.stride()
                    or w.dtype != v.dtype or d <= 0 or (delta and d != delta)):
                break
            delta, j = d, j + 1
        g = (v.unsqueeze(0) if j == i + 1
             else v.as_strided((j - i, *v.shape), (delta, *v.stride()), v.storage_offset()))
        groups.append((i, j, g))
        i = j
    return groups


def pack_blocks(views: Sequence[torch.Tensor], ids: torch.Tensor, out: torch.Tensor,
                groups: RegionGroups | None = None) -> int:
    """Gather blocks ``ids`` of every region into ``out`` (region-major); returns bytes.

    One ``index_select`` per region (or per :func:`region_groups` group when given): the
    block lists are shared by all regions, so a transfer of n blocks over R regions is at
    most R kernel calls, independent of fragmentation. (On CUDA tiles of many regions use
    :class:`GpuRowCopier` instead: one kernel for all.)
    """
    dst = _packed(views, int(ids.shape[0]), out)
    if groups is not None:
        for i, j, g in groups:
            torch.index_select(g, 1, ids, out=dst[i:j])
    else:
        for r, v in enumerate(views):
            torch.index_select(v, 0, ids, out=dst[r])
    return dst.numel() * dst.element_size()


def unpack_blocks(views: Sequence[torch.Tensor], ids: torch.Tensor, src: torch.Tensor,
                  groups: RegionGroups | None = None) -> None:
    """Scatter a :func:`pack_blocks` buffer into blocks ``ids`` of every region."""
    packed = _packed(views, int(ids.shape[0]), src)
    if groups is not None:
        for i, j, g in groups:
            g.index_copy_(1, ids, packed[i:j])
    else:
        for r, v in enumerate(views):
            v.index_copy_(0, ids, packed[r])


# ---------------------------------------------------------------------------- GPU kernel
_UNIT = 16  # bytes: the kernel addresses KV rows in 16-byte units (one vector load)
_KERNEL: object | None = None


def _triton_kernel() -> object | None:
    """The gather/scatter kernel, compiled lazily; None where Triton is missing."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    try:
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - CPU-only installs
        return None

    @triton.jit
    def kv_rows(kv_ptr, roff_ptr, ids_ptr, stage_ptr, n, row_u, stride_u,
                TO_STAGE: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
        # program (pid, cid): columns cid*BLOCK.. of row j of tile-region r, where
        # pid = r * n + j. KV rows live at anchor + roff[r] + ids[j] * stride (16-byte
        # units); the tile is packed region-major, row after row. Offsets are int64
        # element (8-byte) counts, always even → 16-byte vector loads and stores.
        pid = tl.program_id(0)
        cid = tl.program_id(1)
        r = pid // n
        j = pid - r * n
        roff = tl.load(roff_ptr + r)
        b = tl.load(ids_ptr + j)
        kv = (roff + b * stride_u) * 2
        st = pid.to(tl.int64) * row_u * 2
        cols = cid * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            if TO_STAGE:
                x = tl.load(kv_ptr + kv + cols, eviction_policy="evict_first")
                tl.store(stage_ptr + st + cols, x)
            else:
                x = tl.load(stage_ptr + st + cols, eviction_policy="evict_first")
                tl.store(kv_ptr + kv + cols, x)
        else:
            mask = cols < row_u * 2
            if TO_STAGE:
                x = tl.load(kv_ptr + kv + cols, mask=mask)
                tl.store(stage_ptr + st + cols, x, mask=mask)
            else:
                x = tl.load(stage_ptr + st + cols, mask=mask)
                tl.store(kv_ptr + kv + cols, x, mask=mask)

    _KERNEL = kv_rows
    return _KERNEL


class GpuRowCopier:
    """Moves ``(region, block)`` rows between the KV regions and a packed tile, on CUDA,
    with one kernel launch per tile whatever the number of regions.

    The regions are separate allocations (one tensor per layer), so no single torch view
    spans them; the kernel reads a small device table of region offsets (16-byte units
    from an anchor address) instead. The packed format is exactly :func:`pack_blocks`'s
    (region-major, block rows in id order), so either side may fall back to torch.
    """

    BLOCK = 1024  # int64 elements (8 KiB) per program

    def __init__(self, tensors: Sequence[torch.Tensor], layout: KvLayout) -> None:
        dev = tensors[0].device
        storage = tensors[0].untyped_storage()
        self.anchor = torch.empty(0, dtype=torch.int64, device=dev).set_(
            storage, 0, (storage.nbytes() // 8,), (1,))
        base = int(self.anchor.data_ptr())
        offs = [a - base for a in layout.region_base_addrs]
        if (layout.bytes_per_block % _UNIT or layout.block_stride_bytes % _UNIT
                or any(o % _UNIT for o in offs) or base % _UNIT):
            raise ValueError("KV rows are not 16-byte aligned: use the torch gather")
        self.roff = torch.tensor([o // _UNIT for o in offs], dtype=torch.int64, device=dev)
        self.row_u = layout.bytes_per_block // _UNIT
        self.stride_u = layout.block_stride_bytes // _UNIT
        self.row_elems = self.row_u * 2
        blk = self.BLOCK
        while blk > 2 and self.row_elems % blk:
            blk //= 2
        if (blk < 256 and self.row_elems > blk) or self.row_elems % blk:
            # no large power of two tiles a row: whole-row programs, masked
            blk = min(self.BLOCK, 1 << (self.row_elems - 1).bit_length())
        self.block = blk
        self.even = self.row_elems % self.block == 0
        self.kernel: Any = _triton_kernel()  # a triton JIT function (indexed by its grid)
        if self.kernel is None:
            raise ValueError("triton is not importable")

    def _launch(self, ids: torch.Tensor, r0: int, r1: int, buf: torch.Tensor, to_stage: bool) -> int:
        n = int(ids.shape[0])
        nbytes = (r1 - r0) * n * self.row_u * _UNIT
        if n == 0 or r1 <= r0:
            return 0
        if buf.numel() < nbytes:
            raise ValueError(f"tile of {nbytes} B does not fit a {buf.numel()} B buffer")
        stage = buf[:nbytes].view(torch.int64)
        grid = ((r1 - r0) * n, -(-self.row_elems // self.block))
        self.kernel[grid](self.anchor, self.roff[r0:r1], ids, stage, n, self.row_u,
                          self.stride_u, TO_STAGE=to_stage, BLOCK=self.block, EVEN=self.even,
                          num_warps=4)
        return nbytes

    def gather(self, ids: torch.Tensor, r0: int, r1: int, out: torch.Tensor) -> int:
        """Rows ``ids`` of regions ``r0..r1`` into ``out`` (the current stream)."""
        return self._launch(ids, r0, r1, out, True)

    def scatter(self, ids: torch.Tensor, r0: int, r1: int, src: torch.Tensor) -> None:
        """A :meth:`gather` tile back into rows ``ids`` of regions ``r0..r1``."""
        self._launch(ids, r0, r1, src, False)


# ---------------------------------------------------------------------------- protocol
@dataclasses.dataclass
class _Unpack:
    peer: str
    xfer_id: str
    slot: int
    seq: int
    nchunks: int
    event: object  # torch.cuda.Event
    keep: tuple[torch.Tensor, ...]  # tensors the scatter still reads
    start: object = None  # a timing event before the scatter (tracing only)


@dataclasses.dataclass
class _Outgoing:
    """Sender side of one staged transfer to one peer: the receiver's slots we hold."""

    created: float
    grant: wire.StagedGrant | None = None  # the receiver's pool (from its latest grant)
    idle: collections.deque[int] = dataclasses.field(default_factory=collections.deque)
    acks: collections.deque[tuple[int, int, bool]] = dataclasses.field(default_factory=collections.deque)
    denied: str = ""
    pulled: bool = False  # a staged READ: the reader granted slots with its request


class StagedPeer:
    """Both roles of the pack path for one endpoint: sender (:meth:`send`) and receiver
    (grants, unpack + ack, driven by :meth:`progress` / :meth:`NixlEndpoint.poll_notifs`).

    Receive slots are granted by the receiver (:mod:`.staging_grants`, messages in
    :mod:`kvbaton.connector.wire`): a sender asks for slots, WRITEs only into slots it holds, and
    gets each slot back (or loses it to another sender) with the chunk's ack. Any number
    of senders may pack into one receiver at once.

    On CUDA nothing blocks on the GPU: the sender enqueues each chunk's gather on a side
    stream and posts its WRITE once the chunk's event has fired; a send slot is reused as
    soon as its WRITE is done (the receiver's slot only once acked). The receiver enqueues
    each chunk's scatter on another side stream and acks the chunk (freeing the slot) and
    reports the transfer complete only once the scatter's event has fired. Those events
    are checked by :meth:`progress`, which the owner thread must keep calling while
    :attr:`busy` (it also polls notifications); :meth:`send` and :meth:`wait_complete`
    call it themselves. On CPU the scatter is synchronous inside the notification handler.
    """

    def __init__(self, endpoint: NixlEndpoint, tensors: Sequence[torch.Tensor],
                 layout: KvLayout, *, slot_bytes: int, num_slots: int = 4,
                 target_chunks: int = 16, min_chunk_bytes: int = 4 << 20,
                 use_kernel: bool | None = None, send_slots: int | None = None,
                 grant_margin_s: float = 2.0, shared: bool = False,
                 on_complete: Callable[[str, str], None] | None = None) -> None:
        """Allocate and register two pools (send: ``send_slots`` (default ``num_slots``),
        receive: ``num_slots``, both ``slot_bytes``) on the KV's device.

        A transfer is cut into about ``target_chunks`` chunks of at least
        ``min_chunk_bytes`` (and at most a slot). ``use_kernel`` picks the one-launch
        Triton gather/scatter on CUDA (default: when available). ``grant_margin_s`` is
        how long past a sender's deadline its grant is kept (WRITEs still in flight).

        ``shared``: one pool of ``num_slots + send_slots`` slots for both directions
        instead of two: our own sends take their slots from the same grants as the peers
        writing into us (as the grantee :data:`LOCAL`), so an engine that only sends (a
        prefill pushing) or only receives (a decode being pushed to) has every slot in
        flight for that direction; with both at once the grants share the pool fairly.
        Measured on an H200, 16k tokens: 4 + 4 slots of 64 MiB move a fragmented WRITE
        ~1.6× faster than 2 + 2, so the same 256 MiB shared does what 512 MiB split did.
        """
        self.ep = endpoint
        self.layout = layout
        self.views = region_byte_views(tensors, layout)
        self.device = tensors[0].device
        self.target_chunks = int(target_chunks)
        self.min_chunk_bytes = int(min_chunk_bytes)
        #: one pool for both directions (``shared``): its slots go to whoever moves data now
        self.shared = bool(shared)
        if self.shared:
            self.send_pool = self.recv_pool = StagingPool(slot_bytes, num_slots + (send_slots or num_slots),
                                                          self.device)
            self.send_pool.register(endpoint)
        else:
            self.send_pool = StagingPool(slot_bytes, send_slots or num_slots, self.device)
            self.recv_pool = StagingPool(slot_bytes, num_slots, self.device)
            self.send_pool.register(endpoint)
            self.recv_pool.register(endpoint)
        self._local_free: dict[str, collections.deque[int]] = {}  # shared: our sends' slots
        self._send_info = self.send_pool.info()
        self._recv_info = self.recv_pool.info()
        # the whole shared pool goes to peers while we send nothing (see SlotGrants)
        self.grants = SlotGrants(self.recv_pool.num_slots, margin_s=grant_margin_s,
                                 local=LOCAL if self.shared else None,
                                 sending=lambda: bool(self._outgoing))
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            # the owner thread polls between GPU chunks: wake it as precisely as it asks
            set_timer_slack()
            self._on_device()
        #: busy-poll (yield only) while chunks are in flight on CUDA: a sleep costs more
        #: than a chunk's WRITE there (measured: benchmarks/results/datapath_gpu*.md)
        self.spin = self.cuda
        self._packer = None if self.cuda else cf.ThreadPoolExecutor(
            1, thread_name_prefix="kvbaton-pack")
        self._pack_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._unpack_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.copier: GpuRowCopier | None = None
        if self.cuda and use_kernel is not False:
            try:
                self.copier = GpuRowCopier(tensors, layout)
            except ValueError:
                if use_kernel:
                    raise
        #: tiles with fewer regions than this are moved with one torch kernel per region
        #: (a Triton launch costs more CPU time than a few torch launches)
        self.kernel_min_regions = 4
        #: torch gathers/scatters: one launch per run of evenly spaced regions (a layer's
        #: K and V), not per region (:func:`region_groups`); CUDA only (launches cost there)
        self.merge_regions = self.cuda
        self._group_cache: dict[tuple[int, int], RegionGroups] = {}
        # Destination ids of incoming transfers, received once (grant request or our pull)
        # and uploaded once on CUDA; chunks name a range of them (no ids per chunk).
        self._dst_ids: collections.OrderedDict[tuple[str, str], np.ndarray] = collections.OrderedDict()
        self._dst_dev: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._outgoing: dict[tuple[str, str], _Outgoing] = {}
        self._recv_counts: dict[tuple[str, str], int] = {}
        self._cancelled: dict[str, None] = {}  # insertion-ordered set (see cancel)
        self._unpacking: collections.deque[_Unpack] = collections.deque()
        self.completed: dict[str, str] = {}  # xfer_id → peer, for finished incoming transfers
        self._pulls: collections.deque[tuple[str, str, StagingInfo | None, np.ndarray, np.ndarray]] = \
            collections.deque()
        self._on_complete = on_complete
        self.last_send_chunks = 0
        self.dropped_chunks = 0  # chunks in slots their sender did not hold (never scattered)
        self.bad_messages = 0
        #: (perf_counter, event, seq) when a list: where a transfer's time goes
        self.trace: list[tuple[float, str, int]] | None = None
        #: while tracing on CUDA: (kernel, seq, µs on the GPU) of each gather and scatter
        self.gpu_trace: list[tuple[str, int, float]] = []
        #: gather a chunk as soon as a send slot is free, before a receive slot is (False:
        #: only once both are, as before; kept for the benchmark's comparison)
        self.gather_ahead = True
        #: post a finished slot → slot WRITE request again instead of making a new one
        #: (False: a new request per chunk, as before; kept for the benchmark's comparison)
        self.reuse_requests = True
        endpoint.on_notif(PREFIX, self._on_notif)

    def info(self) -> StagingInfo:
        """Our receive pool (published with the KV geometry; senders get slots by grant)."""
        return self._recv_info

    @property
    def block_bytes(self) -> int:
        """Bytes one block id moves (all regions)."""
        return self.layout.bytes_per_block * self.layout.num_regions

    @property
    def busy(self) -> bool:
        """Incoming work the owner must keep calling :meth:`progress` for (bounded: a
        grant ends with its transfer, its sender's release, or its expiry)."""
        return bool(self.grants.busy or self._unpacking)

    def close(self) -> None:
        if self._packer is not None:
            self._packer.shutdown(wait=True)
        if self._unpack_stream is not None:
            self._unpack_stream.synchronize()

    def forget(self, xfer_id: str) -> None:
        """Drop receive-side state of an incoming transfer whose sender gave up."""
        for k in [k for k in self._recv_counts if k[1] == xfer_id]:
            del self._recv_counts[k]
        self.completed.pop(xfer_id, None)

    def cancel(self, xfer_id: str) -> None:
        """The receiver gave up on an incoming transfer (its blocks may be freed and reused):
        chunks of it that still arrive are acked (the sender's slots come free) but never
        scattered, and new grant requests for it are refused. Remembered for a bounded
        number of ids."""
        self.forget(xfer_id)
        self._cancelled[xfer_id] = None
        if self._unpack_stream is not None:
            # scatters of it already enqueued finish before the caller frees the blocks
            self._unpack_stream.synchronize()
        while len(self._cancelled) > 1024:
            self._cancelled.pop(next(iter(self._cancelled)))

    def progress(self) -> bool:
        """Poll notifications, finish scatters whose events fired (acks, completions),
        reclaim expired grants. Non-blocking; returns whether anything happened. Call it
        from the owner thread."""
        got = bool(self.ep.poll_notifs())
        done = self._finish_unpacks()
        if self.grants.busy:
            self._send_handouts(self.grants.expire())
        return done or got

    def tile_bytes(self, num_blocks: int, remote_slot_bytes: int | StagingInfo | None = None) -> int:
        slot = self._send_info.slot_bytes
        if isinstance(remote_slot_bytes, StagingInfo):
            remote_slot_bytes = remote_slot_bytes.slot_bytes
        if remote_slot_bytes:
            slot = min(slot, int(remote_slot_bytes))
        return chunk_bytes_for(num_blocks * self.block_bytes, slot, self.layout.bytes_per_block,
                               target_chunks=self.target_chunks,
                               min_chunk_bytes=self.min_chunk_bytes)

    def _want(self, num_blocks: int, slot_bytes: int) -> int:
        """Receive slots worth asking for: the chunk count, at most a whole pool."""
        tiles = plan_tiles(num_blocks, self.layout.num_regions, self.layout.bytes_per_block,
                           self.tile_bytes(num_blocks, slot_bytes))
        return max(1, len(tiles))

    def _note(self, what: str, seq: int) -> None:
        if self.trace is not None:
            self.trace.append((time.perf_counter(), what, seq))

    def _nap(self, delay: float, active: bool, poll_max: float) -> float:
        """Sleep between polls; returns the next delay. Spins (yields the GIL only) while
        GPU chunks are in flight and :attr:`spin` is set."""
        if active and self.spin:
            time.sleep(0)
            return POLL_MIN_S
        time.sleep(delay)
        return min(delay * 2, poll_max)

    # -------------------------------------------------------------- sender
    def start_send(self, peer: str, remote: StagingInfo | None, local_ids: npt.ArrayLike,
                   remote_ids: npt.ArrayLike, xfer_id: str, *, timeout_s: float) -> StagedSend:
        """A staged WRITE of local blocks into the peer's blocks, advanced by
        :meth:`StagedSend.step` (never blocks). One at a time per :class:`StagedPeer` (the
        send pool's slots are its own); any number of senders may target one receiver."""
        return StagedSend(self, peer, remote, local_ids, remote_ids, xfer_id, timeout_s=timeout_s)

    def send(self, peer: str, remote: StagingInfo | None, local_ids: npt.ArrayLike,
             remote_ids: npt.ArrayLike, xfer_id: str, *, timeout_s: float,
             idle: Callable[[], object] | None = None) -> int:
        """Blocking form of :meth:`start_send`; returns bytes moved once the receiver acked
        every chunk (its blocks hold the data). ``idle`` runs on every turn of the loop
        (tests progress the peer with it)."""
        job = self.start_send(peer, remote, local_ids, remote_ids, xfer_id, timeout_s=timeout_s)
        poll_max = GPU_POLL_MAX_S if self.cuda else POLL_MAX_S
        delay = POLL_MIN_S
        try:
            while True:
                job.progressed |= self.progress()
                if job.step():
                    return job.nbytes
                if idle is not None:
                    idle()
                if job.progressed:
                    delay = POLL_MIN_S
                    continue
                fut = job.pack_future()
                if fut is not None:
                    cf.wait([fut], timeout=delay)  # sleeps until packed, bounded
                else:
                    delay = self._nap(delay, job.active, poll_max)
        finally:
            job.close()

    def _start_pack(self, lids: np.ndarray, ids_dev: torch.Tensor | None, b0: int, b1: int,
                    r0: int, r1: int, slot: int) -> object:
        """Begin packing a tile into a send slot: a Future (CPU) or (event, bytes) (CUDA)."""
        if not self.cuda:
            assert self._packer is not None
            return self._packer.submit(self._pack_cpu, lids[b0:b1], r0, r1, slot)
        assert self._pack_stream is not None and ids_dev is not None
        self._on_device()
        with torch.cuda.stream(self._pack_stream):
            ev0 = self._timing_event(self._pack_stream)
            ids = ids_dev[b0:b1]
            out = self.send_pool.slot(slot)
            if self.copier is not None and r1 - r0 >= self.kernel_min_regions:
                nbytes = self.copier.gather(ids, r0, r1, out)
            else:
                nbytes = pack_blocks(self.views[r0:r1], ids, out, self._groups(r0, r1))
            ev = torch.cuda.Event(enable_timing=ev0 is not None)
            ev.record(self._pack_stream)
        return (ev, nbytes, ev0)

    def _groups(self, r0: int, r1: int) -> RegionGroups | None:
        """The torch gathers' merged views of regions ``r0..r1`` (CUDA only; cached: tiles
        repeat the same region ranges)."""
        if not self.merge_regions:
            return None
        g = self._group_cache.get((r0, r1))
        if g is None:
            g = self._group_cache[(r0, r1)] = region_groups(self.views[r0:r1])
        return g

    def _on_device(self) -> None:
        """Make the KV's GPU the calling thread's current device (Triton launches on the
        current device) once, instead of a device context around every launch (measured:
        ~20 µs of CPU per chunk on each side)."""
        if torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)

    def _timing_event(self, stream: Any) -> Any:
        """While tracing on CUDA: a timing event recorded on ``stream`` (kernel start)."""
        if self.trace is None or not self.cuda:
            return None
        ev0 = torch.cuda.Event(enable_timing=True)
        ev0.record(stream)
        return ev0

    def _pack_finished(self, handle: object, seq: int) -> None:
        """Trace: a chunk's gather was seen done (and its GPU time, when timed)."""
        if self.trace is None:
            return
        self._note("packed", seq)
        if isinstance(handle, tuple) and handle[2] is not None:
            self.gpu_trace.append(("gather", seq, float(handle[2].elapsed_time(handle[0])) * 1e3))

    @staticmethod
    def _pack_done(handle: object) -> bool:
        if isinstance(handle, cf.Future):
            return handle.done()
        return bool(handle[0].query())  # type: ignore[index]

    @staticmethod
    def _pack_result(handle: object) -> int:
        if isinstance(handle, cf.Future):
            return int(handle.result())
        return int(handle[1])  # type: ignore[index]

    def _pack_cpu(self, ids: np.ndarray, r0: int, r1: int, slot: int) -> int:
        """Runs on the packer thread (CPU tensors); returns once the slot holds the bytes."""
        return pack_blocks(self.views[r0:r1], torch.from_numpy(ids), self.send_pool.slot(slot))

    # -------------------------------------------------------------- staged READ
    def request_pull(self, peer: str, remote_ids: npt.ArrayLike, local_ids: npt.ArrayLike,
                     xfer_id: str, *, timeout_s: float = 30.0) -> None:
        """Ask ``peer`` to push its ``remote_ids`` into our ``local_ids`` (staged READ).

        The request is followed by our grant of receive slots for it (at once when slots
        are free, else when they come free), valid ``timeout_s``."""
        _check_xfer_id(xfer_id)
        rids, lids = as_ids(remote_ids), as_ids(local_ids)
        if rids.shape != lids.shape:
            raise ValueError("remote and local id counts differ")
        check_ids(lids, self.layout.num_blocks, side="local", unique=True)
        self.ep.send_notif(peer, wire.encode(wire.StagedPull(xfer_id, rids, lids)))
        self._remember_ids((peer, xfer_id), lids)
        if lids.shape[0]:
            want = self._want(int(lids.shape[0]), self.recv_pool.slot_bytes)
            self._send_handouts(self.grants.request(peer, xfer_id, want, timeout_s))

    def wait_complete(self, xfer_id: str, *, timeout_s: float,
                      idle: Callable[[], object] | None = None) -> str:
        """Wait (bounded backoff) until an incoming transfer finished; returns the peer."""
        deadline = time.monotonic() + timeout_s
        delay = POLL_MIN_S
        poll_max = GPU_POLL_MAX_S if self.cuda else POLL_MAX_S
        while True:
            if self.progress():
                delay = POLL_MIN_S
            if xfer_id in self.completed:
                return self.completed.pop(xfer_id)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"staged transfer {xfer_id} not complete after {timeout_s:.3f}s")
            if idle is not None:
                idle()
            delay = self._nap(delay, self.busy, poll_max)

    def take_pull(self) -> tuple[str, str, StagingInfo | None, np.ndarray, np.ndarray] | None:
        """The oldest queued pull request ``(peer, xfer_id, None, src ids, dst ids)``, or
        None: for owners that serve pulls themselves (after checks) with :meth:`send`.
        (The third field, once the reader's pool, is None: the reader's grant says where.)"""
        return self._pulls.popleft() if self._pulls else None

    def drop_pull(self, peer: str, xfer_id: str) -> None:
        """An owner will not answer this pull: give the reader's slots back."""
        if self._outgoing.pop((peer, xfer_id), None) is not None:
            self.ep.send_notif(peer, wire.encode(wire.StagedRelease(xfer_id)))

    def serve_pulls(self, *, timeout_s: float, idle: Callable[[], object] | None = None) -> int:
        """Answer queued pull requests with staged WRITEs; returns how many were served.

        Not run inside the notification handler: a send polls notifications itself.
        """
        served = 0
        while self._pulls:
            peer, xfer_id, info, src, dst = self._pulls.popleft()
            self.send(peer, info, src, dst, xfer_id, timeout_s=timeout_s, idle=idle)
            served += 1
        return served

    # -------------------------------------------------------------- receiver
    def _send_handouts(self, handouts: Sequence[Handout]) -> None:
        i = self._recv_info
        for h in handouts:
            if h.peer == LOCAL:  # slots of the shared pool for a send of ours
                q = self._local_free.get(h.xfer_id)
                if q is not None:
                    q.extend(h.slots)
                else:  # that send is over: straight back
                    self._send_handouts(self.grants.release(LOCAL, h.xfer_id))
                continue
            self.ep.send_notif(h.peer, wire.encode(wire.StagedGrant(
                h.xfer_id, list(h.slots), i.base_addr, i.slot_bytes, i.mem_type, i.device_id)))

    def _on_notif(self, peer: str, msg: bytes) -> None:
        try:
            m = wire.decode(msg)
        except wire.WireError as e:
            self.bad_messages += 1
            log.warning("kvbaton: staging message from %s dropped: %s", peer, e)
            return
        key = (peer, str(getattr(m, "xfer_id", "")))
        if isinstance(m, wire.StagedAck):
            out = self._outgoing.get(key)
            if out is not None:
                out.acks.append((m.slot, m.seq, m.keep))
        elif isinstance(m, wire.StagedGrant):
            out = self._outgoing.get(key)
            if out is None:  # we gave up on it (or never asked): hand the slots back
                self.ep.send_notif(peer, wire.encode(wire.StagedRelease(m.xfer_id)))
                return
            out.grant = m
            out.idle.extend(m.slots)
        elif isinstance(m, wire.StagedDeny):
            out = self._outgoing.get(key)
            if out is not None:
                out.denied = m.reason or "refused"
        elif isinstance(m, wire.StagedChunk):
            self._on_chunk(peer, m)
        elif isinstance(m, wire.StagedGrantRequest):
            if m.xfer_id in self._cancelled:
                self.ep.send_notif(peer, wire.encode(wire.StagedDeny(m.xfer_id, "cancelled by the receiver")))
                return
            try:
                check_ids(m.dst, self.layout.num_blocks, side="staged destination", unique=True)
                self._send_handouts(self.grants.request(peer, m.xfer_id, m.want, m.ttl_ms / 1e3))
            except ValueError as e:
                self.ep.send_notif(peer, wire.encode(wire.StagedDeny(m.xfer_id, str(e))))
                return
            self._remember_ids(key, m.dst)
        elif isinstance(m, wire.StagedRelease):
            self._recv_counts.pop(key, None)
            self._forget_ids(key)
            self._send_handouts(self.grants.release(peer, m.xfer_id))
        elif isinstance(m, wire.StagedPull):
            self._outgoing[key] = _Outgoing(time.monotonic(), pulled=True)
            self._pulls.append((peer, m.xfer_id, None, m.src, m.dst))
            while len(self._outgoing) > 4096:  # pulls an owner never took or dropped
                old = next(iter(self._outgoing))
                if not self._outgoing[old].pulled:
                    break
                del self._outgoing[old]

    def _on_chunk(self, peer: str, m: wire.StagedChunk) -> None:
        if not self.grants.owns(peer, m.xfer_id, m.slot):
            # never scatter a slot its sender does not hold (expired grant, buggy peer)
            self.dropped_chunks += 1
            log.warning("kvbaton: staged chunk %s/%d from %s in slot %d it does not hold: dropped",
                        m.xfer_id, m.seq, peer, m.slot)
            return
        if m.xfer_id in self._cancelled:  # the receiver gave up: free the slot, keep the blocks
            self._chunk_done(peer, m.xfer_id, m.slot, m.seq, m.nchunks)
            return
        key = (peer, m.xfer_id)
        all_ids = self._dst_ids.get(key)
        nb = (m.r1 - m.r0) * (m.b1 - m.b0) * self.layout.bytes_per_block
        if (all_ids is None or not (0 <= m.r0 < m.r1 <= self.layout.num_regions)
                or not (0 <= m.b0 < m.b1 <= all_ids.shape[0]) or nb > self.recv_pool.slot_bytes):
            self.dropped_chunks += 1
            log.warning("kvbaton: staged chunk %s/%d from %s does not match its transfer: dropped",
                        m.xfer_id, m.seq, peer)
            return
        self._note("chunk", m.seq)
        if not self.cuda:
            unpack_blocks(self.views[m.r0:m.r1], torch.from_numpy(all_ids[m.b0:m.b1].copy()),
                          self.recv_pool.slot(m.slot))
            self._chunk_done(peer, m.xfer_id, m.slot, m.seq, m.nchunks)
            return
        self._unpacking.append(self._start_unpack(peer, m, all_ids))
        self._finish_unpacks()

    def _remember_ids(self, key: tuple[str, str], ids: np.ndarray) -> None:
        self._dst_ids[key] = np.array(ids, dtype=np.int64)  # a writable copy (pinned later)
        self._dst_dev.pop(key, None)
        while len(self._dst_ids) > 1024:  # transfers whose sender vanished
            old, _ = self._dst_ids.popitem(last=False)
            self._dst_dev.pop(old, None)

    def _forget_ids(self, key: tuple[str, str]) -> None:
        self._dst_ids.pop(key, None)
        self._dst_dev.pop(key, None)

    def _start_unpack(self, peer: str, m: wire.StagedChunk, all_ids: np.ndarray) -> _Unpack:
        """Enqueue a chunk's scatter on the unpack stream; its event says when it is out.
        The transfer's ids go to the GPU once, with its first chunk."""
        assert self._unpack_stream is not None
        key = (peer, m.xfer_id)
        self._on_device()
        with torch.cuda.stream(self._unpack_stream):
            ev0 = self._timing_event(self._unpack_stream)
            dev = self._dst_dev.get(key)
            if dev is None:
                host = torch.from_numpy(all_ids).pin_memory()
                dev = self._dst_dev[key] = (host, host.to(self.device, non_blocking=True))
            ids_dev = dev[1][m.b0:m.b1]
            src = self.recv_pool.slot(m.slot)
            if self.copier is not None and m.r1 - m.r0 >= self.kernel_min_regions:
                self.copier.scatter(ids_dev, m.r0, m.r1, src)
            else:
                unpack_blocks(self.views[m.r0:m.r1], ids_dev, src, self._groups(m.r0, m.r1))
            ev = torch.cuda.Event(enable_timing=ev0 is not None)
            ev.record(self._unpack_stream)
        self._note("unpack", m.seq)
        return _Unpack(peer, m.xfer_id, m.slot, m.seq, m.nchunks, ev, dev, ev0)

    def _finish_unpacks(self) -> bool:
        """Ack every chunk whose scatter finished (one stream: they finish in order)."""
        done = False
        while self._unpacking and self._unpacking[0].event.query():  # type: ignore[attr-defined]
            u = self._unpacking.popleft()
            if self.trace is not None:
                self._note("scattered", u.seq)
                if u.start is not None:
                    self.gpu_trace.append(("scatter", u.seq, float(u.start.elapsed_time(u.event)) * 1e3))  # type: ignore[attr-defined]
            self._chunk_done(u.peer, u.xfer_id, u.slot, u.seq, u.nchunks)
            done = True
        return done

    def _chunk_done(self, peer: str, xfer_id: str, slot: int, seq: int, nchunks: int) -> None:
        """A chunk is in the KV blocks: tell the sender (and whether it keeps the slot),
        hand freed slots to others, count the transfer."""
        keep, handouts = self.grants.chunk_done(peer, xfer_id, slot, nchunks)
        self.ep.send_notif(peer, wire.encode(wire.StagedAck(xfer_id, slot, seq, keep)))
        self._send_handouts(handouts)
        self._note("acked", seq)
        key = (peer, xfer_id)
        got = self._recv_counts.get(key, 0) + 1
        if got >= nchunks:
            self._recv_counts.pop(key, None)
            self._forget_ids(key)
            if xfer_id in self._cancelled:
                return
            self.completed[xfer_id] = peer
            if self._on_complete is not None:
                self._on_complete(peer, xfer_id)
        else:
            self._recv_counts[key] = got


class StagedSend:
    """One staged WRITE in progress (sender side), advanced by :meth:`step`, never blocking.

    It asks the receiver for slots (unless it answers the receiver's pull, which came with
    a grant), packs chunks into free send slots, WRITEs each packed chunk into a receive
    slot it holds (with a :class:`~kvbaton.connector.wire.StagedChunk` notification),
    frees a send slot once its WRITE is done and a receive slot once acked (or drops it
    when the ack says it went back). The caller polls notifications between steps
    (:meth:`StagedPeer.progress`). :meth:`close` always runs at the end (done, failed or
    abandoned): it cancels what is still in flight and, when nothing of ours can still
    land, gives the receiver its slots back.
    """

    def __init__(self, sp: StagedPeer, peer: str, remote: StagingInfo | None, local_ids: npt.ArrayLike,
                 remote_ids: npt.ArrayLike, xfer_id: str, *, timeout_s: float) -> None:
        _check_xfer_id(xfer_id)
        lids, rids = as_ids(local_ids), as_ids(remote_ids)
        if lids.shape != rids.shape:
            raise ValueError(f"local and remote id counts differ: {lids.shape[0]} vs {rids.shape[0]}")
        check_ids(lids, sp.layout.num_blocks, side="local", unique=False)
        if rids.shape[0] and (rids.min() < 0 or np.unique(rids).shape[0] != rids.shape[0]):
            raise ValueError("remote (destination) block ids must be unique and non-negative")
        self.sp, self.peer, self.xfer_id, self.timeout_s = sp, peer, xfer_id, timeout_s
        self.lids, self.rids = lids, rids
        self.key = (peer, xfer_id)
        n = int(lids.shape[0])
        self.nbytes = n * sp.block_bytes
        self.deadline = time.monotonic() + timeout_s
        self.tiles: list[tuple[int, int, int, int]] | None = None
        self.nchunks = 0
        self.next_c = self.acked = 0
        # our send slots: the whole send pool, or (shared pool) what our grant holds
        self.local_free = collections.deque(() if sp.shared else range(sp.send_pool.num_slots))
        self.packing: collections.deque[tuple[int, int, int, object]] = collections.deque()
        #: packed chunks waiting for a receive slot: (chunk, send slot, receive slot or -1, bytes)
        self.ready: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self.inflight: dict[int, tuple[int, int, Transfer]] = {}  # send slot → (recv slot, seq, WRITE)
        #: finished WRITE requests by (send slot, receive slot, bytes, receiver's pool), posted again
        self.requests: dict[tuple[int, int, int, int], Transfer] = {}
        self.progressed = False
        self.closed = self.ok = False
        out = sp._outgoing.get(self.key)
        if n == 0:
            self.tiles, self.ok = [], True
            if out is not None and out.pulled:  # an empty pull: hand its grant back
                del sp._outgoing[self.key]
                sp.ep.send_notif(peer, wire.encode(wire.StagedRelease(xfer_id)))
            self.out = _Outgoing(time.monotonic())
            self.closed = True
            return
        if out is not None and not out.pulled:
            raise ValueError(f"staged transfer {xfer_id} to {peer} is already in progress")
        if out is None:
            out = sp._outgoing[self.key] = _Outgoing(time.monotonic())
            rslot = remote.slot_bytes if remote is not None else sp._send_info.slot_bytes
            want = min(sp._want(n, rslot), remote.num_slots if remote is not None else 1 << 30)
            sp.ep.send_notif(peer, wire.encode(wire.StagedGrantRequest(
                xfer_id, want, max(1, int(timeout_s * 1e3)), rids)))
        out.pulled = False
        self.out = out
        sp._note("send", 0)
        self.ids_dev: torch.Tensor | None = None
        if sp.cuda:
            assert sp._pack_stream is not None
            # the gathers read what the engine's stream wrote: order after it
            sp._pack_stream.wait_stream(torch.cuda.current_stream(sp.device))
            with torch.cuda.device(sp.device), torch.cuda.stream(sp._pack_stream):
                self.ids_dev = torch.from_numpy(lids).pin_memory().to(sp.device, non_blocking=True)

    @property
    def done(self) -> bool:
        return self.tiles is not None and self.acked >= self.nchunks

    @property
    def active(self) -> bool:
        """Chunks packing or in flight (the GPU pace of polling applies)."""
        return bool(self.packing or self.inflight or self.next_c)

    def step(self) -> bool:
        """One non-blocking turn; True once every chunk is acked. Raises on a refusal, a
        failed WRITE or past the deadline (then :meth:`close`)."""
        if self.done:
            return True
        sp, out = self.sp, self.out
        self.progressed = False
        if out.denied:
            raise RuntimeError(f"{self.peer} refused staged transfer {self.xfer_id}: {out.denied}")
        g = out.grant
        if self.tiles is None and g is not None:
            n = int(self.lids.shape[0])
            self.tiles = plan_tiles(n, sp.layout.num_regions, sp.layout.bytes_per_block,
                                    sp.tile_bytes(n, g.slot_bytes))
            self.nchunks = len(self.tiles)
            sp.last_send_chunks = self.nchunks
            if sp.shared and self.nchunks:  # our slots: granted from the pool we share
                sp._local_free[self.xfer_id] = self.local_free
                sp._send_handouts(sp.grants.request(LOCAL, self.xfer_id, self.nchunks,
                                                    max(1e-3, self.deadline - time.monotonic())))
            sp._note("grant", 0)
        if self.tiles is not None and g is not None:
            tiles = self.tiles
            # Gather ahead: a free send slot is packed at once; a receive slot is needed
            # only to post. (Packing only once both were free put the gather on every
            # receive slot's round trip: measured ~0.26 of its ~0.9 ms on an H200.)
            while self.next_c < self.nchunks and self.local_free and (sp.gather_ahead or out.idle):
                ls = self.local_free.popleft()
                r0, r1, b0, b1 = tiles[self.next_c]
                self.packing.append((self.next_c, ls, -1 if sp.gather_ahead else out.idle.popleft(),
                                     sp._start_pack(self.lids, self.ids_dev, b0, b1, r0, r1, ls)))
                sp._note("pack", self.next_c)
                self.next_c += 1
            while self.packing and sp._pack_done(self.packing[0][3]):
                c, ls, rs, handle = self.packing.popleft()
                sp._pack_finished(handle, c)
                self.ready.append((c, ls, rs, sp._pack_result(handle)))
            while self.ready and (self.ready[0][2] >= 0 or out.idle):
                c, ls, rs, nbytes = self.ready.popleft()
                if rs < 0:
                    rs = out.idle.popleft()
                sp._note("posting", c)
                r0, r1, b0, b1 = tiles[c]
                msg = wire.encode(wire.StagedChunk(self.xfer_id, rs, c, self.nchunks, r0, r1, b0, b1))
                self.inflight[ls] = (rs, c, self._post(ls, rs, nbytes, g, msg))
                sp._note("post", c)
                self.progressed = True
            for ls, (rs, c, x) in list(self.inflight.items()):
                st = sp.ep.state(x)
                if st == "ERR":
                    raise RuntimeError(f"staged WRITE into slot {rs} of {self.peer} failed")
                if st == "DONE":
                    if not sp.reuse_requests:
                        sp.ep.release(x)
                    del self.inflight[ls]
                    self._slot_written(ls)  # our copy is out: the send slot is free
                    sp._note("wrote", c)
                    self.progressed = True
            while out.acks:
                rs, seq, keep = out.acks.popleft()
                sp._note("ack", seq)
                self.acked += 1
                if keep:
                    out.idle.append(rs)
                self.progressed = True
            if self.acked >= self.nchunks:
                self.ok = True
                return True
        if time.monotonic() >= self.deadline:
            raise TimeoutError(f"staged transfer {self.xfer_id} to {self.peer}: {self.acked}/"
                               f"{self.nchunks or '?'} chunks acked after {self.timeout_s:.3f}s"
                               + ("" if g is not None else " (no grant from the receiver)"))
        return False

    def _slot_written(self, ls: int) -> None:
        """A chunk's WRITE is done: its send slot packs the next chunk, or (shared pool,
        over our fair share or no more chunks) goes back to the grants."""
        sp = self.sp
        if not sp.shared:
            self.local_free.append(ls)
            return
        keep, handouts = sp.grants.chunk_done(LOCAL, self.xfer_id, ls, self.nchunks)
        if keep:
            self.local_free.append(ls)
        sp._send_handouts(handouts)

    def _post(self, ls: int, rs: int, nbytes: int, g: wire.StagedGrant, msg: bytes) -> Transfer:
        """WRITE send slot ``ls`` into receive slot ``rs``: the request made for this slot pair
        and size before is posted again (kept until :meth:`close`), else a new one."""
        sp = self.sp
        key = (ls, rs, nbytes, g.base_addr)
        x = self.requests.get(key) if sp.reuse_requests else None
        if x is not None:
            sp.ep.repost(x, msg)
            return x
        mine = sp._send_info
        plan = plan_contiguous(mine.slot_addr(ls), g.slot_addr(rs), nbytes,
                               local_dev=mine.device_id, remote_dev=g.device_id,
                               local_mem_type=mine.mem_type, remote_mem_type=g.mem_type)
        x = sp.ep.write(plan, self.peer, msg)
        if sp.reuse_requests:
            self.requests[key] = x
        return x

    def pack_future(self) -> cf.Future[int] | None:
        """The CPU pack the next WRITE waits for, when nothing is in flight (to sleep on)."""
        if (self.packing and not self.inflight and not self.ready
                and isinstance(self.packing[0][3], cf.Future)):
            return self.packing[0][3]
        return None

    def close(self) -> None:
        """Release anything in flight (cancels it) and the grant's bookkeeping; idempotent."""
        if self.closed:
            return
        self.closed = True
        sp = self.sp
        writes_open = bool(self.inflight)
        for _, _, x in self.inflight.values():
            sp.ep.release(x)  # cancels anything still in flight
        for x in self.requests.values():
            sp.ep.release(x)  # finished requests kept for reposting (released once: no-op)
        self.requests.clear()
        for _, _, _, h in self.packing:
            if isinstance(h, cf.Future):
                h.cancel()
        if sp._pack_stream is not None and self.packing:
            sp._pack_stream.synchronize()  # no gather may still write a slot we reuse
        if sp.shared and sp._local_free.get(self.xfer_id) is self.local_free:
            del sp._local_free[self.xfer_id]
            self.local_free.clear()
            sp._send_handouts(sp.grants.release(LOCAL, self.xfer_id))  # our send slots
        if sp._outgoing.get(self.key) is self.out:
            del sp._outgoing[self.key]
        if not self.ok and not writes_open and not self.out.denied:
            # nothing of ours can still land: give the receiver its slots back now
            # (with a WRITE in flight we cannot know that; the grant expires instead)
            try:
                sp.ep.send_notif(self.peer, wire.encode(wire.StagedRelease(self.xfer_id)))
            except Exception as e:  # noqa: BLE001 - best effort; the grant expires anyway
                log.debug("kvbaton: release of %s to %s not sent: %r", self.xfer_id, self.peer, e)
        sp._note("done", self.acked)


def _check_xfer_id(xfer_id: str) -> None:
    if not xfer_id or any(c.isspace() for c in xfer_id):
        raise ValueError(f"transfer id must be non-empty without whitespace: {xfer_id!r}")
