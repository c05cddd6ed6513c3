"""End to end: bidirectional reuse across turns of a conversation, push and pull, real engines.

One control plane, a prefill engine (prefix caching **off**, so every reused token really
comes from decode) and a decode engine whose leases last ``TTL_S`` seconds, plus a pull
and a push router. Prompts are token ids (``return_token_ids`` gives the output ids), so
turn N+1's prompt is exactly turn N's prompt + output + new tokens and the hash chains
line up block by block.

What is checked: turns 2+ READ their history from decode (prefill's ``reuse_read`` stats
with bytes, decode's ``reuse_served`` notifications) and greedy output equals the
prefill engine alone; an idle conversation's lease expires and decode frees its blocks,
its next turn recomputes correctly; ``LeaseKeeper`` keeps a conversation reusable past
several TTLs; a read of an ended lease is refused (pin) and recomputed; revoking every
conversation brings decode's KV usage back to 0.

Decode frees an ended lease's blocks at its next scheduler step (an idle vLLM engine does
not step; see connector/reuse.py), so usage checks first send decode a 1-token request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbaton.stack.pd_stack import PdStack
from kvbaton.stack.vllm_server import VllmServer
from kvbaton.tinymodel import ensure_tiny_model
from tests.harness.pd_rig import BLOCK, PdRig, ids, retained_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

TTL_S = 2.0
BLOCK_BYTES = 131072 * 2  # one block of both layers of the tiny float32 model
#: The connectors' settings of this rig (the secured rig, test_secure_vllm, adds credentials).
EXTRA = {"lease_ttl_s": TTL_S, "kv_recompute_threshold": 64,
         "verify_kv": True}  # every load below is checked against its owner's fingerprints


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdRig]:
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    with PdStack(model, tmp_path_factory.mktemp("reuse"), router_modes=("pull", "push"), timeout_s=20,
                 extra_config=EXTRA, prefill_args=["--no-enable-prefix-caching"], router_control_plane=True) as s:
        yield PdRig(s)


def _tree_cpu_s(srv: VllmServer) -> float:
    """CPU seconds (user+system) of a server process and all its children."""
    import psutil

    assert srv.proc is not None
    root = psutil.Process(srv.proc.pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_three_turns_read_history_from_decode(rig: PdRig, mode: str) -> None:
    conv = f"conv-3turns-{mode}"
    prompt = ids(1 if mode == "pull" else 2, 300)
    last_retained = 0
    for turn in range(3):
        ref = rig.single(prompt)
        out = rig.via(mode, prompt, conv, header=(turn == 1))
        got = out["choices"][0]["token_ids"]
        assert got == ref, f"turn {turn + 1} ({mode}) differs from the single engine"
        retained = (out.get("kv_transfer_params") or {}).get("retained")
        assert retained and retained["engine_id"] == "d0", out.get("kv_transfer_params")
        assert retained["num_tokens"] == retained_tokens(len(prompt))
        rig.wait_leased(conv, retained["num_tokens"])
        reads = rig.events("p0", "reuse_read", conversation_id=conv)
        assert len(reads) == turn, reads
        if turn:
            assert reads[-1]["num_blocks"] == last_retained // BLOCK
            assert reads[-1]["nbytes"] == reads[-1]["num_blocks"] * BLOCK_BYTES > 0
            assert reads[-1]["num_descs"] <= reads[-1]["num_blocks"] * 2
        last_retained = retained["num_tokens"]
        prompt = prompt + got + ids(100 + turn, 100)
    served = rig.events("d0", "reuse_served", conversation_id=conv)
    assert len(served) == 2 and all(e["served_nbytes"] > 0 for e in served)
    assert not rig.events("p0", "reuse_failed", conversation_id=conv)
    print(f"\n{mode}: reuse reads {[(e['num_blocks'], e['nbytes'], e['duration_s']) for e in reads]}")
    rig.revoke(conv)


def test_the_ledger_lists_the_reuse_reads_with_bytes(rig: PdRig) -> None:
    """One ledger: each of the three-turn test's reuse READs (both modes) is a REUSE
    transfer that prefill began on the ledger (fenced by the retention_id) and reported."""
    from kvbaton.v1 import rendezvous_pb2 as rpb

    async def go() -> list[Any]:
        async with rig.s.client() as kv:
            return list(await kv.list_transfers(phases=[v for v in rpb.TransferPhase.values() if v]))
    reads = {e["conversation_id"] for e in rig.events("p0", "reuse_read")}
    reuse = [t for t in asyncio.run(go()) if t.kind == rpb.TRANSFER_KIND_REUSE]
    assert len(reuse) >= 4, reuse  # two reads per conversation, pull and push
    for t in reuse:
        assert t.phase == rpb.TRANSFER_PHASE_SUCCEEDED and t.completion.engine_id == "p0", t
        assert t.offer.engine_id == "d0" and t.generation and t.conversation_id.startswith("conv-3turns-"), t
        (o,) = t.outcomes
        assert o.success and o.engine_id == "p0" and o.bytes > 0, t
        assert t.transfer_id.startswith("reuse-") and t.conversation_id in reads, (t.transfer_id, reads)


def test_idle_conversation_expires_and_recomputes(rig: PdRig) -> None:
    conv = "conv-idle"
    prompt = ids(7, 300)
    out = rig.via("pull", prompt, conv)
    got = out["choices"][0]["token_ids"]
    rig.wait_leased(conv, retained_tokens(len(prompt)))
    held = rig.d_usage()
    assert held > 0.0
    time.sleep(TTL_S + 1.5)  # nobody renews: the service expires the lease
    lease, _ = rig.lease(conv)
    from kvbaton.v1 import lease_pb2

    assert lease is None or lease.state == lease_pb2.LEASE_STATE_EXPIRED, lease
    assert rig.d_usage() < held  # decode gave the blocks back
    freed = rig.events("d0", "retention_freed", part="retention", conversation_id=conv)
    assert len(freed) == 1 and "EXPIRED" in freed[0]["why"], freed
    prompt2 = prompt + got + ids(8, 100)
    ref = rig.single(prompt2)
    out2 = rig.via("pull", prompt2, conv)
    assert out2["choices"][0]["token_ids"] == ref
    assert not rig.events("p0", "reuse_read", conversation_id=conv)  # recomputed, not read
    rig.revoke(conv)


def test_lease_keeper_keeps_history_reusable(rig: PdRig) -> None:
    from kvbaton.client import LeaseKeeper

    conv = "conv-kept"
    prompt = ids(11, 300)
    got = rig.via("push", prompt, conv)["choices"][0]["token_ids"]
    rig.wait_leased(conv, retained_tokens(len(prompt)))

    async def think() -> int:
        async with rig.s.client() as kv, LeaseKeeper(kv, conv) as keeper:
            await asyncio.sleep(3.5 * TTL_S)  # an agent calling tools for several TTLs
            return keeper.renewals
    cpu0 = _tree_cpu_s(rig.d)
    t0 = time.monotonic()
    renewals = asyncio.run(think())
    cpu_share = (_tree_cpu_s(rig.d) - cpu0) / (time.monotonic() - t0)
    assert renewals >= 4
    # Retained blocks are plain block references: decode stays idle (a held *request*
    # would make EngineCore + worker spin about a core, API notes §0.4).
    print(f"\ndecode CPU while retaining and idle: {cpu_share:.3f} cores")
    assert cpu_share < 0.3
    prompt2 = prompt + got + ids(12, 100)
    ref = rig.single(prompt2)
    out = rig.via("push", prompt2, conv)
    assert out["choices"][0]["token_ids"] == ref
    reads = rig.events("p0", "reuse_read", conversation_id=conv)
    assert len(reads) == 1 and reads[0]["nbytes"] > 0
    rig.revoke(conv)


def test_read_of_ended_lease_is_refused_and_recomputed(rig: PdRig) -> None:
    """Prefill handed a lookup that went stale (the lease ended in between): the pin is
    refused, nothing is read, and the output is still right."""
    conv = "conv-stale"
    prompt = ids(21, 300)
    got = rig.via("pull", prompt, conv)["choices"][0]["token_ids"]
    reuse = rig.reuse_params(conv, *rig.wait_leased(conv, retained_tokens(len(prompt))))
    rig.revoke(conv)  # the expiry wins the race
    prompt2 = prompt + got + ids(22, 100)
    ref = rig.single(prompt2)
    out = rig.p.post_json("/v1/completions", {**rig.body(prompt2), "kv_transfer_params": {"reuse": reuse}})
    assert out["choices"][0]["token_ids"] == ref
    failed = rig.events("p0", "reuse_failed", conversation_id=conv)
    assert len(failed) == 1 and "pin refused" in failed[0]["reason"], failed
    assert not rig.events("p0", "reuse_read", conversation_id=conv)


def test_concurrent_conversations(rig: PdRig) -> None:
    """Four conversations at once (two per mode), two turns each: every second turn reads
    its own history (not another conversation's) and matches the single engine."""
    convs = [(f"conv-conc-{i}", "pull" if i % 2 else "push", ids(40 + i, 260 + 30 * i)) for i in range(4)]

    def one(conv: str, mode: str, prompt: list[int]) -> tuple[bool, bool]:
        got = rig.via(mode, prompt, conv)["choices"][0]["token_ids"]
        rig.wait_leased(conv, retained_tokens(len(prompt)))
        prompt2 = prompt + got + ids(hash(conv) % 1000, 90)
        out = rig.via(mode, prompt2, conv)["choices"][0]["token_ids"]
        return got == refs[conv][0], out == rig.single(prompt2)

    refs = {c: (rig.single(p),) for c, _, p in convs}
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda a: one(*a), convs))
    assert results == [(True, True)] * 4
    for conv, _, prompt in convs:
        reads = rig.events("p0", "reuse_read", conversation_id=conv)
        assert len(reads) == 1 and reads[0]["num_blocks"] == retained_tokens(len(prompt)) // BLOCK


def test_all_conversations_ended_frees_decode(rig: PdRig) -> None:
    for conv in ("conv-3turns-pull", "conv-3turns-push", "conv-idle", "conv-kept", "conv-stale",
                 *(f"conv-conc-{i}" for i in range(4))):
        rig.revoke(conv)
    deadline = time.monotonic() + 10
    while (u := rig.d_usage()) != 0.0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert u == 0.0
    retained = rig.events("d0", "retained", part="retention")
    freed = rig.events("d0", "retention_freed", part="retention")
    assert len(retained) >= 16 and sorted(e["lease_id"] for e in freed) == sorted(e["lease_id"] for e in retained)
    assert (rig.p.metric("vllm:kv_cache_usage_perc") or 0.0) == 0.0
    # verify_kv: every reuse READ (prefill) and every pull/push load (decode) was checked
    # against the owner's fingerprints, and none differed.
    reads = rig.events("p0", "reuse_read")
    verified = rig.events("p0", "kv_verify", mode="reuse")
    assert reads and sorted(e["req_id"] for e in reads) == sorted(v["req_id"] for v in verified if v["ok"])
    recv = rig.events("d0", "recv_done")
    d_verified = rig.events("d0", "kv_verify")
    assert recv and sorted(e["transfer_id"] for e in recv) == sorted(v["transfer_id"] for v in d_verified if v["ok"])
    assert not [v for v in verified + d_verified if not v["ok"]]
    print(f"\nverify_kv: {len(verified)} reuse READs and {len(d_verified)} P->D loads verified, 0 mismatches")
