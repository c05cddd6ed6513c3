"""Test-only fault injection, off unless ``fault_file`` is set in the extra config."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any


class Faults:
    """The file is JSON, re-read when its mtime changes, e.g.
    ``{"corrupt_landed": {"reuse": 1, "pull": 1, "push": 1}, "delay_reuse_read_s": 2.5}``:
    ``corrupt_landed[mode]`` = how many loads of that mode get their first landed block
    corrupted after the owner fingerprinted it (before the reader verifies);
    ``delay_reuse_read_s`` = how long a reuse READ waits, pin held, before it is posted;
    ``delay_push_write_s`` = how long a matched push WRITE waits before it is posted (a
    test kills a prefill rank in that window);
    ``delay_staged_serve_s`` = how long an owner waits before answering a staged READ
    request (past the reader's deadline: exercises the reader's cancel);
    ``kill_at_reuse_read`` = true: the reader SIGKILLs its whole engine (process group)
    the moment a reuse READ would be posted, pin held (a reader dying with its pin, at a
    point a test need not race to hit);
    ``kill_group_at_reuse_read`` = a process group id: the reader SIGKILLs that group (the
    owner engine, in a test) once, the moment a reuse READ would be posted, pin held, and
    holds the READ back until the group is gone (an owner dying under a reader's pin, by
    construction rather than by a race against a delay window);
    ``delay_grant_s`` = how long decode's retention waits between RegisterRetained and
    Grant (read by the scheduler process's ``RetentionManager``).
    Counts are consumed in this process only (the file is not rewritten).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._mtime = -1.0
        self._conf: dict[str, Any] = {}
        self._used: dict[str, int] = {}

    def _load(self) -> dict[str, Any]:
        if not self.path:
            return {}
        try:
            mt = os.stat(self.path).st_mtime
        except OSError:
            self._conf, self._mtime = {}, -1.0
            return self._conf
        if mt != self._mtime:
            try:
                self._conf = json.loads(Path(self.path).read_text() or "{}")
            except (OSError, ValueError):
                self._conf = {}
            self._mtime, self._used = mt, {}
        return self._conf

    def take_corruption(self, mode: str) -> bool:
        left = int((self._load().get("corrupt_landed") or {}).get(mode, 0)) - self._used.get(mode, 0)
        if left > 0:
            self._used[mode] = self._used.get(mode, 0) + 1
            return True
        return False

    def value(self, key: str) -> float:
        return float(self._load().get(key, 0.0) or 0.0)

    def take_once(self, key: str) -> int:
        """The key's integer value the first time it is asked for (per file version), else 0."""
        v = int(self._load().get(key, 0) or 0)
        if not v or self._used.get(key):
            return 0
        self._used[key] = 1
        return v


def kill_own_process_group() -> None:
    """SIGKILL this process's group: the whole vLLM server (API process, engine core,
    worker), as ``kill -9`` of the group from outside would (test-only faults)."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def kill_process_group(pgid: int) -> None:
    """SIGKILL another process group (test-only faults); already gone is fine."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
