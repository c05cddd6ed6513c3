"""The engines' own request counts, polled from their ``/metrics`` (issue 13).

A router's load counts are its own: two routers in front of one fleet would each think an
engine idle that the other keeps busy. vLLM exports what it is doing as
``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (one sample per engine
core); the router polls them every ``--load-poll-s`` and :meth:`choice.Fleet.report_load`
takes the larger of its own count and the engine's. A poll that fails or times out only
lets the last report lapse (its ttl is three intervals): the router goes on with its own
counts, never waits on this.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .choice import Fleet

log = logging.getLogger("kvbaton.router.load")

#: The gauges whose samples add up to an engine's outstanding requests.
REQUEST_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def engine_requests(metrics_text: str) -> int | None:
    """Running + waiting requests from a Prometheus text page (None: no such gauge)."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if not line.startswith(REQUEST_GAUGES):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in REQUEST_GAUGES:  # e.g. vllm:num_requests_waiting_by_reason
            continue
        try:
            total += float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        seen = True
    return round(total) if seen else None


async def poll_engine_loads(fleet: Fleet, session: aiohttp.ClientSession, interval_s: float) -> None:
    """Until cancelled: every ``interval_s``, each routable engine's count into ``fleet``."""
    timeout = aiohttp.ClientTimeout(total=max(0.2, min(1.0, interval_s)))

    async def one(engine_id: str, url: str) -> None:
        try:
            async with session.get(f"{url}/metrics", timeout=timeout) as r:
                if r.status != 200:
                    return
                n = engine_requests(await r.text())
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("load of %s not read: %r", engine_id, exc)
            return
        if n is not None:
            fleet.report_load(engine_id, n, time.monotonic(), ttl_s=3 * interval_s)

    while True:
        now = time.monotonic()
        engines = [(e.engine_id, e.url) for e in fleet.engines.values() if e.routable(now)]
        await asyncio.gather(*(one(i, u) for i, u in engines))
        await asyncio.sleep(interval_s)
