"""Descriptor planning: coalescing vs a naive reference, addresses, validation, speed."""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import pytest

from kvbaton.connector.transfer.descriptors import build_descriptors, coalesce_runs, plan_transfer, runs_of
from kvbaton.connector.transfer.geometry import KvLayout, KvLayoutMismatch


def naive_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def layout(num_blocks: int = 1000, regions: int = 6, bpb: int = 4096, stride: int = 0,
           base: int = 1 << 32, tpb: int = 16, **kw) -> KvLayout:
    span = num_blocks * max(stride, bpb)
    return KvLayout(region_base_addrs=[base + i * (span + 4096) for i in range(regions)],
                    bytes_per_block=bpb, num_blocks=num_blocks, tokens_per_block=tpb,
                    dtype="bfloat16", block_stride_bytes=stride, **kw)


def fragmented_ids(rng: np.random.Generator, num_blocks: int, n: int) -> np.ndarray:
    """Mixture of contiguous stretches and random jumps, like a real allocator."""
    out: dict[int, None] = {}
    perm = rng.permutation(num_blocks)
    i = 0
    while len(out) < n:
        start = int(perm[i % num_blocks])
        i += 1
        out.update(dict.fromkeys(range(start, min(num_blocks, start + int(rng.integers(1, 12))))))
    return np.array(list(out)[:n], dtype=np.int64)


@pytest.mark.parametrize("seed", range(20))
def test_coalesce_matches_naive(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    src = fragmented_ids(rng, 1000, n) if n else np.zeros(0, np.int64)
    dst = fragmented_ids(rng, 1000, len(src)) if seed % 3 else src + 5
    s, d, ln = coalesce_runs(src, dst)
    assert list(zip(s.tolist(), d.tolist(), ln.tolist())) == naive_runs(src.tolist(), dst.tolist())
    # expanding the runs gives back the pairs
    exp_s = np.concatenate([np.arange(a, a + k) for a, k in zip(s, ln)]) if len(s) else s
    assert np.array_equal(exp_s, src)


def test_coalesce_contiguous_is_one_run() -> None:
    s, d, ln = coalesce_runs(np.arange(10, 500), np.arange(1000, 1490))
    assert (s.tolist(), d.tolist(), ln.tolist()) == ([10], [1000], [490])


def test_coalesce_needs_both_sides_consecutive() -> None:
    s, d, ln = coalesce_runs([1, 2, 3, 4], [7, 8, 20, 21])
    assert ln.tolist() == [2, 2] and d.tolist() == [7, 20]


def test_descriptor_addresses() -> None:
    lay = layout(num_blocks=50, regions=3, bpb=256)
    descs = build_descriptors(lay, [4, 10], [2, 3])
    assert descs.dtype == np.uint64 and descs.shape == (6, 3)
    for r, base in enumerate(lay.region_base_addrs):
        assert descs[2 * r].tolist() == [base + 4 * 256, 512, 0]
        assert descs[2 * r + 1].tolist() == [base + 10 * 256, 768, 0]


def test_strided_layout_is_never_coalesced() -> None:
    lay = layout(num_blocks=50, regions=2, bpb=256, stride=1024)
    plan = plan_transfer(lay, np.arange(10), lay, np.arange(20, 30))
    assert plan.num_descs == 20  # one per block per region: a run would span the gaps
    assert plan.local_descs[1, 0] - plan.local_descs[0, 0] == 1024
    with pytest.raises(ValueError, match="densely packed"):
        build_descriptors(lay, [0], [2])


@pytest.mark.parametrize("seed", range(5))
def test_plan_pairs_and_bytes(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    a, b = layout(), layout(base=1 << 40)
    src, dst = fragmented_ids(rng, 1000, 200), rng.permutation(1000)[:200]
    for coalesce in (True, False):
        plan = plan_transfer(a, src, b, dst, coalesce=coalesce)
        assert plan.nbytes == 200 * a.bytes_per_block * a.num_regions
        assert int(plan.local_descs[:, 1].sum()) == plan.nbytes == int(plan.remote_descs[:, 1].sum())
        assert np.array_equal(plan.local_descs[:, 1], plan.remote_descs[:, 1])
    runs = runs_of(src, dst)
    assert plan_transfer(a, src, b, dst).num_descs == len(runs) * a.num_regions


def test_plan_validation() -> None:
    a = layout(num_blocks=100)
    with pytest.raises(ValueError, match="counts differ"):
        plan_transfer(a, [1, 2], a, [1])
    with pytest.raises(ValueError, match="out of range"):
        plan_transfer(a, [1, 100], a, [1, 2])
    with pytest.raises(ValueError, match="out of range"):
        plan_transfer(a, [1, 2], a, [-1, 2])
    with pytest.raises(ValueError, match="repeat"):
        plan_transfer(a, [1, 2], a, [5, 5])  # WRITE: remote is the destination
    plan_transfer(a, [1, 1], a, [5, 6])  # a repeated source is allowed
    with pytest.raises(ValueError, match="repeat"):
        plan_transfer(a, [3, 3], a, [5, 6], op="READ")  # READ: local is the destination


def test_compatibility_errors() -> None:
    a = layout()
    with pytest.raises(KvLayoutMismatch, match="dtype"):
        a.compatible(KvLayout(**{**a.to_proto_fields(), "dtype": "float16", "fingerprint": ""}))
    with pytest.raises(KvLayoutMismatch, match="region count"):
        a.compatible(layout(regions=4))
    with pytest.raises(KvLayoutMismatch, match="bytes per token"):
        a.compatible(layout(bpb=8192))
    with pytest.raises(NotImplementedError, match="tokens_per_block"):
        a.compatible(layout(bpb=8192, tpb=32))
    with pytest.raises(KvLayoutMismatch, match="fingerprint"):
        a.compatible(layout(fingerprint="other-model"))
    a.compatible(layout(base=1 << 40, num_blocks=5000))  # other addresses and sizes are fine


def test_proto_fields_roundtrip() -> None:
    a = layout(stride=8192, device="cuda", device_id=1)
    fields = a.to_proto_fields()
    assert set(fields) == {"region_base_addrs", "bytes_per_block", "num_blocks", "tokens_per_block",
                           "dtype", "layout", "fingerprint", "device", "device_id",
                           "block_stride_bytes"}
    assert KvLayout.from_proto_fields(**fields) == a
    # proto3 defaults: stride 0 means dense, empty device/layout get defaults
    dense = KvLayout.from_proto_fields(**{**fields, "block_stride_bytes": 0, "device": "",
                                          "layout": ""})
    assert dense.block_stride_bytes == dense.bytes_per_block and dense.device == "cpu"
    pb = pytest.importorskip("kvbaton.v1.common_pb2")
    msg = pb.KvGeometry(**fields)
    back = KvLayout.from_proto_fields(**{f: getattr(msg, f) for f in fields})
    assert back == a


def test_from_tensors_both_layouts() -> None:
    torch = pytest.importorskip("torch")
    split = [torch.zeros(2, 30, 16, 4, 8, dtype=torch.bfloat16) for _ in range(3)]
    ls = KvLayout.from_tensors(split, tokens_per_block=16)
    assert ls.layout == "kv_split" and ls.num_regions == 6 and ls.num_blocks == 30
    assert ls.bytes_per_block == 16 * 4 * 8 * 2 == ls.block_stride_bytes
    assert ls.region_base_addrs[1] - ls.region_base_addrs[0] == 30 * ls.bytes_per_block
    assert len(ls.registration_regions()) == 3  # K and V halves merged per tensor
    joint = [torch.zeros(30, 2, 16, 4, 8, dtype=torch.float16) for _ in range(3)]
    lj = KvLayout.from_tensors(joint, tokens_per_block=16)
    assert lj.layout == "block_major" and lj.num_regions == 3
    assert lj.bytes_per_block == 2 * 16 * 4 * 8 * 2
    # permuted (HND-style) view over block-major memory: still one dense chunk per block
    hnd = [torch.zeros(30, 2, 4, 16, 8).permute(0, 1, 3, 2, 4) for _ in range(2)]
    lh = KvLayout.from_tensors(hnd, tokens_per_block=16)
    assert lh.bytes_per_block == 2 * 16 * 4 * 8 * 4
    # a block that is not one chunk cannot be one descriptor
    bad = [torch.zeros(30, 16, 4, 8)[:, :, :2]]
    with pytest.raises(ValueError, match="not contiguous"):
        KvLayout.from_tensors(bad, tokens_per_block=16)
    # ambiguity is resolved by num_blocks
    mla = [torch.zeros(2, 2, 16)]
    with pytest.raises(ValueError, match="block_dim"):
        KvLayout.from_tensors(mla, tokens_per_block=2, num_blocks=2)
    assert KvLayout.from_tensors(mla, tokens_per_block=2, block_dim=0).num_regions == 1


def _python_calls(fn: Callable[[], object]) -> int:
    """Python-level and builtin calls made while ``fn`` runs (deterministic, unlike a timer)."""
    calls = 0

    def prof(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_planning_has_no_per_block_python_loop() -> None:
    """Planning 10k fragmented blocks x 128 regions costs the same number of Python calls as
    planning 100: the work is in numpy, not in per-block Python loops. (Speed itself is measured
    by ``benchmarks/datapath.py``'s plan_ms, not asserted by a timed test.)"""
    rng = np.random.default_rng(7)
    a, b = layout(num_blocks=20000, regions=128, bpb=32768), layout(num_blocks=20000, regions=128, bpb=32768, base=1 << 44)

    def counts(n: int) -> tuple[int, int]:
        src, dst = rng.permutation(20000)[:n], rng.permutation(20000)[:n]
        plan_transfer(a, src, b, dst)  # warm up (imports, caches)
        return (_python_calls(lambda: coalesce_runs(src, dst)),
                _python_calls(lambda: plan_transfer(a, src, b, dst)))

    small, large = counts(100), counts(10_000)
    assert large == small, (small, large)
    src, dst = rng.permutation(20000)[:10000], rng.permutation(20000)[:10000]
    assert plan_transfer(a, src, b, dst).num_descs > 1_000_000
