"""The one-pair e2e rig: a started :class:`~kvbaton.stack.pd_stack.PdStack` as the vLLM
e2e tests talk to it (requests by token ids, the connectors' stats events, the
conversation's lease and retention, test-only faults).

Why one: the reuse, KV-verify, staging and secure e2e files each had their own copy of
these helpers (and of the stack start-up); a secured stack is the same rig with
credentials, so everything here goes through the stack (its client and CLI flags
carry the operator's certificate and token when it has them).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

from kvbaton.stack.pd_stack import PdStack, post_json
from kvbaton.stack.procs import KVBATON
from kvbaton.stack.vllm_server import VllmServer

BLOCK = 128  # tokens per KV block of the tiny model's engines


def ids(seed: int, n: int) -> list[int]:
    """``n`` reproducible token ids (a prompt no two tests share by accident)."""
    rnd = random.Random(seed)
    return [rnd.randrange(10, 4000) for _ in range(n)]


def retained_tokens(prompt_len: int, max_tokens: int = 40) -> int:
    """Full blocks of prompt+output whose KV decode computed (the last token's is not)."""
    return (prompt_len + max_tokens - 1) // BLOCK * BLOCK


class PdRig:
    """Requests, events and control-plane checks over one started P/D stack.

    ``fault_file``: the connectors' ``fault_file`` (test-only faults, see
    ``connector/flows/faults.py``), when the stack was started with one."""

    def __init__(self, stack: PdStack, fault_file: Path | None = None) -> None:
        self.s = stack
        self.fault_file = fault_file

    @property
    def p(self) -> VllmServer:
        return self.s.engines()[0]

    @property
    def d(self) -> VllmServer:
        return self.s.engines()[1]

    @property
    def cp(self) -> str:
        return self.s.cp_address

    # ---------------------------------------------------------------- faults
    def faults(self, **conf: Any) -> None:
        assert self.fault_file is not None, "the stack has no fault_file"
        tmp = self.fault_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(conf))
        os.replace(tmp, self.fault_file)  # atomic: a reader never sees half a file

    def no_faults(self) -> None:
        if self.fault_file is not None:
            self.fault_file.unlink(missing_ok=True)

    # ---------------------------------------------------------------- requests
    @staticmethod
    def body(prompt: list[int], max_tokens: int = 40, **extra: Any) -> dict[str, Any]:
        return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, **extra}

    def single(self, prompt: list[int], max_tokens: int = 40) -> list[int]:
        """Greedy output ids of the prefill engine alone (no connector params)."""
        status, raw = post_json(f"{self.p.base_url}/v1/completions", self.body(prompt, max_tokens), 120)
        assert status == 200, raw[:500]
        return json.loads(raw)["choices"][0]["token_ids"]

    def via(self, mode: str, prompt: list[int], conv: str = "", *, header: bool = False) -> dict[str, Any]:
        """The ``mode`` router's answer; ``conv`` goes in the body (``conversation_id``) or,
        with ``header``, as ``X-Conversation-Id``."""
        body = self.body(prompt, **({"conversation_id": conv} if conv and not header else {}))
        url = f"{self.s.routers[mode]}/v1/completions"
        status, raw = post_json(url, body, 120, headers={"X-Conversation-Id": conv} if header and conv else None)
        assert status == 200, f"POST {url} -> {status}: {raw[:1000]!r}"
        return json.loads(raw)

    def tokens(self, mode: str, prompt: list[int], conv: str = "") -> list[int]:
        """Output ids of :meth:`via`."""
        return self.via(mode, prompt, conv)["choices"][0]["token_ids"]

    # ---------------------------------------------------------------- events
    def events(self, engine: str, event: str, part: str = "worker", **match: Any) -> list[dict[str, Any]]:
        return self.s.events(engine, event, part=part, **match)

    def wait_events(self, engine: str, event: str, since: int, n: int = 1, timeout_s: float = 10.0,
                    **match: Any) -> list[dict[str, Any]]:
        """Until ``n`` such events after line ``since`` (or ``timeout_s``); what there is."""
        return self.s.wait_events(engine, event, since, n, timeout_s, **match)

    # ---------------------------------------------------------------- control plane
    def lease(self, conv: str) -> tuple[Any, Any]:
        """(lease info or None, retained registration or None) of a conversation."""
        import grpc

        from kvbaton.v1 import lease_pb2, registrar_pb2

        async def go() -> tuple[Any, Any]:
            async with self.s.client() as kv:
                res: list[Any] = []
                for coro in (kv.lease.Get(lease_pb2.GetLeaseRequest(conversation_id=conv), timeout=5),
                             kv.registrar.LookupRetained(registrar_pb2.LookupRetainedRequest(conversation_id=conv),
                                                         timeout=5)):
                    try:
                        res.append(await coro)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() != grpc.StatusCode.NOT_FOUND:
                            raise
                        res.append(None)
                return res[0], (res[1].retained if res[1] is not None else None)
        return asyncio.run(go())

    def wait_leased(self, conv: str, num_tokens: int, timeout_s: float = 10.0) -> tuple[Any, Any]:
        """Until decode's registration of ``num_tokens`` is protected by an ACTIVE lease;
        (lease, retained registration)."""
        from kvbaton.v1 import lease_pb2

        deadline = time.monotonic() + timeout_s
        while True:
            lease, ret = self.lease(conv)
            if (lease is not None and ret is not None and lease.state == lease_pb2.LEASE_STATE_ACTIVE
                    and ret.num_tokens == num_tokens and lease.retention_id == ret.retention_id):
                return lease, ret
            assert time.monotonic() < deadline, (conv, lease, ret)
            time.sleep(0.05)

    def renew(self, conv: str) -> Any:
        """Renew the conversation's lease as its agent would (its own TTL from now); the
        lease as renewed."""
        from kvbaton.v1 import lease_pb2

        async def go() -> Any:
            async with self.s.client() as kv:
                return await kv.lease.Renew(lease_pb2.RenewRequest(conversation_id=conv), timeout=5)
        res = asyncio.run(go())
        assert res.status == lease_pb2.RENEW_STATUS_OK, res
        return res.lease

    def wait_retained(self, conv: str, timeout_s: float = 10.0) -> None:
        """Until decode registered some retained blocks of ``conv``."""
        deadline = time.monotonic() + timeout_s
        while (ret := self.lease(conv)[1]) is None or not ret.block_ids:
            assert time.monotonic() < deadline, f"{conv}: no retention registered"
            time.sleep(0.05)

    @staticmethod
    def reuse_params(conv: str, lease: Any, ret: Any) -> dict[str, Any]:
        """What the router hands prefill (``kv_transfer_params.reuse``), built by hand so a
        test can send the READ-ing request straight to prefill."""
        return {"conversation_id": conv, "engine_id": ret.engine_id, "lease_id": lease.lease_id,
                "retention_id": ret.retention_id, "block_ids": list(ret.block_ids), "num_tokens": ret.num_tokens,
                "tokens_per_block": ret.tokens_per_block, "block_hashes": [h.hex() for h in ret.block_hashes]}

    def revoke(self, conv: str, reason: str = "test done") -> None:
        """Revoke a conversation's lease (if any) so decode frees its retained blocks."""
        import grpc

        from kvbaton.v1 import lease_pb2

        async def go() -> None:
            async with self.s.client() as kv:
                try:
                    await kv.lease.Revoke(lease_pb2.RevokeRequest(conversation_id=conv, reason=reason), timeout=5)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise
        asyncio.run(go())

    def kvbaton(self, who: str, *args: str, token: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the ``kvbaton`` CLI as ``who`` (on a secured stack: its certificate, and its
        token unless ``token`` is false)."""
        sec = self.s.security
        creds = [] if sec is None else sec.client_args(who, token=token)
        env = None if sec is None else sec.child_env()
        return subprocess.run([KVBATON, *args, "--addr", self.cp, *creds], capture_output=True, text=True,
                              timeout=60, env=env)

    # ---------------------------------------------------------------- engines
    def d_usage(self) -> float:
        """Decode's KV usage after a 1-token request (an idle engine frees ended leases at
        its next step, connector/reuse.py)."""
        status, raw = post_json(f"{self.d.base_url}/v1/completions",
                                {"model": "tiny", "prompt": [5], "max_tokens": 1}, 30)
        assert status == 200, raw[:300]
        time.sleep(0.3)
        return self.d.metric("vllm:kv_cache_usage_perc") or 0.0

    def restart(self, which: str) -> None:
        """Start a killed engine again (``"p"`` or ``"d"``) with the same arguments."""
        srv = self.p if which == "p" else self.d
        srv.stop()  # its group is dead already: reaps and verifies nothing is left
        srv.start()

