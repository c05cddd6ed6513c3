"""A request that finds no routable engine of a role waits a little for one.

Why: in a discovered fleet a whole role can be missing for a second or two and then be
back — every engine of the role re-registering at once (a control-plane stall let all four
engines' registrations lapse; they re-registered ~1 s later, and one turn got ``503 no
prefill engine available``: benchmarks/README.md, ``fleet_compute8_alternate_quiet_rep2``),
or a rolling restart of the only prefill. Answering 503 at once turns that blip into an
error every client must handle; waiting up to ``wait_s`` (``--role-wait-s``) turns it into
latency.

How: the router calls :meth:`RoleWaits.changed` whenever its fleet view changes (every
discovery listing and event); a waiting request wakes on that, chooses again, and goes on
or waits for the rest of its time. Nothing polls the fleet: membership and drain only change
with discovery events, and time alone never makes a role routable (``Fleet.routable`` falls
back to suspect engines, so a suspect static engine never leaves a role empty; static lists
therefore never wait at all).

Bounded: at most ``max_waiting`` requests (``--role-wait-max``) wait at once; past that a
request is shed at once with a reason (overload sheds with a reason, it does not queue
without end). When the time is up: 503 naming the role and how long it waited, with
``Retry-After``. A client that goes away stops waiting: aiohttp (>= 3.9) does not cancel a
handler when its client disconnects and has no callback for it, so while waiting the
request also looks at its connection every ``gone_check_s`` (0.25 s; the role's arrival is
still event-driven); a cancelled handler (aiohttp's ``handler_cancellation``, or shutdown)
counts the same.

Counted by role and outcome (``served`` after waiting, ``timed_out``, ``shed``,
``client_gone``) in ``/kvbaton/stats`` (``role_wait``, with how many wait now) and as
``kvbaton_router_role_waits_total`` / ``kvbaton_router_role_waiting``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from kvbaton.services.metrics import RouterMetrics

from .choice import ROLE_DECODE, ROLE_PREFILL

SERVED = "served"
TIMED_OUT = "timed_out"
SHED = "shed"
CLIENT_GONE = "client_gone"
OUTCOMES = (SERVED, TIMED_OUT, SHED, CLIENT_GONE)
#: How often a waiting request looks whether its client is still connected (s).
GONE_CHECK_S = 0.25


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a request gets no engine: ``outcome`` is ``timed_out``, ``shed``, ``client_gone``
    or ``off`` (waiting disabled: today's immediate 503)."""

    role: str
    outcome: str
    waited_s: float


class RoleWaits:
    """The router's waiting requests: the wake-up on fleet changes, the cap, the counts."""

    def __init__(self, wait_s: float = 5.0, max_waiting: int = 256, metrics: RouterMetrics | None = None, *,
                 clock: Callable[[], float] = time.monotonic, gone_check_s: float = GONE_CHECK_S) -> None:
        if wait_s < 0 or max_waiting < 0:
            raise ValueError(f"role wait must be >= 0 s and its cap >= 0, got {wait_s} s, {max_waiting}")
        self.wait_s = wait_s
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.clock = clock
        self.gone_check_s = gone_check_s
        self._changed = asyncio.Event()
        self.waiting: collections.Counter[str] = collections.Counter({ROLE_PREFILL: 0, ROLE_DECODE: 0})
        self.outcomes: dict[str, collections.Counter[str]] = {
            r: collections.Counter(dict.fromkeys(OUTCOMES, 0)) for r in (ROLE_PREFILL, ROLE_DECODE)}
        if metrics is not None:  # series that exist from the first scrape
            for role in (ROLE_PREFILL, ROLE_DECODE):
                metrics.role_waiting.labels(role)
                for outcome in OUTCOMES:
                    metrics.role_waits.labels(role, outcome)

    @property
    def retry_after_s(self) -> int:
        """What a refused client is told to wait before trying again (``Retry-After``)."""
        return max(1, math.ceil(self.wait_s))

    def changed(self) -> None:
        """The fleet view changed: every waiting request chooses again."""
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    def ticket(self, gone: Callable[[], bool] = lambda: False) -> RoleWait:
        """One request's wait (a context manager); ``gone()``: its client went away."""
        return RoleWait(self, gone)

    def count(self, role: str, outcome: str) -> None:
        self.outcomes.setdefault(role, collections.Counter())[outcome] += 1
        if self.metrics is not None:
            self.metrics.role_waits.labels(role, outcome).inc()

    def _move(self, old: str, new: str) -> None:
        for role, d in ((old, -1), (new, 1)):
            if role:
                self.waiting[role] += d
                if self.metrics is not None:
                    self.metrics.role_waiting.labels(role).inc(d)

    def json(self) -> dict[str, Any]:
        return {"wait_s": self.wait_s, "max_waiting": self.max_waiting, "waiting": dict(self.waiting),
                "outcomes": {r: dict(c) for r, c in self.outcomes.items()}}


class RoleWait:
    """One request's wait for routable engines (possibly for one role, then the other),
    within one ``wait_s`` from its first miss."""

    def __init__(self, waits: RoleWaits, gone: Callable[[], bool]) -> None:
        self.waits = waits
        self.gone = gone
        self.role = ""  # the role waited for now ("" while not waiting)
        self.started: float | None = None  # when it first found a role missing
        self.outcome = ""

    def __enter__(self) -> RoleWait:
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.role and not self.outcome:  # cancelled while waiting
            self._end(CLIENT_GONE)
        self.waits._move(self.role, "")
        self.role = ""

    def served(self) -> None:
        """Both roles have a routable engine now: a request that waited counts as served."""
        if self.role and not self.outcome:
            self._end(SERVED)
        self.waits._move(self.role, "")
        self.role = ""

    def _end(self, outcome: str) -> Refusal:
        self.outcome = outcome
        self.waits.count(self.role, outcome)
        waited = 0.0 if self.started is None else self.waits.clock() - self.started
        return Refusal(self.role, outcome, waited)

    async def wait(self, role: str) -> Refusal | None:
        """``role`` has no routable engine: wait for the fleet to change. None: it changed,
        choose again; a :class:`Refusal`: answer without an engine."""
        w = self.waits
        if self.started is None:
            if w.wait_s <= 0:
                return Refusal(role, "off", 0.0)
            if sum(w.waiting.values()) >= w.max_waiting:
                w.count(role, SHED)
                return Refusal(role, SHED, 0.0)
            self.started = w.clock()
        if role != self.role:
            w._move(self.role, role)
            self.role = role
        deadline = self.started + w.wait_s
        while True:
            left = deadline - w.clock()
            if left <= 0:
                return self._end(TIMED_OUT)
            if self.gone():
                return self._end(CLIENT_GONE)
            changed = w._changed
            try:
                await asyncio.wait_for(changed.wait(), min(left, w.gone_check_s))
            except TimeoutError:
                continue
            return None
