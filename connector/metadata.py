"""Per-step messages from the kvbaton scheduler connector to its worker.

The scheduler (``VLLM::EngineCore``) and the worker (``VLLM::Worker``) share no memory:
the only channel is the :class:`KvbatonMeta` vLLM pickles into every step's
``SchedulerOutput``. So everything the worker must act on is spelled out here as plain,
picklable dataclasses.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

# Settings live in settings.py (one table); re-exported for code that imports them here.
from .settings import (
    MAX_PIN_S,
    MODE_PULL,
    MODE_PUSH,
    MODE_REUSE,
    STAGING_ALWAYS,
    STAGING_AUTO,
    STAGING_NEVER,
    KvbatonSettings,
)

__all__ = ["MAX_PIN_S", "MODE_PULL", "MODE_PUSH", "MODE_REUSE", "STAGING_ALWAYS", "STAGING_AUTO", "STAGING_NEVER",
           "KvbatonMeta", "KvbatonSettings", "LoadSpec", "ReuseSource", "SendSpec"]


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """Decode side: read ``remote_block_ids`` of ``remote_engine_id`` into ``local_block_ids``.

    Empty id lists mean "nothing to read, just tell the prefill engine to free" (the
    request was aborted before it got blocks, or everything was a local prefix hit).
    """

    transfer_id: str
    remote_engine_id: str
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    report_recv: bool = True  # False: nobody waits for finished_recving (release only)
    mode: str = MODE_PULL  # push: wait for prefill's WRITE notification instead of reading
    reuse: ReuseSource | None = None  # mode == reuse: the lease to pin while reading
    traceparent: str = ""  # the request's W3C trace context (router), sent on this load's gRPC calls
    # Pull: decode's side of the READ as the ledger records it (BeginRead's block_ids: every
    # destination block up to the last read, its own prefix-cache hits included).
    ledger_block_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ReuseSource:
    """Where a prefill engine reads a conversation's history from (D's retained blocks).

    ``lease_id``/``retention_id`` are what the router looked up; the worker pins that lease
    and checks its ``retention_id`` before reading, so the block ids it reads are the ones
    the lease protects (never blocks of a newer or an ended retention).
    """

    conversation_id: str
    engine_id: str
    lease_id: str
    retention_id: str
    num_tokens: int  # tokens this load covers (from the start of the prompt)


@dataclasses.dataclass(frozen=True)
class SendSpec:
    """Prefill side: blocks of this request are held for ``transfer_id`` until the decode
    engine says it is done, or until ``timeout_s`` passes."""

    transfer_id: str
    num_blocks: int
    timeout_s: float
    mode: str = MODE_PULL
    block_ids: tuple[int, ...] = ()  # push: the blocks to write; pull: the held blocks (verify_kv)
    num_tokens: int = 0  # push: computed tokens those blocks hold
    traceparent: str = ""  # the request's W3C trace context (router), sent on this send's gRPC calls
    #: push: the worker (rank 0) sends Rendezvous.Complete for it (``complete_from_worker``)
    complete_here: bool = False
    request_id: str = ""  # push: the engine's request id, for the Complete message
    peer_engine_id: str = ""  # push: the decode engine the router named (binds the transfer)


@dataclasses.dataclass
class KvbatonMeta(KVConnectorMetadata):
    """One step's work for the worker, keyed by the engine-internal request id."""

    loads: dict[str, LoadSpec] = dataclasses.field(default_factory=dict)
    sends: dict[str, SendSpec] = dataclasses.field(default_factory=dict)
    #: Decode with ``verify_kv``: blocks retained this step, for the worker to fingerprint
    #: (the scheduler process cannot read KV): hold_id -> (conversation_id, block ids);
    #: empty block ids = that hold was freed (the worker drops its fingerprints).
    retains: dict[str, tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
