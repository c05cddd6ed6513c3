"""vLLM's shm-queue readers stop spinning at TP > 1 on CPU, nothing else changes (connector/shm_spin.py).

On real ``SpinCondition`` objects of the installed vLLM (a reader and a writer on an inproc
zmq address): the reader's window is lowered, the writer's (already 0) and the policy's
exclusions (TP 1, GPU, ``-1``) are left alone, and a reader past its window sleeps on the socket
until the writer notifies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

zmq = pytest.importorskip("zmq")
shm = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")

from kvbaton.connector import shm_spin  # noqa: E402


@pytest.fixture
def pair() -> Iterator[tuple[object, object]]:
    ctx = zmq.Context()
    addr = f"inproc://kvbaton-spin-{time.monotonic_ns()}"
    writer = shm.SpinCondition(False, ctx, addr)
    reader = shm.SpinCondition(True, ctx, addr)
    yield reader, writer
    ctx.destroy(linger=0)


def test_readers_are_lowered_writers_untouched(pair: tuple[object, object]) -> None:
    reader, writer = pair
    assert reader.busy_loop_s == 1  # type: ignore[attr-defined]  # vLLM's default, what we change
    assert shm_spin.shorten_reader_spin(0.0, [reader, writer, object()]) == 1
    assert reader.busy_loop_s == 0.0 and writer.busy_loop_s == 0  # type: ignore[attr-defined]
    assert shm_spin.shorten_reader_spin(0.5, [reader]) == 0  # never raised


def test_the_real_process_search_finds_a_live_reader(pair: tuple[object, object]) -> None:
    reader, _ = pair
    assert shm_spin.shorten_reader_spin(0.002) >= 1  # gc finds it
    assert reader.busy_loop_s == 0.002  # type: ignore[attr-defined]


@pytest.mark.parametrize("spin_ms,tp,device", [(-1, 2, "cpu"), (0, 1, "cpu"), (0, 2, "cuda")])
def test_policy_leaves_tp1_gpu_and_minus_one_alone(pair: tuple[object, object], spin_ms: float, tp: int,
                                                    device: str) -> None:
    reader, _ = pair
    assert shm_spin.apply(spin_ms, tp, device) == 0
    assert reader.busy_loop_s == 1  # type: ignore[attr-defined]


def test_a_lowered_reader_sleeps_until_notified(pair: tuple[object, object]) -> None:
    """What makes the change safe: past its window a reader waits on the socket and the
    writer's notify (sent on every enqueue) wakes it; it does not miss the message."""
    reader, writer = pair
    assert shm_spin.apply(0, 2, "cpu") >= 1
    time.sleep(0.01)  # let the SUB socket's subscription reach the PUB side
    woke = threading.Event()

    def wait() -> None:
        reader.wait(timeout_ms=5000)  # type: ignore[attr-defined]
        woke.set()
    t = threading.Thread(target=wait)
    t0 = time.monotonic()
    t.start()
    assert not woke.wait(0.2)  # sleeping, not returning at once (a spinner would)
    writer.notify()  # type: ignore[attr-defined]
    assert woke.wait(5)
    t.join(5)
    assert time.monotonic() - t0 < 4.0
