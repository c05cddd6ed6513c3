"""Bidirectional reuse: decode keeps a finished turn's KV under a lease; prefill reads it.

Decode side (:class:`RetentionManager`, scheduler process ``VLLM::EngineCore``):

* **How blocks are held.** Not by returning ``True`` from ``request_finished`` (that keeps
  the whole request alive in the scheduler, and a held request makes EngineCore and the
  worker spin a core for as long as it is held — VLLM_API_NOTES.md §0.4 — which for a 30 s lease
  on a 2-core machine is unacceptable). Instead the manager takes its own reference on the
  *full* blocks with ``BlockPool.touch`` (the same refcount prefix caching uses), returns
  ``False`` so vLLM frees the request normally, and drops the reference with
  ``BlockPool.free_blocks`` when the lease ends. The engine stays idle while blocks are
  retained; the partial last block is freed with the request. Block-pool calls happen only
  on the engine-loop thread (:meth:`RetentionManager.drain`, called from scheduler hooks).
* **Who owns them.** Every :class:`Hold` has an owner (the lease, once granted) and a local
  deadline. Ending events come from ``Lease.Watch`` (EXPIRED/REVOKED, decided by the lease
  service's clock); a periodic ``Lease.List`` re-confirms live leases (their
  ``remaining_ms``, no clock comparison) and catches events a broken stream missed.
* **Last resort.** A hold not confirmed alive by the control plane for
  ``hard_cap_s`` (> lease TTL + the longest pin) is freed locally, so an unreachable
  control plane cannot leak blocks.
* **Pressure.** Above ``max_retained_fraction`` of the KV blocks, the least-recently
  renewed leases (oldest ``expires_at_ms - ttl_ms``) are revoked at the service; the
  resulting events free them (a pinned lease drains first: never freed under a reader).
* **Lazy free.** Freed holds go on a queue drained by the engine thread at its next
  scheduler hook (admission or step). An idle engine does not step, so blocks of an ended
  lease go back to the pool when the next request arrives — before it is allocated
  (``get_num_new_matched_tokens`` drains first). Nothing needs them before that.

Prefill side: :func:`reusable_blocks` compares the conversation's hash chain with the
prompt's; the worker's receive flow (``flows/receive.py``) pins, READs and unpins.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbaton.v1 import lease_pb2 as lpb
from kvbaton.v1 import registrar_pb2 as rpb

from .flows.faults import Faults
from .settings import MAX_PIN_S, KvbatonSettings
from .statslog import StatsLog

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.block_pool import BlockPool

    from .control import ControlThread

log = logging.getLogger("kvbaton.connector.reuse")

_HASH_SEED = b"kvbaton-block-chain-v1"


def hash_chain(token_ids: Sequence[int] | np.ndarray, block_size: int,
               num_blocks: int | None = None) -> list[bytes]:
    """sha256 chained over full token blocks: ``h[i]`` covers tokens ``[0, (i+1)*block_size)``.

    Chained (each digest hashes the previous one) so equal ``h[i]`` means equal prefixes,
    not just equal blocks. Tokens are hashed as little-endian int32, one update per block.
    """
    arr = np.asarray(token_ids, dtype="<i4")
    n = arr.shape[0] // block_size
    if num_blocks is not None:
        n = min(n, num_blocks)
    out: list[bytes] = []
    prev = _HASH_SEED
    for i in range(n):
        h = hashlib.sha256(prev)
        h.update(arr[i * block_size:(i + 1) * block_size].tobytes())
        prev = h.digest()
        out.append(prev)
    return out


def reusable_blocks(prompt_token_ids: Sequence[int], block_size: int, remote_hashes: Sequence[bytes]) -> int:
    """How many leading full blocks of the prompt equal the retained ones (hash chain)."""
    mine = hash_chain(prompt_token_ids, block_size, len(remote_hashes))
    k = 0
    for a, b in zip(mine, remote_hashes):
        if a != b:
            break
        k += 1
    return k


@dataclasses.dataclass
class Hold:
    """Blocks decode keeps for one turn of a conversation (one reference each)."""

    hold_id: str
    conversation_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    block_hashes: tuple[bytes, ...]
    created: float
    confirmed: float  # last time the control plane said the lease is live (monotonic)
    hard_deadline: float
    lease_id: str = ""
    retention_id: str = ""
    state: str = "registering"  # registering | leased | ending | freed


class RetentionManager:
    """Decode-side owner of retained blocks (see module docstring). Engine-loop methods:
    :meth:`retain`, :meth:`drain`. Everything else runs on the control thread."""

    def __init__(self, settings: KvbatonSettings, block_size: int, control: ControlThread) -> None:
        self.settings = settings
        self.block_size = block_size
        self.control = control
        self.block_pool: BlockPool | None = None
        self.num_blocks = 0
        self.holder = uuid.uuid4().hex[:12]  # this process's label on its leases
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}  # hold_id -> hold
        self._by_lease: dict[str, str] = {}  # lease_id -> hold_id
        self._ended_early: dict[str, float] = {}  # lease ended before its Grant answer came
        self._to_free: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        #: verify_kv: holds retained since the last step, for the worker to fingerprint.
        self._to_fingerprint: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.stats: dict[str, int] = {"retained": 0, "freed": 0, "hard_cap_freed": 0, "grant_failed": 0,
                                      "revoked_for_pressure": 0, "blocks_held": 0}
        self._started = False
        #: ``<stats_dir>/<engine>.retention.jsonl``: retained / freed (with why) / hard cap.
        self.events = StatsLog(settings.stats_dir, settings.engine_id, part="retention")
        #: test-only: ``delay_grant_s`` holds the Grant back after RegisterRetained (the
        #: window in which a client acting on the answer raced decode, router/retention.py)
        self._faults = Faults(settings.fault_file)

    # ------------------------------------------------------------------ engine loop
    def bind(self, block_pool: BlockPool) -> None:
        """Start owning retained blocks of this pool. The lease watch starts now, not at
        the first retained turn: after a restart it must revoke leases that an earlier
        incarnation of this engine left behind (their block ids mean nothing now)."""
        self.block_pool = block_pool
        self.num_blocks = int(block_pool.num_gpu_blocks)
        self._start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Engine shutdown: revoke our live leases (bounded, best effort) so no reader
        pins blocks of an engine that is going away; unreached ones expire by TTL."""
        with self._lock:
            live = [(h.conversation_id, h.lease_id) for h in self._holds.values() if h.state == "leased"]
        if not live:
            return

        async def _revoke_all(c: Any) -> None:
            for conv, lid in live:
                try:
                    await c.call(c.lease.Revoke, lpb.RevokeRequest(
                        conversation_id=conv, lease_id=lid, reason="decode engine shutting down"), retries=0)
                except Exception as exc:  # noqa: BLE001 - best effort: the TTL ends it anyway
                    log.debug("kvbaton: revoke on shutdown failed: %r", exc)
        try:
            self.control.submit(_revoke_all).result(timeout=timeout_s)
        except Exception:  # noqa: BLE001
            log.info("kvbaton: not every retained lease was revoked at shutdown; they expire by TTL")

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        self.control.submit(self._watch_loop)
        self.control.submit(self._confirm_loop)

    def retain(self, conversation_id: str, token_ids: Sequence[int], block_ids: Sequence[int],
               num_computed_tokens: int) -> dict[str, Any] | None:
        """Keep the full blocks of a finished turn; returns what to tell the client (or None).

        Runs on the engine loop inside ``request_finished`` (before vLLM frees the request's
        blocks): touches the blocks, then registers + leases them from the control thread.
        """
        if self.block_pool is None or not conversation_id:
            return None
        n_full = min(int(num_computed_tokens) // self.block_size, len(block_ids))
        if n_full == 0:
            return None
        ids = tuple(int(b) for b in block_ids[:n_full])
        if 0 in ids:  # the null block (a skipped/sliding window): nothing sane to retain
            return None
        cap = int(self.settings.max_retained_fraction * self.num_blocks)
        if n_full > cap:
            log.info("kvbaton: not retaining %s: %d blocks > cap %d", conversation_id, n_full, cap)
            return None
        self._start()
        hashes = tuple(hash_chain(list(token_ids)[: n_full * self.block_size], self.block_size))
        self.block_pool.touch([self.block_pool.blocks[i] for i in ids])
        now = time.monotonic()
        hold = Hold(uuid.uuid4().hex, conversation_id, ids, n_full * self.block_size, hashes, now, now,
                    now + self.settings.hard_cap_s)
        with self._lock:
            self._holds[hold.hold_id] = hold
            held = self._held_blocks()
        self.stats["retained"] += 1
        self.stats["blocks_held"] = held
        if self.settings.verify_kv:
            self._to_fingerprint[hold.hold_id] = (conversation_id, ids)
        self.control.submit(lambda c: self._register(c, hold))
        return {"conversation_id": conversation_id, "engine_id": self.settings.engine_id,
                "hold_id": hold.hold_id, "block_ids": list(ids), "num_tokens": hold.num_tokens,
                "tokens_per_block": self.block_size, "lease": "pending"}

    def take_retains(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Engine loop (``build_connector_meta``): holds retained since the last step, for
        the worker to fingerprint (``verify_kv``), and holds freed since (empty block ids:
        the worker forgets their fingerprints). vLLM runs one more step after a request
        finishes (to tell the workers), so a retention reaches the worker right after the
        turn, while the blocks are already held by this manager and no longer written."""
        out, self._to_fingerprint = self._to_fingerprint, {}
        return out

    def _held_blocks(self) -> int:
        return len({b for h in self._holds.values() if h.state != "freed" for b in h.block_ids})

    def drain(self) -> int:
        """Engine loop: give back the blocks of ended holds (and of holds past the hard cap)."""
        if self.block_pool is None:
            return 0
        now = time.monotonic()
        with self._lock:
            for h in self._holds.values():
                if h.state != "freed" and now >= h.hard_deadline:
                    log.warning("kvbaton: hold %s of %s not confirmed by the control plane for %.0fs: "
                                "freeing locally (hard cap)", h.hold_id, h.conversation_id,
                                now - h.confirmed)
                    self.stats["hard_cap_freed"] += 1
                    self._end_locked(h, "hard cap")
        freed = 0
        while True:
            try:
                hold_id, why = self._to_free.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                ended = self._holds.pop(hold_id, None)
                if ended is not None and ended.lease_id:
                    self._by_lease.pop(ended.lease_id, None)
            if ended is None:
                continue
            h = ended
            # Tail blocks first: they are the least likely to be hit as a prefix again.
            self.block_pool.free_blocks([self.block_pool.blocks[i] for i in reversed(h.block_ids)])
            if self.settings.verify_kv:  # the worker drops its fingerprints of them
                self._to_fingerprint[h.hold_id] = (h.conversation_id, ())
            freed += 1
            self.stats["freed"] += 1
            self.events.record("retention_freed", conversation_id=h.conversation_id, lease_id=h.lease_id,
                               num_blocks=len(h.block_ids), why=why,
                               held_s=round(time.monotonic() - h.created, 3))
            log.info("kvbaton: freed %d retained blocks of %s (%s)", len(h.block_ids), h.conversation_id, why)
        if freed:
            with self._lock:
                self.stats["blocks_held"] = self._held_blocks()
        return freed

    def _end_locked(self, h: Hold, why: str) -> None:
        """Mark a hold freed and queue its blocks for the engine loop (call with the lock)."""
        if h.state == "freed":
            return
        h.state = "freed"
        self._to_free.put((h.hold_id, why))
        if h.retention_id:
            rid, conv = h.retention_id, h.conversation_id
            self.control.submit(lambda c: self._release_retained(c, conv, rid))

    # ------------------------------------------------------------------ control thread
    async def _release_retained(self, c: Any, conv: str, rid: str) -> None:
        try:
            await c.call(c.registrar.ReleaseRetained,
                         rpb.ReleaseRetainedRequest(conversation_id=conv, retention_id=rid), retries=1)
        except Exception as exc:  # noqa: BLE001 - housekeeping only
            log.debug("kvbaton: ReleaseRetained(%s) failed: %r", conv, exc)

    async def _register(self, c: Any, hold: Hold) -> None:
        """RegisterRetained, then Grant; any failure frees the hold (no lease, no owner)."""
        try:
            reg = await c.call(c.registrar.RegisterRetained, rpb.RegisterRetainedRequest(
                retained=rpb.RetainedBlocks(
                    conversation_id=hold.conversation_id, engine_id=self.settings.engine_id,
                    block_ids=list(hold.block_ids), num_tokens=hold.num_tokens,
                    block_hashes=list(hold.block_hashes), tokens_per_block=self.block_size)), retries=2)
            hold.retention_id = reg.retained.retention_id
            if (delay := self._faults.value("delay_grant_s")) > 0:
                self.events.record("fault_delay", fault="delay_grant_s", conversation_id=hold.conversation_id,
                                   delay_s=delay)
                await asyncio.sleep(delay)
            resp = await c.call(c.lease.Grant, lpb.GrantRequest(
                conversation_id=hold.conversation_id, engine_id=self.settings.engine_id,
                ttl_ms=int(self.settings.lease_ttl_s * 1000), num_blocks=len(hold.block_ids),
                retention_id=hold.retention_id, labels={"holder": self.holder}), retries=2)
        except Exception as exc:  # noqa: BLE001 - no lease: the blocks have no owner, free them
            self.stats["grant_failed"] += 1
            self.events.record("retain_failed", conversation_id=hold.conversation_id, error=repr(exc)[:300])
            log.warning("kvbaton: retaining %s failed (%r); freeing its blocks", hold.conversation_id, exc)
            with self._lock:
                self._end_locked(hold, "grant failed")
            return
        lease = resp.lease
        with self._lock:
            hold.lease_id = lease.lease_id
            self._by_lease[lease.lease_id] = hold.hold_id
            if hold.state == "freed":  # hard cap hit while registering: end the lease too
                self.control.submit(lambda c: c.call(c.lease.Revoke, lpb.RevokeRequest(
                    conversation_id=hold.conversation_id, lease_id=lease.lease_id,
                    reason="decode freed the blocks"), retries=1))
                return
            hold.state = "leased"
            self._confirm_locked(hold, lease.remaining_ms)
            if self._ended_early.pop(lease.lease_id, None) is not None:
                self._end_locked(hold, "lease ended before grant was seen")
        log.info("kvbaton: retained %d blocks (%d tokens) of %s under lease %s",
                 len(hold.block_ids), hold.num_tokens, hold.conversation_id, lease.lease_id)
        self.events.record("retained", conversation_id=hold.conversation_id, lease_id=lease.lease_id,
                           retention_id=hold.retention_id, num_blocks=len(hold.block_ids),
                           num_tokens=hold.num_tokens, ttl_ms=lease.ttl_ms)
        # Pressure is relieved after the grant, so the List sees this lease and spares it.
        cap = int(self.settings.max_retained_fraction * self.num_blocks)
        with self._lock:
            held = self._held_blocks()
        if held > cap:
            self.stats["revoked_for_pressure"] += await revoke_oldest(c, self.settings.engine_id, held - cap,
                                                                      spare=lease.lease_id)

    def _confirm_locked(self, h: Hold, remaining_ms: int) -> None:
        now = time.monotonic()
        h.confirmed = now
        h.hard_deadline = now + max(self.settings.hard_cap_s, remaining_ms / 1000 + MAX_PIN_S + 5.0)

    def _on_lease_ended(self, lease_id: str, why: str) -> None:
        with self._lock:
            hold_id = self._by_lease.get(lease_id)
            h = self._holds.get(hold_id) if hold_id else None
            if h is None:
                # Maybe ours, with the Grant answer still in flight: remember briefly.
                self._ended_early[lease_id] = time.monotonic()
                return
            self._end_locked(h, why)

    async def _watch_loop(self, c: Any) -> None:
        """EXPIRED/REVOKED → free. Leases granted to this engine by an earlier incarnation
        of it (another ``holder`` label) name blocks nobody holds: revoke them."""
        T = lpb.LeaseEvent
        while True:
            try:
                async for ev in c.watch_leases(self.settings.engine_id, snapshot=True):
                    info = ev.lease
                    if ev.type in (T.TYPE_EXPIRED, T.TYPE_REVOKED):
                        self._on_lease_ended(info.lease_id, T.Type.Name(ev.type))
                    elif ev.type == T.TYPE_GRANTED and info.labels.get("holder") not in (self.holder, None):
                        conv, lid = info.conversation_id, info.lease_id
                        log.warning("kvbaton: lease %s of %s names blocks this engine does not hold; revoking",
                                    lid, conv)
                        await c.call(c.lease.Revoke, lpb.RevokeRequest(
                            conversation_id=conv, lease_id=lid, reason="decode engine restarted"), retries=1)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("kvbaton: lease watch failed; restarting", exc_info=True)
                await asyncio.sleep(1.0)

    async def _confirm_loop(self, c: Any) -> None:
        """Every few seconds: List this engine's live leases; confirm ours (pushing the hard
        deadline out by the service's ``remaining_ms``), end holds whose lease is gone."""
        period = max(0.5, min(self.settings.lease_ttl_s / 2, 5.0))
        while True:
            await asyncio.sleep(period)
            try:
                # Every page: a hold missing from the list is ended below.
                listed = await c.list_leases(engine_id=self.settings.engine_id, retries=0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - unreachable: the hard cap takes over
                log.debug("kvbaton: lease List failed: %r", exc)
                continue
            live = {i.lease_id: i for i in listed}
            now = time.monotonic()
            with self._lock:
                for h in list(self._holds.values()):
                    if h.state != "leased":
                        continue
                    info = live.get(h.lease_id)
                    if info is not None:
                        self._confirm_locked(h, info.remaining_ms)
                    elif now - h.confirmed > period:  # not live (ended, event missed)
                        self._end_locked(h, "lease no longer listed")
                for lid, t in list(self._ended_early.items()):
                    if now - t > 60.0:
                        del self._ended_early[lid]

    def snapshot(self) -> list[dict[str, Any]]:
        """Current holds (tests, logs)."""
        with self._lock:
            return [{"conversation_id": h.conversation_id, "lease_id": h.lease_id, "state": h.state,
                     "blocks": len(h.block_ids)} for h in self._holds.values()]


async def revoke_oldest(c: Any, engine_id: str, excess_blocks: int, spare: str = "") -> int:
    """Revoke this engine's least-recently-renewed leases until ``excess_blocks`` go (sparing
    ``spare``, the turn that just finished); returns how many were revoked. The lease
    events that follow free the blocks (a pinned lease drains first)."""
    try:
        listed = await c.list_leases(engine_id=engine_id, retries=1)
    except Exception as exc:  # noqa: BLE001 - pressure stays; the next retained turn tries again
        log.warning("kvbaton: cannot list leases to relieve pressure: %r", exc)
        return 0
    revoked = 0
    for info in sorted(listed, key=lambda i: i.expires_at_ms - i.ttl_ms):
        if excess_blocks <= 0:
            break
        if info.lease_id == spare:
            continue
        try:
            await c.call(c.lease.Revoke, lpb.RevokeRequest(conversation_id=info.conversation_id,
                                                           lease_id=info.lease_id,
                                                           reason="decode retained-KV cap"), retries=1)
            excess_blocks -= int(info.num_blocks)
            revoked += 1
        except Exception as exc:  # noqa: BLE001 - the next lease may still go
            log.warning("kvbaton: revoking %s for pressure failed: %r", info.lease_id, exc)
    return revoked
