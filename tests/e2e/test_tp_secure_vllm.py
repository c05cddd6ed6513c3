"""End to end: a TP-2 prefill engine under mutual TLS and bearer tokens (issue 14).

Every rank of a TP engine runs its own connector control thread, and each must reach the
control plane with the engine's credentials (``control_tls_*``, ``control_token_file``: the
same for all ranks of one engine). The stack: etcd over mutual TLS, ``kvbaton serve`` with
``--tls-client-ca`` and ``--tokens``, prefill at ``--tensor-parallel-size 2``, decode TP 1, a
push router with credentials. Checked: ``engines list`` (operator token) shows both prefill
ranks; a routed push answers what the prefill engine alone answers, with both prefill ranks
writing (their bytes add up to the request's KV); no ``recv_failed`` on decode.

Runs by default (CI) since session 22: the fleet shape is TP > 1 under mTLS, not an open port.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbaton.stack.etcd_cluster import EtcdCluster, find_etcd
from kvbaton.stack.pd_stack import PdStack, completion_body, post_json, token_ids
from kvbaton.tinymodel import ensure_tiny_model

pytest.importorskip("cryptography")
from tests.harness.pki import stack_credentials

pytestmark = [pytest.mark.vllm, pytest.mark.etcd, pytest.mark.timeout(600),
              pytest.mark.skipif(find_etcd() is None, reason="etcd not installed (scripts/ensure_etcd.sh)")]

BLOCK_BYTES = 131072 * 2  # one block of the tiny model, both layers, both KV heads (float32)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdStack]:
    work = tmp_path_factory.mktemp("tp-secure")
    sec = stack_credentials(work / "pki", ["p0", "d0"])
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    with EtcdCluster(1, tls=sec.etcd_server()) as etcd, \
            PdStack(model, work, router_modes=("push",), timeout_s=30, prefill_tp=2, decode_tp=1,
                    prefill_args=["--no-enable-prefix-caching"], router_control_plane=True, store=etcd.url,
                    security=sec, engine_env={"OMP_WAIT_POLICY": "PASSIVE"}, engine_nice=5) as s:
        yield s


def test_a_tp2_prefill_pushes_under_tls_and_tokens(stack: PdStack) -> None:
    import subprocess
    import sys

    assert stack.security is not None and stack.p is not None
    cli = [str(Path(sys.executable).parent / "kvbaton"), "engines", "list", "--addr", stack.cp_address,
           *stack.security.client_args("operator")]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=60, env=stack.security.child_env())
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    for r in range(2):
        assert any(row[:1] == ["p0"] and f"{r}/2" in row for row in rows), out.stdout

    prompt = token_ids(4242, 300)
    ref = stack.p.post_json("/v1/completions", completion_body(prompt))["choices"][0]["token_ids"]
    marks = {e: stack.event_count(e) for e in (stack.prefill_id, stack.decode_id)}
    status, raw = post_json(f"{stack.routers['push']}/v1/completions", completion_body(prompt))
    assert status == 200, raw[:1000]
    assert json.loads(raw)["choices"][0]["token_ids"] == ref
    assert not stack.events(stack.decode_id, "recv_failed", since=marks[stack.decode_id])
    recv = stack.events(stack.decode_id, "recv_done", since=marks[stack.decode_id])
    assert len(recv) == 1 and recv[0]["nbytes"] == recv[0]["num_blocks"] * BLOCK_BYTES, recv
    sent = [e for e in stack.events(stack.prefill_id, "send_done", since=marks[stack.prefill_id])
            if e.get("mode") == "push"]
    assert sorted(int(e["tp_rank"]) for e in sent) == [0, 1], sent
    assert sum(e["write_nbytes"] for e in sent) == recv[0]["nbytes"], sent
