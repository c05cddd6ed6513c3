"""A conversational turn is answered once decode's retention of it is visible.

Why: decode keeps a finished turn's KV (``connector/reuse.py``) by registering the blocks
(``Registrar.RegisterRetained``) and leasing them (``Lease.Grant``) from its control thread,
*after* the answer left the engine (the engine loop never waits on the network). The answer
says ``kv_transfer_params.retained`` with ``"lease": "pending"``. A client acts on the answer
at once: an agent sends its next turn milliseconds later, and ends the conversation
(``Lease.Revoke``) right after the last one. Both raced decode's two calls, and under load
(the session-20 CI runs) lost:

* the next turn's lookup found the registration without its lease (or the previous turn's
  lease, which no longer protects the newest registration), so nothing was offered and
  prefill recomputed the whole history (``test_reuse_read_is_staged``: no reuse READ);
* a revoke that landed before the Grant ended the *previous* lease; the Grant then made a
  new one, and decode held the last turn's blocks for a whole TTL after the client had ended
  the conversation (``test_tp_vllm`` P2->D1: 3 of 255 blocks held 20 s after the revoke).

So the router holds a complete (non-streaming) answer that carries a pending retention until
that registration (same engine, blocks and tokens) is protected by an ACTIVE lease, and then
says so in the answer (``"lease": "granted"``, with ``lease_id`` and ``retention_id``): what
the client does next is ordered after the Grant. The wait is bounded (``retain_wait_s``); past
it, or with the control plane unreachable, the answer goes out as decode gave it, counted.
A streamed answer carries no ``kv_transfer_params`` (vLLM), so it is not held.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc

from kvbaton import params
from kvbaton.v1 import lease_pb2, registrar_pb2

#: first and longest pause between two looks at the control plane while waiting
_FIRST_PAUSE_S = 0.002
_MAX_PAUSE_S = 0.05


def pending_retention(answer: Any) -> dict[str, Any] | None:
    """The ``retained`` record of a decode answer whose lease is still pending, else None."""
    if not isinstance(answer, dict):
        return None
    ktp = answer.get("kv_transfer_params")
    ret = ktp.get(params.RETAINED) if isinstance(ktp, dict) else None
    if not isinstance(ret, dict) or ret.get("lease") != "pending":
        return None
    if not ret.get("conversation_id") or not ret.get("engine_id") or not isinstance(ret.get("block_ids"), list):
        return None
    return ret


def _protects(ret: dict[str, Any], found: registrar_pb2.RetainedBlocks, lease: lease_pb2.LeaseInfo) -> bool:
    """The registration is the one decode reported, and an ACTIVE lease protects it."""
    return (found.engine_id == ret["engine_id"] and list(found.block_ids) == [int(b) for b in ret["block_ids"]]
            and found.num_tokens == int(ret.get("num_tokens") or 0)
            and lease.state == lease_pb2.LEASE_STATE_ACTIVE and lease.retention_id == found.retention_id
            and lease.engine_id == found.engine_id)


async def wait_visible(kv: Any, ret: dict[str, Any], wait_s: float, call_timeout_s: float) -> lease_pb2.LeaseInfo | None:
    """Until the reported retention is leased (its lease), or None after ``wait_s`` or as
    soon as the control plane is unreachable (waiting longer would only delay the answer)."""
    conv = str(ret["conversation_id"])
    deadline = time.monotonic() + wait_s
    pause = _FIRST_PAUSE_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        t = max(0.05, min(call_timeout_s, left))
        found: Any
        lease: Any
        found, lease = await asyncio.gather(
            kv.registrar.LookupRetained(registrar_pb2.LookupRetainedRequest(conversation_id=conv), timeout=t),
            kv.lease.Get(lease_pb2.GetLeaseRequest(conversation_id=conv), timeout=t),
            return_exceptions=True)
        errors = [x for x in (found, lease) if isinstance(x, BaseException)]
        if any(isinstance(x, grpc.aio.AioRpcError) and x.code() == grpc.StatusCode.UNAVAILABLE for x in errors):
            return None
        if not errors and _protects(ret, found.retained, lease):
            return lease
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        await asyncio.sleep(min(pause, left))
        pause = min(pause * 2, _MAX_PAUSE_S)


async def settle(kv: Any, body: bytes, wait_s: float, call_timeout_s: float) -> tuple[bytes, str]:
    """The answer to send and what happened: ``""`` (nothing pending), ``"granted"`` (the
    answer now names the lease) or ``"not_visible"`` (sent as decode gave it)."""
    try:
        answer = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body, ""
    ret = pending_retention(answer)
    if ret is None or kv is None or wait_s <= 0:
        return body, ""
    lease = await wait_visible(kv, ret, wait_s, call_timeout_s)
    if lease is None:
        return body, "not_visible"
    ret.update(lease="granted", lease_id=lease.lease_id, retention_id=lease.retention_id)
    return json.dumps(answer).encode(), "granted"
