"""The staging pools an engine allocates by default (no torch: the settings table reads them)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PoolDefaults:
    """Staging pools an engine allocates when the settings leave them at 0."""

    slot_bytes: int
    slots: int          # receive slots (granted to senders)
    send_slots: int     # send slots (a slot is free again once its WRITE is done)
    target_chunks: int  # chunks a transfer aims to be cut into (at most a slot each)
    shared: bool = False  # one pool of slots + send_slots for both directions (StagedPeer(shared=))

    @property
    def total_bytes(self) -> int:
        """Staging memory per engine (both pools)."""
        return self.slot_bytes * (self.slots + self.send_slots)


# Chosen from measurement (benchmarks/results/datapath_gpu_sweep.md, one H200): the
# fastest shape within 256 MiB per engine at 1k, 4k and 16k tokens. Few, large chunks:
# each chunk's round trip (gather, WRITE, notification, scatter, ack) costs ~0.8-1.3 ms
# there (two engines time-slicing one GPU: benchmarks/results/gpu_timeslice_h200x1.json),
# so slots in flight, not bytes, bound the rate. One direction alone gets all 4 slots
# (SlotGrants(sending=)); 2 × 128 MiB was not reliably faster and keeps only one slot per
# direction when both are in use (benchmarks/results/datapath_gpu_h200x1*.md).
GPU_POOL = PoolDefaults(slot_bytes=64 << 20, slots=2, send_slots=2, target_chunks=4, shared=True)
HOST_POOL = PoolDefaults(slot_bytes=2 << 20, slots=4, send_slots=4, target_chunks=16)


def default_pool(device: str) -> PoolDefaults:
    """The shipped staging pools for ``device`` ("cuda" or "cpu")."""
    return GPU_POOL if device == "cuda" else HOST_POOL
