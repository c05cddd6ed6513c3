"""What every stack of real processes shares: children in their own sessions with their
logs in the work directory, vLLM engines started in parallel, the connectors' stats
files read back, and an orderly stop (routers, then engines, then control planes, each
bounded) that runs also after a failed start.

Why a base: :class:`~kvbaton.stack.pd_stack.PdStack` (one pair) and
:class:`~kvbaton.stack.fleet_stack.FleetStack` (N + M engines, K routers) differ only in
what they start; the stop order, the log handles, the stats reading and the
context-manager protocol were two copies that had started to drift.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Self

from kvbaton.stack.ports import free_port
from kvbaton.stack.procs import KVBATON, PY, ROOT, stop_group, wait_port
from kvbaton.stack.security import StackSecurity
from kvbaton.stack.vllm_server import VllmServer

if TYPE_CHECKING:
    from kvbaton.client import KvbatonClient

__all__ = ["StackBase", "run_demo"]


def run_demo(body: Callable[[], int]) -> int:
    """Run a demo's body as a command: Ctrl-C or a failure is one readable line and a nonzero
    exit, never a traceback over the engines' logs. The body's stack stops in its own
    ``with`` block, so by the time this returns everything it started is stopped."""
    try:
        return body()
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped")
        return 130
    except Exception as exc:  # noqa: BLE001 - one readable line, then nonzero
        print(f"FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


class StackBase:
    """Process bookkeeping for a stack; subclasses implement :meth:`_start`.

    Args:
        workdir: logs (``<name>.log``) and the connectors' stats (``stats/``) go here.
        startup_timeout_s: per vLLM engine.
        security: mutual TLS + tokens for every process (:class:`StackSecurity`); None:
            plaintext on loopback (``kvbaton serve --insecure``).
    """

    def __init__(self, workdir: Path | str, *, startup_timeout_s: float = 600.0,
                 security: StackSecurity | None = None) -> None:
        self.workdir = Path(workdir)
        self.stats_dir = self.workdir / "stats"
        self.startup_timeout_s = startup_timeout_s
        self.security = security
        self._cps: list[subprocess.Popen[bytes]] = []  # control planes: stopped last
        self._procs: list[subprocess.Popen[bytes]] = []  # routers and other helpers: stopped first
        self._servers: list[VllmServer] = []  # engines, in start order
        self._logs: list[IO[bytes]] = []
        self._channel: Any = None
        #: Control-plane address(es), comma separated (what clients take); "" until started.
        self.cp_address = ""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Self:
        """Start everything; on any failure stop what was started and re-raise."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        raise NotImplementedError

    def _spawn(self, name: str, cmd: list[str], *, control_plane: bool = False,
               env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A child in its own session (a stop kills its tree), output in ``<name>.log``."""
        log = open(self.workdir / f"{name}.log", "wb")
        self._logs.append(log)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=ROOT, env=None if env is None else dict(env))
        (self._cps if control_plane else self._procs).append(proc)
        return proc

    def _start_control_plane(self, name: str, store: str | None = None) -> str:
        """``kvbaton serve`` (all three services) on a free loopback port; its address.

        Plaintext (``--insecure``) unless the stack is secured, then with the server
        certificate, client-certificate CA, token file and etcd client credentials."""
        port = free_port()
        flags = ["--insecure"] if self.security is None else self.security.serve_args(store or "")
        cp = self._spawn(name, [KVBATON, "serve", *flags, "--listen", f"127.0.0.1:{port}",
                                *(["--store", store] if store is not None else [])], control_plane=True)
        wait_port(port, cp)
        return f"127.0.0.1:{port}"

    def _spawn_router(self, name: str, args: Sequence[str]) -> str:
        """``python -m kvbaton.services.router ARGS`` on a free port (with the router's
        credentials on a secured stack); its base URL once it listens."""
        port = free_port()
        creds = [] if self.security is None else self.security.client_args("router")
        proc = self._spawn(name, [PY, "-m", "kvbaton.services.router", *args, "--port", str(port), *creds],
                           env=None if self.security is None else self.security.child_env())
        wait_port(port, proc)
        return f"http://127.0.0.1:{port}"

    def _start_servers(self) -> None:
        """Start every engine in :attr:`_servers` at once (≈30 s each; sequential would
        add them up); wait for all, then raise the first error."""
        with concurrent.futures.ThreadPoolExecutor(len(self._servers)) as ex:
            futures = [ex.submit(s.start) for s in self._servers]
            for f in futures:
                f.exception(timeout=self.startup_timeout_s + 60)
            for f in futures:
                f.result(timeout=0)

    def stop(self) -> None:
        """Routers, engines, then control planes (reverse start order within each), and
        verify nothing is left. Idempotent; raises the first engine that would not stop."""
        errors: list[BaseException] = []
        for proc in reversed(self._procs):
            stop_group(proc)
        for s in reversed(self._servers):
            try:
                s.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                errors.append(exc)
        for proc in self._cps:
            stop_group(proc)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        for log in self._logs:
            log.close()
        self._cps, self._procs, self._servers, self._logs = [], [], [], []
        if errors:
            raise errors[0]

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ observing
    def client(self, who: str = "operator") -> KvbatonClient:
        """An async control-plane client (``async with stack.client() as kv``): plaintext,
        or on a secured stack with ``who``'s certificate and token."""
        from kvbaton.client import KvbatonClient

        if self.security is None:
            return KvbatonClient(self.cp_address)
        return self.security.client(who, self.cp_address)

    def cli_args(self, who: str = "operator") -> list[str]:
        """``--addr`` and credentials for a ``kvbaton`` CLI command run as ``who``."""
        creds = [] if self.security is None else self.security.client_args(who)
        return ["--addr", self.cp_address, *creds]

    def events(self, engine: str, event: str | None = None, *, since: int = 0, part: str = "worker",
               **match: Any) -> list[dict[str, Any]]:
        """The connector's stats events of ``engine`` (all, or those named ``event`` whose
        fields equal ``match``), from line ``since`` (see :meth:`event_count`) of its
        ``<engine>.<part>.jsonl`` (``worker``, ``retention``, ...)."""
        path = self.stats_dir / f"{engine}.{part}.jsonl"
        if not path.exists():
            return []
        evs = [json.loads(x) for x in path.read_text().splitlines()[since:] if x.strip()]
        return [e for e in evs if (event is None or e["event"] == event)
                and all(e.get(k) == v for k, v in match.items())]

    def wait_events(self, engine: str, event: str, since: int = 0, n: int = 1, timeout_s: float = 10.0,
                    keep: Callable[[dict[str, Any]], bool] | None = None,
                    **match: Any) -> list[dict[str, Any]]:
        """Until ``n`` such events after line ``since`` (also kept by ``keep``, if given) or
        ``timeout_s``: what there is. Events land after the answer that caused them (a
        notification reaches the other engine later), so tests wait rather than read once."""
        deadline = time.monotonic() + timeout_s
        while True:
            evs = [e for e in self.events(engine, event, since=since, **match) if keep is None or keep(e)]
            if len(evs) >= n or time.monotonic() > deadline:
                return evs
            time.sleep(0.05)

    def event_count(self, engine: str, part: str = "worker") -> int:
        """Lines in ``engine``'s stats file so far: a bookmark for :meth:`events`."""
        path = self.stats_dir / f"{engine}.{part}.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0
