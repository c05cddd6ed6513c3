"""What a busy engine loop does to the connector's control-plane calls (no vLLM needed).

    .venv/bin/python benchmarks/gil_handoff.py [--calls 60]

The connector sends Offer/Complete from a background thread (``connector/control.py``)
of the engine process while vLLM's engine loop runs Python on the main thread. A gRPC
call needs the GIL several times (loop wake-up, call setup, completion); while the main
thread computes without releasing it, each hand-off waits for a forced switch — up to
``sys.getswitchinterval()`` (5 ms). This starts ``kvbaton serve``, then times unary calls
from a :class:`~kvbaton.connector.control.ControlThread` while the main thread is:

- ``idle``: blocked (nothing to contend with);
- ``spin``: pure-Python work, never releasing the GIL (a busy engine step);
- ``spin+sleep``: the same with a 2 ms sleep per iteration (the connector's idle-step wait);
- ``spin@0.5ms``: spinning, with ``sys.setswitchinterval(0.0005)`` (``gil_switch_interval_ms``).

Prints median / p90 / max per case; writes ``benchmarks/results/gil_handoff.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvbaton.stack.ports import free_port


def run_case(ct: object, case: str, calls: int) -> dict[str, float]:
    import grpc

    from kvbaton.v1 import rendezvous_pb2 as rpb

    stop = threading.Event()
    lat: list[float] = []
    old = sys.getswitchinterval()
    if case == "spin@0.5ms":
        sys.setswitchinterval(0.0005)

    def caller() -> None:
        for i in range(calls):
            t0 = time.monotonic()
            fut = ct.submit(lambda c, i=i: c.call(c.rendezvous.Cancel, rpb.CancelRequest(  # type: ignore[attr-defined]
                transfer_id=f"gil-{case}-{i}", engine_id="bench", reason="gil benchmark")))
            try:
                fut.result(10)
            except grpc.aio.AioRpcError as exc:  # NOT_FOUND is the answer: a full round trip
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            lat.append((time.monotonic() - t0) * 1000)
            time.sleep(0.02)
        stop.set()

    try:
        if case == "idle":
            caller()
        else:
            th = threading.Thread(target=caller)
            th.start()
            x = 0
            while not stop.is_set():
                for i in range(2000):  # ~0.1 ms of pure Python between checks
                    x += i * i
                if case == "spin+sleep":
                    time.sleep(0.002)
            th.join()
    finally:
        sys.setswitchinterval(old)
    lat.sort()
    return {"median_ms": round(statistics.median(lat), 2), "p90_ms": round(lat[int(0.9 * len(lat))], 2),
            "max_ms": round(lat[-1], 2), "calls": len(lat)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gil_handoff.json")
    args = ap.parse_args(argv)

    from kvbaton.connector.control import ControlThread

    port = free_port()
    srv = subprocess.Popen([str(Path(sys.executable).parent / "kvbaton"), "serve", "--insecure", "--listen",
                            f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ct = ControlThread(f"127.0.0.1:{port}")
        fut = ct.submit(lambda c: c.wait_ready(30))
        fut.result(35)
        results = {}
        for case in ("idle", "spin", "spin+sleep", "spin@0.5ms"):
            results[case] = run_case(ct, case, args.calls)
            r = results[case]
            print(f"{case:12} median {r['median_ms']:6.2f} ms  p90 {r['p90_ms']:6.2f} ms  max {r['max_ms']:7.2f} ms",
                  flush=True)
        ct.close()
    finally:
        srv.terminate()
        srv.wait(10)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "cpus": os.cpu_count(), "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
