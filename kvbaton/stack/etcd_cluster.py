"""Starts throwaway etcd clusters (1 or 3 members) on free loopback ports.

Why a harness of our own: the etcd backend must be tested against the real server,
including member death and restart, and CI machines have only Debian's ``etcd-server``
binary (``scripts/ensure_etcd.sh`` installs it). Each member is one subprocess with its
own data dir under a temp dir; everything is stopped by pid and verified dead.

Server flags chosen for tests:
- ``--max-txn-ops 10000``: etcd 3.4 allows only 128 compares/ops per txn branch by default;
  the store contract does not cap txn size, so production clusters should raise it too.
- ``--heartbeat-interval 50 --election-timeout 500``: fast leader election after a kill,
  and a minimum lease TTL of 1 s (etcd's floor is 1.5 x election timeout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
import uuid

from .ports import free_ports

HEALTH_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def find_etcd() -> str | None:
    """The etcd binary, or None (tests then skip and say how to install it)."""
    found = shutil.which("etcd")
    if found:
        return found
    return "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None


@dataclasses.dataclass(frozen=True)
class EtcdServerTls:
    """Client-facing TLS for the test etcd: its certificate and key, and the CA it
    requires client certificates from (``--client-cert-auth``); ``client_cert``/``key``
    are what the harness's own health check presents."""

    ca: str
    cert: str
    key: str
    client_cert: str
    client_key: str


@dataclasses.dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: pathlib.Path
    log_path: pathlib.Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class EtcdCluster:
    """``size`` etcd members on loopback. ``start()`` blocks until every member is healthy."""

    def __init__(
        self,
        size: int = 1,
        *,
        max_txn_ops: int = 10_000,
        heartbeat_ms: int = 50,
        election_ms: int = 500,
        binary: str | None = None,
        tls: EtcdServerTls | None = None,
    ) -> None:
        self.tls = tls
        self.binary = binary or find_etcd()
        if self.binary is None:
            raise FileNotFoundError("etcd not found: run scripts/ensure_etcd.sh (Debian's etcd-server)")
        self.size = size
        self.max_txn_ops = max_txn_ops
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="kvbaton-etcd-"))
        self.token = f"kvbaton-test-{uuid.uuid4().hex[:8]}"
        ports = free_ports(2 * size)  # distinct: a port named twice fails the cluster's start
        self.members = [
            Member(f"m{i}", ports[2 * i], ports[2 * i + 1], self.root / f"m{i}", self.root / f"m{i}.log")
            for i in range(size)
        ]

    # -- endpoints --------------------------------------------------------------
    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def url(self) -> str:
        return ("etcds://" if self.tls else "etcd://") + ",".join(self.endpoints)

    def index_of(self, endpoint: str) -> int:
        return self.endpoints.index(endpoint)

    # -- lifecycle ------------------------------------------------------------
    def _args(self, m: Member) -> list[str]:
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        client = f"{'https' if self.tls else 'http'}://{m.endpoint}"
        tls = ["--cert-file", self.tls.cert, "--key-file", self.tls.key, "--client-cert-auth",
               "--trusted-ca-file", self.tls.ca] if self.tls else []
        return [
            self.binary or "etcd", *tls,
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", initial,
            "--initial-cluster-state", "new",  # ignored when the data dir already exists
            "--initial-cluster-token", self.token,
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            "--max-txn-ops", str(self.max_txn_ops),
            "--logger", "zap",
            "--log-level", "warn",
        ]

    def _spawn(self, m: Member) -> None:
        log = open(m.log_path, "ab")
        try:
            m.proc = subprocess.Popen(
                self._args(m), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C to pytest must not race our own shutdown
            )
        finally:
            log.close()

    def start(self) -> EtcdCluster:
        try:
            for m in self.members:
                self._spawn(m)
            for i in range(self.size):
                self.wait_healthy(i)
        except BaseException:
            self.stop()
            raise
        return self

    def healthy(self, i: int) -> bool:
        """etcd's /health: true only when the member is up *and* sees a leader."""
        m = self.members[i]
        if not m.alive:
            return False
        ctx = None
        if self.tls:
            import ssl

            ctx = ssl.create_default_context(cafile=self.tls.ca)
            ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        try:
            scheme = "https" if self.tls else "http"
            with urllib.request.urlopen(f"{scheme}://{m.endpoint}/health", timeout=1.0, context=ctx) as r:
                return b'"health":"true"' in r.read()
        except OSError:
            return False

    def wait_healthy(self, i: int, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        m = self.members[i]
        while time.monotonic() < deadline:
            if not m.alive:
                raise RuntimeError(f"etcd {m.name} exited with {m.proc and m.proc.returncode}:\n{self.log_tail(i)}")
            if self.healthy(i):
                return
            time.sleep(0.1)
        raise TimeoutError(f"etcd {m.name} not healthy after {timeout_s}s:\n{self.log_tail(i)}")

    def log_tail(self, i: int, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.members[i].log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def kill_member(self, i: int) -> None:
        """SIGKILL: a crash, no graceful leave (the data dir stays for ``restart_member``)."""
        m = self.members[i]
        if m.proc is not None and m.proc.poll() is None:
            m.proc.send_signal(signal.SIGKILL)
            m.proc.wait(timeout=STOP_TIMEOUT_S)

    def restart_member(self, i: int, *, wait: bool = True) -> None:
        m = self.members[i]
        if m.alive:
            raise RuntimeError(f"{m.name} is still running")
        self._spawn(m)
        if wait:
            self.wait_healthy(i)

    def stop(self) -> None:
        """SIGTERM the members one at a time, SIGKILL stragglers, verify each pid is gone,
        remove data. One at a time: a member stopping hands its leadership to one still up
        at once, while all stopping together each waited out etcd's leadership-transfer
        timeout (6.5 s for 3 members, against 0.08 s)."""
        for m in self.members:
            if m.proc is None:
                continue
            if m.alive:
                m.proc.terminate()
            try:
                m.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait(timeout=STOP_TIMEOUT_S)
            if m.proc.poll() is None:
                raise RuntimeError(f"etcd {m.name} (pid {m.proc.pid}) did not exit")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
