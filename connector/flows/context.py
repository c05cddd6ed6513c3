"""What every flow shares: settings, the endpoint, the control thread, stats and results.

One :class:`FlowContext` per worker, built by the loop. Results go to the engine through
``results`` as ``(kind, req_id, ok, block_ids)``: ``("sent", ...)`` when prefill may free a
request's blocks, ``("recv", ...)`` when a load is over (``ok=False``: the block ids are
reported as load errors, vLLM recomputes).
"""

from __future__ import annotations

import dataclasses
import queue
import time
from collections.abc import Callable
from typing import Any

from kvbaton.services.metrics import ConnectorMetrics, connector_metrics

from .. import wire
from ..control import ControlThread
from ..settings import KvbatonSettings
from ..statslog import StatsLog
from ..transfer.geometry import KvLayout
from ..transfer.integrity import Fingerprinter
from ..transfer.nixl_agent import NixlEndpoint
from .faults import Faults
from .peers import PeerCache

Result = tuple[str, str, bool, tuple[int, ...]]


@dataclasses.dataclass
class FlowContext:
    settings: KvbatonSettings
    layout: KvLayout
    name: str  # our NIXL agent name
    control: ControlThread
    stats: StatsLog
    peers: PeerCache
    fp: Fingerprinter | None = None  # verify_kv (None: off)
    ep: NixlEndpoint | None = None  # set once the loop created it
    results: queue.Queue[Result] = dataclasses.field(default_factory=queue.Queue)
    metrics: ConnectorMetrics = dataclasses.field(default_factory=connector_metrics)
    faults: Faults = dataclasses.field(default_factory=lambda: Faults(""))
    tp_rank: int = 0  # our tensor-parallel rank (outcomes carry it)
    #: tells the engine loop a result is waiting (TP > 1: its idle steps wait long, wakeup.py)
    wake: Callable[[], None] | None = None
    #: stamps messages that arrive between steps (a notification, an event) so that the
    #: steps' ``expire(now, ...)`` ages them on the same clock; tests inject a fixed one
    clock: Callable[[], float] = time.monotonic

    @property
    def endpoint(self) -> NixlEndpoint:
        assert self.ep is not None
        return self.ep

    def notify(self, agent: str, msg: wire.Message) -> None:
        """Send one wire message to a peer's agent (a NIXL notification, no data)."""
        self.endpoint.send_notif(agent, wire.encode(msg))

    def report(self, kind: str, req_id: str, ok: bool, block_ids: tuple[int, ...] = ()) -> None:
        self.results.put((kind, req_id, ok, block_ids))
        if self.wake is not None:
            self.wake()


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def outcome(ok: bool, reason: str = "") -> str:
    """``kvbaton_connector_transfers_total`` outcome label from a result and its reason."""
    return "ok" if ok else "timeout" if reason.startswith("TimeoutError") else "failed"


def recompute_reason(reason: str) -> str:
    """``kvbaton_connector_recomputes_total`` reason label for a failed load."""
    if reason.startswith("TimeoutError"):
        return "timeout"
    if "read fenced by the ledger" in reason:  # BeginRead refused: the owner's blocks moved on
        return "fenced"
    if "pin refused" in reason:
        return "pin_refused"
    if "now protects retention" in reason:  # the lease moved on: the blocks we looked up are gone
        return "lease_ended"
    if reason.startswith("KvIntegrityError"):
        return "verify_failed"
    return "load_failed"


def fire_and_forget(fut: Any, what: str, log: Any) -> None:
    """Log (never raise) the failure of a background control-plane call."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception() is None or log.warning(
        "kvbaton: %s failed: %r", what, f.exception()))

