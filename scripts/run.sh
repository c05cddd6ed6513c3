#!/usr/bin/env bash
# The main job on the embedded default (README's first command): set-up, then a real P/D
# hand-off — control plane + prefill and decode vLLM engines with the kvbaton connector +
# router — driven through a short multi-turn chat (kvbaton.pd_demo, push mode by default).
#   bash scripts/run.sh --mode pull      (arguments go to kvbaton.pd_demo)
# The control-plane-only walk-through, no model or vLLM: .venv/bin/python -m kvbaton.demo
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m kvbaton.pd_demo "$@"
