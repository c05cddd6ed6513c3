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
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbaton.stack.pd_stack import revoke_lease
from kvbaton.stack.vllm_server import VllmServer, free_port, small_engine_args
from kvbaton.tinymodel import ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TTL_S = 2.0
BLOCK = 128
BLOCK_BYTES = 131072 * 2  # one block of both layers of the tiny float32 model


def _kv_config(cp: str, engine_id: str, stats_dir: Path) -> str:
    return json.dumps({
        "kv_connector": "KvbatonConnector",
        "kv_connector_module_path": "kvbaton.connector.kvbaton_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "control_plane": cp, "mode": "pull", "engine_id": engine_id, "timeout_s": 20,
            "stats_dir": str(stats_dir), "ucx_net_devices": "lo", "ucx_tls": "tcp,self,sm",
            "lease_ttl_s": TTL_S, "kv_recompute_threshold": 64,
            "verify_kv": True,  # every load below is checked against its owner's fingerprints
        },
    })


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited rc={proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"port {port} not listening after {timeout_s}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
          timeout_s: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"POST {url} -> {e.code}: {e.read()[:1000]!r}") from None


class Rig:
    def __init__(self, cp: str, p: VllmServer, d: VllmServer, routers: dict[str, str], stats: Path) -> None:
        self.cp, self.p, self.d, self.routers, self.stats_dir = cp, p, d, routers, stats

    def events(self, engine: str, event: str, part: str = "worker", **match: Any) -> list[dict[str, Any]]:
        path = self.stats_dir / f"{engine}.{part}.jsonl"
        if not path.exists():
            return []
        out = [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == event]
        return [e for e in out if all(e.get(k) == v for k, v in match.items())]

    def body(self, prompt: list[int], max_tokens: int = 40) -> dict[str, Any]:
        return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}

    def single(self, prompt: list[int], max_tokens: int = 40) -> list[int]:
        """Greedy output ids of the prefill engine alone (no connector params)."""
        return self.p.post_json("/v1/completions", self.body(prompt, max_tokens))["choices"][0]["token_ids"]

    def turn(self, mode: str, conv: str, prompt: list[int], *, header: bool = False) -> dict[str, Any]:
        body = self.body(prompt)
        if header:
            return _post(f"{self.routers[mode]}/v1/completions", body, {"X-Conversation-Id": conv})
        return _post(f"{self.routers[mode]}/v1/completions", {**body, "conversation_id": conv})

    def client(self) -> Any:
        """A control-plane client for the checks (a secured rig adds credentials)."""
        from kvbaton.client import KvbatonClient

        return KvbatonClient(self.cp)

    def lease(self, conv: str) -> tuple[Any, Any]:
        """(lease info or None, retained registration or None) of a conversation."""
        from kvbaton.v1 import lease_pb2, registrar_pb2

        async def go() -> tuple[Any, Any]:
            async with self.client() as kv:
                res: list[Any] = []
                for coro in (kv.lease.Get(lease_pb2.GetLeaseRequest(conversation_id=conv), timeout=5),
                             kv.registrar.LookupRetained(registrar_pb2.LookupRetainedRequest(conversation_id=conv),
                                                         timeout=5)):
                    try:
                        res.append(await coro)
                    except Exception:  # noqa: BLE001 - NOT_FOUND
                        res.append(None)
                return res[0], (res[1].retained if res[1] is not None else None)
        return asyncio.run(go())

    def wait_leased(self, conv: str, num_tokens: int, timeout_s: float = 10.0) -> Any:
        """Until decode's registration of ``num_tokens`` is protected by an ACTIVE lease."""
        from kvbaton.v1 import lease_pb2

        deadline = time.monotonic() + timeout_s
        while True:
            lease, ret = self.lease(conv)
            if (lease is not None and ret is not None and lease.state == lease_pb2.LEASE_STATE_ACTIVE
                    and ret.num_tokens == num_tokens and lease.retention_id == ret.retention_id):
                return lease
            assert time.monotonic() < deadline, (conv, lease, ret)
            time.sleep(0.05)

    def revoke(self, conv: str) -> None:
        revoke_lease(self.cp, conv)

    def d_usage(self) -> float:
        """Decode's KV usage after one tiny request (which makes the idle engine step)."""
        self.d.post_json("/v1/completions", {"model": "tiny", "prompt": [5], "max_tokens": 1})
        time.sleep(0.3)
        return self.d.metric("vllm:kv_cache_usage_perc") or 0.0


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    work = tmp_path_factory.mktemp("reuse")
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    stats = work / "stats"
    cp_port = free_port()
    cp = subprocess.Popen([str(Path(PY).parent / "kvbaton"), "serve", "--insecure", "--listen", f"127.0.0.1:{cp_port}"],
                          stdout=open(work / "cp.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    procs: list[subprocess.Popen[bytes]] = [cp]
    servers: list[VllmServer] = []
    try:
        _wait_port(cp_port, cp)
        cpa = f"127.0.0.1:{cp_port}"
        p = VllmServer(model, extra_args=[*small_engine_args(), "--no-enable-prefix-caching",
                                          "--kv-transfer-config", _kv_config(cpa, "p0", stats)],
                       env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, log_path=work / "p.log", served_model_name="tiny")
        d = VllmServer(model, extra_args=[*small_engine_args(), "--kv-transfer-config", _kv_config(cpa, "d0", stats)],
                       env={"VLLM_CPU_OMP_THREADS_BIND": "1"}, log_path=work / "d.log", served_model_name="tiny")
        servers += [p, d]
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            for f in [ex.submit(s.start) for s in servers]:
                f.result()
        routers = {}
        for mode in ("pull", "push"):
            rport = free_port()
            router = subprocess.Popen([PY, "-m", "kvbaton.services.router", "--prefill", p.base_url,
                                       "--decode", d.base_url, "--mode", mode, "--port", str(rport)],
                                      stdout=open(work / f"router-{mode}.log", "wb"), stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=ROOT,
                                      env={**os.environ, "KVBATON_CONTROL_PLANE": cpa})
            procs.append(router)
            _wait_port(rport, router)
            routers[mode] = f"http://127.0.0.1:{rport}"
        yield Rig(cpa, p, d, routers, stats)
    finally:
        for s in reversed(servers):
            with contextlib.suppress(Exception):
                s.stop()
        for proc in reversed(procs):
            _stop(proc)


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


def _ids(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(10, 4000) for _ in range(n)]


def _retained_tokens(prompt_len: int, max_tokens: int = 40) -> int:
    """Full blocks of prompt+output whose KV decode computed (the last token's is not)."""
    return (prompt_len + max_tokens - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_three_turns_read_history_from_decode(rig: Rig, mode: str) -> None:
    conv = f"conv-3turns-{mode}"
    prompt = _ids(1 if mode == "pull" else 2, 300)
    last_retained = 0
    for turn in range(3):
        ref = rig.single(prompt)
        out = rig.turn(mode, conv, prompt, header=(turn == 1))
        got = out["choices"][0]["token_ids"]
        assert got == ref, f"turn {turn + 1} ({mode}) differs from the single engine"
        retained = (out.get("kv_transfer_params") or {}).get("retained")
        assert retained and retained["engine_id"] == "d0", out.get("kv_transfer_params")
        assert retained["num_tokens"] == _retained_tokens(len(prompt))
        rig.wait_leased(conv, retained["num_tokens"])
        reads = rig.events("p0", "reuse_read", conversation_id=conv)
        assert len(reads) == turn, reads
        if turn:
            assert reads[-1]["num_blocks"] == last_retained // BLOCK
            assert reads[-1]["nbytes"] == reads[-1]["num_blocks"] * BLOCK_BYTES > 0
            assert reads[-1]["num_descs"] <= reads[-1]["num_blocks"] * 2
        last_retained = retained["num_tokens"]
        prompt = prompt + got + _ids(100 + turn, 100)
    served = rig.events("d0", "reuse_served", conversation_id=conv)
    assert len(served) == 2 and all(e["served_nbytes"] > 0 for e in served)
    assert not rig.events("p0", "reuse_failed", conversation_id=conv)
    print(f"\n{mode}: reuse reads {[(e['num_blocks'], e['nbytes'], e['duration_s']) for e in reads]}")
    rig.revoke(conv)


def test_the_ledger_lists_the_reuse_reads_with_bytes(rig: Rig) -> None:
    """One ledger: each of the three-turn test's reuse READs (both modes) is a REUSE
    transfer that prefill began on the ledger (fenced by the retention_id) and reported."""
    from kvbaton.client import KvbatonClient
    from kvbaton.v1 import rendezvous_pb2 as rpb

    async def go() -> list[Any]:
        async with KvbatonClient(rig.cp) as kv:
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


def test_idle_conversation_expires_and_recomputes(rig: Rig) -> None:
    conv = "conv-idle"
    prompt = _ids(7, 300)
    out = rig.turn("pull", conv, prompt)
    got = out["choices"][0]["token_ids"]
    rig.wait_leased(conv, _retained_tokens(len(prompt)))
    held = rig.d_usage()
    assert held > 0.0
    time.sleep(TTL_S + 1.5)  # nobody renews: the service expires the lease
    lease, _ = rig.lease(conv)
    from kvbaton.v1 import lease_pb2

    assert lease is None or lease.state == lease_pb2.LEASE_STATE_EXPIRED, lease
    assert rig.d_usage() < held  # decode gave the blocks back
    freed = rig.events("d0", "retention_freed", part="retention", conversation_id=conv)
    assert len(freed) == 1 and "EXPIRED" in freed[0]["why"], freed
    prompt2 = prompt + got + _ids(8, 100)
    ref = rig.single(prompt2)
    out2 = rig.turn("pull", conv, prompt2)
    assert out2["choices"][0]["token_ids"] == ref
    assert not rig.events("p0", "reuse_read", conversation_id=conv)  # recomputed, not read
    rig.revoke(conv)


def test_lease_keeper_keeps_history_reusable(rig: Rig) -> None:
    from kvbaton.client import KvbatonClient, LeaseKeeper

    conv = "conv-kept"
    prompt = _ids(11, 300)
    got = rig.turn("push", conv, prompt)["choices"][0]["token_ids"]
    rig.wait_leased(conv, _retained_tokens(len(prompt)))

    async def think() -> int:
        async with KvbatonClient(rig.cp) as kv, LeaseKeeper(kv, conv) as keeper:
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
    prompt2 = prompt + got + _ids(12, 100)
    ref = rig.single(prompt2)
    out = rig.turn("push", conv, prompt2)
    assert out["choices"][0]["token_ids"] == ref
    reads = rig.events("p0", "reuse_read", conversation_id=conv)
    assert len(reads) == 1 and reads[0]["nbytes"] > 0
    rig.revoke(conv)


def test_read_of_ended_lease_is_refused_and_recomputed(rig: Rig) -> None:
    """Prefill handed a lookup that went stale (the lease ended in between): the pin is
    refused, nothing is read, and the output is still right."""
    conv = "conv-stale"
    prompt = _ids(21, 300)
    got = rig.turn("pull", conv, prompt)["choices"][0]["token_ids"]
    lease = rig.wait_leased(conv, _retained_tokens(len(prompt)))
    _, ret = rig.lease(conv)
    reuse = {"conversation_id": conv, "engine_id": ret.engine_id, "lease_id": lease.lease_id,
             "retention_id": ret.retention_id, "block_ids": list(ret.block_ids), "num_tokens": ret.num_tokens,
             "tokens_per_block": ret.tokens_per_block, "block_hashes": [h.hex() for h in ret.block_hashes]}
    rig.revoke(conv)  # the expiry wins the race
    prompt2 = prompt + got + _ids(22, 100)
    ref = rig.single(prompt2)
    out = rig.p.post_json("/v1/completions", {**rig.body(prompt2), "kv_transfer_params": {"reuse": reuse}})
    assert out["choices"][0]["token_ids"] == ref
    failed = rig.events("p0", "reuse_failed", conversation_id=conv)
    assert len(failed) == 1 and "pin refused" in failed[0]["reason"], failed
    assert not rig.events("p0", "reuse_read", conversation_id=conv)


def test_concurrent_conversations(rig: Rig) -> None:
    """Four conversations at once (two per mode), two turns each: every second turn reads
    its own history (not another conversation's) and matches the single engine."""
    convs = [(f"conv-conc-{i}", "pull" if i % 2 else "push", _ids(40 + i, 260 + 30 * i)) for i in range(4)]

    def one(conv: str, mode: str, prompt: list[int]) -> tuple[bool, bool]:
        got = rig.turn(mode, conv, prompt)["choices"][0]["token_ids"]
        rig.wait_leased(conv, _retained_tokens(len(prompt)))
        prompt2 = prompt + got + _ids(hash(conv) % 1000, 90)
        out = rig.turn(mode, conv, prompt2)["choices"][0]["token_ids"]
        return got == refs[conv][0], out == rig.single(prompt2)

    refs = {c: (rig.single(p),) for c, _, p in convs}
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda a: one(*a), convs))
    assert results == [(True, True)] * 4
    for conv, _, prompt in convs:
        reads = rig.events("p0", "reuse_read", conversation_id=conv)
        assert len(reads) == 1 and reads[0]["num_blocks"] == _retained_tokens(len(prompt)) // BLOCK


def test_all_conversations_ended_frees_decode(rig: Rig) -> None:
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
