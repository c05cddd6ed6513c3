"""Follow the registrar: every engine that registers with a ``serve_url`` joins the
router's :class:`~kvbaton.services.router.choice.Fleet`; one whose registration ends
(killed, liveness lapsed, deregistered) leaves it as soon as the watch event arrives;
``draining`` travels on the rank record.

The loop lists the engines first (so engines that went away while the stream was down are
forgotten), then follows ``WatchEngines``; on a transport error it reconnects (the client
moves to the next replica) with a capped, jittered backoff. Nothing here is state that
another router replica would need: the registrar is the source of truth.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import grpc

from kvbaton.v1 import common_pb2, registrar_pb2

from .choice import ROLE_BOTH, ROLE_DECODE, ROLE_PREFILL, Fleet

log = logging.getLogger("kvbaton.router.discovery")

_ROLES = {common_pb2.ENGINE_ROLE_PREFILL: ROLE_PREFILL, common_pb2.ENGINE_ROLE_DECODE: ROLE_DECODE,
          common_pb2.ENGINE_ROLE_BOTH: ROLE_BOTH}


def apply_rank(fleet: Fleet, rank: registrar_pb2.EngineRank) -> None:
    role = _ROLES.get(rank.role)
    if role is None:
        return
    fleet.put_rank(rank.engine_id, rank.tp_rank, rank.tp_size, role, rank.serve_url, rank.draining)


def apply_event(fleet: Fleet, ev: registrar_pb2.EngineEvent) -> None:
    if ev.type == registrar_pb2.EngineEvent.TYPE_PUT:
        apply_rank(fleet, ev.rank)
    elif ev.type == registrar_pb2.EngineEvent.TYPE_DELETE:
        fleet.delete_rank(ev.rank.engine_id, ev.rank.tp_rank)


async def follow_registrar(kv: Any, fleet: Fleet, *, ready: asyncio.Event | None = None,
                           on_change: Callable[[], None] | None = None, max_backoff_s: float = 2.0) -> None:
    """Runs until cancelled. ``ready`` is set once the first listing is in the fleet."""
    backoff = 0.05
    while True:
        stream = None
        try:
            listed = await kv.list_engines()
            by_engine: dict[str, set[int]] = {}
            for rank in listed:
                by_engine.setdefault(rank.engine_id, set()).add(rank.tp_rank)
            fleet.forget_missing(set(by_engine))
            for eid, ranks in by_engine.items():  # ranks that went away meanwhile
                e = fleet.engines.get(eid)
                if e is not None and not e.static:
                    e.ranks &= ranks
            for rank in listed:
                apply_rank(fleet, rank)
            if ready is not None:
                ready.set()
            if on_change is not None:
                on_change()
            stream = kv.registrar.WatchEngines(registrar_pb2.WatchEnginesRequest())
            async for ev in stream:
                backoff = 0.05
                apply_event(fleet, ev)
                if on_change is not None:
                    on_change()
            log.info("registrar watch ended; re-listing")
        except grpc.aio.AioRpcError as exc:
            log.warning("registrar watch failed (%s: %s); retrying", exc.code().name, exc.details())
            if len(getattr(kv, "addresses", ())) > 1:
                await kv.reconnect()
        finally:
            if stream is not None:
                stream.cancel()
        await asyncio.sleep(backoff * (1 + random.random()))
        backoff = min(backoff * 2, max_backoff_s)
