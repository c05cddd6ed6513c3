#!/usr/bin/env bash
# The device-machine form of run_gpu.sh when only a carried folder travels: the runner sends a
# checkout whose ignored .dev_i15/ holds kvbaton/ (with connector/ inside), benchmarks/datapath*.py,
# tests/connector/test_staging*.py, pyproject.toml, COMMIT and this script; wheels_gpu/ holds
# nixl + nixl-cu13 + pytest wheels. From the checkout root, results under $OUT:
#   bash .dev_i15/run_gpu_carry.sh [tests|bench|both|mps] [datapath_gpu.py args...]
# "mps": the benchmark only, with both engines' processes as clients of one CUDA MPS server
# (started here, stopped at the end: the GPU's own settings are untouched), results in
# $OUT/datapath_gpu_mps.json. Without MPS two processes on one GPU time-slice it.
set -uo pipefail
what=${1:-both}; shift || true
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site wheels_gpu/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/.dev_i15 PYTHONUNBUFFERED=1
cd .dev_i15
C=$(cat COMMIT)
uptime >> "$OUT/load.txt"; nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv >> "$OUT/load.txt" 2>&1
if [ "$what" = tests ] || [ "$what" = both ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -p no:cacheprovider -q -rs -m "gpu or not nixl" \
    tests/connector/test_staging_gpu.py tests/connector/test_staging.py tests/connector/test_staging_grants.py > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/tests.log"
fi
name=datapath_gpu
if [ "$what" = mps ]; then
  name=datapath_gpu_mps
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/kvb-mps CUDA_MPS_LOG_DIRECTORY=/tmp/kvb-mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d || { echo "MPS did not start"; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  set -- "$@" --label "both engines under CUDA MPS"
fi
if [ "$what" != tests ]; then
  timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/datapath_gpu.py --commit "$C" --out "$OUT/$name.json" "$@" 2>&1 | grep -v "NIXL INFO" > "$OUT/$name.log"
  echo "$name rc=${PIPESTATUS[0]}"; tail -3 "$OUT/$name.log"
fi
uptime >> "$OUT/load.txt"
