"""Where a match's time goes on etcd: etcd requests, raft proposals and WAL fsyncs per match.

Starts an etcd cluster on loopback (``kvbaton/stack/etcd_cluster.py``: fsync ON, the
flags the tests use — no ``--unsafe-no-fsync``), runs the open-loop benchmark
(``benchmarks/control_plane.py``) against it, and diffs etcd's own Prometheus counters
(``/metrics`` of every member) around the run: gRPC requests handled by method, watch
messages sent, proposals committed, WAL fsyncs (count and seconds) and backend commits.
Per-match figures divide by the matches the benchmark saw.

    flock /tmp/kvbaton-heavy.lock .venv/bin/python benchmarks/etcd_requests.py [--members 3] [--rate 250] \
        [--path session] [--seconds 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.control_plane import git_commit
from kvbaton.stack.etcd_cluster import EtcdCluster

_COUNTERS = ("etcd_server_proposals_committed_total", "etcd_disk_wal_fsync_duration_seconds_count",
             "etcd_disk_wal_fsync_duration_seconds_sum", "etcd_disk_backend_commit_duration_seconds_count")


def scrape(cluster: EtcdCluster) -> dict[str, float]:
    """Summed over members: grpc handled/sent by method, and the raft/disk counters."""
    out: collections.Counter[str] = collections.Counter()
    for m in cluster.members:
        text = urllib.request.urlopen(f"http://{m.endpoint}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if line.startswith(("grpc_server_handled_total{", "grpc_server_msg_sent_total{")):
                method = re.search(r'grpc_method="(\w+)"', name)
                kind = name.split("{", 1)[0].removeprefix("grpc_server_")
                if method:
                    out[f"{kind}.{method.group(1)}"] += float(value)
            elif name in _COUNTERS:
                out[name] += float(value)
    return dict(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--rate", type=float, default=250.0)
    p.add_argument("--path", default="session", choices=("unary", "session"))
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "etcd_requests.json"))
    args = p.parse_args()
    result: dict = {"script": "benchmarks/etcd_requests.py", "argv": sys.argv[1:], "commit": git_commit(),
                    "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": f"{os.cpu_count()} cores",
                    "config": {k: v for k, v in vars(args).items() if k != "out"},
                    "etcd_flags": "kvbaton/stack/etcd_cluster.py defaults: fsync on (no --unsafe-no-fsync), "
                                  "--max-txn-ops 10000, --heartbeat-interval 50, --election-timeout 500",
                    "loadavg_at_start": list(os.getloadavg())}
    cluster = EtcdCluster(args.members).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bench_out = pathlib.Path(tmp) / "control_plane.json"
            before = scrape(cluster)
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "control_plane.py"), "--store", cluster.url,
                            "--path", args.path, "--rate", str(args.rate), "--seconds", str(args.seconds), "--grace", "2",
                            "--out", str(bench_out)], check=True, timeout=600)
            after = scrape(cluster)
            bench = json.loads(bench_out.read_text())
    finally:
        cluster.stop()
    point = bench["stores"][0]["points"][0]
    matches = max(1, point["matches"])
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(after) | set(before))}
    diff = {k: v for k, v in diff.items() if v}
    members = args.members
    result["benchmark_point"] = {k: point.get(k) for k in ("target_rate", "achieved_rate", "matches", "p50_ms", "p99_ms",
                                                           "max_ms", "answers", "lost", "server_cpu_us_per_match")}
    result["loadavg_at_end"] = list(os.getloadavg())
    result["totals_all_members"] = diff
    result["per_match"] = {
        "txn_requests": diff.get("handled_total.Txn", 0.0) / matches,
        "range_requests": diff.get("handled_total.Range", 0.0) / matches,
        "watch_messages_sent": diff.get("msg_sent_total.Watch", 0.0) / matches,
        "proposals_committed_per_member": diff.get("etcd_server_proposals_committed_total", 0.0) / members / matches,
        "wal_fsyncs_per_member": diff.get("etcd_disk_wal_fsync_duration_seconds_count", 0.0) / members / matches,
    }
    fsyncs = diff.get("etcd_disk_wal_fsync_duration_seconds_count", 0.0)
    result["wal_fsync_mean_ms"] = diff.get("etcd_disk_wal_fsync_duration_seconds_sum", 0.0) / fsyncs * 1000 if fsyncs else None
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("benchmark_point", "per_match", "wal_fsync_mean_ms")}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
