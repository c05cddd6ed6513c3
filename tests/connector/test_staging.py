"""Pack path: gather/scatter kernels, strategy policy, and staged transfers over NIXL."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

pytest.importorskip("torch")
import torch

from kvbaton.connector.transfer.descriptors import coalesce_runs
from kvbaton.connector.transfer.geometry import KvLayout
from kvbaton.connector.transfer.staging import (
    choose_strategy,
    pack_blocks,
    plan_tiles,
    region_byte_views,
    region_groups,
    unpack_blocks,
)

LAYERS, NUM_BLOCKS, TPB = 3, 80, 16
_names = itertools.count()


def kv(shape_first: str, fill: bool, dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, TPB, 2, 8) if shape_first == "kv" else (NUM_BLOCKS, 2, TPB, 2, 8)
    ts = [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
    if fill:
        for t in ts:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                    dtype=torch.uint8))
    return ts


def checksum(tensors: list[torch.Tensor], ids: np.ndarray, block_dim: int) -> list[int]:
    """Per-tensor sum of the raw bytes of the given blocks, in id order (order-sensitive)."""
    idx = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    out = []
    for t in tensors:
        b = t.index_select(block_dim, idx).contiguous().view(torch.uint8).to(torch.int64).flatten()
        out.append(int((b * torch.arange(1, b.numel() + 1)).sum()))
    return out


@pytest.mark.parametrize("shape_first", ["kv", "block"])
@pytest.mark.parametrize("seed", range(4))
def test_pack_unpack_roundtrip(shape_first: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    src, dst = kv(shape_first, True), kv(shape_first, False)
    ls, ld = KvLayout.from_tensors(src, TPB), KvLayout.from_tensors(dst, TPB)
    vs, vd = region_byte_views(src, ls), region_byte_views(dst, ld)
    n = int(rng.integers(1, NUM_BLOCKS))
    sids, dids = rng.permutation(NUM_BLOCKS)[:n], rng.permutation(NUM_BLOCKS)[:n]
    buf = torch.empty(n * ls.bytes_per_block * ls.num_regions + 100, dtype=torch.uint8)
    nbytes = pack_blocks(vs, torch.from_numpy(sids), buf)
    assert nbytes == n * ls.bytes_per_block * ls.num_regions
    unpack_blocks(vd, torch.from_numpy(dids), buf)
    bd = 1 if shape_first == "kv" else 0
    assert checksum(dst, dids, bd) == checksum(src, sids, bd)
    rest = np.setdiff1d(np.arange(NUM_BLOCKS), dids)
    assert all(int(t.index_select(bd, torch.from_numpy(rest)).view(torch.uint8).sum()) == 0
               for t in dst)


@pytest.mark.parametrize("shape_first", ["kv", "block"])
def test_region_groups_merge_a_layers_k_and_v(shape_first: str) -> None:
    """K and V of one layer live in one tensor, evenly spaced: one merged view per layer
    (one gather/scatter launch instead of two), and packing through the merged views gives
    the same bytes as region by region, for any region range."""
    rng = np.random.default_rng(7)
    src, dst = kv(shape_first, True), kv(shape_first, False)
    ls, ld = KvLayout.from_tensors(src, TPB), KvLayout.from_tensors(dst, TPB)
    vs, vd = region_byte_views(src, ls), region_byte_views(dst, ld)
    groups = region_groups(vs)
    if shape_first == "block":  # a block holds K and V together: one region per layer
        assert [(i, j) for i, j, _ in groups] == [(0, 1), (1, 2), (2, 3)]
        ranges = [(0, 3), (1, 2)]
    else:
        assert [(i, j) for i, j, _ in groups] == [(0, 2), (2, 4), (4, 6)]
        assert all(g.shape == (2, *vs[0].shape) and g[1].data_ptr() == vs[i + 1].data_ptr()
                   and g[1].stride() == vs[i + 1].stride() for i, _, g in groups)
        assert [(i, j) for i, j, _ in region_groups(vs[1:5])] == [(0, 1), (1, 3), (3, 4)]
        ranges = [(0, 6), (1, 5), (3, 4)]
    n = 29
    sids, dids = torch.from_numpy(rng.permutation(NUM_BLOCKS)[:n]), torch.from_numpy(rng.permutation(NUM_BLOCKS)[:n])
    for r0, r1 in ranges:
        size = (r1 - r0) * n * ls.bytes_per_block
        a, b = torch.zeros(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
        assert pack_blocks(vs[r0:r1], sids, a) == pack_blocks(vs[r0:r1], sids, b, region_groups(vs[r0:r1])) == size
        assert torch.equal(a, b)
        for t in dst:
            t.zero_()
        unpack_blocks(vd[r0:r1], dids, b, region_groups(vd[r0:r1]))
        for r in range(len(vs)):  # raw bytes (random bits seen as complex words hold NaNs)
            got = vd[r].index_select(0, dids).view(torch.uint8)
            want = vs[r].index_select(0, sids).view(torch.uint8) if r0 <= r < r1 else torch.zeros_like(got)
            assert torch.equal(got, want)


def test_region_views_follow_layout() -> None:
    src = kv("kv", True, torch.float32)
    lay = KvLayout.from_tensors(src, TPB)
    views = region_byte_views(src, lay)
    assert len(views) == 2 * LAYERS
    assert views[3].data_ptr() == lay.region_base_addrs[3]
    assert views[3].element_size() == 16  # widest copy word tiling a 1 KiB block
    assert torch.equal(views[3][7].view(torch.uint8), src[1][1, 7].contiguous().view(torch.uint8).flatten())
    odd = [torch.zeros(NUM_BLOCKS, 3, dtype=torch.uint8)]  # 3-byte blocks → byte copies
    assert region_byte_views(odd, KvLayout.from_tensors(odd, 1))[0].element_size() == 1


@pytest.mark.parametrize("n,regions,slot_blocks", [(1024, 128, 8192), (1024, 128, 1024),
                                                   (1000, 7, 300), (5, 3, 100), (1, 1, 1)])
def test_plan_tiles_cover_everything_once(n: int, regions: int, slot_blocks: int) -> None:
    tiles = plan_tiles(n, regions, 32768, slot_blocks * 32768 + 5)
    seen = np.zeros((regions, n), dtype=np.int64)
    for r0, r1, b0, b1 in tiles:
        assert (r1 - r0) * (b1 - b0) <= slot_blocks  # fits a slot
        seen[r0:r1, b0:b1] += 1
    assert (seen == 1).all()
    if slot_blocks >= n:  # whole regions per tile: one gather kernel per region in total
        assert sum(r1 - r0 for r0, r1, _, _ in tiles) == regions
    with pytest.raises(ValueError, match="smaller than one block"):
        plan_tiles(n, regions, 32768, 1000)


def test_choose_strategy() -> None:
    mib = 1 << 20
    # 128 big runs (contiguous 4 GiB): descriptors are cheap, pack only adds copies
    assert choose_strategy(128, 4096 * mib, device="cuda") == "runs"
    assert choose_strategy(128, 4096 * mib, device="cpu") == "runs"
    # 131k scattered 32 KiB blocks on GPUs: descriptors dominate → pack
    assert choose_strategy(131072, 4096 * mib, device="cuda") == "pack"
    # on host memory a 32 KiB block is big enough to stay per-run
    assert choose_strategy(131072, 4096 * mib, device="cpu") == "runs"
    # tiny blocks on the host → pack
    assert choose_strategy(100_000, 100_000 * 2048, device="cpu") == "pack"
    # a tiny transfer never pays the staging round trips
    assert choose_strategy(8, 8 * 2048, device="cpu") == "runs"
    assert choose_strategy(0, 0) == "runs"
    runs = len(coalesce_runs(np.arange(100), np.arange(100))[0])
    assert choose_strategy(runs * 64, 100 * 64 * 32768, device="cuda") == "runs"


# ---------------------------------------------------------------------- over NIXL
class StagedPair:
    def __init__(self, shape_first: str, slot_bytes: int, num_slots: int,
                 send_slots: int | None = None, shared: bool = False) -> None:
        pytest.importorskip("nixl")
        from kvbaton.connector.transfer.nixl_agent import NixlEndpoint
        from kvbaton.connector.transfer.staging import StagedPeer

        self.bd = 1 if shape_first == "kv" else 0
        self.a = NixlEndpoint(f"SA{next(_names)}", net_devices="lo", ucx_tls="tcp,self,sm")
        self.b = NixlEndpoint(f"SB{next(_names)}", net_devices="lo", ucx_tls="tcp,self,sm")
        self.ta, self.tb = kv(shape_first, True), kv(shape_first, False)
        self.la = KvLayout.from_tensors(self.ta, TPB)
        self.lb = KvLayout.from_tensors(self.tb, TPB)
        self.sa = StagedPeer(self.a, self.ta, self.la, slot_bytes=slot_bytes, num_slots=num_slots,
                             send_slots=send_slots, shared=shared)
        self.sb = StagedPeer(self.b, self.tb, self.lb, slot_bytes=slot_bytes, num_slots=num_slots,
                             send_slots=send_slots, shared=shared)
        self.a.add_peer(self.b.name, self.b.metadata())
        self.b.add_peer(self.a.name, self.a.metadata())

    def send_verified(self, n: int, seed: int, xfer_id: str) -> None:
        """A staged WRITE of ``n`` random blocks of A into random blocks of B, checked."""
        rng = np.random.default_rng(seed)
        src, dst = rng.permutation(NUM_BLOCKS)[:n], rng.permutation(NUM_BLOCKS)[:n]
        self.sa.send(self.b.name, self.sb.info(), src, dst, xfer_id, timeout_s=20, idle=self.b.poll_notifs)
        assert self.sb.completed.pop(xfer_id) == self.a.name
        assert checksum(self.tb, dst, self.bd) == checksum(self.ta, src, self.bd)

    def close(self) -> None:
        for s in (self.sa, self.sb):
            s.close()
        self.a.close()
        self.b.close()


@pytest.mark.nixl
@pytest.mark.parametrize("shape_first", ["kv", "block"])
@pytest.mark.parametrize("kind", ["contiguous", "fragmented"])
@pytest.mark.parametrize("shared", [False, True])
def test_staged_write_and_read(shape_first: str, kind: str, shared: bool) -> None:
    # 5 blocks per slot, 3 slots: 50 blocks → 10 chunks, every slot reused ≥ 3 times
    block_bytes = LAYERS * 2 * TPB * 2 * 8 * 2
    p = StagedPair(shape_first, slot_bytes=5 * block_bytes + 17, num_slots=3, shared=shared)
    try:
        pool = p.sa.send_pool  # bounded: 3 slots (shared: 3 + 3), rounded up to 256 B alignment only
        assert (pool is p.sa.recv_pool) is shared
        assert pool.buffer.numel() == (6 if shared else 3) * pool.slot_bytes and pool.slot_bytes < 6 * block_bytes
        rng = np.random.default_rng(11)
        if kind == "contiguous":
            src, dst = np.arange(5, 55), np.arange(20, 70)
        else:
            src, dst = rng.permutation(NUM_BLOCKS)[:50], rng.permutation(NUM_BLOCKS)[:50]
        # staged WRITE A → B
        moved = p.sa.send(p.b.name, p.sb.info(), src, dst, "x1", timeout_s=20,
                          idle=p.b.poll_notifs)
        assert moved == 50 * block_bytes
        assert p.sb.completed.pop("x1") == p.a.name
        assert checksum(p.tb, dst, p.bd) == checksum(p.ta, src, p.bd)
        # staged READ: B pulls other blocks of A into other blocks of its own
        for t in p.tb:
            t.zero_()
        src2, dst2 = rng.permutation(NUM_BLOCKS)[:33], rng.permutation(NUM_BLOCKS)[:33]
        p.sb.request_pull(p.a.name, src2, dst2, "x2")
        p.a.poll_notifs()  # A receives the request …
        for _ in range(200):
            if p.sa.serve_pulls(timeout_s=20, idle=p.b.poll_notifs):
                break
            p.b.poll_notifs()
            p.a.poll_notifs()
        else:
            pytest.fail("pull request never arrived")
        assert p.sb.wait_complete("x2", timeout_s=10) == p.a.name
        assert checksum(p.tb, dst2, p.bd) == checksum(p.ta, src2, p.bd)
    finally:
        p.close()


@pytest.mark.nixl
@pytest.mark.parametrize("ahead", [True, False])
def test_send_gathers_ahead_of_receive_slots(ahead: bool) -> None:
    """A free send slot is packed at once, before the receiver has a slot for its chunk:
    with one receive slot and three send slots, chunk 1 is gathered while chunk 0 is still
    waiting for its ack (the old order, ``gather_ahead=False``, packed a chunk only once a
    receive slot was idle: the gather sat on every receive slot's round trip). Every byte
    still lands where it belongs."""
    block_bytes = LAYERS * 2 * TPB * 2 * 8 * 2
    p = StagedPair("kv", slot_bytes=2 * block_bytes, num_slots=1, send_slots=3)
    try:
        p.sa.gather_ahead = ahead
        p.sa.trace = []
        p.send_verified(16, 5, "ga")
        at = {(what, seq): t for t, what, seq in p.sa.trace}
        assert p.sa.last_send_chunks >= 4
        # chunks are still posted one by one, in order, into the one receive slot
        posts = [at[("post", c)] for c in range(p.sa.last_send_chunks)]
        assert posts == sorted(posts)
        assert all(at[("ack", c)] < at[("post", c + 1)] for c in range(p.sa.last_send_chunks - 1))
        # the gathers of chunks 1 and 2 start before chunk 0 is acked only when gathering ahead
        assert (at[("pack", 1)] < at[("ack", 0)]) is ahead
        assert (at[("pack", 2)] < at[("ack", 0)]) is ahead
        assert not p.sb.grants.busy and p.sb.grants.free_slots() == 1
    finally:
        p.close()


@pytest.mark.nixl
@pytest.mark.parametrize("reuse", [True, False])
def test_staged_send_posts_slot_pair_requests_again(reuse: bool) -> None:
    """Each chunk's WRITE goes from a send slot into a receive slot: with ``reuse_requests``
    the request made for a (send slot, receive slot, size) is posted again for later
    chunks instead of a new one per chunk, and every byte still lands (the chunk
    notifications carry each chunk's own slot and sequence number)."""
    block_bytes = LAYERS * 2 * TPB * 2 * 8 * 2
    p = StagedPair("kv", slot_bytes=2 * block_bytes, num_slots=2, send_slots=2)
    try:
        p.sa.reuse_requests = reuse
        p.a.post_times = []
        p.send_verified(40, 9, "rr")
        n = p.sa.last_send_chunks
        assert len(p.a.post_times) == n >= 12
        made = sum(1 for init_s, _ in p.a.post_times if init_s > 0)
        # at most 2 × 2 slot pairs × 2 chunk sizes (the last chunk is shorter)
        assert made <= 8 if reuse else made == n
        assert not p.sb.grants.busy and p.sb.grants.free_slots() == 2
    finally:
        p.close()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="Linux timer slack")
def test_timer_slack_is_per_thread() -> None:
    import threading

    from kvbaton.connector.transfer.timerslack import set_timer_slack, timer_slack

    before, got = timer_slack(), []

    def run() -> None:
        got.append(set_timer_slack(2000))
        got.append(timer_slack())

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert got == [True, 2000]
    assert timer_slack() == before  # the calling thread's own slack is unchanged
    with pytest.raises(ValueError):
        set_timer_slack(0)


@pytest.mark.nixl
def test_shared_pool_both_directions_at_once() -> None:
    """One pool per engine for both directions: a lone send has every slot of both pools
    in flight (its own for packing, all of the receiver's), and two engines sending to
    each other at once share each pool through the grants (our sends are a grantee like
    any peer) without deadlock; every byte lands and both pools are whole again."""
    from kvbaton.connector.transfer.staging import LOCAL

    block_bytes = LAYERS * 2 * TPB * 2 * 8 * 2
    p = StagedPair("kv", slot_bytes=2 * block_bytes, num_slots=2, send_slots=2, shared=True)
    try:
        for t in p.ta:  # A's blocks 0..39 → B's 40..79, B's 0..39 → A's 40..79
            t[:, 40:].zero_()
        for t in p.tb:
            t.view(torch.uint8)[:, :40].copy_(torch.randint(0, 256, t.view(torch.uint8)[:, :40].shape,
                                                          dtype=torch.uint8))
            t[:, 40:].zero_()
        rng = np.random.default_rng(2)
        a_src, b_dst = rng.permutation(40), 40 + rng.permutation(40)
        b_src, a_dst = rng.permutation(40), 40 + rng.permutation(40)
        want_b = checksum(p.ta, a_src, p.bd)
        want_a = checksum(p.tb, b_src, p.bd)
        # alone: A's send holds all 4 of its slots and all 4 of B's (B sends nothing;
        # with both directions each side keeps one for the other: see SlotGrants(local=))
        most = {"local": 0, "remote": 0}
        job = p.sa.start_send(p.b.name, p.sb.info(), a_src[:20], b_dst[:20], "solo", timeout_s=20)
        deadline = time.monotonic() + 20
        while not job.step():
            p.sa.progress()
            p.sb.progress()
            most["local"] = max(most["local"], len(p.sa.grants.slots_of(LOCAL, "solo")))
            most["remote"] = max(most["remote"], len(p.sb.grants.slots_of(p.a.name, "solo")))
            assert time.monotonic() < deadline
        job.close()
        assert most == {"local": 4, "remote": 4}
        # both directions at once, stepped from one thread (each engine's owner thread)
        jobs = [p.sa.start_send(p.b.name, p.sb.info(), a_src, b_dst, "ab", timeout_s=30),
                p.sb.start_send(p.a.name, p.sa.info(), b_src, a_dst, "ba", timeout_s=30)]
        _finish_both(p, jobs, time.monotonic() + 30, "the two directions stalled each other")
        assert checksum(p.tb, b_dst, p.bd) == want_b
        assert checksum(p.ta, a_dst, p.bd) == want_a
        for sp in (p.sa, p.sb):
            assert not sp.grants.busy and sp.grants.free_slots() == 4
            assert sp.dropped_chunks == 0
    finally:
        p.close()


def _finish_both(p: StagedPair, jobs: list, deadline: float, stalled: str) -> None:
    """Steps both engines (from one thread, as each engine's owner thread would) until every
    job is done, then lets the last acks/releases through."""
    done = [False] * len(jobs)
    while not all(done):
        p.sa.progress()
        p.sb.progress()
        for i, j in enumerate(jobs):
            done[i] = done[i] or j.step()
        assert time.monotonic() < deadline, stalled
    for j in jobs:
        j.close()
    for _ in range(100):
        p.sa.progress()
        p.sb.progress()
        if not (p.sa.grants.busy or p.sb.grants.busy):
            break
        time.sleep(0.002)


@pytest.mark.nixl
def test_shared_pool_second_direction_starts_while_first_holds_everything() -> None:
    """The order the N−1 caps used to guard against: A's send alone takes all of its own
    pool and all of B's (B sends nothing yet); then B starts sending back to A. B's request
    must wait for A's slots and B's own send for its slots, and both transfers still finish
    (the holder gives slots back as its chunks finish), every byte in place."""
    from kvbaton.connector.transfer.staging import LOCAL

    block_bytes = LAYERS * 2 * TPB * 2 * 8 * 2
    p = StagedPair("kv", slot_bytes=2 * block_bytes, num_slots=2, send_slots=2, shared=True)
    try:
        for t in p.tb:
            t.view(torch.uint8)[:, :40].copy_(torch.randint(0, 256, t.view(torch.uint8)[:, :40].shape,
                                                          dtype=torch.uint8))
        for t in (*p.ta, *p.tb):
            t[:, 40:].zero_()
        rng = np.random.default_rng(5)
        a_src, b_dst = rng.permutation(40), 40 + rng.permutation(40)
        b_src, a_dst = rng.permutation(40), 40 + rng.permutation(40)
        want_b, want_a = checksum(p.ta, a_src, p.bd), checksum(p.tb, b_src, p.bd)
        ab = p.sa.start_send(p.b.name, p.sb.info(), a_src, b_dst, "ab", timeout_s=30)
        deadline = time.monotonic() + 30
        while not (len(p.sa.grants.slots_of(LOCAL, "ab")) == 4
                   and len(p.sb.grants.slots_of(p.a.name, "ab")) == 4):
            ab.step()
            p.sa.progress()
            p.sb.progress()
            assert time.monotonic() < deadline, "a lone send never held both whole pools"
        ba = p.sb.start_send(p.a.name, p.sa.info(), b_src, a_dst, "ba", timeout_s=30)
        _finish_both(p, [ab, ba], deadline, "the late direction never got a slot")
        assert checksum(p.tb, b_dst, p.bd) == want_b
        assert checksum(p.ta, a_dst, p.bd) == want_a
        for sp in (p.sa, p.sb):
            assert not sp.grants.busy and sp.grants.free_slots() == 4 and sp.dropped_chunks == 0
    finally:
        p.close()


@pytest.mark.nixl
def test_staged_rejects_bad_ids() -> None:
    p = StagedPair("kv", slot_bytes=1 << 16, num_slots=2)
    try:
        with pytest.raises(ValueError, match="unique"):
            p.sa.send(p.b.name, p.sb.info(), [1, 2], [3, 3], "bad", timeout_s=1)
        with pytest.raises(ValueError, match="out of range"):
            p.sa.send(p.b.name, p.sb.info(), [1, NUM_BLOCKS], [3, 4], "bad", timeout_s=1)
        with pytest.raises(ValueError, match="whitespace"):
            p.sa.send(p.b.name, p.sb.info(), [1], [3], "a b", timeout_s=1)
        with pytest.raises(TimeoutError):
            # B is never progressed, so no ack can come back
            p.sa.send(p.b.name, p.sb.info(), np.arange(20), np.arange(20), "stuck", timeout_s=0.3)
    finally:
        p.close()


@pytest.mark.nixl
def test_cancelled_transfer_is_refused_not_scattered() -> None:
    """A receiver that gave up on a transfer (its blocks may be freed and reused) refuses to
    grant slots for it: the sender fails fast, nothing is scattered, no slot leaks on either
    side, and a later transfer with another id lands normally."""
    block_bytes = LAYERS * 2 * TPB * 2 * 8 * 2
    p = StagedPair("kv", slot_bytes=2 * block_bytes, num_slots=2)
    try:
        src, dst = np.arange(1, 9), np.arange(30, 38)
        p.sb.cancel("gone")
        with pytest.raises(RuntimeError, match="refused.*cancelled"):
            p.sa.send(p.b.name, p.sb.info(), src, dst, "gone", timeout_s=20, idle=p.b.poll_notifs)
        assert "gone" not in p.sb.completed
        assert all(int(t.abs().sum()) == 0 for t in p.tb)  # nothing scattered
        assert not p.sb.grants.busy and p.sb.grants.free_slots() == 2
        p.sa.send(p.b.name, p.sb.info(), src, dst, "next", timeout_s=20, idle=p.b.poll_notifs)
        assert p.sb.completed.pop("next") == p.a.name
        assert checksum(p.tb, dst, p.bd) == checksum(p.ta, src, p.bd)
        assert not p.sb.grants.busy and p.sb.grants.free_slots() == 2  # all slots came back
    finally:
        p.close()


@pytest.mark.nixl
def test_take_pull_hands_out_requests_in_order() -> None:
    p = StagedPair("kv", slot_bytes=1 << 16, num_slots=2)
    try:
        assert p.sa.take_pull() is None
        p.sb.request_pull(p.a.name, [1, 2], [5, 6], "q1")
        p.sb.request_pull(p.a.name, [3], [7], "q2")
        got = []
        for _ in range(500):
            p.b.poll_notifs()  # progresses the sender's UCX too
            p.a.poll_notifs()
            time.sleep(0.002)
            while (x := p.sa.take_pull()) is not None:
                got.append(x)
            if len(got) == 2:
                break
        assert [(g[0], g[1], list(g[3]), list(g[4])) for g in got] == \
            [(p.b.name, "q1", [1, 2], [5, 6]), (p.b.name, "q2", [3], [7])]
        assert got[0][2] is None  # the reader's grant, not the request, says where to write
        for g in got:
            p.sa.drop_pull(g[0], g[1])  # not answering: the reader gets its slots back
        for _ in range(500):
            p.a.poll_notifs()
            p.sb.progress()
            if not p.sb.grants.busy:
                break
            time.sleep(0.002)
        assert not p.sb.grants.busy and p.sb.grants.free_slots() == 2
    finally:
        p.close()


@pytest.mark.nixl
@pytest.mark.parametrize("mode", ["write", "pull"])
@pytest.mark.parametrize("shared", [False, True])
def test_two_senders_into_one_receiver_at_once(mode: str, shared: bool) -> None:
    """Two engines pack into one receiver at the same time (each on its own thread, as two
    prefill engines would): the receiver's grants keep their slots apart, so every byte
    lands where it belongs (checksums), and the receiver's pool is whole again after."""
    import threading

    from kvbaton.connector.transfer.nixl_agent import NixlEndpoint
    from kvbaton.connector.transfer.staging import StagedPeer

    block_bytes = LAYERS * 2 * TPB * 2 * 8 * 2
    p = StagedPair("kv", slot_bytes=3 * block_bytes, num_slots=3, shared=shared)
    c = NixlEndpoint(f"SC{next(_names)}", net_devices="lo", ucx_tls="tcp,self,sm")
    tc = kv("kv", True)
    sc = StagedPeer(c, tc, KvLayout.from_tensors(tc, TPB), slot_bytes=3 * block_bytes, num_slots=3,
                    shared=shared)
    pool = p.sb.recv_pool.num_slots
    c.add_peer(p.b.name, p.b.metadata())
    p.b.add_peer(c.name, c.metadata())
    try:
        rng = np.random.default_rng(5)
        dst = rng.permutation(NUM_BLOCKS)[:70]
        jobs = {"a": (p.a, p.sa, rng.permutation(NUM_BLOCKS)[:40], dst[:40]),
                "c": (c, sc, rng.permutation(NUM_BLOCKS)[:30], dst[40:])}
        asked = {k: threading.Event() for k in jobs}
        errors: list[BaseException] = []
        both_active = []

        def sender(k: str) -> None:
            _ep, sp, src, d = jobs[k]
            try:
                if mode == "write":
                    sp.send(p.b.name, p.sb.info(), src, d, f"w{k}", timeout_s=30,
                            idle=asked[k].set)
                else:  # the receiver asked both to push (a staged READ from each)
                    asked[k].set()
                    deadline = time.monotonic() + 30
                    while not sp.serve_pulls(timeout_s=30):
                        sp.progress()
                        assert time.monotonic() < deadline, "pull never arrived"
                        time.sleep(0.001)
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                errors.append(e)

        if mode == "pull":
            for k, (ep, _sp, src, d) in jobs.items():
                p.sb.request_pull(ep.name, src, d, f"w{k}", timeout_s=30)
        threads = [threading.Thread(target=sender, args=(k,), daemon=True) for k in jobs]
        for t in threads:
            t.start()
        for e in asked.values():
            assert e.wait(10)  # both requests are out before the receiver looks
        deadline = time.monotonic() + 60
        while any(t.is_alive() for t in threads):
            p.sb.progress()
            holders = {p.sb.grants.holder(s) for s in range(pool)} - {None}
            both_active.append(len(holders) == 2)
            assert time.monotonic() < deadline, "senders did not finish"
            time.sleep(0.0005)
        for t in threads:
            t.join(5)
        if errors:
            raise errors[0]
        for k in jobs:
            assert p.sb.completed.pop(f"w{k}") == jobs[k][0].name
        assert checksum(p.tb, dst[:40], p.bd) == checksum(p.ta, jobs["a"][2], p.bd)
        assert checksum(p.tb, dst[40:], p.bd) == checksum(tc, jobs["c"][2], p.bd)
        rest = np.setdiff1d(np.arange(NUM_BLOCKS), dst)
        assert all(int(t.index_select(p.bd, torch.from_numpy(rest)).abs().sum()) == 0 for t in p.tb)
        assert any(both_active)  # the two really shared the pool at some point
        assert not p.sb.grants.busy and p.sb.grants.free_slots() == pool
        assert p.sb.dropped_chunks == 0
    finally:
        sc.close()
        c.close()
        p.close()


@pytest.mark.nixl
def test_grant_of_a_vanished_sender_is_reclaimed() -> None:
    """A sender that asked for slots and never used them (crashed, say) does not block the
    receiver: its grant expires at its ttl (+ margin) and the next sender proceeds; a chunk
    notification for a slot its sender does not hold is dropped, never scattered."""
    from kvbaton.connector import wire
    from kvbaton.connector.transfer.nixl_agent import NixlEndpoint

    block_bytes = LAYERS * 2 * TPB * 2 * 8 * 2
    p = StagedPair("kv", slot_bytes=2 * block_bytes, num_slots=2)
    ghost = NixlEndpoint(f"SG{next(_names)}", net_devices="lo", ucx_tls="tcp,self,sm")
    ghost.add_peer(p.b.name, p.b.metadata())
    p.b.add_peer(ghost.name, ghost.metadata())
    p.sb.grants.margin_s = 0.05
    try:
        ghost.send_notif(p.b.name, wire.encode(wire.StagedGrantRequest("gx", 2, 300, np.arange(4))))
        for _ in range(2000):
            p.sb.progress()
            ghost.poll_notifs()
            if p.sb.grants.free_slots() == 0:
                break
            time.sleep(0.001)
        assert p.sb.grants.slots_of(ghost.name, "gx") == {0, 1}
        # a forged chunk from a peer that holds no slot: dropped
        p.a.send_notif(p.b.name, wire.encode(wire.StagedChunk("fake", 0, 0, 1, 0, 1, 0, 1)))
        src, dst = np.arange(1, 9), np.arange(30, 38)
        t0 = time.monotonic()
        p.sa.send(p.b.name, p.sb.info(), src, dst, "after", timeout_s=20, idle=p.sb.progress)
        assert time.monotonic() - t0 >= 0.3  # waited for the ghost's grant to expire
        assert p.sb.grants.expired == 1 and p.sb.dropped_chunks == 1
        assert checksum(p.tb, dst, p.bd) == checksum(p.ta, src, p.bd)
        assert not p.sb.grants.busy and not p.sb.busy  # the worker's loop may poll slowly again
    finally:
        ghost.close()
        p.close()
