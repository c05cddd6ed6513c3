"""More faults on real vLLM engines (push mode, kvbaton connector, real NIXL):

- the router is SIGKILLed in the middle of a streamed request: the client's call ends
  (no hang), both engines free every block and keep serving correctly;
- the decode engine is SIGKILLed while prefill holds the KV it computed for it: the
  completion expires at the control plane within the connector's timeout and prefill
  frees its blocks (no leak), then serves the next request correctly.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from kvbaton.stack.pd_stack import PdStack, post_json, usage_back_to_zero
from kvbaton.tinymodel import ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdStack]:
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    with PdStack(model, tmp_path_factory.mktemp("pdfaults2"), router_modes=("push",), timeout_s=TIMEOUT_S) as s:
        yield s


def _body(prompt: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            **extra}


def _single(stack: PdStack, prompt: str) -> str:
    status, raw = post_json(f"{stack.p.base_url}/v1/completions", _body(prompt), 60)
    assert status == 200, raw[:300]
    return json.loads(raw)["choices"][0]["text"]


def test_router_killed_mid_stream(stack: PdStack) -> None:
    router_url = stack.routers["push"]
    router_proc = stack._procs[-1]  # spawned last
    prompt = "The router dies while it streams this answer to the client. " * 10

    def stream() -> str:
        try:
            with requests.post(f"{router_url}/v1/completions", json=_body(prompt, 400, stream=True),
                               stream=True, timeout=(5, 30)) as r:
                for _ in r.iter_lines():
                    pass
            return "completed"
        except requests.RequestException as exc:
            return f"broken: {type(exc).__name__}"

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(stream)
        time.sleep(1.0)  # the request is in flight: prefill done, decode streaming
        os.killpg(router_proc.pid, 9)
        outcome = fut.result(timeout=40)  # the client's call ends, it does not hang
    assert outcome.startswith("broken") or outcome == "completed", outcome
    for eng in (stack.p, stack.d):
        assert usage_back_to_zero(eng, timeout_s=TIMEOUT_S + 20) == 0.0  # no leaked blocks
        assert eng.healthy()
    # The engines still agree with each other after the fault.
    ref = _single(stack, "After the router died, engines still answer. " * 6)
    assert ref


def test_decode_killed_while_prefill_holds(stack: PdStack) -> None:
    """Last in the module: it kills the decode engine."""
    prompt = "Decode dies while prefill holds the KV it computed for it. " * 12
    tid = f"dkill-{uuid.uuid4().hex[:8]}"
    leg = {**_body(prompt, 1), "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid, "transfer_mode": "push"}}
    status, raw = post_json(f"{stack.p.base_url}/v1/completions", leg, 60)
    assert status == 200, raw[:300]
    assert stack.wait_phase(tid, ["COMPLETED"], timeout_s=5.0) == "COMPLETED"
    assert stack.d.pgid is not None
    os.killpg(stack.d.pgid, 9)
    t0 = time.monotonic()
    assert stack.wait_phase(tid, ["EXPIRED"], timeout_s=TIMEOUT_S + 10) == "EXPIRED"
    assert usage_back_to_zero(stack.p, timeout_s=TIMEOUT_S + 20) == 0.0
    freed_after = time.monotonic() - t0
    assert freed_after < TIMEOUT_S + 20
    assert stack.p.healthy()
    assert _single(stack, "Prefill serves on after its decode peer died. " * 6)
    print(f"\nprefill freed the held blocks {freed_after:.1f}s after decode died (timeout_s={TIMEOUT_S})")
