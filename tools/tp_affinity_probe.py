"""Issue 14: during a routed P2 -> D1 push on the 2-core VM, print each engine process's thread CPU
affinities and its three busiest threads (CPU seconds per second over 2 s).

Found with it (2026-12-02): every thread of a TP rank (kvbaton control and transfer threads
included) is pinned to the rank's one core, and the ranks' main threads spin at 0.6-0.9 core
while the push is pending. Heavy: run under ``flock /tmp/kvbaton-heavy.lock``.
Usage: python tools/tp_affinity_probe.py [WORKDIR]
"""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from kvbaton.stack.pd_stack import PdStack, completion_body, post_json, token_ids
from kvbaton.tinymodel import ensure_tiny_model


def thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def snapshot(st: PdStack) -> None:
    time.sleep(4)
    for role, srv in zip("PD", st.engines()):
        assert srv.proc is not None
        root = psutil.Process(srv.proc.pid)
        for pr in [root, *root.children(recursive=True)]:
            try:
                name = pr.name()
                before = {t.id: t.user_time + t.system_time for t in pr.threads()}
            except psutil.Error:
                continue
            if "VLLM" not in name:
                continue
            aff: dict[str, int] = {}
            for tid in before:
                try:
                    key = str(sorted(os.sched_getaffinity(tid)))
                except OSError:
                    continue
                aff[key] = aff.get(key, 0) + 1
            time.sleep(2)
            after = {t.id: t.user_time + t.system_time for t in pr.threads()}
            busy = sorted(((after[t] - before.get(t, 0.0)) / 2, t) for t in after)[-3:]
            print("AFF", role, pr.pid, name, aff, flush=True)
            print("BUSY", role, pr.pid, name, [(round(c, 2), thread_name(pr.pid, t)) for c, t in busy], flush=True)


def main() -> None:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvbaton-tp-affinity")
    model = ensure_tiny_model(Path("/tmp/kvbaton-tiny-model"))
    subprocess.run(["rm", "-rf", str(work)], check=False)
    t0 = time.monotonic()
    with PdStack(model, work, timeout_s=30, prefill_tp=2, decode_tp=1, router_control_plane=True,
                 prefill_args=["--no-enable-prefix-caching"], engine_env={"OMP_WAIT_POLICY": "PASSIVE"},
                 engine_nice=5) as st:
        print("up", round(time.monotonic() - t0, 1), flush=True)
        for srv in st.engines():
            srv.post_json("/v1/completions", completion_body(token_ids(1, 200), 4))
        th = threading.Thread(target=snapshot, args=(st,))
        th.start()
        t = time.monotonic()
        status, _ = post_json(f"{st.routers['push']}/v1/completions", completion_body(token_ids(50, 300)), timeout_s=120)
        print("push", status, round(time.monotonic() - t, 2), flush=True)
        th.join()


if __name__ == "__main__":
    main()
