"""The pack path (``staging: always``) inside real vLLM workers, on CPU, with NIXL.

One stack: control plane, prefill (prefix caching off, so reused history really comes
from decode) and decode, both with ``staging: always`` and ``verify_kv: true``, and small
staging slots (2 block rows of the tiny model) so every transfer is cut into several
chunks that reuse the 2-slot pool. Checked for push, pull and a reuse READ:

- output equals the prefill engine alone;
- the stats say the staged path moved it (``strategy: pack``; push: prefill's
  ``send_done``, several chunks; pull/reuse: the reader's ``recv_done`` / ``reuse_read``
  and the owner's ``staged_serve``);
- every transfer verified against the owner's fingerprints after the scatter, 0 mismatches;
- prefill's KV usage returns to 0 and decode's to its baseline.

Failure paths (test-only faults, ``worker.Faults``): a block corrupted after the scatter is
caught by the reader's verification (recompute, output equal); an owner that answers a
staged READ only after the reader's deadline ends in a recompute, its late chunks are
acked but never scattered, and the next staged transfer works (the pools are not wedged).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbaton.stack.pd_stack import PdStack, usage_back_to_zero
from kvbaton.tinymodel import ensure_tiny_model
from kvbaton.v1 import lease_pb2
from tests.harness.pd_rig import PdRig, ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROW = 131072  # bytes of one block of one layer (tiny model, float32)
SLOT = 2 * ROW


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdRig]:
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    work = tmp_path_factory.mktemp("staging")
    fault_file = work / "faults.json"
    extra = {"staging": "always", "staging_slot_bytes": SLOT, "staging_slots": 2, "verify_kv": True,
             "lease_ttl_s": 5.0, "pin_ttl_s": 6.0, "kv_recompute_threshold": 64, "fault_file": str(fault_file)}
    with PdStack(model, work, router_modes=("pull", "push"), timeout_s=8.0, extra_config=extra,
                 prefill_args=["--no-enable-prefix-caching"], router_control_plane=True) as s:
        yield PdRig(s, fault_file)


def test_staging_published(rig: PdRig) -> None:
    """Both ranks carry their receive pool in the registrar (the peer's WRITE target)."""
    import asyncio

    from kvbaton.client import KvbatonClient
    from kvbaton.v1 import registrar_pb2

    async def go() -> list[Any]:
        async with KvbatonClient(rig.s.cp_address) as kv:
            return [(await kv.registrar.GetEngine(registrar_pb2.GetEngineRequest(engine_id=e), timeout=5)).ranks[0]
                    for e in ("p0", "d0")]
    for rank in asyncio.run(go()):
        assert rank.HasField("staging"), rank.engine_id
        assert (rank.staging.slot_bytes, rank.staging.num_slots, rank.staging.mem_type) == (SLOT, 2, "DRAM")
        assert rank.staging.base_addr > 0


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_pd_transfer_is_staged(rig: PdRig, mode: str) -> None:
    prompt = ids(40 if mode == "pull" else 41, 420)  # 4 blocks x 2 layers = 8 rows: 4 chunks of 2
    ref = rig.single(prompt)
    d_base = rig.d_usage()
    d0, p0 = rig.s.event_count("d0"), rig.s.event_count("p0")
    assert rig.tokens(mode, prompt) == ref
    recv = rig.wait_events("d0", "recv_done", d0)
    assert len(recv) == 1 and recv[0]["num_blocks"] >= 3, recv
    tid = recv[0]["transfer_id"]
    if mode == "push":
        sent = rig.wait_events("p0", "send_done", p0, transfer_id=tid)
        assert [(e["strategy"], e["mode"]) for e in sent] == [("pack", "push")], sent
        assert sent[0]["chunks"] >= 2, sent
        assert recv[0]["strategy"] == "pack", recv  # decode saw the staged completion first
    else:
        assert recv[0]["strategy"] == "pack", recv
        served = rig.wait_events("p0", "staged_serve", p0)
        assert len(served) == 1 and served[0]["chunks"] >= 2 and served[0]["peer"] == "d0", served
        assert served[0]["num_blocks"] == recv[0]["num_blocks"], (served, recv)
        assert rig.wait_events("p0", "send_done", p0, transfer_id=tid), "prefill never freed"
    ver = rig.wait_events("d0", "kv_verify", d0)
    assert [(v["transfer_id"], v["mode"], v["result"], v["num_blocks"]) for v in ver] == \
        [(tid, mode, "ok", recv[0]["num_blocks"])], ver
    assert not rig.s.events("d0", "recv_failed", since=d0)
    assert not rig.s.events("p0", "staged_serve_failed", since=p0)
    assert not rig.s.events("p0", "send_failed", since=p0)
    assert usage_back_to_zero(rig.s.p) == 0.0
    assert rig.d_usage() == d_base


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_reuse_read_is_staged(rig: PdRig, mode: str) -> None:
    conv = f"staging-reuse-{mode}"
    d_base = rig.d_usage()
    prompt = ids(50 if mode == "pull" else 51, 300)
    got = rig.tokens(mode, prompt, conv)
    rig.wait_retained(conv)
    prompt2 = prompt + got + ids(52, 100)
    p0, d0 = rig.s.event_count("p0"), rig.s.event_count("d0")
    assert rig.tokens(mode, prompt2, conv) == rig.single(prompt2)
    reads = rig.wait_events("p0", "reuse_read", p0, conversation_id=conv)
    assert len(reads) == 1 and reads[0]["strategy"] == "pack" and reads[0]["nbytes"] > 0, reads
    served = rig.wait_events("d0", "staged_serve", d0)
    assert len(served) == 1 and served[0]["peer"] == "p0" and served[0]["chunks"] >= 2, served
    assert served[0]["num_blocks"] == reads[0]["num_blocks"], (served, reads)
    ver = rig.wait_events("p0", "kv_verify", p0, mode="reuse")
    assert [(v["conversation_id"], v["result"], v["num_blocks"]) for v in ver] == \
        [(conv, "ok", reads[0]["num_blocks"])], ver
    assert not rig.s.events("p0", "reuse_failed", since=p0)
    assert not rig.s.events("d0", "staged_serve_failed", since=d0)
    rig.revoke(conv)
    assert usage_back_to_zero(rig.s.p) == 0.0
    deadline = time.monotonic() + 15.0
    while (u := rig.d_usage()) != d_base and time.monotonic() < deadline:
        time.sleep(0.3)
    assert u == d_base


def test_next_turn_and_revoke_come_after_a_late_grant(rig: PdRig) -> None:
    """Decode's Grant of a finished turn held back 2 s after its RegisterRetained (test
    fault): the router answers only once the turn is leased (the answer names the lease), so
    the next turn, sent at once, READs the history, and a revoke sent at once ends the last
    turn's lease (before the fix: no READ, and the late Grant made a lease the revoke never
    saw, holding decode's blocks for a TTL; session-20 CI)."""
    conv = "staging-late-grant"
    d_base = rig.d_usage()
    prompt = ids(53, 300)
    try:
        rig.faults(delay_grant_s=2.0)
        r0 = rig.s.event_count("d0", part="retention")
        out = rig.via("pull", prompt, conv)
        prompt2 = prompt + out["choices"][0]["token_ids"] + ids(54, 100)
        p0 = rig.s.event_count("p0")
        out2 = rig.via("pull", prompt2, conv)  # the next turn at once, as an agent sends it
        assert out2["choices"][0]["token_ids"] == rig.single(prompt2)
        reads = rig.wait_events("p0", "reuse_read", p0, conversation_id=conv)
        assert len(reads) == 1 and reads[0]["nbytes"] > 0, reads
        rig.revoke(conv)  # the conversation ends at once
    finally:
        rig.no_faults()
    assert len(rig.wait_events("d0", "fault_delay", r0, 2, part="retention")) == 2, "the Grants were not held back"
    ret, ret2 = out["kv_transfer_params"]["retained"], out2["kv_transfer_params"]["retained"]
    granted = [e["lease_id"] for e in rig.wait_events("d0", "retained", r0, 2, part="retention",
                                                       conversation_id=conv)]
    lease, _ = rig.lease(conv)
    assert lease is None or lease.state != lease_pb2.LEASE_STATE_ACTIVE, (lease, granted)  # none after the revoke
    assert [(r["lease"], r.get("lease_id")) for r in (ret, ret2)] == [("granted", g) for g in granted], (ret, ret2)
    deadline = time.monotonic() + 15.0
    while (u := rig.d_usage()) != d_base and time.monotonic() < deadline:
        time.sleep(0.3)
    assert u == d_base


def test_a_grant_later_than_the_routers_wait_does_not_outlive_the_revoke(rig: PdRig) -> None:
    """Decode's Grants held back 9 s, past the router's 5 s wait: the router answers turn 2
    with its lease still pending and the client revokes at once, ending turn 1's lease. Turn
    2's Grant then comes after the revoke: the lease service refuses it (the blocks were
    registered before the revoke) and decode frees them at once, instead of holding them
    under a new lease for its TTL (session 21's "left").

    The revoke goes out before anything else (the single engine's answer is checked after
    it): with the check first, a slow machine once let turn 2's Grant (then held 7 s) reach
    the lease service before the revoke, and the test saw no refusal."""
    conv = "staging-later-grant"
    d_base = rig.d_usage()
    prompt = ids(57, 300)
    r0 = rig.s.event_count("d0", part="retention")
    try:
        rig.faults(delay_grant_s=9.0)
        out = rig.via("pull", prompt, conv)
        assert out["kv_transfer_params"]["retained"]["lease"] == "pending"  # the router's wait ran out
        assert rig.wait_events("d0", "retained", r0, 1, timeout_s=20.0, part="retention", conversation_id=conv)
        r1 = rig.s.event_count("d0", part="retention")
        prompt2 = prompt + out["choices"][0]["token_ids"] + ids(58, 100)
        out2 = rig.via("pull", prompt2, conv)
        rig.revoke(conv)  # at once: before turn 2's Grant
        assert out2["kv_transfer_params"]["retained"]["lease"] == "pending"
    finally:
        rig.no_faults()
    assert out2["choices"][0]["token_ids"] == rig.single(prompt2)
    failed = rig.wait_events("d0", "retain_failed", r1, 1, timeout_s=20.0, part="retention", conversation_id=conv)
    assert failed and "FAILED_PRECONDITION" in failed[0]["error"] and "was revoked" in failed[0]["error"], failed
    assert not rig.s.events("d0", "retained", since=r1, part="retention", conversation_id=conv)
    lease, _ = rig.lease(conv)
    assert lease is not None and lease.state == lease_pb2.LEASE_STATE_REVOKED, lease
    deadline = time.monotonic() + 15.0
    while (u := rig.d_usage()) != d_base and time.monotonic() < deadline:
        time.sleep(0.3)
    assert u == d_base


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_corruption_after_scatter_is_detected(rig: PdRig, mode: str) -> None:
    prompt = ids(60 if mode == "pull" else 61, 300)
    ref = rig.single(prompt)
    d0 = rig.s.event_count("d0")
    try:
        rig.faults(corrupt_landed={mode: 1})
        assert rig.tokens(mode, prompt) == ref, f"{mode}: corrupted KV was served"
    finally:
        rig.no_faults()
    ver = rig.wait_events("d0", "kv_verify", d0)
    assert [(v["mode"], v["result"], v["corrupted"], v["mismatched"]) for v in ver] == \
        [(mode, "mismatch", True, [0])], ver
    failed = rig.wait_events("d0", "recv_failed", d0)
    assert len(failed) == 1 and failed[0]["reason"].startswith("KvIntegrityError"), failed
    assert usage_back_to_zero(rig.s.p) == 0.0


def test_late_staged_answer_is_refused_and_pools_recover(rig: PdRig) -> None:
    """Prefill answers decode's staged READ after decode's deadline (8 s): decode
    recomputes, prefill's late chunks are acked but not scattered (decode's blocks are
    free again), and the next staged pull is correct."""
    prompt = ids(70, 300)
    ref = rig.single(prompt)
    d_base = rig.d_usage()
    d0, p0 = rig.s.event_count("d0"), rig.s.event_count("p0")
    try:
        rig.faults(delay_staged_serve_s=9.0)
        assert rig.tokens("pull", prompt) == ref
        failed = rig.wait_events("d0", "recv_failed", d0)
        assert len(failed) == 1 and "TimeoutError" in failed[0]["reason"], failed
        served = rig.wait_events("p0", "staged_serve", p0, timeout_s=15.0)
        assert len(served) == 1, served  # the late answer completed: every chunk acked
    finally:
        rig.no_faults()
    assert not rig.s.events("d0", "kv_verify", since=d0)  # nothing landed to verify
    assert usage_back_to_zero(rig.s.p) == 0.0
    assert rig.d_usage() == d_base
    prompt2 = ids(71, 300)
    d1 = rig.s.event_count("d0")
    assert rig.tokens("pull", prompt2) == rig.single(prompt2)
    recv = rig.wait_events("d0", "recv_done", d1)
    assert len(recv) == 1 and recv[0]["strategy"] == "pack", recv
    ver = rig.wait_events("d0", "kv_verify", d1)
    assert [v["result"] for v in ver] == ["ok"], ver
