"""KV integrity fingerprints (connector/transfer/integrity.py) on randomized layouts, no vLLM.

Every layout is real memory (numpy / torch buffers) addressed the way NIXL addresses it
(region base + block * stride), so the crc32 path reads exactly the bytes a transfer moves.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch

from kvbaton.connector.transfer.geometry import KvLayout
from kvbaton.connector.transfer.integrity import (
    ALG_CRC32,
    ALG_TORCH64,
    Fingerprinter,
    Fingerprints,
    KvIntegrityError,
    TorchBlockViews,
    compare,
    corrupt_block,
    crc32_blocks,
)


def _random_cache(rnd: random.Random) -> tuple[KvLayout, list[torch.Tensor], np.ndarray]:
    """A random geometry: 1-4 regions in one allocation, padded block strides, random bytes."""
    regions = rnd.randint(1, 4)
    tokens = rnd.choice([1, 2, 16, 32])
    bpb = tokens * 4 * rnd.randint(1, 24)
    stride = bpb + 4 * rnd.randint(0, 3)
    nblocks = rnd.randint(2, 40)
    span = (nblocks - 1) * stride + bpb
    gap = 4 * rnd.randint(0, 5)
    total = regions * (span + gap)
    t = torch.from_numpy(np.frombuffer(np.random.default_rng(rnd.randrange(1 << 30)).bytes(total),
                                       dtype=np.uint8).copy())
    base = t.data_ptr()
    layout = KvLayout(tuple(base + r * (span + gap) for r in range(regions)), bpb, nblocks, tokens, "float32",
                      block_stride_bytes=stride)
    return layout, [t], t.numpy()


def _block_bytes(arr: np.ndarray, layout: KvLayout, b: int) -> bytes:
    base0 = layout.region_base_addrs[0] - arr.ctypes.data
    out = b""
    for base in layout.region_base_addrs:
        off = base - layout.region_base_addrs[0] + base0 + b * layout.block_stride_bytes
        out += arr[off:off + layout.bytes_per_block].tobytes()
    return out


@pytest.mark.parametrize("seed", range(12))
def test_crc32_is_per_block_over_all_regions(seed: int) -> None:
    rnd = random.Random(seed)
    layout, _tensors, arr = _random_cache(rnd)
    ids = [rnd.randrange(layout.num_blocks) for _ in range(rnd.randint(1, 12))]
    got = crc32_blocks(layout, ids)
    # Chained crc over the regions' bytes == crc of their concatenation.
    assert got == [zlib.crc32(_block_bytes(arr, layout, b)) for b in ids]


@pytest.mark.parametrize("alg", [ALG_CRC32, ALG_TORCH64])
@pytest.mark.parametrize("seed", range(10))
def test_any_changed_byte_is_detected_and_located(alg: str, seed: int) -> None:
    rnd = random.Random(1000 + seed)
    layout, tensors, arr = _random_cache(rnd)
    fp = Fingerprinter(layout, tensors, alg)
    try:
        ids = rnd.sample(range(layout.num_blocks), rnd.randint(1, min(10, layout.num_blocks)))
        owner = fp.submit(ids).result(timeout=10)
        assert owner.alg == alg and owner.block_ids == tuple(ids)
        assert compare(owner.values, fp.compute(ids).values) == []  # deterministic
        # Flip one byte of one block in one region (never in the stride padding).
        pos = rnd.randrange(len(ids))
        region = rnd.randrange(layout.num_regions)
        off = (layout.region_base_addrs[region] - arr.ctypes.data + ids[pos] * layout.block_stride_bytes
               + rnd.randrange(layout.bytes_per_block))
        arr[off] ^= 1 << rnd.randrange(8)
        assert compare(owner.values, fp.compute(ids).values) == [pos]
    finally:
        fp.close()


@pytest.mark.parametrize("seed", range(6))
def test_padding_between_blocks_is_not_fingerprinted(seed: int) -> None:
    rnd = random.Random(2000 + seed)
    layout, tensors, arr = _random_cache(rnd)
    if layout.block_stride_bytes == layout.bytes_per_block:
        layout = KvLayout(layout.region_base_addrs[:1], layout.bytes_per_block - layout.tokens_per_block * 4 or
                          layout.bytes_per_block, layout.num_blocks, layout.tokens_per_block, "float32",
                          block_stride_bytes=layout.bytes_per_block)
    if layout.block_stride_bytes == layout.bytes_per_block:
        pytest.skip("no padding in this geometry")
    before = {alg: Fingerprinter(layout, tensors, alg).compute(range(layout.num_blocks - 1)).values
              for alg in (ALG_CRC32, ALG_TORCH64)}
    pad = layout.region_base_addrs[0] - arr.ctypes.data + layout.bytes_per_block  # after block 0
    arr[pad] ^= 0xFF
    for alg, vals in before.items():
        assert Fingerprinter(layout, tensors, alg).compute(range(layout.num_blocks - 1)).values == vals


def test_same_content_other_block_ids_same_fingerprint() -> None:
    """Reader and owner use different block ids: only contents count."""
    rnd = random.Random(7)
    layout, tensors, arr = _random_cache(rnd)
    ids_a, ids_b = [0, 1], [layout.num_blocks - 2, layout.num_blocks - 1]
    for r in range(layout.num_regions):
        base = layout.region_base_addrs[r] - arr.ctypes.data
        for a, b in zip(ids_a, ids_b):
            src = base + a * layout.block_stride_bytes
            dst = base + b * layout.block_stride_bytes
            arr[dst:dst + layout.bytes_per_block] = arr[src:src + layout.bytes_per_block]
    for alg in (ALG_CRC32, ALG_TORCH64):
        fp = Fingerprinter(layout, tensors, alg)
        assert fp.compute(ids_a).values == fp.compute(ids_b).values
        assert fp.compute(ids_a).values != fp.compute(ids_b[::-1]).values  # order matters


def test_torch64_weights_are_shared_across_instances() -> None:
    """Two engines (two processes) derive the same weights: equal bytes, equal fingerprints."""
    rnd = random.Random(11)
    layout, tensors, arr = _random_cache(rnd)
    copy = torch.from_numpy(arr.copy())
    shift = copy.data_ptr() - tensors[0].data_ptr()
    layout2 = KvLayout(tuple(a + shift for a in layout.region_base_addrs), layout.bytes_per_block,
                       layout.num_blocks, layout.tokens_per_block, "float32",
                       block_stride_bytes=layout.block_stride_bytes)
    ids = list(range(layout.num_blocks))
    assert (TorchBlockViews(layout, tensors).fingerprints(ids)
            == TorchBlockViews(layout2, [copy]).fingerprints(ids))


def test_encode_decode_roundtrip_and_compare_lengths() -> None:
    fps = Fingerprints(ALG_TORCH64, (3, 4, 9), (0, (1 << 64) - 1, 12345))
    back = Fingerprints.decode(fps.encode(), (3, 4, 9))
    assert back == fps
    assert Fingerprints.decode("crc32=", ()).values == ()
    with pytest.raises(KvIntegrityError):
        Fingerprints.decode("md5=ab", (1,))
    assert compare([1, 2, 3], [1, 2]) == [2]
    assert compare([1], [1, 5, 6]) == [1, 2]
    assert compare([1, 2], [1, 2]) == []


def test_out_of_range_block_ids_are_refused() -> None:
    layout, tensors, _ = _random_cache(random.Random(5))
    with pytest.raises(KvIntegrityError):
        crc32_blocks(layout, [layout.num_blocks])
    with pytest.raises(KvIntegrityError):
        TorchBlockViews(layout, tensors).fingerprints([-1])


def test_corrupt_block_changes_only_that_block() -> None:
    layout, tensors, _ = _random_cache(random.Random(9))
    fp = Fingerprinter(layout, tensors, ALG_CRC32)
    ids = list(range(layout.num_blocks))
    before = fp.compute(ids).values
    corrupt_block(layout, 1, nbytes=min(64, layout.bytes_per_block))
    assert compare(before, fp.compute(ids).values) == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_torch64_on_cuda_matches_host() -> None:
    rnd = random.Random(13)
    layout, tensors, arr = _random_cache(rnd)
    dev = tensors[0].cuda()
    shift = dev.data_ptr() - tensors[0].data_ptr()
    glayout = KvLayout(tuple(a + shift for a in layout.region_base_addrs), layout.bytes_per_block,
                       layout.num_blocks, layout.tokens_per_block, "float32", device="cuda",
                       block_stride_bytes=layout.block_stride_bytes)
    ids = list(range(layout.num_blocks))
    fp = Fingerprinter(glayout, [dev])
    assert fp.alg == ALG_TORCH64
    assert fp.compute(ids).values == Fingerprinter(layout, tensors, ALG_TORCH64).compute(ids).values
    with pytest.raises(KvIntegrityError):
        fp.compute(ids, ALG_CRC32)


def test_owner_finds_the_run_a_reader_asks_about() -> None:
    """The owner answers for exactly the blocks read: a reader that skipped leading blocks
    (its own prefix hit) reads a later run of the owner's record; newest record first."""
    import concurrent.futures

    from kvbaton.connector.flows.verify import FpRecord, Verifier

    t = Verifier.__new__(Verifier)  # only the record bookkeeping is exercised
    done: concurrent.futures.Future[Fingerprints] = concurrent.futures.Future()
    t.records = {"t:x": [FpRecord((7, 3, 9, 4), done, 0.0)],
                 "r:c": [FpRecord((1, 2, 5), done, 2.0, "new"), FpRecord((1, 2), done, 1.0, "old")]}
    assert t.record("t:x", -1, (9, 4)) == (t.records["t:x"][0], 2)
    assert t.record("t:x", 0, (7, 3, 9, 4))[1] == 0
    assert t.record("t:x", -1, (3, 4)) is None  # not a run of the record
    assert t.record("t:x", -1, (8,)) is None
    assert t.record("r:c", 1, (2, 5)) == (t.records["r:c"][0], 1)
    assert t.record("r:c", 0, (1, 2))[0].hold_id == "new"
    assert t.record("r:missing", 0, (1,)) is None


def test_torch64_chunking_does_not_change_fingerprints(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvbaton.connector.transfer.integrity as integrity

    layout, tensors, _ = _random_cache(random.Random(17))
    ids = list(range(layout.num_blocks))
    whole = TorchBlockViews(layout, tensors).fingerprints(ids)
    monkeypatch.setattr(integrity, "TORCH_CHUNK_BYTES", 1)  # one block per chunk
    assert TorchBlockViews(layout, tensors).fingerprints(ids) == whole
