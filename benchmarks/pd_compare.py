"""TTFT and TPOT of P/D disaggregation on real vLLM engines: kvbaton push, kvbaton pull and
vLLM's own NixlConnector (pull), beside one engine alone — same tiny model, same prompts.

    .venv/bin/python benchmarks/pd_compare.py [--n 8] [--lengths 256 1024] [--concurrent 4]

Why this shape:
- Prompts are token-id lists of exactly the asked length, fresh random ids for every
  request, so no configuration gets a prefix-cache hit another one did not.
- Every configuration is a 1P1D pair with P's worker on core 0 and D's on core 1
  (``VLLM_CPU_OMP_THREADS_BIND``); the two pairs run one after the other (an idle
  NixlConnector engine keeps a core busy, which would distort the other pair).
- All three P/D configurations go through the same proxy, kvbaton's router
  (``services/router``): in pull mode it *is* vLLM's proxy protocol (P gets
  ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, non-streaming;
  D gets the returned params, streaming), so the HTTP hop costs the same everywhere.
  "single" is the prefill engine asked directly (no hop, no connector work).
- TTFT = first streamed token at the client; TPOT = mean gap between later tokens
  (``--output-tokens`` tokens, ``ignore_eos``; (last - first) / (tokens - 1), vLLM's definition). Requests go one at a time; ``--concurrent``
  adds a burst of that many at once per length (TTFT only, median over the burst).
- Anything that fails or stalls (per-request timeout) is recorded as such in the JSON,
  never crashes the run; the stack is always torn down.

Results: a table on stdout and ``benchmarks/results/pd_compare.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvbaton.stack.pd_stack import PdStack, StreamResult, stream_request
from kvbaton.tinymodel import ensure_tiny_model

VOCAB_LO, VOCAB_HI = 10, 4000  # the tiny model's vocab is 4096; stay clear of specials


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _summary(results: list[StreamResult], errors: list[str]) -> dict[str, Any]:
    ttft = [r.ttft_s * 1000 for r in results if r.ttft_s >= 0]
    tpot = [r.tpot_s * 1000 for r in results if r.tpot_s is not None]
    return {"n_ok": len(ttft), "n_failed": len(errors), "errors": errors[:5],
            "ttft_ms_median": _pct(ttft, 0.5), "ttft_ms_p90": _pct(ttft, 0.9),
            "tpot_ms_median": _pct(tpot, 0.5), "ttft_ms_all": [round(x, 2) for x in ttft],
            "tpot_ms_all": [round(x, 3) for x in tpot]}


class Runner:
    """Sends the measured requests to one URL."""

    def __init__(self, url: str, output_tokens: int, timeout_s: float, rng: random.Random) -> None:
        self.url = f"{url}/v1/completions"
        self.output_tokens = output_tokens
        self.timeout_s = timeout_s
        self.rng = rng

    def body(self, length: int) -> dict[str, Any]:
        prompt = [self.rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(length)]
        return {"model": "tiny", "prompt": prompt, "max_tokens": self.output_tokens, "temperature": 0.0,
                "ignore_eos": True}

    def one(self, length: int) -> StreamResult | str:
        try:
            r = stream_request(self.url, self.body(length), timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            return f"{type(exc).__name__}: {exc}"[:300]
        if r.n_tokens < self.output_tokens:
            return f"short stream: {r.n_tokens} of {self.output_tokens} tokens"
        return r

    def sequential(self, length: int, n: int, warmup: int) -> dict[str, Any]:
        for _ in range(warmup):
            self.one(length)
        ok: list[StreamResult] = []
        errors: list[str] = []
        for _ in range(n):
            r = self.one(length)
            (ok.append(r) if isinstance(r, StreamResult) else errors.append(r))
            if len(errors) >= 3 and not ok:  # broken: don't spend n x timeout on it
                errors.append("gave up after 3 failures in a row")
                break
        return _summary(ok, errors)

    def burst(self, length: int, k: int) -> dict[str, Any]:
        with concurrent.futures.ThreadPoolExecutor(k) as ex:
            outs = list(ex.map(lambda _: self.one(length), range(k)))
        return _summary([r for r in outs if isinstance(r, StreamResult)], [r for r in outs if isinstance(r, str)])


def measure(name: str, url: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    runner = Runner(url, args.output_tokens, args.timeout, rng)
    out: dict[str, Any] = {}
    for length in args.lengths:
        t0 = time.monotonic()
        out[str(length)] = runner.sequential(length, args.n, args.warmup)
        if args.concurrent > 1:
            out[f"{length}x{args.concurrent}"] = runner.burst(length, args.concurrent)
        print(f"  {name:<14} {length:>5} tok: {_fmt(out[str(length)])}  ({time.monotonic() - t0:.0f}s)", flush=True)
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _fmt(s: dict[str, Any]) -> str:
    f = _ms
    fail = f"  {s['n_failed']} failed" if s["n_failed"] else ""
    return f"TTFT med {f(s['ttft_ms_median'])} p90 {f(s['ttft_ms_p90'])} ms, TPOT med {f(s['tpot_ms_median'])} ms{fail}"


def run_pair(connector: str, modes: list[str], names: dict[str, str], args: argparse.Namespace, model: Path,
             work: Path, rng: random.Random, results: dict[str, Any]) -> None:
    """Start one P/D pair, measure its configurations, stop it; failures are recorded."""
    t0 = time.monotonic()
    try:
        with PdStack(model, work / connector, connector=connector, router_modes=modes,
                     timeout_s=20.0, startup_timeout_s=args.startup_timeout) as stack:
            print(f"{connector} pair up in {time.monotonic() - t0:.0f}s", flush=True)
            if connector == "kvbaton":
                results["single"] = measure("single", stack.p.base_url, args, rng)
            for mode in modes:
                results[names[mode]] = measure(names[mode], stack.routers[mode], args, rng)
            if connector == "kvbaton":
                results["_kvbaton_transfers"] = {
                    "recv_done": len(stack.events("d0", "recv_done")),
                    "recv_failed": len(stack.events("d0", "recv_failed")),
                    "bytes": sum(e["nbytes"] for e in stack.events("d0", "recv_done"))}
    except Exception as exc:  # noqa: BLE001 - e.g. NixlConnector failing to start
        msg = f"{type(exc).__name__}: {exc}"
        print(f"{connector} pair FAILED: {msg[:2000]}", flush=True)
        traceback.print_exc()
        for mode in modes:
            results.setdefault(names[mode], {"error": msg[:4000]})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8, help="measured requests per configuration and length")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--concurrent", type=int, default=4, help="burst size per length; 0/1: none")
    ap.add_argument("--timeout", type=float, default=60.0, help="per request (stall) timeout, s")
    ap.add_argument("--startup-timeout", type=float, default=400.0)
    ap.add_argument("--skip-nixl", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/pd_compare.json")
    args = ap.parse_args(argv)
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", ROOT / ".cache/tiny-model")))
    work = Path(tempfile.mkdtemp(prefix="kvbaton-pd-compare-"))
    rng = random.Random(1234)
    results: dict[str, Any] = {}
    t0 = time.monotonic()
    run_pair("kvbaton", ["push", "pull"], {"push": "kvbaton-push", "pull": "kvbaton-pull"}, args, model, work,
             rng, results)
    if not args.skip_nixl:
        run_pair("nixl", ["pull"], {"pull": "vllm-nixl-pull"}, args, model, work, rng, results)
    doc = {
        "benchmark": "pd_compare", "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "note": "shared 2-core VM: noisy"},
        "model": "kvbaton.tinymodel (2-layer Llama, hidden 256, float32), --enforce-eager, 64 MiB KV",
        "setup": {"n": args.n, "warmup": args.warmup, "lengths": args.lengths, "output_tokens": args.output_tokens,
                  "concurrent": args.concurrent, "proxy": "kvbaton router for all P/D configs",
                  "pinning": "P worker core 0, D worker core 1"},
        "runtime_s": round(time.monotonic() - t0, 1), "workdir": str(work), "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n{'config':<15}{'len':>6}{'TTFT med ms':>13}{'TTFT p90 ms':>13}{'TPOT med ms':>13}{'ok/n':>7}")
    for name in ("single", "kvbaton-push", "kvbaton-pull", "vllm-nixl-pull"):
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            print(f"{name:<15}  FAILED: {r['error'][:100]}")
            continue
        for key, s in r.items():
            f = _ms
            print(f"{name:<15}{key:>6}{f(s['ttft_ms_median']):>13}{f(s['ttft_ms_p90']):>13}"
                  f"{f(s['tpot_ms_median']):>13}{s['n_ok']:>4}/{s['n_ok'] + s['n_failed']}")
    print(f"\n{doc['runtime_s']:.0f}s; JSON in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
