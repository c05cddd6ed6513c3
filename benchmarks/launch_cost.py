"""CPU time of the receiver's per-chunk steps on CUDA (one staged chunk of the Qwen3-32B-shaped
cache: 2 regions × 1024 blocks × 32 KiB = 64 MiB), with the GPU idle and while another process
keeps it busy: where a chunk's ~150 µs of scatter launch goes (datapath_gpu trace).

Each step is timed alone (median µs of CPU over ``--samples`` calls; the GPU is drained
between calls, outside the timed part).

  python3 benchmarks/launch_cost.py --out benchmarks/results/launch_cost_h200x1.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _steps() -> dict[str, Callable[[], Any]]:
    import torch

    from kvbaton.connector import wire
    from kvbaton.connector.transfer.geometry import KvLayout
    from kvbaton.connector.transfer.staging import GpuRowCopier, region_byte_views, region_groups, unpack_blocks

    n = 1024
    cache = [torch.zeros((2, n, 16, 8, 128), dtype=torch.bfloat16, device="cuda") for _ in range(64)]
    lay = KvLayout.from_tensors(cache, 16)
    views = region_byte_views(cache, lay)
    copier = GpuRowCopier(cache, lay)
    s = torch.cuda.Stream()
    src = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    ids = torch.randperm(n, device="cuda")
    chunk = wire.encode(wire.StagedChunk("x-123456789", 1, 7, 64, 4, 6, 0, 1024))
    ev = torch.cuda.Event()
    ev.record(s)

    def stream_ctx() -> None:
        with torch.cuda.stream(s):
            pass

    def index_copy2() -> None:
        with torch.cuda.stream(s):
            unpack_blocks(views[4:6], ids, src)

    merged = region_groups(views[4:6])

    def index_copy_merged() -> None:
        with torch.cuda.stream(s):
            unpack_blocks(views[4:6], ids, src, merged)

    def triton_scatter() -> None:
        with torch.cuda.stream(s):
            copier.scatter(ids, 4, 6, src)

    def event_record() -> None:
        e = torch.cuda.Event()
        e.record(s)

    def event_query() -> None:
        ev.query()

    def ids_slice() -> None:
        ids[0:1024]

    def wire_chunk() -> None:
        wire.decode(chunk)

    def wire_ack() -> None:
        wire.encode(wire.StagedAck("x-123456789", 1, 7, True))

    def start_unpack_like() -> None:
        with torch.cuda.stream(s):
            i = ids[0:1024]
            unpack_blocks(views[4:6], i, src)
            e = torch.cuda.Event()
            e.record(s)

    return {f.__name__: f for f in (stream_ctx, index_copy2, index_copy_merged, triton_scatter, event_record, event_query,
                                    ids_slice, wire_chunk, wire_ack, start_unpack_like)}


def _measure(samples: int) -> dict[str, float]:
    import torch
    out = {}
    for name, f in _steps().items():
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        ts = []
        for _ in range(samples):
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        out[name] = round(statistics.median(ts), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--commit", default="")
    p.add_argument("--out", default="benchmarks/results/launch_cost.json")
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 0
    from gpu_timeslice import busy_gpu
    rows = [dict(other="idle", **_measure(args.samples))]
    print(rows[-1], flush=True)
    with busy_gpu(64):
        rows.append(dict(other="another process copying 64 MiB per kernel", **_measure(args.samples)))
    print(rows[-1], flush=True)
    res = {"gpu": torch.cuda.get_device_name(0), "commit": args.commit, "samples": args.samples,
           "config": {"samples": args.samples, "chunk": "2 regions x 1024 blocks x 32 KiB (64 MiB)",
                      "busy_other": "64 MiB copies per kernel"},
           "unit": "median µs of CPU per call", "rows": rows}
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
