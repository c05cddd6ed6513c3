"""Property-based tests over every unary RPC's inputs (hypothesis), through a real server.

Requests are generated from the protobuf descriptors themselves, so every field of every
message gets random values: odd strings, huge and negative-looking numbers, long lists.
Whatever comes in, the server answers OK or a precise refusal — never UNKNOWN/INTERNAL
(a crash) — and the invariants hold afterwards.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from google.protobuf import descriptor as D

from kvbaton.services.server import ControlPlane
from kvbaton.services.store import MemoryStore
from kvbaton.v1 import (
    common_pb2,
    lease_pb2,
    lease_pb2_grpc,
    registrar_pb2,
    registrar_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
)
from tests.services.conftest import fast_config

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ABORTED}

# Ids drawn from a small pool collide often, so sequences exercise real state, not just validation.
ids = st.one_of(st.sampled_from(["dec", "pre", "c1", "c2", "t1", "t2", ""]), st.text(max_size=300))
u32 = st.one_of(st.integers(0, 70), st.sampled_from([0, 1, 99, 100, 65_536, 2**31, 2**32 - 1]))


def strategy_for(desc: D.Descriptor, depth: int = 0) -> st.SearchStrategy:
    """A strategy building messages of type ``desc`` field by field."""
    fields = {}
    for f in desc.fields:
        if f.type == D.FieldDescriptor.TYPE_MESSAGE:
            if f.message_type.GetOptions().map_entry:
                inner = st.dictionaries(st.text(max_size=40), st.text(max_size=40), max_size=4)
            elif depth > 2:
                continue
            else:
                inner = strategy_for(f.message_type, depth + 1)
        elif f.type == D.FieldDescriptor.TYPE_STRING:
            inner = ids
        elif f.type == D.FieldDescriptor.TYPE_BYTES:
            inner = st.binary(max_size=80)
        elif f.type == D.FieldDescriptor.TYPE_BOOL:
            inner = st.booleans()
        elif f.type == D.FieldDescriptor.TYPE_ENUM:
            inner = st.sampled_from([v.number for v in f.enum_type.values] + [99])
        elif f.type in (D.FieldDescriptor.TYPE_INT64, D.FieldDescriptor.TYPE_SINT64):
            inner = st.integers(-(2**63), 2**63 - 1)
        elif f.type == D.FieldDescriptor.TYPE_UINT64:
            inner = st.integers(0, 2**64 - 1)
        else:
            inner = u32
        if f.is_repeated and not (f.type == D.FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry):
            inner = st.lists(inner, max_size=6) | st.just(list(range(70_000)) if f.type == D.FieldDescriptor.TYPE_UINT32 else [])
        fields[f.name] = st.one_of(st.none(), inner)
    return st.fixed_dictionaries({}, optional=fields)


def build(cls, values: dict):
    msg = cls()
    for name, value in values.items():
        if value is None:
            continue
        field = cls.DESCRIPTOR.fields_by_name[name]
        try:
            if field.type == D.FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
                getattr(msg, name).update(value)
            elif field.type == D.FieldDescriptor.TYPE_MESSAGE:
                sub = [build(field.message_type._concrete_class, v) for v in value] if field.is_repeated else build(
                    field.message_type._concrete_class, value)
                if field.is_repeated:
                    getattr(msg, name).extend(sub)
                else:
                    getattr(msg, name).CopyFrom(sub)
            elif field.is_repeated:
                getattr(msg, name).extend(value)
            else:
                setattr(msg, name, value)
        except (ValueError, TypeError):
            pass  # a value protobuf itself rejects (e.g. out-of-range enum) never reaches the wire
    return msg


class _Server:
    """A control plane on its own loop thread, for synchronous hypothesis tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="prop-server")
        self.thread.start()
        assert self.ready.wait(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.plane = ControlPlane(fast_config(), store=MemoryStore())
        self.loop.run_until_complete(self.plane.start())
        self.ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.plane.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    s = _Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stubs(server):
    channel = grpc.insecure_channel(server.plane.address)
    grpc.channel_ready_future(channel).result(10)
    reg = registrar_pb2_grpc.RegistrarStub(channel)
    # Two real engines, so that generated requests naming them get past "unknown engine".
    for eid, role in (("dec", common_pb2.ENGINE_ROLE_DECODE), ("pre", common_pb2.ENGINE_ROLE_PREFILL)):
        reg.RegisterEngine(registrar_pb2.RegisterEngineRequest(rank=registrar_pb2.EngineRank(
            engine_id=eid, role=role, tp_size=1, agent_name=eid, agent_metadata=b"m",
            geometry=common_pb2.KvGeometry(region_base_addrs=[1], bytes_per_block=16, num_blocks=100,
                                           tokens_per_block=16, dtype="float32", fingerprint="fp")), ttl_ms=600_000))
    yield {"Registrar": reg, "Rendezvous": rendezvous_pb2_grpc.RendezvousStub(channel),
           "Lease": lease_pb2_grpc.LeaseStub(channel)}
    channel.close()


UNARY = [
    (svc_pb.DESCRIPTOR.services_by_name[svc], m)
    for svc_pb, svc in ((registrar_pb2, "Registrar"), (rendezvous_pb2, "Rendezvous"), (lease_pb2, "Lease"))
    for m in svc_pb.DESCRIPTOR.services_by_name[svc].methods
    if not m.client_streaming and not m.server_streaming
]


@pytest.mark.parametrize("service, method", UNARY, ids=[f"{s.name}.{m.name}" for s, m in UNARY])
def test_any_input_gets_ok_or_a_precise_refusal(stubs, service, method):
    call = getattr(stubs[service.name], method.name)
    cls = method.input_type._concrete_class

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy_for(method.input_type))
    def check(values):
        request = build(cls, values)
        try:
            call(request, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() in REFUSALS, (method.full_name, exc.code(), exc.details(), request)
            assert exc.details(), "a refusal must say why"

    check()


def test_invariants_after_random_traffic(server, stubs):
    """After everything above: no ended lease holds pins, every pending transfer has a
    side, every registered rank is well-formed, and the services still answer."""
    leases = stubs["Lease"].List(lease_pb2.ListLeasesRequest(states=[lease_pb2.LEASE_STATE_EXPIRED,
                                                                     lease_pb2.LEASE_STATE_REVOKED]), timeout=10)
    for info in leases.leases:
        assert not info.pins, info  # an ended lease holds no pins
        assert info.ended_at_ms >= info.granted_at_ms
    pending = stubs["Rendezvous"].ListTransfers(rendezvous_pb2.ListTransfersRequest(), timeout=10)
    for t in pending.transfers:
        assert t.offer.engine_id or t.completion.engine_id
    # Random deregistrations may have removed the engines; whatever is left is well-formed.
    for rank in stubs["Registrar"].ListEngines(registrar_pb2.ListEnginesRequest(), timeout=10).ranks:
        assert rank.engine_id and rank.role and rank.tp_rank < rank.tp_size and rank.agent_metadata
