"""Leases at scale: idle CPU, ``Get`` latency and KeepAlive cost with many live leases.

Starts two ``kvbaton serve`` processes of the same tree (memory store by default): one
stays empty (one probe lease), the other gets ``--leases`` live leases (granted here, long
TTL so none ends during the run). Both run through the whole run on the same machine, so
what one measures against the other shares the load of the moment:

- idle server CPU (% of one core) of both, over the same ``--idle-s`` window, with no
  client traffic: before the grants (two empty servers), with the leases, and after the
  KeepAlive runs;
- ``Get`` latency of one conversation, interleaved: ``--rounds`` rounds, each
  ``--gets`` sequential calls to one server then to the other (which goes first
  alternates), pooled per server (p50/p99/max) and kept per round;
- server CPU of one KeepAlive message of ``--batch`` renewals (and of smaller ones, to
  show the cost grows with the size), on the full server, for renewals that need a store
  write (the stored deadline no longer covers now + TTL) and for renewals within the
  slack (no write), first with the full answer (a RenewResult per renewal), then asking
  for the compact one (``KeepAliveRequest.compact``: a result only per renewal not
  renewed; a server that predates it answers in full, recorded as ``answer``), then
  compact with the renewals packed as ``KeepAliveRequest.conversation_ids`` (a server
  that predates it renews none of them: its statuses show it);
- server RSS.

    flock /tmp/kvbaton-heavy.lock .venv/bin/python benchmarks/leases_scale.py [--leases 100000] [--baseline REV] [--out FILE]

``--baseline REV`` measures the same against ``kvbaton serve`` of that commit too, after
this tree's, in the same run (under ``"baseline"`` in the results file, with its commit
and the load average when each server started).

Server CPU is the sum over the server's threads of the time on CPU from
``/proc/<pid>/task/*/schedstat`` (nanoseconds; the 10 ms ticks of ``/proc/<pid>/stat``
were too coarse for a 20 ms message). Each KeepAlive figure is one message, answered
before the next is sent; its window runs from just before the message to 50 ms after the
answer (the flusher's and watch's tail), so it also holds ~50 ms of the idle server
(``idle_cpu_pct`` of the full server says how much: ~2 ms).
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
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.control_plane import export_baseline, pct
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


def cpu_seconds(pid: int) -> float:
    """Time on CPU of every thread of ``pid`` so far (schedstat: nanoseconds)."""
    total = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e9


async def idle_cpu(pids: list[int], seconds: float) -> list[float]:
    """Idle CPU (% of one core) of each of ``pids`` over one shared window."""
    c0, t0 = [cpu_seconds(p) for p in pids], time.perf_counter()
    await asyncio.sleep(seconds)
    dt = time.perf_counter() - t0
    return [(cpu_seconds(p) - c) / dt * 100 for p, c in zip(pids, c0)]


async def get_latency(kv: KvbatonClient, conversation: str, n: int) -> list[float]:
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        await kv.lease.Get(lease_pb2.GetLeaseRequest(conversation_id=conversation), timeout=5)
        lat.append((time.perf_counter() - t0) * 1000)
    return lat


def summary(lat: list[float]) -> dict:
    return {"n": len(lat), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": max(lat)}


async def interleaved_gets(empty: KvbatonClient, full: KvbatonClient, n: int, rounds: int) -> dict:
    """``rounds`` rounds of ``n`` Gets to each server, one after the other (which goes
    first alternates): pooled per server, and per round."""
    pooled: dict[str, list[float]] = {"empty": [], "full": []}
    per_round = []
    for r in range(rounds):
        order = (("empty", empty), ("full", full)) if r % 2 == 0 else (("full", full), ("empty", empty))
        row: dict = {"first": order[0][0], "loadavg": list(os.getloadavg())}
        for name, kv in order:
            lat = await get_latency(kv, "probe", n)
            pooled[name] += lat
            row[name] = summary(lat)
        per_round.append(row)
    return {"empty": summary(pooled["empty"]), "full": summary(pooled["full"]), "rounds": per_round}


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
        await asyncio.sleep(0.05)  # the tail: the journal's watch event is applied after the answer
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
            "server_cpu_ms_per_message_median": pct(per_msg, 50), "server_cpu_ms_per_message_max": max(per_msg),
            "server_cpu_ms_per_message": per_msg, "loadavg": list(os.getloadavg()), "statuses": statuses, "answer_requested": "compact" if compact else "full",
            "request": "conversation_ids (packed)" if packed else "renewals",
            "answer": "/".join(sorted(answers)), "answer_bytes": max(sizes)}


def start_server(store: str, baseline_dir: pathlib.Path | None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, KVBATON_LOG_LEVEL="WARNING")
    if baseline_dir is not None:  # the baseline's tree, importable ahead of this checkout
        env["PYTHONPATH"] = str(baseline_dir)
    server = subprocess.Popen([sys.executable, "-m", "kvbaton.cli", "serve", "--insecure", "--listen", f"127.0.0.1:{port}",
                               "--store", store, "--log-level", "WARNING"], env=env, start_new_session=True,
                              cwd=str(baseline_dir) if baseline_dir is not None else None)
    return server, port


def stop_server(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(5)


async def run(args, baseline_dir: pathlib.Path | None = None) -> dict:
    stores = getattr(args, "store_urls", None) or [args.store, args.store]
    empty_srv, empty_port = start_server(stores[0], baseline_dir)
    server, port = start_server(stores[1], baseline_dir)
    machine = f"{os.cpu_count()} cores" + (f", {args.machine}" if args.machine else "")
    out: dict = {"benchmark": "leases_scale", "commit": args.commit or commit(), "machine": machine,
                 "config": {k: v for k, v in vars(args).items() if k not in ("out", "store_urls")},
                 "cpu_source": "/proc/<pid>/task/*/schedstat (ns, all threads)",
                 "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "loadavg_at_start": list(os.getloadavg())}
    pids = [empty_srv.pid, server.pid]
    try:
        async with KvbatonClient(f"127.0.0.1:{empty_port}", timeout_s=30) as ekv, \
                KvbatonClient(f"127.0.0.1:{port}", timeout_s=30) as kv:
            for k in (ekv, kv):
                await k.wait_ready(30)
                await k.lease.Grant(lease_pb2.GrantRequest(conversation_id="probe", engine_id="dec-probe", ttl_ms=3_600_000), timeout=5)
            await asyncio.sleep(1.0)
            async def phase(name: str, second: str, **extra: Any) -> None:
                """Idle CPU, interleaved Gets and RSS of both servers, as ``out[name]``
                (``second``: what the second server is called in this phase)."""
                idle = await idle_cpu(pids, args.idle_s)
                out[name] = {**extra, "idle_cpu_pct": {"empty": idle[0], second: idle[1]},
                             "get": await interleaved_gets(ekv, kv, args.gets, args.rounds),
                             "rss_mib": {"empty": rss_mib(pids[0]), second: rss_mib(pids[1])}}
                print(f"{name}:", json.dumps({k: v for k, v in out[name].items() if k != "get"}),
                      json.dumps({k: out[name]["get"][k] for k in ("empty", "full")}), flush=True)

            # Two empty servers first: what the pair looks like before one gets the leases.
            await phase("before", "to_fill")
            rate = await grant_many(kv, args.leases, ttl_ms=args.ttl_ms)
            await asyncio.sleep(2.0)
            await phase("with_leases", "full", live_leases={"empty": 1, "full": args.leases + 1}, grants_per_s=rate)
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
            await asyncio.sleep(1.0)
            await phase("after", "full")
            out["loadavg_at_end"] = list(os.getloadavg())
    finally:
        stop_server(server)
        stop_server(empty_srv)
    return out


def on_store(args, baseline_dir: pathlib.Path | None) -> dict:
    """One server's run; etcd1 / etcd3: on a fresh 1- or 3-member etcd on loopback of its own."""
    if args.store not in ("etcd1", "etcd3"):
        return asyncio.run(run(args, baseline_dir))
    from kvbaton.stack.etcd_cluster import EtcdCluster

    # One cluster each: the empty server's store holds nothing the full one's does.
    clusters = [EtcdCluster(int(args.store[-1])).start() for _ in range(2)]
    args.store_urls = [c.url for c in clusters]
    try:
        return asyncio.run(run(args, baseline_dir))
    finally:
        for c in clusters:
            c.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", default="memory://", help="memory://, etcd://h:p[,h:p], or etcd1 / etcd3 (started here)")
    p.add_argument("--leases", type=int, default=100_000)
    p.add_argument("--ttl-ms", type=int, default=3_600_000)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--gets", type=int, default=1_000, help="Gets per server per round")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds of --gets to each server")
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000, 5_000, 10_000])
    p.add_argument("--repeat", type=int, default=5)
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
