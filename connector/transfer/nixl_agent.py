"""A thin, engine-friendly wrapper over one NIXL agent (``nixl._api.nixl_agent``).

Why a wrapper:

* **No spinning.** ``nixl_agent`` hard-codes the progress thread's poll delay to 0, so an
  idle agent burns a whole core (measured: 2.0 s CPU per 2 s idle on NIXL 1.5.1). We create
  the agent with ``nixl_agent_config(enable_prog_thread=False)`` (0.0001 s CPU per 2 s idle).
  Without it, UCX only makes progress inside our calls, so the owner thread must keep calling
  :meth:`NixlEndpoint.poll_notifs` (the passive side of a first connection hangs otherwise)
  and :meth:`NixlEndpoint.wait` polls ``check_xfer_state`` with a bounded sleep backoff.
* **One thread per agent.** The agent is created in NIXL's ``NIXL_THREAD_SYNC_NONE`` mode
  (no locks). Every method of a :class:`NixlEndpoint` must be called from the one thread
  that owns it (the connector's dedicated transfer thread). Nothing here starts threads.
* **Handles are released exactly once.** Using a NIXL transfer handle after release
  segfaults the process; :class:`Transfer` refuses any use after release instead.
* **No listener.** NIXL's built-in metadata socket binds all interfaces without
  authentication; metadata travels through the registrar instead (:meth:`metadata`,
  :meth:`add_peer`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .descriptors import Op, TransferPlan
from .geometry import KvLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger(__name__)

# Backoff for polls: short first (host-memory transfers finish within µs of posting),
# capped so a long wait costs ~nothing (≤ 500 wakeups/s).
POLL_MIN_S = 20e-6
POLL_MAX_S = 2e-3


def _plugins(agent: Any) -> list[str]:
    try:
        return sorted(str(p) for p in agent.get_plugin_list())
    except Exception:  # noqa: BLE001 - only for the error message
        return []


def set_ucx_env(*, net_devices: str | None = None, tls: str | None = None) -> None:
    """Set UCX defaults in the environment unless already set. UCX reads them once, when
    the first agent's UCX context is made, so this must run before that."""
    if net_devices is not None:
        os.environ.setdefault("UCX_NET_DEVICES", net_devices)
    if tls is not None:
        os.environ.setdefault("UCX_TLS", tls)


class NixlBackendUnavailable(RuntimeError):
    """The configured NIXL backend cannot be created on this machine (plugin or its system
    libraries missing, e.g. LIBFABRIC without libfabric/EFA). Raised at agent creation, so
    an engine fails at start-up with this message instead of at its first transfer."""


class Transfer:
    """One posted NIXL transfer. Owned by the endpoint thread; released exactly once."""

    __slots__ = ("_handle", "_released", "op", "peer", "nbytes", "num_descs", "posted_at",
                 "state")

    def __init__(self, handle: Any, op: Op, peer: str, plan: TransferPlan, state: str) -> None:
        self._handle = handle
        self._released = False
        self.op = op
        self.peer = peer
        self.nbytes = plan.nbytes
        self.num_descs = plan.num_descs
        self.posted_at = time.monotonic()
        self.state = state  # "PROC" | "DONE" | "ERR" | "RELEASED"

    @property
    def released(self) -> bool:
        return self._released

    def __repr__(self) -> str:
        return (f"Transfer({self.op} → {self.peer}, {self.nbytes} B, {self.num_descs} descs, "
                f"{self.state})")


class NixlEndpoint:
    """One worker's NIXL agent: registration, peers, WRITE/READ, waits and notifications.

    Not thread-safe by design (see module docstring): call it from one thread only.
    """

    def __init__(self, name: str, *, net_devices: str | None = None,
                 ucx_tls: str | None = None, backend: str = "UCX",
                 backend_params: dict[str, str] | None = None) -> None:
        """Create the agent without NIXL's busy progress thread.

        ``net_devices`` (e.g. ``"lo"`` for loopback tests) and ``ucx_tls`` (e.g.
        ``"tcp,self,sm"`` for host memory; on GPUs include ``cuda_copy,cuda_ipc``) become UCX
        environment defaults; variables already set by the operator win.
        """
        set_ucx_env(net_devices=net_devices, tls=ucx_tls)
        from nixl._api import nixl_agent, nixl_agent_config  # deferred: heavy import

        conf = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                 backends=[])
        self._agent = nixl_agent(name, conf)
        params = dict(backend_params or {})
        try:
            self._agent.create_backend(backend, params)
        except Exception as exc:  # nixl raises nixlNotFoundError / nixlBackendError
            plugins = _plugins(self._agent)
            raise NixlBackendUnavailable(
                f"NIXL backend {backend!r} cannot be created on this machine ({type(exc).__name__}: {exc}); "
                f"plugins NIXL found: {', '.join(plugins) or 'none'} (a listed plugin may still lack its "
                "system libraries). Set kv_connector_extra_config.nixl_backend to one this machine "
                "has (UCX is the default).") from exc
        self.name = name
        self.backend = backend
        self._peers: set[str] = set()
        self._regs: list[Any] = []
        self._inbox: dict[str, list[bytes]] = {}
        #: when a list: (descriptors + request creation s, post call s) of every post (benchmarks)
        self.post_times: list[tuple[float, float]] | None = None
        self._handlers: list[tuple[bytes, Callable[[str, bytes], None]]] = []
        self._closed = False

    # ------------------------------------------------------------------ memory
    def register_tensors(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Register contiguous torch tensors (KV caches, staging buffers)."""
        reg = self._agent.register_memory(list(tensors))
        if reg is None:
            raise ValueError("NIXL refused the tensors (non-contiguous or mixed devices?)")
        self._regs.append(reg)
        return reg

    def register_regions(self, regions: Sequence[tuple[int, int, int]], mem_type: str) -> Any:
        """Register raw ``(addr, nbytes, dev_id)`` extents of ``mem_type`` DRAM/VRAM.

        NIXL wants 4-tuples ``(addr, len, dev, meta)`` for raw regions (and would read any
        2-D, 3-column numpy array as such rows), so rows get an empty ``meta``.
        """
        rows = [(int(a), int(n), int(d), "") for a, n, d in regions]
        reg = self._agent.register_memory(rows, mem_type)
        self._regs.append(reg)
        return reg

    def register_layout(self, layout: KvLayout) -> Any:
        """Register every block of a :class:`KvLayout` (adjacent regions merged)."""
        return self.register_regions(layout.registration_regions(), layout.nixl_mem_type)

    def deregister(self, reg: Any) -> None:
        """Deregister; a peer with stale metadata can still write here (leases prevent it)."""
        self._agent.deregister_memory(reg)
        self._regs = [r for r in self._regs if r is not reg]

    # ------------------------------------------------------------------ peers
    def metadata(self) -> bytes:
        """This agent's metadata (with its registrations) for the registrar."""
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, name: str, metadata: bytes) -> str:
        """Load a peer's metadata; a known peer is replaced (engine restart = new metadata)."""
        if name in self._peers:
            self.remove_peer(name)
        loaded = self._agent.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes | bytearray) else str(loaded)
        if loaded != name:
            self._agent.remove_remote_agent(loaded)
            raise ValueError(f"metadata is for agent {loaded!r}, expected {name!r}")
        self._peers.add(name)
        return loaded

    def remove_peer(self, name: str) -> None:
        if name in self._peers:
            self._peers.discard(name)
            self._agent.remove_remote_agent(name)

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    # ------------------------------------------------------------------ transfers
    def write(self, plan: TransferPlan, peer: str, notif: bytes = b"") -> Transfer:
        """Post a WRITE of local descs into the peer's; ``notif`` arrives after the data."""
        return self._post("WRITE", plan, peer, notif)

    def read(self, plan: TransferPlan, peer: str, notif: bytes = b"") -> Transfer:
        """Post a READ of the peer's descs into local ones; ``notif`` tells the peer when done."""
        return self._post("READ", plan, peer, notif)

    def _post(self, op: Op, plan: TransferPlan, peer: str, notif: bytes) -> Transfer:
        if peer not in self._peers and peer != self.name:
            raise KeyError(f"unknown NIXL peer {peer!r}: add_peer() it first")
        if plan.num_descs == 0:
            raise ValueError("empty transfer plan")
        t0 = time.perf_counter() if self.post_times is not None else 0.0
        local = self._agent.get_xfer_descs(np.ascontiguousarray(plan.local_descs),
                                           plan.local_mem_type)
        remote = self._agent.get_xfer_descs(np.ascontiguousarray(plan.remote_descs),
                                            plan.remote_mem_type)
        handle = self._agent.initialize_xfer(op, local, remote, peer, notif)
        xfer = Transfer(handle, op, peer, plan, "PROC")
        t1 = time.perf_counter() if self.post_times is not None else 0.0
        # On host memory UCX does the whole copy inside this call (GIL released).
        state = self._agent.transfer(handle, notif)
        if self.post_times is not None:
            self.post_times.append((t1 - t0, time.perf_counter() - t1))
        xfer.state = state
        if state == "ERR":
            self.release(xfer)
            raise RuntimeError(f"NIXL {op} to {peer} failed to post ({plan.num_descs} descs)")
        return xfer

    def repost(self, xfer: Transfer, notif: bytes = b"") -> None:
        """Post a finished transfer's request again (same descriptors, a new notification).

        Why: creating a request (descriptor lists, NIXL/UCX request setup) costs tens of µs
        per post on GPUs; the pack path moves the same slot → slot pairs over and over."""
        if xfer.released:
            raise RuntimeError(f"{xfer!r} was released; its handle must not be used")
        if xfer.state != "DONE":
            raise RuntimeError(f"{xfer!r} is not finished: it cannot be posted again")
        t1 = time.perf_counter() if self.post_times is not None else 0.0
        xfer.state = self._agent.transfer(xfer._handle, notif)
        xfer.posted_at = time.monotonic()
        if self.post_times is not None:
            self.post_times.append((0.0, time.perf_counter() - t1))
        if xfer.state == "ERR":
            raise RuntimeError(f"NIXL {xfer.op} to {xfer.peer} failed to post again")

    def state(self, xfer: Transfer) -> str:
        """One non-blocking status check ("PROC" | "DONE" | "ERR")."""
        if xfer.released:
            raise RuntimeError(f"{xfer!r} was released; its handle must not be used")
        if xfer.state == "PROC":
            xfer.state = self._agent.check_xfer_state(xfer._handle)
        return xfer.state

    def release(self, xfer: Transfer) -> None:
        """Release the handle once (cancels it if still in flight; later calls no-op)."""
        if xfer._released:
            return
        try:
            self._agent.release_xfer_handle(xfer._handle)
        finally:
            # Even if NIXL refused (could not cancel), never touch the handle again: NIXL
            # keeps a refused handle in its own leak list and frees it with the agent.
            xfer._released = True
            xfer.state = "RELEASED"

    def wait(self, xfer: Transfer, timeout_s: float,
             idle: Callable[[], object] | None = None) -> None:
        """Block until ``xfer`` is done, with a bounded sleep backoff; always releases it.

        Raises TimeoutError after ``timeout_s`` (the transfer is cancelled by the release),
        RuntimeError if NIXL reports an error. ``idle`` runs between polls (tests use it to
        progress a peer endpoint that shares this thread).
        """
        deadline = time.monotonic() + timeout_s
        delay = POLL_MIN_S
        try:
            while True:
                st = self.state(xfer)
                if st == "DONE":
                    return
                if st == "ERR":
                    raise RuntimeError(f"NIXL transfer failed: {xfer!r}")
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"NIXL transfer not done after {timeout_s:.3f}s: {xfer!r}")
                if idle is not None:
                    idle()
                time.sleep(delay)
                delay = min(delay * 2, POLL_MAX_S)
        finally:
            self.release(xfer)

    # ------------------------------------------------------------------ notifications
    def poll_notifs(self) -> dict[str, list[bytes]]:
        """Drain NIXL's notification queue (this also progresses UCX for passive peers).

        Messages matching a handler prefix (:meth:`on_notif`) go to that handler, in order;
        the rest are returned and kept in an inbox for :meth:`take_notif` /
        :meth:`wait_notif`. Keys are peer agent names (str).
        """
        new = self._agent.get_new_notifs()
        unhandled: dict[str, list[bytes]] = {}
        for peer, msgs in new.items():
            for m in msgs:
                for prefix, fn in self._handlers:
                    if m.startswith(prefix):
                        fn(peer, m)
                        break
                else:
                    unhandled.setdefault(peer, []).append(m)
                    self._inbox.setdefault(peer, []).append(m)
        return unhandled

    def on_notif(self, prefix: bytes, handler: Callable[[str, bytes], None]) -> None:
        """Route notifications starting with ``prefix`` to ``handler(peer, msg)``.

        Handlers run inside :meth:`poll_notifs` on the owner thread; they must not block.
        """
        self._handlers.append((prefix, handler))

    def take_notif(self, peer: str, msg: bytes | None = None,
                   prefix: bytes | None = None) -> bytes | None:
        """Remove and return the first inbox message from ``peer`` matching ``msg``/``prefix``."""
        box = self._inbox.get(peer, [])
        for i, m in enumerate(box):
            if (msg is None or m == msg) and (prefix is None or m.startswith(prefix)):
                return box.pop(i)
        return None

    def wait_notif(self, peer: str, msg: bytes | None = None, *, prefix: bytes | None = None,
                   timeout_s: float, idle: Callable[[], object] | None = None) -> bytes:
        """Poll (bounded backoff) until a matching notification from ``peer`` arrives."""
        deadline = time.monotonic() + timeout_s
        delay = POLL_MIN_S
        while True:
            self.poll_notifs()
            got = self.take_notif(peer, msg, prefix)
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no notification {msg or prefix!r} from {peer!r} "
                                   f"after {timeout_s:.3f}s")
            if idle is not None:
                idle()
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)

    def send_notif(self, peer: str, msg: bytes) -> None:
        """A notification not bound to a transfer (acks, requests)."""
        self._agent.send_notif(peer, msg)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Forget peers and registrations. The agent itself is freed with the object."""
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers):
            try:
                self.remove_peer(peer)
            except Exception:  # best effort on shutdown
                log.warning("remove_peer(%s) failed on close", peer, exc_info=True)
        for reg in list(self._regs):
            try:
                self.deregister(reg)
            except Exception:
                log.warning("deregister failed on close", exc_info=True)

    def __enter__(self) -> NixlEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
