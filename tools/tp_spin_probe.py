"""Issue 14: who holds the 2 cores while a P2 -> D2 transfer is pending.

Starts a P/D stack at the TP sizes given (default 2 -> 2, the shipped connector settings plus
``KVBATON_TP_EXTRA`` JSON), warms both engines up, then sends routed requests in the mode given
and, while each is pending, samples every engine process's threads at once: CPU seconds
per second over ``--window`` s, the busiest threads by name, and (``--pyspy``) a ``py-spy dump``
of each rank (first request only). Prints each request's status and wall time, then the connector's ``idle_stats``
lines. Heavy: run under ``flock /tmp/kvbaton-heavy.lock``.

Usage: python tools/tp_spin_probe.py [--prefill-tp 2] [--decode-tp 2] [--mode push] [--requests 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from kvbaton.stack.pd_stack import PdStack, completion_body, post_json, token_ids
from kvbaton.tinymodel import ensure_tiny_model


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def _engine_procs(st: PdStack) -> list[tuple[str, psutil.Process]]:
    out = []
    for role, srv in zip("PD", st.engines()):
        assert srv.proc is not None
        root = psutil.Process(srv.proc.pid)
        for pr in [root, *root.children(recursive=True)]:
            try:
                out.append((role, pr))
            except psutil.Error:
                continue
    return out


def _cpu(pr: psutil.Process) -> dict[int, float]:
    try:
        return {t.id: t.user_time + t.system_time for t in pr.threads()}
    except psutil.Error:
        return {}


def sample(st: PdStack, window: float, pyspy: bool, delay: float) -> None:
    time.sleep(delay)
    procs = _engine_procs(st)
    before = {pr.pid: _cpu(pr) for _, pr in procs}
    t0 = time.monotonic()
    time.sleep(window)
    dt = time.monotonic() - t0
    total = 0.0
    for role, pr in procs:
        after = _cpu(pr)
        b = before.get(pr.pid, {})
        busy = sorted(((after[t] - b.get(t, 0.0)) / dt, t) for t in after)
        s = sum(c for c, _ in busy)
        total += s
        try:
            name = pr.name()
        except psutil.Error:
            name = "?"
        print(f"CPU {role} {pr.pid} {name}: {s:.2f} core; top "
              f"{[(round(c, 2), _comm(pr.pid, t)) for c, t in busy[-4:][::-1]]}", flush=True)
    print(f"CPU all engine processes: {total:.2f} cores over {dt:.1f} s; loadavg {os.getloadavg()}", flush=True)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if pyspy and Path(spy).exists():
        for role, pr in procs:
            try:
                if "Worker" not in pr.name() and "EngineCore" not in pr.name():
                    continue
            except psutil.Error:
                continue
            r = subprocess.run([spy, "dump", "-p", str(pr.pid)], capture_output=True, text=True, timeout=30)
            print(f"PYSPY {role} {pr.pid}\n{r.stdout[-3000:]}{r.stderr[-500:]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=2)
    ap.add_argument("--mode", default="push")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--delay", type=float, default=1.0, help="s after the first request before sampling")
    ap.add_argument("--pyspy", action="store_true")
    ap.add_argument("--work", default="/tmp/kvbaton-tp-spin")
    a = ap.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    model = ensure_tiny_model(Path("/tmp/kvbaton-tiny-model"))
    extra = json.loads(os.environ.get("KVBATON_TP_EXTRA", "{}"))
    t0 = time.monotonic()
    with PdStack(model, work, timeout_s=30, prefill_tp=a.prefill_tp, decode_tp=a.decode_tp, router_control_plane=True,
                 prefill_args=["--no-enable-prefix-caching"], engine_env={"OMP_WAIT_POLICY": "PASSIVE"},
                 engine_nice=5, extra_config=extra) as st:
        print(f"up {time.monotonic() - t0:.1f} s; extra {extra}", flush=True)
        for srv in st.engines():
            srv.post_json("/v1/completions", completion_body(token_ids(1, 200), 4))
        for i in range(a.requests):
            th = threading.Thread(target=sample, args=(st, a.window, a.pyspy and i == 0, a.delay))
            th.start()
            t = time.monotonic()
            status, raw = post_json(f"{st.routers[a.mode]}/v1/completions", completion_body(token_ids(50 + i, 300)),
                                    timeout_s=120)
            print(f"request {i} {a.mode}: {status} in {time.monotonic() - t:.2f} s", flush=True)
            th.join()
        d = st.decode_id
        print("recv_done", len(st.events(d, "recv_done")), "recv_failed",
              [e.get("reason", "")[:160] for e in st.events(d, "recv_failed")], flush=True)
        for eng in (st.prefill_id, d):
            waits = st.events(eng, "idle_wait", part="scheduler")
            by: dict[str, list[float]] = {}
            for e in waits:
                by.setdefault(e["reason"], []).append(e["waited_ms"])
            print(f"idle_wait {eng}: " + ", ".join(f"{r} x{len(v)} (max {max(v):.0f} ms, sum {sum(v):.0f} ms)"
                                                  for r, v in sorted(by.items())), flush=True)
        print("send_failed/expired", [(e.get("event"), e.get("reason", "")[:160]) for e in
                                      st.events(st.prefill_id, "send_expired") + st.events(st.prefill_id, "send_failed")],
              flush=True)


if __name__ == "__main__":
    main()
