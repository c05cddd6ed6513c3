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
small chunks). A single packer thread packs chunk i+1 while the owner thread posts and
waits for chunk i's WRITE (on host memory UCX copies inside the post call with the GIL
released; on GPUs the WRITE is asynchronous), and the receiver unpacks chunk i while
chunk i+1 flies. Slots are a fixed pool on both sides,
reused: a slot is free again once its WRITE is done *and* the receiver acked its unpack.

Protocol (NIXL notifications, which arrive after the data they follow):

* ``KVBS/C <xfer> <slot> <seq> <nchunks> <r0> <r1>\\n<dst ids int64>`` — regions
  ``r0..r1`` of blocks ``dst ids`` landed in ``slot``.
* ``KVBS/A <xfer> <slot> <seq>`` — receiver unpacked it; the slot may be reused.
* ``KVBS/P <xfer> <n> <base> <slot_bytes> <num_slots> <dev>\\n<src ids><dst ids>`` — pull:
  please push these blocks to me (the staged form of a READ: the owner of the data must
  pack, so a staged READ is a request that the peer answers with a staged WRITE).

The same code runs on CPU tensors (CI) and CUDA tensors (a side stream per direction).
All methods run on the endpoint's owner thread except the packing itself.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

from .descriptors import as_ids, check_ids, plan_contiguous
from .geometry import LAYOUT_KV_SPLIT, KvLayout
from .nixl_agent import POLL_MAX_S, POLL_MIN_S, NixlEndpoint, Transfer

Strategy = Literal["runs", "pack"]
_CHUNK, _ACK, _PULL = b"KVBS/C ", b"KVBS/A ", b"KVBS/P "
PREFIX = b"KVBS/"


# ---------------------------------------------------------------------------- policy
@dataclasses.dataclass(frozen=True)
class PathCosts:
    """Rough cost model; defaults from measurements in shared/nixl-notes.md."""

    desc_s: float        # fixed cost per NIXL descriptor
    link_bps: float      # large-descriptor NIXL bandwidth
    pack_bps: float      # end-to-end bandwidth of the pipelined pack path
    pack_fixed_s: float  # per-transfer protocol latency of the pack path (chunk + ack)


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


def _packed(views: Sequence[torch.Tensor], n: int, buf: torch.Tensor) -> torch.Tensor:
    """``buf`` (uint8, 16-byte aligned) seen as ``[regions, n, row]`` of the views' dtype."""
    row, esize = int(views[0].shape[1]), views[0].element_size()
    nbytes = len(views) * n * row * esize
    return buf[:nbytes].view(views[0].dtype).view(len(views), n, row)


def pack_blocks(views: Sequence[torch.Tensor], ids: torch.Tensor, out: torch.Tensor) -> int:
    """Gather blocks ``ids`` of every region into ``out`` (region-major); returns bytes.

    One ``index_select`` per region: the block lists are shared by all regions, so a
    transfer of n blocks over R regions is R kernel calls, independent of fragmentation.
    """
    dst = _packed(views, int(ids.shape[0]), out)
    for r, v in enumerate(views):
        torch.index_select(v, 0, ids, out=dst[r])
    return dst.numel() * dst.element_size()


def unpack_blocks(views: Sequence[torch.Tensor], ids: torch.Tensor, src: torch.Tensor) -> None:
    """Scatter a :func:`pack_blocks` buffer into blocks ``ids`` of every region."""
    packed = _packed(views, int(ids.shape[0]), src)
    for r, v in enumerate(views):
        v.index_copy_(0, ids, packed[r])


# ---------------------------------------------------------------------------- protocol
class StagedPeer:
    """Both roles of the pack path for one endpoint: sender (:meth:`send`) and receiver
    (unpack + ack, answered from :meth:`NixlEndpoint.poll_notifs`)."""

    def __init__(self, endpoint: NixlEndpoint, tensors: Sequence[torch.Tensor],
                 layout: KvLayout, *, slot_bytes: int, num_slots: int = 4,
                 on_complete: Callable[[str, str], None] | None = None) -> None:
        """Allocate and register two pools (send and receive, so both directions can run
        at once without sharing slots) of ``num_slots × slot_bytes`` on the KV's device.

        One incoming staged transfer at a time per :class:`StagedPeer`: the receive slots
        are addressed by the sender, so concurrent senders need separate peers/pools.
        """
        self.ep = endpoint
        self.layout = layout
        self.views = region_byte_views(tensors, layout)
        self.device = tensors[0].device
        self.send_pool = StagingPool(slot_bytes, num_slots, self.device)
        self.recv_pool = StagingPool(slot_bytes, num_slots, self.device)
        self.send_pool.register(endpoint)
        self.recv_pool.register(endpoint)
        self._send_info = self.send_pool.info()
        self._packer = cf.ThreadPoolExecutor(1, thread_name_prefix="kvbaton-pack")
        cuda = self.device.type == "cuda"
        self._pack_stream = torch.cuda.Stream(self.device) if cuda else None
        self._unpack_stream = torch.cuda.Stream(self.device) if cuda else None
        self._acks: dict[str, set[int]] = {}
        self._recv_counts: dict[str, int] = {}
        self.completed: dict[str, str] = {}  # xfer_id → peer, for finished incoming transfers
        self._pulls: collections.deque[tuple[str, str, StagingInfo, np.ndarray, np.ndarray]] = \
            collections.deque()
        self._on_complete = on_complete
        endpoint.on_notif(PREFIX, self._on_notif)

    def info(self) -> StagingInfo:
        """Where peers WRITE into us (publish it with the KV geometry)."""
        return self.recv_pool.info()

    @property
    def block_bytes(self) -> int:
        """Bytes one block id moves (all regions)."""
        return self.layout.bytes_per_block * self.layout.num_regions

    def close(self) -> None:
        self._packer.shutdown(wait=True)

    def forget(self, xfer_id: str) -> None:
        """Drop receive-side state of an incoming transfer whose sender gave up."""
        self._recv_counts.pop(xfer_id, None)
        self.completed.pop(xfer_id, None)

    # -------------------------------------------------------------- sender
    def send(self, peer: str, remote: StagingInfo, local_ids: npt.ArrayLike,
             remote_ids: npt.ArrayLike, xfer_id: str, *, timeout_s: float,
             idle: Callable[[], object] | None = None) -> int:
        """Staged WRITE of local blocks into the peer's blocks; returns bytes moved.

        Returns once the receiver acked every chunk (its blocks hold the data).
        """
        _check_xfer_id(xfer_id)
        lids, rids = as_ids(local_ids), as_ids(remote_ids)
        if lids.shape != rids.shape:
            raise ValueError(f"local and remote id counts differ: {lids.shape[0]} vs {rids.shape[0]}")
        check_ids(lids, self.layout.num_blocks, side="local", unique=False)
        if rids.shape[0] and (rids.min() < 0 or np.unique(rids).shape[0] != rids.shape[0]):
            raise ValueError("remote (destination) block ids must be unique and non-negative")
        mine = self._send_info
        nslots = min(mine.num_slots, remote.num_slots)
        n = int(lids.shape[0])
        if n == 0:
            return 0
        tiles = plan_tiles(n, self.layout.num_regions, self.layout.bytes_per_block,
                           min(mine.slot_bytes, remote.slot_bytes))
        nchunks = len(tiles)
        deadline = time.monotonic() + timeout_s
        acks = self._acks.setdefault(xfer_id, set())
        free = collections.deque(range(nslots))
        packing: collections.deque[tuple[int, int, cf.Future[int]]] = collections.deque()
        inflight: dict[int, Transfer] = {}
        written: set[int] = set()
        next_c = acked = 0
        delay = POLL_MIN_S
        try:
            while acked < nchunks:
                progressed = False
                while next_c < nchunks and free:
                    slot = free.popleft()
                    r0, r1, b0, b1 = tiles[next_c]
                    packing.append((next_c, slot, self._packer.submit(
                        self._pack, lids[b0:b1], r0, r1, slot)))
                    next_c += 1
                if packing and packing[0][2].done():
                    c, slot, fut = packing.popleft()
                    nbytes = fut.result()
                    r0, r1, b0, b1 = tiles[c]
                    msg = (_CHUNK + f"{xfer_id} {slot} {c} {nchunks} {r0} {r1}\n".encode()
                           + rids[b0:b1].astype("<i8").tobytes())
                    plan = plan_contiguous(mine.slot_addr(slot), remote.slot_addr(slot), nbytes,
                                           local_dev=mine.device_id, remote_dev=remote.device_id,
                                           local_mem_type=mine.mem_type,
                                           remote_mem_type=remote.mem_type)
                    inflight[slot] = self.ep.write(plan, peer, msg)
                    progressed = True
                for slot, x in list(inflight.items()):
                    st = self.ep.state(x)
                    if st == "ERR":
                        raise RuntimeError(f"staged WRITE of slot {slot} to {peer} failed")
                    if st == "DONE":
                        self.ep.release(x)
                        del inflight[slot]
                        written.add(slot)
                        progressed = True
                self.ep.poll_notifs()
                for slot in list(acks & written):
                    acks.discard(slot)
                    written.discard(slot)
                    free.append(slot)
                    acked += 1
                    progressed = True
                if acked >= nchunks:
                    break
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"staged transfer {xfer_id} to {peer}: {acked}/{nchunks} "
                                       f"chunks acked after {timeout_s:.3f}s")
                if progressed:
                    delay = POLL_MIN_S
                    continue
                if idle is not None:
                    idle()
                if packing and not inflight:
                    cf.wait([packing[0][2]], timeout=delay)  # sleeps until packed, bounded
                else:
                    time.sleep(delay)
                delay = min(delay * 2, POLL_MAX_S)
        finally:
            for x in inflight.values():
                self.ep.release(x)  # cancels anything still in flight
            for _, _, fut in packing:
                fut.cancel()
            self._acks.pop(xfer_id, None)
        return n * self.block_bytes

    def _pack(self, ids: np.ndarray, r0: int, r1: int, slot: int) -> int:
        """Runs on the packer thread; returns once the slot holds the bytes.

        On CUDA the id upload and the gathers are on a side stream, synchronized before
        the slot is handed to NIXL. Ordering against the engine's writes of these blocks
        is the caller's (the blocks belong to a finished request).
        """
        if self._pack_stream is None:
            return pack_blocks(self.views[r0:r1], torch.from_numpy(ids), self.send_pool.slot(slot))
        with torch.cuda.stream(self._pack_stream):
            ids_dev = torch.from_numpy(ids).to(self.device, non_blocking=False)
            nbytes = pack_blocks(self.views[r0:r1], ids_dev, self.send_pool.slot(slot))
        self._pack_stream.synchronize()
        return nbytes

    # -------------------------------------------------------------- staged READ
    def request_pull(self, peer: str, remote_ids: npt.ArrayLike, local_ids: npt.ArrayLike,
                     xfer_id: str) -> None:
        """Ask ``peer`` to push its ``remote_ids`` into our ``local_ids`` (staged READ)."""
        _check_xfer_id(xfer_id)
        rids, lids = as_ids(remote_ids), as_ids(local_ids)
        if rids.shape != lids.shape:
            raise ValueError("remote and local id counts differ")
        check_ids(lids, self.layout.num_blocks, side="local", unique=True)
        i = self.info()
        hdr = f"{xfer_id} {lids.shape[0]} {i.base_addr} {i.slot_bytes} {i.num_slots} {i.mem_type} {i.device_id}\n"
        self.ep.send_notif(peer, _PULL + hdr.encode() + rids.astype("<i8").tobytes()
                           + lids.astype("<i8").tobytes())

    def wait_complete(self, xfer_id: str, *, timeout_s: float,
                      idle: Callable[[], object] | None = None) -> str:
        """Wait (bounded backoff) until an incoming transfer finished; returns the peer."""
        deadline = time.monotonic() + timeout_s
        delay = POLL_MIN_S
        while True:
            self.ep.poll_notifs()
            if xfer_id in self.completed:
                return self.completed.pop(xfer_id)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"staged transfer {xfer_id} not complete after {timeout_s:.3f}s")
            if idle is not None:
                idle()
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

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
    def _on_notif(self, peer: str, msg: bytes) -> None:
        if msg.startswith(_ACK):
            xfer_id, slot, _seq = msg[len(_ACK):].decode().split()
            self._acks.setdefault(xfer_id, set()).add(int(slot))
        elif msg.startswith(_CHUNK):
            head, _, body = msg.partition(b"\n")
            xfer_id, slot_s, seq, nchunks, r0, r1 = head[len(_CHUNK):].decode().split()
            slot = int(slot_s)
            ids = np.frombuffer(body, dtype="<i8")
            self._unpack(ids, int(r0), int(r1), slot)
            self.ep.send_notif(peer, _ACK + f"{xfer_id} {slot} {seq}".encode())
            got = self._recv_counts.get(xfer_id, 0) + 1
            if got == int(nchunks):
                self._recv_counts.pop(xfer_id, None)
                self.completed[xfer_id] = peer
                if self._on_complete is not None:
                    self._on_complete(peer, xfer_id)
            else:
                self._recv_counts[xfer_id] = got
        elif msg.startswith(_PULL):
            head, _, body = msg.partition(b"\n")
            xfer_id, n, base, slot_bytes, num_slots, mem, dev = head[len(_PULL):].decode().split()
            ids = np.frombuffer(body, dtype="<i8")
            k = int(n)
            info = StagingInfo(int(base), int(slot_bytes), int(num_slots), mem, int(dev))
            self._pulls.append((peer, xfer_id, info, ids[:k].copy(), ids[k:2 * k].copy()))

    def _unpack(self, ids: np.ndarray, r0: int, r1: int, slot: int) -> None:
        check_ids(ids, self.layout.num_blocks, side="staged destination", unique=True)
        ids_t = torch.from_numpy(ids.copy())
        if self._unpack_stream is None:
            unpack_blocks(self.views[r0:r1], ids_t, self.recv_pool.slot(slot))
            return
        with torch.cuda.stream(self._unpack_stream):
            unpack_blocks(self.views[r0:r1], ids_t.to(self.device), self.recv_pool.slot(slot))
        self._unpack_stream.synchronize()  # the ack frees the slot: data must be out first


def _check_xfer_id(xfer_id: str) -> None:
    if not xfer_id or any(c.isspace() for c in xfer_id):
        raise ValueError(f"transfer id must be non-empty without whitespace: {xfer_id!r}")
