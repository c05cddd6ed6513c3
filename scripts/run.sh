#!/usr/bin/env bash
# The main job on the embedded default (README's first command): set-up, then the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m kvbaton.demo "$@"
