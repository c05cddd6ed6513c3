"""Leases at scale: idle CPU, ``Get`` latency and KeepAlive cost with many live leases.

Starts ``kvbaton serve`` in its own process (memory store by default) and measures, on an
empty server and then with ``--leases`` live leases (granted here, long TTL so none ends
during the run):

- idle server CPU (% of one core) over ``--idle-s`` seconds with no client traffic;
- ``Get`` latency of one conversation (``--gets`` sequential calls: p50/p99/max);
- server CPU of one KeepAlive message of ``--batch`` renewals (and of smaller ones, to
  show the cost grows with the size), for renewals that need a store write (the
  stored deadline no longer covers now + TTL) and for renewals within the slack (no write),
  first with the full answer (a RenewResult per renewal), then asking for the compact one
  (``KeepAliveRequest.compact``: a result only per renewal not renewed; a server that
  predates it answers in full, recorded as ``answer``), then compact with the renewals
  packed as ``KeepAliveRequest.conversation_ids`` (a server that predates it renews none
  of them: its statuses show it);
- server RSS.

    flock /tmp/kvbaton-heavy.lock .venv/bin/python benchmarks/leases_scale.py [--leases 100000] [--baseline REV] [--out FILE]

``--baseline REV`` measures the same against ``kvbaton serve`` of that commit too, after
this tree's, in the same run (under ``"baseline"`` in the results file, with its commit
and the load average when each server started).

Server CPU comes from /proc (10 ms ticks): each KeepAlive figure is the mean over
``--repeat`` messages sent one after another, each answered before the next is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.control_plane import cpu_seconds, export_baseline, pct
from kvbaton.client import KvbatonClient
from kvbaton.stack.ports import free_port
from kvbaton.v1 import lease_pb2


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


async def idle_cpu(pid: int, seconds: float) -> float:
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.perf_counter() - t0) * 100


async def get_latency(kv: KvbatonClient, conversation: str, n: int) -> dict:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await kv.lease.Get(lease_pb2.GetLeaseRequest(conversation_id=conversation), timeout=5)
        lat.append((time.perf_counter() - t0) * 1000)
    return {"n": n, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": max(lat)}


async def grant_many(kv: KvbatonClient, n: int, ttl_ms: int, concurrency: int = 64) -> float:
    it = iter(range(n))
    t0 = time.perf_counter()

    async def worker() -> None:
        for i in it:
            await kv.lease.Grant(lease_pb2.GrantRequest(conversation_id=f"conv-{i}", engine_id=f"dec-{i % 16}",
                                                        ttl_ms=ttl_ms, num_blocks=8), timeout=30)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0)


async def keepalive_cost(kv: KvbatonClient, pid: int, size: int, repeat: int, offset: int, *, twice: bool = False,
                         compact: bool = False, packed: bool = False) -> dict:
    """Server CPU per message of ``size`` renewals, over ``repeat`` messages on one stream.
    ``twice``: each message is sent once unmeasured and at once again, measured: the second
    arrives while the stored deadlines still cover now + TTL (within the slack), so it is
    answered without a store write. ``compact``: the messages ask for the compact answer
    (a result only per renewal not renewed); ``answer`` records what the server gave.
    ``packed``: the renewals go as ``conversation_ids`` (no message per renewal)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def requests():
        while True:
            item = await queue.get()
            if item is None:
                return
            yield item

    stream = kv.lease.KeepAlive(requests())
    per_msg, statuses, answers, sizes = [], {}, set(), []
    for r in range(repeat):
        base = offset + r * size
        convs = [f"conv-{base + i}" for i in range(size)]
        msg = (lease_pb2.KeepAliveRequest(seq=r, compact=compact, conversation_ids=convs) if packed else
               lease_pb2.KeepAliveRequest(seq=r, compact=compact, renewals=[lease_pb2.RenewRequest(conversation_id=c)
                                                                             for c in convs]))
        if twice:
            await queue.put(msg)
            await asyncio.wait_for(stream.read(), 60)
        else:
            await asyncio.sleep(0.2)  # let anything else settle: the window below holds this message only
        c0 = cpu_seconds(pid)
        await queue.put(msg)
        resp = await asyncio.wait_for(stream.read(), 60)
        await asyncio.sleep(0.05)  # the flusher's tail (it answers after the write, but ticks are coarse)
        per_msg.append((cpu_seconds(pid) - c0) * 1000)
        answers.add("compact" if resp.compact else "full")
        sizes.append(resp.ByteSize())
        if resp.compact:
            statuses["RENEW_STATUS_OK"] = statuses.get("RENEW_STATUS_OK", 0) + resp.renewed
        for res in resp.results:
            statuses[lease_pb2.RenewStatus.Name(res.status)] = statuses.get(lease_pb2.RenewStatus.Name(res.status), 0) + 1
    await queue.put(None)
    stream.cancel()
    return {"renewals_per_message": size, "messages": repeat, "server_cpu_ms_per_message_mean": sum(per_msg) / len(per_msg),
            "server_cpu_ms_per_message": per_msg, "statuses": statuses, "answer_requested": "compact" if compact else "full",
            "request": "conversation_ids (packed)" if packed else "renewals",
            "answer": "/".join(sorted(answers)), "answer_bytes": max(sizes)}


async def run(args, baseline_dir: pathlib.Path | None = None) -> dict:
    port = free_port()
    env = dict(os.environ, KVBATON_LOG_LEVEL="WARNING")
    if baseline_dir is not None:  # the baseline's tree, importable ahead of this checkout
        env["PYTHONPATH"] = str(baseline_dir)
    server = subprocess.Popen([sys.executable, "-m", "kvbaton.cli", "serve", "--insecure", "--listen", f"127.0.0.1:{port}",
                               "--store", getattr(args, "store_url", args.store), "--log-level", "WARNING"], env=env, start_new_session=True,
                              cwd=str(baseline_dir) if baseline_dir is not None else None)
    machine = f"{os.cpu_count()} cores" + (f", {args.machine}" if args.machine else "")
    out: dict = {"benchmark": "leases_scale", "commit": args.commit or commit(), "machine": machine,
                 "config": {k: v for k, v in vars(args).items() if k != "out"}, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "loadavg_at_start": list(os.getloadavg())}
    try:
        async with KvbatonClient(f"127.0.0.1:{port}", timeout_s=30) as kv:
            await kv.wait_ready(30)
            await kv.lease.Grant(lease_pb2.GrantRequest(conversation_id="probe", engine_id="dec-probe", ttl_ms=3_600_000), timeout=5)
            await asyncio.sleep(1.0)
            out["empty"] = {"idle_cpu_pct": await idle_cpu(server.pid, args.idle_s),
                            "get": await get_latency(kv, "probe", args.gets), "rss_mib": rss_mib(server.pid)}
            print("empty:", json.dumps(out["empty"]), flush=True)
            rate = await grant_many(kv, args.leases, ttl_ms=args.ttl_ms)
            await asyncio.sleep(2.0)
            full = {"live_leases": args.leases + 1, "grants_per_s": rate,
                    "idle_cpu_pct": await idle_cpu(server.pid, args.idle_s),
                    "get": await get_latency(kv, "probe", args.gets), "rss_mib": rss_mib(server.pid)}
            out["full"] = full
            print("full:", json.dumps(full), flush=True)
            # Renewals that need a write: granted more than the slack (1 s) ago, so the stored
            # deadline no longer covers now + TTL. Each message renews leases not renewed before.
            ka = []
            # The full answer (one result per renewal), then the compact one, then the compact
            # one for packed renewals. Each variant renews the same leases: the 1.2 s pause
            # puts them past the slack again, so they need a write again.
            for compact, packed in ((False, False), (True, False), (True, True)):
                await asyncio.sleep(1.2)
                offset = 0
                for size in args.sizes:
                    r = await keepalive_cost(kv, server.pid, size, args.repeat, offset, compact=compact, packed=packed)
                    r["kind"] = "write needed"
                    offset += size * args.repeat
                    ka.append(r)
                    print("keepalive:", json.dumps({k: v for k, v in r.items() if k != "server_cpu_ms_per_message"}), flush=True)
                # Each message twice in a row: the second within the slack, answered without a write.
                r = await keepalive_cost(kv, server.pid, args.sizes[-1], args.repeat,
                                         offset - args.sizes[-1] * args.repeat, twice=True, compact=compact, packed=packed)
                r["kind"] = "within slack (no write)"
                ka.append(r)
                print("keepalive:", json.dumps({k: v for k, v in r.items() if k != "server_cpu_ms_per_message"}), flush=True)
            out["keepalive"] = ka
            full["idle_cpu_pct_after"] = await idle_cpu(server.pid, args.idle_s)
            full["get_after"] = await get_latency(kv, "probe", args.gets)
            full["rss_mib_after"] = rss_mib(server.pid)
            print("after:", json.dumps({k: full[k] for k in ("idle_cpu_pct_after", "get_after", "rss_mib_after")}), flush=True)
            out["loadavg_at_end"] = list(os.getloadavg())
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(5)
    return out


def on_store(args, baseline_dir: pathlib.Path | None) -> dict:
    """One server's run; etcd1 / etcd3: on a fresh 1- or 3-member etcd on loopback of its own."""
    if args.store not in ("etcd1", "etcd3"):
        return asyncio.run(run(args, baseline_dir))
    from kvbaton.stack.etcd_cluster import EtcdCluster

    cluster = EtcdCluster(int(args.store[-1])).start()
    args.store_url = cluster.url
    try:
        return asyncio.run(run(args, baseline_dir))
    finally:
        cluster.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="memory://", help="memory://, etcd://h:p[,h:p], or etcd1 / etcd3 (started here)")
    p.add_argument("--leases", type=int, default=100_000)
    p.add_argument("--ttl-ms", type=int, default=3_600_000)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--gets", type=int, default=2_000)
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000, 5_000, 10_000])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--baseline", default="", help="also measure `kvbaton serve` of this commit, same run, after this tree")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "leases_scale.json"))
    p.add_argument("--machine", default="", help="what this machine is, recorded in the results (beside its core count)")
    p.add_argument("--commit", default="", help="the commit measured, where this tree is a copy with no git history")
    args = p.parse_args()
    if sum(args.sizes) * args.repeat > args.leases:
        p.error("--leases must cover sum(--sizes) * --repeat distinct conversations")
    result = on_store(args, None)
    if args.baseline:
        # Resolved once, before the export: a branch name may move during the run.
        sha = subprocess.run(["git", "rev-parse", args.baseline], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        base_dir = export_baseline(sha)
        try:
            base = on_store(args, base_dir)
        finally:
            shutil.rmtree(base_dir, ignore_errors=True)
        base["commit"] = sha
        result["baseline"] = base
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
