"""The worker's transfer thread: owns the NIXL endpoint, polls, and dispatches to the flows.

``kvbaton-xfer-<engine>`` is the one thread that touches the NIXL agent (created in no-lock
mode: one owner thread). Each turn it takes the engine's commands from ``inbox`` (loads,
sends, rendezvous events, retained blocks), polls NIXL's notifications — which also
progresses UCX for peers reading *our* memory, since the agent runs without NIXL's
spinning progress thread — routes each typed message (:mod:`.wire`) to its flow, and
gives every flow one non-blocking step (:mod:`.flows`). Results go to the engine on
``results``. It sleeps on the inbox for 1 ms while any flow has work (50 µs while a staged
send runs from GPU memory) and 10 ms when idle: never a busy loop, and the idle poll bounds
how long a peer's READ of our retained blocks waits for progress.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from . import wire
from .affinity import unpin_this_thread
from .control import ControlThread
from .flows.context import FlowContext
from .flows.faults import Faults
from .flows.peers import PeerCache, agent_name
from .flows.receive import ReceiveFlow
from .flows.send import SendFlow
from .flows.sequence import Mover
from .flows.staged import StagedFlow
from .flows.verify import Verifier
from .settings import KvbatonSettings
from .statslog import StatsLog
from .transfer.geometry import KvLayout
from .transfer.integrity import Fingerprinter
from .transfer.nixl_agent import NixlEndpoint
from .transfer.staging import StagingInfo

log = logging.getLogger("kvbaton.connector.loop")

_BUSY_POLL_S = 0.001
# Idle poll: also what progresses UCX when a peer READs our retained blocks (no NIXL
# progress thread), so it bounds a reuse READ's latency. 100 cheap wakeups/s.
_IDLE_POLL_S = 0.01

Command = tuple[str, str, Any]


class TransferLoop:
    """The NIXL owner thread (see module docstring)."""

    def __init__(self, settings: KvbatonSettings, tp_rank: int, layout: KvLayout, control: ControlThread,
                 stats: StatsLog, fingerprinter: Fingerprinter | None = None,
                 tensors: list[torch.Tensor] | None = None, tp_size: int = 1) -> None:
        self.settings = settings
        self.name = agent_name(settings.engine_id, tp_rank)
        self.fp = fingerprinter
        self.inbox: queue.Queue[Command] = queue.Queue()
        self.ctx = FlowContext(settings, layout, self.name, control, stats, PeerCache(control, tp_size=tp_size),
                               fingerprinter, faults=Faults(settings.fault_file), tp_rank=tp_rank)
        self.results = self.ctx.results
        self.staged = StagedFlow(self.ctx, tensors or [])
        self.verifier = Verifier(self.ctx, self.inbox.put)
        mover = Mover(self.ctx, self.staged)
        self.sends = SendFlow(self.ctx, mover, self.verifier)
        self.receives = ReceiveFlow(self.ctx, mover, self.verifier, self.staged)
        self.metadata: bytes = b""
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.cpus: set[int] | None = None  # the thread's CPU mask once widened (connector/affinity.py)
        self._thread = threading.Thread(target=self._run, name=f"kvbaton-xfer-{settings.engine_id}", daemon=True)

    @property
    def staging_info(self) -> StagingInfo | None:
        """Our receive pool (published with the rank), None without staging."""
        return self.staged.info if self.staged.has_pool else None

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the thread and wait until the agent exists and the caches are registered."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError("kvbaton transfer thread did not become ready")
        if self._error is not None:
            raise RuntimeError(f"kvbaton transfer thread failed to start: {self._error}") from self._error

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("stop", "", None))
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ thread body
    def _open(self) -> NixlEndpoint:
        ep = NixlEndpoint(self.name, net_devices=self.settings.ucx_net_devices, ucx_tls=self.settings.ucx_tls,
                          backend=self.settings.nixl_backend.upper())
        ep.register_layout(self.ctx.layout)
        self.ctx.ep = self.ctx.peers.ep = ep
        s, r, v = self.sends, self.receives, self.verifier
        routes: list[tuple[type[wire.Message], Callable[[str, Any], None]]] = [
            (wire.Done, s.on_done), (wire.Pushed, r.on_pushed), (wire.ReuseServed, r.on_reuse_served),
            (wire.FpQuestion, v.on_question), (wire.FpAnswer, v.on_answer)]
        for cls, fn in routes:
            ep.on_notif(wire.prefix(cls.KIND), self._typed(fn))
        self.staged.init_pools(ep)
        # last: anything else that claims to be ours (another version, the old strings)
        for p in (wire.MAGIC, *wire.LEGACY_PREFIXES):
            ep.on_notif(p, self._refuse)
        self.metadata = ep.metadata()
        return ep

    def _typed(self, fn: Callable[[str, Any], None]) -> Callable[[str, bytes], None]:
        def handler(peer: str, raw: bytes) -> None:
            try:
                msg = wire.decode(raw)
            except wire.WireError as exc:
                self._refuse(peer, raw, exc)
                return
            fn(peer, msg)
        return handler

    def _refuse(self, peer: str, raw: bytes, exc: BaseException | None = None) -> None:
        """A message we must not parse: log it clearly (the transfer fails by its deadline)."""
        if exc is None:
            try:
                wire.decode(raw)
                exc = wire.WireError("no handler for this message")
            except wire.WireError as e:
                exc = e
        log.warning("kvbaton: notification from %s refused: %s", peer, exc)
        self.ctx.stats.record("wire_refused", peer=peer, reason=str(exc)[:300], head=raw[:40].decode(errors="replace"))

    def _run(self) -> None:
        if self.settings.unpin_threads:  # before the agent: NIXL's and UCX's threads inherit the mask
            self.cpus = unpin_this_thread()
        try:
            ep = self._open()
        except BaseException as exc:  # noqa: BLE001 - surfaced by start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                self._take_commands()
                self._poll_notifs(ep)
                self._step_flows(time.monotonic())
        finally:
            self.receives.close()
            self.staged.close()
            ep.close()

    @property
    def busy(self) -> bool:
        return self.receives.busy or self.sends.busy or self.verifier.busy or self.staged.busy

    def _wait_s(self) -> float:
        if self.staged.sending_on_gpu:
            return self.staged.poll_s
        return _BUSY_POLL_S if self.busy else _IDLE_POLL_S

    def _take_commands(self) -> None:
        try:
            self._handle(self.inbox.get(timeout=self._wait_s()))
            while True:
                self._handle(self.inbox.get_nowait())
        except queue.Empty:
            pass

    def _poll_notifs(self, ep: NixlEndpoint) -> None:
        try:
            if self.staged.peer is not None:
                self.staged.peer.progress()  # poll_notifs + (CUDA) finished scatters → acks
            else:
                ep.poll_notifs()
        except Exception:  # keep the thread alive
            log.exception("kvbaton: poll_notifs failed")

    def _step_flows(self, now: float) -> None:
        self.staged.progress(now)
        self.receives.progress(now)
        self.sends.progress(now)
        self.verifier.progress(now)
        max_age = 2 * self.settings.timeout_s
        self.sends.expire(now, max_age)
        self.receives.expire(now, max_age)
        self.verifier.expire(now, max_age)
        self.staged.expire(now, max_age)

    def _handle(self, cmd: Command) -> None:
        kind, key, spec = cmd
        now = time.monotonic()
        if kind == "load":
            self.receives.on_load(key, spec, now)
        elif kind == "send":
            self.sends.on_send(key, spec, now)
        elif kind == "event":
            self._on_event(key, spec)
        elif kind == "fp_stat":
            self.ctx.stats.record("kv_fingerprint", key=key, **spec)
        elif kind == "retain":  # verify_kv, decode: a finished turn's retained blocks (or freed)
            conv, ids = spec
            self.verifier.on_retain(key, conv, ids)

    def _on_event(self, tid: str, ev: Any) -> None:
        """A rendezvous event for this engine (from the control thread's subscription)."""
        state, me = ev.transfer, self.settings.engine_id
        if state.completion.engine_id == me:
            self.sends.on_event(tid, ev)
        if state.offer.engine_id == me:
            self.receives.on_event(tid, ev)
