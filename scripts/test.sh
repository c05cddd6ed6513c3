#!/usr/bin/env bash
# The test command (README, .ci/run): does all of its own set-up on a fresh machine —
# Debian's etcd-server and Chromium, the venv with vLLM/torch/NIXL and kvbaton — then the static
# checks (scripts/lint.sh: ruff, mypy, import contracts), then the suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k lease).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_etcd.sh
bash scripts/ensure_chromium.sh
bash scripts/bootstrap.sh
.venv/bin/python -m kvbaton.protogen --check
bash scripts/lint.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
