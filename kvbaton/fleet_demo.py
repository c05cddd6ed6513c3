"""The main job: an agent conversation over a fleet — 2 prefill and 1–2 decode vLLM
engines behind a router that discovers them from the registrar.

    python -m kvbaton.fleet_demo [--mode pull|push] [--decodes 2] [--turns 6]   (scripts/run.sh runs this)

It starts, on this machine and on loopback only: the kvbaton control plane (in-memory),
the tiny float32 Llama model (generated locally, no hub), prefill engines ``p0`` and ``p1``
and decode engines ``d0`` (``d1``), each registering the URL it serves on and its role, and
a router that follows the registrar (no engine URL is given to it). Prefix caching is on
everywhere, as in production.

Then one agent conversation (``X-Session-ID`` header, as agent frameworks send it): every
turn's prompt is the previous prompt + the answer + ~200 new tokens (a tool result). Per
turn it prints which prefill and which decode served it (the router's answer headers), the
tokens the router offered from decode's retained KV and the tokens prefill actually READ
back from decode (the connector's stats, the ground truth), the streamed TTFT, and — once
the conversation is over, so the check does not warm any engine's prefix cache during it —
whether the answer equals a single engine's. The router keeps the conversation on the
decode that holds its KV while the prefill side alternates (least outstanding work), so
the history a prefill lacks comes back from decode instead of being recomputed.

Exits nonzero if an answer differs, a request failed, or no later turn read KV back.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 128  # vLLM's CPU block size for this model (tokens per KV block)


def _ids(rnd: random.Random, n: int) -> list[int]:
    return [rnd.randrange(10, 4000) for _ in range(n)]


def _reads(stack: Any, conv: str, marks: dict[str, int], timeout_s: float = 5.0,
           expect: bool = False) -> tuple[int, int, list[str]]:
    """(tokens READ back from decode, bytes, failures) for this turn, from the prefill
    engines' stats files (written by a background thread just after the answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reads, fails = [], []
        for eid in stack.prefill_ids:
            reads += [e for e in stack.events(eid, "reuse_read", since=marks[eid]) if e["conversation_id"] == conv]
            fails += [e for e in stack.events(eid, "reuse_failed", since=marks[eid]) if e["conversation_id"] == conv]
        if reads or fails or not expect or time.monotonic() > deadline:
            return (sum(int(e["num_blocks"]) for e in reads) * BLOCK, sum(int(e["nbytes"]) for e in reads),
                    [str(e.get("reason", "")) for e in fails])
        time.sleep(0.05)


def run(args: argparse.Namespace, workdir: Path) -> int:
    from kvbaton.stack import fleet_stack
    from kvbaton.tinymodel import ensure_tiny_model

    t_start = time.monotonic()
    print(f"kvbaton fleet demo: 2 prefill + {args.decodes} decode engines, one router (discovery), "
          f"mode {args.mode.upper()}; work dir {workdir}", flush=True)
    model = ensure_tiny_model(args.model_dir)
    print(f"model: {model} (2-layer Llama, float32, random weights: tokens are gibberish, greedy output "
          "must equal a single engine's)", flush=True)
    print(f"starting control plane, {2 + args.decodes} vLLM engines (prefix caching on) and the router ... "
          "(a minute or two on 2 cores)", flush=True)
    problems: list[str] = []
    rnd = random.Random(args.seed)
    conv = f"agent-{rnd.randrange(10**6)}"
    with fleet_stack.FleetStack(model, workdir, n_prefill=2, n_decode=args.decodes, mode=args.mode,
                                extra_config={"lease_ttl_s": 60, "kv_recompute_threshold": 64}) as stack:
        stack.wait_routers_see(2, args.decodes)
        stack.warm_up()
        router = stack.routers[0]
        print(f"  control plane {stack.cp_address}   router {router}   "
              f"[ready after {time.monotonic() - t_start:.0f}s]", flush=True)
        with urllib.request.urlopen(f"{router}/kvbaton/fleet", timeout=5) as r:
            for e in json.loads(r.read())["engines"]:
                print(f"  discovered {e['engine_id']:<3} {e['role']:<8} {e['url']}")
        print(f"\nconversation {conv} (X-Session-ID), {args.turns} turns, {args.max_tokens} output tokens each\n")
        print(f"{'turn':>4} {'prompt':>6} {'prefill':>7} {'decode':>6} {'offered':>7} {'read back':>9} "
              f"{'TTFT ms':>8} {'total ms':>8} {'tries':>5}")
        prompt = _ids(rnd, args.first_tokens)
        turns: list[tuple[list[int], list[int]]] = []
        for i in range(1, args.turns + 1):
            marks = {eid: stack.event_count(eid) for eid in stack.prefill_ids}
            body = {"model": "tiny", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                    "ignore_eos": True}
            try:
                res = fleet_stack.stream_tokens(f"{router}/v1/completions", body, {"X-Session-ID": conv})
            except Exception as exc:  # noqa: BLE001 - report and go on to shutdown
                problems.append(f"turn {i}: request failed: {exc!r}")
                print(f"{i:>4} request failed: {exc!r}")
                break
            if not res["done"]:
                problems.append(f"turn {i}: the answer's stream ended without [DONE]")
                print(f"{i:>4} stream cut after {len(res['token_ids'])} tokens")
                break
            h = res["headers"]
            offered = int(h.get("X-Kvbaton-Reuse-Tokens", 0))
            read, _, fails = _reads(stack, conv, marks, expect=offered > 0)
            print(f"{i:>4} {len(prompt):>6} {h.get('X-Kvbaton-Prefill', '?'):>7} {h.get('X-Kvbaton-Decode', '?'):>6} "
                  f"{offered:>7} {read:>9} {res['ttft_s'] * 1000:>8.1f} {res['total_s'] * 1000:>8.1f} "
                  f"{h.get('X-Kvbaton-Attempts', '?'):>5}"
                  + (f"  READ failed: {fails}" if fails else ""), flush=True)
            turns.append((prompt, res["token_ids"]))
            if i < args.turns:
                full = (len(prompt) + args.max_tokens - 1) // BLOCK * BLOCK
                if fleet_stack.wait_leased(stack.cp_address, conv, full) is None:
                    problems.append(f"turn {i}: decode's retained KV never came under a lease")
                prompt = prompt + res["token_ids"] + _ids(rnd, args.new_tokens)
        reads_total = sum(len([e for e in stack.events(eid, "reuse_read") if e["conversation_id"] == conv])
                          for eid in stack.prefill_ids)
        print("\nequality with a single engine (each turn's prompt sent to p0 alone, after the conversation):")
        same_all = True
        for i, (p, out) in enumerate(turns, 1):
            single = stack.engines["p0"].post_json("/v1/completions", {
                "model": "tiny", "prompt": p, "max_tokens": args.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}, timeout_s=120)["choices"][0]["token_ids"]
            if single != out:
                same_all = False
                problems.append(f"turn {i}: output differs from the single engine")
        print(f"  {'all ' + str(len(turns)) + ' turns equal' if same_all else 'DIFFERENT: ' + str(problems)}")
        with urllib.request.urlopen(f"{router}/kvbaton/stats", timeout=5) as r:
            stats = json.loads(r.read())
        with urllib.request.urlopen(f"{router}/kvbaton/fleet", timeout=5) as r:
            cost = json.loads(r.read())["decision_us"]
        print(f"\nrouter: {stats['decode_affinity']} of {len(turns) - 1} later turns on the decode holding the "
              f"conversation's KV; "
              f"reuse offered {stats['reuse_offered']} times; decision cost p50 {cost['p50']:.1f} µs, "
              f"p99 {cost['p99']:.1f} µs")
        if len(turns) > 1 and reads_total == 0:
            problems.append("no turn read its history back from decode")
        print("\nstopping router, engines and control plane ...", flush=True)
    print(f"all stopped; {time.monotonic() - t_start:.0f}s in all; logs and connector stats in {workdir}")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    print(f"OK: {len(turns)} turns over 2 prefill + {args.decodes} decode engines, every answer equal to a "
          f"single engine's, history read back from decode on {reads_total} turns")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbaton.fleet_demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("push", "pull"), default="pull")
    ap.add_argument("--decodes", type=int, default=2, choices=(1, 2))
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--first-tokens", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=200, help="tokens added per turn (the tool result)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--model-dir", type=Path,
                    default=Path(os.environ.get("KVBATON_TINY_MODEL", ROOT / ".cache/tiny-model")))
    ap.add_argument("--workdir", type=Path, default=None, help="logs and stats (default: a fresh temp dir)")
    args = ap.parse_args(argv)
    if args.first_tokens + args.turns * (args.new_tokens + args.max_tokens) > 4000:
        ap.error("the conversation would outgrow the engines' 4096-token context")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvbaton-fleet-demo-"))
    from kvbaton.stack.base import run_demo

    return run_demo(lambda: run(args, workdir))


if __name__ == "__main__":
    sys.exit(main())
