"""Who may call what: bearer tokens with scopes, and per-client rate limits.

Pure logic (no gRPC): ``services/api/guard.py`` applies it to every RPC.

Roles and what they may do:

- ``engine`` (``engines``: the engine ids it speaks for): register/refresh/deregister its
  own ranks; offer/complete/cancel/report/subscribe as its own engine; grant leases and
  register/release retained blocks on its own engine; watch its own engine's leases;
  pin/unpin (a prefill engine reading a decode engine's KV); look up engines, retained
  blocks and transfers.
- ``agent`` (``conversations``: ids, or prefixes ending in ``*``): renew, get and revoke
  only those conversations' leases.
- ``router``: look up engines, retained blocks, leases and transfers; renew any lease.
- ``operator``: everything, including listing, watching and revoking anything.

The token file (JSON) is ``{"tokens": [{"token": "...", "name": "...", "role": "...",
"engines": [...], "conversations": [...]}]}``; tokens are compared in constant time by
their SHA-256.

Identity: rate limits, stream caps and engine ownership (who registered an engine id)
key on ``Principal.identity``: the token itself (a digest of it, so two tokens that share
a name are two identities), else the client certificate (mutual TLS), else the peer
host. Names are for people and logs only.

What the rules here cannot see (they see only the request) is checked against the
records by ``services/api/ownership.py``: a transfer's sides, a lease's engine, a
retention's engine, the identity behind a live engine registration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import pathlib
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

ROLES = ("engine", "agent", "router", "operator")


@dataclasses.dataclass(frozen=True)
class Principal:
    name: str
    role: str
    engines: frozenset[str] = frozenset()
    conversations: tuple[str, ...] = ()
    # Who this is for rate limits and ownership: "token:<digest>", "cert:<digest>" or
    # "peer:<host>" (see the module docstring); "" when nothing identifies the caller.
    identity: str = ""

    def owns_conversation(self, conversation_id: str) -> bool:
        if self.role in ("operator", "router", "engine"):
            return True  # infrastructure: which of them may do *what* is the rule's business
        for pattern in self.conversations:
            if pattern.endswith("*") and conversation_id.startswith(pattern[:-1]):
                return True
            if pattern == conversation_id:
                return True
        return False


class TokenBook:
    """Token -> principal, loaded from the token file."""

    def __init__(self, entries: Iterable[tuple[str, Principal]]) -> None:
        self._by_digest = {hashlib.sha256(tok.encode()).digest(): p for tok, p in entries}

    @classmethod
    def load(cls, path: str | pathlib.Path) -> TokenBook:
        data = json.loads(pathlib.Path(path).read_text())
        entries = []
        for i, item in enumerate(data.get("tokens", [])):
            role = item.get("role")
            if role not in ROLES:
                raise ValueError(f"token #{i} ({item.get('name', '?')}): role must be one of {ROLES}")
            if not item.get("token") or len(item["token"]) < 16:
                raise ValueError(f"token #{i} ({item.get('name', '?')}): token must be at least 16 characters")
            engines = frozenset(item.get("engines", []))
            reserved = sorted(e for e in engines if not is_engine_id(e))
            if reserved:
                raise ValueError(f"token #{i} ({item.get('name', '?')}): {reserved} cannot be engine ids "
                                 "(reserved: '*' and ids with '*')")
            entries.append((item["token"], Principal(
                name=item.get("name", f"token-{i}"), role=role, engines=engines,
                conversations=tuple(item.get("conversations", [])),
                identity="token:" + hashlib.sha256(b"kvbaton-identity:" + item["token"].encode()).hexdigest()[:24])))
        return cls(entries)

    def lookup(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for known, principal in self._by_digest.items():  # constant time per entry
            if hmac.compare_digest(known, digest):
                found = principal
        return found


Rule = Callable[[Principal, Any], str | None]


def is_engine_id(engine_id: str) -> bool:
    """``*`` routes events to every engine (operators' views): never an engine's own id."""
    return bool(engine_id) and "*" not in engine_id


def _own_engine_or(field: str, verb: str, roles: tuple[str, ...]) -> Rule:
    """The listed roles for any engine; an engine only for one of its own (field set)."""
    def rule(p: Principal, req: Any) -> str | None:
        if p.role in roles:
            return None
        value = getattr(req, field)
        if p.role == "engine" and value and value in p.engines:
            return None
        return f"{p.name} ({p.role}) may not {verb} for engine {value or '(any)'!r}"
    return rule


def _engine_field(field: str, verb: str) -> Rule:
    def rule(p: Principal, req: Any) -> str | None:
        value = req
        for part in field.split("."):
            value = getattr(value, part)
        if p.role == "operator" or (p.role == "engine" and value in p.engines):
            return None
        return f"{p.name} ({p.role}) may not {verb} for engine {value!r}"
    return rule


def _conversation(verb: str, roles: tuple[str, ...] = ("agent", "router", "operator")) -> Rule:
    def rule(p: Principal, req: Any) -> str | None:
        if p.role in roles and p.owns_conversation(req.conversation_id):
            return None
        return f"{p.name} ({p.role}) may not {verb} conversation {req.conversation_id!r}"
    return rule


def _roles(*roles: str, verb: str) -> Rule:
    def rule(p: Principal, req: Any) -> str | None:
        return None if p.role in roles else f"{p.name} ({p.role}) may not {verb}"
    return rule


def _engine_or_any(field: str, verb: str, roles: tuple[str, ...]) -> Rule:
    """An engine may act for its own engine; the listed roles for any."""
    own = _engine_field(field, verb)

    def rule(p: Principal, req: Any) -> str | None:
        return None if p.role in roles else own(p, req)
    return rule


READERS = ("engine", "router", "operator")

RULES: dict[str, Rule] = {
    "/kvbaton.v1.Registrar/RegisterEngine": _engine_field("rank.engine_id", "register"),
    "/kvbaton.v1.Registrar/RefreshEngine": _engine_field("engine_id", "refresh"),
    "/kvbaton.v1.Registrar/DeregisterEngine": _engine_field("engine_id", "deregister"),
    "/kvbaton.v1.Registrar/GetEngine": _roles(*READERS, verb="look up engines"),
    "/kvbaton.v1.Registrar/ListEngines": _roles(*READERS, verb="list engines"),
    "/kvbaton.v1.Registrar/WatchEngines": _roles(*READERS, verb="watch engines"),
    "/kvbaton.v1.Registrar/RegisterRetained": _engine_field("retained.engine_id", "retain blocks"),
    "/kvbaton.v1.Registrar/LookupRetained": _roles(*READERS, verb="look up retained blocks"),
    # (whose registration it is: services/api/ownership.py)
    "/kvbaton.v1.Registrar/ReleaseRetained": _roles("engine", "operator", verb="release retained blocks"),
    "/kvbaton.v1.Registrar/DrainEngine": _roles("operator", verb="drain engines"),
    "/kvbaton.v1.Rendezvous/Offer": _engine_field("decode_engine_id", "offer"),
    "/kvbaton.v1.Rendezvous/Complete": _engine_field("prefill_engine_id", "complete"),
    "/kvbaton.v1.Rendezvous/Subscribe": _engine_field("engine_id", "subscribe"),
    "/kvbaton.v1.Rendezvous/ReportOutcome": _engine_field("outcome.engine_id", "report outcomes"),
    "/kvbaton.v1.Rendezvous/Cancel": _engine_field("engine_id", "cancel"),
    "/kvbaton.v1.Rendezvous/BeginRead": _engine_field("reader_engine_id", "begin reads"),
    "/kvbaton.v1.Rendezvous/GetTransfer": _roles(*READERS, verb="look up transfers"),
    "/kvbaton.v1.Rendezvous/ListTransfers": _roles("router", "operator", verb="list transfers"),
    "/kvbaton.v1.Lease/Grant": _engine_field("engine_id", "grant leases"),
    "/kvbaton.v1.Lease/Renew": _conversation("renew"),
    "/kvbaton.v1.Lease/Pin": _roles("engine", "operator", verb="pin leases"),
    "/kvbaton.v1.Lease/Unpin": _roles("engine", "operator", verb="unpin leases"),
    "/kvbaton.v1.Lease/Revoke": _conversation("revoke", roles=("agent", "engine", "operator")),
    "/kvbaton.v1.Lease/Get": _conversation("read", roles=("agent", "engine", "router", "operator")),
    # The decode connector's retention loops list their own engine's leases.
    "/kvbaton.v1.Lease/List": _own_engine_or("engine_id", "list leases", roles=("operator", "router")),
    "/kvbaton.v1.Lease/Watch": _engine_or_any("engine_id", "watch leases", roles=("operator",)),
}
_RENEW = _conversation("renew")


def _renewals_in_scope(p: Principal, req: Any) -> str | None:
    """KeepAlive: every renewal must be in the caller's scope. Routers and operators own
    every conversation, so a 10,000-renewal message costs them one check, not 10,000."""
    if p.role in ("router", "operator"):
        return None
    refused = next((r for r in map(partial(_RENEW, p), req.renewals) if r), None)
    if refused is None and req.conversation_ids:  # the packed renewals (conversation only)
        refused = next((r for r in map(partial(_RENEW, p), map(_ByConversation, req.conversation_ids)) if r), None)
    return refused


class _ByConversation:
    """A packed renewal, for the rules that read ``conversation_id``."""

    __slots__ = ("conversation_id",)

    def __init__(self, conversation_id: str) -> None:
        self.conversation_id = conversation_id


# Per message of a client stream (KeepAlive): every renewal must be in scope.
STREAM_RULES: dict[str, Rule] = {
    "/kvbaton.v1.Lease/KeepAlive": _renewals_in_scope,
}
# An engine session (Rendezvous/Session) carries offers, completions, outcomes and
# cancels: each message is authorized by the rule of the unary RPC it stands for.
SESSION_METHOD = "/kvbaton.v1.Rendezvous/Session"
SESSION_BODIES = {
    "offer": "/kvbaton.v1.Rendezvous/Offer",
    "complete": "/kvbaton.v1.Rendezvous/Complete",
    "report_outcome": "/kvbaton.v1.Rendezvous/ReportOutcome",
    "cancel": "/kvbaton.v1.Rendezvous/Cancel",
    "begin_read": "/kvbaton.v1.Rendezvous/BeginRead",
}


def authorize_session_call(p: Principal, call: Any) -> str | None:
    """One call of an engine session (a ``SessionCall``): the rule of its unary RPC."""
    body = call.WhichOneof("body")
    if body is None:
        # Nothing to act on (the servicer answers INVALID_ARGUMENT); only engines talk here.
        return None if p.role in ("engine", "operator") else f"{p.name} ({p.role}) may not open engine sessions"
    return RULES[SESSION_BODIES[body]](p, getattr(call, body))


# (The guard applies it per call, answering a refused call alone; see services/api/guard.py.)
STREAM_RULES[SESSION_METHOD] = lambda p, req: next(
    (r for r in (authorize_session_call(p, c) for c in req.calls) if r), None)
# Health checks (probes carry no token) and reflection need no authorization.
PUBLIC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def authorize(principal: Principal, method: str, request: Any) -> str | None:
    """None if allowed, else the reason it is not."""
    rule = RULES.get(method) or STREAM_RULES.get(method)
    if rule is None:
        return None if principal.role == "operator" else f"{principal.name} ({principal.role}) may not call {method}"
    return rule(principal, request)


class RateLimiter:
    """A token bucket per client: ``rate`` requests/s with bursts of ``burst``."""

    def __init__(self, rate: float, burst: float, *, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.max_clients = max_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, updated)

    def allow(self, client: str, cost: float = 1.0) -> bool:
        """Charges ``cost`` (e.g. the renewals in one KeepAlive message). A cost above the
        burst is admitted from a full bucket and leaves it in debt, so a big message is
        possible but the client's average rate still holds."""
        now = self.clock()
        tokens, updated = self._buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - updated) * self.rate)
        ok = tokens >= min(cost, self.burst)
        if ok:
            tokens -= cost
        if len(self._buckets) >= self.max_clients and client not in self._buckets:
            self._buckets.clear()  # bounded memory: forget idle clients (they start full)
        self._buckets[client] = (tokens, now)
        return ok

    def retry_after_ms(self, client: str, cost: float = 1.0) -> int:
        """How long until ``client``'s bucket holds ``cost`` again (the hint sent with a
        refusal), at least 1 ms."""
        tokens, updated = self._buckets.get(client, (self.burst, self.clock()))
        tokens = min(self.burst, tokens + (self.clock() - updated) * self.rate)
        missing = min(cost, self.burst) - tokens
        return max(1, int(missing / self.rate * 1000) + 1) if self.rate > 0 else 1000
