"""Per-step messages from the kvbaton scheduler connector to its worker, and settings.

The scheduler (``VLLM::EngineCore``) and the worker (``VLLM::Worker``) share no memory:
the only channel is the :class:`KvbatonMeta` vLLM pickles into every step's
``SchedulerOutput``. So everything the worker must act on is spelled out here as plain,
picklable dataclasses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

#: Notification prefix a decode worker sends to the prefill agent once it is done with
#: (or gives up on) a transfer; the rest of the message is the transfer id.
NOTIF_DONE = b"kvb:done:"
#: Notification a prefill worker attaches to its push WRITE: ``kvb:push:<transfer_id>:<bytes>``;
#: NIXL delivers it after the data, so its arrival means the blocks are complete.
NOTIF_PUSH = b"kvb:push:"

MODE_PULL = "pull"
MODE_PUSH = "push"


@dataclasses.dataclass(frozen=True)
class KvbatonSettings:
    """``kv_connector_extra_config`` keys, read identically in every process."""

    control_plane: str
    mode: str = MODE_PULL
    engine_id: str = ""
    timeout_s: float = 30.0
    stats_dir: str = ""
    ttl_ms: int = 10_000
    ucx_net_devices: str | None = None  # e.g. "lo" for single-host tests
    ucx_tls: str | None = None  # e.g. "tcp,self,sm" for host memory

    @classmethod
    def from_vllm(cls, kv_transfer_config: Any) -> KvbatonSettings:
        get = kv_transfer_config.get_from_extra_config
        mode = str(get("mode", MODE_PULL)).lower()
        if mode not in (MODE_PULL, MODE_PUSH):
            raise ValueError(f"kvbaton: mode must be 'pull' or 'push', got {mode!r}")
        cp = str(get("control_plane", "") or "")
        if not cp:
            raise ValueError("kvbaton: kv_connector_extra_config.control_plane (address) is required")
        # vLLM's own engine_id is a uuid shared by the 3 processes; an explicit one is
        # nicer in the registrar and in logs.
        engine_id = str(get("engine_id", "") or kv_transfer_config.engine_id or "")
        if not engine_id:
            raise ValueError("kvbaton: no engine_id")
        return cls(control_plane=cp, mode=mode, engine_id=engine_id,
                   timeout_s=float(get("timeout_s", 30.0)), stats_dir=str(get("stats_dir", "") or ""),
                   ttl_ms=int(get("ttl_ms", 10_000)),
                   ucx_net_devices=get("ucx_net_devices", None), ucx_tls=get("ucx_tls", None))


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


@dataclasses.dataclass(frozen=True)
class SendSpec:
    """Prefill side: blocks of this request are held for ``transfer_id`` until the decode
    engine says it is done, or until ``timeout_s`` passes."""

    transfer_id: str
    num_blocks: int
    timeout_s: float
    mode: str = MODE_PULL
    block_ids: tuple[int, ...] = ()  # push: the blocks to write
    num_tokens: int = 0  # push: computed tokens those blocks hold


@dataclasses.dataclass
class KvbatonMeta(KVConnectorMetadata):
    """One step's work for the worker, keyed by the engine-internal request id."""

    loads: dict[str, LoadSpec] = dataclasses.field(default_factory=dict)
    sends: dict[str, SendSpec] = dataclasses.field(default_factory=dict)
