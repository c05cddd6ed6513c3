"""Plots for the P/D sweep and the bidirectional-reuse benchmark.

    .venv/bin/python benchmarks/plot.py [--sweep-dir benchmarks/results/sweep] [--out-dir benchmarks/results]

Reads the per-run JSONs of ``benchmarks/sweep.py`` and, if present,
``benchmarks/results/reuse_turns.json`` (``benchmarks/reuse_turns.py``), and writes:

- ``ttft_vs_length.png``: TTFT vs input length, one panel per offered rate, one line per
  mode (a line is a mode at a rate): median, with the p90 as an error bar above it. Log
  y axis, because vLLM's NixlConnector baseline can be 10-100x slower than kvbaton and a
  linear axis would flatten push vs pull into one line.
- ``tpot_vs_length.png``: the same for TPOT.
- ``<sweep-dir>/summary.md`` (also printed): the tables and headline ratios of the README.
- ``reuse_ttft_per_turn.png``: TTFT of each turn against its context length, reuse on vs
  off, per mode (off: median of the repetitions with their min-max range shaded).

Runs that failed or were skipped have no median: they are drawn as an ``x`` on the panel's
floor and named in the legend, so a missing point is visibly a failure, not an omission.
Per mode, only the newest sweep in the directory is plotted (by ``sweep_id``), so a stale
file can't mix in; the sweep ids are named on the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker as mticker

ROOT = Path(__file__).resolve().parents[1]
STYLE: dict[str, dict[str, Any]] = {
    "push": {"color": "tab:blue", "marker": "o", "label": "kvbaton push"},
    "pull": {"color": "tab:orange", "marker": "s", "label": "kvbaton pull"},
    "nixl-pull": {"color": "tab:gray", "marker": "^", "label": "vLLM NixlConnector (pull)"},
}


def load_sweep(sweep_dir: Path) -> list[dict[str, Any]]:
    """The run documents of the newest sweep *of each mode* in ``sweep_dir`` (iterations
    averaged later): a stale file of a mode can't mix in, and a sweep that re-ran only the
    kvbaton modes (``--skip-nixl``) keeps the last NixlConnector baseline beside it."""
    docs = [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*_len*_rate*_it*.json"))]
    newest: dict[str, str] = {}
    for d in docs:
        newest[d["mode"]] = max(newest.get(d["mode"], ""), d["sweep_id"])
    return [d for d in docs if d["sweep_id"] == newest[d["mode"]]]


def _sweep_ids(docs: list[dict[str, Any]]) -> str:
    """``20261130T032205`` or, when modes come from different sweeps, ``push+pull 2026...; nixl-pull 2026...``."""
    by_id: dict[str, list[str]] = {}
    for d in docs:
        modes = by_id.setdefault(d["sweep_id"], [])
        if d["mode"] not in modes:
            modes.append(d["mode"])
    if len(by_id) == 1:
        return next(iter(by_id))
    return "; ".join(f"{'+'.join(m)} {sid}" for sid, m in sorted(by_id.items(), reverse=True))


def _by_mode_rate(docs: list[dict[str, Any]]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    out: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for d in docs:
        out[(d["mode"], d["rate"])].append(d)
    return out


def _median_over_iterations(ds: list[dict[str, Any]], key: str) -> float | None:
    """One value per length: the median of the per-iteration statistics (usually one)."""
    xs = sorted(d["summary"].get(key) for d in ds if d["summary"].get(key) is not None)
    return xs[len(xs) // 2] if xs else None


def plot_metric(docs: list[dict[str, Any]], metric: str, ylabel: str, title: str, out: Path, note: str = "") -> None:
    """One panel per rate; per mode a median line with p90 error bars (upper side)."""
    rates = sorted({d["rate"] for d in docs})
    modes = [m for m in STYLE if any(d["mode"] == m for d in docs)]
    lengths = sorted({d["length"] for d in docs})
    fig, axes = plt.subplots(1, len(rates), figsize=(max(7.0, 5.2 * len(rates)), 5.4), sharey=True, squeeze=False)
    span = (max(lengths) - min(lengths)) or max(lengths)
    dodge = {m: (i - (len(modes) - 1) / 2) * 0.025 * span for i, m in enumerate(modes)}  # unhide bars
    grouped = _by_mode_rate(docs)
    all_vals = [v for d in docs for k in (f"{metric}_median", f"{metric}_p90")
                if (v := d["summary"].get(k)) is not None]
    floor = min(all_vals) / 2 if all_vals else 1.0
    for ax, rate in zip(axes[0], rates, strict=True):
        for mode in modes:
            by_len: dict[int, list[dict[str, Any]]] = defaultdict(list)
            for d in grouped.get((mode, rate), []):
                by_len[d["length"]].append(d)
            xs, med, p90, failed, partial = [], [], [], [], []
            for length in sorted(by_len):
                m = _median_over_iterations(by_len[length], f"{metric}_median")
                p = _median_over_iterations(by_len[length], f"{metric}_p90")
                xs.append(length + dodge[mode])
                if m is None:  # NaN breaks the line: no segment across a failed run
                    failed.append(length)
                    med.append(float("nan"))
                    p90.append(float("nan"))
                    continue
                med.append(m)
                p90.append(p if p is not None else m)
                n_ok = sum(d["summary"]["n_ok"] for d in by_len[length])
                n = sum(d["summary"]["n"] for d in by_len[length])
                if n_ok < n:
                    partial.append((length + dodge[mode], m, f"{n_ok}/{n} ok"))
            st = STYLE[mode]
            if not all(math.isnan(m) for m in med):
                ax.errorbar(xs, med, yerr=[[0] * len(med), [b - a if b >= a else 0.0 for a, b in zip(med, p90, strict=True)]],
                            color=st["color"], marker=st["marker"], capsize=4, linewidth=1.8,
                            label=f"{st['label']}: median, bar up to p90")
            for x, y, txt in partial:  # a median over the survivors only: say so on the plot
                ax.annotate(txt, (x, y), textcoords="offset points", xytext=(6, -10), fontsize=7, color=st["color"])
            if failed:
                ax.scatter([x + dodge[mode] for x in failed], [floor] * len(failed), marker="x", s=80,
                           color=st["color"], zorder=5, label=f"{st['label']}: failed or skipped")
        ax.set_title(f"offered load {rate:g} QPS (Poisson)")
        ax.set_xlabel("input length (tokens)")
        ax.set_xticks(lengths)
        ax.set_yscale("log")
        plain = mticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    ncol = min(len(handles), min(3, len(rates)))
    nrows = -(-len(handles) // ncol)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=ncol, fontsize=8,
               frameon=False)
    out_tokens = docs[0].get("output_tokens")
    fig.suptitle(f"{title}: one line per mode, one panel per offered rate\n"
                 f"tiny Llama on a 2-core CPU, 1P1D, {out_tokens} output tokens, sweep {_sweep_ids(docs)}{note}",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.02 + 0.045 * nrows, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def _g(v: float | None, nd: int = 1) -> str:
    return "–" if v is None else f"{v:.{nd}f}"


def summary_markdown(docs: list[dict[str, Any]], reuse: Path) -> str:
    """Tables (medians/p90/p99) and the push / pull ratios, as benchmarks/README.md quotes them.

    Only runs of one sweep are set side by side: the kvbaton modes' sweep in the main
    table and the ratios; a mode whose newest runs come from another sweep (the
    NixlConnector baseline after ``--skip-nixl``) gets a table of its own, named by its
    sweep id. The ratios cover every (length, rate) cell, not a chosen one."""
    kv_sweep = next((d["sweep_id"] for d in docs if d["mode"] == "push"), docs[0]["sweep_id"])
    same = [d for d in docs if d["sweep_id"] == kv_sweep]
    other = [d for d in docs if d["sweep_id"] != kv_sweep]
    header = [("| mode | input tok | QPS | n ok/n | TTFT med | TTFT p90 | TTFT p99 | TPOT med | TPOT p90 | E2E med "
               "| E2E p90 | req/s | out tok/s | coalesced | sustained |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    order = {m: i for i, m in enumerate(STYLE)}

    def rows(group: list[dict[str, Any]]) -> list[str]:
        out = []
        for d in sorted(group, key=lambda d: (d["length"], d["rate"], order.get(d["mode"], 9), d["iteration"])):
            s = d["summary"]
            note = "skipped" if d.get("skipped") else ("error" if d.get("error") else ("yes" if s["sustained"] else "no"))
            out.append(f"| {d['mode']} | {d['length']} | {d['rate']:g} | {s['n_ok']}/{s['n']} | {_g(s['ttft_ms_median'])} "
                       f"| {_g(s['ttft_ms_p90'])} | {_g(s['ttft_ms_p99'])} | {_g(s['tpot_ms_median'], 2)} "
                       f"| {_g(s['tpot_ms_p90'], 2)} | {_g(s['e2e_ms_median'])} | {_g(s['e2e_ms_p90'])} "
                       f"| {_g(s['throughput_rps'], 2)} | {_g(s['throughput_output_tok_s'], 0)} | {s.get('n_coalesced', 0)} "
                       f"| {note} |")
        return out

    lines = [f"Sweep {kv_sweep}: {len(same)} runs, {same[0]['output_tokens']} output tokens.", "", *header, *rows(same)]
    if other:
        lines += ["", (f"Not the same run: {_sweep_ids(other)} ({len(other)} runs; another time, another machine load). "
                       "Read it on its own, not cell by cell against the table above:"), "", *header, *rows(other)]
    lines += ["", ("Times in ms. TPOT excludes 'coalesced' streams (all tokens reached the client in one "
                   "burst, TPOT < 0.5 ms: a starved hop, not decode speed). Push / pull in every cell "
                   "(same prompts at the same times; one iteration each):"), "",
              "| input tok | QPS | TTFT push / pull (median) | ratio | TPOT push / pull (median) | ratio | both sustained |",
              "|---:|---:|---:|---:|---:|---:|---|"]
    idx = {(d["mode"], d["length"], d["rate"]): d["summary"] for d in same if d["iteration"] == 0}
    ahead = cells = 0
    for length in sorted({d["length"] for d in same}):
        for r in sorted({d["rate"] for d in same}):
            a, b = idx.get(("push", length, r)), idx.get(("pull", length, r))
            if a is None or b is None:
                continue
            rt = a["ttft_ms_median"] / b["ttft_ms_median"] if a["ttft_ms_median"] and b["ttft_ms_median"] else None
            rp = a["tpot_ms_median"] / b["tpot_ms_median"] if a["tpot_ms_median"] and b["tpot_ms_median"] else None
            cells += 1
            ahead += rt is not None and rt < 1
            lines.append(f"| {length} | {r:g} | {_g(a['ttft_ms_median'])} / {_g(b['ttft_ms_median'])} | {_g(rt, 2)} "
                         f"| {_g(a['tpot_ms_median'], 2)} / {_g(b['tpot_ms_median'], 2)} | {_g(rp, 2)} "
                         f"| {'yes' if a.get('sustained') and b.get('sustained') else 'no'} |")
    lines += ["", f"Push has the lower median TTFT in {ahead} of {cells} cells."]
    lines += ["", ("Where the time goes (kvbaton; medians over requests, ms after the client sent it; "
                   "connector stats files joined by request id):"), "",
              ("| mode | input tok | QPS | P prefill done (hold starts) | KV ready on D | first token at client "
               "| P hold (ms) | D wait for KV (ms) | chunks/req | CPU s/req: P worker | D worker | D engine-core "
               "| routers+cp+client | machine busy |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in sorted(docs, key=lambda d: (d["length"], d["rate"], order.get(d["mode"], 9))):
        if d["mode"] not in ("push", "pull") or not d["records"]:
            continue
        ok = [r for r in d["records"] if r.get("ok")]

        def med(key: str, sub: str | None = "kv", rs: list[dict[str, Any]] = ok) -> float | None:
            xs = sorted(v for r in rs if (v := (r.get(sub) or {}).get(key) if sub else r.get(key)) is not None)
            return xs[len(xs) // 2] if xs else None

        cpu = (d.get("cpu") or {}).get("cpu_s", {})
        n = max(len(d["records"]), 1)
        other = sum(v for k, v in cpu.items() if k.startswith(("router", "control", "client")))
        lines.append(
            f"| {d['mode']} | {d['length']} | {d['rate']:g} | {_g(med('p_hold_start_ms'))} | {_g(med('d_kv_ready_ms'))} "
            f"| {_g(med('ttft_ms', None))} | {_g(med('p_held_ms'))} | {_g(med('d_wait_ms'))} "
            f"| {_g(med('n_chunks', None), 0)} | {_g(cpu.get('prefill:VLLM::Worker', 0) / n, 3)} "
            f"| {_g(cpu.get('decode:VLLM::Worker', 0) / n, 3)} | {_g(cpu.get('decode:VLLM::EngineCor', 0) / n, 3)} "
            f"| {_g(other / n, 3)} | {_g((d.get('cpu') or {}).get('machine_busy_frac'), 2)} |")
    if reuse.exists():
        rd = json.loads(reuse.read_text())
        lines += ["", ("Reuse (benchmarks/results/reuse_turns.json), longest turn; the prefill engine runs with "
                       "prefix caching off (the benchmark's method: without reuse it recomputes the whole history; "
                       "no results file has a prefix-caching-on figure):"), ""]
        for mode, rows in rd.get("modes", {}).items():
            if rows:
                last = rows[-1]
                lines.append(f"- {mode}: {last['prompt_tokens']} prompt tokens ({last['reused_tokens']} reused): "
                             f"TTFT off {last['ttft_off_ms']:.0f} ms / on {last['ttft_on_ms']:.0f} ms = "
                             f"x{last['ttft_off_ms'] / last['ttft_on_ms']:.2f}")
    return "\n".join(lines) + "\n"


def plot_reuse(path: Path, out: Path) -> bool:
    """TTFT per turn vs context length, reuse on vs off, one panel per mode."""
    if not path.exists():
        print(f"no {path}: skipping the reuse plot")
        return False
    doc = json.loads(path.read_text())
    modes = [m for m, rows in doc.get("modes", {}).items() if rows]
    if not modes:
        print(f"{path} has no rows: skipping the reuse plot")
        return False
    fig, axes = plt.subplots(1, len(modes), figsize=(5.8 * len(modes), 4.6), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        rows = doc["modes"][mode]
        x = [r["prompt_tokens"] for r in rows]
        on = [r["ttft_on_ms"] for r in rows]
        off = [r["ttft_off_ms"] for r in rows]
        lo = [min(r.get("ttft_off_all_ms") or [r["ttft_off_ms"]]) for r in rows]
        hi = [max(r.get("ttft_off_all_ms") or [r["ttft_off_ms"]]) for r in rows]
        ax.fill_between(x, lo, hi, color="tab:red", alpha=0.15, label="reuse off: min-max of reps")
        ax.plot(x, off, "s-", color="tab:red", label="reuse off (prefill recomputes history; median)")
        ax.plot(x, on, "o-", color="tab:green", label="reuse on (prefill READs history from decode)")
        for r, xi, yi in zip(rows, x, on, strict=True):
            if r.get("reused_tokens"):
                ax.annotate(f"{r['reused_tokens']}", (xi, yi), textcoords="offset points", xytext=(0, -13),
                            ha="center", fontsize=7, color="tab:green")
        ax.set_title(f"kvbaton {mode} mode (green labels: tokens reused)")
        ax.set_xlabel("context length of the turn (prompt tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    top = max(max(max(r.get("ttft_off_all_ms") or [0]), r["ttft_off_ms"], r["ttft_on_ms"])
              for m in modes for r in doc["modes"][m])
    axes[0][0].set_ylim(0, top * 1.08)  # after plotting: sharey would keep the first panel's limits
    axes[0][0].set_ylabel("TTFT (ms)")
    fig.suptitle(f"TTFT per conversation turn, D→P KV reuse on vs off — tiny Llama, 2-core CPU "
                 f"(+{doc['args'].get('new_tokens')} new tokens per turn, prefix caching off on prefill)",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep-dir", type=Path, default=ROOT / "benchmarks/results/sweep")
    ap.add_argument("--reuse", type=Path, default=ROOT / "benchmarks/results/reuse_turns.json")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--one-sweep", action=argparse.BooleanOptionalAction, default=True,
                    help="figures draw only the kvbaton modes' sweep (default); --no-one-sweep adds modes "
                         "whose newest runs are from another sweep")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    docs = load_sweep(args.sweep_dir)
    if docs:
        # The figures draw one run only: the kvbaton modes' sweep (a mode whose newest runs
        # come from another sweep is in summary.md's separate table, not on these axes).
        kv_sweep = next((d["sweep_id"] for d in docs if d["mode"] == "push"), docs[0]["sweep_id"])
        same = [d for d in docs if d["sweep_id"] == kv_sweep] if args.one_sweep else docs
        plot_metric(same, "ttft_ms", "time to first token (ms, log scale)", "TTFT vs input length",
                    args.out_dir / "ttft_vs_length.png")
        plot_metric(same, "tpot_ms", "time per output token (ms, log scale)", "TPOT vs input length",
                    args.out_dir / "tpot_vs_length.png", note="\n(streams that reached the client in one burst excluded)")
        md = summary_markdown(docs, args.reuse)
        (args.sweep_dir / "summary.md").write_text(md)
        print(md)
    else:
        print(f"no sweep JSONs in {args.sweep_dir}", file=sys.stderr)
    plot_reuse(args.reuse, args.out_dir / "reuse_ttft_per_turn.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
