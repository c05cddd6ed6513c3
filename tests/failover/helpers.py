"""A `kvbaton serve` replica as a real process, for the failover tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile

from kvbaton.client import KvbatonClient
from kvbaton.stack.ports import free_port


class Replica:
    """One `kvbaton serve` process."""

    def __init__(self, store_url: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = dict(os.environ, KVBATON_LOG_LEVEL=os.environ.get("KVBATON_REPLICA_LOG_LEVEL", "WARNING"))
        # Its warnings (store unavailable, stop steps that failed) go to a file a failing
        # test can quote (``log_tail``).
        fd, self.log_path = tempfile.mkstemp(prefix=f"kvbaton-replica-{self.port}-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvbaton.cli", "serve", "--insecure", "--listen", self.address, "--store",
                 store_url], env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return b"".join(fh.readlines()[-lines:]).decode(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"

    async def ready(self, timeout_s: float = 60) -> None:
        async with KvbatonClient(self.address) as kv:
            await kv.wait_ready(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)
