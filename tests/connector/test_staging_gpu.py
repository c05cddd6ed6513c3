"""Pack path on CUDA: the one-launch Triton gather/scatter and staged transfers over NIXL.

Skipped without a GPU (CI); run on a GPU machine with the nixl wheels installed.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

try:
    from kvbaton.connector.transfer.geometry import KvLayout
    from kvbaton.connector.transfer.staging import GpuRowCopier, pack_blocks, plan_tiles, region_byte_views
except ImportError:  # a checkout run without installing the package
    from connector.transfer.geometry import KvLayout  # type: ignore[no-redef]
    from connector.transfer.staging import GpuRowCopier, pack_blocks, plan_tiles, region_byte_views  # type: ignore[no-redef]

pytestmark = pytest.mark.gpu
LAYERS, NUM_BLOCKS, TPB = 3, 80, 16
_names = itertools.count()


def kv(shape_first: str, fill: bool, heads: int = 2, head: int = 8) -> list[torch.Tensor]:
    shape = ((2, NUM_BLOCKS, TPB, heads, head) if shape_first == "kv"
             else (NUM_BLOCKS, 2, TPB, heads, head))
    ts = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    if fill:
        for t in ts:
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                    dtype=torch.uint8, device="cuda"))
    return ts


def cuda_pair(slot_blocks: int, **kw: Any) -> tuple[Any, ...]:
    """Two NIXL agents with a CUDA KV cache each (A filled, B zeroed) and a StagedPeer of
    ``slot_blocks``-block slots on each: ``(a, b, sa, sb, va, vb)`` (vX: region views)."""
    pytest.importorskip("nixl")
    try:
        from kvbaton.connector.transfer.nixl_agent import NixlEndpoint
        from kvbaton.connector.transfer.staging import StagedPeer
    except ImportError:
        from connector.transfer.nixl_agent import NixlEndpoint  # type: ignore[no-redef]
        from connector.transfer.staging import StagedPeer  # type: ignore[no-redef]
    a, b = NixlEndpoint(f"GA{next(_names)}"), NixlEndpoint(f"GB{next(_names)}")
    ta, tb = kv("kv", True), kv("kv", False)
    la, lb = KvLayout.from_tensors(ta, TPB), KvLayout.from_tensors(tb, TPB)
    kw = dict(slot_bytes=slot_blocks * la.bytes_per_block * la.num_regions, target_chunks=64,
              min_chunk_bytes=0, **kw)
    sa, sb = StagedPeer(a, ta, la, **kw), StagedPeer(b, tb, lb, **kw)
    a.add_peer(b.name, b.metadata())
    b.add_peer(a.name, a.metadata())
    return a, b, sa, sb, region_byte_views(ta, la), region_byte_views(tb, lb)


@pytest.mark.parametrize("shape_first", ["kv", "block"])
@pytest.mark.parametrize("head", [8, 128, 24])  # 24: rows not a multiple of the kernel block
def test_kernel_matches_torch(shape_first: str, head: int) -> None:
    rng = np.random.default_rng(head)
    src, dst = kv(shape_first, True, head=head), kv(shape_first, False, head=head)
    ls, ld = KvLayout.from_tensors(src, TPB), KvLayout.from_tensors(dst, TPB)
    vs, vd = region_byte_views(src, ls), region_byte_views(dst, ld)
    cs, cd = GpuRowCopier(src, ls), GpuRowCopier(dst, ld)
    n = 37
    sids = torch.from_numpy(rng.permutation(NUM_BLOCKS)[:n]).cuda()
    dids = torch.from_numpy(rng.permutation(NUM_BLOCKS)[:n]).cuda()
    size = n * ls.bytes_per_block * ls.num_regions
    ref = torch.empty(size, dtype=torch.uint8, device="cuda")
    got = torch.empty(size, dtype=torch.uint8, device="cuda")
    pack_blocks(vs, sids, ref)
    for r0, r1, _b0, _b1 in plan_tiles(n, ls.num_regions, ls.bytes_per_block, size // 3):
        assert r1 - r0 >= 1
    assert cs.gather(sids, 0, ls.num_regions, got) == size
    assert torch.equal(got, ref)
    # tiles of a region range, then scatter back into another cache
    r0, r1 = 1, ls.num_regions - 1
    part = torch.empty(size, dtype=torch.uint8, device="cuda")
    nb = cs.gather(sids[5:20], r0, r1, part)
    cd.scatter(dids[5:20], r0, r1, part[:nb])
    torch.cuda.synchronize()
    for r in range(ls.num_regions):
        got_r = vd[r].index_select(0, dids[5:20])
        want = vs[r].index_select(0, sids[5:20]) if r0 <= r < r1 else torch.zeros_like(got_r)
        assert torch.equal(got_r.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.nixl
@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("shared", [False, True])  # True: one pool for both directions (the GPU default)
def test_staged_write_and_read_cuda(kernel: bool, shared: bool) -> None:
    a, b, sa, sb, va, vb = cuda_pair(5, num_slots=2, use_kernel=kernel, shared=shared)

    def same(src: np.ndarray, dst: np.ndarray) -> bool:
        s, d = torch.from_numpy(src).cuda(), torch.from_numpy(dst).cuda()
        return all(torch.equal(x.index_select(0, s).view(torch.uint8), y.index_select(0, d).view(torch.uint8))
                   for x, y in zip(va, vb))

    try:
        rng = np.random.default_rng(3)
        src, dst = rng.permutation(NUM_BLOCKS)[:50], rng.permutation(NUM_BLOCKS)[:50]
        sa.send(b.name, sb.info(), src, dst, "w1", timeout_s=30, idle=sb.progress)
        assert sa.last_send_chunks >= 10  # slots reused
        assert sb.wait_complete("w1", timeout_s=10) == a.name
        assert same(src, dst)
        for v in vb:  # B's blocks (every region) back to zero
            v.zero_()
        src2, dst2 = rng.permutation(NUM_BLOCKS)[:33], rng.permutation(NUM_BLOCKS)[:33]
        sb.request_pull(a.name, src2, dst2, "r1")
        for _ in range(2000):
            sa.progress()
            if sa.serve_pulls(timeout_s=30, idle=sb.progress):
                break
        assert sb.wait_complete("r1", timeout_s=10) == a.name
        assert same(src2, dst2)
    finally:
        sa.close()
        sb.close()
        a.close()
        b.close()


@pytest.mark.nixl
def test_two_senders_into_one_receiver_cuda() -> None:
    """Two senders pack into one receiver's CUDA staging pool at once (each on its own
    thread, as two prefill engines would): the receiver's grants keep their slots apart,
    every byte lands where it belongs, and the pool is whole again afterwards."""
    import threading
    import time

    pytest.importorskip("nixl")
    try:
        from kvbaton.connector.transfer.nixl_agent import NixlEndpoint
        from kvbaton.connector.transfer.staging import StagedPeer
    except ImportError:
        from connector.transfer.nixl_agent import NixlEndpoint  # type: ignore[no-redef]
        from connector.transfer.staging import StagedPeer  # type: ignore[no-redef]
    eps = [NixlEndpoint(f"G2{k}{next(_names)}") for k in "ACB"]
    caches = [kv("kv", True), kv("kv", True), kv("kv", False)]
    lays = [KvLayout.from_tensors(t, TPB) for t in caches]
    block_bytes = lays[0].bytes_per_block * lays[0].num_regions
    kw = dict(slot_bytes=3 * block_bytes, num_slots=3, target_chunks=64, min_chunk_bytes=0)
    peers = [StagedPeer(e, t, lay, **kw) for e, t, lay in zip(eps, caches, lays)]
    a, c, b = eps
    sa, sc, sb = peers
    for x in (a, c):
        x.add_peer(b.name, b.metadata())
        b.add_peer(x.name, x.metadata())
    views = [region_byte_views(t, lay) for t, lay in zip(caches, lays)]
    try:
        rng = np.random.default_rng(9)
        dst = rng.permutation(NUM_BLOCKS)[:70]
        jobs = [(sa, rng.permutation(NUM_BLOCKS)[:40], dst[:40], "ga"),
                (sc, rng.permutation(NUM_BLOCKS)[:30], dst[40:], "gc")]
        errors: list[BaseException] = []
        started = [threading.Event(), threading.Event()]

        def run(i: int) -> None:
            sp, src, d, xid = jobs[i]
            try:
                sp.send(b.name, sb.info(), src, d, xid, timeout_s=60, idle=started[i].set)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(30)
        deadline = time.monotonic() + 120
        shared = False
        while any(t.is_alive() for t in threads):
            sb.progress()
            shared |= len({sb.grants.holder(s) for s in range(3)} - {None}) == 2
            assert time.monotonic() < deadline
        if errors:
            raise errors[0]
        torch.cuda.synchronize()
        for i, (_sp, src, d, xid) in enumerate(jobs):
            assert sb.completed.pop(xid) == eps[i].name
            s_t, d_t = torch.from_numpy(src).cuda(), torch.from_numpy(d).cuda()
            for x, y in zip(views[i], views[2]):
                assert torch.equal(x.index_select(0, s_t).view(torch.uint8),
                                   y.index_select(0, d_t).view(torch.uint8))
        rest = torch.from_numpy(np.setdiff1d(np.arange(NUM_BLOCKS), dst)).cuda()
        assert all(int(v.index_select(0, rest).view(torch.uint8).sum()) == 0 for v in views[2])
        assert shared and not sb.grants.busy and sb.dropped_chunks == 0
    finally:
        for p in peers:
            p.close()
        for e in eps:
            e.close()


@pytest.mark.nixl
@pytest.mark.parametrize("ahead", [True, False])
def test_gather_ahead_and_trace_cuda(ahead: bool) -> None:
    """On CUDA too, a free send slot is gathered before the receiver has a slot for it
    (one receive slot, three send slots), chunks are still posted in order one at a time,
    every byte lands, and tracing records each gather's and scatter's GPU time."""
    a, b, sa, sb, va, vb = cuda_pair(2, num_slots=1, send_slots=3)
    try:
        sa.gather_ahead = ahead
        sa.trace, sb.trace = [], []
        rng = np.random.default_rng(4)
        src, dst = rng.permutation(NUM_BLOCKS)[:16], rng.permutation(NUM_BLOCKS)[:16]
        sa.send(b.name, sb.info(), src, dst, "ga", timeout_s=30, idle=sb.progress)
        assert sb.wait_complete("ga", timeout_s=10) == a.name
        s, d = torch.from_numpy(src).cuda(), torch.from_numpy(dst).cuda()
        assert all(torch.equal(x.index_select(0, s).view(torch.uint8), y.index_select(0, d).view(torch.uint8))
                   for x, y in zip(va, vb))
        n = sa.last_send_chunks
        assert n >= 4
        at = {(what, seq): t for t, what, seq in sa.trace}
        assert all(at[("ack", c)] < at[("post", c + 1)] for c in range(n - 1))
        assert (at[("pack", 1)] < at[("ack", 0)]) is ahead
        gathers = [us for k, _, us in sa.gpu_trace if k == "gather"]
        scatters = [us for k, _, us in sb.gpu_trace if k == "scatter"]
        assert len(gathers) == n and len(scatters) == n
        assert all(us > 0 for us in gathers + scatters)
    finally:
        sa.close()
        sb.close()
        a.close()
        b.close()
