"""KV integrity verification (``verify_kv``) and kills during a reuse READ, real vLLM + NIXL.

One stack: control plane, prefill (prefix caching off, so reused history really comes
from decode) and decode, both with ``verify_kv: true``, pull and push routers that know the
control plane (conversation reuse). Short bounds so faults resolve quickly: connector
``timeout_s`` 6, lease TTL 3 s, pin TTL 6 s (a reuse READ must end within 3 s of its pin).

Test-only faults come from a JSON file the connector re-reads (``fault_file``, see
``connector/flows/faults.py``): corrupt the first landed block after the owner
fingerprinted it, or have the reader, at the moment its reuse READ would be posted (pin
held), kill the owner engine or its own engine — inside the pinned window by
construction, with no race against a delay window.

Checked:
- pull, push and reuse: every transfer is verified (one ``kv_verify`` ok per load), no
  mismatch, the owner fingerprinted what it exposed, output equals the prefill engine alone;
- corruption after the owner's fingerprint is detected for each mode: mismatch counted,
  load failed, request recomputed, output still equal;
- decode SIGKILLed while prefill is about to READ a conversation's history (pin held):
  the request ends within the READ bound and is recomputed correctly, prefill's KV usage
  returns to 0, the lease does not end before it promised, the restarted decode serves the
  next turn correctly;
- prefill SIGKILLed while it holds a pin: the lease stays live while the dead reader's
  pin lives (past the lease's own promise), the pin lapses within its TTL, then the lease
  expires (not before its promised time nor under the pin: the service's clock) and
  decode gives its blocks back to its baseline; the restarted prefill serves the next
  turn correctly.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbaton.stack.pd_stack import PdStack, post_json, usage_back_to_zero
from kvbaton.tinymodel import ensure_tiny_model
from tests.harness.pd_rig import BLOCK, PdRig, ids, retained_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TIMEOUT_S = 6.0
LEASE_TTL_S = 3.0
PIN_TTL_S = 6.0


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdRig]:
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    work = tmp_path_factory.mktemp("kvverify")
    fault_file = work / "faults.json"
    extra = {"verify_kv": True, "lease_ttl_s": LEASE_TTL_S, "pin_ttl_s": PIN_TTL_S,
             "kv_recompute_threshold": 64, "fault_file": str(fault_file)}
    with PdStack(model, work, router_modes=("pull", "push"), timeout_s=TIMEOUT_S, extra_config=extra,
                 prefill_args=["--no-enable-prefix-caching"], router_control_plane=True) as s:
        yield PdRig(s, fault_file)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pd_transfer_is_verified(rig: PdRig, mode: str) -> None:
    prompt = ids(10 if mode == "pull" else 11, 300)
    ref = rig.single(prompt)
    d0, p0 = rig.s.event_count("d0"), rig.s.event_count("p0")
    out = rig.via(mode, prompt)
    assert out["choices"][0]["token_ids"] == ref
    recv = rig.wait_events("d0", "recv_done", d0)
    assert len(recv) == 1 and recv[0]["nbytes"] > 0, recv
    tid = recv[0]["transfer_id"]
    ver = rig.wait_events("d0", "kv_verify", d0)
    assert [(v["transfer_id"], v["mode"], v["result"], v["num_blocks"]) for v in ver] == \
        [(tid, mode, "ok", recv[0]["num_blocks"])], ver
    owner = rig.wait_events("p0", "kv_fingerprint", p0, key=f"t:{tid}")
    assert len(owner) == 1 and owner[0]["num_blocks"] >= recv[0]["num_blocks"], owner
    if mode == "pull":  # asked and answered over NIXL
        ans = rig.wait_events("p0", "kv_fp_answer", p0, key=f"t:{tid}")
        assert [a["answer"] for a in ans] == ["ok"], ans
    assert not rig.s.events("d0", "recv_failed", since=d0)
    assert usage_back_to_zero(rig.s.p) == 0.0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_reuse_read_is_verified(rig: PdRig, mode: str) -> None:
    conv = f"verify-reuse-{mode}"
    prompt = ids(20 if mode == "pull" else 21, 300)
    got = rig.via(mode, prompt, conv)["choices"][0]["token_ids"]
    rig.wait_leased(conv, retained_tokens(len(prompt)))
    fp = rig.wait_events("d0", "kv_fingerprint", 0, key=f"r:{conv}")
    assert len(fp) == 1 and fp[0]["num_blocks"] == retained_tokens(len(prompt)) // BLOCK, fp
    prompt2 = prompt + got + ids(22, 100)
    p0 = rig.s.event_count("p0")
    out = rig.via(mode, prompt2, conv)["choices"][0]["token_ids"]
    assert out == rig.single(prompt2)
    reads = rig.wait_events("p0", "reuse_read", p0, conversation_id=conv)
    assert len(reads) == 1 and reads[0]["nbytes"] > 0, reads
    ver = rig.wait_events("p0", "kv_verify", p0, mode="reuse")
    assert [(v["conversation_id"], v["result"], v["num_blocks"]) for v in ver] == \
        [(conv, "ok", reads[0]["num_blocks"])], ver
    assert not rig.s.events("p0", "reuse_failed", since=p0)
    rig.revoke(conv)


def test_corruption_after_owner_fingerprint_is_detected(rig: PdRig) -> None:
    """Each mode once: the first landed block is garbled after the owner fingerprinted
    it; the reader must refuse it and recompute, never serve it."""
    results = {}
    try:
        for mode in ("pull", "push"):
            prompt = ids(30 if mode == "pull" else 31, 300)
            ref = rig.single(prompt)
            d0 = rig.s.event_count("d0")
            rig.faults(corrupt_landed={mode: 1})
            out = rig.via(mode, prompt)["choices"][0]["token_ids"]
            rig.no_faults()
            assert out == ref, f"{mode}: corrupted KV was served"
            ver = rig.wait_events("d0", "kv_verify", d0)
            assert [(v["mode"], v["result"], v["corrupted"], v["mismatched"]) for v in ver] == \
                [(mode, "mismatch", True, [0])], ver
            failed = rig.wait_events("d0", "recv_failed", d0)
            assert len(failed) == 1 and failed[0]["reason"].startswith("KvIntegrityError"), failed
            assert not rig.s.events("d0", "recv_done", since=d0)
            results[mode] = ver[0]
        conv = "verify-corrupt-reuse"
        prompt = ids(32, 300)
        got = rig.via("pull", prompt, conv)["choices"][0]["token_ids"]
        rig.wait_leased(conv, retained_tokens(len(prompt)))
        prompt2 = prompt + got + ids(33, 100)
        p0 = rig.s.event_count("p0")
        rig.faults(corrupt_landed={"reuse": 1})
        out = rig.via("pull", prompt2, conv)["choices"][0]["token_ids"]
        rig.no_faults()
        assert out == rig.single(prompt2), "reuse: corrupted KV was served"
        ver = rig.wait_events("p0", "kv_verify", p0, mode="reuse")
        assert [(v["result"], v["corrupted"]) for v in ver] == [("mismatch", True)], ver
        failed = rig.wait_events("p0", "reuse_failed", p0, conversation_id=conv)
        assert len(failed) == 1 and failed[0]["reason"].startswith("KvIntegrityError"), failed
        assert not rig.s.events("p0", "reuse_read", since=p0)
        rig.revoke(conv)
    finally:
        rig.no_faults()
    assert usage_back_to_zero(rig.s.p) == 0.0
    print(f"\nmismatches detected: {results}")


_LIVE = (1, 2)  # LEASE_STATE_ACTIVE, LEASE_STATE_DRAINING (past its deadline but pinned)


def _lease_states(rig: PdRig, conv: str, until: float, every_s: float = 0.1) -> list[tuple[float, Any]]:
    out = []
    while time.monotonic() < until:
        lease, _ = rig.lease(conv)
        out.append((time.monotonic(), lease))
        if lease is None or lease.state not in _LIVE:
            break
        time.sleep(every_s)
    return out


def _assert_never_early(history: list[tuple[float, Any]]) -> None:
    """A lease never ends before the expiry it last promised (service clock)."""
    from kvbaton.v1 import lease_pb2

    promised = 0
    for _, lease in history:
        if lease is None:
            continue
        if lease.state == lease_pb2.LEASE_STATE_ACTIVE:
            promised = max(promised, lease.expires_at_ms)
        elif lease.state in (lease_pb2.LEASE_STATE_EXPIRED, lease_pb2.LEASE_STATE_REVOKED):
            assert lease.ended_at_ms >= promised, (lease, promised)
            assert not lease.pins, lease


def test_decode_killed_during_reuse_read(rig: PdRig) -> None:
    """The owner dies under a reader's pin. The reader kills decode's process group itself
    (fault ``kill_group_at_reuse_read``) the moment its reuse READ would be posted, pin
    held, and posts the READ once decode is gone: the kill lands inside the pinned window
    by construction (a kill from here raced a 2 s delay window against this process's
    file polling and a lease RPC, as the sibling test below did)."""
    assert rig.s.d is not None and rig.s.p is not None and rig.s.d.pgid is not None
    conv = "verify-kill-decode"
    prompt = ids(40, 300)
    got = rig.via("pull", prompt, conv)["choices"][0]["token_ids"]
    lease, ret = rig.wait_leased(conv, retained_tokens(len(prompt)))
    prompt2 = prompt + got + ids(41, 100)
    ref = rig.single(prompt2)
    p0 = rig.s.event_count("p0")
    decode_group = rig.s.d.pgid
    rig.faults(kill_group_at_reuse_read=decode_group)
    body = rig.body(prompt2, kv_transfer_params={"reuse": rig.reuse_params(conv, lease, ret)})
    try:
        t0 = time.monotonic()
        status, raw = post_json(f"{rig.s.p.base_url}/v1/completions", body, PIN_TTL_S + 30)  # not hung
        waited = time.monotonic() - t0
    finally:
        rig.no_faults()
    (killed,) = rig.s.events("p0", "fault_kill_group", since=p0, conversation_id=conv)
    assert killed["pgid"] == decode_group and killed["pin_id"] and killed["pin_expires_at_ms"] > 0, killed
    assert rig.s.d.proc is not None and rig.s.d.proc.wait(timeout=30) is not None  # decode is gone
    assert status == 200, raw[:500]
    assert json.loads(raw)["choices"][0]["token_ids"] == ref  # recomputed, not garbage
    assert waited < PIN_TTL_S / 2 + 10, waited
    failed = rig.wait_events("p0", "reuse_failed", p0, conversation_id=conv)
    assert len(failed) == 1, failed
    assert not rig.s.events("p0", "reuse_read", since=p0)
    assert not [v for v in rig.s.events("p0", "kv_verify", since=p0) if v["result"] == "ok"]
    assert usage_back_to_zero(rig.s.p) == 0.0  # the surviving engine holds nothing
    # Prefill unpinned on failure; the lease (no owner alive to renew it) runs out on the
    # service's clock, never before what it promised.
    history = _lease_states(rig, conv, time.monotonic() + LEASE_TTL_S + 5)
    assert history and (history[-1][1] is None or history[-1][1].state not in _LIVE), history[-1]
    _assert_never_early(history)
    print(f"\nprefill request ended {waited:.1f}s after it was sent: {failed[0]['reason']}")
    rig.restart("d")
    prompt3 = prompt2 + ref + ids(42, 60)
    out = rig.via("pull", prompt3, conv)["choices"][0]["token_ids"]
    assert out == rig.single(prompt3)
    rig.revoke(conv)


def test_prefill_killed_holding_a_pin(rig: PdRig) -> None:
    """The reader dies holding its pin. It kills itself (fault ``kill_at_reuse_read``) the
    moment its reuse READ would be posted, so the kill lands inside the pinned window by
    construction (a kill from here raced a 2.5 s window against this process's polling
    and a lease RPC, and lost under load), and every timing below is read off the
    service's clock: the pin's expiry (as the Pin answered it) and the lease's end."""
    assert rig.s.d is not None and rig.s.p is not None
    baseline = rig.d_usage()
    conv = "verify-kill-prefill"
    prompt = ids(50, 300)
    got = rig.via("push", prompt, conv)["choices"][0]["token_ids"]
    lease, ret = rig.wait_leased(conv, retained_tokens(len(prompt)))
    held = rig.d_usage()
    assert held > baseline
    prompt2 = prompt + got + ids(51, 100)
    p0 = rig.s.event_count("p0")
    rig.faults(kill_at_reuse_read=True)
    # The lease's own promise starts now (LEASE_TTL_S): the pin (PIN_TTL_S, longer) is
    # granted within it, and outlives it.
    promised = rig.renew(conv).expires_at_ms
    body = rig.body(prompt2, kv_transfer_params={"reuse": rig.reuse_params(conv, lease, ret)})
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(post_json, f"{rig.s.p.base_url}/v1/completions", body, 60)
            with pytest.raises(Exception):  # noqa: B017 - connection reset/refused, not a hang
                fut.result(timeout=60)
    finally:
        rig.no_faults()  # before the restart below
    (killed,) = rig.s.events("p0", "fault_kill", since=p0, conversation_id=conv)
    pin_id, pin_expires_ms, t_kill_ms = killed["pin_id"], killed["pin_expires_at_ms"], killed["t"] * 1000
    assert pin_id and pin_expires_ms > 0, killed
    assert rig.s.p.proc is not None and rig.s.p.proc.wait(timeout=30) is not None  # the engine is gone
    # The dead reader's pin keeps the lease alive (no read of freed blocks could follow
    # even if it came back) until the pin lapses, within its TTL; then the lease, not
    # renewed, expires on time and decode frees the blocks.
    history = _lease_states(rig, conv, time.monotonic() + PIN_TTL_S + LEASE_TTL_S + 15)
    assert all(ls.state in _LIVE for _, ls in history if ls is not None and ls.pins), history
    assert all([p.pin_id for p in ls.pins] == [pin_id] for _, ls in history if ls is not None and ls.pins), history
    last = history[-1][1]
    assert last is not None and last.state not in _LIVE, history[-1]
    _assert_never_early(history)
    # Service clock: the pin was not extended after its reader died, the lease did not end
    # under it, and ended promptly once it lapsed.
    assert promised < pin_expires_ms <= t_kill_ms + PIN_TTL_S * 1000, (promised, pin_expires_ms, t_kill_ms)
    assert pin_expires_ms <= last.ended_at_ms <= pin_expires_ms + 1000, (last, pin_expires_ms)
    deadline = time.monotonic() + 15
    while (u := rig.d_usage()) > baseline and time.monotonic() < deadline:
        time.sleep(0.5)
    assert u <= baseline, (u, baseline)
    freed = rig.events("d0", "retention_freed", part="retention", conversation_id=conv)
    assert len(freed) == 1 and ("EXPIRED" in freed[0]["why"] or "REVOKED" in freed[0]["why"]), freed
    print(f"\nthe lease ended {last.ended_at_ms - t_kill_ms:.0f} ms after the reader died holding a pin "
          f"(pin TTL {PIN_TTL_S}s, lapsed {pin_expires_ms - t_kill_ms:.0f} ms after); decode back to {u:.4f}")
    rig.restart("p")
    prompt3 = prompt2 + ids(52, 60)
    out = rig.via("push", prompt3, conv)["choices"][0]["token_ids"]
    assert out == rig.single(prompt3)
    assert usage_back_to_zero(rig.s.p) == 0.0
    rig.revoke(conv)
