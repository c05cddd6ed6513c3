"""Probe a TP-2 prefill + TP-1 decode stack (issue 14): time direct requests to each engine, then
one push and one pull through the routers, with a `top` snapshot and a py-spy dump of the control
plane 4 s into each routed request, and print both engines' connector stats lines.

Why: on the 2-core VM a direct request to the TP-2 prefill took 0.2 s but a routed one ~30 s
(decode's push wait timed out; the pull landed per rank, slowly), with the control plane idle
in that window. Heavy: run under ``flock /tmp/kvbaton-heavy.lock``.
Usage: python tools/tp_probe.py [NICE] [WORKDIR]
"""
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from kvbaton.stack.pd_stack import PdStack, post_json
from kvbaton.tinymodel import ensure_tiny_model


def ids(seed: int, n: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(10, 4000) for _ in range(n)]


def body(p: list[int], n: int = 24) -> dict:
    return {"model": "tiny", "prompt": p, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}


def timed(srv: Any, prompt: list[int]) -> float:
    t = time.monotonic()
    srv.post_json("/v1/completions", body(prompt))
    return round(time.monotonic() - t, 2)


def snapshot(st: PdStack) -> None:
    """4 s into a routed request: who has the CPU, and what the control plane is doing."""
    time.sleep(4)
    print(subprocess.run(["top", "-b", "-n1", "-w", "200"], capture_output=True, text=True).stdout[:4000], flush=True)
    spy = str(Path(sys.executable).parent / "py-spy")
    for proc in st._cps:
        cp = psutil.Process(proc.pid)
        out = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=30)
        print("=== control plane", proc.pid, "cpu %", cp.cpu_percent(1.0), "\n", out.stdout[:5000], flush=True)


def main() -> None:
    nice = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    work = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/kvbaton-tp-probe")
    model = ensure_tiny_model(Path("/tmp/kvbaton-tiny-model"))
    subprocess.run(["rm", "-rf", str(work)], check=False)
    t0 = time.monotonic()
    with PdStack(model, work, timeout_s=30, prefill_tp=2, decode_tp=1, router_control_plane=True,
                 prefill_args=["--no-enable-prefix-caching"], engine_nice=nice) as st:
        print("up", round(time.monotonic() - t0, 1), flush=True)
        p, d = st.engines()
        for i in range(3):
            print("direct P", timed(p, ids(i, 300)), flush=True)
        for i in range(2):
            print("direct D", timed(d, ids(i, 300)), flush=True)
        for mode in ("push", "pull"):
            th = threading.Thread(target=snapshot, args=(st,))
            th.start()
            t = time.monotonic()
            status, raw = post_json(f"{st.routers[mode]}/v1/completions", body(ids(50, 300)), timeout_s=120)
            print(mode, status, round(time.monotonic() - t, 2), flush=True)
            th.join()
        keep = ("nbytes", "write_nbytes", "reason", "error", "held_s", "duration_s")
        for e in ("p0", "d0"):
            for ev in st.events(e):
                print(e, ev.get("tp_rank"), ev["event"], {k: v for k, v in ev.items() if k in keep}, flush=True)
        print("leadership lost:", (work / "cp.log").read_text().count("leadership lost"))


if __name__ == "__main__":
    main()
