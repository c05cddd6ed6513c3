"""Reuse (D→P) pieces of the connector without engines.

* the hash chain prefill and decode must agree on;
* prefill's claim: only beyond its local prefix hit, only above the threshold, only once,
  and only blocks the chain matched;
* decode's :class:`RetentionManager` against a real control plane (``kvbaton serve``) and
  a fake block pool: a retained turn holds one reference per full block until its lease
  ends, a new turn replaces the old one, pressure revokes the oldest lease, a grant that
  cannot happen frees at once, and the local hard cap frees without the control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus

from kvbaton.connector.control import ControlThread
from kvbaton.connector.metadata import MODE_REUSE, KvbatonSettings
from kvbaton.connector.reuse import RetentionManager, hash_chain, reusable_blocks
from kvbaton.connector.scheduler import KvbatonScheduler

BS = 128


# ---------------------------------------------------------------------------- hash chain
def test_hash_chain_is_a_prefix_chain() -> None:
    a = list(range(1000))
    b = a[:300] + [7] * 700
    ha, hb = hash_chain(a, BS), hash_chain(b, BS)
    assert len(ha) == 1000 // BS and all(len(h) == 32 for h in ha)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]  # block 2 (tokens 256..383) differs
    assert all(x != y for x, y in zip(ha[2:], hb[2:]))  # and everything after it, by chaining
    assert reusable_blocks(b, BS, ha) == 2
    assert reusable_blocks(a[:700], BS, ha) == 700 // BS  # a shorter prompt matches its full blocks
    assert reusable_blocks([1] + a[1:], BS, ha) == 0
    assert hash_chain(a, BS, 3) == ha[:3]


# ---------------------------------------------------------------------------- prefill claim
def _req(rid: str, prompt: list[int], params: dict | None, status=RequestStatus.WAITING, computed: int = 0):
    return types.SimpleNamespace(request_id=rid, prompt_token_ids=prompt, num_prompt_tokens=len(prompt),
                                 kv_transfer_params=params, status=status, num_computed_tokens=computed,
                                 all_token_ids=prompt)


def _blocks(ids: list[int]):
    return types.SimpleNamespace(get_block_ids=lambda: (list(ids),))


def _reuse(history: list[int], block_ids: list[int]) -> dict:
    return {"conversation_id": "c1", "engine_id": "d0", "lease_id": "L1", "retention_id": "R1",
            "block_ids": block_ids, "num_tokens": len(block_ids) * BS, "tokens_per_block": BS,
            "block_hashes": [h.hex() for h in hash_chain(history, BS)]}


@pytest.fixture
def prefill() -> KvbatonScheduler:
    return KvbatonScheduler(KvbatonSettings(control_plane="127.0.0.1:1", engine_id="p0"), BS)


def test_prefill_claims_matching_blocks_beyond_local_hit_once(prefill: KvbatonScheduler) -> None:
    history = list(range(10, 10 + 4 * BS))  # 4 retained blocks on decode: 40..43
    prompt = history[: 3 * BS] + [5] * 200  # the prompt shares 3 of them, then diverges
    params = {"do_remote_decode": True, "transfer_id": "t1", "reuse": _reuse(history, [40, 41, 42, 43])}
    r = _req("r1", prompt, params)
    assert prefill.get_num_new_matched_tokens(r, BS) == (2 * BS, True)  # block 0 is a local hit
    prefill.update_state_after_alloc(r, _blocks([7, 8, 9, 10, 11]), 2 * BS)
    spec = prefill.build_connector_meta(None).loads["r1"]
    assert spec.mode == MODE_REUSE and spec.remote_engine_id == "d0"
    assert spec.local_block_ids == (8, 9) and spec.remote_block_ids == (41, 42)
    assert spec.reuse is not None and (spec.reuse.lease_id, spec.reuse.retention_id) == ("L1", "R1")
    assert "reuse" not in params and params["do_remote_decode"]  # P→D hand-off untouched
    # A failed read re-enters admission: recompute, never claim again.
    assert prefill.get_num_new_matched_tokens(r, 0) == (0, False)


def test_prefill_recomputes_below_threshold_or_on_mismatch(prefill: KvbatonScheduler) -> None:
    history = list(range(10, 10 + 2 * BS))
    r = _req("r2", history + [1] * 50, {"reuse": _reuse(history, [3, 4])})
    assert prefill.get_num_new_matched_tokens(r, 2 * BS) == (0, False)  # all of it is a local hit
    r = _req("r3", [9] * 400, {"reuse": _reuse(history, [3, 4])})
    assert prefill.get_num_new_matched_tokens(r, 0) == (0, False)  # different history
    bad = {**_reuse(history, [3, 4]), "tokens_per_block": 16}
    r = _req("r4", history + [1] * 50, {"reuse": bad})
    assert prefill.get_num_new_matched_tokens(r, 0) == (0, False)  # another block size
    assert prefill.reuse_stats["reuse_claimed"] == 0


def test_every_reuse_offer_leaves_a_stats_line_with_the_local_hit(tmp_path) -> None:
    """Why a reuse turn READ or not (``<engine>.scheduler.jsonl``): what prefill's own prefix
    cache held of the history, what decode offered, and the decision."""
    sched = KvbatonScheduler(KvbatonSettings(control_plane="127.0.0.1:1", engine_id="p0",
                                             stats_dir=str(tmp_path)), BS)
    history = list(range(10, 10 + 3 * BS))
    sched.get_num_new_matched_tokens(_req("a", history + [1] * 50, {"reuse": _reuse(history, [3, 4, 5])}), BS)
    sched.get_num_new_matched_tokens(_req("b", history + [1] * 50, {"reuse": _reuse(history, [3, 4, 5])}), 3 * BS)
    sched.get_num_new_matched_tokens(_req("c", [9] * 400, {"reuse": _reuse(history, [3, 4, 5])}), 0)
    lines = [json.loads(x) for x in (tmp_path / "p0.scheduler.jsonl").read_text().splitlines()]
    got = [(e["request_id"], e["local_hit_tokens"], e["reusable_tokens"], e["read_tokens"], e["decision"])
           for e in lines if e["event"] == "reuse_offer"]
    assert got == [("a", BS, 3 * BS, 2 * BS, "read"), ("b", 3 * BS, 3 * BS, 0, "below_threshold"),
                   ("c", 0, 0, 0, "no_match")]
    assert all(e["conversation_id"] == "c1" for e in lines if e["event"] == "reuse_offer")


# ---------------------------------------------------------------------------- decode retention
class FakePool:
    """The bits of vLLM's BlockPool the manager uses (refcounts only)."""

    def __init__(self, n: int) -> None:
        self.num_gpu_blocks = n
        self.blocks = [types.SimpleNamespace(block_id=i, ref_cnt=0) for i in range(n)]

    def touch(self, blocks) -> None:
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks) -> None:
        for b in blocks:
            assert b.ref_cnt > 0, f"double free of block {b.block_id}"
            b.ref_cnt -= 1

    def refs(self, ids) -> list[int]:
        return [self.blocks[i].ref_cnt for i in ids]


@pytest.fixture(scope="module")
def control_plane() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(Path(sys.executable).parent / "kvbaton"), "serve", "--insecure", "--listen",
                             f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                break
            assert proc.poll() is None and time.monotonic() < deadline, "control plane did not start"
            time.sleep(0.1)
        addr = f"127.0.0.1:{port}"
        _register_decode(addr, "d0")
        yield addr
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


def _register_decode(addr: str, engine_id: str) -> None:
    import torch

    from kvbaton.client import KvbatonClient
    from kvbaton.connector.transfer.geometry import KvLayout
    from kvbaton.v1 import common_pb2, registrar_pb2

    layout = KvLayout.from_tensors([torch.zeros(8, 2, BS, 128)], BS, block_dim=0)

    async def go() -> None:
        async with KvbatonClient(addr) as kv:
            await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(
                rank=registrar_pb2.EngineRank(
                    engine_id=engine_id, role=common_pb2.ENGINE_ROLE_DECODE, tp_size=1, tp_rank=0,
                    agent_name="a-" + engine_id, agent_metadata=b"x",
                    geometry=common_pb2.KvGeometry(**layout.to_proto_fields())), ttl_ms=600_000))
    asyncio.run(go())


def _until(pred, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _lease_call(addr: str, method: str, req):
    from kvbaton.client import KvbatonClient

    async def go():
        async with KvbatonClient(addr) as kv:
            return await getattr(kv.lease, method)(req, timeout=5)
    return asyncio.run(go())


@pytest.fixture
def manager(control_plane: str) -> Iterator[tuple[RetentionManager, FakePool]]:
    settings = KvbatonSettings(control_plane=control_plane, engine_id="d0", lease_ttl_s=30.0,
                               max_retained_fraction=0.5)
    ctl = ControlThread(control_plane, name="test-retention")
    mgr = RetentionManager(settings, BS, ctl)
    pool = FakePool(16)
    mgr.bind(pool)
    try:
        yield mgr, pool
    finally:
        ctl.close()


def _leased(mgr: RetentionManager) -> bool:
    return all(h["state"] == "leased" for h in mgr.snapshot()) and bool(mgr.snapshot())


def test_retain_holds_full_blocks_until_the_lease_ends(manager, control_plane: str) -> None:
    from kvbaton.v1 import lease_pb2

    mgr, pool = manager
    tokens = list(range(3 * BS + 40))
    out = mgr.retain("conv-a", tokens, [1, 2, 3, 4], num_computed_tokens=len(tokens) - 1)
    assert out is not None and out["block_ids"] == [1, 2, 3] and out["num_tokens"] == 3 * BS
    assert pool.refs([1, 2, 3, 4]) == [1, 1, 1, 0]  # the partial block stays the request's
    _until(lambda: _leased(mgr), what="lease")
    lease = _lease_call(control_plane, "Get", lease_pb2.GetLeaseRequest(conversation_id="conv-a"))
    assert lease.num_blocks == 3 and lease.engine_id == "d0" and lease.ttl_ms == 30_000

    # Next turn: the new retention replaces the old one (Grant revokes it → event → free).
    tokens2 = tokens + list(range(200))
    mgr.retain("conv-a", tokens2, [1, 2, 3, 4, 5], num_computed_tokens=len(tokens2) - 1)
    _until(lambda: (mgr.drain() or True) and len(mgr.snapshot()) == 1 and _leased(mgr), what="replace")
    assert pool.refs([1, 2, 3, 4, 5]) == [1, 1, 1, 1, 0]

    _lease_call(control_plane, "Revoke", lease_pb2.RevokeRequest(conversation_id="conv-a", reason="done"))
    _until(lambda: (mgr.drain() or True) and not mgr.snapshot(), what="free after revoke")
    assert pool.refs(range(16)) == [0] * 16
    assert mgr.stats["freed"] == 2


def test_pressure_revokes_least_recently_renewed(manager, control_plane: str) -> None:
    from kvbaton.v1 import lease_pb2

    mgr, pool = manager  # cap: 0.5 × 16 = 8 blocks
    mgr.retain("old", list(range(5 * BS)), [1, 2, 3, 4, 5], num_computed_tokens=5 * BS)
    _until(lambda: _leased(mgr), what="first lease")
    mgr.retain("new", list(range(4 * BS)), [6, 7, 8, 9], num_computed_tokens=4 * BS)
    _until(lambda: (mgr.drain() or True) and [h["conversation_id"] for h in mgr.snapshot()] == ["new"],
           what="old revoked for pressure")
    assert pool.refs([1, 2, 3, 4, 5]) == [0] * 5 and pool.refs([6, 7, 8, 9]) == [1] * 4
    assert mgr.stats["revoked_for_pressure"] == 1
    _lease_call(control_plane, "Revoke", lease_pb2.RevokeRequest(conversation_id="new"))
    _until(lambda: (mgr.drain() or True) and not mgr.snapshot(), what="cleanup")


def test_hard_cap_frees_without_the_control_plane(manager) -> None:
    mgr, pool = manager
    mgr.retain("capped", list(range(2 * BS)), [3, 4], num_computed_tokens=2 * BS)
    _until(lambda: _leased(mgr), what="lease")
    for h in mgr._holds.values():  # as if the control plane had been silent past the cap
        h.hard_deadline = time.monotonic() - 1
    assert mgr.drain() == 1 and pool.refs([3, 4]) == [0, 0]
    assert mgr.stats["hard_cap_freed"] == 1


def test_unreachable_control_plane_frees_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    ctl = ControlThread(dead, timeout_s=0.5, name="test-dead")
    try:
        mgr = RetentionManager(KvbatonSettings(control_plane=dead, engine_id="d0"), BS, ctl)
        pool = FakePool(8)
        mgr.bind(pool)
        mgr.retain("lost", list(range(2 * BS)), [1, 2], num_computed_tokens=2 * BS)
        assert pool.refs([1, 2]) == [1, 1]
        _until(lambda: (mgr.drain() or True) and not mgr.snapshot(), timeout_s=20, what="free")
        assert pool.refs([1, 2]) == [0, 0] and mgr.stats["grant_failed"] == 1
    finally:
        ctl.close()


def test_restarted_engine_revokes_leases_it_cannot_honour(manager, control_plane: str) -> None:
    """A new incarnation of d0 (another holder label) revokes the leases the old one took:
    their block ids name memory the new process never retained."""
    old, pool = manager
    old.retain("orphan", list(range(2 * BS)), [5, 6], num_computed_tokens=2 * BS)
    _until(lambda: _leased(old), what="lease")
    settings = KvbatonSettings(control_plane=control_plane, engine_id="d0", lease_ttl_s=30.0)
    ctl = ControlThread(control_plane, name="test-restarted")
    try:
        new = RetentionManager(settings, BS, ctl)
        new.bind(FakePool(16))  # starts the watch: the snapshot shows the orphan lease
        _until(lambda: (old.drain() or True) and not old.snapshot(), what="orphan revoked")
        assert pool.refs([5, 6]) == [0, 0]
    finally:
        ctl.close()


def test_verify_kv_passes_retained_and_freed_holds_to_the_worker(control_plane: str) -> None:
    """verify_kv: the blocks a turn retains reach the worker (to fingerprint) in the next
    step's metadata, and so does their release (to forget the fingerprints)."""
    from kvbaton.v1 import lease_pb2

    settings = KvbatonSettings(control_plane=control_plane, engine_id="d0", lease_ttl_s=30.0, verify_kv=True)
    ctl = ControlThread(control_plane, name="test-verify-retains")
    try:
        mgr = RetentionManager(settings, BS, ctl)
        pool = FakePool(16)
        mgr.bind(pool)
        out = mgr.retain("conv-v", list(range(2 * BS + 5)), [6, 7, 8], num_computed_tokens=2 * BS + 4)
        assert out is not None
        assert mgr.take_retains() == {out["hold_id"]: ("conv-v", (6, 7))}
        assert mgr.take_retains() == {}  # once
        _until(lambda: _leased(mgr), what="lease")
        _lease_call(control_plane, "Revoke", lease_pb2.RevokeRequest(conversation_id="conv-v", reason="done"))
        _until(lambda: (mgr.drain() or True) and not mgr.snapshot(), what="free after revoke")
        assert mgr.take_retains() == {out["hold_id"]: ("conv-v", ())}
        assert pool.refs([6, 7]) == [0, 0]
    finally:
        ctl.close()
    # Off (the default): nothing is queued for the worker.
    mgr2 = RetentionManager(KvbatonSettings(control_plane=control_plane, engine_id="d0"), BS,
                            ControlThread(control_plane, name="test-verify-off"))
    mgr2.bind(FakePool(8))
    mgr2.retain("conv-off", list(range(2 * BS)), [1, 2], num_computed_tokens=2 * BS)
    assert mgr2.take_retains() == {}
    mgr2.control.close()


def test_fault_file_counts_and_reloads(tmp_path: Path) -> None:
    from kvbaton.connector.flows.faults import Faults

    assert not Faults("").take_corruption("pull") and Faults("").value("delay_reuse_read_s") == 0.0
    f = tmp_path / "faults.json"
    faults = Faults(str(f))
    assert not faults.take_corruption("pull")  # no file: no fault
    f.write_text('{"corrupt_landed": {"pull": 2}, "delay_reuse_read_s": 1.5}')
    assert [faults.take_corruption("pull") for _ in range(3)] == [True, True, False]
    assert not faults.take_corruption("reuse") and faults.value("delay_reuse_read_s") == 1.5
    f.unlink()
    assert not faults.take_corruption("pull") and faults.value("delay_reuse_read_s") == 0.0


def test_fault_kill_group_fires_once_per_file_version(tmp_path: Path) -> None:
    import os
    import subprocess

    from kvbaton.connector.flows.faults import Faults, kill_process_group
    from kvbaton.stack.procs import process_group_members

    f = tmp_path / "faults.json"
    faults = Faults(str(f))
    assert faults.take_once("kill_group_at_reuse_read") == 0  # no file: no fault
    f.write_text('{"kill_group_at_reuse_read": 4242}')
    assert [faults.take_once("kill_group_at_reuse_read") for _ in range(2)] == [4242, 0]
    # A real group (own session, so its pgid is its pid) is gone once killed.
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert process_group_members(child.pid) == [child.pid]
        kill_process_group(child.pid)
        child.wait(10)
        assert process_group_members(child.pid) == []
        kill_process_group(child.pid)  # already gone: no error
    finally:
        if child.poll() is None:
            os.killpg(child.pid, 9)
            child.wait(10)
