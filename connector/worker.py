"""Worker half of the kvbaton connector (runs in ``VLLM::Worker``).

Threads (all named daemons; the model-runner thread never blocks on them):

* ``kvbaton-xfer-<engine>``: owns the :class:`NixlEndpoint` (NIXL agent in no-lock mode:
  one owner thread). Takes commands from ``_inbox``, posts READs, polls their state and
  the agent's notifications (that polling is also what progresses UCX for peers reading
  *our* memory, since the agent runs without NIXL's spinning progress thread), and puts
  results on ``_results``. It sleeps on the inbox queue with a 1 ms timeout while work is
  pending and 50 ms when idle, so it is never a busy loop.
* ``kvbaton-control``: gRPC to the control plane (:mod:`.control`).

Pull mode:

* Decode: each :class:`LoadSpec` → fetch the prefill rank from the registrar (cached per
  engine), ``add_peer``, plan (coalesced runs), READ with a ``kvb:done:<transfer_id>``
  notification that NIXL delivers to prefill after the data. Done → ``finished_recving``;
  any failure (unknown engine, layout mismatch, NIXL error, timeout) → the block ids go to
  :meth:`get_block_ids_with_load_errors` *and* the request to ``finished_recving``, so
  vLLM's ``kv_load_failure_policy=recompute`` recomputes it and every block is freed.
* Prefill: each :class:`SendSpec` holds the request until the done notification for its
  transfer id arrives or ``timeout_s`` passes; then ``finished_sending`` (vLLM frees).

Reuse (prefill reads a conversation's history from decode's retained blocks):

* A ``MODE_REUSE`` :class:`LoadSpec` → ``Lease.Pin`` (control thread) → check the pinned
  lease still names the retention the router looked up → registrar lookup of the decode
  rank → one coalesced NIXL READ → ``Lease.Unpin``. The READ must finish within half the
  pin's TTL counted from when the pin was *requested* (so it ends before the service can
  let the pin lapse, without comparing clocks); otherwise it is cancelled. A refused pin,
  a mismatch or a failed/late READ fails the load: vLLM recomputes (never garbage).
* Decode only counts the ``kvb:reuse:`` notification; its blocks belong to the lease.

Pack path (``staging``, :mod:`.staging`): fragmented transfers can go gather → one NIXL
WRITE per chunk → scatter → ack instead of one descriptor per coalesced run.

* Pools: at ``register_kv_caches`` this thread allocates one send and one receive pool
  (``staging_slot_bytes`` × ``staging_slots``, on the KV's device) and registers them
  with the agent once (:class:`StagedPeer`); the receive pool is published with the rank
  (``EngineRank.staging``), and peers read it with the rest of the rank in :meth:`_peer`.
  ``staging: never`` allocates nothing and publishes nothing.
* Per transfer :func:`pick_strategy`: ``always`` packs whenever both sides have a pool,
  ``auto`` asks :func:`staging.choose_strategy` from the coalesced plan (descriptor count,
  bytes; keeps runs on host memory with vLLM's block sizes), ``never`` keeps runs.
* Push (prefill): the staged WRITE runs on this thread until decode acked every chunk
  (each ack means the chunk is scattered into decode's blocks), bounded by the hold's
  deadline; only then the ``kvb:push:`` notification (with the fingerprints) goes out,
  so decode's existing "push arrived" path still means "the blocks are complete". Its id
  is derived from the transfer id, so a decode that gave up cancels it: late chunks are
  acked but never scattered into blocks vLLM has freed.
* Pull (decode) and reuse (prefill): the reader sends ``KVBS/P`` (a staged READ request),
  the owner looks the reader up and answers with a staged WRITE (``_progress_serves``,
  on its transfer thread); the reader reports the load (verifying first with
  ``verify_kv``) once the last chunk is scattered, then sends the notification the runs
  READ carried (``kvb:done:`` → prefill frees; ``kvb:reuse:`` → decode counts). Timeouts
  are the load's (``timeout_s``; reuse: half the pin TTL); failure → the usual failed load
  (recompute, blocks freed) and the transfer is cancelled in the receive pool.
* The receive slots are addressed by the sender, so a reader runs staged READs from one
  owner engine at a time (others wait, bounded by their deadlines). Staged messages from
  an agent we have no metadata for (push: decode never looked prefill up) wait for its
  registrar lookup before they are processed (acks need it).

KV integrity (``verify_kv``, :mod:`.integrity`): the owner of the bytes fingerprints the
blocks it exposes, on the ``kvbaton-verify`` thread, as soon as it learns of them (prefill:
the SendSpec of a push or pull; decode: the hold ids the scheduler passes in
``KvbatonMeta.retains`` in the step after a turn finished). How the owner's fingerprints
reach the reader:

* **push**: appended to the WRITE's notification (``kvb:push:<tid>:<bytes>:<alg>=<fp,...>``),
  so they arrive with the data and cost no round trip.
* **pull and reuse**: the reader sends ``kvb:fpq:`` to the owner just before posting its
  READ and the owner answers ``kvb:fpa:`` (it looks the reader up in the registrar like any
  peer). Why not the registrar's retained-blocks record or the pin answer: the scheduler
  process that registers retentions and takes leases cannot read KV, and the worker that
  can computes the fingerprints only in the *next* step, so publishing them there means a
  second, racing write to the registrar (a new RPC, its etcd path and auth) and a router
  that must wait for it. The NIXL answer is owned end to end by the two workers that touch
  the bytes, needs no control-plane change, and overlaps the READ (one notification each
  way; the owner answers from fingerprints made when it exposed the blocks, so blocks freed
  or rewritten since then cannot match).

The reader fingerprints its own landed blocks with the owner's algorithm and compares
before reporting the load finished. A mismatch, a missing answer (owner dead or without
``verify_kv``) or an owner that no longer has the record fails the load exactly like a
failed READ (recompute, blocks freed), with a ``kv_verify`` stats line (``ok``,
``mismatched`` positions), ``kvbaton_connector_kv_verifications_total`` and a warning.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvbaton.services.metrics import connector_metrics
from kvbaton.services.tracing import grpc_metadata

from .control import ControlThread, geometry_fields, role_of
from .descriptors import plan_transfer
from .geometry import KvLayout
from .integrity import Fingerprinter, Fingerprints, KvIntegrityError, compare, corrupt_block
from .metadata import (
    MODE_PULL,
    MODE_PUSH,
    MODE_REUSE,
    NOTIF_DONE,
    STAGING_ALWAYS,
    STAGING_NEVER,
    NOTIF_FPA,
    NOTIF_FPQ,
    NOTIF_PUSH,
    NOTIF_REUSE,
    KvbatonMeta,
    KvbatonSettings,
    LoadSpec,
    SendSpec,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .nixl_agent import NixlEndpoint, Transfer
    from .staging import StagedPeer, StagingInfo

#: staging.PREFIX (not imported at module level: staging imports torch)
STAGED_PREFIX = b"KVBS/"

log = logging.getLogger("kvbaton.connector.worker")

_BUSY_POLL_S = 0.001
# Idle poll: also what progresses UCX when a peer READs our retained blocks (no NIXL
# progress thread), so it bounds a reuse READ's latency. 100 cheap wakeups/s.
_IDLE_POLL_S = 0.01


def agent_name(engine_id: str, tp_rank: int) -> str:
    return f"kvb-{engine_id}-r{tp_rank}"


def pick_strategy(setting: str, num_descs: int, nbytes: int, *, device: str,
                  local_pool: bool, remote_pool: bool) -> str:
    """``"runs"`` or ``"pack"`` for one transfer, from the ``staging`` setting.

    Pack needs a staging pool on both sides (the peer's is published with its rank; an
    engine without one, e.g. ``staging: never`` or an older connector, gets runs).
    ``auto`` asks :func:`staging.choose_strategy` (per-descriptor cost vs pack cost),
    which keeps vLLM's large CPU blocks on runs.
    """
    if setting == STAGING_NEVER or not local_pool or not remote_pool or nbytes <= 0:
        return "runs"
    if setting == STAGING_ALWAYS:
        return "pack"
    from .staging import choose_strategy

    return choose_strategy(num_descs, nbytes, device=device)


def push_xfer_id(transfer_id: str) -> str:
    """Staged-protocol id of a push's WRITE: derived from the transfer id, so a decode that
    gave up on the transfer can refuse its late chunks (:meth:`StagedPeer.cancel`)."""
    if transfer_id and not any(c.isspace() for c in transfer_id):
        return "w" + transfer_id
    return "w" + uuid.uuid4().hex


def engine_of_agent(agent: str) -> str:
    """Inverse of :func:`agent_name` (``kvb-<engine>-r<rank>`` → engine id)."""
    core = agent.removeprefix("kvb-")
    head, sep, rank = core.rpartition("-r")
    return head if sep and rank.isdigit() else core


def staging_from_rank(rank: Any) -> StagingInfo | None:
    """A peer's published receive pool (``EngineRank.staging``), None when it has none."""
    from .staging import StagingInfo

    st = rank.staging if rank.HasField("staging") else None
    if st is None or not st.num_slots or not st.slot_bytes:
        return None
    return StagingInfo(int(st.base_addr), int(st.slot_bytes), int(st.num_slots), st.mem_type or "DRAM",
                       int(st.device_id))


def _outcome(ok: bool, reason: str = "") -> str:
    """``kvbaton_connector_transfers_total`` outcome label from a result and its reason."""
    return "ok" if ok else "timeout" if reason.startswith("TimeoutError") else "failed"


def _recompute_reason(reason: str) -> str:
    """``kvbaton_connector_recomputes_total`` reason label for a failed load."""
    if reason.startswith("TimeoutError"):
        return "timeout"
    if "pin refused" in reason:
        return "pin_refused"
    if "now protects retention" in reason:  # the lease moved on: the blocks we looked up are gone
        return "lease_ended"
    if reason.startswith("KvIntegrityError"):
        return "verify_failed"
    return "load_failed"


class Faults:
    """Test-only fault injection, off unless ``fault_file`` is set in the extra config.

    The file is JSON, re-read when its mtime changes, e.g.
    ``{"corrupt_landed": {"reuse": 1, "pull": 1, "push": 1}, "delay_reuse_read_s": 2.5}``:
    ``corrupt_landed[mode]`` = how many loads of that mode get their first landed block
    corrupted after the owner fingerprinted it (before the reader verifies);
    ``delay_reuse_read_s`` = how long a reuse READ waits, pin held, before it is posted;
    ``delay_staged_serve_s`` = how long an owner waits before answering a staged READ
    request (past the reader's deadline: exercises the reader's cancel).
    Counts are consumed in this process only (the file is not rewritten).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._mtime = -1.0
        self._conf: dict[str, Any] = {}
        self._used: dict[str, int] = {}

    def _load(self) -> dict[str, Any]:
        if not self.path:
            return {}
        try:
            mt = os.stat(self.path).st_mtime
        except OSError:
            self._conf, self._mtime = {}, -1.0
            return self._conf
        if mt != self._mtime:
            try:
                self._conf = json.loads(Path(self.path).read_text() or "{}")
            except (OSError, ValueError):
                self._conf = {}
            self._mtime, self._used = mt, {}
        return self._conf

    def take_corruption(self, mode: str) -> bool:
        left = int((self._load().get("corrupt_landed") or {}).get(mode, 0)) - self._used.get(mode, 0)
        if left > 0:
            self._used[mode] = self._used.get(mode, 0) + 1
            return True
        return False

    def value(self, key: str) -> float:
        return float(self._load().get(key, 0.0) or 0.0)


@dataclasses.dataclass
class _Load:
    req_id: str
    spec: LoadSpec
    deadline: float
    t0: float
    peer_future: concurrent.futures.Future[Any] | None = None
    xfer: Transfer | None = None
    nbytes: int = 0
    num_descs: int = 0
    peer: str = ""
    pin_future: concurrent.futures.Future[Any] | None = None
    pin_id: str = ""
    pin_sent: float = 0.0
    read_deadline: float = 0.0
    t_post: float = 0.0  # when the NIXL READ was posted (kvbaton_connector_transfer_seconds)
    delay_until: float = 0.0  # test-only fault: reuse READ held back until then
    # verify_kv
    landed: bool = False  # the data is in our blocks; verification (if on) still to do
    t_landed: float = 0.0
    fp_key: str = ""  # pull/reuse: the key of the owner's answer we wait for
    fp_owner: Fingerprints | None = None
    fp_local: concurrent.futures.Future[Any] | None = None
    corrupted: bool = False
    # staged READ (pack path): our id of the incoming staged transfer, and what to tell the
    # owner once every chunk is scattered into our blocks
    strategy: str = "runs"
    staged_xid: str = ""
    staged_notif: bytes = b""


@dataclasses.dataclass
class _Held:
    req_id: str
    spec: SendSpec
    deadline: float
    t0: float
    match: Any = None  # push: the rendezvous TransferState once matched
    peer_future: concurrent.futures.Future[Any] | None = None
    xfer: Transfer | None = None
    peer: str = ""
    nbytes: int = 0
    num_descs: int = 0
    t_post: float = 0.0  # when the NIXL WRITE was posted
    strategy: str = "runs"
    chunks: int = 0  # staged: chunks the WRITE was cut into


@dataclasses.dataclass
class _Serve:
    """Owner side of a staged READ: a peer asked us to push blocks into its staging slots."""

    agent: str
    engine_id: str
    xfer_id: str
    info: Any  # StagingInfo of the requester's receive pool
    src: Any  # our block ids (numpy)
    dst: Any  # its block ids (numpy)
    deadline: float
    t0: float
    peer_future: concurrent.futures.Future[Any] | None = None


@dataclasses.dataclass
class _StagedWait:
    """Staged-protocol messages from an agent we have no NIXL metadata for yet (a push's
    writer: decode never looked prefill up). Kept, in order, until the registrar lookup
    lets us answer (acks need the sender's metadata); its data waits in our slot."""

    agent: str
    msgs: list[bytes]
    deadline: float
    peer_future: concurrent.futures.Future[Any] | None = None


@dataclasses.dataclass
class _FpRecord:
    """Owner side: fingerprints of blocks this engine exposes (being computed or done)."""

    block_ids: tuple[int, ...]
    future: concurrent.futures.Future[Fingerprints]
    t: float
    hold_id: str = ""  # retained blocks: the scheduler's hold (dropped when it is freed)


#: Upper bound on retained-block fingerprint records kept by one worker (oldest dropped):
#: a safety net only, holds are normally forgotten when the scheduler frees them.
_MAX_RETAINED_RECORDS = 4096


@dataclasses.dataclass
class _FpAnswer:
    """Owner side: a reader's fingerprint question waiting for its record or its peer."""

    key: str
    reader: str  # engine id
    first: int
    block_ids: tuple[int, ...]
    deadline: float
    t0: float = 0.0
    peer_future: concurrent.futures.Future[Any] | None = None


class StatsLog:
    """Per-transfer JSON lines in ``stats_dir`` (tests and operators read them) + counters."""

    def __init__(self, stats_dir: str, engine_id: str, part: str = "worker") -> None:
        self.counters: dict[str, int] = {}
        self._path = Path(stats_dir) / f"{engine_id}.{part}.jsonl" if stats_dir else None
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)

    def record(self, event: str, **fields: Any) -> None:
        self.counters[event] = self.counters.get(event, 0) + 1
        if "nbytes" in fields:
            self.counters["bytes"] = self.counters.get("bytes", 0) + int(fields["nbytes"])
        line = {"event": event, "t": time.time(), "pid": os.getpid(), **fields}
        log.info("kvbaton: %s", json.dumps(line))
        if self._path is not None:
            with open(self._path, "a") as f:
                f.write(json.dumps(line) + "\n")


class TransferThread:
    """The NIXL owner thread (see module docstring)."""

    def __init__(self, settings: KvbatonSettings, tp_rank: int, layout: KvLayout,
                 control: ControlThread, stats: StatsLog, fingerprinter: Fingerprinter | None = None,
                 tensors: list[torch.Tensor] | None = None) -> None:
        self.metrics = connector_metrics()  # counted next to each stats record below
        self.fp = fingerprinter  # verify_kv (None: off)
        self.faults = Faults(settings.fault_file)
        self._fp_records: dict[str, list[_FpRecord]] = {}  # owner: key -> records, newest first
        self._fp_answers: list[_FpAnswer] = []  # owner: questions not answered yet
        self._fp_replies: dict[str, tuple[float, str]] = {}  # reader: key -> (t, answer)
        self._retained_records = 0  # owner: records under "r:" keys (approximate, for the cap)
        self.settings = settings
        self.layout = layout
        self.control = control
        self.stats = stats
        self.name = agent_name(settings.engine_id, tp_rank)
        self.inbox: queue.Queue[tuple[str, str, Any]] = queue.Queue()
        self.results: queue.Queue[tuple[str, str, bool, tuple[int, ...]]] = queue.Queue()
        self.metadata: bytes = b""
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._loads: list[_Load] = []
        self._held: dict[str, _Held] = {}  # transfer_id -> held request
        self._early_acks: dict[str, float] = {}  # acks that arrived before the SendSpec
        self._early_matches: dict[str, tuple[float, Any]] = {}  # MATCH before the SendSpec
        self._push_arrived: dict[str, tuple[float, int]] = {}  # push WRITE notifs: tid -> (t, bytes)
        self._push_failed: dict[str, tuple[float, str]] = {}  # rendezvous said the push is off
        self._peers: dict[str, tuple[str, KvLayout]] = {}  # engine_id -> (agent, layout)
        self._ep: NixlEndpoint | None = None
        # Pack path (staging.py): created on this thread with the agent, when staging is on.
        self._tensors = tensors or []
        self._staged: StagedPeer | None = None
        self.staging_info: StagingInfo | None = None  # our receive pool, published with the rank
        self._peer_staging: dict[str, StagingInfo | None] = {}  # engine_id -> its receive pool
        self._staged_done: dict[str, float] = {}  # incoming staged transfers fully scattered
        self._staged_src: dict[str, int] = {}  # agent -> our staged READs it is answering
        self._serves: list[_Serve] = []  # staged READs of our blocks waiting for their peer
        self._staged_wait: dict[str, _StagedWait] = {}  # agent -> its messages, until we know it
        self._thread = threading.Thread(target=self._run, name=f"kvbaton-xfer-{settings.engine_id}",
                                        daemon=True)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the thread and wait until the agent exists and the caches are registered."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError("kvbaton transfer thread did not become ready")
        if self._error is not None:
            raise RuntimeError("kvbaton transfer thread failed to start") from self._error

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("stop", "", None))
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ thread body
    def _run(self) -> None:
        from .nixl_agent import NixlEndpoint  # heavy import, only in the worker process

        try:
            ep = NixlEndpoint(self.name, net_devices=self.settings.ucx_net_devices,
                              ucx_tls=self.settings.ucx_tls)
            ep.register_layout(self.layout)
            ep.on_notif(NOTIF_DONE, self._on_done)
            ep.on_notif(NOTIF_PUSH, self._on_push)
            ep.on_notif(NOTIF_REUSE, self._on_reuse_served)
            ep.on_notif(NOTIF_FPQ, self._on_fp_question)
            ep.on_notif(NOTIF_FPA, self._on_fp_answer)
            self._init_staging(ep)
            self.metadata = ep.metadata()
            self._ep = ep
        except BaseException as exc:  # noqa: BLE001 - surfaced by start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                busy = bool(self._loads or self._held or self._fp_answers or self._serves or self._staged_wait)
                try:
                    cmd = self.inbox.get(timeout=_BUSY_POLL_S if busy else _IDLE_POLL_S)
                    self._handle(cmd)
                    while True:
                        self._handle(self.inbox.get_nowait())
                except queue.Empty:
                    pass
                try:
                    if self._staged is not None:
                        self._staged.progress()  # poll_notifs + (CUDA) finished scatters → acks
                    else:
                        ep.poll_notifs()
                except Exception:  # noqa: BLE001 - keep the thread alive
                    log.exception("kvbaton: poll_notifs failed")
                self._progress_staged_wait()
                self._progress_serves()
                self._progress_loads()
                self._progress_writes()
                self._progress_fp_answers()
                self._expire_held()
        finally:
            for ld in self._loads:
                self._finish_load(ld, ok=False, reason="shutdown")
            if self._staged is not None:
                self._staged.close()
            ep.close()

    # ------------------------------------------------------------------ staging (pack path)
    def _init_staging(self, ep: NixlEndpoint) -> None:
        """Allocate and register this engine's staging pools once, next to the KV cache."""
        if self.settings.staging == STAGING_NEVER or not self._tensors:
            return
        from .staging import StagedPeer

        slot, nslots = self.settings.staging_pool(self.layout.device)
        slot = max(slot, self.layout.bytes_per_block)  # a tile holds at least one block row
        # Ours first (the first matching prefix wins): staged messages from an agent we
        # cannot answer yet wait for its registrar lookup (see _StagedWait).
        ep.on_notif(STAGED_PREFIX, self._on_staged_notif)
        try:
            self._staged = StagedPeer(ep, self._tensors, self.layout, slot_bytes=slot, num_slots=nslots,
                                      target_chunks=self.settings.staging_target_chunks,
                                      min_chunk_bytes=min(4 << 20, slot), on_complete=self._on_staged_complete)
        except Exception:  # noqa: BLE001 - no pool: runs only (published as absent)
            log.exception("kvbaton: staging pool not available; moving KV with coalesced runs only")
            self._staged = None
            return
        self.staging_info = self._staged.info()
        log.info("kvbaton: staging pools %d x %d B (%s), mode %s", nslots, self._staged.recv_pool.slot_bytes,
                 self.staging_info.mem_type, self.settings.staging)

    def _on_staged_notif(self, peer: str, msg: bytes) -> None:
        if self._staged is None:
            return
        wait = self._staged_wait.get(peer)
        if wait is None and peer in self._ep.peers:
            self._staged._on_notif(peer, msg)  # noqa: SLF001 - we own the routing of its prefix
            return
        if wait is None:
            wait = self._staged_wait[peer] = _StagedWait(peer, [], time.monotonic() + self.settings.timeout_s)
        wait.msgs.append(msg)

    def _progress_staged_wait(self) -> None:
        """Deliver held staged messages once their sender's metadata is known."""
        if not self._staged_wait or self._staged is None:
            return
        now = time.monotonic()
        for agent, wait in list(self._staged_wait.items()):
            try:
                got = self._peer(engine_of_agent(agent), wait, now)
                if got is None:
                    continue
                if got[0] != agent:
                    raise LookupError(f"{engine_of_agent(agent)} is registered as {got[0]}, not {agent}")
                del self._staged_wait[agent]
                for m in wait.msgs:
                    self._staged._on_notif(agent, m)  # noqa: SLF001
            except Exception as exc:  # noqa: BLE001 - the sender times out, the load recomputes
                self._staged_wait.pop(agent, None)
                log.warning("kvbaton: dropped %d staged messages from %s: %r", len(wait.msgs), agent, exc)
                self.stats.record("staged_dropped", peer=agent, num_msgs=len(wait.msgs),
                                  reason=f"{type(exc).__name__}: {exc}"[:300])

    def _on_staged_complete(self, peer: str, xfer_id: str) -> None:
        """Receiver: every chunk of an incoming staged transfer is scattered into our blocks."""
        assert self._staged is not None
        self._staged.completed.pop(xfer_id, None)  # tracked here (bounded by _expire_held)
        self._staged_done[xfer_id] = time.monotonic()

    def _strategy(self, num_descs: int, nbytes: int, engine_id: str) -> str:
        return pick_strategy(self.settings.staging, num_descs, nbytes, device=self.layout.device,
                             local_pool=self._staged is not None,
                             remote_pool=self._peer_staging.get(engine_id) is not None)

    def _progress_serves(self) -> None:
        """Owner: answer staged READs (``KVBS/P``) with staged WRITEs, once the requester's
        NIXL metadata is known. The WRITE runs on this thread until every chunk is acked
        (bounded by ``timeout_s``); a failure is logged and the reader fails its load at its
        own deadline (recompute)."""
        if self._staged is None:
            return
        now = time.monotonic()
        while True:
            got = self._staged.take_pull()
            if got is None:
                break
            agent, xid, info, src, dst = got
            self._serves.append(_Serve(agent, engine_of_agent(agent), xid, info, src, dst,
                                       now + self.settings.timeout_s, now))
        keep: list[_Serve] = []
        delay = self.faults.value("delay_staged_serve_s") if self.faults.path else 0.0
        for sv in self._serves:
            if delay and now < sv.t0 + delay:  # test-only fault
                keep.append(sv)
                continue
            try:
                peer = self._peer(sv.engine_id, sv, now)
                if peer is None:
                    keep.append(sv)
                    continue
                if peer[0] != sv.agent:
                    raise LookupError(f"engine {sv.engine_id} is registered as {peer[0]}, not {sv.agent}")
                t0 = time.monotonic()
                nbytes = self._staged.send(sv.agent, sv.info, sv.src, sv.dst, sv.xfer_id,
                                           timeout_s=max(0.001, sv.deadline + delay - t0))
                self.stats.record("staged_serve", xfer_id=sv.xfer_id, peer=sv.engine_id, strategy="pack",
                                  nbytes=nbytes, num_blocks=int(len(sv.src)), chunks=self._staged.last_send_chunks,
                                  duration_s=round(time.monotonic() - t0, 6))
            except Exception as exc:  # noqa: BLE001 - the reader gives up at its deadline
                log.warning("kvbaton: staged answer %s to %s failed: %r", sv.xfer_id, sv.engine_id, exc)
                self.stats.record("staged_serve_failed", xfer_id=sv.xfer_id, peer=sv.engine_id,
                                  reason=f"{type(exc).__name__}: {exc}"[:300])
                self._forget_peer(sv.engine_id)
        self._serves = keep

    def _start_staged_read(self, ld: _Load, notif: bytes) -> bool:
        """Reader: ask the owner to push ``remote_block_ids`` into our ``local_block_ids``
        through our receive pool. False while another peer is answering a staged READ of
        ours (the receive slots are addressed by the sender: one sending engine at a time)."""
        assert self._staged is not None and self._ep is not None
        if any(n > 0 for a, n in self._staged_src.items() if a != ld.peer):
            return False
        ld.staged_xid = "s" + uuid.uuid4().hex
        ld.staged_notif = notif
        ld.strategy = "pack"
        self._staged_src[ld.peer] = self._staged_src.get(ld.peer, 0) + 1
        self._staged.request_pull(ld.peer, ld.spec.remote_block_ids, ld.spec.local_block_ids, ld.staged_xid)
        return True

    def _poll_staged(self, ld: _Load, now: float, deadline: float, engine_id: str) -> bool:
        """Reader: True once every chunk is scattered into our blocks (then tell the owner)."""
        if self._staged_done.pop(ld.staged_xid, None) is None:
            if now >= deadline:
                self._forget_peer(engine_id)  # dead or restarted owner: look it up again
                raise TimeoutError(f"staged READ {ld.staged_xid} from {ld.peer} not complete in time")
            return False
        self._end_staged(ld, ok=True)
        if ld.staged_notif:
            self._ep.send_notif(ld.peer, ld.staged_notif)  # prefill frees / decode counts
        return True

    def _end_staged(self, ld: _Load, *, ok: bool) -> None:
        if not ld.staged_xid:
            return
        n = self._staged_src.get(ld.peer, 0) - 1
        if n > 0:
            self._staged_src[ld.peer] = n
        else:
            self._staged_src.pop(ld.peer, None)
        if not ok and self._staged is not None:
            self._staged.cancel(ld.staged_xid)  # late chunks are acked, never scattered
        ld.staged_xid = ""

    def _handle(self, cmd: tuple[str, str, Any]) -> None:
        kind, req_id, spec = cmd
        now = time.monotonic()
        if kind == "load":
            ld = _Load(req_id, spec, now + self.settings.timeout_s, now)
            self._loads.append(ld)
        elif kind == "event":
            self._on_event(req_id, spec)
        elif kind == "fp_stat":
            self.stats.record("kv_fingerprint", key=req_id, **spec)
        elif kind == "retain":  # verify_kv, decode: fingerprint a finished turn's retained blocks
            conv, ids = spec
            if ids:
                self._fingerprint_exposed(f"r:{conv}", ids, mode=MODE_REUSE, hold_id=req_id)
            else:  # the hold was freed: its blocks are not ours to vouch for any more
                recs = self._fp_records.get(f"r:{conv}", [])
                n = len(recs)
                recs[:] = [r for r in recs if r.hold_id != req_id]
                self._retained_records -= n - len(recs)
                if not recs:
                    self._fp_records.pop(f"r:{conv}", None)
        elif kind == "send":
            tid = spec.transfer_id
            if self.fp is not None and spec.block_ids:
                self._fingerprint_exposed(f"t:{tid}", spec.block_ids, mode=spec.mode, req_id=req_id)
            if spec.mode == MODE_PUSH:
                held = _Held(req_id, spec, now + spec.timeout_s, now)
                early = self._early_matches.pop(tid, None)
                if early is not None:
                    held.match = early[1]
                self._held[tid] = held
            elif tid in self._early_acks:
                self._early_acks.pop(tid)
                self.stats.record("send_done", transfer_id=tid, req_id=req_id, notif=True, early=True)
                self.metrics.transfers.labels(MODE_PULL, "prefill", "ok").inc()
                self.results.put(("sent", req_id, True, ()))
            else:
                self._held[tid] = _Held(req_id, spec, now + spec.timeout_s, now)

    def _on_done(self, peer: str, msg: bytes) -> None:
        tid = msg[len(NOTIF_DONE):].decode(errors="replace")
        self.stats.record("notif", transfer_id=tid, peer=peer)
        held = self._held.pop(tid, None)
        if held is None:
            self._early_acks[tid] = time.monotonic()
            return
        self.stats.record("send_done", transfer_id=tid, req_id=held.req_id, notif=True,
                          held_s=round(time.monotonic() - held.t0, 6))
        self.metrics.transfers.labels(held.spec.mode, "prefill", "ok").inc()
        self.results.put(("sent", held.req_id, True, ()))

    def _on_push(self, peer: str, msg: bytes) -> None:
        tid, _, rest = msg[len(NOTIF_PUSH):].decode(errors="replace").partition(":")
        nbytes, _, fps = rest.partition(":")  # fps: the writer's fingerprints (verify_kv)
        self.stats.record("notif", transfer_id=tid, peer=peer, kind="push")
        self._push_arrived[tid] = (time.monotonic(), int(nbytes or 0), fps)

    def _on_reuse_served(self, peer: str, msg: bytes) -> None:
        conv, _, nbytes = msg[len(NOTIF_REUSE):].decode(errors="replace").rpartition(":")
        self.stats.record("reuse_served", conversation_id=conv, peer=peer, served_nbytes=int(nbytes or 0))

    def _on_event(self, tid: str, ev: Any) -> None:
        """A rendezvous event for this engine (from the control thread's subscription)."""
        from kvbaton.v1 import rendezvous_pb2 as rpb

        T = rpb.RendezvousEvent
        state = ev.transfer
        mine_prefill = state.completion.engine_id == self.settings.engine_id
        if ev.type == T.TYPE_MATCH and mine_prefill:
            held = self._held.get(tid)
            if held is not None and held.spec.mode == MODE_PUSH:
                held.match = state
            else:
                self._early_matches[tid] = (time.monotonic(), state)
        elif ev.type in (T.TYPE_EXPIRED, T.TYPE_CANCELLED):
            held = self._held.get(tid)
            if mine_prefill and held is not None and held.xfer is None:
                del self._held[tid]
                self.stats.record("send_cancelled", transfer_id=tid, req_id=held.req_id,
                                  reason=state.reason or rpb.TransferPhase.Name(state.phase))
                self.metrics.transfers.labels(held.spec.mode, "prefill",
                                              "timeout" if ev.type == T.TYPE_EXPIRED else "failed").inc()
                self.results.put(("sent", held.req_id, False, ()))
            if state.offer.engine_id == self.settings.engine_id:
                self._push_failed[tid] = (time.monotonic(), state.reason or "expired/cancelled")
        elif ev.type == T.TYPE_DONE and state.offer.engine_id == self.settings.engine_id:
            if any(not o.success for o in state.outcomes):
                self._push_failed[tid] = (time.monotonic(), "prefill reported failure")

    def _expire_held(self) -> None:
        now = time.monotonic()
        for tid, held in list(self._held.items()):
            if now >= held.deadline and held.xfer is None:
                del self._held[tid]
                self.stats.record("send_expired", transfer_id=tid, req_id=held.req_id)
                self.metrics.transfers.labels(held.spec.mode, "prefill", "timeout").inc()
                self.results.put(("sent", held.req_id, False, ()))
        for box in (self._early_acks, self._push_arrived, self._push_failed, self._early_matches,
                    self._fp_replies, self._staged_done):
            for tid, v in list(box.items()):
                t = v if isinstance(v, float) else v[0]
                if now - t > 2 * self.settings.timeout_s:
                    del box[tid]
        # Owner fingerprint records: a transfer's live as long as its hold can; a retained
        # turn's until the scheduler says its hold was freed (a renewed lease can last far
        # longer than any fixed age), with a count cap as a safety net.
        for key, recs in list(self._fp_records.items()):
            if key.startswith("r:"):
                continue
            recs[:] = [r for r in recs if now - r.t <= 2 * self.settings.timeout_s]
            if not recs:
                del self._fp_records[key]

    # ------------------------------------------------------------------ push writes (prefill)
    def _progress_writes(self) -> None:
        now = time.monotonic()
        for tid, held in list(self._held.items()):
            if held.spec.mode != MODE_PUSH or held.match is None:
                continue
            try:
                done = self._step_write(tid, held, now)
                err = ""
            except Exception as exc:  # noqa: BLE001 - any failure: report, free, decode recomputes
                if held.xfer is not None and self._ep is not None:
                    self._ep.release(held.xfer)
                done, err = True, f"{type(exc).__name__}: {exc}"
            if done:
                del self._held[tid]
                self._report_outcome(held, ok=not err, error=err, dur=now - held.t0)
                self.results.put(("sent", held.req_id, not err, ()))

    def _step_write(self, tid: str, held: _Held, now: float) -> bool:
        assert self._ep is not None
        if held.xfer is None:
            offer = held.match.offer
            got = self._peer(offer.engine_id, held, now)
            if got is None:
                return False
            peer, remote_layout = got
            held.peer = peer
            local = list(held.spec.block_ids)
            remote = [int(b) for b in offer.block_ids]
            if len(local) != len(remote):
                raise ValueError(f"block count mismatch: {len(local)} local vs {len(remote)} offered")
            # Decode needs only its last num_tokens tokens; the leading blocks are its own
            # prefix-cache hits (shared) and must not be written.
            skip = max(0, (held.spec.num_tokens - int(offer.num_tokens)) // self.layout.tokens_per_block)
            fps = ""
            if self.fp is not None:  # verify_kv: our fingerprints travel with the data
                found = self._fp_record(f"t:{tid}", 0, tuple(local))
                if found is None:
                    raise KvIntegrityError("no fingerprints of the blocks to push")
                rec = found[0]
                if not rec.future.done():
                    return False  # computing (µs to ms); the WRITE waits for them
                mine = rec.future.result()
                fps = ":" + Fingerprints(mine.alg, mine.block_ids[skip:], mine.values[skip:]).encode()
            plan = plan_transfer(self.layout, local[skip:], remote_layout, remote[skip:], op="WRITE")
            held.nbytes, held.num_descs = plan.nbytes, plan.num_descs
            msg = NOTIF_PUSH + f"{tid}:{plan.nbytes}{fps}".encode()
            held.t_post = time.monotonic()
            held.strategy = self._strategy(plan.num_descs, plan.nbytes, offer.engine_id)
            if held.strategy == "pack":
                # Staged WRITE: returns once decode acked every chunk (scattered into its
                # blocks); only then the push notification, so its arrival still means the
                # blocks are complete. Runs on this thread, bounded by the hold's deadline.
                assert self._staged is not None
                rinfo = self._peer_staging[offer.engine_id]
                try:
                    self._staged.send(peer, rinfo, local[skip:], remote[skip:], push_xfer_id(tid),
                                      timeout_s=max(0.001, held.deadline - time.monotonic()))
                    held.chunks = self._staged.last_send_chunks
                    self._ep.send_notif(peer, msg)
                except Exception:
                    self._forget_peer(offer.engine_id)
                    raise
                return True
            try:
                held.xfer = self._ep.write(plan, peer, msg)
            except Exception:
                self._forget_peer(offer.engine_id)
                raise
        return self._poll(held.xfer, "WRITE to", held.peer, held.match.offer.engine_id, now, held.deadline)

    def _poll(self, xfer: Any, what: str, peer: str, engine_id: str, now: float, deadline: float | None) -> bool:
        """One non-blocking look at a posted NIXL transfer: True when done (handle released);
        raises on failure (forgetting the peer's metadata, which may be stale) or past the
        deadline."""
        st = self._ep.state(xfer)
        if st == "DONE":
            self._ep.release(xfer)
            return True
        if st == "ERR":
            self._forget_peer(engine_id)
            raise RuntimeError(f"NIXL {what} {peer} failed")
        if deadline is not None and now >= deadline:
            raise TimeoutError(f"NIXL {what} {peer} not done after {self.settings.timeout_s}s")
        return False

    def _report_outcome(self, held: _Held, *, ok: bool, error: str, dur: float) -> None:
        from kvbaton.v1 import rendezvous_pb2 as rpb

        self.stats.record("send_done" if ok else "send_failed", transfer_id=held.spec.transfer_id,
                          req_id=held.req_id, mode=MODE_PUSH, write_nbytes=held.nbytes,
                          num_descs=held.num_descs, error=error, held_s=round(dur, 6),
                          strategy=held.strategy, chunks=held.chunks)
        self.metrics.transfers.labels(MODE_PUSH, "prefill", _outcome(ok, error)).inc()
        if ok:
            self.metrics.transfer_bytes.labels(MODE_PUSH, "write").inc(held.nbytes)
            if held.t_post:
                self.metrics.transfer_seconds.labels(MODE_PUSH, "write").observe(time.monotonic() - held.t_post)
        req = rpb.ReportOutcomeRequest(
            transfer_id=held.spec.transfer_id, attempt=held.match.attempt,
            outcome=rpb.Outcome(engine_id=self.settings.engine_id, tp_rank=0, success=ok,
                                bytes=held.nbytes if ok else 0, error=error[:500],
                                duration_us=int(dur * 1e6)))
        md = grpc_metadata(held.spec.traceparent)
        fut = self.control.submit(lambda c: c.call(c.rendezvous.ReportOutcome, req, metadata=md))
        fut.add_done_callback(lambda f: f.cancelled() or f.exception() is None or log.warning(
            "kvbaton: ReportOutcome failed: %r", f.exception()))

    def _peer(self, eid: str, holder: Any, now: float) -> tuple[str, KvLayout] | None:
        """The peer's (agent, layout), fetched from the registrar once; None while pending."""
        assert self._ep is not None
        if eid in self._peers:
            return self._peers[eid]
        if holder.peer_future is None:
            holder.peer_future = self.control.get_engine(eid)
        if not holder.peer_future.done():
            if now >= holder.deadline:
                holder.peer_future.cancel()
                raise TimeoutError(f"registrar lookup of engine {eid!r} timed out")
            return None
        fut, holder.peer_future = holder.peer_future, None
        resp = fut.result()
        if not resp.ranks:
            raise LookupError(f"engine {eid!r} has no registered ranks")
        rank = resp.ranks[0]
        layout = KvLayout.from_proto_fields(**geometry_fields(rank))
        self._ep.add_peer(rank.agent_name, rank.agent_metadata)
        self._peers[eid] = (rank.agent_name, layout)
        self._peer_staging[eid] = staging_from_rank(rank)
        return self._peers[eid]

    # ------------------------------------------------------------------ loads
    def _progress_loads(self) -> None:
        assert self._ep is not None
        now = time.monotonic()
        keep: list[_Load] = []
        for ld in self._loads:
            try:
                done = self._step_load(ld, now)
            except Exception as exc:  # noqa: BLE001 - any failure → recompute
                if ld.xfer is not None:
                    self._ep.release(ld.xfer)
                self._end_staged(ld, ok=False)
                self._finish_load(ld, ok=False, reason=f"{type(exc).__name__}: {exc}")
                done = True
            if not done:
                keep.append(ld)
        self._loads = keep

    def _step_load(self, ld: _Load, now: float) -> bool:
        """Advance one load; True when finished (reported)."""
        assert self._ep is not None
        eid = ld.spec.remote_engine_id
        tid_s = ld.spec.transfer_id
        if ld.landed:
            return self._step_verify(ld, now)
        if ld.spec.mode == MODE_REUSE:
            return self._step_reuse(ld, now)
        if ld.spec.mode == MODE_PUSH:
            arrived = self._push_arrived.pop(tid_s, None)
            if arrived is not None:
                ld.nbytes = arrived[1]
                # a staged push completed (every chunk scattered) before its notification
                # was sent, so its completion is already here
                if self._staged_done.pop(push_xfer_id(tid_s), None) is not None:
                    ld.strategy = "pack"
                if self.fp is not None:
                    if not arrived[2]:
                        raise KvIntegrityError("the writer sent no fingerprints (verify_kv off there?)")
                    ld.fp_owner = Fingerprints.decode(arrived[2], ())
                return self._landed(ld, now)
            failed = self._push_failed.pop(tid_s, None)
            if failed is not None:
                raise RuntimeError(f"push transfer ended without data: {failed[1]}")
            if now >= ld.deadline:
                raise TimeoutError(f"no push WRITE for {tid_s} after {self.settings.timeout_s}s")
            return False
        if ld.staged_xid:
            if not self._poll_staged(ld, now, ld.deadline, eid):
                return False
            return self._landed(ld, now)
        if ld.xfer is None:
            got = self._peer(eid, ld, now)
            if got is None:
                return False
            peer, remote_layout = got
            ld.peer = peer
            tid = ld.spec.transfer_id.encode()
            if not ld.spec.local_block_ids:
                self._ep.send_notif(peer, NOTIF_DONE + tid)
                self._finish_load(ld, ok=True, reason="release-only")
                return True
            plan = plan_transfer(self.layout, ld.spec.local_block_ids, remote_layout,
                                 ld.spec.remote_block_ids, op="READ", coalesce=True)
            ld.nbytes, ld.num_descs = plan.nbytes, plan.num_descs
            # verify_kv: ask first, so the owner answers in the same poll that serves the READ
            # (while it still holds the blocks and polls fast), not one idle poll later.
            if self._strategy(plan.num_descs, plan.nbytes, eid) == "pack":
                if ld.t_post == 0.0:
                    self._ask_fingerprints(ld, f"t:{ld.spec.transfer_id}", -1)
                    ld.t_post = time.monotonic()
                if not self._start_staged_read(ld, NOTIF_DONE + tid):  # another sender is busy
                    if now >= ld.deadline:
                        raise TimeoutError("staging pool busy with another peer")
                return False
            self._ask_fingerprints(ld, f"t:{ld.spec.transfer_id}", -1)  # the owner finds the run
            ld.t_post = time.monotonic()
            try:
                ld.xfer = self._ep.read(plan, peer, NOTIF_DONE + tid)
            except Exception:
                # Metadata may be stale (prefill restarted): look it up again next time.
                self._forget_peer(eid)
                raise
        if not self._poll(ld.xfer, "READ from", ld.peer, eid, now, ld.deadline):
            return False
        return self._landed(ld, now)

    def _step_reuse(self, ld: _Load, now: float) -> bool:
        """Pin → READ → (unpin in _finish_load). True when finished."""
        from kvbaton.v1 import lease_pb2 as lpb

        assert self._ep is not None and ld.spec.reuse is not None
        src = ld.spec.reuse
        if not ld.pin_id:
            if ld.pin_future is None:
                ld.pin_sent = now
                req = lpb.PinRequest(conversation_id=src.conversation_id, lease_id=src.lease_id,
                                     reader=self.name, ttl_ms=int(self.settings.pin_ttl_s * 1000))
                md = grpc_metadata(ld.spec.traceparent)
                ld.pin_future = self.control.submit(lambda c: c.call(c.lease.Pin, req, retries=1, metadata=md))
            if not ld.pin_future.done():
                if now >= ld.deadline:
                    ld.pin_future.cancel()
                    raise TimeoutError("Lease.Pin did not answer")
                return False
            fut, ld.pin_future = ld.pin_future, None
            try:
                resp = fut.result()
            except Exception as exc:  # noqa: BLE001 - refused or unreachable: either way, do not read
                detail = exc.details() if hasattr(exc, "details") else repr(exc)
                raise RuntimeError(f"pin refused: {detail}") from None
            ld.pin_id = resp.pin.pin_id
            ld.read_deadline = ld.pin_sent + self.settings.pin_ttl_s * 0.5
            if resp.lease.retention_id != src.retention_id or resp.lease.engine_id != src.engine_id:
                raise RuntimeError(f"lease {src.lease_id} now protects retention {resp.lease.retention_id!r}, "
                                   f"not {src.retention_id!r}")
        if now >= ld.read_deadline:
            raise TimeoutError(f"reuse READ from {src.engine_id} not done within half the pin TTL")
        if ld.staged_xid:
            if not self._poll_staged(ld, now, ld.read_deadline, src.engine_id):
                return False
            return self._landed(ld, now)
        if ld.xfer is None and self.faults.path:  # test-only: widen the READ window, pin held
            if not ld.delay_until:
                ld.delay_until = now + self.faults.value("delay_reuse_read_s")
                if ld.delay_until > now:
                    self.stats.record("fault_delay", req_id=ld.req_id, conversation_id=src.conversation_id,
                                      delay_s=ld.delay_until - now, pin_id=ld.pin_id)
            if now < ld.delay_until:
                return False
        if ld.xfer is None:
            got = self._peer(src.engine_id, ld, now)
            if got is None:
                return False
            peer, remote_layout = got
            ld.peer = peer
            plan = plan_transfer(self.layout, ld.spec.local_block_ids, remote_layout,
                                 ld.spec.remote_block_ids, op="READ", coalesce=True)
            ld.nbytes, ld.num_descs = plan.nbytes, plan.num_descs
            msg = NOTIF_REUSE + f"{src.conversation_id}:{plan.nbytes}".encode()
            first = src.num_tokens // self.layout.tokens_per_block - len(ld.spec.remote_block_ids)
            if self._strategy(plan.num_descs, plan.nbytes, src.engine_id) == "pack":
                if ld.t_post == 0.0:
                    self._ask_fingerprints(ld, f"r:{src.conversation_id}", first)
                    ld.t_post = time.monotonic()
                self._start_staged_read(ld, msg)  # False: another sender busy (read deadline bounds it)
                return False
            self._ask_fingerprints(ld, f"r:{src.conversation_id}", first)  # verify_kv (before the READ)
            ld.t_post = time.monotonic()
            try:
                ld.xfer = self._ep.read(plan, peer, msg)
            except Exception:
                self._forget_peer(src.engine_id)
                raise
        # No deadline here: the read deadline (half the pin TTL) was checked above.
        if not self._poll(ld.xfer, "READ from", ld.peer, src.engine_id, now, None):
            return False
        return self._landed(ld, now)

    # ------------------------------------------------------------------ verify_kv
    def _fingerprint_exposed(self, key: str, block_ids: Any, *, mode: str, **fields: Any) -> None:
        """Owner: start fingerprinting blocks we expose under ``key`` (verify thread)."""
        if self.fp is None or not block_ids:
            return
        ids = tuple(int(b) for b in block_ids)
        t0 = time.monotonic()
        fut = self.fp.submit(ids)
        recs = self._fp_records.setdefault(key, [])
        recs.insert(0, _FpRecord(ids, fut, t0, str(fields.get("hold_id", ""))))
        del recs[8:]  # a conversation's last few retentions are plenty
        if key.startswith("r:"):
            self._retained_records += 1
            if self._retained_records > _MAX_RETAINED_RECORDS:  # safety net: drop the oldest
                ordered = sorted((r.t, k) for k, rs in self._fp_records.items() if k.startswith("r:") for r in rs)
                cut = ordered[len(ordered) - _MAX_RETAINED_RECORDS][0]
                for k in {k for _, k in ordered}:
                    self._fp_records[k] = [r for r in self._fp_records[k] if r.t >= cut]
                    if not self._fp_records[k]:
                        del self._fp_records[k]
                self._retained_records = sum(len(rs) for k, rs in self._fp_records.items() if k.startswith("r:"))

        def _done(f: concurrent.futures.Future[Fingerprints]) -> None:
            if f.cancelled() or f.exception() is not None:
                log.warning("kvbaton: fingerprinting %s failed: %r", key, None if f.cancelled() else f.exception())
                return
            # Recorded by the transfer thread (the stats file has one writer).
            self.inbox.put(("fp_stat", key, {"mode": mode, "role": "owner", "num_blocks": len(ids),
                                             "alg": f.result().alg,
                                             "duration_s": round(time.monotonic() - t0, 6), **fields}))
        fut.add_done_callback(_done)

    def _fp_record(self, key: str, first: int, ids: tuple[int, ...]) -> tuple[_FpRecord, int] | None:
        """Owner: the newest record under ``key`` holding ``ids`` as a run, and where it
        starts. ``first`` is the reader's hint; a reader that skipped leading blocks it
        had cached locally (pull after a prefix hit) reads a later run, found by the
        position of its first id (block ids are unique within one record)."""
        for rec in self._fp_records.get(key, ()):
            if not ids:
                return rec, 0
            starts = [first] if 0 <= first < len(rec.block_ids) else []
            if ids[0] in rec.block_ids:
                starts.append(rec.block_ids.index(ids[0]))
            for a in starts:
                if rec.block_ids[a:a + len(ids)] == ids:
                    return rec, a
        return None

    def _on_fp_question(self, peer: str, msg: bytes) -> None:
        """Owner: a reader wants our fingerprints of blocks it READ (answered from the loop)."""
        try:
            key, reader, first, ids = msg[len(NOTIF_FPQ):].decode().rsplit("|", 3)
            block_ids = tuple(int(b) for b in ids.split(",")) if ids else ()
            now = time.monotonic()
            ans = _FpAnswer(key, reader, int(first), block_ids, now + min(self.settings.timeout_s, 10.0), now)
        except ValueError:
            log.warning("kvbaton: malformed fingerprint question from %s: %r", peer, msg[:200])
            return
        self._fp_answers.append(ans)

    def _progress_fp_answers(self) -> None:
        """Owner: answer questions whose record is ready (or say why not) once the reader's
        NIXL metadata is known. Bounded: a question is dropped at its deadline."""
        if not self._fp_answers or self._ep is None:
            return
        now = time.monotonic()
        keep: list[_FpAnswer] = []
        for ans in self._fp_answers:
            try:
                if self.fp is None:
                    text = "!verify_kv is off on the owner"
                else:
                    found = self._fp_record(ans.key, ans.first, ans.block_ids)
                    rec, a = found if found is not None else (None, 0)
                    # A question may beat the SendSpec / retained hold it is about to this
                    # thread (they come with the engine's next step): wait a little, not
                    # long for retained blocks (their hold came a whole turn earlier).
                    limit = min(ans.deadline, ans.t0 + (5.0 if ans.key.startswith("t:") else 1.0))
                    if rec is None or not rec.future.done():
                        if now < limit:
                            keep.append(ans)
                            continue
                        text = "!no fingerprints of those blocks" if rec is None else "!fingerprints not ready"
                    else:
                        fps = rec.future.result()
                        n = len(ans.block_ids)
                        text = Fingerprints(fps.alg, fps.block_ids[a:a + n], fps.values[a:a + n]).encode()
                got = self._peer(ans.reader, ans, now)
                if got is None:
                    keep.append(ans)
                    continue
                self._ep.send_notif(got[0], NOTIF_FPA + f"{ans.key}|{text}".encode())
                self.stats.record("kv_fp_answer", key=ans.key, reader=ans.reader, num_blocks=len(ans.block_ids),
                                  answer="ok" if not text.startswith("!") else text[1:])
            except Exception as exc:  # noqa: BLE001 - the reader fails its load at its own deadline
                log.warning("kvbaton: fingerprint answer to %s for %s failed: %r", ans.reader, ans.key, exc)
                self._forget_peer(ans.reader)  # its metadata may be stale (restarted): look it up again
        self._fp_answers = keep

    def _on_fp_answer(self, peer: str, msg: bytes) -> None:
        key, _, text = msg[len(NOTIF_FPA):].decode(errors="replace").rpartition("|")
        self._fp_replies[key] = (time.monotonic(), text)

    def _ask_fingerprints(self, ld: _Load, key: str, first: int) -> None:
        """Reader: just before posting a READ, ask the owner for its fingerprints (the
        answer travels while the data does)."""
        if self.fp is None:
            return
        ld.fp_key = key
        self._fp_replies.pop(key, None)  # an older answer for the same key is not ours
        ids = ",".join(str(int(b)) for b in ld.spec.remote_block_ids)
        self._ep.send_notif(ld.peer, NOTIF_FPQ + f"{key}|{self.settings.engine_id}|{first}|{ids}".encode())

    def _landed(self, ld: _Load, now: float) -> bool:
        """The data is in our blocks: finish now, or verify first (``verify_kv``)."""
        ld.xfer = None  # released by _poll
        if self.fp is None or not ld.spec.local_block_ids:
            self._finish_load(ld, ok=True)
            return True
        ld.landed, ld.t_landed = True, now
        return self._step_verify(ld, now)

    def _step_verify(self, ld: _Load, now: float) -> bool:
        """Reader: owner's fingerprints vs ours of what landed; True when finished (ok).
        Raises KvIntegrityError (→ failed load → recompute) on mismatch or no answer."""
        assert self.fp is not None
        if ld.fp_owner is None:
            got = self._fp_replies.pop(ld.fp_key, None)
            if got is None:
                # The owner answers within one of its polls; a dead or silent owner fails
                # the load (we cannot vouch for the bytes), bounded by the load's deadlines.
                limit = min(ld.deadline, ld.t_landed + min(self.settings.timeout_s, 5.0))
                if ld.spec.mode == MODE_REUSE:
                    limit = min(limit, ld.read_deadline)
                if now >= limit:
                    self._count_verify(ld, "unavailable")
                    raise KvIntegrityError(f"no fingerprints from the owner of {ld.fp_key} in time")
                return False
            if got[1].startswith("!"):
                self._count_verify(ld, "unavailable")
                raise KvIntegrityError(f"owner cannot vouch for {ld.fp_key}: {got[1][1:]}")
            ld.fp_owner = Fingerprints.decode(got[1], ld.spec.remote_block_ids)
        if ld.fp_local is None:
            if self.faults.path and self.faults.take_corruption(ld.spec.mode):
                corrupt_block(self.layout, ld.spec.local_block_ids[0])  # test-only fault
                ld.corrupted = True
                self.stats.record("fault_corrupt", req_id=ld.req_id, mode=ld.spec.mode,
                                  block_id=ld.spec.local_block_ids[0])
            ld.fp_local = self.fp.submit(ld.spec.local_block_ids, ld.fp_owner.alg)
        if not ld.fp_local.done():
            if now >= ld.deadline:
                raise TimeoutError("fingerprinting the landed blocks took too long")
            return False
        mine = ld.fp_local.result()
        bad = compare(ld.fp_owner.values, mine.values)
        self._count_verify(ld, "mismatch" if bad else "ok", mismatched=bad[:16], alg=mine.alg,
                           verify_s=round(time.monotonic() - ld.t_landed, 6))
        if bad:
            log.warning("kvbaton: KV integrity mismatch on %s load %s (%s): %d of %d blocks differ from the "
                        "owner's fingerprints; recomputing", ld.spec.mode, ld.req_id, ld.fp_key or ld.spec.transfer_id,
                        len(bad), len(ld.spec.local_block_ids))
            raise KvIntegrityError(f"{len(bad)} of {len(ld.spec.local_block_ids)} blocks differ from the owner's")
        self._finish_load(ld, ok=True)
        return True

    def _count_verify(self, ld: _Load, result: str, **fields: Any) -> None:
        self.metrics.kv_verifications.labels(ld.spec.mode, result).inc()
        src = ld.spec.reuse
        self.stats.record("kv_verify", req_id=ld.req_id, mode=ld.spec.mode, transfer_id=ld.spec.transfer_id,
                          conversation_id=src.conversation_id if src else "", ok=result == "ok", result=result,
                          num_blocks=len(ld.spec.local_block_ids), corrupted=ld.corrupted, **fields)

    def _unpin(self, ld: _Load) -> None:
        """Release our pin (fire-and-forget: a lost Unpin only delays expiry by the pin TTL)."""
        from kvbaton.v1 import lease_pb2 as lpb

        src = ld.spec.reuse
        if src is None or not ld.pin_id:
            return
        req = lpb.UnpinRequest(conversation_id=src.conversation_id, lease_id=src.lease_id, pin_id=ld.pin_id)
        ld.pin_id = ""
        md = grpc_metadata(ld.spec.traceparent)
        fut = self.control.submit(lambda c: c.call(c.lease.Unpin, req, retries=2, metadata=md))
        fut.add_done_callback(lambda f: f.cancelled() or f.exception() is None or log.warning(
            "kvbaton: Unpin failed (the pin lapses by itself): %r", f.exception()))

    def _forget_peer(self, eid: str) -> None:
        self._peer_staging.pop(eid, None)
        got = self._peers.pop(eid, None)
        if got is not None and self._ep is not None:
            try:
                self._ep.remove_peer(got[0])
            except Exception:  # noqa: BLE001
                log.debug("remove_peer failed", exc_info=True)

    def _count_load(self, ld: _Load, *, ok: bool, reason: str, now: float) -> None:
        """Connector metrics for a finished load (decode's pull/push receive, prefill's reuse READ)."""
        mode = ld.spec.mode
        if not ld.spec.local_block_ids:
            return  # release only: nothing to receive, nothing moved
        m = self.metrics
        m.transfers.labels(mode, "prefill" if mode == MODE_REUSE else "decode", _outcome(ok, reason)).inc()
        if not ok:
            m.recomputes.labels(_recompute_reason(reason)).inc()
            return
        if mode != MODE_PUSH:  # a push was written by prefill, which counts its bytes
            m.transfer_bytes.labels(mode, "read").inc(ld.nbytes)
            if ld.t_post:
                m.transfer_seconds.labels(mode, "read").observe(now - ld.t_post)
        if mode == MODE_REUSE:
            m.reused_tokens.inc(len(ld.spec.local_block_ids) * self.layout.tokens_per_block)

    def _finish_load(self, ld: _Load, *, ok: bool, reason: str = "") -> None:
        self._end_staged(ld, ok=ok)
        now = time.monotonic()
        dur = now - ld.t0
        self._count_load(ld, ok=ok, reason=reason, now=now)
        if ld.spec.mode == MODE_REUSE:
            self._unpin(ld)
            src = ld.spec.reuse
            if ok:
                self.stats.record("reuse_read", conversation_id=src.conversation_id if src else "",
                                  req_id=ld.req_id, nbytes=ld.nbytes, num_descs=ld.num_descs, strategy=ld.strategy,
                                  num_blocks=len(ld.spec.local_block_ids), duration_s=round(dur, 6))
            else:
                self.stats.record("reuse_failed", conversation_id=src.conversation_id if src else "",
                                  req_id=ld.req_id, reason=reason, duration_s=round(dur, 6))
            self.results.put(("recv", ld.req_id, ok, ld.spec.local_block_ids))
            return
        if ok and ld.spec.local_block_ids:
            self.stats.record("recv_done", transfer_id=ld.spec.transfer_id, req_id=ld.req_id,
                              nbytes=ld.nbytes, num_descs=ld.num_descs, mode=ld.spec.mode,
                              strategy=ld.strategy,
                              num_blocks=len(ld.spec.local_block_ids), duration_s=round(dur, 6))
        elif ok:
            self.stats.record("release_sent", transfer_id=ld.spec.transfer_id, req_id=ld.req_id)
        else:
            self.stats.record("recv_failed", transfer_id=ld.spec.transfer_id, req_id=ld.req_id,
                              reason=reason, duration_s=round(dur, 6))
            if ld.spec.mode == MODE_PUSH and ld.spec.transfer_id and self._staged is not None:
                # a staged WRITE still in flight must not land in blocks vLLM frees now
                self._staged.cancel(push_xfer_id(ld.spec.transfer_id))
            if ld.spec.mode == MODE_PUSH and ld.spec.transfer_id:
                # Tell the rendezvous we gave up, so a late match is refused and prefill
                # frees its blocks (a write already in flight can still land: not fenced yet).
                from kvbaton.v1 import rendezvous_pb2 as rpb

                cancel = rpb.CancelRequest(transfer_id=ld.spec.transfer_id, engine_id=self.settings.engine_id,
                                           reason=f"decode gave up: {reason}"[:200])
                md = grpc_metadata(ld.spec.traceparent)
                self.control.submit(lambda c: c.call(c.rendezvous.Cancel, cancel, retries=1, metadata=md))
            # Let prefill free now rather than at its timeout (best effort).
            if ld.peer and self._ep is not None and ld.spec.remote_engine_id in self._peers:
                try:
                    self._ep.send_notif(ld.peer, NOTIF_DONE + ld.spec.transfer_id.encode())
                except Exception:  # noqa: BLE001
                    log.debug("failure notif not sent", exc_info=True)
        if ld.spec.report_recv:
            self.results.put(("recv", ld.req_id, ok, ld.spec.local_block_ids))


class KvbatonWorker:
    """Worker-side facade state: hands specs to the transfer thread, reports results."""

    def __init__(self, settings: KvbatonSettings, kv_role: str, tp_rank: int = 0) -> None:
        self.settings = settings
        self.kv_role = kv_role
        self.tp_rank = tp_rank
        self.stats = StatsLog(settings.stats_dir, settings.engine_id)
        self._control: ControlThread | None = None
        self._xfer: TransferThread | None = None
        self._expect_send: set[str] = set()  # held on the scheduler side for a transfer
        self._seen_finished: set[str] = set()
        self._sent_pending: set[str] = set()  # done sending, not yet seen in finished_req_ids
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], block_size: int) -> None:
        # All layers' tensors share one allocation on CPU; KvLayout merges adjacent regions
        # into one NIXL registration.
        tensors = list(kv_caches.values())
        layout = KvLayout.from_tensors(tensors, block_size, block_dim=0)
        self._control = ControlThread(self.settings.control_plane)
        fp = Fingerprinter(layout, tensors, self.settings.verify_kv_alg) if self.settings.verify_kv else None
        self._xfer = TransferThread(self.settings, self.tp_rank, layout, self._control, self.stats, fp,
                                    tensors=tensors)
        self._xfer.start()
        from kvbaton.v1 import common_pb2, registrar_pb2

        rank = registrar_pb2.EngineRank(
            engine_id=self.settings.engine_id, tp_size=1,
            role=role_of({"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}.get(
                self.settings.serve_role, self.kv_role)),
            tp_rank=self.tp_rank, agent_name=self._xfer.name, agent_metadata=self._xfer.metadata,
            geometry=common_pb2.KvGeometry(**layout.to_proto_fields()),
            labels={"mode": self.settings.mode}, serve_url=self.settings.serve_url)
        si = self._xfer.staging_info
        if si is not None:  # where peers WRITE staged chunks into us (pack path)
            rank.staging.CopyFrom(common_pb2.KvStaging(base_addr=si.base_addr, slot_bytes=si.slot_bytes,
                                                       num_slots=si.num_slots, mem_type=si.mem_type,
                                                       device_id=si.device_id))
        self._control.register_rank(rank, self.settings.ttl_ms)
        inbox = self._xfer.inbox
        self._control.subscribe(self.settings.engine_id, self.tp_rank,
                                lambda ev: inbox.put(("event", ev.transfer.transfer_id, ev)))
        log.info("kvbaton: worker ready: engine %s agent %s, %d regions x %d blocks x %d B",
                 self.settings.engine_id, self._xfer.name, layout.num_regions, layout.num_blocks,
                 layout.bytes_per_block)

    def on_meta(self, meta: KvbatonMeta | None) -> None:
        """Hand this step's specs to the transfer thread (called from bind_connector_metadata,
        which vLLM calls every step, empty ones included)."""
        if meta is None or self._xfer is None:
            return
        for req_id, spec in meta.loads.items():
            self._xfer.inbox.put(("load", req_id, spec))
        for req_id, sspec in meta.sends.items():
            self._expect_send.add(req_id)
            self._xfer.inbox.put(("send", req_id, sspec))
            if sspec.complete_here and self.tp_rank == 0:
                self._send_complete(sspec)
        if self._xfer.fp is not None:
            for hold_id, retained in getattr(meta, "retains", {}).items():  # or freed: empty ids
                self._xfer.inbox.put(("retain", hold_id, retained))

    def _send_complete(self, sspec: SendSpec) -> None:
        """Push: tell the rendezvous these blocks are ready, from this process's control
        thread (``complete_from_worker``). Fire-and-forget like the scheduler's: a lost
        Complete ends in the hold's timeout and decode's recompute."""
        from .scheduler import push_complete

        assert self._control is not None
        req = push_complete(self.settings, sspec.transfer_id, sspec.block_ids, sspec.num_tokens, sspec.request_id)
        md = grpc_metadata(sspec.traceparent)
        t0 = time.monotonic()
        fut = self._control.submit(lambda c: c.call(c.rendezvous.Complete, req, metadata=md))

        def _done(f: concurrent.futures.Future[Any]) -> None:
            err = "cancelled" if f.cancelled() else repr(f.exception()) if f.exception() is not None else ""
            if err:
                log.warning("kvbaton: Complete for %s failed: %s", sspec.transfer_id, err)
            self.stats.record("rpc", rpc="Complete", transfer_id=sspec.transfer_id, error=err,
                              latency_ms=round((time.monotonic() - t0) * 1000, 2))
        fut.add_done_callback(_done)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._seen_finished |= finished_req_ids & self._expect_send
        recving: set[str] = set()
        if self._xfer is not None:
            while True:
                try:
                    kind, req_id, ok, blocks = self._xfer.results.get_nowait()
                except queue.Empty:
                    break
                if kind == "sent":
                    self._sent_pending.add(req_id)
                else:
                    recving.add(req_id)
                    if not ok:
                        self._load_errors.update(blocks)
        # vLLM asserts finished_sending ids were seen finished (API notes §4.7).
        sending = self._sent_pending & self._seen_finished
        self._sent_pending -= sending
        self._seen_finished -= sending
        self._expect_send -= sending
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def shutdown(self) -> None:
        if self._xfer is not None:
            self._xfer.stop()
            if self._xfer.fp is not None:
                self._xfer.fp.close()
        if self._control is not None:
            self._control.close()
