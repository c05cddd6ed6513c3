"""Child processes of a stack: wait for one to listen, stop its whole process group.

Why here and not in each launcher: the P/D stack, the fleet, the benchmarks and the tests
start control planes and routers the same way (own session, so a stop takes the whole
tree; every wait bounded, failing early if the child died), and were copying these.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["KVBATON", "PY", "ROOT", "process_group_members", "stop_group", "wait_port"]

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
#: The ``kvbaton`` console script of this interpreter's environment.
KVBATON = str(Path(PY).parent / "kvbaton")


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Wait until something listens on ``port``; fail early if ``proc`` died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited rc={proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"port {port} not listening after {timeout_s}s")


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the process group of a ``start_new_session`` child, SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(grace_s)
    else:  # leader gone: make sure nothing of its group is left either
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def process_group_members(pgid: int) -> list[int]:
    """PIDs (from /proc) whose process group is ``pgid``: to verify a clean stop, and to see a
    non-child group die without waiting on it (test-only connector faults)."""
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        # Field 2 (comm) may contain spaces/parens: split after the last ')'.
        fields = stat.rsplit(")", 1)[1].split()
        # fields[0]=state, [1]=ppid, [2]=pgrp
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids
