#!/usr/bin/env bash
# Issue 14: P2 -> D2 push with the TP > 1 long idle steps (shipped) and without them
# (tp_idle_wait_max_ms 0: the 2 ms steps of before), one after the other in one lock hold.
# Usage (heavy): flock /tmp/kvbaton-heavy.lock nice -n 19 bash tools/tp_spin_ab.sh OUT.log [MODE]
set -u
out=$1; mode=${2:-push}
py=.venv/bin/python
{
  echo "# tools/tp_spin_ab.sh, commit $(git rev-parse --short HEAD), $(date -u +%FT%TZ), mode $mode"
  for arm in on off on; do
    extra='{}'; [ "$arm" = off ] && extra='{"tp_idle_wait_max_ms": 0}'
    echo "## arm $arm: KVBATON_TP_EXTRA=$extra; load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    t0=$(date +%s)
    KVBATON_TP_EXTRA=$extra timeout 600 $py tools/tp_spin_probe.py --mode "$mode" --requests 4 --delay 0.3 \
      --window 1.5 --work /tmp/kvbaton-tp-spin-$arm 2>&1 | grep -E "^(up|request|CPU all|idle_wait|recv_done|send_failed)"
    echo "## arm $arm: rc ${PIPESTATUS[0]}, $(( $(date +%s) - t0 )) s; load after: $(cut -d' ' -f1-3 /proc/loadavg)"
  done
} > "$out" 2>&1
