"""Push vs pull P/D under open-loop load: TTFT, TPOT, end-to-end latency and throughput,
swept over input length and request rate, on real vLLM engines (tiny model, this CPU).

    .venv/bin/python benchmarks/sweep.py            # default sweep, ~12-15 min on 2 cores
    .venv/bin/python benchmarks/sweep.py --quick    # ~3 min smoke version
    .venv/bin/python benchmarks/plot.py             # PNGs from the JSONs

What it does, and why:
- Starts what it needs with :class:`kvbaton.stack.pd_stack.PdStack`: the control plane,
  P (core 0) and D (core 1) with the kvbaton connector, and one router per mode (push,
  pull). Then a second stack with vLLM's own ``NixlConnector`` (pull only) as the
  baseline. The two stacks run one after the other: an idle NixlConnector engine keeps
  a core busy and would distort the other pair.
- Prefix caching is off (``--no-enable-prefix-caching``, passed to both engines because
  PdStack gives both the same extra args): decode must not serve a prompt from its own
  cache instead of receiving it, and since push and pull replay the *same* prompts (same
  seed per length/rate, so the comparison is paired), prefill must not hit the previous
  mode's cache either.
- Load comes from a **separate client process** (``sweep.py client``, spawned per run):
  the load generator's Python threads must not share the GIL with the process that
  starts/owns the stack, and a wedged client can be killed without losing the sweep.
  Arrivals are open-loop Poisson at the given rate (a closed loop would hide queueing:
  a slow system would just be offered less load).
- Per request: TTFT (first streamed token at the client), TPOT = (last token - first
  token) / (tokens - 1) counted in *tokens* (the server's usage count), not chunks,
  end-to-end latency, and the number of chunks (to see token coalescing). For kvbaton
  runs the connector's stats files are joined per request (the request id is sent in the
  body, so vLLM's internal id is ``cmpl-<id>-0-...`` on both engines): when decode got its
  KV, how long prefill held blocks — the timeline used to explain the results.
- Every run has a wall-clock bound; a configuration that fails (e.g. NixlConnector
  stalling) is recorded with its errors and the higher rates of that length are skipped
  for that mode (any failed request does), so a broken baseline cannot eat the time budget.

One JSON file per run in ``benchmarks/results/sweep/`` (``--quick``: ``.../sweep/quick/``):
``{mode}_len{L}_rate{R}_it{I}.json`` with the setup, per-request records and a summary
(median/p90/p99). Stale run files in that directory are removed at the start of a sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.pd_compare import VOCAB_HI, VOCAB_LO, _pct
from kvbaton.stack.pd_stack import PdStack, StreamResult, stream_request

RESULTS = ROOT / "benchmarks" / "results" / "sweep"
COALESCED_TPOT_MS = 0.5  # below this the tokens arrived in one burst (see summarize)
MODEL_NOTE = "kvbaton.tinymodel (2-layer Llama, hidden 256, float32), --enforce-eager, 64 MiB KV, max-num-seqs 16"


# ====================================================================== client process

@dataclasses.dataclass
class ClientSpec:
    """What one client process sends: ``n`` requests of ``length`` tokens at ``rate`` QPS."""

    url: str
    length: int
    rate: float
    n: int
    output_tokens: int
    seed: int
    run_tag: str  # prefix of every request id (unique per run, so stats join unambiguously)
    request_timeout_s: float  # per socket read (a stalled stream raises)
    deadline_s: float  # whole run, from the first arrival: unfinished requests are failures
    warmup: int = 0  # sequential, unrecorded requests before the timed ones


def _prompts_and_arrivals(spec: ClientSpec) -> tuple[list[list[int]], list[float]]:
    """Prompts and Poisson arrival offsets from ``spec.seed`` alone, so push and pull (and
    NixlConnector) get identical prompts at identical times: the comparison is paired."""
    rng = random.Random(spec.seed)
    prompts = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(spec.length)] for _ in range(spec.n)]
    t, arrivals = 0.0, []
    for _ in range(spec.n):
        arrivals.append(t)
        t += rng.expovariate(spec.rate)
    return prompts, arrivals


def run_client(spec: ClientSpec, out: Path) -> None:
    """Open-loop load: one thread per request, each sleeping until its arrival time."""
    from tqdm import tqdm

    url = f"{spec.url}/v1/completions"

    def body(prompt: list[int], rid: str) -> dict[str, Any]:
        return {"model": "tiny", "prompt": prompt, "max_tokens": spec.output_tokens, "temperature": 0.0,
                "ignore_eos": True, "request_id": rid}

    wrng = random.Random(spec.seed + 1_000_003)  # warmup prompts: never equal to timed ones
    for i in range(spec.warmup):
        try:
            stream_request(url, body([wrng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(spec.length)],
                                     f"{spec.run_tag}-w{i}"), timeout_s=spec.request_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failing warmup shows up in the timed requests
            print(f"warmup {i} failed: {exc!r}"[:300], file=sys.stderr)

    prompts, arrivals = _prompts_and_arrivals(spec)
    records: list[dict[str, Any] | None] = [None] * spec.n
    bar = tqdm(total=spec.n, desc=f"  requests {spec.run_tag}", position=1, leave=False, mininterval=1.0,
               file=sys.stderr)
    lock = threading.Lock()
    t0_mono = time.monotonic() + 0.05
    t0_wall = time.time() + 0.05

    def one(i: int) -> None:
        delay = t0_mono + arrivals[i] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        rid = f"{spec.run_tag}-{i}"
        rec: dict[str, Any] = {"i": i, "request_id": rid, "arrival_s": round(arrivals[i], 4),
                               "t_send_wall": time.time(), "ok": False}
        try:
            r: StreamResult = stream_request(url, body(prompts[i], rid), timeout_s=spec.request_timeout_s)
            rec.update(ttft_ms=r.ttft_s * 1000 if r.ttft_s >= 0 else None,
                       tpot_ms=r.tpot_s * 1000 if r.tpot_s is not None else None,
                       e2e_ms=r.total_s * 1000, n_tokens=r.n_tokens, n_chunks=len(r.chunk_times_s))
            if r.n_tokens < spec.output_tokens or r.ttft_s < 0:
                rec["error"] = f"short stream: {r.n_tokens} of {spec.output_tokens} tokens"
            else:
                rec["ok"] = True
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rec["t_end_wall"] = time.time()
        records[i] = rec
        with lock:
            bar.update(1)

    threads = [threading.Thread(target=one, args=(i,), daemon=True, name=f"req-{i}") for i in range(spec.n)]
    for th in threads:
        th.start()
    end = t0_mono + spec.deadline_s
    for th in threads:
        th.join(timeout=max(0.0, end - time.monotonic()))
    bar.close()
    for i, rec in enumerate(records):  # snapshot: a late thread may still write, ignore it
        if rec is None:
            records[i] = {"i": i, "request_id": f"{spec.run_tag}-{i}", "arrival_s": round(arrivals[i], 4),
                          "ok": False, "error": f"not finished within the run deadline ({spec.deadline_s:.0f}s)"}
    out.write_text(json.dumps({"t0_wall": t0_wall, "records": records}))
    sys.stdout.flush()
    os._exit(0)  # daemon threads stuck on a dead server must not keep the process alive


# ====================================================================== parent side

def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Median/p90/p99 of TTFT, TPOT, e2e over the successful requests, and throughput
    (TPOT without coalesced streams, see below).

    Throughput is measured over the window from the first send to the last completion:
    it is what the system delivered, and below the offered rate when it can't keep up."""
    ok = [r for r in records if r.get("ok")]
    out: dict[str, Any] = {"n": len(records), "n_ok": len(ok), "n_failed": len(records) - len(ok),
                           "errors": sorted({r["error"] for r in records if r.get("error")})[:5]}
    # A stream whose 32 tokens reached the client within ~a millisecond was coalesced on the
    # way (a starved router/API server/client flushed them at once): its TPOT of ~0.01 ms
    # says nothing about decode speed, and its TTFT already includes the whole decode. Such
    # requests stay in TTFT/E2E but not in TPOT; how many there were is reported.
    coalesced = [r for r in ok if r.get("tpot_ms") is not None and r["tpot_ms"] < COALESCED_TPOT_MS]
    out["n_coalesced"] = len(coalesced)
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        xs = [r[key] for r in ok if r.get(key) is not None and not (key == "tpot_ms" and r in coalesced)]
        for name, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99)):
            v = _pct(xs, q)
            out[f"{key}_{name}"] = round(v, 3) if v is not None else None
        out[f"{key}_mean"] = round(sum(xs) / len(xs), 3) if xs else None
    if ok:
        t_first = min(r["t_send_wall"] for r in ok)
        t_last = max(r["t_end_wall"] for r in ok)
        window = max(t_last - t_first, 1e-6)
        out["window_s"] = round(window, 3)
        out["throughput_rps"] = round(len(ok) / window, 3)
        out["throughput_output_tok_s"] = round(sum(r["n_tokens"] for r in ok) / window, 1)
        out["chunks_per_request_median"] = _pct([r["n_chunks"] for r in ok], 0.5)
    else:
        out.update(window_s=None, throughput_rps=0.0, throughput_output_tok_s=0.0, chunks_per_request_median=None)
    # "Sustained": nothing failed and the backlog drained: the delivered rate is at least
    # 80% of the ideal n / (arrival span + median latency) of these very arrival times
    # (Poisson spans vary a lot over ~10 requests, so the nominal rate is no yardstick).
    ideal = None
    if ok and out["e2e_ms_median"] is not None:
        span = max(r["arrival_s"] for r in records) - min(r["arrival_s"] for r in records)
        ideal = len(records) / (span + out["e2e_ms_median"] / 1000)
    out["offered_ideal_rps"] = round(ideal, 3) if ideal else None
    out["sustained"] = bool(out["n_failed"] == 0 and ideal and out["throughput_rps"] >= 0.8 * ideal)
    return out


def join_connector_stats(stack: PdStack, records: list[dict[str, Any]], since: dict[str, int]) -> dict[str, Any]:
    """Attach each request's connector events (decode got KV, prefill freed its blocks),
    as milliseconds after the client sent it. vLLM's id is ``cmpl-<request_id>-0-<rand>``."""
    evs = {e: stack.events(e, since=since[e]) for e in ("p0", "d0")}
    by_rid: dict[str, dict[str, Any]] = {}

    def rid_of(ev: dict[str, Any]) -> str | None:
        req = str(ev.get("req_id") or "")
        if not req.startswith("cmpl-"):
            return None
        return req[len("cmpl-"):].rsplit("-0-", 1)[0]

    for eng, lst in evs.items():
        for ev in lst:
            rid = rid_of(ev)
            if rid is None:
                continue
            by_rid.setdefault(rid, {})[f"{eng}_{ev['event']}"] = ev
    counts = {"recv_done": 0, "recv_failed": 0, "send_done": 0, "send_failed": 0, "send_expired": 0, "bytes": 0}
    for lst in evs.values():
        for ev in lst:
            if ev["event"] in counts:
                counts[ev["event"]] += 1
            if ev["event"] == "recv_done":
                counts["bytes"] += int(ev.get("nbytes", 0))
    for rec in records:
        got = by_rid.get(rec["request_id"])
        if not got or "t_send_wall" not in rec:
            continue
        t0 = rec["t_send_wall"]
        kv: dict[str, Any] = {}
        if (d := got.get("d0_recv_done") or got.get("d0_recv_failed")) is not None:
            kv["d_kv_ready_ms"] = round((d["t"] - t0) * 1000, 2)  # decode has the KV (or gave up)
            kv["d_wait_ms"] = round(d.get("duration_s", 0) * 1000, 2)  # from load start to done
            kv["nbytes"] = d.get("nbytes")
            kv["ok"] = d["event"] == "recv_done"
        if (p := got.get("p0_send_done") or got.get("p0_send_failed") or got.get("p0_send_expired")) is not None:
            kv["p_freed_ms"] = round((p["t"] - t0) * 1000, 2)  # prefill's WRITE done / READ acked
            if p.get("held_s") is not None:
                kv["p_held_ms"] = round(p["held_s"] * 1000, 2)
                kv["p_hold_start_ms"] = round((p["t"] - p["held_s"] - t0) * 1000, 2)  # ≈ prefill finished
        rec["kv"] = kv
    return counts


def spawn_client(spec: ClientSpec, work: Path) -> dict[str, Any]:
    """Run one client process; kill it if it outlives the run deadline (+ slack)."""
    spec_path = work / f"{spec.run_tag}.spec.json"
    out_path = work / f"{spec.run_tag}.out.json"
    spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
    cmd = [sys.executable, str(Path(__file__).resolve()), "client", "--spec", str(spec_path), "--out", str(out_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL)
    limit = spec.deadline_s + spec.warmup * spec.request_timeout_s + 60
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.wait(timeout=10)
        raise TimeoutError(f"client process exceeded {limit:.0f}s and was killed") from exc
    if not out_path.exists():
        raise RuntimeError(f"client exited rc={proc.returncode} without results")
    return json.loads(out_path.read_text())


_CLK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds (threads included), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK
    except (OSError, IndexError, ValueError):
        return None


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all cores from /proc/stat."""
    with open("/proc/stat") as fh:
        vals = [int(x) for x in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return float(sum(vals) - idle), float(sum(vals))


def _busy_fraction(sample_s: float = 5.0) -> float:
    """Fraction of all cores busy over ``sample_s`` (immediate, unlike the load average)."""
    a = _machine_cpu()
    time.sleep(sample_s)
    b = _machine_cpu()
    return (b[0] - a[0]) / max(b[1] - a[1], 1.0)


def wait_machine_free(max_wait_s: float, max_busy: float, poll_s: float = 30.0) -> dict[str, Any]:
    """Wait until no vLLM server we didn't start is running (none of ours exist yet) and the
    machine has been nearly idle (< ``max_busy`` of all cores over 5 s) at two polls in a
    row, so another job (engines, a pip install, a benchmark) doesn't share the 2 cores with
    the measurement; one quiet sample between two steps of someone's script is not enough.
    Bounded: after ``max_wait_s`` the sweep runs anyway and every run's JSON says what was
    seen (``machine_free``, ``loadavg_before``, ``cpu.machine_busy_frac``)."""
    t0 = time.monotonic()
    quiet = 0
    while True:
        r = subprocess.run(["pgrep", "-f", "vllm.entrypoints"], check=False, capture_output=True, text=True,
                           timeout=10)
        pids = [p for p in r.stdout.split() if p.strip()]
        busy = _busy_fraction()
        waited = time.monotonic() - t0
        quiet = quiet + 1 if not pids and busy < max_busy else 0
        info = {"waited_s": round(waited, 1), "foreign_vllm_at_start": pids, "busy_frac_at_start": round(busy, 3),
                "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
        if quiet >= 2:
            return info
        if waited >= max_wait_s:
            print(f"warning: machine not free after {waited:.0f}s ({info}); going on", flush=True)
            return info
        print(f"waiting for the machine: foreign vLLM pids {pids}, {busy:.0%} busy, quiet polls {quiet}/2 "
              f"({waited:.0f}s)", flush=True)
        time.sleep(poll_s)


def stack_components(stack: PdStack) -> dict[str, list[int]]:
    """PIDs of every process of the stack, by component: where the CPU goes during a run
    is the profile that explains push vs pull on 2 cores (engine-core/API processes float,
    only the workers' OMP threads are pinned)."""
    from kvbaton.stack.vllm_server import process_group_members

    comps: dict[str, list[int]] = {}
    for name, srv in (("prefill", stack.p), ("decode", stack.d)):
        if srv is not None and srv.pgid is not None:
            for pid in process_group_members(srv.pgid):
                try:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    continue
                comps.setdefault(f"{name}:{comm}", []).append(pid)
    for proc in stack._procs:  # control plane and routers (their logs are named after them)
        log_name = Path(getattr(proc, "args", [""])[0]).name
        label = "control-plane" if log_name == "kvbaton" else f"router-{proc.args[-3]}"
        comps.setdefault(label, []).append(proc.pid)
    return comps


class CpuMeter:
    """CPU seconds used per stack component, and by the machine, between start and stop."""

    def __init__(self, comps: dict[str, list[int]]) -> None:
        self.comps = comps
        self.t0 = time.monotonic()
        self.m0 = _machine_cpu()
        self.c0 = {k: sum(v or 0.0 for v in map(_proc_cpu_s, pids)) for k, pids in comps.items()}
        self.child0 = resource.getrusage(resource.RUSAGE_CHILDREN)

    def stop(self) -> dict[str, Any]:
        m1 = _machine_cpu()
        wall = time.monotonic() - self.t0
        c1 = {k: sum(v or 0.0 for v in map(_proc_cpu_s, pids)) for k, pids in self.comps.items()}
        ch = resource.getrusage(resource.RUSAGE_CHILDREN)
        per = {k: round(c1[k] - self.c0[k], 2) for k in self.comps}
        per["client (load generator)"] = round(ch.ru_utime + ch.ru_stime - self.child0.ru_utime - self.child0.ru_stime, 2)
        busy = (m1[0] - self.m0[0]) / max(m1[1] - self.m0[1], 1.0)
        return {"wall_s": round(wall, 2), "machine_busy_frac": round(busy, 3), "cpu_s": per}


@dataclasses.dataclass
class SweepConfig:
    lengths: list[int]
    rates: list[float]
    duration_s: float  # arrival window per run: n = max(min_requests, rate * duration)
    min_requests: int
    output_tokens: int
    iterations: int
    warmup: int
    request_timeout_s: float
    nixl_lengths: list[int]
    nixl_rates: list[float]
    out_dir: Path
    sweep_id: str
    kvbaton_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # extra_config keys


def run_stack(connector: str, modes: list[str], cfg: SweepConfig, model: Path, work: Path,
              meta: dict[str, Any], runs_bar: Any) -> list[dict[str, Any]]:
    """Start one stack, run every (length, rate, iteration, mode) on it, stop it.

    Modes alternate inside each (length, rate) so slow drift of the shared VM hits push and
    pull alike. A mode that fails at some rate skips the higher rates of that length."""
    written: list[dict[str, Any]] = []
    lengths = cfg.lengths if connector == "kvbaton" else cfg.nixl_lengths
    rates = cfg.rates if connector == "kvbaton" else cfg.nixl_rates
    names = {"push": "push", "pull": "pull"} if connector == "kvbaton" else {"pull": "nixl-pull"}
    t0 = time.monotonic()
    stack_info: dict[str, Any] = {"connector": connector}
    try:
        with PdStack(model, work / connector, connector=connector, router_modes=modes, timeout_s=20.0,
                     engine_args=["--no-enable-prefix-caching"], startup_timeout_s=600.0,
                     extra_config=cfg.kvbaton_config if connector == "kvbaton" else None) as stack:
            stack_info["startup_s"] = round(time.monotonic() - t0, 1)
            stack_info["workdir"] = str(work / connector)
            print(f"{connector} stack up in {stack_info['startup_s']:.0f}s (logs: {work / connector})", flush=True)
            broken: set[tuple[str, int]] = set()
            comps = stack_components(stack)
            idle = CpuMeter(comps)  # baseline: what the idle stack burns (busy-polling shows here)
            time.sleep(5.0)
            stack_info["idle_cpu"] = idle.stop()
            print(f"idle {connector} stack, 5 s: {stack_info['idle_cpu']}", flush=True)
            for length in lengths:
                for rate in rates:
                    for it in range(cfg.iterations):
                        for mode in modes:
                            name = names[mode]
                            n = max(cfg.min_requests, round(rate * cfg.duration_s))
                            if (name, length) in broken:
                                doc = _run_doc(name, length, rate, it, cfg, meta, stack_info, [],
                                               skipped="requests failed at a lower rate of this length")
                                written.append(_write(doc, cfg))
                                runs_bar.update(1)
                                continue
                            tag = f"{cfg.sweep_id}-{name}-l{length}-r{rate:g}-i{it}"
                            first = rate == rates[0] and it == 0
                            spec = ClientSpec(url=stack.routers[mode], length=length, rate=rate, n=n,
                                              output_tokens=cfg.output_tokens,
                                              seed=length * 100_000 + round(rate * 100) * 10 + it,
                                              run_tag=tag, request_timeout_s=cfg.request_timeout_s,
                                              deadline_s=n / rate + 2 * cfg.request_timeout_s,
                                              warmup=cfg.warmup if first else 1)
                            since = {e: stack.event_count(e) for e in ("p0", "d0")} if connector == "kvbaton" else {}
                            load0 = os.getloadavg()
                            t_run = time.monotonic()
                            meter = CpuMeter(comps)
                            try:
                                res = spawn_client(spec, work)
                                records = res["records"]
                                err = None
                            except Exception as exc:  # noqa: BLE001 - recorded
                                records, err = [], f"{type(exc).__name__}: {exc}"
                            cpu = meter.stop()
                            counts = join_connector_stats(stack, records, since) if connector == "kvbaton" else None
                            doc = _run_doc(name, length, rate, it, cfg, meta, stack_info, records, error=err)
                            doc["loadavg_before"] = [round(x, 2) for x in load0]
                            doc["wall_s"] = round(time.monotonic() - t_run, 1)
                            doc["cpu"] = cpu
                            if counts is not None:
                                doc["connector_events"] = counts
                            written.append(_write(doc, cfg))
                            s = doc["summary"]
                            runs_bar.write(
                                f"{name:>9} len {length:>5} rate {rate:>4g}: TTFT med {_f(s['ttft_ms_median'])} "
                                f"p90 {_f(s['ttft_ms_p90'])} ms, TPOT med {_f(s['tpot_ms_median'])} ms, "
                                f"{s['throughput_rps']} req/s, {s['n_ok']}/{s['n']} ok"
                                f"{'' if s['sustained'] else '  NOT SUSTAINED'} ({doc['wall_s']:.0f}s)")
                            runs_bar.update(1)
                            if s["n_failed"] > 0:  # timeouts only get worse at higher rates: save the budget
                                broken.add((name, length))
    except Exception as exc:  # noqa: BLE001 - e.g. NixlConnector failing to start: recorded
        msg = f"{type(exc).__name__}: {exc}"
        print(f"{connector} stack FAILED: {msg[:2000]}", flush=True)
        traceback.print_exc()
        done = {(d["mode"], d["length"], d["rate"], d["iteration"]) for d in written}
        for length in lengths:
            for rate in rates:
                for it in range(cfg.iterations):
                    for mode in modes:
                        if (names[mode], length, rate, it) not in done:
                            doc = _run_doc(names[mode], length, rate, it, cfg, meta, stack_info, [],
                                           error=f"stack failed: {msg[:3000]}")
                            written.append(_write(doc, cfg))
                            runs_bar.update(1)
    return written


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _run_doc(mode: str, length: int, rate: float, it: int, cfg: SweepConfig, meta: dict[str, Any],
             stack_info: dict[str, Any], records: list[dict[str, Any]], *, error: str | None = None,
             skipped: str | None = None) -> dict[str, Any]:
    summary = summarize(records)
    if error or skipped:
        summary["sustained"] = False
    return {"benchmark": "sweep", "sweep_id": cfg.sweep_id, "mode": mode, "length": length, "rate": rate,
            "iteration": it, "output_tokens": cfg.output_tokens, "error": error, "skipped": skipped,
            "summary": summary, "stack": dict(stack_info), "meta": meta, "records": records}


def _write(doc: dict[str, Any], cfg: SweepConfig) -> dict[str, Any]:
    path = cfg.out_dir / f"{doc['mode']}_len{doc['length']}_rate{doc['rate']:g}_it{doc['iteration']}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def print_table(docs: list[dict[str, Any]]) -> None:
    """Medians/p90 per run, the same numbers benchmarks/README.md tabulates."""
    print(f"\n{'mode':<10}{'len':>6}{'QPS':>5}{'TTFT med':>10}{'p90':>9}{'p99':>9}{'TPOT med':>10}{'p90':>8}"
          f"{'E2E med':>9}{'req/s':>7}{'ok/n':>8}  note")
    for d in sorted(docs, key=lambda d: (d["length"], d["rate"], d["mode"], d["iteration"])):
        s = d["summary"]
        note = d.get("skipped") or (d.get("error") or "")[:60] or ("" if s["sustained"] else "not sustained")
        print(f"{d['mode']:<10}{d['length']:>6}{d['rate']:>5g}{_f(s['ttft_ms_median']):>10}{_f(s['ttft_ms_p90']):>9}"
              f"{_f(s['ttft_ms_p99']):>9}{_f(s['tpot_ms_median']):>10}{_f(s['tpot_ms_p90']):>8}"
              f"{_f(s['e2e_ms_median']):>9}{s['throughput_rps']:>7}{s['n_ok']:>4}/{s['n']:<3}  {note}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "client":
        cp = argparse.ArgumentParser()
        cp.add_argument("--spec", type=Path, required=True)
        cp.add_argument("--out", type=Path, required=True)
        a = cp.parse_args(argv[1:])
        run_client(ClientSpec(**json.loads(a.spec.read_text())), a.out)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~3 min: lengths 256 1024, rate 2, 5 s per run, "
                    "NixlConnector at 256 only; JSONs in results/sweep/quick/")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="offered QPS (Poisson)")
    ap.add_argument("--duration", type=float, default=8.0, help="arrival window per run, s")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2, help="unrecorded requests before each mode/length")
    ap.add_argument("--request-timeout", type=float, default=30.0, help="per socket read (stall), s")
    ap.add_argument("--nixl-lengths", type=int, nargs="*", default=None, help="default: --lengths")
    ap.add_argument("--nixl-rates", type=float, nargs="*", default=None, help="default: --rates")
    ap.add_argument("--skip-nixl", action="store_true")
    ap.add_argument("--skip-kvbaton", action="store_true")
    ap.add_argument("--wait-free", type=float, default=1200.0,
                    help="wait up to this many s for foreign vLLM servers to exit before starting")
    ap.add_argument("--max-busy", type=float, default=0.25,
                    help="...and for the machine to be below this busy fraction at 2 polls in a row")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--kvbaton-config", type=json.loads, default={},
                    help='more kv_connector_extra_config keys for the kvbaton engines, as JSON '
                         '(e.g. \'{"idle_step_wait_ms": 0}\')')
    ap.add_argument("--baselines-only", action="store_true",
                    help="run only vLLM's NixlPushConnector and bidirectional_kv_xfer baselines (one request "
                    "at a time, strict timeouts; benchmarks/vllm_baselines.py) -> results/sweep/vllm_baselines.json")
    ap.add_argument("--baseline-lengths", type=int, nargs="+", default=[256, 1024], help="push input lengths")
    ap.add_argument("--baseline-n", type=int, default=8, help="push requests per length")
    ap.add_argument("--baseline-timeout", type=float, default=30.0, help="per push request (both legs), s")
    ap.add_argument("--bidir-length", type=int, default=1024, help="first-turn prompt tokens")
    ap.add_argument("--bidir-turns", type=int, default=3)
    ap.add_argument("--bidir-timeout", type=float, default=60.0, help="per conversation turn, s")
    args = ap.parse_args(argv)
    if args.baselines_only:
        return _baselines_main(args, argv)
    if args.quick:
        args.lengths, args.rates, args.duration, args.min_requests, args.warmup = [256, 1024], [2.0], 5.0, 6, 1
        args.nixl_lengths = args.nixl_lengths or [256]
        args.nixl_rates = args.nixl_rates or [2.0]
    out_dir = args.out_dir or (RESULTS / "quick" if args.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*_len*_rate*_it*.json"):
        stale.unlink()

    from tqdm import tqdm

    from kvbaton.tinymodel import ensure_tiny_model

    cfg = SweepConfig(lengths=args.lengths, rates=args.rates, duration_s=args.duration, min_requests=args.min_requests,
                      output_tokens=args.output_tokens, iterations=args.iterations, warmup=args.warmup,
                      request_timeout_s=args.request_timeout,
                      nixl_lengths=args.lengths if args.nixl_lengths is None else args.nixl_lengths,
                      nixl_rates=args.rates if args.nixl_rates is None else args.nixl_rates,
                      out_dir=out_dir, sweep_id=time.strftime("%Y%m%dT%H%M%S"),
                      kvbaton_config=dict(args.kvbaton_config))
    t0 = time.monotonic()
    free = wait_machine_free(args.wait_free, args.max_busy)
    meta = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                        "note": "shared 2-core VM: noisy; P worker core 0, D worker core 1"},
            "model": MODEL_NOTE, "engine_args_extra": ["--no-enable-prefix-caching"], "machine_free": free,
            "quick": args.quick, "command": " ".join([Path(sys.argv[0]).name, *argv])}
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", ROOT / ".cache/tiny-model")))
    work = Path(tempfile.mkdtemp(prefix="kvbaton-sweep-"))
    stacks: list[tuple[str, list[str]]] = []
    if not args.skip_kvbaton:
        stacks.append(("kvbaton", ["push", "pull"]))
    if not args.skip_nixl:
        stacks.append(("nixl", ["pull"]))
    total = sum(len(cfg.lengths if c == "kvbaton" else cfg.nixl_lengths)
                * len(cfg.rates if c == "kvbaton" else cfg.nixl_rates) * cfg.iterations * len(m) for c, m in stacks)
    docs: list[dict[str, Any]] = []
    with tqdm(total=total, desc="runs", position=0, mininterval=1.0) as bar:
        for connector, modes in stacks:
            docs += run_stack(connector, modes, cfg, model, work, meta, bar)
    print_table(docs)
    runtime = time.monotonic() - t0
    (out_dir / "sweep_meta.json").write_text(json.dumps(
        {"sweep_id": cfg.sweep_id, "runtime_s": round(runtime, 1), "workdir": str(work), "meta": meta,
         "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
         "runs": len(docs)}, indent=1) + "\n")
    print(f"\n{runtime:.0f}s; {len(docs)} JSON files in {out_dir}; logs and stats in {work}")
    return 0


def _baselines_main(args: argparse.Namespace, argv: list[str]) -> int:
    """``--baselines-only``: its own step, not part of the default sweep, because both
    connectors hung or froze here before and must not put the sweep's budget at risk."""
    from benchmarks.vllm_baselines import print_baselines, run_baselines
    from kvbaton.tinymodel import ensure_tiny_model

    out = (args.out_dir or RESULTS) / "vllm_baselines.json"
    free = wait_machine_free(args.wait_free, args.max_busy)
    meta = {"cpus": os.cpu_count(), "platform": platform.platform(), "model": MODEL_NOTE,
            "engine_args_extra": ["--no-enable-prefix-caching"], "machine_free": free,
            "command": " ".join([Path(sys.argv[0]).name, *argv]), "started": time.strftime("%Y%m%dT%H%M%S")}
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", ROOT / ".cache/tiny-model")))
    work = Path(tempfile.mkdtemp(prefix="kvbaton-baselines-"))
    doc = run_baselines(model, work, out, meta, push_lengths=args.baseline_lengths, push_n=args.baseline_n,
                        push_timeout_s=args.baseline_timeout, bidir_length=args.bidir_length,
                        bidir_turns=args.bidir_turns, bidir_timeout_s=args.bidir_timeout,
                        output_tokens=args.output_tokens)
    print_baselines(doc)
    print(f"\n{doc['runtime_s']:.0f}s; {out}; logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
