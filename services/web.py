"""The control plane's HTTP side: ``/metrics`` (Prometheus), a read-only status page
(``/``), its data as JSON (``/api/state``) and ``/healthz``.

aiohttp on the services' own event loop rather than prometheus_client's
``start_http_server`` thread: the page and ``/api/state`` read the domain caches, which
belong to that loop, and a thread would race them. Everything here is read-only and
every read is bounded by a timeout, so a stuck store makes a slow page, never a stuck
server. There is no authentication: bind it to a pod/loopback address, as with gRPC.

Rates (matches/s, renewals/s) come from diffing this replica's counters, sampled once
per second by a background task, so they are meaningful however often the page is read.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import html
import time
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvbaton.v1 import lease_pb2, rendezvous_pb2

from .domain.registrar import role_name
from .plane_view import PlaneView

log = structlog.get_logger(__name__)

STATE_TIMEOUT_S = 3.0
RATE_WINDOW_S = 5.0
MAX_ROWS = 50
# Counters behind the rates (summed over their labels).
RATE_COUNTERS = {
    "matches_per_s": "kvbaton_rendezvous_matches_total",
    "renewals_per_s": "kvbaton_lease_renewals_total",
    "renewal_writes_per_s": "kvbaton_lease_renewal_writes_total",
    "pins_per_s": "kvbaton_lease_pins_total",
    "bytes_per_s": "kvbaton_transfer_bytes_total",
    # New transfers refused because a replica's loop was past capacity: add replicas.
    "shed_per_s": "kvbaton_server_shed_total",
}


def counter_totals(registry: CollectorRegistry) -> dict[str, float]:
    """``{sample name: value summed over labels}`` for every ``*_total`` sample."""
    out: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _phase(phase: int) -> str:
    return rendezvous_pb2.TransferPhase.Name(phase).removeprefix("TRANSFER_PHASE_").lower()


def _lease_state(state: int) -> str:
    return lease_pb2.LeaseState.Name(state).removeprefix("LEASE_STATE_").lower()


def transfer_row(t: rendezvous_pb2.TransferState, now_ms: int) -> dict[str, Any]:
    """One pending transfer as ``/api/state`` and ``kvbaton top`` show it."""
    side = t.offer if t.offer.engine_id and not t.completion.engine_id else t.completion
    deadline = side.deadline_ms if t.phase != rendezvous_pb2.TRANSFER_PHASE_MATCHED else 0
    first = min((s.received_at_ms for s in (t.offer, t.completion) if s.engine_id), default=t.updated_at_ms)
    return {
        "transfer_id": t.transfer_id, "attempt": t.attempt, "phase": _phase(t.phase),
        "decode": t.offer.engine_id, "prefill": t.completion.engine_id,
        "blocks": max(len(t.offer.block_ids), len(t.completion.block_ids)),
        "age_ms": max(now_ms - first, 0), "deadline_in_ms": max(deadline - now_ms, 0) if deadline else None,
        "outcomes": f"{len(t.outcomes)}/{max(t.expected_outcomes, 1)}" if t.phase == rendezvous_pb2.TRANSFER_PHASE_MATCHED else "",
    }


def lease_row(info: lease_pb2.LeaseInfo) -> dict[str, Any]:
    return {
        "conversation_id": info.conversation_id, "lease_id": info.lease_id, "engine_id": info.engine_id,
        "state": _lease_state(info.state), "remaining_ms": info.remaining_ms, "ttl_ms": info.ttl_ms,
        "pins": len(info.pins), "blocks": info.num_blocks, "renewals": info.renewals,
    }


def engine_rows(ranks: list[Any]) -> list[dict[str, Any]]:
    """Ranks grouped into one row per engine."""
    engines: dict[str, dict[str, Any]] = {}
    for r in ranks:
        e = engines.setdefault(r.engine_id, {
            "engine_id": r.engine_id, "role": role_name(r.role), "tp_size": r.tp_size, "ranks": 0,
            "num_blocks": r.geometry.num_blocks, "tokens_per_block": r.geometry.tokens_per_block,
            "device": r.geometry.device, "fingerprint": r.geometry.fingerprint, "labels": dict(r.labels),
            "registered_at_ms": r.registered_at_ms,
        })
        e["ranks"] += 1
    return sorted(engines.values(), key=lambda e: (e["role"], e["engine_id"]))


class WebServer:
    """Serves one ``ControlPlane``'s metrics and status page; ``start()`` / ``stop()``."""

    def __init__(self, plane: PlaneView) -> None:
        if plane.metrics.registry is None:
            raise ValueError("the web server exports the plane's metrics: they need a registry")
        self.plane = plane
        self.registry: CollectorRegistry = plane.metrics.registry
        self._runner: web.AppRunner | None = None
        self._web_runner: web.AppRunner | None = None
        self._sampler: asyncio.Task | None = None
        self._samples: collections.deque[tuple[float, dict[str, float]]] = collections.deque(maxlen=64)
        self.metrics_url = ""
        self.page_url = ""

    # -- lifecycle -------------------------------------------------------------
    def _app(self, *, metrics: bool, page: bool) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self.healthz)
        if metrics:
            app.router.add_get("/metrics", self.metrics)
        if page:
            app.router.add_get("/", self.page)
            app.router.add_get("/api/state", self.api_state)
        return app

    async def _serve(self, app: web.Application, address: str) -> tuple[web.AppRunner, str]:
        host, _, port = address.rpartition(":")
        host = host.strip("[]") or "0.0.0.0"
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, host, int(port))
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else int(port)
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        return runner, f"http://{shown}:{bound}"

    async def start(self) -> None:
        cfg = self.plane.config
        separate = cfg.web_address is not None and cfg.metrics_address is not None
        if cfg.metrics_address is not None:
            self._runner, base = await self._serve(self._app(metrics=True, page=not separate), cfg.metrics_address)
            self.metrics_url = base + "/metrics"
            self.page_url = base + "/"
        if cfg.web_address is not None:
            runner, base = await self._serve(self._app(metrics=cfg.metrics_address is None, page=True), cfg.web_address)
            if self._runner is None:
                self._runner, self.metrics_url = runner, base + "/metrics"
            else:
                self._web_runner = runner
            self.page_url = base + "/"
        self._sample()
        self._sampler = asyncio.get_running_loop().create_task(self._sample_forever(), name="web-rate-sampler")

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        for runner in (self._web_runner, self._runner):
            if runner is not None:
                await asyncio.wait_for(runner.cleanup(), 5.0)

    # -- rates -----------------------------------------------------------------
    def _sample(self) -> None:
        self._samples.append((time.monotonic(), counter_totals(self.registry)))

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._sample()

    def rates(self) -> dict[str, float]:
        """Per-second rates over the last ``RATE_WINDOW_S`` (or as much history as exists)."""
        if len(self._samples) < 2:
            return {name: 0.0 for name in RATE_COUNTERS}
        t1, last = self._samples[-1]
        t0, first = next(((t, v) for t, v in self._samples if t1 - t <= RATE_WINDOW_S), self._samples[0])
        dt = max(t1 - t0, 1e-6)
        return {name: round((last.get(c, 0.0) - first.get(c, 0.0)) / dt, 3) if t1 > t0 else 0.0
                for name, c in RATE_COUNTERS.items()}

    # -- state -----------------------------------------------------------------
    async def state(self) -> dict[str, Any]:
        """Everything the page shows, from this replica's caches (and one engines range)."""
        plane = self.plane
        now_ms = plane.clock.now_ms()
        out: dict[str, Any] = {
            "time_ms": now_ms, "address": plane.address, "store": plane.store.name if plane.store else "",
            "services": list(plane.config.services),
            "leader": plane.leadership(),
            "engines": [], "transfers": None, "leases": None, "errors": [],
        }
        try:
            ranks = await asyncio.wait_for(plane.registrar.list_engines(), STATE_TIMEOUT_S) if plane.registrar else []
            out["engines"] = engine_rows(ranks)
        except Exception as exc:  # noqa: BLE001 - the store may be down: show what we have, say why
            out["errors"].append(f"engines: {exc!r}")
        if plane.rendezvous is not None:
            ts = await plane.rendezvous.list()
            counts = {p: 0 for p in ("offered", "completed", "matched")}
            for t in ts:
                counts[_phase(t.phase)] = counts.get(_phase(t.phase), 0) + 1
            ts.sort(key=lambda t: min((s.received_at_ms for s in (t.offer, t.completion) if s.engine_id),
                                      default=t.updated_at_ms))
            out["transfers"] = {"counts": counts, "total": len(ts), "items": [transfer_row(t, now_ms) for t in ts[:MAX_ROWS]]}
        if plane.lease is not None:
            live = await plane.lease.list()
            retained: dict[str, int] = {}
            for info in live:
                retained[info.engine_id] = retained.get(info.engine_id, 0) + info.num_blocks
            out["leases"] = {
                "active": sum(1 for i in live if i.state == lease_pb2.LEASE_STATE_ACTIVE),
                "draining": sum(1 for i in live if i.state == lease_pb2.LEASE_STATE_DRAINING),
                "retained_blocks": retained,
                "expiring_soonest": [lease_row(i) for i in live[:MAX_ROWS]],  # list() sorts by deadline
            }
        totals = counter_totals(self.registry)
        out["totals"] = {name.removeprefix("kvbaton_"): value for name, value in sorted(totals.items())}
        out["rates"] = self.rates()
        return out

    # -- handlers --------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "services": list(self.plane.config.services)})

    async def metrics(self, request: web.Request) -> web.Response:
        await self.plane.refresh_state_gauges(timeout_s=STATE_TIMEOUT_S)
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _refusal(self, request: web.Request) -> web.Response | None:
        """With tokens configured, the page and /api/state (transfer and conversation ids)
        need an operator token (``Authorization: Bearer <token>``): 401 without a known
        token, 403 for another role. /metrics and /healthz stay open (counts only)."""
        book = getattr(self.plane, "tokens", None)
        if book is None:
            return None
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return web.json_response({"error": "an operator token is required: Authorization: Bearer <token>"},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        who = book.lookup(auth[len("Bearer "):].strip())
        if who is None:
            return web.json_response({"error": "unknown token"}, status=401, headers={"WWW-Authenticate": "Bearer"})
        if who.role != "operator":
            return web.json_response({"error": f"{who.name} ({who.role}) may not read the control plane's state; "
                                               "an operator token is required"}, status=403)
        return None

    async def api_state(self, request: web.Request) -> web.Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        return web.json_response(await asyncio.wait_for(self.state(), STATE_TIMEOUT_S * 2))

    async def page(self, request: web.Request) -> web.Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        try:  # ``?refresh=0``: a still page (a capture must not race the reload)
            refresh_s = max(0, int(request.query.get("refresh", "1")))
        except ValueError:
            return web.Response(status=400, text="refresh must be a whole number of seconds (0: no reload)")
        state = await asyncio.wait_for(self.state(), STATE_TIMEOUT_S * 2)
        return web.Response(text=render_page(state, refresh_s=refresh_s), content_type="text/html")


# -- HTML -------------------------------------------------------------------------

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#0f1419;color:#d8dee9}
header{padding:12px 20px;background:#1b2230;border-bottom:1px solid #2e3746;display:flex;gap:24px;align-items:baseline}
header h1{font-size:18px;margin:0;color:#8fbcbb}
header span{color:#8a94a6}
main{padding:16px 20px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin-bottom:16px}
.card{background:#1b2230;border:1px solid #2e3746;border-radius:6px;padding:10px 14px;min-width:130px}
.card b{display:block;font-size:22px;color:#eceff4}
.card small{color:#8a94a6}
h2{font-size:15px;margin:18px 0 6px;color:#88c0d0}
table{border-collapse:collapse;width:100%;background:#151b24}
th,td{padding:4px 8px;border-bottom:1px solid #263040;text-align:left;font-family:ui-monospace,Menlo,monospace;font-size:12.5px}
th{color:#8a94a6;font-weight:600;background:#1b2230}
.empty{color:#6b7485;font-style:italic;padding:6px 8px}
.warn{color:#ebcb8b}.bad{color:#bf616a}.ok{color:#a3be8c}
.err{background:#3b2228;border:1px solid #bf616a;padding:8px;border-radius:4px;margin-bottom:12px}
"""


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]], empty: str) -> str:
    if not rows:
        return f'<div class="empty">{html.escape(empty)}</div>'
    head = "".join(f"<th>{html.escape(title)}</th>" for title, _ in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape('' if r.get(k) is None else str(r.get(k)))}</td>" for _, k in columns) + "</tr>"
        for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _secs(ms: int | None) -> str:
    return "" if ms is None else f"{ms / 1000:.1f}s"


def render_page(state: dict[str, Any], *, refresh_s: int = 1) -> str:
    """The status page: a plain server-rendered table page that reloads itself every
    ``refresh_s`` seconds (no scripts, so it works in any browser and in a headless
    screenshot; 0: no reload, for a capture that must not race one)."""
    rates = state.get("rates", {})
    leases = state.get("leases") or {}
    transfers = state.get("transfers") or {}
    leader = ", ".join(f"{k}: {'leader' if v else 'standby'}" for k, v in state.get("leader", {}).items())
    cards = [
        ("engines", len(state.get("engines", []))),
        ("pending transfers", transfers.get("total", "–")),
        ("active leases", leases.get("active", "–")),
        ("draining leases", leases.get("draining", "–")),
        ("matches/s", f"{rates.get('matches_per_s', 0):.1f}"),
        ("renewals/s", f"{rates.get('renewals_per_s', 0):.1f}"),
        ("renewal writes/s", f"{rates.get('renewal_writes_per_s', 0):.1f}"),
        ("KV MiB/s", f"{rates.get('bytes_per_s', 0) / 2**20:.1f}"),
        ("shed/s", f"{rates.get('shed_per_s', 0):.1f}"),
    ]
    card_html = "".join(f'<div class="card"><b>{html.escape(str(v))}</b><small>{html.escape(k)}</small></div>'
                        for k, v in cards)
    errors = "".join(f'<div class="err">{html.escape(e)}</div>' for e in state.get("errors", []))
    engines = [dict(e, labels=" ".join(f"{k}={v}" for k, v in sorted(e["labels"].items())),
                    rank=f"{e['ranks']}/{e['tp_size']}") for e in state.get("engines", [])]
    trows = [dict(t, age=_secs(t["age_ms"]), deadline=_secs(t["deadline_in_ms"])) for t in transfers.get("items", [])]
    lrows = [dict(lr, remaining=_secs(lr["remaining_ms"]), ttl=_secs(lr["ttl_ms"])) for lr in leases.get("expiring_soonest", [])]
    retained = [{"engine": k, "blocks": v} for k, v in sorted(leases.get("retained_blocks", {}).items())]
    totals = state.get("totals", {})
    key_totals = [{"counter": k, "value": f"{v:g}"} for k, v in totals.items()
                  if k.startswith(("rendezvous_", "transfers", "transfer_bytes", "lease_", "engine_"))]
    sections = [
        "<h2>Engines</h2>" + _table(engines, [("ENGINE", "engine_id"), ("ROLE", "role"), ("RANKS", "rank"),
                                              ("BLOCKS", "num_blocks"), ("TOK/BLK", "tokens_per_block"),
                                              ("DEVICE", "device"), ("LABELS", "labels")], "no engines registered"),
    ]
    if state.get("transfers") is not None:
        sections.append("<h2>Pending transfers (oldest first)</h2>" + _table(
            trows, [("TRANSFER", "transfer_id"), ("ATT", "attempt"), ("PHASE", "phase"), ("DECODE", "decode"),
                    ("PREFILL", "prefill"), ("BLOCKS", "blocks"), ("AGE", "age"), ("EXPIRES IN", "deadline"),
                    ("OUTCOMES", "outcomes")], "no pending transfers"))
    if state.get("leases") is not None:
        sections.append("<h2>Leases expiring soonest</h2>" + _table(
            lrows, [("CONVERSATION", "conversation_id"), ("LEASE", "lease_id"), ("ENGINE", "engine_id"),
                    ("STATE", "state"), ("REMAINING", "remaining"), ("TTL", "ttl"), ("PINS", "pins"),
                    ("BLOCKS", "blocks"), ("RENEWALS", "renewals")], "no live leases"))
        sections.append("<h2>Retained blocks per engine</h2>" + _table(
            retained, [("ENGINE", "engine"), ("BLOCKS", "blocks")], "nothing retained"))
    sections.append("<h2>Counters (this replica)</h2>" + _table(
        key_totals, [("COUNTER", "counter"), ("VALUE", "value")], "no traffic yet"))
    when = time.strftime("%H:%M:%S", time.localtime(state.get("time_ms", 0) / 1000))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">{f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ''}
<title>kvbaton control plane</title><style>{_CSS}</style></head>
<body><header><h1>kvbaton</h1><span>{html.escape(state.get('address', ''))}</span>
<span>store {html.escape(state.get('store', ''))}</span><span>{html.escape(', '.join(state.get('services', [])))}</span>
<span>{html.escape(leader)}</span><span>{when}</span></header>
<main>{errors}<div class="cards">{card_html}</div>{''.join(sections)}</main></body></html>
"""
