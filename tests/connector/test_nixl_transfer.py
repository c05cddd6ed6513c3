"""Real NIXL transfers between two agents on host memory (UCX over loopback/shm).

Both agents live in this process and are driven from the test thread; the passive side
is progressed through ``wait(..., idle=peer.poll_notifs)`` since neither agent runs
NIXL's (spinning) progress thread. One test moves data between two processes.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("nixl")
import torch

from kvbaton.connector.transfer.descriptors import plan_transfer
from kvbaton.connector.transfer.geometry import KvLayout
from kvbaton.connector.transfer.nixl_agent import NixlEndpoint

pytestmark = pytest.mark.nixl

LAYERS, NUM_BLOCKS, TPB = 4, 96, 16
_names = itertools.count()


def endpoint(prefix: str) -> NixlEndpoint:
    return NixlEndpoint(f"{prefix}{next(_names)}", net_devices="lo", ucx_tls="tcp,self,sm")


def kv(shape_first: str, fill: bool) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, TPB, 2, 16) if shape_first == "kv" else (NUM_BLOCKS, 2, TPB, 2, 16)
    if fill:
        return [torch.randint(-2**15, 2**15 - 1, shape, dtype=torch.int16).view(torch.bfloat16)
                for _ in range(LAYERS)]
    return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]


def blocks(tensors: list[torch.Tensor], ids: np.ndarray, block_dim: int) -> list[torch.Tensor]:
    idx = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    return [t.index_select(block_dim, idx).view(torch.int16) for t in tensors]


class Pair:
    def __init__(self, shape_first: str) -> None:
        self.block_dim = 1 if shape_first == "kv" else 0
        self.a, self.b = endpoint("A"), endpoint("B")
        self.ta, self.tb = kv(shape_first, True), kv(shape_first, False)
        self.la = KvLayout.from_tensors(self.ta, TPB)
        self.lb = KvLayout.from_tensors(self.tb, TPB)
        self.a.register_layout(self.la)
        self.b.register_layout(self.lb)
        self.a.add_peer(self.b.name, self.b.metadata())
        self.b.add_peer(self.a.name, self.a.metadata())

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture(scope="module", params=["kv", "block"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = Pair(request.param)
    yield p
    p.close()


def id_sets(seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        "contiguous": (np.arange(10, 40), np.arange(50, 80)),
        "fragmented": (rng.permutation(NUM_BLOCKS)[:40], rng.permutation(NUM_BLOCKS)[:40]),
    }


@pytest.mark.parametrize("kind", ["contiguous", "fragmented"])
@pytest.mark.parametrize("coalesce", [True, False])
def test_write(pair: Pair, kind: str, coalesce: bool) -> None:
    src, dst = id_sets(1)[kind]
    for t in pair.tb:
        t.zero_()
    plan = plan_transfer(pair.la, src, pair.lb, dst, op="WRITE", coalesce=coalesce)
    if kind == "contiguous" and coalesce:
        assert plan.num_descs == pair.la.num_regions  # one run per region
    note = f"w-{kind}-{coalesce}".encode()
    x = pair.a.write(plan, pair.b.name, note)
    pair.a.wait(x, timeout_s=10, idle=pair.b.poll_notifs)
    assert x.released
    assert pair.b.wait_notif(pair.a.name, note, timeout_s=10) == note
    for got, want in zip(blocks(pair.tb, dst, pair.block_dim), blocks(pair.ta, src, pair.block_dim)):
        assert torch.equal(got, want)
    untouched = np.setdiff1d(np.arange(NUM_BLOCKS), dst)
    assert all(int(t.abs().sum()) == 0 for t in blocks(pair.tb, untouched, pair.block_dim))


@pytest.mark.parametrize("kind", ["contiguous", "fragmented"])
def test_read(pair: Pair, kind: str) -> None:
    """B reads A's blocks (pull); A gets the notification (it may free them)."""
    src, dst = id_sets(2)[kind]
    for t in pair.tb:
        t.zero_()
    plan = plan_transfer(pair.lb, dst, pair.la, src, op="READ")
    x = pair.b.read(plan, pair.a.name, b"read-done")
    pair.b.wait(x, timeout_s=10, idle=pair.a.poll_notifs)
    pair.a.wait_notif(pair.b.name, b"read-done", timeout_s=10)
    for got, want in zip(blocks(pair.tb, dst, pair.block_dim), blocks(pair.ta, src, pair.block_dim)):
        assert torch.equal(got, want)


def test_handle_is_released_once(pair: Pair) -> None:
    plan = plan_transfer(pair.la, [0], pair.lb, [0])
    x = pair.a.write(plan, pair.b.name)
    pair.a.wait(x, timeout_s=10, idle=pair.b.poll_notifs)
    pair.a.release(x)  # second release is a no-op, not a double free
    with pytest.raises(RuntimeError, match="released"):
        pair.a.state(x)  # using a released NIXL handle would segfault


def test_repost_moves_the_new_bytes_with_the_new_notification(pair: Pair) -> None:
    """A finished request posted again moves what its source holds now and delivers the
    new notification; a request still in flight or released cannot be posted again."""
    import time

    plan = plan_transfer(pair.la, [3], pair.lb, [5])
    for t in pair.tb:
        t.zero_()
    x = pair.a.write(plan, pair.b.name, b"rp-1")
    if pair.a.state(x) == "PROC":  # on loopback it may be done already
        with pytest.raises(RuntimeError, match="not finished"):
            pair.a.repost(x, b"rp-x")
    deadline = time.monotonic() + 10
    while pair.a.state(x) != "DONE":
        pair.b.poll_notifs()
        assert time.monotonic() < deadline
    assert pair.b.wait_notif(pair.a.name, b"rp-1", timeout_s=10) == b"rp-1"
    for t in pair.ta:  # new source bytes for the second post
        t.view(torch.int16).select(pair.block_dim, 3).add_(1)
    pair.a.repost(x, b"rp-2")
    pair.a.wait(x, timeout_s=10, idle=pair.b.poll_notifs)  # releases it
    assert pair.b.wait_notif(pair.a.name, b"rp-2", timeout_s=10) == b"rp-2"
    for got, want in zip(blocks(pair.tb, [5], pair.block_dim), blocks(pair.ta, [3], pair.block_dim)):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="released"):
        pair.a.repost(x, b"rp-3")


def test_peer_errors(pair: Pair) -> None:
    plan = plan_transfer(pair.la, [0], pair.lb, [0])
    with pytest.raises(KeyError, match="add_peer"):
        pair.a.write(plan, "nobody")
    with pytest.raises(ValueError, match="expected"):
        pair.a.add_peer("not-" + pair.b.name, pair.b.metadata())


def test_idle_agent_does_not_spin() -> None:
    import time
    ep = endpoint("idle")
    t0 = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - t0 < 0.2  # NIXL's own progress thread would burn ~0.5 s
    ep.close()


def _child(conn: mp.connection.Connection, nbytes: int) -> None:
    """Second process: owns a buffer, lets the parent WRITE into it, reports a checksum."""
    ep = NixlEndpoint("child", net_devices="lo", ucx_tls="tcp,self,sm")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    lay = KvLayout([buf.data_ptr()], bytes_per_block=4096, num_blocks=nbytes // 4096,
                   tokens_per_block=16, dtype="uint8")
    ep.register_layout(lay)
    conn.send((ep.metadata(), lay.to_proto_fields()))
    ep.add_peer("parent", conn.recv())
    ep.wait_notif("parent", b"done", timeout_s=20)
    conn.send(int(buf.to(torch.int64).sum()))
    ep.close()


def test_two_processes_write() -> None:
    nbytes = 4096 * 64
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child_conn, nbytes), daemon=True)
    proc.start()
    try:
        ep = NixlEndpoint("parent", net_devices="lo", ucx_tls="tcp,self,sm")
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        lay = KvLayout([src.data_ptr()], bytes_per_block=4096, num_blocks=64,
                       tokens_per_block=16, dtype="uint8")
        ep.register_layout(lay)
        assert parent_conn.poll(60), "child did not start"
        md, fields = parent_conn.recv()
        remote = KvLayout.from_proto_fields(**fields)
        ep.add_peer("child", md)
        parent_conn.send(ep.metadata())
        rng = np.random.default_rng(3)
        ids, dst = rng.permutation(64)[:32], rng.permutation(64)[:32]
        x = ep.write(plan_transfer(lay, ids, remote, dst), "child", b"done")
        ep.wait(x, timeout_s=20, idle=ep.poll_notifs)
        assert parent_conn.poll(30), "child did not report"
        want = int(src.view(64, 4096)[torch.from_numpy(ids)].to(torch.int64).sum())
        assert parent_conn.recv() == want
        ep.close()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
