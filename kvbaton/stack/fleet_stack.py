"""Start and stop a fleet: a control plane, N prefill and M decode vLLM engines that
register their ``serve_url`` and role, and K routers that discover them (issue 13).

Shared by ``kvbaton.fleet_demo`` (the main job), ``tests/e2e/test_fleet_vllm.py`` and
``benchmarks/fleet.py``. Same rules as :mod:`kvbaton.stack.pd_stack`: every child in its own
session (a stop kills its tree), every wait bounded, engines started in parallel and
pinned by role (prefill engines on core 0, decode engines on core 1:
``VLLM_CPU_OMP_THREADS_BIND``), the connectors' stats files are what says KV moved.

Why by role: a NIXL READ over UCX/TCP needs the engine that owns the bytes to make
progress; with a prefill and the decode it reads from on one core, a reuse READ took
13-22 s instead of 0.2-0.6 s (measured, fleet_demo, alternate pinning).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from kvbaton.stack.base import StackBase
from kvbaton.stack.pd_stack import kvbaton_kv_config
from kvbaton.stack.ports import free_port
from kvbaton.stack.security import StackSecurity
from kvbaton.stack.vllm_server import VllmServer, small_engine_args

if TYPE_CHECKING:
    from kvbaton.client import KvbatonClient

__all__ = ["FleetStack", "LeaseWaiter", "await_leased", "stream_tokens", "wait_leased"]


class FleetStack(StackBase):
    """Control plane + ``n_prefill`` + ``n_decode`` kvbaton engines + ``n_routers`` routers.

    Args:
        model: model directory (``kvbaton.tinymodel.ensure_tiny_model``).
        workdir: logs and connector stats.
        mode: the routers' and connectors' P/D mode (``pull`` or ``push``).
        store: the control plane's ``--store`` (``memory://`` default; ``etcd://h:p`` for
            replicas sharing state, ``etcds://`` over TLS with ``security``).
        n_cp: control-plane processes (replicas over the same store; etcd only).
        extra_config: extra ``kv_connector_extra_config`` for every engine.
        engine_args: extra vLLM arguments for every engine.
        role_args: extra vLLM arguments by role (``{"prefill": [...], "decode": [...]}``),
            after ``engine_args`` (a later flag wins: e.g. a smaller prefill KV cache).
        router_args: extra router arguments (e.g. ``["--slack", "2"]``).
        static_routers: routers get ``--prefill ID=URL`` / ``--decode ID=URL`` lists instead
            of discovering engines (a fleet without discovery).
        security: mutual TLS + tokens between every process and the control plane
            (:class:`~kvbaton.stack.security.StackSecurity`: a certificate and token per
            engine id, ``router`` and ``operator``); None: plaintext on loopback.
    """

    def __init__(self, model: Path | str, workdir: Path | str, *, n_prefill: int = 2, n_decode: int = 2,
                 n_routers: int = 1, mode: str = "pull", store: str = "memory://", n_cp: int = 1,
                 timeout_s: float = 20.0, extra_config: dict[str, Any] | None = None,
                 engine_args: Sequence[str] = (), router_args: Sequence[str] = (),
                 role_args: Mapping[str, Sequence[str]] | None = None,
                 static_routers: bool = False, startup_timeout_s: float = 600.0,
                 security: StackSecurity | None = None) -> None:
        super().__init__(workdir, startup_timeout_s=startup_timeout_s, security=security)
        self.model = Path(model)
        self.mode = mode
        self.n_routers = n_routers
        self.store = store
        self.n_cp = n_cp
        self.timeout_s = timeout_s
        self.extra_config = dict(extra_config or {})
        self.engine_args = list(engine_args)
        self.role_args = {k: list(v) for k, v in (role_args or {}).items()}
        self.router_args = list(router_args)
        self.static_routers = static_routers
        self.prefill_ids = [f"p{i}" for i in range(n_prefill)]
        self.decode_ids = [f"d{i}" for i in range(n_decode)]
        self.cp_addresses: list[str] = []
        self.engines: dict[str, VllmServer] = {}
        self.routers: list[str] = []

    def _start(self) -> None:
        for i in range(self.n_cp):
            self.cp_addresses.append(self._start_control_plane(f"cp{i}", self.store))
        self.cp_address = ",".join(self.cp_addresses)
        sec = self.security
        ids = self.prefill_ids + self.decode_ids
        for eid in ids:
            port = free_port()
            role = "prefill" if eid in self.prefill_ids else "decode"
            cfg = kvbaton_kv_config(self.cp_address, eid, self.stats_dir, mode=self.mode, timeout_s=self.timeout_s,
                                    extra={"serve_url": f"http://127.0.0.1:{port}", "serve_role": role,
                                           **(sec.connector_config(eid) if sec else {}), **self.extra_config})
            self.engines[eid] = VllmServer(
                self.model, port=port, served_model_name="tiny", startup_timeout_s=self.startup_timeout_s,
                extra_args=[*small_engine_args(), *self.engine_args, *self.role_args.get(role, ()),
                            "--kv-transfer-config", cfg],
                env={"VLLM_CPU_OMP_THREADS_BIND": "0" if role == "prefill" else "1"},
                log_path=self.workdir / f"{eid}.log")
        self._servers = list(self.engines.values())
        self._start_servers()
        for _ in range(self.n_routers):
            self.add_router()

    def add_router(self, *extra: str) -> str:
        """One more router (same control plane); returns its base URL."""
        engines: list[str] = []
        if self.static_routers:
            for eid in self.prefill_ids:
                engines += ["--prefill", f"{eid}={self.engines[eid].base_url}"]
            for eid in self.decode_ids:
                engines += ["--decode", f"{eid}={self.engines[eid].base_url}"]
        # Router i talks to control-plane replica i first (replicas share the store).
        i = len(self.routers) % len(self.cp_addresses)
        cps = ",".join(self.cp_addresses[i:] + self.cp_addresses[:i])
        url = self._spawn_router(f"router{len(self.routers)}", [
            *engines, "--mode", self.mode, "--control-plane", cps,
            *(["--no-discover"] if self.static_routers else []), *self.router_args, *extra])
        self.routers.append(url)
        return url

    def warm_up(self) -> None:
        """One short request to every engine directly (vLLM's first request is slow), so
        that the first measured turn is not."""
        for srv in self.engines.values():
            srv.post_json("/v1/completions", {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 2}, timeout_s=300)

    # ------------------------------------------------------------------ observing
    def wait_routers_see(self, n_prefill: int, n_decode: int, timeout_s: float = 30.0) -> None:
        """Until every router routes over that many engines of each role (bounded)."""
        import urllib.request

        deadline = time.monotonic() + timeout_s
        for url in self.routers:
            while True:
                with urllib.request.urlopen(f"{url}/kvbaton/fleet", timeout=5) as r:
                    view = json.loads(r.read())
                engines = view["engines"]
                p = sum(1 for e in engines if e["routable"] and e["role"] in ("prefill", "both"))
                d = sum(1 for e in engines if e["routable"] and e["role"] in ("decode", "both"))
                if p >= n_prefill and d >= n_decode:
                    break
                if time.monotonic() > deadline:
                    # What it saw (why an engine is not routable) and what it follows.
                    seen = [{k: e.get(k) for k in ("engine_id", "role", "routable", "suspect", "draining", "ranks")}
                            for e in engines]
                    # And what the registrar lists: an engine missing there is not registered
                    # (its connector's keeper), not missing from the router's view.
                    raise TimeoutError(f"router {url} sees {p} prefill / {d} decode engines: {seen}; "
                                       f"discovery {view.get('discovery')}; "
                                       f"the registrar lists {sorted(self.registered())}")
                time.sleep(0.1)

    def registered(self) -> set[str]:
        """The engine ids the registrar lists now (as the operator, every page)."""
        import asyncio

        async def go() -> set[str]:
            async with self.client() as kv:
                listed, _, _ = await kv.list_engines_at()
                return {r.engine_id for r in listed}
        return asyncio.run(go())


def stream_tokens(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                  timeout_s: float = 120.0) -> dict[str, Any]:
    """Stream ``/v1/completions`` (``return_token_ids``) and return the output token ids,
    the time to the first token, the total time, the router's ``X-Kvbaton-*`` and
    ``Server-Timing`` headers, and ``done``: whether the stream ended with ``data: [DONE]``
    (a stream the router cut mid-answer just ends: urllib reads that as a normal end).
    Raises ``urllib.error.HTTPError`` on a non-200 answer."""
    import urllib.request

    payload = {**body, "stream": True, "return_token_ids": True}
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    t0 = time.perf_counter()
    ttft = -1.0
    ids: list[int] = []
    done = False
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        kv_headers = {k: v for k, v in r.headers.items()
                      if k.lower().startswith("x-kvbaton-") or k.lower() == "server-timing"}
        for raw in r:
            line = raw.decode().strip()
            done = done or line == "data: [DONE]"
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for ch in chunk.get("choices") or ():
                got = ch.get("token_ids") or []
                if got and ttft < 0:
                    ttft = time.perf_counter() - t0
                ids.extend(got)
    return {"token_ids": ids, "ttft_s": ttft, "total_s": time.perf_counter() - t0, "headers": kv_headers,
            "done": done}


async def await_leased(kv: KvbatonClient, conv: str, num_tokens: int, timeout_s: float = 10.0) -> str | None:
    """Until decode's retention of ``conv`` covers ``num_tokens`` and is under a live lease
    (decode registers it just after the answer), over an open client; returns the holding
    engine, or None if that did not happen within ``timeout_s``."""
    import asyncio

    from kvbaton.v1 import lease_pb2, registrar_pb2

    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        call_s = max(0.05, min(2.0, left))
        try:
            lease = await kv.lease.Get(lease_pb2.GetLeaseRequest(conversation_id=conv), timeout=call_s)
            ret = (await kv.registrar.LookupRetained(
                registrar_pb2.LookupRetainedRequest(conversation_id=conv), timeout=call_s)).retained
            if (lease.state == lease_pb2.LEASE_STATE_ACTIVE and ret.num_tokens >= num_tokens
                    and lease.retention_id == ret.retention_id):
                return ret.engine_id
        except grpc.aio.AioRpcError as exc:
            # NOT_FOUND: not there yet. DEADLINE_EXCEEDED: a control plane starved of
            # CPU for one call (seen at load 20 on the 2-core box, killing a whole
            # benchmark run); ask again until this wait's own deadline.
            if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
        await asyncio.sleep(0.05)
    return None


def wait_leased(cp: str, conv: str, num_tokens: int, timeout_s: float = 10.0, *,
                client: Callable[[], KvbatonClient] | None = None) -> str | None:
    """:func:`await_leased` from synchronous code, over a client opened for this one wait.
    ``client`` makes the control-plane client (e.g. a secured stack's
    :meth:`~kvbaton.stack.base.StackBase.client`); default: plaintext to ``cp``."""
    with LeaseWaiter(cp, client) as waiter:
        return waiter.wait(conv, num_tokens, timeout_s)


class LeaseWaiter:
    """:func:`await_leased` from one synchronous thread, over one client and event loop it
    keeps. Why: a benchmark that waits after every turn of every conversation would
    otherwise open a channel (and an event loop) per wait, and that CPU competes with the
    engines being measured — only in the arm that waits. Use as a context manager."""

    def __init__(self, cp: str, client: Callable[[], KvbatonClient] | None = None) -> None:
        import asyncio

        from kvbaton.client import KvbatonClient

        async def open_client() -> KvbatonClient:  # a grpc.aio channel is made inside its loop
            kv = client() if client is not None else KvbatonClient(cp)
            await kv.__aenter__()
            return kv

        self._runner = asyncio.Runner()
        self._kv = self._runner.run(open_client())

    def wait(self, conv: str, num_tokens: int, timeout_s: float = 10.0) -> str | None:
        return self._runner.run(await_leased(self._kv, conv, num_tokens, timeout_s))

    def close(self) -> None:
        try:
            self._runner.run(self._kv.__aexit__(None, None, None))
        finally:
            self._runner.close()

    def __enter__(self) -> LeaseWaiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
