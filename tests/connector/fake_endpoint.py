"""A fake NIXL endpoint and control thread for unit tests of the worker's flows.

Only for logic: the real endpoint is exercised on host memory by test_nixl_transfer.py /
test_staging.py and whole engines by tests/e2e. Here every transfer's fate is set by the
test (``finish``/``fail``), every control-plane answer too (``answer``/``refuse``), and time
is whatever ``now`` the test passes to ``progress``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from kvbaton.connector import wire
from kvbaton.connector.flows.context import FlowContext
from kvbaton.connector.flows.faults import Faults
from kvbaton.connector.flows.peers import PeerCache
from kvbaton.connector.settings import KvbatonSettings
from kvbaton.connector.statslog import StatsLog
from kvbaton.connector.transfer.geometry import KvLayout
from kvbaton.v1 import common_pb2, registrar_pb2, rendezvous_pb2

BS = 16


def layout(num_blocks: int = 32) -> KvLayout:
    return KvLayout.from_tensors([torch.zeros(num_blocks, 2, BS, 8)], BS, block_dim=0)


@dataclasses.dataclass
class FakeXfer:
    op: str
    peer: str
    notif: bytes
    nbytes: int
    state: str = "PROC"
    released: bool = False
    plan: Any = None  # the TransferPlan posted (descriptor rows)


class FakeEndpoint:
    """What the flows call on a :class:`NixlEndpoint`, recorded."""

    def __init__(self) -> None:
        self.peers: set[str] = set()
        self.removed: list[str] = []
        self.sent: list[tuple[str, wire.Message]] = []  # notifications, decoded
        self.xfers: list[FakeXfer] = []
        self.handlers: list[tuple[bytes, Callable[[str, bytes], None]]] = []
        self.post_error: Exception | None = None

    def add_peer(self, name: str, metadata: bytes) -> str:
        self.peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        self.peers.discard(name)
        self.removed.append(name)

    def _post(self, op: str, plan: Any, peer: str, notif: bytes) -> FakeXfer:
        if self.post_error is not None:
            raise self.post_error
        x = FakeXfer(op, peer, notif, int(plan.nbytes), plan=plan)
        self.xfers.append(x)
        return x

    def read(self, plan: Any, peer: str, notif: bytes = b"") -> FakeXfer:
        return self._post("READ", plan, peer, notif)

    def write(self, plan: Any, peer: str, notif: bytes = b"") -> FakeXfer:
        return self._post("WRITE", plan, peer, notif)

    def state(self, x: FakeXfer) -> str:
        assert not x.released, "state() of a released transfer"
        return x.state

    def release(self, x: FakeXfer) -> None:
        assert not x.released, "released twice"
        x.released = True

    def send_notif(self, peer: str, msg: bytes) -> None:
        self.sent.append((peer, wire.decode(msg)))

    def on_notif(self, prefix: bytes, handler: Callable[[str, bytes], None]) -> None:
        self.handlers.append((prefix, handler))

    def deliver(self, peer: str, raw: bytes) -> None:
        """A notification arrives (first matching handler, like the real one)."""
        for prefix, fn in self.handlers:
            if raw.startswith(prefix):
                fn(peer, raw)
                return
        raise AssertionError(f"no handler for {raw[:30]!r}")

    def messages(self, cls: type[wire.Message]) -> list[Any]:
        return [m for _, m in self.sent if isinstance(m, cls)]


class FakeControl:
    """Control thread whose calls never run: the test answers each future."""

    def __init__(self, ranks: dict[str, Any] | None = None) -> None:
        self.ranks = ranks or {}
        self.lookups: list[concurrent.futures.Future[Any]] = []
        self.calls: list[tuple[concurrent.futures.Future[Any], Any]] = []  # (future, request)
        # BeginRead is answered at once with this (a TransferState, or an exception to raise);
        # None: left to the test like every other call.
        self.begin_read: Any = rendezvous_pb2.TransferState(phase=rendezvous_pb2.TRANSFER_PHASE_MATCHED)

    def get_engine(self, engine_id: str) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if engine_id in self.ranks:  # one rank, or a list of every rank (tensor parallelism)
            got = self.ranks[engine_id]
            fut.set_result(registrar_pb2.GetEngineResponse(ranks=got if isinstance(got, list) else [got]))
        self.lookups.append(fut)
        return fut

    def submit(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        rec = _Recorder()
        fn(rec)  # records which RPC and request it would send
        self.calls.append((fut, rec.req))
        if isinstance(rec.req, rendezvous_pb2.BeginReadRequest) and self.begin_read is not None:
            if isinstance(self.begin_read, BaseException):
                fut.set_exception(self.begin_read)
            else:
                fut.set_result(self.begin_read)
        return fut

    def requests(self, rpc: str) -> list[Any]:
        return [req for _, req in self.calls if type(req).__name__ == rpc]


class _Recorder:
    """Stands in for the client inside ``submit(lambda c: c.call(c.x.Rpc, req, ...))`` (or
    ``c.session.method(req)``)."""

    req: Any = None

    def __getattr__(self, name: str) -> Any:
        return self

    def call(self, _rpc: Any, req: Any, **_kw: Any) -> None:
        self.req = req

    def __call__(self, req: Any, *_a: Any, **_kw: Any) -> None:
        """``c.session.offer(req)`` & co.: the session path of ``rendezvous_call``."""
        self.req = req


def rank(engine_id: str, lay: KvLayout) -> Any:
    return registrar_pb2.EngineRank(engine_id=engine_id, agent_name=f"kvb-{engine_id}-r0", agent_metadata=b"md",
                                    geometry=common_pb2.KvGeometry(**lay.to_proto_fields()))


def context(control: FakeControl, ep: FakeEndpoint, lay: KvLayout, **settings: Any) -> FlowContext:
    s = KvbatonSettings(control_plane="cp:1", engine_id="me", **settings)
    peers = PeerCache(control, ep)  # type: ignore[arg-type]
    return FlowContext(s, lay, "kvb-me-r0", control, StatsLog("", "me"), peers,  # type: ignore[arg-type]
                       ep=ep, faults=Faults(""))  # type: ignore[arg-type]


def drain(ctx: FlowContext) -> list[tuple[str, str, bool, tuple[int, ...]]]:
    out = []
    while not ctx.results.empty():
        out.append(ctx.results.get_nowait())
    return out
