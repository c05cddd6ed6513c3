"""Store incarnations on resumable streams.

A client resumes a stream from the last revision it saw. That is only meaningful within
one revision history: when the embedded store restarts, revisions begin again at 1 and
everything it held is gone, so resuming "after revision R" would silently drop every new
event at or below R. Each stream therefore announces the store's incarnation in its
initial metadata; a client that resumes under another one (or from a revision the store
has not reached) starts from scratch instead, and learns that it must re-register.
"""

from __future__ import annotations

import grpc
import structlog

from ..store import Store

log = structlog.get_logger(__name__)

METADATA_KEY = "kvbaton-store-incarnation"  # kvbaton.client.STORE_INCARNATION_METADATA


async def announce(context: grpc.aio.ServicerContext, store: Store) -> None:
    if store.incarnation:
        await context.send_initial_metadata(((METADATA_KEY, store.incarnation),))


# Revision 1 is where every incarnation's history starts (the first write is revision 2).
FIRST_REVISION = 1


async def resume_from(store: Store, after_revision: int, incarnation: str, stream: str) -> int:
    """The revision to resume after: ``after_revision`` as asked, or ``FIRST_REVISION``
    when it was seen under another store incarnation (or lies beyond the store's current
    revision): the client has seen nothing of this history, so it gets all of it (what
    happened between the restart and its reconnecting included), as far as it is kept."""
    if not after_revision:
        return 0
    if incarnation and store.incarnation and incarnation != store.incarnation:
        log.info("stream.new_incarnation", stream=stream, client_incarnation=incarnation, store_incarnation=store.incarnation,
                 after_revision=after_revision)
        return FIRST_REVISION
    if after_revision > await store.current_revision():
        log.info("stream.revision_from_the_future", stream=stream, after_revision=after_revision)
        return FIRST_REVISION
    return after_revision
