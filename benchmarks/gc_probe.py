"""Runs a server entry point with its garbage collections recorded: the benchmark's probe.

Why: ``benchmarks/control_plane.py`` measures a server from outside (CPU from /proc,
latency at the client); a stall in its latencies may be the collector's pass, the
machine's other load, or the server's own work. This wrapper times every collection of
the server process (``gc.callbacks``: CPU time of the pass, wall time, generation, a
``CLOCK_MONOTONIC`` timestamp comparable with the benchmark's ``time.perf_counter``) and
writes them as JSON to ``$KVBATON_GC_PROBE_OUT`` when the server exits, so each point
can report its collections beside its p99 and CPU. The cost is one callback per pass.

    python benchmarks/gc_probe.py -m kvbaton.cli serve ...      # a module, like python -m
    python benchmarks/gc_probe.py benchmarks/floor_server.py serve ...   # a script
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import time


def main() -> None:
    out = os.environ.get("KVBATON_GC_PROBE_OUT", "")
    passes: list[list[float]] = []  # [start (monotonic s), generation, cpu ms, wall ms, collected]
    started: list[float] = [0.0, 0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0], started[1] = time.monotonic(), time.thread_time()
        elif started[0]:
            passes.append([started[0], info["generation"], (time.thread_time() - started[1]) * 1e3,
                           (time.monotonic() - started[0]) * 1e3, info["collected"]])

    gc.callbacks.append(on_gc)
    if sys.argv[1] == "-m":
        target, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
        sys.path[0] = os.getcwd()  # as ``python -m`` has it (not this file's directory)
        run = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        target, sys.argv = sys.argv[1], sys.argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        run = lambda: runpy.run_path(target, run_name="__main__")  # noqa: E731
    try:
        run()
    finally:
        if out:
            with open(out, "w") as f:
                json.dump({"threshold": list(gc.get_threshold()), "passes": passes}, f)


if __name__ == "__main__":
    main()
