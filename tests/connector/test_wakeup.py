"""The engine loop's wake-up at TP > 1 (connector/wakeup.py): long idle steps that end at once
when a rank reports a transfer ended or a request arrives, and never lose a wake.

Real AF_UNIX datagram sockets (abstract names, one per test); the engine core is stood in for
by an object with an ``input_queue`` whose method calls the scheduler, as ``EngineCore.step``
does in vLLM 0.32.
"""

from __future__ import annotations

import queue
import threading
import time
import types
import uuid
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvbaton.connector.flows.context import FlowContext
from kvbaton.connector.metadata import KvbatonSettings
from kvbaton.connector.scheduler import KvbatonScheduler
from kvbaton.connector.wakeup import (
    INPUT,
    TIMEOUT,
    WOKEN,
    WakeListener,
    WakeSender,
    find_engine_inbox,
    wake_name,
)

BS = 128


def _name() -> bytes:
    return wake_name(f"t-{uuid.uuid4().hex[:8]}", 1)


def test_a_wake_sent_before_the_wait_is_kept_and_many_count_once() -> None:
    name = _name()
    lst, snd = WakeListener(name), WakeSender(name)
    try:
        for _ in range(3):
            snd.wake()
        t0 = time.monotonic()
        assert lst.wait(30.0) == WOKEN
        assert time.monotonic() - t0 < 5.0
        assert lst.wakes == 3 and snd.sent == 3
        ticks = iter([0.0, 0.0, 1.0, 2.0])  # injected clock: the 1 s wait is over on the 2nd check
        assert lst.wait(1.0, clock=lambda: next(ticks)) == TIMEOUT  # all three were consumed
    finally:
        lst.close()
        snd.close()


def test_a_wake_from_another_thread_ends_a_long_wait() -> None:
    name = _name()
    lst, snd = WakeListener(name), WakeSender(name)
    got: list[str] = []
    started = threading.Event()

    def waiter() -> None:
        started.set()
        got.append(lst.wait(30.0))

    th = threading.Thread(target=waiter)
    th.start()
    assert started.wait(5)
    snd.wake()  # before or during the wait: either way it ends it
    th.join(10)
    assert not th.is_alive() and got == [WOKEN]
    lst.close()
    snd.close()


def test_a_new_request_in_the_engine_inbox_ends_the_wait() -> None:
    lst = WakeListener(_name())
    inbox: queue.Queue[Any] = queue.Queue()
    got: list[str] = []
    th = threading.Thread(target=lambda: got.append(lst.wait(30.0, inbox, slice_s=0.002)))
    th.start()
    inbox.put(("ADD", None))
    th.join(10)
    assert not th.is_alive() and got == [INPUT]
    assert inbox.qsize() == 1  # only looked at: the engine core takes it
    lst.close()


def test_sender_without_listener_drops_quietly_and_a_name_binds_once() -> None:
    name = _name()
    snd = WakeSender(name)
    snd.wake()
    assert snd.dropped == 1 and snd.sent == 0
    lst = WakeListener(name)
    with pytest.raises(OSError):
        WakeListener(name)
    lst.close()
    snd.close()


class _EngineCore:
    """Stands in for vLLM's EngineCore: its ``step`` runs the scheduler; it owns the inbox."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue[Any] = queue.Queue()

    def step(self, fn: Any) -> Any:
        return fn()


def test_find_engine_inbox_walks_up_to_the_engine_core() -> None:
    core = _EngineCore()
    assert core.step(find_engine_inbox) is core.input_queue
    assert find_engine_inbox() is None  # not called from an engine loop


def _sched(tp_size: int, **kw: Any) -> KvbatonScheduler:
    s = KvbatonScheduler(KvbatonSettings(control_plane="127.0.0.1:1", engine_id=f"e-{uuid.uuid4().hex[:8]}", **kw),
                         BS, tp_size=tp_size)
    s._in_flight["r1"] = time.monotonic() + 60.0  # a transfer of ours pending
    return s


def _empty_step() -> Any:
    return types.SimpleNamespace(total_num_scheduled_tokens=0)


def test_tp2_idle_step_waits_until_a_rank_wakes_it() -> None:
    import os

    s = _sched(2)
    core = _EngineCore()
    rank = WakeSender(wake_name(s.settings.engine_id, os.getpid()))  # what a worker rank sends to
    try:
        rank.wake()  # the rank reported a result before the loop went idle
        t0 = time.monotonic()
        core.step(lambda: s.build_connector_meta(_empty_step()))
        assert time.monotonic() - t0 < 2.0  # not the 5 s default
        assert s.idle_stats[WOKEN] == 1 and s.idle_stats["long_waits"] == 1
        core.input_queue.put(("ADD", None))  # a request arrives
        core.step(lambda: s.build_connector_meta(_empty_step()))
        assert s.idle_stats[INPUT] == 1
        core.input_queue.get_nowait()
        s.update_connector_output(None, {"r1"})  # the transfer ended: no more idle waits
        core.step(lambda: s.build_connector_meta(_empty_step()))
        assert s.idle_stats["idle_steps"] == 2
    finally:
        rank.close()
        s.shutdown()


def test_tp2_idle_step_is_bounded_by_tp_idle_wait_max_ms() -> None:
    s = _sched(2, tp_idle_wait_max_ms=50)
    core = _EngineCore()
    t0 = time.monotonic()
    core.step(lambda: s.build_connector_meta(_empty_step()))
    took = time.monotonic() - t0
    assert s.idle_stats[TIMEOUT] == 1 and 0.04 <= took < 3.0
    s.shutdown()


def test_tp1_and_unknown_engines_keep_the_short_idle_step() -> None:
    s1 = _sched(1, idle_step_wait_ms=1)
    assert s1._wake is None  # TP 1: unchanged, nothing bound
    s1.build_connector_meta(_empty_step())
    assert s1.idle_stats["idle_steps"] == 1 and s1.idle_stats["long_waits"] == 0
    s2 = _sched(2, idle_step_wait_ms=1)
    s2.build_connector_meta(_empty_step())  # not inside an engine core: no inbox to watch
    assert s2.idle_stats["long_waits"] == 0 and s2.idle_stats["idle_steps"] == 1 and not s2._long_waits
    s2.shutdown()
    s3 = _sched(2, tp_idle_wait_max_ms=0)
    assert s3._wake is None and not s3._long_waits


def test_a_reported_result_wakes_the_engine_loop() -> None:
    woken: list[int] = []
    ctx = FlowContext(settings=None, layout=None, name="a", control=None, stats=None, peers=None,  # type: ignore[arg-type]
                      wake=lambda: woken.append(1))
    ctx.report("recv", "r1", True)
    assert ctx.results.get_nowait() == ("recv", "r1", True, ()) and woken == [1]


def test_ranks_that_cannot_wake_the_loop_bring_the_short_steps_back() -> None:
    s = _sched(2, tp_idle_wait_max_ms=20)
    core = _EngineCore()
    core.step(lambda: s.build_connector_meta(_empty_step()))  # times out: no rank can reach us
    s.update_connector_output(None, {"r1"})  # one end without a wake: may have overtaken it
    assert s._long_waits
    s._in_flight["r2"] = time.monotonic() + 60.0
    s.update_connector_output({"r2"}, None)  # a second one: the channel is broken
    assert not s._long_waits
    s._in_flight["r3"] = time.monotonic() + 60.0
    core.step(lambda: s.build_connector_meta(_empty_step()))
    assert s.idle_stats["long_waits"] == 1 and s.idle_stats["idle_steps"] == 2
    s.shutdown()


def test_wakes_that_arrive_keep_the_long_steps() -> None:
    import os

    s = _sched(2)
    rank = WakeSender(wake_name(s.settings.engine_id, os.getpid()))
    core = _EngineCore()
    try:
        for rid in ("r1", "r2", "r3"):
            s._in_flight[rid] = time.monotonic() + 60.0
            rank.wake()
            core.step(lambda: s.build_connector_meta(_empty_step()))
            s.update_connector_output(None, {rid})
        assert s._long_waits and s.idle_stats[WOKEN] == 3
        s2 = _sched(2)  # busy steps never wait: the wakes stay queued, and still count
        rank2 = WakeSender(wake_name(s2.settings.engine_id, os.getpid()))
        for rid in ("r1", "r2", "r3"):
            s2._in_flight[rid] = time.monotonic() + 60.0
            rank2.wake()
            s2.update_connector_output(None, {rid})
        assert s2._long_waits and s2._wake is not None and s2._wake.pending()
        rank2.close()
        s2.shutdown()
    finally:
        rank.close()
        s.shutdown()


def test_a_flow_that_fails_a_load_wakes_the_scheduler_through_the_socket() -> None:
    """The whole path in one process: a receive flow gives up on a push the rendezvous failed,
    reports it, and the engine loop's long wait ends (the worker's ``ctx.wake`` is a sender)."""
    from kvbaton.connector.metadata import LoadSpec
    from tests.connector.test_flows import Rig
    from tests.connector.test_worker_failed_push import _failed

    name = _name()
    lst, snd = WakeListener(name), WakeSender(name)
    r = Rig()
    r.ctx.wake = snd.wake
    t0 = time.monotonic()
    try:
        r.recv.on_load("req", LoadSpec("x9", "", (), (4, 5), mode="push"), t0)
        assert lst.wait(0.0) == TIMEOUT  # nothing ended yet
        r.recv.on_event("x9", _failed("x9"))
        r.recv.progress(t0 + 0.1)
        assert lst.wait(30.0) == WOKEN
        assert r.results() == [("recv", "req", False, (4, 5))]
    finally:
        lst.close()
        snd.close()
