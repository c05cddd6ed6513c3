#!/usr/bin/env bash
# GPU tests of the pack path + benchmarks/datapath_gpu.py from a plain checkout on a GPU
# machine (nothing installed: kvbaton.connector is mapped onto connector/ through a
# temporary package dir; nixl must be importable). Logs and results go to $OUT.
#   OUT=/tmp/out bash benchmarks/run_gpu.sh [--tests-only] [datapath_gpu.py args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvb-gpu-out}
mkdir -p "$OUT"
# kvbaton.connector is connector/ (pyproject's package-dir); map it for this run only
made=""
if [ ! -e kvbaton/connector ]; then ln -s ../connector kvbaton/connector && made=1; fi
trap '[ -n "$made" ] && rm -f kvbaton/connector' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# (the host-memory NIXL tests pin UCX to tcp on "lo", which GPU images may lack: CI runs those)
timeout "${TEST_TIMEOUT:-600}" python3 -m pytest --noconftest -p no:cacheprovider -v -rs -m "gpu or not nixl" \
  tests/connector/test_staging_gpu.py tests/connector/test_staging.py tests/connector/test_staging_grants.py 2>&1 | tee "$OUT/tests.log"
[ "${1:-}" = "--tests-only" ] && exit 0
timeout "${BENCH_TIMEOUT:-3600}" python3 benchmarks/datapath_gpu.py --out "$OUT/datapath_gpu.json" "$@" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/bench.log"
