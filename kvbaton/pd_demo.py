"""The main job: a real P/D hand-off between two vLLM engines through kvbaton.

    python -m kvbaton.pd_demo [--mode push|pull] [--turns 4]     (scripts/run.sh runs this)

It starts, on this machine and on loopback only:

1. the kvbaton control plane (``kvbaton serve``, in-memory store);
2. a tiny float32 Llama model, generated once into ``.cache/tiny-model`` (no hub access);
3. a prefill vLLM engine pinned to core 0 and a decode vLLM engine pinned to core 1, both
   with the kvbaton connector (KV moves between them over NIXL/UCX);
4. the kvbaton router (OpenAI-compatible) in the chosen mode;

then holds a short multi-turn chat through the router. For every turn it prints the
streamed time to first token, the total latency, the KV bytes that moved P→D and the NIXL
notifications (read from the connectors' stats files, the ground truth of what moved),
and whether the answer equals the prefill engine's own single-engine answer. At the end it
asks the control plane what it saw, the way an operator would (``kvbaton engines list``,
``kvbaton transfers list --phase succeeded``), stops everything and exits nonzero if any
turn failed, differed, or moved no bytes.

Push (default): the router sends both legs at once; decode *offers* its blocks, prefill
*completes*, the rendezvous matches them and prefill WRITEs into decode. Pull: prefill
returns its block ids, decode READs them; the rendezvous is not involved, so the control
plane lists no transfers in that mode (only the registrar is used, for NIXL metadata).

``python -m kvbaton.demo`` is the control-plane-only walk-through (no model, no vLLM).

The stack is started with :mod:`kvbaton.stack.pd_stack` (shared with the e2e tests and
the benchmarks).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbaton.stack import pd_stack
from kvbaton.stack.base import run_demo

ROOT = Path(__file__).resolve().parents[1]

#: What the user says each turn; the assistant's (gibberish: random weights) answers are
#: fed back, so every turn's prompt extends the previous one, as in an agent's loop.
TURNS = [
    "You are the decode engine's assistant. Explain in one line what a KV cache block holds, "
    "and why moving it from the prefill engine saves recomputing the prompt.",
    "Now say how many tokens fit in one block of this engine and what happens to the blocks "
    "after the transfer.",
    "Summarise the whole conversation so far for an operator who watches the control plane.",
    "Thanks. Last question: what should happen to these blocks if the prefill engine dies?",
]


def _moved(stack: Any, mode: str, marks: dict[str, int], timeout_s: float = 5.0) -> dict[str, Any]:
    """What moved for the one request sent since ``marks`` (bookmarks of both stats files).

    Prefill writes its ``send_done`` from a background thread after the response, so this
    polls (bounded) until the prefill side has reported too."""
    deadline = time.monotonic() + timeout_s
    while True:
        d = stack.events("d0", since=marks["d0"])
        p = stack.events("p0", since=marks["p0"])
        recv = [e for e in d if e["event"] == "recv_done"]
        failed = [e for e in d if e["event"] == "recv_failed"]
        sent = [e for e in p if e["event"] == "send_done"]
        if (sent and (recv or failed)) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    notifs = [e for e in d if e["event"] == "notif"] if mode == "push" else [e for e in p if e["event"] == "notif"]
    return {
        "bytes": sum(int(e.get("nbytes", 0)) for e in recv),
        "blocks": sum(int(e.get("num_blocks", 0)) for e in recv),
        "notifs": len(notifs),
        "failed": [e.get("reason", "") for e in failed],
        "transfer_ids": sorted({e["transfer_id"] for e in recv + failed}),
        "xfer_ms": [round(float(e.get("duration_s", 0)) * 1000, 1) for e in recv],
    }


def _cli(addr: str, *args: str) -> str:
    """Run an operator command against the control plane (bounded) and return its output."""
    exe = Path(sys.executable).parent / "kvbaton"
    cmd = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else ["-m", "kvbaton.cli"]),
           *args, "--addr", addr]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {r.stderr.strip()}")
    return r.stdout.rstrip()


def run(mode: str, turns: int, max_tokens: int, model_dir: Path, workdir: Path) -> int:
    """The demo; returns the process exit code."""
    from kvbaton.tinymodel import ensure_tiny_model

    t_start = time.monotonic()
    print(f"kvbaton P/D demo, mode {mode.upper()} (--mode push|pull); work dir {workdir}", flush=True)
    model = ensure_tiny_model(model_dir)
    print(f"model: {model} (2-layer Llama, float32, random weights: the words are gibberish, "
          "but greedy output must be identical with and without the hand-off)", flush=True)
    print("starting control plane, prefill engine (core 0), decode engine (core 1), router ... "
          "(about a minute)", flush=True)
    problems: list[str] = []
    with pd_stack.PdStack(model, workdir, router_modes=(mode,), timeout_s=20.0) as stack:
        prefill, decode = stack.engines()
        print(f"  control plane {stack.cp_address}   prefill {prefill.base_url} "
              f"({prefill.startup_s:.0f}s)   decode {decode.base_url} ({decode.startup_s:.0f}s)   "
              f"router {stack.routers[mode]}  [ready after {time.monotonic() - t_start:.0f}s]\n", flush=True)
        url = f"{stack.routers[mode]}/v1/chat/completions"
        messages: list[dict[str, str]] = []
        hdr = f"{'turn':>4} {'prompt tok':>10} {'TTFT ms':>8} {'total ms':>8} {'KV bytes P->D':>14} " \
              f"{'blocks':>6} {'notifs':>6} {'= single':>8}"
        print(hdr)
        for i, user in enumerate(TURNS[:turns], 1):
            messages.append({"role": "user", "content": user})
            body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True}
            marks = {e: stack.event_count(e) for e in ("p0", "d0")}
            try:
                res = pd_stack.stream_request(url, body, timeout_s=60)
            except Exception as exc:  # noqa: BLE001 - report and go on to shutdown
                problems.append(f"turn {i}: request failed: {exc!r}")
                print(f"{i:>4} request failed: {exc!r}")
                break
            moved = _moved(stack, mode, marks)
            single = prefill.post_json("/v1/chat/completions", body, timeout_s=60)
            same = single["choices"][0]["message"]["content"] == res.text
            n_prompt = int(single["usage"]["prompt_tokens"])
            print(f"{i:>4} {n_prompt:>10} {res.ttft_s * 1000:>8.1f} {res.total_s * 1000:>8.1f} "
                  f"{moved['bytes']:>14,} {moved['blocks']:>6} {moved['notifs']:>6} {'yes' if same else 'NO':>8}",
                  flush=True)
            if not same:
                problems.append(f"turn {i}: output differs from the single engine")
            if moved["failed"]:
                problems.append(f"turn {i}: transfer failed ({moved['failed']}); decode recomputed")
            if moved["bytes"] <= 0 and not moved["failed"]:
                problems.append(f"turn {i}: no KV bytes moved")
            messages.append({"role": "assistant", "content": res.text})
        print("\n(decode's prefix cache keeps earlier turns' full 128-token blocks, so a later turn "
              "moves only the blocks decode does not hold yet)")
        print(f"\n$ kvbaton engines list --addr {stack.cp_address}")
        print(_cli(stack.cp_address, "engines", "list"))
        print(f"\n$ kvbaton transfers list --phase succeeded --addr {stack.cp_address}")
        listed = _cli(stack.cp_address, "transfers", "list", "--phase", "succeeded")
        print(listed)
        n_listed = len(listed.splitlines()) - 1
        if mode == "pull":
            print("(pull mode: decode READs prefill's blocks directly; the rendezvous is not used, "
                  "so no transfers are listed)")
        elif n_listed < turns and not problems:
            problems.append(f"control plane lists {n_listed} succeeded transfers for {turns} turns")
        for engine in ("p0", "d0"):
            srv = prefill if engine == "p0" else decode
            usage = pd_stack.usage_back_to_zero(srv, timeout_s=10)
            if usage:
                problems.append(f"{engine} still holds KV blocks (kv_cache_usage_perc={usage})")
        print("\nstopping router, engines and control plane ...", flush=True)
    print(f"all stopped; {time.monotonic() - t_start:.0f}s in all; logs and connector stats in {workdir}")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    print(f"OK: {turns} turns in {mode} mode, every answer equal to the single engine's, KV moved over NIXL")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbaton.pd_demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("push", "pull"), default="push")
    ap.add_argument("--turns", type=int, default=4, choices=range(1, len(TURNS) + 1))
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--model-dir", type=Path, default=Path(os.environ.get("KVBATON_TINY_MODEL", ROOT / ".cache/tiny-model")))
    ap.add_argument("--workdir", type=Path, default=None, help="logs and stats (default: a fresh temp dir)")
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"kvbaton-pd-demo-{args.mode}-"))
    return run_demo(lambda: run(args.mode, args.turns, args.max_tokens, args.model_dir, workdir))


if __name__ == "__main__":
    sys.exit(main())
