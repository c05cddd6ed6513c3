"""Wake the engine loop when a transfer ends, so its idle steps can wait long at TP > 1.

Why: while a request waits for its KV (decode) or holds blocks for a transfer (prefill), vLLM
steps with empty batches back to back (``VLLM_API_NOTES.md`` §0.4). At TP > 1 every step is a
message on vLLM's shm queue to each rank, and a rank's main thread busy-waits on that queue
(``SpinCondition``: ``sched_yield``) for 1 s after every message. With steps every few ms the
ranks never stop spinning: with TP 2 on both sides four main threads held the 2 cores of the VM
while a transfer was pending, and the control plane, the transfer threads and the engines'
control threads starved (registrations lapsed, ``BeginRead`` unanswered, NIXL WRITEs timed out;
issue 14). So at TP > 1 the scheduler's idle step waits *longer than the spin window* — the ranks
go quiet after 1 s — and is woken at once by what it waits for:

* **a transfer ending**: each worker rank's transfer thread sends a datagram here whenever it
  reports a transfer finished or failed (:class:`WakeSender`); the step that follows collects
  it (``get_finished``). A wake sent while the loop is busy stays queued in the socket, so the
  next wait returns at once: none is lost.
* **a new request** (or an abort): the engine core's input queue is checked every slice
  (``idle_step_wait_ms``, the same bound a new request waits today).

Scheduler (``VLLM::EngineCore``) and workers are separate processes that share no memory: the
channel is an abstract AF_UNIX datagram socket named by the engine id and the engine core's pid
(each worker is the engine core's child: :func:`wake_name`). If the name cannot be bound or the
engine core's input queue cannot be found (another vLLM), the scheduler keeps the short idle
steps: slower TP > 1, never a request waiting on a wake that cannot come.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("kvbaton.connector.wakeup")

#: why a wait ended
WOKEN, INPUT, TIMEOUT = "woken", "input", "timeout"


def wake_name(engine_id: str, engine_core_pid: int) -> bytes:
    """The abstract socket name (leading NUL: no file, gone with the process) for one engine.

    The pid keeps two engines that were given the same id on one host (a misconfiguration the
    registrar refuses later) from waking each other's loops."""
    return f"\0kvbaton-wake-{engine_id}-{engine_core_pid}".encode()


class WakeListener:
    """The scheduler's end: bound once, waited on by the engine loop only."""

    def __init__(self, name: bytes) -> None:
        self.name = name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(name)
        except OSError:
            self._sock.close()
            raise
        self._sock.setblocking(False)
        self.wakes = 0  # datagrams received

    def _drain(self) -> bool:
        got = False
        while True:
            try:
                self._sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return got
            got = True
            self.wakes += 1

    def pending(self) -> bool:
        """A wake is queued (not consumed: the next :meth:`wait` still sees it)."""
        try:
            return bool(self._sock.recv(1, socket.MSG_PEEK))
        except (BlockingIOError, InterruptedError):
            return False

    def wait(self, timeout_s: float, inbox: Any = None, slice_s: float = 0.002,
             clock: Callable[[], float] = time.monotonic) -> str:
        """Wait up to ``timeout_s`` for a wake (:data:`WOKEN`) or, if ``inbox`` is given,
        for it to hold something (:data:`INPUT`, checked every ``slice_s``); else :data:`TIMEOUT`.

        Wakes that came before the call count (the socket keeps them) and are all consumed."""
        deadline = clock() + max(timeout_s, 0.0)
        while True:
            if self._drain():
                return WOKEN
            if inbox is not None and not inbox.empty():
                return INPUT
            left = deadline - clock()
            if left <= 0:
                return TIMEOUT
            step = min(left, slice_s) if inbox is not None else left
            select.select([self._sock], [], [], step)

    def close(self) -> None:
        self._sock.close()


class WakeSender:
    """A worker rank's end: fire-and-forget, from any thread; never raises, never blocks.

    A wake that cannot be delivered (the listener is not bound, its buffer is full of wakes
    already) is dropped: the engine loop then finds the result at its next step anyway."""

    def __init__(self, name: bytes) -> None:
        self.name = name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self.sent = 0
        self.dropped = 0

    def wake(self) -> None:
        try:
            self._sock.sendto(b"w", self.name)
            self.sent += 1
        except OSError:  # ECONNREFUSED / ENOENT (no listener), EAGAIN (its buffer is full)
            self.dropped += 1

    def close(self) -> None:
        self._sock.close()


def find_engine_inbox(max_depth: int = 16) -> queue.Queue[Any] | None:
    """The engine core's input queue, found from the engine loop's own call stack.

    ``build_connector_meta`` runs inside ``EngineCore.step`` (vLLM 0.32: ``run_busy_loop`` →
    ``step`` → ``Scheduler.schedule`` → the connector), whose ``self`` owns ``input_queue``,
    where vLLM's input thread puts new requests and aborts. Read only (``empty()``); None if
    no caller has one (another vLLM layout): the caller then keeps short waits."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        q = getattr(owner, "input_queue", None) if owner is not None else None
        if isinstance(q, queue.Queue):
            return q
        frame = frame.f_back
    return None


def engine_core_pid_of_worker() -> int:
    """A worker rank's engine core: its parent (vLLM's multiproc executor starts the ranks)."""
    return os.getppid()
