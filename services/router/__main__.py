"""``python -m kvbaton.services.router --prefill URL --decode URL --mode pull|push --port P [--control-plane H:P]``."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    web.run_app(build_app(args.prefill, args.decode, args.mode, control_plane=args.control_plane), host=args.host, port=args.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
