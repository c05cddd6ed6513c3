"""Follow the registrar: every engine that registers with a ``serve_url`` joins the
router's :class:`~kvbaton.services.router.choice.Fleet`; one whose registration ends
(killed, liveness lapsed, deregistered) leaves it as soon as the watch event arrives;
``draining`` travels on the rank record.

The loop lists the engines at a store revision R (so engines that went away while the
stream was down are forgotten), then watches the changes after R: nothing that happens
between the listing and the watch is missed, and nothing is applied twice in a way that
matters (a rank's end is applied only to the registration incarnation that ended, so an
old end replayed after a newer registration was listed changes nothing). Any failure of
the stream or the listing, a compacted revision or a restarted store included, starts
over with a fresh listing after a capped, jittered backoff (the client moves to the next
replica on transport errors).

The loop never ends while the router runs. The bug this shape fixes (issue 13): when the
control-plane client moved to another replica (a lookup's retry after UNAVAILABLE closes
the old channel), gRPC ended the watch stream with ``asyncio.CancelledError``; the loop
took that for its own cancellation and stopped, so the router kept the fleet it had at
that moment: an engine whose registration lapsed and came back at once stayed out of
rotation for good. Only the task's own cancellation ends it now (``kvbaton.client``'s
resumed streams had the same gap, fixed there the same way); :class:`DiscoveryState`
(on ``/kvbaton/fleet``) says whether it follows and how often it re-listed.

Nothing here is state that another router replica would need: the registrar is the
source of truth.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable
from typing import Any

import grpc

from kvbaton.client import channel_closed_under
from kvbaton.v1 import common_pb2, registrar_pb2

from .choice import ROLE_BOTH, ROLE_DECODE, ROLE_PREFILL, Fleet

log = logging.getLogger("kvbaton.router.discovery")

_ROLES = {common_pb2.ENGINE_ROLE_PREFILL: ROLE_PREFILL, common_pb2.ENGINE_ROLE_DECODE: ROLE_DECODE,
          common_pb2.ENGINE_ROLE_BOTH: ROLE_BOTH}


@dataclasses.dataclass
class DiscoveryState:
    """Where the follower stands (for ``/kvbaton/fleet`` and tests)."""

    following: bool = False  # a watch stream is open after a listing
    revision: int = 0  # the last store revision applied (listing or event)
    listings: int = 0  # listings applied (1 + re-lists after failures)
    last_error: str = ""

    def json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def apply_rank(fleet: Fleet, rank: registrar_pb2.EngineRank) -> None:
    role = _ROLES.get(rank.role)
    if role is None:
        return
    fleet.put_rank(rank.engine_id, rank.tp_rank, rank.tp_size, role, rank.serve_url, rank.draining,
                   rank.incarnation)


def apply_event(fleet: Fleet, ev: registrar_pb2.EngineEvent) -> None:
    if ev.type == registrar_pb2.EngineEvent.TYPE_PUT:
        apply_rank(fleet, ev.rank)
    elif ev.type == registrar_pb2.EngineEvent.TYPE_DELETE:
        fleet.delete_rank(ev.rank.engine_id, ev.rank.tp_rank, ev.rank.incarnation)


def apply_listing(fleet: Fleet, listed: list[registrar_pb2.EngineRank]) -> None:
    """Makes the discovered part of ``fleet`` what the registrar listed."""
    by_engine: dict[str, set[int]] = {}
    for rank in listed:
        by_engine.setdefault(rank.engine_id, set()).add(rank.tp_rank)
    fleet.forget_missing(set(by_engine))
    for eid, ranks in by_engine.items():  # ranks that went away meanwhile
        e = fleet.engines.get(eid)
        if e is not None and not e.static:
            e.ranks &= ranks
            e.incarnations = {r: inc for r, inc in e.incarnations.items() if r in ranks}
    for rank in listed:
        apply_rank(fleet, rank)


async def follow_registrar(kv: Any, fleet: Fleet, *, ready: asyncio.Event | None = None,
                           on_change: Callable[[], None] | None = None, max_backoff_s: float = 2.0,
                           state: DiscoveryState | None = None) -> None:
    """Runs until cancelled. ``ready`` is set once the first listing is in the fleet."""
    st = state if state is not None else DiscoveryState()
    backoff = 0.05
    while True:
        stream = None
        channel = getattr(kv, "channel", None)
        try:
            listed, revision, incarnation = await kv.list_engines_at()
            apply_listing(fleet, listed)
            st.listings += 1
            st.revision = revision
            if ready is not None:
                ready.set()
            if on_change is not None:
                on_change()
            # A server that gives no revision: the old way (a snapshot of PUTs, then changes).
            request = registrar_pb2.WatchEnginesRequest(after_revision=revision, incarnation=incarnation)
            channel = getattr(kv, "channel", None)
            stream = kv.registrar.WatchEngines(request)
            st.following = True
            async for ev in stream:
                backoff = 0.05
                apply_event(fleet, ev)
                st.revision = max(st.revision, ev.revision)
                if on_change is not None:
                    on_change()
            st.last_error = "the watch ended"
            log.info("registrar watch ended; re-listing")
        except grpc.aio.AioRpcError as exc:
            st.last_error = f"{exc.code().name}: {exc.details()}"
            log.warning("registrar watch failed (%s: %s); re-listing", exc.code().name, exc.details())
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION and len(getattr(kv, "addresses", ())) > 1:
                await kv.reconnect(if_channel=channel)
        except asyncio.CancelledError:
            if not channel_closed_under(channel, getattr(kv, "channel", None)):
                raise
            # The stream's channel was closed under it (the client moved replica).
            st.last_error = "the watch stream was cancelled (the client moved to another replica)"
            log.warning("registrar watch cancelled under the router (channel replaced); re-listing")
        except Exception as exc:  # never stop following: a frozen fleet routes wrongly for good
            st.last_error = repr(exc)
            log.exception("registrar discovery failed; re-listing")
        finally:
            st.following = False
            if stream is not None:
                stream.cancel()
        await asyncio.sleep(backoff * (1 + random.random()))
        backoff = min(backoff * 2, max_backoff_s)
