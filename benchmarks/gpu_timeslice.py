"""How long a small kernel in one process waits while another process keeps the same GPU
busy (the one-GPU benchmark's two engines share one H200; without MPS the GPU time-slices
between their contexts instead of running their kernels side by side).

Process B launches a small copy (16 MiB, ~20 µs of GPU time) and polls its event; we record
launch → seen done, first with process A idle, then while A keeps a stream of kernels
(copies of ``--busy-mib`` each) queued. Results (median / p90 µs) go to ``--out``.

  python3 benchmarks/gpu_timeslice.py --out benchmarks/results/gpu_timeslice_h200x1.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any


def _busy(dev: int, mib: int, go: Any, stop: Any) -> None:
    import torch
    torch.cuda.set_device(dev)
    a = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    torch.cuda.synchronize()
    go.set()
    while not stop.is_set():
        for _ in range(8):
            b.copy_(a)
        torch.cuda.synchronize()


@contextlib.contextmanager
def busy_gpu(mib: int, dev: int = 0) -> Iterator[None]:
    """Another process keeps GPU ``dev`` busy with ``mib`` MiB copies while the block runs."""
    ctx = mp.get_context("spawn")
    go, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_busy, args=(dev, mib, go, stop), daemon=True)
    proc.start()
    go.wait(60)
    try:
        yield
    finally:
        stop.set()
        proc.join(30)


def _probe(n: int, mib: int) -> dict[str, float]:
    import torch
    a = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    lat, gpu = [], []
    for _ in range(n):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        b.copy_(a)
        e1.record()
        while not e1.query():
            pass
        lat.append((time.perf_counter() - t0) * 1e6)
        gpu.append(e0.elapsed_time(e1) * 1e3)
        time.sleep(200e-6)
    lat.sort()
    return {"seen_median_us": round(statistics.median(lat), 1), "seen_p90_us": round(lat[int(0.9 * n)], 1),
            "gpu_median_us": round(statistics.median(gpu), 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--probe-mib", type=int, default=16)
    p.add_argument("--busy-mib", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--commit", default="")
    p.add_argument("--out", default="benchmarks/results/gpu_timeslice.json")
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    rows = [dict(other="idle", **_probe(args.samples, args.probe_mib))]
    print(rows[-1], flush=True)
    for mib in args.busy_mib:
        with busy_gpu(mib):
            rows.append(dict(other=f"another process copying {mib} MiB per kernel",
                             **_probe(args.samples, args.probe_mib)))
        print(rows[-1], flush=True)
    out = {"gpu": torch.cuda.get_device_name(0), "commit": args.commit, "probe_mib": args.probe_mib,
           "samples": args.samples, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
