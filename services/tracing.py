"""OpenTelemetry tracing: optional, off by default, one trace per client request.

Turned on per process by ``--otlp-endpoint URL`` (``kvbaton serve``, the router) or
``$KVBATON_OTLP_ENDPOINT``; tests pass an in-memory exporter to :func:`configure`. When
it is off nothing is installed: no interceptor on the gRPC server or channels, no span
objects, no OpenTelemetry import; the helpers below return at their first line.

How a request's trace crosses the processes (W3C Trace Context, ``traceparent``):

* the **router** starts ``kvbaton.router.request`` per client request and a child span
  per engine leg (``kvbaton.router.prefill`` / ``kvbaton.router.decode``); each leg's
  ``traceparent`` goes to the engine both as an HTTP header and as
  ``kv_transfer_params["traceparent"]``;
* the **connector** (scheduler and worker) passes that string, unchanged, as gRPC
  metadata on the control-plane calls it makes for the request (Offer, Complete, Cancel,
  ReportOutcome, Pin, Unpin) with :func:`grpc_metadata`: the engines need no tracing
  set-up of their own;
* the **services**' server interceptor (:class:`ServerTracing`) continues the trace with
  one span per RPC, named ``<package.Service>/<Method>``, carrying the request's
  ``kvbaton.transfer_id`` / ``kvbaton.conversation_id`` when it has them;
* a :class:`~kvbaton.client.KvbatonClient` made while tracing is on injects the current
  span (the router's Renew/LookupRetained for a conversation) through
  :func:`client_interceptors`.

Only the process-local provider built here is used (never the global one), so several
configurations in one process (tests) do not fight over OpenTelemetry's set-once global.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc

ENV_ENDPOINT = "KVBATON_OTLP_ENDPOINT"
TRACEPARENT = "traceparent"

# Attribute names (also in docs/operators.md).
ATTR_TRANSFER_ID = "kvbaton.transfer_id"
ATTR_CONVERSATION_ID = "kvbaton.conversation_id"
ATTR_MODE = "kvbaton.mode"

# The methods never traced: health checks and reflection (probes, grpcurl).
_UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


class _State:
    def __init__(self, provider: Any, tracer: Any, propagator: Any) -> None:
        self.provider = provider
        self.tracer = tracer
        self.propagator = propagator


_state: _State | None = None


def enabled() -> bool:
    return _state is not None


def configure(endpoint: str | None = None, *, service_name: str = "kvbaton", exporter: Any = None,
              batch: bool | None = None) -> bool:
    """Turns tracing on for this process: spans go to the OTLP/gRPC collector at
    ``endpoint`` (default ``$KVBATON_OTLP_ENDPOINT``; ``http://`` means plaintext) or to
    ``exporter`` (tests: an ``InMemorySpanExporter``). Neither given: stays off, returns
    False. Spans are exported in batches off the request path (``batch``; default: on for
    OTLP, off for an explicit exporter so tests see spans at once)."""
    global _state
    endpoint = endpoint if endpoint is not None else os.environ.get(ENV_ENDPOINT, "")
    if exporter is None and not endpoint:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import (
        TraceContextTextMapPropagator,
    )

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter,
        )

        exporter = OTLPSpanExporter(endpoint=endpoint)
        batch = True if batch is None else batch
    shutdown()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    _state = _State(provider, provider.get_tracer("kvbaton"), TraceContextTextMapPropagator())
    return True


def shutdown() -> None:
    """Flushes and turns tracing off (later spans are not recorded)."""
    global _state
    state, _state = _state, None
    if state is not None:
        state.provider.shutdown()


# ---------------------------------------------------------------------------------------
# Spans and propagation
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def span(name: str, *, kind: str = "internal", traceparent: str = "",
         attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
    """A span made current for the block (None when tracing is off). Its parent is the
    current span, or ``traceparent`` when given. Exceptions are recorded and re-raised."""
    state = _state
    if state is None:
        yield None
        return
    from opentelemetry import trace

    ctx = state.propagator.extract({TRACEPARENT: traceparent}) if traceparent else None
    with state.tracer.start_as_current_span(name, context=ctx, kind=getattr(trace.SpanKind, kind.upper()),
                                            attributes=dict(attributes or {})) as s:
        yield s


def current_traceparent() -> str:
    """The current span as a ``traceparent`` value ("" when off or outside a span)."""
    state = _state
    if state is None:
        return ""
    carrier: dict[str, str] = {}
    state.propagator.inject(carrier)
    return carrier.get(TRACEPARENT, "")


def grpc_metadata(traceparent: str | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying ``traceparent`` (None when there is none). Pure: the
    connector calls it without any tracing set-up."""
    return ((TRACEPARENT, traceparent),) if traceparent else None


def set_attributes(s: Any, **attrs: Any) -> None:
    if s is not None:
        s.set_attributes({k: v for k, v in attrs.items() if v is not None})


def _request_ids(request: Any) -> dict[str, str]:
    """``kvbaton.transfer_id`` / ``kvbaton.conversation_id`` from a request message."""
    out: dict[str, str] = {}
    for field, attr in (("transfer_id", ATTR_TRANSFER_ID), ("conversation_id", ATTR_CONVERSATION_ID)):
        value = getattr(request, field, "")
        if not value and field == "conversation_id":
            value = getattr(getattr(request, "retained", None), "conversation_id", "")  # RegisterRetained
        if isinstance(value, str) and value:
            out[attr] = value
    return out


# ---------------------------------------------------------------------------------------
# gRPC server interceptor
# ---------------------------------------------------------------------------------------


def server_interceptors() -> list:
    """``[ServerTracing()]`` while tracing is on, else ``[]`` (nothing on the RPC path)."""
    return [ServerTracing()] if _state is not None else []


def _traceparent_of(metadata: Sequence[tuple[str, Any]] | None) -> str:
    for k, v in metadata or ():
        if k == TRACEPARENT:
            return v if isinstance(v, str) else v.decode(errors="replace")
    return ""


def _finish(s: Any, context: Any, exc: BaseException | None) -> None:
    from opentelemetry.trace import Status, StatusCode

    code = None
    with contextlib.suppress(Exception):
        code = context.code()
    if code is None and exc is not None:
        code = grpc.StatusCode.UNKNOWN if isinstance(exc, Exception) else grpc.StatusCode.CANCELLED
    value = code.value[0] if code is not None else 0
    s.set_attribute("rpc.grpc.status_code", value)
    if value != 0:
        detail = ""
        with contextlib.suppress(Exception):
            detail = context.details() or ""
        s.set_status(Status(StatusCode.ERROR, f"{code.name}: {detail}"[:300] if code is not None else str(exc)))


class ServerTracing(grpc.aio.ServerInterceptor):
    """The server interceptor: a SERVER span per RPC continuing the caller's
    ``traceparent`` (metadata). Put it first, before the auth ``Guard``, so refused
    calls are traced too. Streams are traced only when the caller sent a
    ``traceparent`` (a Subscribe or KeepAlive lives for hours: a root span of that length
    is noise)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        state = _state
        method = details.method
        if handler is None or state is None or method.startswith(_UNTRACED_PREFIXES):
            return handler
        from opentelemetry import trace

        parent_tp = _traceparent_of(details.invocation_metadata)
        streaming_request = bool(handler.stream_unary or handler.stream_stream)
        if (streaming_request or handler.unary_stream) and not parent_tp:
            return handler  # a long-lived stream with no caller trace: a span would only be noise
        ctx = state.propagator.extract({TRACEPARENT: parent_tp}) if parent_tp else None
        name = method.lstrip("/")
        service, _, rpc_method = name.rpartition("/")
        base = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc_method}

        def start(request: Any = None):
            attrs = dict(base)
            if request is not None:
                attrs.update(_request_ids(request))
            return state.tracer.start_as_current_span(name, context=ctx, kind=trace.SpanKind.SERVER,
                                                      attributes=attrs, record_exception=False,
                                                      set_status_on_exception=False)

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                with start(request) as s:
                    try:
                        resp = await inner(request, context)
                    except BaseException as exc:
                        _finish(s, context, exc)
                        raise
                    _finish(s, context, None)
                    return resp
            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)

        if handler.unary_stream:
            inner_us = handler.unary_stream

            async def server_stream(request, context):
                with start(request) as s:
                    try:
                        async for item in inner_us(request, context):
                            yield item
                    except BaseException as exc:
                        _finish(s, context, exc)
                        raise
                    _finish(s, context, None)
            return grpc.unary_stream_rpc_method_handler(server_stream, handler.request_deserializer,
                                                        handler.response_serializer)

        if handler.stream_unary:
            inner_su = handler.stream_unary

            async def client_stream(request_iterator, context):
                with start() as s:
                    try:
                        resp = await inner_su(request_iterator, context)
                    except BaseException as exc:
                        _finish(s, context, exc)
                        raise
                    _finish(s, context, None)
                    return resp
            return grpc.stream_unary_rpc_method_handler(client_stream, handler.request_deserializer,
                                                        handler.response_serializer)

        inner_ss = handler.stream_stream

        async def bidi(request_iterator, context):
            with start() as s:
                try:
                    async for item in inner_ss(request_iterator, context):
                        yield item
                except BaseException as exc:
                    _finish(s, context, exc)
                    raise
                _finish(s, context, None)
        return grpc.stream_stream_rpc_method_handler(bidi, handler.request_deserializer, handler.response_serializer)


# ---------------------------------------------------------------------------------------
# gRPC client interceptors
# ---------------------------------------------------------------------------------------


def client_interceptors() -> list:
    """Interceptors adding the current span's ``traceparent`` to every call's metadata
    (unless the caller set one); ``[]`` while tracing is off."""
    if _state is None:
        return []

    def details(d):
        if _traceparent_of(d.metadata) or _state is None:
            return d
        tp = current_traceparent()
        return d if not tp else d._replace(metadata=list(d.metadata or ()) + [(TRACEPARENT, tp)])

    class _Unary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation, d, request):
            return await continuation(details(d), request)

    class _ServerStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation, d, request):
            return await continuation(details(d), request)

    class _ClientStream(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation, d, request_iterator):
            return await continuation(details(d), request_iterator)

    class _Bidi(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation, d, request_iterator):
            return await continuation(details(d), request_iterator)

    return [_Unary(), _ServerStream(), _ClientStream(), _Bidi()]
