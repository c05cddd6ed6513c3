"""KV integrity verification (``verify_kv``) and kills during a reuse READ, real vLLM + NIXL.

One stack: control plane, prefill (prefix caching off, so reused history really comes
from decode) and decode, both with ``verify_kv: true``, pull and push routers that know the
control plane (conversation reuse). Short bounds so faults resolve quickly: connector
``timeout_s`` 6, lease TTL 3 s, pin TTL 6 s (a reuse READ must end within 3 s of its pin).

Test-only faults come from a JSON file the connector re-reads (``fault_file``, see
``worker.Faults``): corrupt the first landed block after the owner fingerprinted it, or
hold a reuse READ back (pin held) to widen the window a kill can hit.

Checked:
- pull, push and reuse: every transfer is verified (one ``kv_verify`` ok per load), no
  mismatch, the owner fingerprinted what it exposed, output equals the prefill engine alone;
- corruption after the owner's fingerprint is detected for each mode: mismatch counted,
  load failed, request recomputed, output still equal;
- decode SIGKILLed while prefill is about to READ a conversation's history (pin held):
  the request ends within the READ bound and is recomputed correctly, prefill's KV usage
  returns to 0, the lease does not end before it promised, the restarted decode serves the
  next turn correctly;
- prefill SIGKILLed while it holds a pin: the lease stays ACTIVE while the dead reader's
  pin lives, the pin lapses within its TTL, then the lease expires (not before its promised
  time) and decode gives its blocks back to its baseline; the restarted prefill serves the
  next turn correctly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbaton.stack.pd_stack import PdStack, post_json, revoke_lease, usage_back_to_zero
from kvbaton.tinymodel import ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TIMEOUT_S = 6.0
LEASE_TTL_S = 3.0
PIN_TTL_S = 6.0
BLOCK = 128


class Rig:
    def __init__(self, stack: PdStack, fault_file: Path) -> None:
        self.s = stack
        self.fault_file = fault_file

    # ---------------------------------------------------------------- faults
    def faults(self, **conf: Any) -> None:
        tmp = self.fault_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(conf))
        os.replace(tmp, self.fault_file)  # atomic: a reader never sees half a file

    def no_faults(self) -> None:
        self.fault_file.unlink(missing_ok=True)

    # ---------------------------------------------------------------- requests
    @staticmethod
    def body(prompt: list[int], max_tokens: int = 40, **extra: Any) -> dict[str, Any]:
        return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, **extra}

    def single(self, prompt: list[int]) -> list[int]:
        status, raw = post_json(f"{self.s.p.base_url}/v1/completions", self.body(prompt), 120)
        assert status == 200, raw[:500]
        return json.loads(raw)["choices"][0]["token_ids"]

    def via(self, mode: str, prompt: list[int], conv: str = "") -> dict[str, Any]:
        body = self.body(prompt, **({"conversation_id": conv} if conv else {}))
        status, raw = post_json(f"{self.s.routers[mode]}/v1/completions", body, 120)
        assert status == 200, raw[:500]
        return json.loads(raw)

    def wait_events(self, engine: str, event: str, since: int, n: int = 1, timeout_s: float = 10.0,
                    **match: Any) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            evs = [e for e in self.s.events(engine, event, since=since)
                   if all(e.get(k) == v for k, v in match.items())]
            if len(evs) >= n or time.monotonic() > deadline:
                return evs
            time.sleep(0.05)

    # ---------------------------------------------------------------- control plane
    def lease(self, conv: str) -> tuple[Any, Any]:
        from kvbaton.client import KvbatonClient
        from kvbaton.v1 import lease_pb2, registrar_pb2

        async def go() -> tuple[Any, Any]:
            async with KvbatonClient(self.s.cp_address) as kv:
                res: list[Any] = []
                for coro in (kv.lease.Get(lease_pb2.GetLeaseRequest(conversation_id=conv), timeout=5),
                             kv.registrar.LookupRetained(registrar_pb2.LookupRetainedRequest(conversation_id=conv),
                                                         timeout=5)):
                    try:
                        res.append(await coro)
                    except Exception:  # noqa: BLE001 - NOT_FOUND
                        res.append(None)
                return (res[0],
                        res[1].retained if res[1] is not None else None)
        return asyncio.run(go())

    def wait_leased(self, conv: str, num_tokens: int, timeout_s: float = 10.0) -> tuple[Any, Any]:
        from kvbaton.v1 import lease_pb2

        deadline = time.monotonic() + timeout_s
        while True:
            lease, ret = self.lease(conv)
            if (lease is not None and ret is not None and lease.state == lease_pb2.LEASE_STATE_ACTIVE
                    and ret.num_tokens == num_tokens and lease.retention_id == ret.retention_id):
                return lease, ret
            assert time.monotonic() < deadline, (conv, lease, ret)
            time.sleep(0.05)

    def reuse_params(self, conv: str, lease: Any, ret: Any) -> dict[str, Any]:
        """What the router hands prefill (kv_transfer_params.reuse), built by hand so a test
        can send the READ-ing request straight to prefill while decode is being killed."""
        return {"conversation_id": conv, "engine_id": ret.engine_id, "lease_id": lease.lease_id,
                "retention_id": ret.retention_id, "block_ids": list(ret.block_ids), "num_tokens": ret.num_tokens,
                "tokens_per_block": ret.tokens_per_block, "block_hashes": [h.hex() for h in ret.block_hashes]}

    def revoke(self, conv: str) -> None:
        revoke_lease(self.s.cp_address, conv)

    def d_usage(self) -> float:
        """Decode's KV usage after a 1-token request (an idle engine frees ended leases at
        its next step, connector/reuse.py)."""
        status, raw = post_json(f"{self.s.d.base_url}/v1/completions",
                                {"model": "tiny", "prompt": [5], "max_tokens": 1}, 30)
        assert status == 200, raw[:300]
        time.sleep(0.3)
        return self.s.d.metric("vllm:kv_cache_usage_perc") or 0.0

    def restart(self, which: str) -> None:
        srv = self.s.p if which == "p" else self.s.d
        srv.stop()  # its group is dead already: reaps and verifies nothing is left
        srv.start()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    work = tmp_path_factory.mktemp("kvverify")
    fault_file = work / "faults.json"
    extra = {"verify_kv": True, "lease_ttl_s": LEASE_TTL_S, "pin_ttl_s": PIN_TTL_S,
             "kv_recompute_threshold": 64, "fault_file": str(fault_file)}
    with PdStack(model, work, router_modes=("pull", "push"), timeout_s=TIMEOUT_S, extra_config=extra,
                 prefill_args=["--no-enable-prefix-caching"], router_control_plane=True) as s:
        yield Rig(s, fault_file)


def _ids(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(10, 4000) for _ in range(n)]


def _retained_tokens(prompt_len: int, max_tokens: int = 40) -> int:
    return (prompt_len + max_tokens - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pd_transfer_is_verified(rig: Rig, mode: str) -> None:
    prompt = _ids(10 if mode == "pull" else 11, 300)
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
def test_reuse_read_is_verified(rig: Rig, mode: str) -> None:
    conv = f"verify-reuse-{mode}"
    prompt = _ids(20 if mode == "pull" else 21, 300)
    got = rig.via(mode, prompt, conv)["choices"][0]["token_ids"]
    rig.wait_leased(conv, _retained_tokens(len(prompt)))
    fp = rig.wait_events("d0", "kv_fingerprint", 0, key=f"r:{conv}")
    assert len(fp) == 1 and fp[0]["num_blocks"] == _retained_tokens(len(prompt)) // BLOCK, fp
    prompt2 = prompt + got + _ids(22, 100)
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


def test_corruption_after_owner_fingerprint_is_detected(rig: Rig) -> None:
    """Each mode once: the first landed block is garbled after the owner fingerprinted
    it; the reader must refuse it and recompute, never serve it."""
    results = {}
    try:
        for mode in ("pull", "push"):
            prompt = _ids(30 if mode == "pull" else 31, 300)
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
        prompt = _ids(32, 300)
        got = rig.via("pull", prompt, conv)["choices"][0]["token_ids"]
        rig.wait_leased(conv, _retained_tokens(len(prompt)))
        prompt2 = prompt + got + _ids(33, 100)
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


def _lease_states(rig: Rig, conv: str, until: float, every_s: float = 0.1) -> list[tuple[float, Any]]:
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


def test_decode_killed_during_reuse_read(rig: Rig) -> None:
    assert rig.s.d is not None and rig.s.p is not None
    conv = "verify-kill-decode"
    prompt = _ids(40, 300)
    got = rig.via("pull", prompt, conv)["choices"][0]["token_ids"]
    lease, ret = rig.wait_leased(conv, _retained_tokens(len(prompt)))
    prompt2 = prompt + got + _ids(41, 100)
    ref = rig.single(prompt2)
    p0 = rig.s.event_count("p0")
    rig.faults(delay_reuse_read_s=2.0)
    body = rig.body(prompt2, kv_transfer_params={"reuse": rig.reuse_params(conv, lease, ret)})
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            t0 = time.monotonic()
            fut = ex.submit(post_json, f"{rig.s.p.base_url}/v1/completions", body, 60)
            delayed = rig.wait_events("p0", "fault_delay", p0, conversation_id=conv)
            assert len(delayed) == 1 and delayed[0]["pin_id"], delayed  # pinned, READ not posted yet
            pinned, _ = rig.lease(conv)
            assert pinned is not None and len(pinned.pins) == 1, pinned
            os.killpg(rig.s.d.pgid, 9)  # decode dies while prefill holds a pin on its blocks
            status, raw = fut.result(timeout=PIN_TTL_S + 30)  # not hung
            waited = time.monotonic() - t0
    finally:
        rig.no_faults()
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
    prompt3 = prompt2 + ref + _ids(42, 60)
    out = rig.via("pull", prompt3, conv)["choices"][0]["token_ids"]
    assert out == rig.single(prompt3)
    rig.revoke(conv)


def test_prefill_killed_holding_a_pin(rig: Rig) -> None:
    assert rig.s.d is not None and rig.s.p is not None
    baseline = rig.d_usage()
    conv = "verify-kill-prefill"
    prompt = _ids(50, 300)
    got = rig.via("push", prompt, conv)["choices"][0]["token_ids"]
    lease, ret = rig.wait_leased(conv, _retained_tokens(len(prompt)))
    held = rig.d_usage()
    assert held > baseline
    prompt2 = prompt + got + _ids(51, 100)
    p0 = rig.s.event_count("p0")
    rig.faults(delay_reuse_read_s=2.5)
    body = rig.body(prompt2, kv_transfer_params={"reuse": rig.reuse_params(conv, lease, ret)})
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(post_json, f"{rig.s.p.base_url}/v1/completions", body, 60)
            delayed = rig.wait_events("p0", "fault_delay", p0, conversation_id=conv)
            assert len(delayed) == 1 and delayed[0]["pin_id"], delayed
            pinned, _ = rig.lease(conv)
            assert pinned is not None and [p.pin_id for p in pinned.pins] == [delayed[0]["pin_id"]], pinned
            t_kill = time.monotonic()
            os.killpg(rig.s.p.pgid, 9)  # the reader dies holding its pin
            with pytest.raises(Exception):  # noqa: B017 - connection reset/refused, not a hang
                fut.result(timeout=30)
    finally:
        rig.no_faults()
    # The dead reader's pin keeps the lease alive (no read of freed blocks could follow
    # even if it came back) until the pin lapses, within its TTL; then the lease, not
    # renewed, expires on time and decode frees the blocks.
    history = _lease_states(rig, conv, t_kill + PIN_TTL_S + LEASE_TTL_S + 6)
    pinned_until = max((t for t, ls in history if ls is not None and ls.pins), default=t_kill)
    assert all(ls.state in _LIVE for _, ls in history if ls is not None and ls.pins), history
    assert pinned_until - t_kill <= PIN_TTL_S + 0.5, pinned_until - t_kill
    assert history[-1][1] is None or history[-1][1].state not in _LIVE, history[-1]
    _assert_never_early(history)
    deadline = time.monotonic() + 15
    while (u := rig.d_usage()) > baseline and time.monotonic() < deadline:
        time.sleep(0.5)
    assert u <= baseline, (u, baseline)
    freed = [e for e in map(json.loads, (rig.s.stats_dir / "d0.retention.jsonl").read_text().splitlines())
             if e["event"] == "retention_freed" and e.get("conversation_id") == conv]
    assert len(freed) == 1 and ("EXPIRED" in freed[0]["why"] or "REVOKED" in freed[0]["why"]), freed
    print(f"\npin held {pinned_until - t_kill:.1f}s after the reader died (pin TTL {PIN_TTL_S}s); "
          f"decode back to {u:.4f}")
    rig.restart("p")
    prompt3 = prompt2 + _ids(52, 60)
    out = rig.via("push", prompt3, conv)["choices"][0]["token_ids"]
    assert out == rig.single(prompt3)
    assert usage_back_to_zero(rig.s.p) == 0.0
    rig.revoke(conv)
