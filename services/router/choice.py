"""Which prefill and which decode engine serve a request: pure, synchronous, unit-tested.

The router keeps one :class:`Fleet` (every engine it may route to, from static lists and/or
the registrar) and asks it for a choice per request. Nothing here does I/O or reads a
clock of its own (callers pass ``now``), so the decision cost is measurable in-process
(``benchmarks/fleet.py``) and the rules are testable without engines.

Rules (issue 13):

- **Prefill:** least work, counted in prompt tokens: the tokens the router has sent to an
  engine and not yet seen answered (not requests: one 8k-token prompt outweighs ten short
  ones) plus the tokens *this* prompt would cost it. A conversation's prompt costs the
  prefill that served its previous turn only the new tokens (its prefix cache holds the
  history, unless evicted since: :class:`PrefillHint`); on another prefill the history is
  READ from decode when decode retains it (a READ token weighs ``read_weight`` of a
  computed one) or recomputed. So a conversation stays on its prefill while that prefill's
  queue is shorter than the work the stay saves. Ties go to the engine that holds the
  history, then to the one chosen least recently, so an idle fleet alternates.
- **Decode:** the engine holding the conversation's retained KV (the caller passes its id
  when the lease is live) unless it is more than ``slack`` outstanding requests busier than
  the least loaded decode; otherwise the least loaded (ties: least recently chosen).
- **Other routers' work.** These counts are this router's own. When the engines' own
  request counts are polled (``vllm:num_requests_running`` + ``..._waiting`` from their
  ``/metrics``: :meth:`Fleet.report_load`), an engine's load is the larger of the two, the
  requests this router does not know of weighing a typical prompt each (prefill), so two
  routers do not both think one engine idle. A report older than its ``ttl`` is ignored.
- An engine is *routable* while registered (or listed statically), not draining and not
  suspected dead (a transport error marks it suspect for ``suspect_s``).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Iterable, Sequence

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLE_BOTH = "both"


class PrefillReason(enum.StrEnum):
    """Why a prefill engine was chosen (a stats label)."""

    CACHED = "cached"  # the prefill that served the conversation's previous turn
    LEAST_WORK = "least_work"  # least outstanding + this prompt's work (no hint, or it lost)


#: What a token READ from decode's retained KV costs prefill, in computed tokens (measured
#: on the 2-core box: 4,480 tokens READ in 12 ms vs ~500 ms to compute them: 1/40; the
#: READ also needs the decode engine's progress, so this is kept conservative).
READ_WEIGHT = 0.1


@dataclasses.dataclass(frozen=True)
class PrefillHint:
    """Where a conversation's history is likely cached: the prefill that served its last
    turn and that turn's prompt tokens. A hint, not a fact (the prefix cache may have
    evicted it since); wrong hints cost one READ or one recompute, never an answer."""

    engine_id: str
    cached_tokens: int


class DecodeReason(enum.StrEnum):
    """Why a decode engine was chosen (a stats / metrics label)."""

    AFFINITY = "affinity"  # the engine holding the conversation's KV
    NO_HISTORY = "no_history"  # no live retained KV for the conversation: least loaded
    HOLDER_OVERLOADED = "holder_overloaded"  # holder busier than the least loaded + slack
    HOLDER_UNAVAILABLE = "holder_unavailable"  # holder gone, draining, suspect or excluded


@dataclasses.dataclass
class Engine:
    """One engine the router may send to, with the load this router has put on it."""

    engine_id: str
    url: str
    role: str
    draining: bool = False
    static: bool = False  # from --prefill/--decode: never removed by discovery
    ranks: set[int] = dataclasses.field(default_factory=set)
    #: tp_rank -> the registration incarnation last seen for it (discovery: a DELETE of an
    #: older incarnation, replayed after a newer registration was listed, is ignored).
    incarnations: dict[int, str] = dataclasses.field(default_factory=dict)
    tp_size: int = 1
    prefill_tokens: int = 0  # outstanding prompt tokens on prefill legs
    prefill_requests: int = 0
    decode_requests: int = 0  # outstanding decode legs
    suspect_until: float = 0.0  # a monotonic time: avoid until then after a transport error
    reported_requests: int = 0  # running + waiting, as the engine itself last said
    reported_until: float = 0.0  # a monotonic time: the report is ignored after it
    last_chosen: int = 0  # sequence number of the last choice that picked it

    def serves(self, role: str) -> bool:
        return self.role == role or self.role == ROLE_BOTH

    def registered(self) -> bool:
        return self.static or len(self.ranks) >= self.tp_size

    def alive(self, now: float) -> bool:
        """Expected to answer (an HTTP request, or a NIXL READ of its retained KV)."""
        return not self.draining and self.suspect_until <= now and self.registered()

    def routable(self, now: float) -> bool:
        return self.alive(now) and bool(self.url)

    def requests_elsewhere(self, now: float | None, mine: int) -> int:
        """Requests the engine reports beyond the ``mine`` this router has on it (other
        routers' work), or 0 without a live report."""
        if now is None or self.reported_until <= now:
            return 0
        return max(0, self.reported_requests - mine)

    def decode_load(self, now: float | None = None) -> int:
        return self.decode_requests + self.requests_elsewhere(now, self.decode_requests)

    def prefill_load(self, now: float | None = None, typical_tokens: float = 0.0) -> float:
        return self.prefill_tokens + typical_tokens * self.requests_elsewhere(now, self.prefill_requests)


@dataclasses.dataclass(frozen=True)
class Choice:
    prefill: Engine | None
    decode: Engine | None
    reason: DecodeReason | None = None
    prefill_reason: PrefillReason = PrefillReason.LEAST_WORK


class Fleet:
    """The engines of a router, keyed by engine id."""

    def __init__(self, *, slack: int = 4, suspect_s: float = 5.0, discovering: bool = False) -> None:
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        self.slack = slack
        # True when the registrar is followed: an engine it does not list is gone.
        self.discovering = discovering
        self.suspect_s = suspect_s
        self.engines: dict[str, Engine] = {}
        self._seq = itertools.count(1)
        #: Moving mean of the prompts sent to prefill (tokens): what another router's
        #: request on a prefill is taken to weigh.
        self.typical_prompt_tokens = 0.0

    # ------------------------------------------------------------ membership
    def add_static(self, engine_id: str, url: str, role: str) -> Engine:
        e = self.engines.get(engine_id)
        if e is None:
            e = self.engines[engine_id] = Engine(engine_id, url.rstrip("/"), role, static=True)
        elif e.role != role:  # the same engine listed under both roles
            e.role = ROLE_BOTH
        e.static = True
        return e

    def put_rank(self, engine_id: str, tp_rank: int, tp_size: int, role: str, url: str, draining: bool,
                 incarnation: str = "") -> Engine:
        """A registration (or its update) seen on the registrar."""
        e = self.engines.get(engine_id)
        if e is None:
            e = self.engines[engine_id] = Engine(engine_id, url.rstrip("/"), role)
        if url:
            e.url = url.rstrip("/")
        e.role = role if not e.static else e.role
        e.tp_size = max(1, tp_size)
        e.ranks.add(tp_rank)
        if incarnation:
            e.incarnations[tp_rank] = incarnation
        e.draining = draining
        return e

    def delete_rank(self, engine_id: str, tp_rank: int, incarnation: str = "") -> None:
        """A registration ended: the engine is no longer routable (one missing rank is enough).
        ``incarnation``: the registration that ended; when the rank has been seen registered
        again since (another incarnation), this end is an old one and changes nothing."""
        e = self.engines.get(engine_id)
        if e is None:
            return
        known = e.incarnations.get(tp_rank, "")
        if incarnation and known and known != incarnation:
            return
        e.ranks.discard(tp_rank)
        e.incarnations.pop(tp_rank, None)
        if not e.ranks and not e.static and not (e.prefill_requests or e.decode_requests):
            del self.engines[engine_id]

    def forget_missing(self, live: set[str]) -> None:
        """After a fresh listing: discovered engines not in ``live`` are gone."""
        for eid in [k for k, e in self.engines.items() if not e.static and k not in live]:
            self.engines[eid].ranks.clear()
            self.engines[eid].incarnations.clear()
            if not (self.engines[eid].prefill_requests or self.engines[eid].decode_requests):
                del self.engines[eid]

    # ------------------------------------------------------------ load
    def report_load(self, engine_id: str, requests: int, now: float, ttl_s: float) -> None:
        """The engine's own count of running + waiting requests, valid for ``ttl_s``."""
        e = self.engines.get(engine_id)
        if e is not None:
            e.reported_requests = max(0, requests)
            e.reported_until = now + ttl_s

    def start_prefill(self, e: Engine, tokens: int) -> None:
        t = self.typical_prompt_tokens
        self.typical_prompt_tokens = float(tokens) if t == 0 else 0.9 * t + 0.1 * tokens
        e.prefill_tokens += tokens
        e.prefill_requests += 1

    def end_prefill(self, e: Engine, tokens: int) -> None:
        e.prefill_tokens = max(0, e.prefill_tokens - tokens)
        e.prefill_requests = max(0, e.prefill_requests - 1)
        e.reported_until = 0.0  # the last report still counts this request: wait for the next
        self._gc(e)

    def start_decode(self, e: Engine) -> None:
        e.decode_requests += 1

    def end_decode(self, e: Engine) -> None:
        e.decode_requests = max(0, e.decode_requests - 1)
        e.reported_until = 0.0  # the last report still counts this request: wait for the next
        self._gc(e)

    def _gc(self, e: Engine) -> None:
        """An engine that left while requests were on it goes once they are done."""
        if (not e.static and not e.ranks and not (e.prefill_requests or e.decode_requests)
                and self.engines.get(e.engine_id) is e):
            del self.engines[e.engine_id]

    def mark_suspect(self, engine_id: str, now: float) -> None:
        e = self.engines.get(engine_id)
        if e is not None:
            e.suspect_until = now + self.suspect_s

    def routable(self, role: str, now: float) -> list[Engine]:
        """Engines of ``role`` to send to; when every such engine is suspect, the suspects
        (trying one beats answering 503)."""
        out = [e for e in self.engines.values() if e.serves(role) and e.routable(now)]
        if not out:
            out = [e for e in self.engines.values() if e.serves(role) and e.routable(e.suspect_until)]
        return out

    # ------------------------------------------------------------ choice
    def choose_prefill(self, now: float, exclude: Iterable[str] = (), *, hint: PrefillHint | None = None,
                       prompt_tokens: int = 0, reuse_tokens: int = 0) -> tuple[Engine | None, PrefillReason]:
        return pick_prefill(self.routable(ROLE_PREFILL, now), set(exclude), hint, prompt_tokens, reuse_tokens,
                            now=now, typical_tokens=self.typical_prompt_tokens)

    def choose_decode(self, now: float, holder_id: str = "", exclude: Iterable[str] = ()) -> tuple[Engine | None, DecodeReason]:
        return pick_decode(self.routable(ROLE_DECODE, now), holder_id, self.slack, set(exclude), now=now)

    def choose(self, now: float, holder_id: str = "", exclude: Iterable[str] = (), *,
               hint: PrefillHint | None = None, prompt_tokens: int = 0, reuse_tokens: int = 0) -> Choice:
        """Both legs at once (push; pull could pick decode after prefill with the same rules).
        ``hint``: the conversation's last prefill; ``reuse_tokens``: history decode retains
        (READable by any prefill)."""
        ex = set(exclude)
        p, pwhy = self.choose_prefill(now, ex, hint=hint, prompt_tokens=prompt_tokens, reuse_tokens=reuse_tokens)
        d, why = self.choose_decode(now, holder_id, ex)
        for e in (p, d):
            if e is not None:
                e.last_chosen = next(self._seq)
        return Choice(p, d, why, pwhy)

    def holder_usable(self, holder_id: str, now: float) -> bool:
        """Whether a READ from ``holder_id`` can be expected to work: it is in the fleet and
        routable, or unknown here (a static fleet without engine ids)."""
        e = self.engines.get(holder_id)
        if e is None:
            return not self.discovering
        return e.alive(now)

    def snapshot(self, now: float) -> list[dict[str, object]]:
        return [{"engine_id": e.engine_id, "url": e.url, "role": e.role, "draining": e.draining,
                 "static": e.static, "routable": e.routable(now), "alive": e.alive(now), "suspect": e.suspect_until > now,
                 "ranks": sorted(e.ranks), "tp_size": e.tp_size, "prefill_tokens": e.prefill_tokens,
                 "prefill_requests": e.prefill_requests, "decode_requests": e.decode_requests,
                 "reported_requests": e.reported_requests if e.reported_until > now else None}
                for e in sorted(self.engines.values(), key=lambda x: x.engine_id)]


def prefill_cost(e: Engine, hint: PrefillHint | None, prompt_tokens: int, reuse_tokens: int, *,
                 now: float | None = None, typical_tokens: float = 0.0) -> float:
    """Outstanding tokens on ``e`` plus what this prompt costs there (module docstring)."""
    prompt = max(0, prompt_tokens)
    cached = min(hint.cached_tokens, prompt) if hint is not None and hint.engine_id == e.engine_id else 0
    readable = max(0, min(reuse_tokens, prompt) - cached)
    return e.prefill_load(now, typical_tokens) + (prompt - cached - readable) + READ_WEIGHT * readable


def pick_prefill(engines: Sequence[Engine], exclude: set[str], hint: PrefillHint | None = None,
                 prompt_tokens: int = 0, reuse_tokens: int = 0, *, now: float | None = None,
                 typical_tokens: float = 0.0) -> tuple[Engine | None, PrefillReason]:
    best: Engine | None = None
    best_key: tuple[float, int, int] | None = None
    for e in engines:
        if e.engine_id in exclude:
            continue
        holds = hint is not None and hint.engine_id == e.engine_id
        key = (prefill_cost(e, hint, prompt_tokens, reuse_tokens, now=now, typical_tokens=typical_tokens),
               0 if holds else 1, e.last_chosen)
        if best_key is None or key < best_key:
            best, best_key = e, key
    if best is not None and hint is not None and best.engine_id == hint.engine_id:
        return best, PrefillReason.CACHED
    return best, PrefillReason.LEAST_WORK


def pick_decode(engines: Sequence[Engine], holder_id: str, slack: int,
                exclude: set[str], *, now: float | None = None) -> tuple[Engine | None, DecodeReason]:
    least: Engine | None = None
    holder: Engine | None = None
    for e in engines:
        if e.engine_id in exclude:
            continue
        if e.engine_id == holder_id:
            holder = e
        if least is None or (e.decode_load(now), e.last_chosen) < (least.decode_load(now), least.last_chosen):
            least = e
    if not holder_id:
        return least, DecodeReason.NO_HISTORY
    if holder is None:
        return least, DecodeReason.HOLDER_UNAVAILABLE
    assert least is not None
    if holder.decode_load(now) <= least.decode_load(now) + slack:
        return holder, DecodeReason.AFFINITY
    return least, DecodeReason.HOLDER_OVERLOADED


def estimate_prompt_tokens(body: dict[str, object]) -> int:
    """Prompt size in tokens, as well as the router can tell without a tokenizer: token-id
    lists count exactly, text at ~4 characters a token."""
    prompt = body.get("prompt")
    messages = body.get("messages")
    if prompt is None and isinstance(messages, list):
        chars = 0
        for m in messages:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                chars += len(c)
            elif isinstance(c, list):
                chars += sum(len(str(p.get("text", ""))) for p in c if isinstance(p, dict))
        return max(1, chars // 4)
    if isinstance(prompt, list):
        if prompt and all(isinstance(x, int) for x in prompt):
            return len(prompt)
        return max(1, sum(len(x) if isinstance(x, list) else len(str(x)) // 4 for x in prompt))
    if isinstance(prompt, str):
        return max(1, len(prompt) // 4)
    return 1
