"""Push-mode ordering and failure on real vLLM engines (kvbaton connector, real NIXL).

The connector has no delay hook, so the order of decode's *offer* and prefill's
*completion* is forced from the outside, the way a router could send the two legs:

- completion first: the prefill leg is sent and answered, and the control plane is
  polled until the transfer is COMPLETED, before the decode leg is sent;
- offer first: the decode leg is sent and the control plane polled until the transfer
  is OFFERED, before the prefill leg is sent.

Both must give the single-engine output with bytes really written (stats files). Then
the prefill engine is SIGKILLed while a decode request waits on its KV: the request
must end (recomputed, ``kv_load_failure_policy=recompute``) within about the
connector's ``timeout_s`` rather than hang, and decode must hold no block afterwards.
Engines use a small ``timeout_s`` so the fault path is quick.
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

from kvbaton.stack.pd_stack import PdStack, post_json, usage_back_to_zero
from kvbaton.tinymodel import ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

TIMEOUT_S = 4.0  # the connector's hold / wait bound on these engines


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdStack]:
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    with PdStack(model, tmp_path_factory.mktemp("pdfaults"), router_modes=(), timeout_s=TIMEOUT_S) as s:
        yield s


def _body(prompt: str, max_tokens: int = 12) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def _prefill_leg(prompt: str, tid: str) -> dict[str, Any]:
    """What the push router sends to prefill (services/router/app.py)."""
    return {**_body(prompt, 1), "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid, "transfer_mode": "push"}}


def _decode_leg(prompt: str, tid: str) -> dict[str, Any]:
    return {**_body(prompt), "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid, "transfer_mode": "push"}}


def _single(stack: PdStack, prompt: str) -> str:
    assert stack.p is not None
    return stack.p.post_json("/v1/completions", _body(prompt))["choices"][0]["text"]


def _text(status: int, raw: bytes) -> str:
    assert status == 200, raw[:500]
    return json.loads(raw)["choices"][0]["text"]


def _wait_events(stack: PdStack, engine: str, event: str, tid: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Events of ``tid`` (stats lines are written by background threads: poll briefly)."""
    deadline = time.monotonic() + timeout_s
    while True:
        evs = [e for e in stack.events(engine, event) if e.get("transfer_id") == tid]
        if evs or time.monotonic() > deadline:
            return evs
        time.sleep(0.05)


def _assert_pushed(stack: PdStack, tid: str) -> None:
    recv = _wait_events(stack, "d0", "recv_done", tid)
    assert len(recv) == 1 and recv[0]["nbytes"] > 0, recv
    sent = _wait_events(stack, "p0", "send_done", tid)
    assert len(sent) == 1 and sent[0]["mode"] == "push" and sent[0]["write_nbytes"] == recv[0]["nbytes"], sent
    assert [e for e in stack.events("d0", "notif") if e.get("transfer_id") == tid and e.get("kind") == "push"]
    assert not _wait_events(stack, "d0", "recv_failed", tid, timeout_s=0)
    assert stack.wait_phase(tid, ["SUCCEEDED"], timeout_s=5.0) == "SUCCEEDED"


def test_push_completion_before_offer(stack: PdStack) -> None:
    prompt = "Prefill finishes long before decode offers its blocks. " * 12  # ~2 blocks
    ref = _single(stack, prompt)
    tid = f"cbo-{uuid.uuid4().hex[:8]}"
    _text(*post_json(f"{stack.p.base_url}/v1/completions", _prefill_leg(prompt, tid), timeout_s=60))
    assert stack.wait_phase(tid, ["COMPLETED"], timeout_s=5.0) == "COMPLETED"
    out = _text(*post_json(f"{stack.d.base_url}/v1/completions", _decode_leg(prompt, tid), timeout_s=60))
    assert out == ref
    _assert_pushed(stack, tid)
    assert usage_back_to_zero(stack.p) == 0.0
    assert usage_back_to_zero(stack.d) == 0.0


def test_push_offer_before_completion(stack: PdStack) -> None:
    prompt = "Decode offers first and waits for the prefill engine. " * 12
    ref = _single(stack, prompt)
    tid = f"obc-{uuid.uuid4().hex[:8]}"
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        dfut = ex.submit(post_json, f"{stack.d.base_url}/v1/completions", _decode_leg(prompt, tid), 60)
        assert stack.wait_phase(tid, ["OFFERED"], timeout_s=5.0) == "OFFERED"
        time.sleep(0.5)  # the offer has been waiting a while (well inside TIMEOUT_S)
        _text(*post_json(f"{stack.p.base_url}/v1/completions", _prefill_leg(prompt, tid), timeout_s=60))
        out = _text(*dfut.result(timeout=60))
    assert out == ref
    _assert_pushed(stack, tid)
    assert usage_back_to_zero(stack.p) == 0.0
    assert usage_back_to_zero(stack.d) == 0.0


def test_prefill_killed_while_decode_waits(stack: PdStack) -> None:
    """Last in the module: it kills the prefill engine."""
    assert stack.p is not None and stack.d is not None
    prompt = "The prefill engine dies while decode waits for its KV. " * 12
    ref = _single(stack, prompt)
    tid = f"kill-{uuid.uuid4().hex[:8]}"
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        t0 = time.monotonic()
        dfut = ex.submit(post_json, f"{stack.d.base_url}/v1/completions", _decode_leg(prompt, tid), 60)
        assert stack.wait_phase(tid, ["OFFERED"], timeout_s=5.0) == "OFFERED"
        assert stack.p.pgid is not None
        os.killpg(stack.p.pgid, 9)  # SIGKILL the whole engine: API server, EngineCore, Worker
        status, raw = dfut.result(timeout=TIMEOUT_S + 30)  # not hung
        waited = time.monotonic() - t0
    # Recomputed locally (policy "recompute"): 200 and the single-engine output; with
    # policy "fail" it would be a 500 — either way it must end, and within the bound.
    assert status == 200, raw[:500]
    assert json.loads(raw)["choices"][0]["text"] == ref
    assert waited < TIMEOUT_S + 10, waited
    failed = _wait_events(stack, "d0", "recv_failed", tid)
    assert len(failed) == 1, failed
    assert not _wait_events(stack, "d0", "recv_done", tid, timeout_s=0)
    assert usage_back_to_zero(stack.d) == 0.0
    assert stack.d.healthy()
    print(f"\ndecode request ended {waited:.1f}s after its offer (timeout_s={TIMEOUT_S}): "
          f"{failed[0]['reason']}")
