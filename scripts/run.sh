#!/usr/bin/env bash
# The main job on the embedded default (README's first command): set-up, then a fleet —
# control plane + 2 prefill and 2 decode vLLM engines with the kvbaton connector + a router
# that discovers them — driven through an agent conversation (kvbaton.fleet_demo).
#   bash scripts/run.sh --mode push --decodes 1      (arguments go to kvbaton.fleet_demo)
# The one-pair walk-through: .venv/bin/python -m kvbaton.pd_demo
# The control-plane-only walk-through, no model or vLLM: .venv/bin/python -m kvbaton.demo
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m kvbaton.fleet_demo "$@"
