"""TTFT per turn of a growing conversation, with D→P reuse on vs off (kvbaton, real vLLM).

    .venv/bin/python benchmarks/reuse_turns.py [--modes pull push] [--new-tokens 1000]
        [--max-model-len 8192] [--reps 3]

Setup: control plane, prefill engine (**prefix caching off**, so without reuse it
recomputes the whole history every turn), decode engine (lease TTL 60 s), one router per
mode with the control plane configured. The tiny model allows 8,192 positions
(``max_position_embeddings``); the 64 MiB float32 KV cache holds 32k tokens, so the
conversation grows by ``--new-tokens`` user tokens + ``--output-tokens`` generated ones per
turn until the next prompt would not fit ``--max-model-len``.

Per turn, one prompt (token ids: previous prompt + previous output + fresh random ids):
- **on**: streamed through the router *with* the conversation id (the router renews the
  lease and hands prefill the retained blocks; prefill READs them from decode and computes
  only the new tokens). Once per turn: a second "on" request would reuse this turn's own
  retention (more than a real next turn could).
- **off**: the same prompt through the same router *without* a conversation id (prefill
  computes everything; decode's own prefix cache helps it exactly as in "on"), ``--reps``
  times, median.
- Greedy outputs of both are checked against the prefill engine alone.

TTFT = first streamed token at the client. Results: a table and
``benchmarks/results/reuse_turns.json``; the last line prints off/on at the longest turn.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvbaton.stack.pd_stack import stop_group, stream_request, wait_port
from kvbaton.stack.vllm_server import VllmServer, free_port, small_engine_args
from kvbaton.tinymodel import ensure_tiny_model

PY = sys.executable
BLOCK = 128


def kv_config(cp: str, engine_id: str, stats_dir: Path, ttl_s: float) -> str:
    return json.dumps({
        "kv_connector": "KvbatonConnector",
        "kv_connector_module_path": "kvbaton.connector.kvbaton_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "control_plane": cp, "mode": "pull", "engine_id": engine_id, "timeout_s": 20,
            "stats_dir": str(stats_dir), "ucx_net_devices": "lo", "ucx_tls": "tcp,self,sm",
            "lease_ttl_s": ttl_s, "max_retained_fraction": 0.5,
        },
    })


def events(stats_dir: Path, engine: str, event: str) -> list[dict[str, Any]]:
    path = stats_dir / f"{engine}.worker.jsonl"
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == event]


def wait_leased(cp: str, conv: str, num_tokens: int, timeout_s: float = 10.0) -> bool:
    """Until decode's retention of ``num_tokens`` is under an ACTIVE lease (a real user's
    think time covers this; here it is a few ms)."""
    from kvbaton.client import KvbatonClient
    from kvbaton.v1 import lease_pb2, registrar_pb2

    async def go() -> bool:
        async with KvbatonClient(cp) as kv:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    lease = await kv.lease.Get(lease_pb2.GetLeaseRequest(conversation_id=conv), timeout=2)
                    ret = (await kv.registrar.LookupRetained(
                        registrar_pb2.LookupRetainedRequest(conversation_id=conv), timeout=2)).retained
                    if (lease.state == lease_pb2.LEASE_STATE_ACTIVE and ret.num_tokens == num_tokens
                            and lease.retention_id == ret.retention_id):
                        return True
                except Exception:  # noqa: BLE001 - not registered/leased yet: poll again
                    pass
                await asyncio.sleep(0.02)
            return False
    return asyncio.run(go())


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvb-reuse-bench-"))
    stats = work / "stats"
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    procs: list[Any] = []
    servers: list[VllmServer] = []
    out: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "args": vars(args),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "modes": {}}
    try:
        cport = free_port()
        cp = subprocess.Popen(
            [str(Path(PY).parent / "kvbaton"), "serve", "--insecure", "--listen", f"127.0.0.1:{cport}"],
            stdout=open(work / "cp.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(cp)
        wait_port(cport, cp)
        cpa = f"127.0.0.1:{cport}"
        mml = ["--max-model-len", str(args.max_model_len)]
        p = VllmServer(model, extra_args=[*small_engine_args(), *mml, "--no-enable-prefix-caching",
                                          "--kv-transfer-config", kv_config(cpa, "p0", stats, 60.0)],
                       env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, log_path=work / "p.log", served_model_name="tiny",
                       startup_timeout_s=600)
        d = VllmServer(model, extra_args=[*small_engine_args(), *mml,
                                          "--kv-transfer-config", kv_config(cpa, "d0", stats, 60.0)],
                       env={"VLLM_CPU_OMP_THREADS_BIND": "1"}, log_path=work / "d.log", served_model_name="tiny",
                       startup_timeout_s=600)
        servers += [p, d]
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            for f in [ex.submit(s.start) for s in servers]:
                f.result()
        routers: dict[str, str] = {}
        for mode in args.modes:
            rport = free_port()
            r = subprocess.Popen(
                [PY, "-m", "kvbaton.services.router", "--prefill", p.base_url, "--decode", d.base_url,
                 "--mode", mode, "--port", str(rport)], stdout=open(work / f"router-{mode}.log", "wb"),
                stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT, env={**os.environ, "KVBATON_CONTROL_PLANE": cpa})
            procs.append(r)
            wait_port(rport, r)
            routers[mode] = f"http://127.0.0.1:{rport}"
        for mode, url in routers.items():
            out["modes"][mode] = run_mode(args, mode, url, p, cpa, stats)
    finally:
        for s in reversed(servers):
            try:
                s.stop()
            except Exception as exc:  # noqa: BLE001
                print(f"stop failed: {exc!r}", file=sys.stderr)
        for proc in reversed(procs):
            stop_group(proc)
    return out


def run_mode(args: argparse.Namespace, mode: str, url: str, p: VllmServer, cp: str,
             stats: Path) -> list[dict[str, Any]]:
    rnd = random.Random(f"{args.seed}-{mode}")

    def fresh(n: int) -> list[int]:
        return [rnd.randrange(10, 4000) for _ in range(n)]

    conv = f"bench-{mode}-{int(time.time())}"
    prompt = fresh(args.first_tokens)
    rows: list[dict[str, Any]] = []
    turn = 0
    while len(prompt) + args.output_tokens <= args.max_model_len:
        turn += 1
        body = {"model": "tiny", "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0.0,
                "ignore_eos": True}
        ref = p.post_json("/v1/completions", {**body, "return_token_ids": True}, timeout_s=120)["choices"][0]
        reads_before = len(events(stats, "p0", "reuse_read"))
        on = stream_request(f"{url}/v1/completions", {**body, "conversation_id": conv})
        reads = events(stats, "p0", "reuse_read")[reads_before:]
        offs = [stream_request(f"{url}/v1/completions", body) for _ in range(args.reps)]
        row = {"turn": turn, "prompt_tokens": len(prompt),
               "ttft_on_ms": round(on.ttft_s * 1000, 2),
               "ttft_off_ms": round(statistics.median(o.ttft_s for o in offs) * 1000, 2),
               "ttft_off_all_ms": [round(o.ttft_s * 1000, 2) for o in offs],
               "reused_tokens": sum(e["num_blocks"] for e in reads) * BLOCK,
               "read_bytes": sum(e["nbytes"] for e in reads),
               "read_descs": sum(e["num_descs"] for e in reads),
               "read_ms": round(sum(e["duration_s"] for e in reads) * 1000, 3),
               "on_correct": on.text == ref["text"], "off_correct": all(o.text == ref["text"] for o in offs)}
        row["ratio_off_over_on"] = round(row["ttft_off_ms"] / row["ttft_on_ms"], 2) if on.ttft_s > 0 else None
        rows.append(row)
        print(f"[{mode}] turn {turn}: {len(prompt):5d} tok  on {row['ttft_on_ms']:8.1f} ms  "
              f"off {row['ttft_off_ms']:8.1f} ms  x{row['ratio_off_over_on']}  reused {row['reused_tokens']:5d} tok "
              f"({row['read_bytes'] / 2**20:.1f} MiB, {row['read_descs']} descs, {row['read_ms']:.1f} ms)  "
              f"correct {row['on_correct']}/{row['off_correct']}", flush=True)
        retained = (len(prompt) + args.output_tokens - 1) // BLOCK * BLOCK
        if not wait_leased(cp, conv, retained):
            print(f"[{mode}] warning: retention of turn {turn} not leased in time", file=sys.stderr)
        prompt = prompt + ref["token_ids"] + fresh(args.new_tokens)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["pull", "push"], choices=["pull", "push"])
    ap.add_argument("--first-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=1000)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reuse_turns.json"))
    args = ap.parse_args()
    res = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    for mode, rows in res["modes"].items():
        if rows:
            last = rows[-1]
            print(f"{mode}: longest turn {last['prompt_tokens']} tokens: TTFT off/on = "
                  f"{last['ttft_off_ms']:.1f}/{last['ttft_on_ms']:.1f} ms = x{last['ratio_off_over_on']} "
                  f"(reused {last['reused_tokens']} tokens)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
