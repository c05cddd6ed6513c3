#!/usr/bin/env bash
# Reproduction runs of the session-20 e2e regression (q-regress, session 21): pytest on the
# given tests with NLOAD busy-loop processes at normal priority for the duration, xfail marks
# ignored (--runxfail), each run's stack logs kept under /tmp/qregress/TAG/tmp.
# Run it under the heavy lock: flock /tmp/kvbaton-heavy.lock tools/qregress_repro.sh TAG NLOAD TESTS...
set -u
tag=$1; nload=$2; shift 2
cd "$(dirname "$0")/.."
out=/tmp/qregress/$tag; rm -rf "$out"; mkdir -p "$out"
pids=()
for _ in $(seq 1 "$nload"); do ( while :; do :; done ) & pids+=($!); done
echo "load before: $(cat /proc/loadavg) busy=$nload commit=$(git rev-parse --short HEAD)" > "$out/info.txt"
timeout 1500 .venv/bin/python -m pytest -q -p no:cacheprovider --runxfail --basetemp="$out/tmp" "$@" > "$out/pytest.log" 2>&1
rc=$?
for p in "${pids[@]}"; do kill "$p"; done
echo "load after: $(cat /proc/loadavg) rc=$rc" >> "$out/info.txt"
tail -5 "$out/pytest.log"; cat "$out/info.txt"
