"""``python -m kvbaton.services.router [--prefill [ID=]URL ...] [--decode [ID=]URL ...] --mode pull|push --port P
[--control-plane H:P [--no-discover]] [--slack N] [--load-poll-s S] [--role-wait-s S] [--role-wait-max N]
[--otlp-endpoint URL] [--tls-ca F --tls-cert F --tls-key F --token T | --token-file F]``.

Engines: every ``--prefill`` / ``--decode`` given (repeatable; ``ID=URL`` names the engine
as it registers, so the router can tell which URL holds a conversation's KV) and, with a
control plane, every engine registered there with a ``serve_url`` (followed live).

Push transfers are bound to the chosen pair by the engines' registered ids (discovered, or
``ID=URL``; ``--prefill-engine-id``/``--decode-engine-id`` name a one-pair router's engines):
the control plane matches a transfer only between the two (README "Security").
"""

from __future__ import annotations

import argparse
import logging
import os

from aiohttp import web

from kvbaton import security
from kvbaton.services import tracing

from .app import build_app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kvbaton-router", description=__doc__)
    ap.add_argument("--prefill", action="append", default=[], metavar="[ID=]URL",
                    help="a prefill engine's base URL (repeatable)")
    ap.add_argument("--decode", action="append", default=[], metavar="[ID=]URL",
                    help="a decode engine's base URL (repeatable)")
    ap.add_argument("--no-discover", action="store_true",
                    help="with a control plane: route over the static lists only (no registrar watch)")
    ap.add_argument("--slack", type=int, default=4,
                    help="keep a conversation on the decode holding its KV unless that engine has more than "
                         "this many requests beyond the least loaded decode (default 4)")
    ap.add_argument("--suspect-s", type=float, default=5.0,
                    help="after a transport error, send an engine nothing new for this long (default 5)")
    ap.add_argument("--load-poll-s", type=float, default=0.0,
                    help="every this many seconds read each engine's running + waiting requests from its "
                         "/metrics, so that load other routers put on it counts too (default 0: off, "
                         "this router's own counts only)")
    ap.add_argument("--retain-wait-s", type=float, default=5.0,
                    help="hold a conversational turn's answer until decode's retention of it is leased, at most "
                         "this long, so that the client's next turn or revoke comes after it (default 5; 0: off)")
    ap.add_argument("--role-wait-s", type=float, default=5.0,
                    help="a request that finds no routable engine of a role (all re-registering at once, say) "
                         "waits this long for one, woken by the fleet view changing, then gets 503 with "
                         "Retry-After (default 5; 0: 503 at once)")
    ap.add_argument("--role-wait-max", type=int, default=256,
                    help="at most this many requests wait for an engine at once; past that, 503 at once "
                         "(default 256)")
    ap.add_argument("--no-retry", action="store_true",
                    help="do not re-send a request whose engine failed before answering")
    ap.add_argument("--mode", choices=("pull", "push"), default="pull")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--control-plane", default=None,
                    help="kvbaton control plane host:port, for conversation reuse (default: $KVBATON_CONTROL_PLANE)")
    ap.add_argument("--otlp-endpoint", default=None,
                    help=f"send OpenTelemetry traces to this OTLP/gRPC collector, e.g. http://otel:4317 "
                         f"(default: ${tracing.ENV_ENDPOINT}; unset: tracing off)")
    ap.add_argument("--prefill-engine-id", default=None,
                    help="the prefill engine's kvbaton engine_id (default: $KVBATON_PREFILL_ENGINE_ID); with "
                         "--decode-engine-id, push transfers are bound to the pair")
    ap.add_argument("--decode-engine-id", default=None,
                    help="the decode engine's kvbaton engine_id (default: $KVBATON_DECODE_ENGINE_ID)")
    security.add_client_flags(ap)
    args = ap.parse_args(argv)
    try:
        creds = security.from_args(args)
    except ValueError as exc:
        ap.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if tracing.configure(args.otlp_endpoint, service_name="kvbaton-router"):
        logging.getLogger("kvbaton.router").info("tracing: OTLP spans to %s",
                                                 args.otlp_endpoint or f"${tracing.ENV_ENDPOINT}")
    try:
        discover = False if args.no_discover else None
        if not (args.prefill and args.decode) and not (args.control_plane or os.environ.get("KVBATON_CONTROL_PLANE")):
            ap.error("give --prefill and --decode engines, or --control-plane to discover them")
        web.run_app(build_app(args.prefill, args.decode, args.mode, control_plane=args.control_plane,
                              discover=discover, slack=args.slack, suspect_s=args.suspect_s,
                              retry=not args.no_retry, security=creds, load_poll_s=args.load_poll_s,
                              retain_wait_s=args.retain_wait_s, role_wait_s=args.role_wait_s,
                              role_wait_max=args.role_wait_max,
                              prefill_engine_id=args.prefill_engine_id, decode_engine_id=args.decode_engine_id),
                    host=args.host, port=args.port, print=None, access_log=None)
    finally:
        tracing.shutdown()  # flush the last spans


if __name__ == "__main__":
    main()
