"""OpenTelemetry tracing (services/tracing.py) against a real server, with an in-memory
exporter: a caller's ``traceparent`` (gRPC metadata) is continued by the services with a
span per RPC carrying the request's transfer / conversation ids; the router's request
span reaches the engines (HTTP header and ``kv_transfer_params``) and, through a traced
client, the control plane; with tracing off nothing is recorded and nothing breaks.
"""

from __future__ import annotations

import grpc
import pytest
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvbaton.client import KvbatonClient
from kvbaton.services import tracing
from kvbaton.services.router.app import build_app
from kvbaton.services.server import ControlPlane
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import registrar_pb2, rendezvous_pb2

from .conftest import fast_config
from .helpers import register

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


@pytest.fixture
def exporter():
    exp = InMemorySpanExporter()
    assert tracing.configure(exporter=exp, service_name="kvbaton-test")
    yield exp
    tracing.shutdown()


@pytest.fixture
def no_tracing(monkeypatch):
    monkeypatch.delenv(tracing.ENV_ENDPOINT, raising=False)
    tracing.shutdown()
    assert not tracing.enabled()


async def _plane():
    store = MemoryStore()
    plane = ControlPlane(fast_config(otlp_endpoint=""), store=store)
    await plane.start()
    kv = KvbatonClient(plane.address, timeout_s=5.0)
    await kv.wait_ready()
    return plane, kv, store


async def _close(plane, kv, store):
    await kv.close()
    await plane.stop()
    await store.close()


def _spans(exporter, name):
    return [s for s in exporter.get_finished_spans() if s.name == name]


async def test_server_span_continues_the_callers_trace(exporter):
    plane, kv, store = await _plane()
    try:
        await register(kv, "d0")
        md = tracing.grpc_metadata(TRACEPARENT)
        await kv.call(kv.rendezvous.Offer, rendezvous_pb2.OfferRequest(
            transfer_id="t-1", decode_engine_id="d0", block_ids=[1, 2], num_tokens=32), metadata=md)
        with pytest.raises(grpc.aio.AioRpcError) as err:  # nothing retained: NOT_FOUND, traced as an error
            await kv.registrar.LookupRetained(registrar_pb2.LookupRetainedRequest(conversation_id="conv-9"),
                                              metadata=md)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await _close(plane, kv, store)

    (offer,) = _spans(exporter, "kvbaton.v1.Rendezvous/Offer")
    assert format(offer.context.trace_id, "032x") == TRACE_ID
    assert offer.parent is not None and format(offer.parent.span_id, "016x") == PARENT_SPAN_ID
    assert offer.parent.is_remote
    assert offer.kind.name == "SERVER"
    assert offer.attributes["kvbaton.transfer_id"] == "t-1"
    assert "kvbaton.conversation_id" not in offer.attributes
    assert offer.attributes["rpc.system"] == "grpc"
    assert offer.attributes["rpc.service"] == "kvbaton.v1.Rendezvous"
    assert offer.attributes["rpc.method"] == "Offer"
    assert offer.attributes["rpc.grpc.status_code"] == 0
    assert offer.status.is_ok

    (lookup,) = _spans(exporter, "kvbaton.v1.Registrar/LookupRetained")
    assert format(lookup.context.trace_id, "032x") == TRACE_ID
    assert lookup.attributes["kvbaton.conversation_id"] == "conv-9"
    assert lookup.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert not lookup.status.is_ok

    # A call without a traceparent is a root span of its own trace; the health check is not traced.
    (reg,) = _spans(exporter, "kvbaton.v1.Registrar/RegisterEngine")
    assert reg.parent is None and format(reg.context.trace_id, "032x") != TRACE_ID
    assert not [s for s in exporter.get_finished_spans() if "grpc.health" in s.name]


async def test_traced_client_injects_the_current_span(exporter):
    plane, kv, store = await _plane()  # made while tracing is on: its channel injects
    try:
        with tracing.span("caller", kind="client") as caller:
            with pytest.raises(grpc.aio.AioRpcError):
                await kv.rendezvous.GetTransfer(rendezvous_pb2.GetTransferRequest(transfer_id="t-x"))
        trace_id = caller.get_span_context().trace_id
    finally:
        await _close(plane, kv, store)
    (get,) = _spans(exporter, "kvbaton.v1.Rendezvous/GetTransfer")
    assert get.context.trace_id == trace_id
    assert get.parent.span_id == caller.get_span_context().span_id
    assert get.attributes["kvbaton.transfer_id"] == "t-x"


async def test_router_trace_reaches_engines_and_control_plane(exporter):
    """One trace: router request → prefill/decode legs (HTTP header + kv_transfer_params)
    → the control-plane RPCs the router makes for the conversation."""
    plane, kv, store = await _plane()
    seen: list[tuple[str, dict, dict]] = []

    async def engine(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.host, dict(request.headers), body))
        return web.json_response({"id": "c", "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                                  "kv_transfer_params": {"remote_engine_id": "p0", "remote_block_ids": [1],
                                                         "transfer_id": body.get("kv_transfer_params", {})
                                                         .get("transfer_id", "")}})

    runners = []
    try:
        urls = []
        for _ in range(2):
            app = web.Application()
            app.router.add_post("/v1/completions", engine)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        router = web.AppRunner(build_app(urls[0], urls[1], "pull", control_plane=plane.address))
        await router.setup()
        site = web.TCPSite(router, "127.0.0.1", 0)
        await site.start()
        runners.append(router)
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/completions",
                              json={"prompt": "hi", "max_tokens": 2, "conversation_id": "conv-7"}) as r:
                assert r.status == 200, await r.text()
    finally:
        for r in runners:
            await r.cleanup()
        await _close(plane, kv, store)

    (req,) = _spans(exporter, "kvbaton.router.request")
    trace_id = format(req.context.trace_id, "032x")
    assert req.attributes["kvbaton.mode"] == "pull"
    assert req.attributes["kvbaton.conversation_id"] == "conv-7"
    transfer_id = req.attributes["kvbaton.transfer_id"]
    assert len(transfer_id) == 32
    assert req.attributes["http.response.status_code"] == 200
    legs = {s.name: s for s in exporter.get_finished_spans() if s.name.startswith("kvbaton.router.") and s is not req}
    assert set(legs) == {"kvbaton.router.prefill", "kvbaton.router.decode"}
    for leg in legs.values():
        assert leg.parent.span_id == req.context.span_id
        assert leg.attributes["kvbaton.transfer_id"] == transfer_id

    assert len(seen) == 2  # prefill, then decode
    for (_, headers, body), leg in zip(seen, ("kvbaton.router.prefill", "kvbaton.router.decode")):
        ctx = legs[leg].context
        expected = f"00-{trace_id}-{format(ctx.span_id, '016x')}-{format(ctx.trace_flags, '02x')}"
        assert headers.get("traceparent") == expected
        assert body["kv_transfer_params"]["traceparent"] == expected
    assert seen[1][2]["kv_transfer_params"]["conversation_id"] == "conv-7"

    # The conversation lookups (Renew + LookupRetained) joined the request's trace.
    for name, attr in (("kvbaton.v1.Lease/Renew", "conv-7"), ("kvbaton.v1.Registrar/LookupRetained", "conv-7")):
        (rpc,) = _spans(exporter, name)
        assert format(rpc.context.trace_id, "032x") == trace_id
        assert rpc.parent.span_id == req.context.span_id
        assert rpc.attributes["kvbaton.conversation_id"] == attr


async def test_tracing_off_records_nothing_and_breaks_nothing(no_tracing, monkeypatch):
    exp = InMemorySpanExporter()
    tracing.configure(exporter=exp)
    tracing.shutdown()  # on, then off again: nothing may reach the old exporter either

    async def boom(*a, **k):
        raise AssertionError("the tracing interceptor must not be installed while tracing is off")

    monkeypatch.setattr(tracing.ServerTracing, "intercept_service", boom)
    plane, kv, store = await _plane()
    try:
        assert tracing.server_interceptors() == [] and tracing.client_interceptors() == []
        call = kv.registrar.ListEngines(registrar_pb2.ListEnginesRequest())
        assert type(call).__name__ == "UnaryUnaryCall"  # no client interceptor on the channel
        await call
        assert tracing.current_traceparent() == ""
        with tracing.span("x") as s:
            assert s is None
        await register(kv, "d0")
        # A caller's traceparent is simply ignored.
        resp = await kv.call(kv.rendezvous.Offer, rendezvous_pb2.OfferRequest(
            transfer_id="t-2", decode_engine_id="d0", block_ids=[1], num_tokens=16),
            metadata=tracing.grpc_metadata(TRACEPARENT))
        assert resp.state.transfer_id == "t-2"
    finally:
        await _close(plane, kv, store)
    assert exp.get_finished_spans() == ()
    assert tracing.grpc_metadata("") is None


def test_configure_needs_an_endpoint_or_exporter(no_tracing):
    assert tracing.configure() is False and not tracing.enabled()
    assert tracing.configure("") is False and not tracing.enabled()


def test_connector_scheduler_forwards_the_requests_traceparent():
    """The connector needs no tracing set-up: it passes kv_transfer_params["traceparent"]
    on as gRPC metadata (scheduler calls) and in the specs (the worker's calls)."""
    pytest.importorskip("vllm")
    import types

    from vllm.v1.request import RequestStatus

    from kvbaton.connector.metadata import KvbatonSettings
    from kvbaton.connector.scheduler import KvbatonScheduler

    calls: list[tuple[str, object, object]] = []

    class FakeClient:
        rendezvous = types.SimpleNamespace(Offer="Offer", Complete="Complete", Cancel="Cancel")

        async def call(self, method, request, *, retries=3, metadata=None):
            calls.append((method, request, metadata))

    class FakeControl:
        def submit(self, fn):
            import asyncio
            import concurrent.futures

            asyncio.run(fn(FakeClient()))
            fut = concurrent.futures.Future()
            fut.set_result(None)
            return fut

    def req(rid, params, status=RequestStatus.WAITING, computed=0):
        return types.SimpleNamespace(request_id=rid, prompt_token_ids=list(range(256)), num_prompt_tokens=256,
                                     kv_transfer_params=params, status=status, num_computed_tokens=computed)

    blocks = types.SimpleNamespace(get_block_ids=lambda: ([4, 5],))
    for engine_id, mode in (("d0", "push"), ("p0", "push")):
        sched = KvbatonScheduler(KvbatonSettings(control_plane="127.0.0.1:1", engine_id=engine_id, mode=mode), 128)
        sched._control = FakeControl()
        if engine_id == "d0":  # decode: Offer
            r = req("r1", {"do_remote_prefill": True, "transfer_id": "t1", "transfer_mode": "push",
                           "traceparent": TRACEPARENT})
            assert sched.get_num_new_matched_tokens(r, 0) == (256, True)
            sched.update_state_after_alloc(r, blocks, 256)
            assert sched.build_connector_meta(None).loads["r1"].traceparent == TRACEPARENT
        else:  # prefill: Complete
            r = req("r2", {"do_remote_decode": True, "transfer_id": "t1", "transfer_mode": "push",
                           "traceparent": TRACEPARENT}, status=RequestStatus.FINISHED_LENGTH_CAPPED, computed=256)
            assert sched.request_finished(r, [7, 8])[0]
            assert sched.build_connector_meta(None).sends["r2"].traceparent == TRACEPARENT
    assert [(m, md) for m, _, md in calls] == [("Offer", (("traceparent", TRACEPARENT),)),
                                               ("Complete", (("traceparent", TRACEPARENT),))]
