"""``kvbaton top``: a live terminal view of a control plane.

    kvbaton top [--addr H:P[,H:P]] [--metrics URL[,URL]] [--interval 1] [--once]

Tables come over gRPC (``ListEngines``, ``ListTransfers``, ``List`` leases), so ``top``
works against any deployment an operator can reach with the other ``kvbaton``
commands. Rates need counters, which only the services' ``/metrics`` have: give
``--metrics`` (one URL per replica; the counters are summed, since each replica counts
only what it served) and ``top`` diffs two scrapes. Without it the rates say ``n/a``.

The screen is redrawn with plain ANSI (home + clear), not curses: it works in any
terminal and in ``kubectl exec``, and ``--once`` prints a single frame with no escapes
(scripts, tests).
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvbaton.services.web import RATE_COUNTERS, engine_rows, lease_row, transfer_row

MAX_ROWS = 10
SCRAPE_TIMEOUT_S = 3.0


def _scrape_one(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:  # operator-given URL
        text = resp.read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def scrape(urls: Sequence[str]) -> dict[str, float] | None:
    """Counter totals summed over every replica's /metrics (None if any scrape failed:
    a partial sum would show a false drop in the rates)."""
    if not urls:
        return None
    try:
        parts = await asyncio.wait_for(
            asyncio.gather(*(asyncio.to_thread(_scrape_one, u) for u in urls)), SCRAPE_TIMEOUT_S + 1)
    except Exception:  # noqa: BLE001 - unreachable replica: no rates this frame
        return None
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def rates(before: tuple[float, dict[str, float]] | None, after: tuple[float, dict[str, float]] | None) -> dict[str, float] | None:
    if before is None or after is None or after[0] <= before[0]:
        return None
    dt = after[0] - before[0]
    return {name: max(after[1].get(c, 0.0) - before[1].get(c, 0.0), 0.0) / dt for name, c in RATE_COUNTERS.items()}


async def snapshot(kv: Any) -> dict[str, Any]:
    """Engines, pending transfers and the leases expiring soonest, over gRPC."""
    from kvbaton.v1 import lease_pb2, rendezvous_pb2

    answers: tuple[Any, ...] = await asyncio.gather(  # each a response or the exception it raised
        kv.list_engines(),  # every page: a dashboard must not lose engines past the first
        kv.call(kv.rendezvous.ListTransfers, rendezvous_pb2.ListTransfersRequest()),
        kv.call(kv.lease.List, lease_pb2.ListLeasesRequest()),
        return_exceptions=True)
    engines, transfers, leases = answers
    now_ms = int(time.time() * 1000)
    out: dict[str, Any] = {"errors": []}
    for name, resp in (("engines", engines), ("transfers", transfers), ("leases", leases)):
        if isinstance(resp, BaseException):
            out["errors"].append(f"{name}: {resp.details() if hasattr(resp, 'details') else repr(resp)}")
    out["engines"] = [] if isinstance(engines, BaseException) else engine_rows(list(engines))
    if not isinstance(transfers, BaseException):
        ts = sorted(transfers.transfers, key=lambda t: min(
            (s.received_at_ms for s in (t.offer, t.completion) if s.engine_id), default=t.updated_at_ms))
        out["transfers"] = [transfer_row(t, now_ms) for t in ts]
    if not isinstance(leases, BaseException):
        out["leases"] = [lease_row(i) for i in leases.leases]  # sorted by deadline by the service
    return out


def _table(rows: list[list[str]], headers: list[str]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(headers, *rows)]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in [headers, *rows]]


def _s(ms: int | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.1f}s"


def render(addr: str, snap: dict[str, Any], r: dict[str, float] | None, *, width: int = 120) -> str:
    """One frame as plain text."""
    lines = [f"kvbaton top — {addr} — {time.strftime('%H:%M:%S')}"]
    transfers, leases = snap.get("transfers"), snap.get("leases")
    active = sum(1 for lr in leases or [] if lr["state"] == "active")
    draining = sum(1 for lr in leases or [] if lr["state"] == "draining")
    if r is None:
        rate_text = "matches/s n/a  renewals/s n/a  (pass --metrics URL for rates)"
    else:
        rate_text = (f"matches/s {r['matches_per_s']:.1f}  renewals/s {r['renewals_per_s']:.1f}  "
                     f"renewal writes/s {r['renewal_writes_per_s']:.1f}  pins/s {r['pins_per_s']:.1f}  "
                     f"KV MiB/s {r['bytes_per_s'] / 2**20:.1f}  shed/s {r['shed_per_s']:.1f}")
    lines.append(f"engines {len(snap['engines'])}  pending transfers "
                 f"{'?' if transfers is None else len(transfers)}  leases {active} active / {draining} draining")
    lines.append(rate_text)
    lines.extend(f"! {e}" for e in snap.get("errors", []))

    lines += ["", "ENGINES"]
    rows = [[e["engine_id"], e["role"], f"{e['ranks']}/{e['tp_size']}", str(e["num_blocks"]),
             str(e["tokens_per_block"]), e["device"] or "?"] for e in snap["engines"][:MAX_ROWS]]
    lines += _table(rows, ["ENGINE", "ROLE", "RANKS", "BLOCKS", "TOK/BLK", "DEVICE"]) if rows else ["  (none)"]

    lines += ["", "PENDING TRANSFERS (oldest first)"]
    rows = [[t["transfer_id"], str(t["attempt"]), t["phase"], t["decode"] or "-", t["prefill"] or "-",
             str(t["blocks"]), _s(t["age_ms"]), _s(t["deadline_in_ms"])] for t in (transfers or [])[:MAX_ROWS]]
    lines += _table(rows, ["TRANSFER", "ATT", "PHASE", "DECODE", "PREFILL", "BLOCKS", "AGE", "EXPIRES IN"]) if rows else ["  (none)"]
    if transfers and len(transfers) > MAX_ROWS:
        lines.append(f"  … {len(transfers) - MAX_ROWS} more")

    lines += ["", "LEASES EXPIRING SOONEST"]
    rows = [[lr["conversation_id"], lr["lease_id"], lr["engine_id"], lr["state"], _s(lr["remaining_ms"]),
             str(lr["pins"]), str(lr["blocks"]), str(lr["renewals"])] for lr in (leases or [])[:MAX_ROWS]]
    lines += _table(rows, ["CONVERSATION", "LEASE", "ENGINE", "STATE", "REMAINING", "PINS", "BLOCKS", "RENEWALS"]) if rows else ["  (none)"]
    if leases and len(leases) > MAX_ROWS:
        lines.append(f"  … {len(leases) - MAX_ROWS} more")
    return "\n".join(line[:width] for line in lines)


async def run(addr: str, metrics: Sequence[str], *, interval_s: float = 1.0, once: bool = False,
              timeout_s: float = 5.0, frames: int = 0, client: Any = None) -> int:
    """Redraws every ``interval_s`` until interrupted (or ``frames`` frames); ``once``:
    one frame (rates from two scrapes ``interval_s`` apart), no escapes. ``client``: a
    ready KvbatonClient to use; without one, TLS and token come from the environment
    (``KVBATON_TLS_*``, ``KVBATON_TOKEN``; kvbaton/security.py)."""
    from kvbaton.security import ClientSecurity

    async with client or ClientSecurity.resolve().client(addr, timeout_s=timeout_s) as kv:
        prev = (time.monotonic(), s) if (s := await scrape(metrics)) is not None else None
        drawn = 0
        while True:
            if once:
                await asyncio.sleep(interval_s)  # the rate window
            snap = await snapshot(kv)
            totals = await scrape(metrics)
            cur = (time.monotonic(), totals) if totals is not None else None
            frame = render(addr, snap, rates(prev, cur))
            prev = cur or prev
            if once:
                print(frame, flush=True)
                return 0
            sys.stdout.write("\x1b[H\x1b[2J" + frame + "\n")
            sys.stdout.flush()
            drawn += 1
            if frames and drawn >= frames:
                return 0
            await asyncio.sleep(interval_s)
