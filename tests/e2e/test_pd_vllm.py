"""End to end: control plane + prefill vLLM + decode vLLM + router, pull mode, real NIXL.

Engines start once per module (≈30 s each, started in parallel: P pinned to core 0 and
D to core 1, API notes §0.3). Outputs through the router must equal the prefill engine's
own single-engine output at temperature 0; the connectors' stats files must show bytes
read and done-notifications; both engines' KV usage must drop back to 0 (no held or
leaked blocks).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbaton.tinymodel import ensure_tiny_model
from tests.harness.vllm_server import VllmServer, free_port, small_engine_args

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def _kv_config(cp: str, engine_id: str, stats_dir: Path, mode: str = "pull") -> str:
    return json.dumps({
        "kv_connector": "KvbatonConnector",
        "kv_connector_module_path": "kvbaton.connector.kvbaton_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "control_plane": cp, "mode": mode, "engine_id": engine_id, "timeout_s": 20,
            "stats_dir": str(stats_dir), "ucx_net_devices": "lo", "ucx_tls": "tcp,self,sm",
        },
    })


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited rc={proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"port {port} not listening after {timeout_s}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _post(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _stream_ttft(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[float, str]:
    """(seconds to the first SSE data line with text, full text) of a streamed completion."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = -1.0
    text = []
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            piece = chunk["choices"][0].get("text", "")
            if piece and ttft < 0:
                ttft = time.perf_counter() - t0
            text.append(piece)
    return ttft, "".join(text)


class PD:
    """Everything the tests talk to."""

    def __init__(self, p: VllmServer, d: VllmServer, router_url: str, push_router_url: str,
                 stats_dir: Path) -> None:
        self.p, self.d, self.router_url, self.stats_dir = p, d, router_url, stats_dir
        self.push_router_url = push_router_url

    def events(self, engine: str, event: str) -> list[dict[str, Any]]:
        path = self.stats_dir / f"{engine}.worker.jsonl"
        if not path.exists():
            return []
        return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == event]

    def body(self, prompt: str, max_tokens: int = 16) -> dict[str, Any]:
        return {"model": self.p.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    work = tmp_path_factory.mktemp("pd")
    model = ensure_tiny_model(Path(os.environ.get("KVBATON_TINY_MODEL", "/tmp/kvbaton-tiny-model")))
    stats = work / "stats"
    cp_port = free_port()
    cp_log = open(work / "cp.log", "wb")
    cp = subprocess.Popen([str(Path(PY).parent / "kvbaton"), "serve", "--listen", f"127.0.0.1:{cp_port}"],
                          stdout=cp_log, stderr=subprocess.STDOUT, start_new_session=True)
    procs: list[subprocess.Popen[bytes]] = [cp]
    servers: list[VllmServer] = []
    try:
        _wait_port(cp_port, cp)
        cpa = f"127.0.0.1:{cp_port}"
        p = VllmServer(model, extra_args=[*small_engine_args(), "--kv-transfer-config", _kv_config(cpa, "p0", stats)],
                       env={"VLLM_CPU_OMP_THREADS_BIND": "0"}, log_path=work / "p.log", served_model_name="tiny")
        d = VllmServer(model, extra_args=[*small_engine_args(), "--kv-transfer-config", _kv_config(cpa, "d0", stats)],
                       env={"VLLM_CPU_OMP_THREADS_BIND": "1"}, log_path=work / "d.log", served_model_name="tiny")
        servers += [p, d]
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            for f in [ex.submit(s.start) for s in servers]:
                f.result()
        urls = []
        for mode in ("pull", "push"):
            rport = free_port()
            rlog = open(work / f"router-{mode}.log", "wb")
            router = subprocess.Popen([PY, "-m", "kvbaton.services.router", "--prefill", p.base_url,
                                       "--decode", d.base_url, "--mode", mode, "--port", str(rport)],
                                      stdout=rlog, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
            procs.append(router)
            _wait_port(rport, router)
            urls.append(f"http://127.0.0.1:{rport}")
        yield PD(p, d, urls[0], urls[1], stats)
    finally:
        for s in reversed(servers):
            with contextlib.suppress(Exception):
                s.stop()
        for proc in reversed(procs):
            _stop(proc)


PROMPTS = [
    "The cache block " * 40,  # ~160 tokens: two KV blocks
    "Hello there, decode engine 42. " * 25,
    "Once upon a time",  # one partial block
]


def _usage_back_to_zero(srv: VllmServer, timeout_s: float = 15.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        u = srv.metric("vllm:kv_cache_usage_perc") or 0.0
        if u == 0.0 or time.monotonic() > deadline:
            return u
        time.sleep(0.2)


def test_pull_outputs_match_single_engine(pd: PD) -> None:
    for prompt in PROMPTS:
        single = pd.p.post_json("/v1/completions", pd.body(prompt))["choices"][0]["text"]
        status, raw = _post(f"{pd.router_url}/v1/completions", pd.body(prompt))
        assert status == 200, raw[:1000]
        assert json.loads(raw)["choices"][0]["text"] == single, prompt[:40]
    recv = pd.events("d0", "recv_done")
    assert len(recv) >= len(PROMPTS)
    assert all(e["nbytes"] > 0 for e in recv)
    assert sum(e["nbytes"] for e in recv) >= 4 * 131072 * 2  # ≥ 4 blocks × 2 layers moved
    assert not pd.events("d0", "recv_failed")
    done = [e for e in pd.events("p0", "send_done") if e.get("notif")]
    assert len(done) >= len(PROMPTS)
    assert len(pd.events("p0", "notif")) >= len(PROMPTS)
    assert not pd.events("p0", "send_expired")
    assert _usage_back_to_zero(pd.p) == 0.0
    assert _usage_back_to_zero(pd.d) == 0.0


def _ttft_medians(pd: PD, router_url: str, tag: str, n: int = 5) -> tuple[float, float]:
    """Median streamed TTFT (s) of fresh ~200-token prompts: single engine vs router.

    Every measurement uses a prompt neither engine has seen (no prefix-cache hits), and
    the single-engine leg asks the prefill engine directly without kv_transfer_params."""
    single_t, routed_t = [], []
    for i in range(n):
        a = f"{tag} single {i}: a streamed prompt about key value caches. " * 18
        b = f"{tag} routed {i}: a streamed prompt about key value caches. " * 18
        ts, ref = _stream_ttft(f"{pd.p.base_url}/v1/completions", pd.body(b))
        single_t.append(_stream_ttft(f"{pd.p.base_url}/v1/completions", pd.body(a))[0])
        tr, got = _stream_ttft(f"{router_url}/v1/completions", pd.body(b))
        assert got == ref
        routed_t.append(tr)
    return sorted(single_t)[n // 2], sorted(routed_t)[n // 2]


def test_pull_streaming_and_ttft(pd: PD) -> None:
    single_ttft, routed_ttft = _ttft_medians(pd, pd.router_url, "pull")
    # Chat goes through the same path.
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 50}], "max_tokens": 8,
            "temperature": 0.0}
    single_chat = pd.p.post_json("/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    status, raw = _post(f"{pd.router_url}/v1/chat/completions", chat)
    assert status == 200, raw[:500]
    assert json.loads(raw)["choices"][0]["message"]["content"] == single_chat
    print(f"\nTTFT median of 5: single engine {single_ttft * 1000:.1f} ms, "
          f"through router (pull) {routed_ttft * 1000:.1f} ms")
    assert _usage_back_to_zero(pd.p) == 0.0
    assert _usage_back_to_zero(pd.d) == 0.0


def test_pull_unknown_prefill_engine_recomputes(pd: PD) -> None:
    prompt = "Nobody prefilled this prompt for us. " * 10
    single = pd.p.post_json("/v1/completions", pd.body(prompt))["choices"][0]["text"]
    failed_before = len(pd.events("d0", "recv_failed"))
    out = pd.d.post_json("/v1/completions", {**pd.body(prompt), "kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": "no-such-engine", "remote_block_ids": [1, 2, 3],
        "remote_num_tokens": 300, "transfer_id": "t-unknown"}})
    assert out["choices"][0]["text"] == single
    assert len(pd.events("d0", "recv_failed")) == failed_before + 1
    assert _usage_back_to_zero(pd.d) == 0.0


def test_router_relays_errors(pd: PD) -> None:
    status, raw = _post(f"{pd.router_url}/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2})
    assert status == 404, (status, raw[:300])
    status, _ = _post(f"{pd.router_url}/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -3})
    assert status == 400


PUSH_PROMPTS = [
    "Pushed prefill blocks travel by NIXL WRITE. " * 12,
    "A second, different pushed prompt " * 30,
    "short push",
]


def test_push_outputs_match_single_engine(pd: PD) -> None:
    recv_before = len(pd.events("d0", "recv_done"))
    for prompt in PUSH_PROMPTS:
        single = pd.p.post_json("/v1/completions", pd.body(prompt))["choices"][0]["text"]
        status, raw = _post(f"{pd.push_router_url}/v1/completions", pd.body(prompt))
        assert status == 200, raw[:1000]
        assert json.loads(raw)["choices"][0]["text"] == single, prompt[:40]
    recv = pd.events("d0", "recv_done")[recv_before:]
    assert len(recv) == len(PUSH_PROMPTS)
    assert all(e["nbytes"] > 0 for e in recv)
    pushed = [e for e in pd.events("p0", "send_done") if e.get("mode") == "push"]
    assert len(pushed) >= len(PUSH_PROMPTS) and all(e["write_nbytes"] > 0 for e in pushed)
    assert len([e for e in pd.events("d0", "notif") if e.get("kind") == "push"]) >= len(PUSH_PROMPTS)
    assert not pd.events("p0", "send_failed")
    assert _usage_back_to_zero(pd.p) == 0.0
    assert _usage_back_to_zero(pd.d) == 0.0
    single_ttft, push_ttft = _ttft_medians(pd, pd.push_router_url, "push")
    print(f"\nTTFT median of 5: single engine {single_ttft * 1000:.1f} ms, "
          f"through router (push) {push_ttft * 1000:.1f} ms")


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_concurrent_requests(pd: PD, mode: str) -> None:
    """Eight requests at once through one router: all correct, nothing held afterwards."""
    url = pd.router_url if mode == "pull" else pd.push_router_url
    prompts = [f"{mode} concurrent request number {i}. " * (5 + 7 * i) for i in range(8)]
    refs = [pd.p.post_json("/v1/completions", pd.body(p))["choices"][0]["text"] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda p: _post(f"{url}/v1/completions", pd.body(p)), prompts))
    for (status, raw), ref in zip(outs, refs):
        assert status == 200, raw[:500]
        assert json.loads(raw)["choices"][0]["text"] == ref
    assert not pd.events("d0", "recv_failed") or all(e["transfer_id"] == "t-unknown"
                                                     for e in pd.events("d0", "recv_failed"))
    assert _usage_back_to_zero(pd.p) == 0.0
    assert _usage_back_to_zero(pd.d) == 0.0
