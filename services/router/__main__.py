"""``python -m kvbaton.services.router --prefill URL --decode URL --mode pull|push --port P [--control-plane H:P]
[--otlp-endpoint URL]``."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if tracing.configure(args.otlp_endpoint, service_name="kvbaton-router"):
        logging.getLogger("kvbaton.router").info("tracing: OTLP spans to %s",
                                                 args.otlp_endpoint or f"${tracing.ENV_ENDPOINT}")
    try:
        web.run_app(build_app(args.prefill, args.decode, args.mode, control_plane=args.control_plane),
                    host=args.host, port=args.port, print=None, access_log=None)
    finally:
        tracing.shutdown()  # flush the last spans


if __name__ == "__main__":
    main()
