"""The ``kvbaton`` command: run the services, and look at / act on what they hold.

    kvbaton serve [registrar|rendezvous|lease ...] [--listen H:P] [--store URL]
    kvbaton leases list|get|revoke|watch ...      kvbaton engines list | drain ENGINE [--undo]
    kvbaton transfers list                         (human tables, or --json)
    kvbaton top [--metrics URL] [--once]           a live view (engines, transfers, leases, rates)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from kvbaton import security

DEFAULT_ADDR = "127.0.0.1:50051"


def _dump(msg) -> dict:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)] if rows else [len(h) for h in headers]

    def line(r: list[str]) -> str:
        return "  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def _ms(ms: int) -> str:
    return f"{ms / 1000:.1f}s" if ms < 600_000 else f"{ms / 60_000:.0f}m"


def _enum(name: str, prefix: str) -> str:
    return name.removeprefix(prefix).lower()


def _lease_rows(leases) -> list[list[str]]:
    from kvbaton.v1 import lease_pb2

    return [[ls.conversation_id, ls.lease_id, ls.engine_id, _enum(lease_pb2.LeaseState.Name(ls.state), "LEASE_STATE_"),
             _ms(ls.remaining_ms), str(len(ls.pins)), str(ls.num_blocks), _renewals(ls), ls.reason] for ls in leases]


def _renewals(ls) -> str:
    """The record's renewal count, marked when the deadline shown comes from the renewal
    journal (renewed since the record was written; those renewals are not counted)."""
    return f"{ls.renewals}+journal" if ls.deadline_journaled else str(ls.renewals)


LEASE_HEADERS = ["CONVERSATION", "LEASE", "ENGINE", "STATE", "REMAINING", "PINS", "BLOCKS", "RENEWALS", "REASON"]


async def _leases(args) -> int:
    from kvbaton.v1 import lease_pb2

    async with _client(args) as kv:
        if args.action == "list":
            states = ["LEASE_STATE_" + s.upper() for s in args.state]  # enum names: protobuf checks them
            leases = await kv.list_leases(engine_id=args.engine or "", states=states,
                                          expiring_within_ms=int(args.expiring_within * 1000), limit=args.limit)
            if args.json:
                print(json.dumps([_dump(ls) for ls in leases], indent=2))
            else:
                print(_table(_lease_rows(leases), LEASE_HEADERS))
        elif args.action == "get":
            info = await kv.call(kv.lease.Get, lease_pb2.GetLeaseRequest(conversation_id=args.conversation))
            print(json.dumps(_dump(info), indent=2) if args.json else _table(_lease_rows([info]), LEASE_HEADERS))
        elif args.action == "revoke":
            info = await kv.call(kv.lease.Revoke, lease_pb2.RevokeRequest(
                conversation_id=args.conversation, reason=args.reason))
            print(json.dumps(_dump(info), indent=2) if args.json else _table(_lease_rows([info]), LEASE_HEADERS))
        elif args.action == "watch":
            deadline = time.monotonic() + args.for_s if args.for_s else None
            async def consume() -> None:
                async for ev in kv.watch_leases(args.engine or "", snapshot=True):
                    kind = _enum(lease_pb2.LeaseEvent.Type.Name(ev.type), "TYPE_")
                    if args.json:
                        print(json.dumps({"type": kind, **_dump(ev.lease)}), flush=True)
                    else:
                        ls = ev.lease
                        print(f"{kind:9} {ls.conversation_id} lease={ls.lease_id} engine={ls.engine_id} "
                              f"remaining={_ms(ls.remaining_ms)} {ls.reason}".rstrip(), flush=True)
            try:
                await asyncio.wait_for(consume(), None if deadline is None else max(deadline - time.monotonic(), 0.01))
            except TimeoutError:
                pass
    return 0


async def _drain(args) -> int:
    """Stop new work to an engine, let its in-flight transfers finish (bounded by
    ``--wait``), then end its retained conversations (their leases are revoked; a lease a
    reader still pins ends when the read is done, and the engine frees the blocks)."""
    from kvbaton.v1 import lease_pb2, registrar_pb2, rendezvous_pb2

    async with _client(args) as kv:
        resp = await kv.call(kv.registrar.DrainEngine, registrar_pb2.DrainEngineRequest(
            engine_id=args.engine, undo=args.undo, reason=args.reason))
        out: dict = {"engine_id": args.engine, "draining": not args.undo, "ranks": len(resp.ranks)}
        if not args.undo:
            pending = [rendezvous_pb2.TRANSFER_PHASE_OFFERED, rendezvous_pb2.TRANSFER_PHASE_COMPLETED,
                       rendezvous_pb2.TRANSFER_PHASE_MATCHED]
            deadline = time.monotonic() + args.wait
            while True:
                inflight = await kv.list_transfers(phases=pending, engine_id=args.engine)
                if not inflight or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.2)
            out["in_flight_left"] = len(inflight)
            leases = await kv.list_leases(engine_id=args.engine)
            for info in leases:
                await kv.call(kv.lease.Revoke, lease_pb2.RevokeRequest(
                    conversation_id=info.conversation_id, lease_id=info.lease_id,
                    reason=f"engine {args.engine} drained" + (f": {args.reason}" if args.reason else "")))
            out["conversations_released"] = len(leases)
        if args.json:
            print(json.dumps(out))
        else:
            print(f"engine {args.engine}: " + ("draining" if not args.undo else "takes new work again")
                  + f" ({out['ranks']} ranks registered)")
            if not args.undo:
                print(f"  in-flight transfers left after {args.wait:g}s: {out['in_flight_left']}; "
                      f"conversations released: {out['conversations_released']}")
    return 0


async def _engines(args) -> int:
    from kvbaton.v1 import common_pb2

    if args.action == "drain":
        return await _drain(args)
    async with _client(args) as kv:
        ranks = await kv.list_engines()
        if args.json:
            out = []
            for r in ranks:
                d = _dump(r)
                d.pop("agent_metadata", None)
                d["agent_metadata_bytes"] = len(r.agent_metadata)
                out.append(d)
            print(json.dumps(out, indent=2))
        else:
            rows = [[r.engine_id, _enum(common_pb2.EngineRole.Name(r.role), "ENGINE_ROLE_"), f"{r.tp_rank}/{r.tp_size}",
                     _kv_heads(r), r.agent_name, str(r.geometry.num_blocks), str(r.geometry.tokens_per_block),
                     f"{r.geometry.bytes_per_block * len(r.geometry.region_base_addrs) * r.geometry.num_blocks / 2**20:.1f}",
                     r.geometry.device or "?", r.geometry.fingerprint[:16], r.serve_url or "-",
                     "draining" if r.draining else "serving"] for r in ranks]
            print(_table(rows, ["ENGINE", "ROLE", "RANK", "KV_HEADS", "AGENT", "BLOCKS", "TOK/BLK", "KV_MIB", "DEVICE",
                                "FINGERPRINT", "URL", "STATE"]))
    return 0


def _kv_heads(rank) -> str:
    """The KV heads a rank holds, e.g. ``2-3/8`` (of the model's 8), ``?`` when unpublished."""
    from kvbaton.kvgeometry import KvIncompatible, rank_heads

    total = rank.geometry.total_kv_heads
    if not total:
        return "?"
    try:
        heads = rank_heads(rank.tp_size, total, rank.tp_rank)
    except (KvIncompatible, ValueError):
        return f"!/{total}"
    first, last = heads.start, heads.stop - 1
    return f"{first}/{total}" if first == last else f"{first}-{last}/{total}"


async def _transfers(args) -> int:
    from kvbaton.v1 import rendezvous_pb2

    async with _client(args) as kv:
        phases = ["TRANSFER_PHASE_" + p.upper() for p in args.phase]  # enum names: protobuf checks them
        transfers = await kv.list_transfers(phases=phases, engine_id=args.engine or "", limit=args.limit)
        if args.json:
            print(json.dumps([_dump(t) for t in transfers], indent=2))
        else:
            now = int(time.time() * 1000)
            rows = [[t.transfer_id, str(t.attempt),
                     _enum(rendezvous_pb2.TransferKind.Name(t.kind or rendezvous_pb2.TRANSFER_KIND_PUSH), "TRANSFER_KIND_"),
                     _enum(rendezvous_pb2.TransferPhase.Name(t.phase), "TRANSFER_PHASE_"),
                     t.offer.engine_id or "-", str(len(t.offer.block_ids)), t.completion.engine_id or "-",
                     str(len(t.completion.block_ids)), str(sum(o.bytes for o in t.outcomes)),
                     _ms(max(now - t.updated_at_ms, 0)), t.reason]
                    for t in transfers]
            print(_table(rows, ["TRANSFER", "ATT", "KIND", "PHASE", "DECODE", "D_BLK", "PREFILL", "P_BLK", "BYTES", "AGE",
                                "REASON"]))
    return 0


def _client(args):
    """A client from the common flags: --addr, --timeout, --tls-* and --token[-file]
    (each falling back to its $KVBATON_* variable; kvbaton/security.py)."""
    return security.from_args(args).client(args.addr, timeout_s=args.timeout)


def loop_runner(choice: str) -> Any:
    """What runs the server's main coroutine for ``--event-loop``: uvloop's ``run`` for
    "uvloop" and, where uvloop imports, for "auto"; else ``asyncio.run`` ("asyncio", or
    "auto" without uvloop). None: "uvloop" asked for and not installed."""
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            return None if choice == "uvloop" else asyncio.run
        return uvloop.run
    return asyncio.run


def _gc_threshold(text: str) -> tuple[int, int, int]:
    """``--gc-threshold``: three numbers, checked by services/gc_policy.py."""
    from kvbaton.services import gc_policy

    try:
        return gc_policy.parse_threshold(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _gc_help() -> str:
    from kvbaton.services import gc_policy

    default, cpython = (",".join(map(str, t)) for t in (gc_policy.SERVE_THRESHOLD, gc_policy.CPYTHON_THRESHOLD))
    return (f"the garbage collector's thresholds (gc.set_threshold) for the server process; default {default} "
            f"(why: services/gc_policy.py); CPython's own: {cpython}")


def _serve(args) -> int:
    from kvbaton import logs
    from kvbaton.services.server import ALL_SERVICES, ServerConfig, serve

    logs.configure(args.log_level)
    services = args.services or list(ALL_SERVICES)
    config = ServerConfig(address=args.listen, store_url=args.store, services=services,
                          etcd_ca=args.etcd_ca or "", etcd_cert=args.etcd_cert or "", etcd_key=args.etcd_key or "",
                          tls_cert=args.tls_cert or "", tls_key=args.tls_key or "", tls_client_ca=args.tls_client_ca or "",
                          insecure=args.insecure, tokens_file=args.tokens or "", rate_limit=args.rate_limit,
                          max_streams_per_client=args.max_streams_per_client, otlp_endpoint=args.otlp_endpoint,
                          shed_lag_ms=args.shed_lag_ms)
    if args.gc_threshold is not None:
        config.gc_threshold = args.gc_threshold
    config.lease.default_ttl_ms = args.default_lease_ttl_ms
    # /metrics and the status page listen on the gRPC address's host: loopback by
    # default, every interface when --listen is 0.0.0.0 (containers).
    host = args.listen.rsplit(":", 1)[0] or "0.0.0.0"
    if args.metrics_port is not None:
        config.metrics_address = f"{host}:{args.metrics_port}"
    if args.web_port is not None:
        config.web_address = f"{host}:{args.web_port}"
    run = loop_runner(args.event_loop)
    if run is None:
        print("kvbaton serve: --event-loop uvloop needs the uvloop package (pip install uvloop)", file=sys.stderr)
        return 2
    try:
        run(serve(config))
    except KeyboardInterrupt:
        pass
    except (ValueError, OSError) as exc:  # bad configuration: say what, not a traceback
        print(f"kvbaton serve: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbaton", description="KV-cache hand-off control plane for disaggregated vLLM")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the services (all in one process by default)")
    s.add_argument("services", nargs="*", default=[],
                   help="which services (default: all three)")
    s.add_argument("--listen", default=DEFAULT_ADDR, help="host:port to listen on (default %(default)s)")
    s.add_argument("--store", default="memory://",
                   help="memory:// (default), etcd://host:port[,host:port...] or etcds://... (TLS)")
    s.add_argument("--etcd-ca", help="CA that signed etcd's certificate: TLS to etcd (default $KVBATON_ETCD_CA)")
    s.add_argument("--etcd-cert", help="client certificate for etcd --client-cert-auth (default $KVBATON_ETCD_CERT)")
    s.add_argument("--etcd-key", help="client key for etcd (default $KVBATON_ETCD_KEY)")
    s.add_argument("--tls-cert", help="server certificate (PEM)")
    s.add_argument("--tls-key", help="server private key (PEM)")
    s.add_argument("--tls-client-ca", help="CA for client certificates: turns on mutual TLS")
    s.add_argument("--insecure", action="store_true", help="serve plaintext (no TLS); logged loudly")
    s.add_argument("--tokens", help="bearer-token file (JSON) enabling authorization; see services/auth.py")
    s.add_argument("--rate-limit", type=float, default=0.0, help="requests/s per client (0: off)")
    s.add_argument("--max-streams-per-client", type=int, default=256)
    s.add_argument("--default-lease-ttl-ms", type=int, default=30_000)
    s.add_argument("--event-loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                   help="the server's event loop: uvloop costs less CPU per call (the uvloop package, installed "
                        "with kvbaton on Linux and macOS); auto (default): uvloop where importable, else asyncio")
    s.add_argument("--shed-lag-ms", type=float, default=20.0,
                   help="refuse new transfers (RESOURCE_EXHAUSTED) while the server's event loop runs more than "
                        "this many ms behind; 0: never (default %(default)s)")
    s.add_argument("--gc-threshold", type=_gc_threshold, default=None, metavar="GEN0,GEN1,GEN2",
                   help=_gc_help())
    s.add_argument("--log-level", default=None)
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics (and the status page, /api/state) on this port (default: off; 9464 is usual)")
    s.add_argument("--web-port", type=int, default=None,
                   help="serve the status page and /api/state on a separate port (default: with /metrics)")
    s.add_argument("--otlp-endpoint", default=None,
                   help="send OpenTelemetry traces to this OTLP/gRPC collector, e.g. http://otel:4317 "
                        "(default: $KVBATON_OTLP_ENDPOINT; unset: tracing off)")
    s.set_defaults(func=_serve)

    def client_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--addr", default=DEFAULT_ADDR, help="control plane address(es), comma separated")
        sp.add_argument("--json", action="store_true", help="JSON instead of a table")
        sp.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
        security.add_client_flags(sp)

    lp = sub.add_parser("leases", help="decode-side leases")
    lsub = lp.add_subparsers(dest="action", required=True)
    ll = lsub.add_parser("list")
    client_args(ll)
    ll.add_argument("--engine")
    ll.add_argument("--state", action="append", default=[], choices=["active", "draining", "expired", "revoked"])
    ll.add_argument("--expiring-within", type=float, default=0, help="seconds")
    ll.add_argument("--limit", type=int, default=0)
    for name in ("get", "revoke"):
        lp = lsub.add_parser(name)
        client_args(lp)
        lp.add_argument("conversation")
        if name == "revoke":
            lp.add_argument("--reason", default="revoked by operator")
    lw = lsub.add_parser("watch")
    client_args(lw)
    lw.add_argument("--engine")
    lw.add_argument("--for", dest="for_s", type=float, default=0, help="stop after this many seconds")
    lp.set_defaults(func=lambda a: asyncio.run(_leases(a)))

    e = sub.add_parser("engines", help="registered engines")
    esub = e.add_subparsers(dest="action", required=True)
    client_args(esub.add_parser("list"))
    ed = esub.add_parser("drain", help="stop new work to an engine, let in-flight finish, release its conversations")
    client_args(ed)
    ed.add_argument("engine")
    ed.add_argument("--undo", action="store_true", help="end the drain: the engine takes new work again")
    ed.add_argument("--reason", default="", help="shown with the drain")
    ed.add_argument("--wait", type=float, default=30.0,
                    help="seconds to wait for the engine's in-flight transfers before releasing (default 30)")
    e.set_defaults(func=lambda a: asyncio.run(_engines(a)))

    t = sub.add_parser("transfers", help="pending and recent transfers")
    tsub = t.add_subparsers(dest="action", required=True)
    tl = tsub.add_parser("list")
    client_args(tl)
    tl.add_argument("--engine")
    tl.add_argument("--phase", action="append", default=[],
                    choices=["offered", "completed", "matched", "succeeded", "failed", "expired", "cancelled"])
    tl.add_argument("--limit", type=int, default=0)
    t.set_defaults(func=lambda a: asyncio.run(_transfers(a)))

    tp = sub.add_parser("top", help="live view: engines, pending transfers, leases expiring soonest, rates")
    tp.add_argument("--addr", default=DEFAULT_ADDR, help="control plane address(es), comma separated")
    tp.add_argument("--metrics", default="", help="/metrics URL(s) of the replicas, comma separated (for rates)")
    tp.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default %(default)s)")
    tp.add_argument("--once", action="store_true", help="print one frame and exit (rates over one interval)")
    tp.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    security.add_client_flags(tp)
    tp.set_defaults(func=_top)
    return p


def _top(args) -> int:
    from kvbaton import top

    try:
        async def go() -> int:
            return await top.run(args.addr, [u for u in args.metrics.split(",") if u], interval_s=args.interval,
                                 once=args.once, timeout_s=args.timeout, client=_client(args))
        return asyncio.run(go())
    except KeyboardInterrupt:
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except grpc.aio.AioRpcError as exc:
        print(f"kvbaton: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    except ValueError as exc:  # half-configured TLS / token flags: say what, not a traceback
        print(f"kvbaton: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
