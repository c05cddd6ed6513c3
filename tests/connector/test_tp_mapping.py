"""TP mapping: which rank moves which heads, checked by moving real bytes between
simulated ranks (every head lands exactly once, bytes add up) and by the refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.connector.transfer.tp_mapping import TpMapping, compute_tp_mapping
from kvbaton.kvgeometry import (
    EngineKv,
    KvIncompatible,
    head_holders,
    incompatibility,
    rank_heads,
    split_reason,
    writer_ranks,
)

HEAD_BYTES = 64  # one head of one block of one region: tokens * 2 (K,V) * head_dim * esize


def engine(tp: int, heads: int, *, head_bytes: int = HEAD_BYTES, tpb: int = 16, regions: int = 3,
           dtype: str = "float16", layout: str = "block_major", head_major: bool = True) -> EngineKv:
    per = max(heads // tp, 1)
    return EngineKv(tp_size=tp, tokens_per_block=tpb, bytes_per_block=per * head_bytes,
                    num_regions=regions, dtype=dtype, layout=layout, total_kv_heads=heads,
                    head_major=head_major)


def rank_caches(e: EngineKv, num_blocks: int, *, fill: bool) -> list[np.ndarray]:
    """Per-rank KV: [regions, blocks, bytes_per_block] uint8. With ``fill``, every byte says
    which (region, block, head, byte-in-head) it is, so a landed byte can be traced back."""
    out = []
    for r in range(e.tp_size):
        a = np.zeros((e.num_regions, num_blocks, e.bytes_per_block), dtype=np.int64)
        if fill:
            for i, h in enumerate(e.heads_of(r)):
                sl = slice(i * e.head_bytes, (i + 1) * e.head_bytes)
                a[:, :, sl] = _pattern(e.num_regions, num_blocks, h, e.head_bytes)
        out.append(a)
    return out


def _pattern(regions: int, blocks: int, head: int, head_bytes: int) -> np.ndarray:
    reg = np.arange(regions)[:, None, None]
    blk = np.arange(blocks)[None, :, None]
    byte = np.arange(head_bytes)[None, None, :]
    return ((reg * 1000 + blk) * 1000 + head) * 10_000 + byte + 1  # never 0 (0 = not written)


def move(m: TpMapping, num_blocks: int, *, by: str) -> tuple[list[np.ndarray], dict[int, int]]:
    """Run the plan with random block ids on both sides; ``by`` = "src" (push: each owner
    rank writes its slices) or "dst" (pull: each receiver rank reads). Returns the receivers'
    caches (in request block order) and the bytes each owner rank moved."""
    rng = np.random.default_rng(num_blocks)
    pool = num_blocks * 3
    src_ids = rng.choice(pool, num_blocks, replace=False)
    dst_ids = rng.choice(pool, num_blocks, replace=False)
    src = rank_caches(m.src, num_blocks, fill=True)
    src_pool = [np.zeros((m.src.num_regions, pool, m.src.bytes_per_block), dtype=np.int64) for _ in src]
    for r, a in enumerate(src):
        src_pool[r][:, src_ids, :] = a
    dst_pool = [np.zeros((m.dst.num_regions, pool, m.dst.bytes_per_block), dtype=np.int64)
                for _ in range(m.dst.tp_size)]
    writes = np.zeros((m.dst.tp_size, m.dst.num_regions, pool, m.dst.bytes_per_block), dtype=np.int64)
    moved: dict[int, int] = {}
    ranks = range(m.src.tp_size) if by == "src" else range(m.dst.tp_size)
    for rank in ranks:
        pieces = m.out_of(rank) if by == "src" else m.into(rank)
        for p in pieces:
            s_flat = src_pool[p.src_rank].reshape(m.src.num_regions, -1)
            d_flat = dst_pool[p.dst_rank].reshape(m.dst.num_regions, -1)
            w_flat = writes[p.dst_rank].reshape(m.dst.num_regions, -1)
            for so, do, n in m.extents(p, src_ids.tolist(), dst_ids.tolist(),
                                       m.src.bytes_per_block, m.dst.bytes_per_block):
                d_flat[:, do:do + n] = s_flat[:, so:so + n]
                w_flat[:, do:do + n] += 1
                moved[p.src_rank] = moved.get(p.src_rank, 0) + n * m.src.num_regions
    # Every byte of every receiver's blocks of this request written exactly once.
    assert (writes[:, :, dst_ids, :] == 1).all(), "a byte landed twice or never"
    assert writes.sum() == writes[:, :, dst_ids, :].sum(), "bytes landed outside the request's blocks"
    return [d[:, dst_ids, :] for d in dst_pool], moved


def expected(e: EngineKv, num_blocks: int) -> list[np.ndarray]:
    return rank_caches(e, num_blocks, fill=True)


# ------------------------------------------------------------------ concrete pairs
@pytest.mark.parametrize("p_tp,d_tp,heads,writers,per_dst", [
    (2, 1, 2, (0, 1), [2]),          # P TP2 -> D TP1: decode rank 0 merges two ranks' heads
    (1, 2, 2, (0,), [1, 1]),         # P TP1 -> D TP2: one prefill rank feeds both
    (2, 2, 2, (0, 1), [1, 1]),       # equal TP: rank r -> rank r, whole blocks
    (4, 2, 2, (0, 2), [1, 1]),       # prefill replicates: one replica per head writes
    (2, 4, 2, (0, 1), [1, 1, 1, 1]),  # decode replicates: each replica gets the head
    (8, 8, 8, tuple(range(8)), [1] * 8),
    (8, 2, 8, tuple(range(8)), [4, 4]),
    (2, 8, 8, (0, 1), [1] * 8),
    (8, 8, 2, tuple(range(8)), [1] * 8),  # both replicate 4x: replica i reads replica i
])
def test_concrete_pairs(p_tp, d_tp, heads, writers, per_dst):
    m = compute_tp_mapping(engine(p_tp, heads), engine(d_tp, heads))
    assert m.writer_ranks == writers
    assert [m.writers_of(d) for d in range(d_tp)] == per_dst
    for by in ("src", "dst"):
        got, moved = move(m, 5, by=by)
        for d, (g, want) in enumerate(zip(got, expected(m.dst, 5))):
            np.testing.assert_array_equal(g, want, err_msg=f"receiver rank {d} ({by})")
        assert sum(moved.values()) == m.request_bytes(5)
        assert sorted(moved) == list(writers)
        for r in writers:
            assert moved[r] == m.bytes_out_of(r, 5)


def test_equal_tp_moves_whole_blocks_rank_to_rank():
    m = compute_tp_mapping(engine(4, 8), engine(4, 8))
    assert [(s.src_rank, s.dst_rank, s.whole_block) for s in m.slices] == [(r, r, True) for r in range(4)]


def test_merge_offsets_p2_to_d1():
    m = compute_tp_mapping(engine(2, 4), engine(1, 4))
    assert [(s.src_rank, s.first_head, s.num_heads, s.src_offset, s.dst_offset, s.nbytes)
            for s in m.into(0)] == [(0, 0, 2, 0, 0, 128), (1, 2, 2, 0, 128, 128)]
    assert not any(s.whole_block for s in m.slices)
    assert m.readers_of(0) == m.readers_of(1) == 1


def test_split_offsets_p1_to_d2():
    m = compute_tp_mapping(engine(1, 4), engine(2, 4))
    assert [(s.dst_rank, s.src_offset, s.dst_offset, s.nbytes) for s in m.out_of(0)] == [
        (0, 0, 0, 128), (1, 128, 0, 128)]
    assert m.readers_of(0) == 2 and m.writers_of(1) == 1


def test_legacy_engines_without_head_counts_map_rank_to_rank():
    a = EngineKv(2, 16, 4096, 4, "bfloat16", "kv_split")
    m = compute_tp_mapping(a, a)
    assert [(s.src_rank, s.dst_rank, s.nbytes, s.whole_block) for s in m.slices] == [
        (0, 0, 4096, True), (1, 1, 4096, True)]
    with pytest.raises(KvIncompatible, match="did not publish its KV head count"):
        compute_tp_mapping(a, EngineKv(1, 16, 8192, 4, "bfloat16", "kv_split"))


def test_rank_out_of_range():
    m = compute_tp_mapping(engine(2, 2), engine(1, 2))
    with pytest.raises(ValueError, match="receiver rank 1"):
        m.into(1)
    with pytest.raises(ValueError, match="owner rank 2"):
        m.out_of(2)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("a,b,reason", [
    (engine(2, 2, dtype="float16"), engine(2, 2, dtype="bfloat16"), "dtype differs"),
    (engine(2, 2, layout="block_major"), engine(2, 2, layout="kv_split"), "layout differs"),
    (engine(2, 2, regions=3), engine(2, 2, regions=4), "region count differs"),
    (engine(2, 2, tpb=16), engine(2, 2, tpb=32), "block sizes differ"),
    (engine(1, 2, tpb=32), engine(1, 2, tpb=16), "block sizes differ"),
    (engine(3, 6), engine(4, 6), "6 KV heads cannot be spread over 4"),
    (engine(2, 4), engine(2, 8), "head counts differ"),
    (engine(2, 4, head_bytes=64), engine(1, 4, head_bytes=128), "bytes per head"),
    (engine(2, 4, head_major=False), engine(1, 4, head_major=False), "not head-major"),
    (engine(1, 2, head_major=True), engine(2, 2, head_major=False), "not head-major"),
])
def test_incompatible_pairs_refused_with_reason(a, b, reason):
    why = incompatibility(a, b)
    assert why is not None and reason in why, why
    with pytest.raises(KvIncompatible, match=reason):
        compute_tp_mapping(a, b)


def test_whole_block_pairs_need_no_head_major_layout():
    # NHD-style blocks are fine while every rank pair moves whole blocks.
    assert incompatibility(engine(2, 2, head_major=False), engine(2, 2, head_major=False)) is None
    assert incompatibility(engine(4, 2, head_major=False), engine(2, 2, head_major=False)) is None


def test_split_reason_and_holders():
    assert split_reason(4, 6) and split_reason(0, 2) and split_reason(2, 0)
    assert split_reason(8, 2) is None and split_reason(2, 8) is None
    assert list(rank_heads(2, 8, 1)) == [4, 5, 6, 7]
    assert list(rank_heads(8, 2, 5)) == [1]
    assert head_holders(8, 2, 1) == [4, 5, 6, 7] and head_holders(2, 8, 5) == [1]
    with pytest.raises(KvIncompatible):
        rank_heads(4, 6, 0)
    with pytest.raises(ValueError):
        rank_heads(2, 2, 2)


# ------------------------------------------------------------------ properties
def _tp_for(heads: int) -> st.SearchStrategy[int]:
    divisors = [t for t in range(1, heads + 1) if heads % t == 0]
    multiples = [heads * k for k in (2, 4, 8) if heads * k <= 16]
    return st.sampled_from(divisors + multiples)


@st.composite
def pairs(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    return heads, draw(_tp_for(heads)), draw(_tp_for(heads))


@settings(max_examples=150, deadline=None)
@given(pair=pairs(), num_blocks=st.integers(1, 6), by=st.sampled_from(["src", "dst"]))
def test_every_head_lands_exactly_once_and_bytes_add_up(pair, num_blocks, by):
    heads, p_tp, d_tp = pair
    m = compute_tp_mapping(engine(p_tp, heads), engine(d_tp, heads))
    got, moved = move(m, num_blocks, by=by)  # asserts every receiver byte written exactly once
    for g, want in zip(got, expected(m.dst, num_blocks)):
        np.testing.assert_array_equal(g, want)
    assert sum(moved.values()) == m.request_bytes(num_blocks)
    assert sum(m.bytes_into(d, num_blocks) for d in range(d_tp)) == m.request_bytes(num_blocks)
    assert sum(m.bytes_out_of(s, num_blocks) for s in range(p_tp)) == m.request_bytes(num_blocks)
    # Every (receiver rank, head) pair has exactly one source holding that head.
    for d in range(d_tp):
        got_heads = [h for s in m.into(d) for h in range(s.first_head, s.first_head + s.num_heads)]
        assert got_heads == list(m.dst.heads_of(d))
        for s in m.into(d):
            assert set(range(s.first_head, s.first_head + s.num_heads)) <= set(m.src.heads_of(s.src_rank))
    # Writers: exactly the ranks that move something; no rank writes twice into one receiver
    # (one slice per (owner, receiver) pair: adjacent heads coalesce).
    assert set(m.writer_ranks) == set(moved)
    assert writer_ranks(m.src, m.dst) == m.writer_ranks  # what the control plane expects
    keys = [(s.src_rank, s.dst_rank) for s in m.slices]
    assert len(keys) == len(set(keys))
    assert sum(m.writers_of(d) for d in range(d_tp)) == len(m.slices)
    assert sum(m.readers_of(s) for s in range(p_tp)) == len(m.slices)


@settings(max_examples=100, deadline=None)
@given(pair=pairs())
def test_mapping_is_load_balanced_over_replicas(pair):
    heads, p_tp, d_tp = pair
    m = compute_tp_mapping(engine(p_tp, heads), engine(d_tp, heads))
    if p_tp == d_tp:
        assert [(s.src_rank, s.dst_rank) for s in m.slices] == [(r, r) for r in range(p_tp)]
    # No owner rank feeds more receivers than needed: at most ceil(d_tp / p_tp) (or all of
    # a receiver's heads come from ceil(p_tp/d_tp)-sized groups).
    per_owner = max(m.readers_of(s) for s in m.writer_ranks)
    assert per_owner <= max(-(-d_tp // p_tp), 1)
    assert len(m.writer_ranks) == min(p_tp, max(heads, d_tp))


@settings(max_examples=200, deadline=None)
@given(ha=st.integers(1, 12), hb=st.integers(1, 12), ta=st.integers(1, 12), tb=st.integers(1, 12))
def test_check_and_mapping_agree(ha, hb, ta, tb):
    """The control plane's verdict (incompatibility) is exactly when the mapping raises."""
    a = EngineKv(ta, 16, max(ha // ta, 1) * HEAD_BYTES, 2, "float16", "block_major", ha, True)
    b = EngineKv(tb, 16, max(hb // tb, 1) * HEAD_BYTES, 2, "float16", "block_major", hb, True)
    why = incompatibility(a, b)
    if why is None:
        got, _ = move(compute_tp_mapping(a, b), 2, by="src")
        for g, want in zip(got, expected(b, 2)):
            np.testing.assert_array_equal(g, want)
    else:
        with pytest.raises(KvIncompatible):
            compute_tp_mapping(a, b)


def test_head_major_blocks():
    from kvbaton.connector.transfer.tp_mapping import head_major_blocks

    def dense(shape):
        return tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    cpu = (10, 4, 16, 128)  # vLLM CPU: [blocks, heads, block_size, 2*head_dim]
    assert head_major_blocks(cpu, dense(cpu), 4)
    assert head_major_blocks((10, 16, 4, 64), dense((10, 16, 4, 64)), 1)  # one head: the whole block
    assert not head_major_blocks((10, 16, 4, 64), dense((10, 16, 4, 64)), 4)  # NHD
    assert not head_major_blocks((10, 2, 16, 2, 64), dense((10, 2, 16, 2, 64)), 2)  # K/V outside the heads
    permuted = (10, 4, 16, 128)
    assert not head_major_blocks(permuted, (8192, 128, 512, 1), 4)  # heads inside tokens in memory


def test_worker_publishes_its_heads():
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    import types

    from kvbaton.connector.metadata import KvbatonSettings
    from kvbaton.connector.worker import KvbatonWorker

    values = {"control_plane": "127.0.0.1:9", "engine_id": "e"}
    ktc = types.SimpleNamespace(engine_id="", get_from_extra_config=lambda k, default=None: values.get(k, default))
    s = KvbatonSettings.from_vllm(ktc)
    w = KvbatonWorker(s, "kv_producer", 1, tp_size=2, total_kv_heads=4)
    assert w._head_fields([torch.zeros(8, 2, 16, 128)]) == {"total_kv_heads": 4, "head_major": True}
    assert w._head_fields([torch.zeros(8, 16, 2, 128)]) == {"total_kv_heads": 4, "head_major": False}
    assert KvbatonWorker(s, "kv_producer", 0)._head_fields([torch.zeros(8, 2, 16, 128)]) == {}


@settings(max_examples=80, deadline=None)
@given(pair=pairs(), num_blocks=st.integers(1, 8), seed=st.integers(0, 1000))
def test_descriptors_move_the_same_bytes_as_the_slices(pair, num_blocks, seed):
    """The NIXL rows ``descs`` builds, applied to flat memory, land exactly what the
    per-block extents say (coalesced whole-block runs included)."""
    import types

    heads, p_tp, d_tp = pair
    m = compute_tp_mapping(engine(p_tp, heads, regions=2), engine(d_tp, heads, regions=2))
    rng = np.random.default_rng(seed)
    pool = 12
    # Sometimes contiguous ids (runs coalesce), sometimes scattered.
    src_ids = (np.arange(num_blocks) + 2 if seed % 2 else rng.choice(pool, num_blocks, replace=False)).tolist()
    dst_ids = (np.arange(num_blocks) + 1 if seed % 3 else rng.choice(pool, num_blocks, replace=False)).tolist()

    def lay(e: EngineKv, rank: int):
        span = pool * e.bytes_per_block
        return types.SimpleNamespace(region_base_addrs=(rank * 10_000_000, rank * 10_000_000 + span + 64),
                                     block_stride_bytes=e.bytes_per_block, bytes_per_block=e.bytes_per_block,
                                     device_id=rank)
    for p in m.slices:
        sl, dl = lay(m.src, p.src_rank), lay(m.dst, p.dst_rank)
        a, b = m.descs(p, sl, src_ids, dl, dst_ids)
        assert a.shape == b.shape and (a[:, 1] == b[:, 1]).all() and (a[:, 2] == p.src_rank).all()
        got = {(int(x), int(y)) for ra, rb in zip(a, b) for x, y in zip(range(int(ra[0]), int(ra[0] + ra[1])),
                                                                           range(int(rb[0]), int(rb[0] + rb[1])))}
        want = set()
        for r in range(2):
            for so, do, n in m.extents(p, src_ids, dst_ids, m.src.bytes_per_block, m.dst.bytes_per_block):
                sb, db = sl.region_base_addrs[r] + so, dl.region_base_addrs[r] + do
                want |= {(sb + k, db + k) for k in range(n)}
        assert got == want
        if p.whole_block and seed % 2 and seed % 3:
            assert a.shape[0] == 2  # one run per region
