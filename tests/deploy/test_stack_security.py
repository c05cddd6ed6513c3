"""The stack launchers' credentials (:class:`kvbaton.stack.security.StackSecurity`) read the
directory ``deploy/make-certs.sh`` writes: a control plane started by the stack base with
them, on etcd over mutual TLS, serves the operator's CLI and the engines' and router's
clients, and refuses a client without a token.

Why: the secured e2e files make their certificates with the tests' CA in that layout; this
keeps the layout and the deploy script from drifting apart (no vLLM here: seconds).
"""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import subprocess

import pytest

from kvbaton.stack.base import StackBase
from kvbaton.stack.etcd_cluster import EtcdCluster, find_etcd
from kvbaton.stack.procs import KVBATON
from kvbaton.stack.security import StackSecurity

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _ControlPlanes(StackBase):
    """Two control-plane replicas over one store, nothing else."""

    def __init__(self, workdir: pathlib.Path, store: str, security: StackSecurity) -> None:
        super().__init__(workdir, security=security)
        self.store = store

    def _start(self) -> None:
        self.cp_address = ",".join(self._start_control_plane(f"cp{i}", self.store) for i in range(2))


def test_stack_security_wants_a_complete_directory(tmp_path: pathlib.Path) -> None:
    (tmp_path / "ca.crt").write_text("x")
    with pytest.raises(ValueError, match="control-plane.crt, control-plane.key, tokens.json"):
        StackSecurity(tmp_path)


@pytest.mark.etcd
@pytest.mark.timeout(180)
def test_make_certs_output_secures_a_stack(tmp_path: pathlib.Path) -> None:
    if shutil.which("openssl") is None or find_etcd() is None:
        pytest.skip("needs openssl and etcd")
    pki = tmp_path / "pki"
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(pki), "kvbaton"], check=True, timeout=120,
                   capture_output=True)
    sec = StackSecurity(pki)
    with EtcdCluster(1, tls=sec.etcd_server()) as etcd, _ControlPlanes(tmp_path, etcd.url, sec) as stack:
        assert etcd.url.startswith("etcds://")

        def cli(who: str, *, token: bool = True) -> subprocess.CompletedProcess[str]:
            creds = sec.client_args(who, token=token)
            return subprocess.run([KVBATON, "engines", "list", "--json", "--addr", stack.cp_address, *creds],
                                  capture_output=True, text=True, timeout=60, env=sec.child_env())

        ok = cli("operator")
        assert ok.returncode == 0 and ok.stdout.strip() == "[]", ok.stderr
        refused = cli("operator", token=False)
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
        assert stack.cli_args("operator")[:2] == ["--addr", stack.cp_address]

        from kvbaton.v1 import registrar_pb2

        async def engines(who: str) -> int:
            async with stack.client(who) as kv:
                return len((await kv.registrar.ListEngines(registrar_pb2.ListEnginesRequest(), timeout=10)).ranks)
        for who in ("prefill-0", "decode-0", "router", "operator"):
            assert asyncio.run(engines(who)) == 0, who
    for log in sorted(tmp_path.glob("cp*.log")):
        text = log.read_text(errors="replace")
        assert "kvbaton.tls" in text and "etcds://" in text, log
