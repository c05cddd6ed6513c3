"""Start and stop a whole P/D stack (control plane, prefill + decode vLLM, routers) for
the main job, the tests and the benchmarks, without leaking processes.

Why one module: the e2e tests, the fault tests, ``kvbaton.pd_demo`` and
``benchmarks/pd_compare.py`` all need the same four things started the same way, and
the details are easy to get subtly wrong on a 2-core box:

- P is pinned to core 0 and D to core 1 (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's default
  pins *every* engine's worker to core 0, API notes §0.3), and both start in parallel
  (≈30 s each; sequential would double the wait).
- Every child runs in its own session so a stop kills its whole tree (vLLM's
  EngineCore and Worker outlive their API process otherwise), and every wait and every
  HTTP call has a timeout (a client waiting on a killed server hangs forever).
- The connectors' stats files (``<engine>.worker.jsonl``) are the only place that says
  KV really moved (bytes, notifications): :meth:`PdStack.events` reads them.

Connectors: ``"kvbaton"`` (needs the control plane, which is started too) and three
of vLLM's own, for comparisons: ``"nixl"`` (``NixlConnector``, pull), ``"nixl-push"``
(``NixlPushConnector``, P WRITEs into blocks D registered) and ``"nixl-bidir"``
(``NixlConnector`` with ``bidirectional_kv_xfer``: D keeps a finished request's blocks and
P reads them back on the next turn). They use NIXL's ZMQ side channel, so each engine gets
its own ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (:attr:`PdStack.side_channel_ports`). vLLM's
connectors have no router here: :mod:`benchmarks.sweep` talks to the engines directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbaton.stack.base import StackBase
from kvbaton.stack.procs import stop_group, wait_port
from kvbaton.stack.security import StackSecurity
from kvbaton.stack.vllm_server import VllmServer, free_port, small_engine_args

__all__ = [
    "NIXL_VARIANTS", "PdStack", "StreamResult", "kvbaton_kv_config", "nixl_kv_config", "post_json",
    "stop_group", "stream_request", "usage_back_to_zero", "wait_port",
]


# ---------------------------------------------------------------------- configs

def kvbaton_kv_config(cp: str, engine_id: str, stats_dir: Path | str, *, mode: str = "pull",
                      timeout_s: float = 20.0, kv_role: str = "kv_both",
                      extra: dict[str, Any] | None = None) -> str:
    """``--kv-transfer-config`` for the kvbaton connector on loopback.

    ``recompute`` (not vLLM's default ``fail``) so a transfer that did not happen costs a
    local prefill instead of an HTTP 500; ``timeout_s`` bounds every hold and wait.
    ``extra`` adds/overrides ``kv_connector_extra_config`` keys (e.g. ``verify_kv``)."""
    return json.dumps({
        "kv_connector": "KvbatonConnector",
        "kv_connector_module_path": "kvbaton.connector.kvbaton_connector",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "control_plane": cp, "mode": mode, "engine_id": engine_id, "timeout_s": timeout_s,
            "stats_dir": str(stats_dir), "ucx_net_devices": "lo", "ucx_tls": "tcp,self,sm",
            **(extra or {}),
        },
    })


#: PdStack ``connector`` value -> (vLLM connector class, ``kv_connector_extra_config``).
NIXL_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "nixl": ("NixlConnector", {}),
    "nixl-push": ("NixlPushConnector", {}),
    "nixl-bidir": ("NixlConnector", {"bidirectional_kv_xfer": True}),
}


def nixl_kv_config(variant: str = "nixl", engine_id: str | None = None) -> str:
    """``--kv-transfer-config`` for one of vLLM's own NIXL connectors with host (CPU) buffers.

    ``engine_id`` is fixed for push: D's ``kv_transfer_params`` must name P's engine
    before P has answered (both legs are sent at once), so the proxy has to know it."""
    name, extra = NIXL_VARIANTS[variant]
    cfg: dict[str, Any] = {"kv_connector": name, "kv_role": "kv_both", "kv_buffer_device": "cpu",
                           "kv_load_failure_policy": "recompute"}
    if extra:
        cfg["kv_connector_extra_config"] = dict(extra)
    if engine_id is not None:
        cfg["engine_id"] = engine_id
    return json.dumps(cfg)


def _nixl_env(side_channel_port: int) -> dict[str, str]:
    """Loopback UCX for NixlConnector (measured working on the CPU build)."""
    return {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            "UCX_TLS": "tcp,self,sm", "UCX_NET_DEVICES": "lo"}


# ---------------------------------------------------------------------- processes

def revoke_lease(cp_address: str, conversation_id: str, reason: str = "test done") -> None:
    """Revoke a conversation's lease (if any) so decode frees its retained blocks; a lease
    already gone is fine (tests call it in cleanup)."""
    import asyncio

    from kvbaton.client import KvbatonClient
    from kvbaton.v1 import lease_pb2

    async def go() -> None:
        async with KvbatonClient(cp_address) as kv:
            with contextlib.suppress(Exception):
                await kv.lease.Revoke(lease_pb2.RevokeRequest(conversation_id=conversation_id, reason=reason),
                                      timeout=5)
    asyncio.run(go())


def _cores(tp: int, first: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an engine: one core, or one core per TP rank
    (``0|1``: rank 0 on core 0, rank 1 on core 1; ranks share cores beyond the machine's)."""
    n = os.cpu_count() or 1
    if tp <= 1:
        return str(first % n)
    return "|".join(str((first + r) % n) for r in range(tp))


def _tp_args(tp: int) -> list[str]:
    return ["--tensor-parallel-size", str(tp)] if tp > 1 else []


# ---------------------------------------------------------------------- HTTP

def post_json(url: str, body: dict[str, Any], timeout_s: float = 120.0,
              headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """POST JSON; (status, body) also for HTTP errors, so callers can assert on them."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def token_ids(seed: int, n: int) -> list[int]:
    """``n`` reproducible token ids of the tiny model's vocabulary (a prompt no two callers
    share by accident: give each its own seed)."""
    rnd = random.Random(seed)
    return [rnd.randrange(10, 4000) for _ in range(n)]


def completion_body(prompt: list[int], max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body for the tiny model that returns token ids (what an
    answer is compared by: exactly ``max_tokens`` of them, EOS ignored)."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}


@dataclasses.dataclass
class StreamResult:
    """A streamed completion as the client saw it."""

    text: str
    ttft_s: float  # to the first chunk carrying text (-1 if none)
    total_s: float
    chunk_times_s: list[float]  # arrival of every text-carrying chunk, from the request start
    n_tokens: int = 0  # completion tokens (the server's usage count; chunks if it sent none)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last token - first token) / (tokens - 1).

        Counted in tokens, not chunks: vLLM merges several tokens into one chunk when the
        reader lags, so chunk gaps would overstate it (this is vLLM's benchmark definition)."""
        t = self.chunk_times_s
        return (t[-1] - t[0]) / (self.n_tokens - 1) if t and self.n_tokens > 1 else None


def stream_request(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> StreamResult:
    """Stream ``/v1/completions`` or ``/v1/chat/completions`` and time every chunk.

    ``timeout_s`` is urllib's per-socket-read timeout: a stalled stream raises instead
    of hanging. Raises ``urllib.error.HTTPError`` on a non-200 answer."""
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    times: list[float] = []
    text: list[str] = []
    n_tokens = 0
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                n_tokens = int(chunk["usage"].get("completion_tokens") or 0)
            if not chunk.get("choices"):
                continue
            ch = chunk["choices"][0]
            piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            if piece:
                times.append(time.perf_counter() - t0)
                text.append(piece)
    return StreamResult("".join(text), times[0] if times else -1.0, time.perf_counter() - t0, times,
                        n_tokens or len(times))


def usage_back_to_zero(srv: VllmServer, timeout_s: float = 15.0) -> float:
    """Poll ``vllm:kv_cache_usage_perc`` until 0 (nothing held or leaked) or ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        u = srv.metric("vllm:kv_cache_usage_perc") or 0.0
        if u == 0.0 or time.monotonic() > deadline:
            return u
        time.sleep(0.2)


# ---------------------------------------------------------------------- the stack

class PdStack(StackBase):
    """Control plane (kvbaton only) + P on core 0 + D on core 1 + one router per mode.

    Args:
        model: model directory (``kvbaton.tinymodel.ensure_tiny_model``).
        workdir: logs and connector stats go here.
        connector: ``"kvbaton"``, or one of vLLM's :data:`NIXL_VARIANTS` (``"nixl"`` pull,
            ``"nixl-push"``, ``"nixl-bidir"``); the latter three get no routers.
        router_modes: a router subprocess is started for each (``"pull"``, ``"push"``).
        timeout_s: the kvbaton connector's hold/wait bound (``timeout_s`` extra config).
        engine_args: extra vLLM arguments (after :func:`small_engine_args`).
        startup_timeout_s: per engine; generous because a loaded box was seen at >8 min.
        extra_config: extra ``kv_connector_extra_config`` keys for both kvbaton engines
            (e.g. ``{"verify_kv": True}``).
        prefill_args: extra vLLM arguments for the prefill engine only (e.g.
            ``--no-enable-prefix-caching``, so reused history really comes from decode).
        router_control_plane: routers get ``--control-plane`` (conversation reuse).
        store: the control plane's ``--store`` (None: its default, in memory).
        security: mutual TLS + tokens everywhere (:class:`StackSecurity`, kvbaton only);
            the routers then also name the pair (``--prefill-engine-id``/``--decode-engine-id``:
            under tokens a push must be bound to both engines).
        prefill_tp, decode_tp: ``--tensor-parallel-size`` of each engine; a TP > 1 engine gets
            one core per rank (``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
        engine_env, engine_nice: extra environment and the niceness of both engines'
            process trees (a TP > 1 engine spins between steps; see tests/e2e/test_tp_vllm.py).
        prefill_nice, decode_nice, prefill_env, decode_env: the same per role (a niceness
            overrides ``engine_nice``, an environment is added to ``engine_env``).

    Use as a context manager; :meth:`stop` is idempotent and stops everything started,
    also after a failed start.
    """

    def __init__(self, model: Path | str, workdir: Path | str, *, connector: str = "kvbaton",
                 router_modes: Sequence[str] = ("pull", "push"), timeout_s: float = 20.0,
                 engine_args: Sequence[str] = (), startup_timeout_s: float = 600.0,
                 prefill_id: str = "p0", decode_id: str = "d0",
                 extra_config: dict[str, Any] | None = None, prefill_args: Sequence[str] = (),
                 router_control_plane: bool = False, store: str | None = None,
                 security: StackSecurity | None = None, prefill_tp: int = 1, decode_tp: int = 1,
                 engine_env: dict[str, str] | None = None, engine_nice: int = 0,
                 prefill_nice: int | None = None, decode_nice: int | None = None,
                 prefill_env: dict[str, str] | None = None, decode_env: dict[str, str] | None = None) -> None:
        if connector != "kvbaton" and connector not in NIXL_VARIANTS:
            raise ValueError(f"connector must be kvbaton or one of {list(NIXL_VARIANTS)}, got {connector!r}")
        if security is not None and connector != "kvbaton":
            raise ValueError("security applies to the kvbaton connector's control plane only")
        super().__init__(workdir, startup_timeout_s=startup_timeout_s, security=security)
        self.model = Path(model)
        self.connector = connector
        self.router_modes = list(router_modes)
        self.timeout_s = timeout_s
        self.engine_args = list(engine_args)
        self.prefill_id, self.decode_id = prefill_id, decode_id
        self.extra_config = dict(extra_config or {})
        self.prefill_args = list(prefill_args)
        self.router_control_plane = router_control_plane  # routers get --control-plane (reuse)
        self.store = store
        self.tp = {"prefill": max(int(prefill_tp), 1), "decode": max(int(decode_tp), 1)}
        self.engine_env = dict(engine_env or {})  # extra environment for both engines
        self.engine_nice = engine_nice  # both engines' process trees (VllmServer ``nice``)
        #: per role, overriding ``engine_nice`` / adding to ``engine_env``
        self.nice = {"prefill": engine_nice if prefill_nice is None else prefill_nice,
                     "decode": engine_nice if decode_nice is None else decode_nice}
        self.role_env = {"prefill": dict(prefill_env or {}), "decode": dict(decode_env or {})}
        self.p: VllmServer | None = None
        self.d: VllmServer | None = None
        self.routers: dict[str, str] = {}  # mode -> base URL
        self.side_channel_ports: dict[str, int] = {}  # engine id -> NIXL side-channel port (nixl*)

    # ------------------------------------------------------------------ lifecycle
    def engines(self) -> tuple[VllmServer, VllmServer]:
        """(prefill, decode) of a started stack."""
        if self.p is None or self.d is None:
            raise RuntimeError("the P/D stack is not started")
        return self.p, self.d

    def _start(self) -> None:
        envs: list[dict[str, str]] = [{"VLLM_CPU_OMP_THREADS_BIND": _cores(self.tp["prefill"], 0)},
                                      {"VLLM_CPU_OMP_THREADS_BIND": _cores(self.tp["decode"], 1)}]
        for env, role in zip(envs, ("prefill", "decode")):
            env.update(self.engine_env)
            env.update(self.role_env[role])
        if self.connector == "kvbaton":
            self.cp_address = self._start_control_plane("cp", self.store)
            sec = self.security
            configs = [kvbaton_kv_config(self.cp_address, eid, self.stats_dir, timeout_s=self.timeout_s,
                                         extra={**(sec.connector_config(eid) if sec else {}), **self.extra_config})
                       for eid in (self.prefill_id, self.decode_id)]
        else:
            ids = (self.prefill_id, self.decode_id)
            configs = ([nixl_kv_config()] * 2 if self.connector == "nixl"
                       else [nixl_kv_config(self.connector, eid) for eid in ids])
            for eid, env in zip(ids, envs):
                self.side_channel_ports[eid] = free_port()
                env.update(_nixl_env(self.side_channel_ports[eid]))
        self.p, self.d = (
            VllmServer(self.model, extra_args=[*small_engine_args(), *self.engine_args,
                                               *(self.prefill_args if name == "prefill" else ()),
                                               *_tp_args(self.tp[name]),
                                               "--kv-transfer-config", c],
                       env=env, log_path=self.workdir / f"{name}.log", served_model_name="tiny",
                       startup_timeout_s=self.startup_timeout_s, nice=self.nice[name])
            for name, c, env in (("prefill", configs[0], envs[0]), ("decode", configs[1], envs[1])))
        self._servers = [self.p, self.d]
        self._start_servers()
        for mode in self.router_modes:
            cp_flag = ["--control-plane", self.cp_address] if self.cp_address and self.router_control_plane else []
            bind = (["--prefill-engine-id", self.prefill_id, "--decode-engine-id", self.decode_id]
                    if self.security is not None else [])
            self.routers[mode] = self._spawn_router(f"router-{mode}", [
                "--prefill", self.p.base_url, "--decode", self.d.base_url, "--mode", mode, *cp_flag, *bind])

    def rendezvous(self) -> Any:
        """A synchronous Rendezvous stub (tests poll transfer phases with it)."""
        import grpc

        from kvbaton.v1 import rendezvous_pb2_grpc

        if self._channel is None:
            sec = self.security
            self._channel = grpc.insecure_channel(self.cp_address) if sec is None else grpc.secure_channel(
                self.cp_address, grpc.composite_channel_credentials(
                    grpc.ssl_channel_credentials(Path(sec.ca).read_bytes(), Path(sec.key("operator")).read_bytes(),
                                                 Path(sec.cert("operator")).read_bytes()),
                    grpc.access_token_call_credentials(sec.token("operator"))))
        return rendezvous_pb2_grpc.RendezvousStub(self._channel)

    def transfer_phase(self, transfer_id: str) -> str:
        """Phase name of ``transfer_id`` (e.g. ``"OFFERED"``), ``""`` if the plane has none."""
        import grpc

        from kvbaton.v1 import rendezvous_pb2

        try:
            st = self.rendezvous().GetTransfer(rendezvous_pb2.GetTransferRequest(transfer_id=transfer_id),
                                               timeout=2.0)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return ""
            raise
        return rendezvous_pb2.TransferPhase.Name(st.phase).removeprefix("TRANSFER_PHASE_")

    def wait_phase(self, transfer_id: str, phases: Sequence[str], timeout_s: float = 10.0) -> str:
        """Poll until ``transfer_id`` is in one of ``phases``; raise TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            ph = self.transfer_phase(transfer_id)
            if ph in phases:
                return ph
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfer {transfer_id} in phase {ph or 'none'!r}, wanted {list(phases)}")
            time.sleep(0.02)
