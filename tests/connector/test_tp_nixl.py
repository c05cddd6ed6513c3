"""Per-rank KV moves with real NIXL (host memory, UCX on loopback): one agent per TP rank,
head slices and descriptors from ``TpMapping``, push (owners WRITE, a receiver waits for
one notification per writer) and pull (receivers READ). Every landed head is compared
with what the owner holds; bytes per rank add up to the request's KV.

All agents live in this process and are progressed by the test thread (no NIXL progress
thread): waits poll every other agent between checks.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl")

from kvbaton.connector.transfer.descriptors import TransferPlan  # noqa: E402
from kvbaton.connector.transfer.geometry import KvLayout  # noqa: E402
from kvbaton.connector.transfer.nixl_agent import NixlEndpoint  # noqa: E402
from kvbaton.connector.transfer.tp_mapping import compute_tp_mapping  # noqa: E402
from kvbaton.kvgeometry import EngineKv  # noqa: E402

pytestmark = pytest.mark.nixl

LAYERS, POOL, TPB, HEAD_DIM, HEADS = 2, 24, 16, 32, 4
_names = itertools.count()


class Rank:
    """One TP rank: its heads' share of a head-major KV cache and its own NIXL agent."""

    def __init__(self, side: str, rank: int, e: EngineKv) -> None:
        self.heads = list(e.heads_of(rank))
        self.caches = [torch.zeros((POOL, len(self.heads), TPB, 2 * HEAD_DIM), dtype=torch.float32)
                       for _ in range(LAYERS)]
        self.layout = KvLayout.from_tensors(self.caches, TPB, block_dim=0)
        self.ep = NixlEndpoint(f"tp{side}{rank}-{next(_names)}", net_devices="lo", ucx_tls="tcp,self,sm")
        self.ep.register_layout(self.layout)


def head_values(layer: int, head: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * layer + head)
    return torch.randn((n, TPB, 2 * HEAD_DIM), generator=g)


def engine(tp: int) -> EngineKv:
    per = max(HEADS // tp, 1)
    return EngineKv(tp, TPB, per * TPB * 2 * HEAD_DIM * 4, LAYERS, "float32", "block_major", HEADS, True)


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2), (2, 2), (4, 2), (2, 4)])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_every_rank_moves_its_heads(p_tp, d_tp, mode):
    m = compute_tp_mapping(engine(p_tp), engine(d_tp))
    src = [Rank("P", r, m.src) for r in range(p_tp)]
    dst = [Rank("D", r, m.dst) for r in range(d_tp)]
    everyone = src + dst
    try:
        for a in everyone:
            for b in everyone:
                if a is not b:
                    a.ep.add_peer(b.ep.name, b.ep.metadata())
        rng = np.random.default_rng(p_tp * 10 + d_tp)
        n = 5
        src_ids = rng.choice(POOL, n, replace=False).tolist()
        dst_ids = sorted(rng.choice(POOL, n, replace=False).tolist())  # some runs contiguous
        for r in src:
            for layer, c in enumerate(r.caches):
                for i, h in enumerate(r.heads):
                    c[src_ids, i] = head_values(layer, h, n)

        def progress() -> None:
            for x in everyone:
                x.ep.poll_notifs()

        moved: dict[tuple[str, int], int] = {}
        if mode == "push":
            for s, owner in enumerate(src):
                for piece in m.out_of(s):
                    recv = dst[piece.dst_rank]
                    loc, rem = m.descs(piece, owner.layout, src_ids, recv.layout, dst_ids)
                    plan = TransferPlan(loc, rem, int(loc[:, 1].sum()), len(loc))
                    owner.ep.wait(owner.ep.write(plan, recv.ep.name, f"push:{s}".encode()), 10.0, idle=progress)
                    moved[("P", s)] = moved.get(("P", s), 0) + plan.nbytes
            for d, recv in enumerate(dst):
                writers = sorted({p.src_rank for p in m.into(d)})
                assert len(writers) == m.writers_of(d)
                for s in writers:  # done only when every writer's notification is in
                    recv.ep.wait_notif(src[s].ep.name, f"push:{s}".encode(), timeout_s=10.0, idle=progress)
        else:
            for d, recv in enumerate(dst):
                for piece in m.into(d):
                    owner = src[piece.src_rank]
                    rem, loc = m.descs(piece, owner.layout, src_ids, recv.layout, dst_ids)
                    plan = TransferPlan(loc, rem, int(loc[:, 1].sum()), len(loc))
                    recv.ep.wait(recv.ep.read(plan, owner.ep.name), 10.0, idle=progress)
                    moved[("D", d)] = moved.get(("D", d), 0) + plan.nbytes
        assert sum(moved.values()) == m.request_bytes(n)
        for d, recv in enumerate(dst):
            for layer, c in enumerate(recv.caches):
                for i, h in enumerate(recv.heads):
                    assert torch.equal(c[dst_ids, i], head_values(layer, h, n)), (d, layer, h)
            untouched = [b for b in range(POOL) if b not in dst_ids]
            assert all(int(c[untouched].count_nonzero()) == 0 for c in recv.caches)
    finally:
        for x in everyone:
            x.ep.close()
