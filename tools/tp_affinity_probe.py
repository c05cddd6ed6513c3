"""Issue 14: during a routed P2->D1 push on the 2-core VM, print each engine process's thread CPU
affinities and its busiest threads (2 s of CPU time). Heavy: run under flock /tmp/kvbaton-heavy.lock."""
import json, os, random, subprocess, sys, threading, time
from pathlib import Path
import psutil
from kvbaton.stack.pd_stack import PdStack, post_json
from kvbaton.tinymodel import ensure_tiny_model
def ids(seed, n):
    r = random.Random(seed); return [r.randrange(10, 4000) for _ in range(n)]
def body(p, n=24):
    return {"model": "tiny", "prompt": p, "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
def procs(srv):
    root = psutil.Process(srv.proc.pid); return [root, *root.children(recursive=True)]
def snap(st):
    time.sleep(4)
    for nm, srv in zip("PD", st.engines()):
        for pr in procs(srv):
            try: pn = pr.name()
            except Exception: continue
            if "VLLM" not in pn: continue
            a = {}
            for t in pr.threads():
                try: a.setdefault(str(sorted(os.sched_getaffinity(t.id))), []).append(t.id)
                except Exception: pass
            print("AFF", nm, pr.pid, pn, {k: len(v) for k, v in a.items()}, flush=True)
            ts = {t.id: t.user_time + t.system_time for t in pr.threads()}
            time.sleep(2)
            ts2 = {t.id: t.user_time + t.system_time for t in pr.threads()}
            busy = sorted(((ts2[k] - ts.get(k, 0)) / 2, k) for k in ts2)[-3:]
            names = {}
            for _, tid in busy:
                try: names[tid] = open(f"/proc/{pr.pid}/task/{tid}/comm").read().strip()
                except Exception: names[tid] = "?"
            print("BUSY", nm, pr.pid, pn, [(round(c, 2), names[t]) for c, t in busy], flush=True)
def main():
    model = ensure_tiny_model(Path("/tmp/kvbaton-tiny-model"))
    work = Path("/tmp/i14nice/w5"); subprocess.run(["rm", "-rf", str(work)])
    t0 = time.monotonic()
    with PdStack(model, work, timeout_s=30, prefill_tp=2, decode_tp=1, router_control_plane=True,
                 prefill_args=["--no-enable-prefix-caching"], engine_env={"OMP_WAIT_POLICY": "PASSIVE"}, engine_nice=5) as st:
        print("up", round(time.monotonic() - t0, 1), flush=True)
        p, d = st.engines()
        for srv in (p, d):
            t = time.monotonic(); srv.post_json("/v1/completions", body(ids(1, 200), 4)); print("warm", round(time.monotonic()-t, 2))
        th = threading.Thread(target=snap, args=(st,)); th.start()
        t = time.monotonic()
        status, raw = post_json(f"{st.routers['push']}/v1/completions", body(ids(50, 300)), timeout_s=120)
        print("ROUND push", status, round(time.monotonic() - t, 2), flush=True); th.join()
main()
