"""A server interceptor applying ``services.auth`` to every RPC: authentication
(bearer token → principal), authorization (the principal's scope against the request's
engine / conversation), per-client rate limits and a cap on concurrent streams.

Refusals are statuses with a reason: UNAUTHENTICATED (no or unknown token),
PERMISSION_DENIED (out of scope), RESOURCE_EXHAUSTED (rate or stream limit). A refused
request reaches no servicer, so it changes nothing.

Buckets and stream slots are per identity (``Principal.identity``: the token, else the
client certificate, else the peer host), never per name: two clients share a bucket only
when they are the same identity. An unknown token is refused before any bucket is
touched. The caller is left in ``CALLER`` for the servicers' ownership checks.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import hashlib
from collections.abc import Callable

import grpc
import structlog

from ..auth import (
    PUBLIC_PREFIXES,
    SESSION_METHOD,
    Principal,
    RateLimiter,
    TokenBook,
    authorize,
    authorize_session_call,
)
from .status import retry_hint

log = structlog.get_logger(__name__)

ANONYMOUS = Principal(name="anonymous", role="operator")

# Set by the guard for a session stream (Rendezvous/Session), read by its servicer: called
# with each call of the session (a SessionCall), it returns None (admitted) or (status
# code, reason) for that call alone, so one refused call does not end the stream. Unset
# (no tokens, no rate limit): nothing to check.
# A refusal may add a retry hint in ms (RESOURCE_EXHAUSTED by the rate limit): (code,
# reason, retry_after_ms).
MessageGate = Callable[[object], "tuple[grpc.StatusCode, str] | tuple[grpc.StatusCode, str, int] | None"]
SESSION_GATE: contextvars.ContextVar[MessageGate | None] = contextvars.ContextVar("kvbaton_session_gate", default=None)
# The authenticated caller of the RPC being served (set by the guard in the RPC's task);
# None where nothing is checked (no tokens, no mutual TLS, no rate limit).
CALLER: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("kvbaton_caller", default=None)


def identify(principal: Principal, context) -> Principal:
    """``principal`` with its identity: a token's (already set), else the client
    certificate's (mutual TLS), else the peer host's."""
    if principal.identity:
        return principal
    auth = context.auth_context() if hasattr(context, "auth_context") else {}
    pem = (auth.get("x509_pem_cert") or [b""])[0]
    if pem:
        return dataclasses.replace(principal, identity="cert:" + hashlib.sha256(pem).hexdigest()[:24])
    return dataclasses.replace(principal, identity="peer:" + context.peer().rsplit(":", 1)[0])


@dataclasses.dataclass
class GuardConfig:
    tokens: TokenBook | None = None
    # Requests per second per client (principal, or peer host without tokens); 0: off.
    rate_limit: float = 0.0
    burst: float = 0.0
    max_streams_per_client: int = 256
    # Mutual TLS on: the client certificate identifies a caller even without tokens.
    mtls: bool = False


class StreamRefused(Exception):
    """A message of a client stream was refused; the stream's handler ends the call with
    ``code`` and ``details`` (servicers pass it through from their reader tasks)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def _handler_factory(handler: grpc.RpcMethodHandler):
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler, handler.unary_unary
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler, handler.unary_stream
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler, handler.stream_unary
    return grpc.stream_stream_rpc_method_handler, handler.stream_stream


class Guard(grpc.aio.ServerInterceptor):
    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.limiter = RateLimiter(config.rate_limit, config.burst or max(config.rate_limit, 1.0)) if config.rate_limit else None
        self.streams: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()

    def _principal(self, metadata) -> Principal | str:
        if self.config.tokens is None:
            return ANONYMOUS
        auth = next((v for k, v in metadata if k == "authorization"), None)
        if not auth:
            return "missing bearer token (metadata 'authorization: Bearer <token>')"
        if not auth.startswith("Bearer "):
            return "authorization metadata must be 'Bearer <token>'"
        principal = self.config.tokens.lookup(auth[len("Bearer "):].strip())
        return principal if principal is not None else "unknown token"

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(PUBLIC_PREFIXES):
            return handler
        if self.config.tokens is None and self.limiter is None and not self.config.mtls and handler.unary_unary:
            return handler  # nothing to check on a unary call: no per-call cost at all
        who = self._principal(details.invocation_metadata or ())
        make, inner = _handler_factory(handler)
        guard = self

        if isinstance(who, str):
            reason = who

            async def deny(request_or_iterator, context):
                guard.refused["unauthenticated"] += 1
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

            if handler.unary_stream or handler.stream_stream:
                async def deny_stream(request_or_iterator, context):
                    await deny(request_or_iterator, context)
                    yield  # pragma: no cover - abort raises
                return make(deny_stream, handler.request_deserializer, handler.response_serializer)
            return make(deny, handler.request_deserializer, handler.response_serializer)

        base: Principal = who

        async def admit(context, request=None) -> Principal:
            principal = identify(base, context)
            CALLER.set(principal)
            client = principal.identity
            if guard.limiter is not None and not guard.limiter.allow(client):
                guard.refused["rate_limited"] += 1
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"rate limit {self.config.rate_limit:g} requests/s exceeded for "
                                    f"{principal.name} ({client})", retry_hint(guard.limiter.retry_after_ms(client)))
            if request is not None:
                reason = authorize(principal, method, request)
                if reason is not None:
                    guard.refused["permission_denied"] += 1
                    log.warning("auth.denied", principal=principal.name, method=method, reason=reason)
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
            return principal

        def stream_slot(context) -> str:
            return identify(base, context).identity

        if handler.unary_unary:
            async def unary(request, context):
                await admit(context, request)
                return await inner(request, context)
            return make(unary, handler.request_deserializer, handler.response_serializer)

        if handler.unary_stream:
            async def server_stream(request, context):
                await admit(context, request)
                slot = stream_slot(context)
                if guard.streams[slot] >= self.config.max_streams_per_client:
                    guard.refused["too_many_streams"] += 1
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"{slot} already has {guard.streams[slot]} open streams "
                                        f"(limit {self.config.max_streams_per_client})")
                guard.streams[slot] += 1
                try:
                    async for item in inner(request, context):
                        yield item
                finally:
                    guard.streams[slot] -= 1
            return make(server_stream, handler.request_deserializer, handler.response_serializer)

        if method == SESSION_METHOD:
            return make(self._session(inner, admit), handler.request_deserializer,
                        handler.response_serializer)

        # Client streams (KeepAlive): every message is authorized before it reaches the servicer.
        async def bidi(request_iterator, context):
            principal = await admit(context)
            slot = principal.identity
            if guard.streams[slot] >= self.config.max_streams_per_client:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{slot} already has {guard.streams[slot]} open streams")
            guard.streams[slot] += 1

            async def checked():
                # Raises StreamRefused rather than aborting here: this runs in the servicer's
                # reader task, and an abort racing the handler's own send fails in gRPC core
                # (TOO_MANY_OPERATIONS) and leaves the client hanging. The servicer hands
                # the exception to its handler task, which ends the call below.
                async for req in request_iterator:
                    reason = authorize(principal, method, req)
                    if reason is not None:
                        guard.refused["permission_denied"] += 1
                        raise StreamRefused(grpc.StatusCode.PERMISSION_DENIED, reason)
                    # Charged per renewal, not per message: a 10,000-renewal batch costs 10,000.
                    cost = float(max(1, len(getattr(req, "renewals", ())) + len(getattr(req, "conversation_ids", ()))))
                    if guard.limiter is not None and not guard.limiter.allow(slot, cost=cost):
                        guard.refused["rate_limited"] += 1
                        raise StreamRefused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"rate limit {self.config.rate_limit:g} renewals/s exceeded for "
                                            f"{slot} ({int(cost)} in one message)")
                    yield req

            try:
                async for item in inner(checked(), context):
                    yield item
            except StreamRefused as exc:
                await context.abort(exc.code, exc.details)
            finally:
                guard.streams[slot] -= 1
        return make(bidi, handler.request_deserializer, handler.response_serializer)

    def _session(self, inner, admit):
        """An engine session: opening it is admitted like any stream; then every message is
        rate-limited and authorized as the unary call it stands for, and a refusal answers
        that message only (through ``SESSION_GATE``) instead of ending the stream."""
        guard = self
        config = self.config

        async def session(request_iterator, context):
            principal = await admit(context)
            slot = principal.identity
            if guard.streams[slot] >= config.max_streams_per_client:
                guard.refused["too_many_streams"] += 1
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{slot} already has {guard.streams[slot]} open streams "
                                    f"(limit {config.max_streams_per_client})")
            guard.streams[slot] += 1
            client = slot
            limiter = guard.limiter
            check_scope = config.tokens is not None

            def gate(call):
                if limiter is not None and not limiter.allow(client):
                    guard.refused["rate_limited"] += 1
                    return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"rate limit {config.rate_limit:g} requests/s exceeded for {principal.name} ({client})",
                            limiter.retry_after_ms(client))
                if check_scope:
                    reason = authorize_session_call(principal, call)
                    if reason is not None:
                        guard.refused["permission_denied"] += 1
                        log.warning("auth.denied", principal=principal.name, method=SESSION_METHOD, reason=reason)
                        return grpc.StatusCode.PERMISSION_DENIED, reason
                return None

            # The RPC runs in its own task: the value lives and dies with it (no reset, which
            # would fail if the generator were finalized from another context).
            SESSION_GATE.set(gate if (limiter is not None or check_scope) else None)
            try:
                async for item in inner(request_iterator, context):
                    yield item
            finally:
                guard.streams[slot] -= 1
        return session
