"""``python -m kvbaton.services.router --prefill URL --decode URL --mode pull|push --port P [--control-plane H:P]
[--otlp-endpoint URL] [--prefill-engine-id ID --decode-engine-id ID] [--tls-ca F --tls-cert F --tls-key F
--token T | --token-file F]``.

The engine ids bind push transfers: the router names the decode to prefill and the
prefill to decode, and the control plane matches a transfer only between the two
(README "Security")."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from kvbaton import security
from kvbaton.services import tracing

from .app import build_app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kvbaton-router", description=__doc__)
    ap.add_argument("--prefill", required=True, help="prefill engine base URL")
    ap.add_argument("--decode", required=True, help="decode engine base URL")
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
        web.run_app(build_app(args.prefill, args.decode, args.mode, control_plane=args.control_plane,
                              security=creds, prefill_engine_id=args.prefill_engine_id,
                              decode_engine_id=args.decode_engine_id),
                    host=args.host, port=args.port, print=None, access_log=None)
    finally:
        tracing.shutdown()  # flush the last spans


if __name__ == "__main__":
    main()
