"""Where a push request's time goes, one request at a time, push and pull alternating.

    .venv/bin/python benchmarks/push_timeline.py [--requests 12] [--length 1024]
        [--configs '{"idle_step_wait_ms": 0}' '{}']

For each kvbaton ``kv_connector_extra_config`` variant given with ``--configs`` (default:
the idle-step wait off, then the defaults) it starts a P/D stack, sends ``--requests``
requests alternating push and pull, 1.5 s apart, and joins the connector's stats events
and the rendezvous record into a timeline per request, in ms after the client sent it:

- ``P_hold_start``: prefill finished and its worker got the blocks to send (push) or hold (pull);
- ``D_load_start``: decode's worker got its load spec (push: decode offered its blocks);
- ``matched``: the rendezvous matched offer and completion (push only);
- ``complete_lag``: ``matched - P_hold_start`` — how late prefill's Complete arrived;
- ``D_kv_ready``: decode's worker had the KV; ``ttft``: first token at the client.

Prints one JSON line per request and a summary per (config, mode); writes everything to
``benchmarks/results/push_timeline.json``. Ratios between configs come from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.pd_compare import VOCAB_HI, VOCAB_LO
from benchmarks.sweep import CpuMeter, stack_components
from kvbaton.stack.pd_stack import PdStack, stream_request


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 1) if vals else None


def run_config(model: Path, work: Path, extra: dict[str, Any], *, requests: int, length: int,
               output_tokens: int, seed: int) -> list[dict[str, Any]]:
    from kvbaton.v1 import rendezvous_pb2

    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    with PdStack(model, work, connector="kvbaton", router_modes=["push", "pull"],
                 engine_args=["--no-enable-prefix-caching"], startup_timeout_s=600, extra_config=extra) as st:
        comps = stack_components(st)
        for i in range(requests + 2):  # the first two (one per mode) warm the connections up
            mode = "push" if i % 2 == 0 else "pull"
            time.sleep(1.5)
            body = {"model": "tiny", "prompt": [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(length)],
                    "max_tokens": output_tokens, "temperature": 0.0, "ignore_eos": True,
                    "request_id": f"tl{i}-{mode}"}
            n0 = {e: st.event_count(e) for e in ("p0", "d0")}
            meter = CpuMeter(comps)
            t0 = time.time()
            r = stream_request(st.routers[mode] + "/v1/completions", body, timeout_s=30)
            cpu = meter.stop()  # from send to the last token: where the cores went
            time.sleep(0.3)
            ev = {f"{e}:{x['event']}": x for e in ("p0", "d0") for x in st.events(e, since=n0[e])}

            def rel(t: float, t0: float = t0) -> float:
                return round((t - t0) * 1000, 1)

            row: dict[str, Any] = {"config": extra, "mode": mode, "i": i, "warmup": i < 2,
                                   "ttft": round(r.ttft_s * 1000, 1), "e2e": round(r.total_s * 1000, 1),
                                   "busy": cpu["machine_busy_frac"],
                                   "cpu_ms": {k: round(v * 1000) for k, v in cpu["cpu_s"].items()
                                              if v and not k.startswith("client")}}
            if "p0:send_done" in ev:
                s = ev["p0:send_done"]
                row["P_hold_start"] = rel(s["t"] - s.get("held_s", 0))
                row["P_send_done"] = rel(s["t"])
            if "d0:recv_done" in ev:
                d = ev["d0:recv_done"]
                row["D_load_start"] = rel(d["t"] - d["duration_s"])
                row["D_kv_ready"] = rel(d["t"])
            tid = next((x.get("transfer_id") for x in ev.values() if x.get("transfer_id")), "")
            if mode == "push" and tid:
                ts = st.rendezvous().GetTransfer(rendezvous_pb2.GetTransferRequest(transfer_id=tid), timeout=2)
                row["matched"] = rel(ts.matched_at_ms / 1000)
                if "P_hold_start" in row:
                    row["complete_lag"] = round(row["matched"] - row["P_hold_start"], 1)
                for eng, rpc, key, part in (("p0", "Complete", "complete_rpc_ms", "scheduler"),
                                            ("p0", "Complete", "complete_rpc_ms", "worker"),
                                            ("d0", "Offer", "offer_rpc_ms", "scheduler")):
                    path = st.stats_dir / f"{eng}.{part}.jsonl"
                    if path.exists():
                        for line in path.read_text().splitlines():
                            x = json.loads(line)
                            if x.get("rpc") == rpc and x.get("transfer_id") == tid:
                                row[key] = x["latency_ms"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--configs", type=json.loads, nargs="+", default=[{"idle_step_wait_ms": 0}, {}])
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configs in turn this many times (A B A B ...: drift hits all alike)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "push_timeline.json")
    args = ap.parse_args(argv)

    from kvbaton.tinymodel import ensure_tiny_model

    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", ROOT / ".cache/tiny-model")))
    work = Path(tempfile.mkdtemp(prefix="kvbaton-timeline-"))
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for k, extra in enumerate(args.configs):
            rows += run_config(model, work / f"r{rnd}c{k}", extra, requests=args.requests, length=args.length,
                               output_tokens=args.output_tokens, seed=7 + rnd)
    summary = []
    print(f"\nmedians over the timed requests ({args.length} tokens, {args.output_tokens} out), ms after send:")
    print(f"{'config':32} {'mode':5} {'ttft':>7} {'P_hold':>7} {'D_load':>7} {'matched':>8} {'lag':>6} {'D_kv':>7}")
    for extra in args.configs:
        for mode in ("push", "pull"):
            sel = [r for r in rows if r["config"] == extra and r["mode"] == mode and not r["warmup"]]
            s = {"config": extra, "mode": mode, "n": len(sel)}
            for key in ("ttft", "P_hold_start", "D_load_start", "matched", "complete_lag", "D_kv_ready", "busy",
                        "complete_rpc_ms", "offer_rpc_ms"):
                s[key] = _median(sel, key)
            comps = sorted({c for r in sel for c in r["cpu_ms"]})
            s["cpu_ms_median"] = {c: _median([{"v": r["cpu_ms"].get(c, 0)} for r in sel], "v") for c in comps}
            summary.append(s)
            print(f"{json.dumps(extra):32} {mode:5} {s['ttft']!s:>7} {s['P_hold_start']!s:>7} "
                  f"{s['D_load_start']!s:>7} {s['matched']!s:>8} {s['complete_lag']!s:>6} {s['D_kv_ready']!s:>7}")
            print(f"    Complete rpc {s['complete_rpc_ms']} ms, Offer rpc {s['offer_rpc_ms']} ms, machine busy {s['busy']}")
            print("    cpu ms per request: " + ", ".join(f"{c} {v}" for c, v in s["cpu_ms_median"].items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"length": args.length, "output_tokens": args.output_tokens,
                                    "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "summary": summary, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
