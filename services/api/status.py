"""Maps domain errors to gRPC statuses: one place, so every RPC answers the same way."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import grpc
import structlog

from ..domain.errors import Code, DomainError
from ..domain.hub import SubscriberOverflow
from ..store import RequestTooLargeError, StoreError

log = structlog.get_logger(__name__)

_CODES = {
    Code.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Code.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Code.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Code.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Code.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Code.ABORTED: grpc.StatusCode.ABORTED,
    Code.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Code.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


# Trailing metadata of a RESOURCE_EXHAUSTED answer that passes: milliseconds to wait
# before sending the call again (kvbaton.client honours it; SessionResult.retry_after_ms
# is the same for a session call).
RETRY_AFTER_METADATA = "kvbaton-retry-after-ms"


def grpc_code(code: Code) -> grpc.StatusCode:
    return _CODES[code]


def retry_hint(retry_after_ms: int) -> tuple[tuple[str, str], ...]:
    """Trailing metadata carrying a retry hint (none for 0)."""
    return ((RETRY_AFTER_METADATA, str(int(retry_after_ms))),) if retry_after_ms > 0 else ()


def store_unavailable(exc: StoreError) -> str:
    """The reason given with UNAVAILABLE when the store failed: retry later (another
    replica, or this one once the store answers again)."""
    return f"store unavailable ({type(exc).__name__}): {exc}; retry with backoff"


def too_large(exc: RequestTooLargeError) -> str:
    return f"request too large for the store: {exc}"


def unary(fn: Callable) -> Callable:
    """Turns DomainError/StoreError raised by a unary handler into a status with a reason."""

    @functools.wraps(fn)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await fn(self, request, context)
        except DomainError as exc:
            await context.abort(_CODES[exc.code], exc.message, retry_hint(exc.retry_after_ms))
        except RequestTooLargeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, too_large(exc))
        except StoreError as exc:
            log.warning("store.unavailable", rpc=fn.__name__, error=str(exc))
            await context.abort(grpc.StatusCode.UNAVAILABLE, store_unavailable(exc))

    return wrapper


def streaming(fn: Callable) -> Callable:
    """The same for server-streaming handlers (async generators)."""

    @functools.wraps(fn)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            async for item in fn(self, request, context):
                yield item
        except DomainError as exc:
            await context.abort(_CODES[exc.code], exc.message)
        except RequestTooLargeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, too_large(exc))
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, store_unavailable(exc))

    return wrapper


async def with_heartbeats(events, heartbeat: Callable[[], object], every_s: float):
    """Yields from ``events``, and ``heartbeat()`` whenever it stays silent for ``every_s``,
    so that clients (and proxies) can tell a quiet stream from a dead one. Ends quietly
    when the source ends or falls behind (the client resumes with its last revision)."""
    it = events.__aiter__()
    pending = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield heartbeat()
                continue
            try:
                event = pending.result()
            except (StopAsyncIteration, SubscriberOverflow):
                return
            yield event
            pending = asyncio.ensure_future(it.__anext__())
    finally:
        pending.cancel()
        # The cancelled __anext__ must finish before the generator can be closed.
        await asyncio.gather(pending, return_exceptions=True)
        await it.aclose()
