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
#: Notification a prefill worker attaches to a reuse READ from a decode engine's retained
#: blocks: ``kvb:reuse:<conversation_id>:<bytes>`` (decode only counts it: the blocks stay
#: owned by the lease, not by the reader).
NOTIF_REUSE = b"kvb:reuse:"

#: ``verify_kv`` (connector/integrity.py): a reader asks the owner of blocks it READs for
#: their fingerprints: ``kvb:fpq:<key>|<reader engine id>|<first>|<block ids, comma-separated>``,
#: key ``t:<transfer_id>`` (pull) or ``r:<conversation_id>`` (reuse); ``first`` is the
#: position of the first block id in the owner's record if the reader knows it (reuse reads
#: a slice of it), else -1 (pull after a local prefix hit: the owner finds the run).
NOTIF_FPQ = b"kvb:fpq:"
#: The owner's answer: ``kvb:fpa:<key>|<alg>=<hex,...>`` or ``kvb:fpa:<key>|!<why>``.
NOTIF_FPA = b"kvb:fpa:"

MODE_PULL = "pull"
MODE_PUSH = "push"
STAGING_AUTO, STAGING_ALWAYS, STAGING_NEVER = "auto", "always", "never"
MODE_REUSE = "reuse"  # a LoadSpec that READs a decode engine's retained blocks (D→P)

#: The longest pin the lease service grants (services/domain/limits.MAX_PIN_TTL_MS): a
#: decode engine's local hard cap must outlast a lease plus this.
MAX_PIN_S = 60.0


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
    # Bidirectional reuse (D→P across turns of one conversation).
    lease_ttl_s: float = 30.0  # TTL of the lease decode takes on a finished turn's blocks
    max_retained_fraction: float = 0.5  # above this share of KV blocks, revoke oldest leases
    retain_hard_cap_s: float = 0.0  # 0: lease_ttl_s + MAX_PIN_S + 30 (see reuse.py)
    kv_recompute_threshold: int = 64  # fewer reusable tokens than this: recompute instead
    pin_ttl_s: float = 10.0  # prefill's pin while it READs retained blocks
    retain: bool = True  # decode keeps blocks of turns that carry a conversation_id
    # Empty engine steps (nothing scheduled, only transfers pending): sleep this long in
    # the scheduler hook instead of spinning; see KvbatonScheduler.build_connector_meta.
    idle_step_wait_ms: float = 2.0
    # sys.setswitchinterval for the engine processes (ms); 0 leaves Python's 5 ms. Measured
    # (benchmarks/push_timeline.py): prefill's Complete RPC median 115 ms at 5 ms, 9.8 ms at 0.5.
    gil_switch_interval_ms: float = 0.5
    # Push: prefill's Rendezvous.Complete goes out from the worker process (rank 0) when
    # it receives the send, instead of from the engine-core process at request_finished.
    complete_from_worker: bool = False
    # KV integrity (connector/integrity.py): owners fingerprint the blocks they expose,
    # readers verify what landed before reporting a load finished; a mismatch recomputes.
    verify_kv: bool = False
    verify_kv_alg: str = ""  # "" = crc32 on host memory, torch64 on GPUs
    #: Test-only fault injection: a JSON file the worker re-reads (see worker.Faults).
    #: Never set in production.
    fault_file: str = ""
    # Pack path for fragmented transfers (connector/staging.py): "auto" lets
    # staging.choose_strategy pick per transfer (keeps coalesced runs on host memory with
    # vLLM's block sizes), "always" packs every transfer with a peer that has a pool,
    # "never" (the default) allocates no pool and always moves runs. Opt in only where one
    # prefill engine at a time sends packed data to a decode engine: the receive slots are
    # chosen by the sender, so two senders packing into one receiver at once could overwrite
    # each other's chunks (verify_kv would catch it; without it the KV would be wrong).
    staging: str = STAGING_NEVER
    # Staging pool per engine (one send + one receive pool of these, registered once).
    # 0 = default by device: 2 MiB x 4 on host memory, 32 MiB x 4 on GPUs.
    staging_slot_bytes: int = 0
    staging_slots: int = 0
    staging_target_chunks: int = 16
    # The engine's own OpenAI-compatible API base URL (http://host:port), published with its
    # registration so routers discover it (vLLM's config does not carry the API server's
    # host/port). Empty: the engine is not routable by discovery.
    serve_url: str = ""
    # The role the engine registers with, i.e. what routers send it: "prefill", "decode"
    # or "both". Empty: from vLLM's kv_role (kv_both registers as both, so a fleet of
    # kv_both engines names each engine's job here).
    serve_role: str = ""

    def staging_pool(self, device: str) -> tuple[int, int]:
        """(slot bytes, slots) of this engine's pools on ``device`` ("cpu"/"cuda")."""
        cuda = device == "cuda"
        slot = self.staging_slot_bytes or ((32 << 20) if cuda else (2 << 20))
        return int(slot), int(self.staging_slots or 4)

    @property
    def hard_cap_s(self) -> float:
        """Local last-resort bound on holding retained blocks without word from the control plane."""
        floor = self.lease_ttl_s + MAX_PIN_S
        return max(self.retain_hard_cap_s, floor + 1.0) if self.retain_hard_cap_s else floor + 30.0

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
        staging = str(get("staging", STAGING_NEVER) or STAGING_NEVER).lower()
        if staging not in (STAGING_AUTO, STAGING_ALWAYS, STAGING_NEVER):
            raise ValueError(f"kvbaton: staging must be 'auto', 'always' or 'never', got {staging!r}")
        engine_id = str(get("engine_id", "") or kv_transfer_config.engine_id or "")
        if not engine_id:
            raise ValueError("kvbaton: no engine_id")
        return cls(control_plane=cp, mode=mode, engine_id=engine_id,
                   timeout_s=float(get("timeout_s", 30.0)), stats_dir=str(get("stats_dir", "") or ""),
                   ttl_ms=int(get("ttl_ms", 10_000)),
                   ucx_net_devices=get("ucx_net_devices", None), ucx_tls=get("ucx_tls", None),
                   lease_ttl_s=float(get("lease_ttl_s", 30.0)),
                   max_retained_fraction=float(get("max_retained_fraction", 0.5)),
                   retain_hard_cap_s=float(get("retain_hard_cap_s", 0.0)),
                   kv_recompute_threshold=int(get("kv_recompute_threshold", 64)),
                   pin_ttl_s=float(get("pin_ttl_s", 10.0)),
                   retain=bool(get("retain", True)),
                   idle_step_wait_ms=float(get("idle_step_wait_ms", 2.0)),
                   gil_switch_interval_ms=float(get("gil_switch_interval_ms", 0.5)),
                   complete_from_worker=_flag(get("complete_from_worker", False)),
                   verify_kv=_flag(get("verify_kv", False)),
                   verify_kv_alg=str(get("verify_kv_alg", "") or ""),
                   fault_file=str(get("fault_file", "") or ""),
                   staging=staging,
                   staging_slot_bytes=int(get("staging_slot_bytes", 0) or 0),
                   staging_slots=int(get("staging_slots", 0) or 0),
                   staging_target_chunks=int(get("staging_target_chunks", 16) or 16),
                   serve_url=str(get("serve_url", "") or "").rstrip("/"),
                   serve_role=_serve_role(get("serve_role", "")))


def _serve_role(v: Any) -> str:
    role = str(v or "").lower()
    if role not in ("", "prefill", "decode", "both"):
        raise ValueError(f"kvbaton: serve_role must be 'prefill', 'decode' or 'both', got {role!r}")
    return role


def _flag(v: Any) -> bool:
    """A boolean extra-config value (JSON true/false, or "true"/"1"/"yes" strings)."""
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


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


@dataclasses.dataclass
class KvbatonMeta(KVConnectorMetadata):
    """One step's work for the worker, keyed by the engine-internal request id."""

    loads: dict[str, LoadSpec] = dataclasses.field(default_factory=dict)
    sends: dict[str, SendSpec] = dataclasses.field(default_factory=dict)
    #: Decode with ``verify_kv``: blocks retained this step, for the worker to fingerprint
    #: (the scheduler process cannot read KV): hold_id -> (conversation_id, block ids);
    #: empty block ids = that hold was freed (the worker drops its fingerprints).
    retains: dict[str, tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
