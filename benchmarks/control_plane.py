"""Control-plane benchmark: rendezvous match latency/throughput and lease renewals/s.

Starts ``kvbaton serve`` in its own process (memory store, or etcd with ``--store``) and
drives it from this process, so client and server don't share an event loop.

    .venv/bin/python benchmarks/control_plane.py [--store memory:// --store etcd3] [--path unary --path session] [--out FILE]

Server, client and (etcd3) etcd-member CPU per match are measured from /proc; on the
session path ``calls_per_batch`` says how many calls shared a SessionRequest message.

Both paths are measured by default: ``unary`` (one Offer and one Complete call per
transfer) and ``session`` (the decode and the prefill engine each send theirs over their
own Rendezvous/Session stream, ``KvbatonClient.session``).

Rendezvous: ``--concurrency`` workers each run transfers back to back, paced so that all
together aim at ``--rate`` matches/s. A transfer sends the offer and the completion at
once; latency is from sending the second message to the MATCH arriving on the prefill
subscriber's stream. Lease renewals: ``--leases`` conversations renewed over ONE KeepAlive
stream in batches of ``--batch``, with a few batches in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvbaton.client import KvbatonClient
from kvbaton.stack.ports import free_port
from kvbaton.v1 import common_pb2, lease_pb2, registrar_pb2, rendezvous_pb2


def cpu_seconds(pid: int | None = None) -> float:
    """User+system CPU of a process (this one by default), from /proc."""
    fields = pathlib.Path(f"/proc/{pid or os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


async def register(kv: KvbatonClient, engine_id: str, role) -> None:
    rank = registrar_pb2.EngineRank(
        engine_id=engine_id, role=role, tp_size=1, agent_name=engine_id, agent_metadata=b"m",
        geometry=common_pb2.KvGeometry(region_base_addrs=[1], bytes_per_block=32768, num_blocks=100000,
                                       tokens_per_block=16, dtype="bfloat16", fingerprint="bench"))
    await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(rank=rank, ttl_ms=600_000))


async def bench_rendezvous(kv: KvbatonClient, *, rate: float, concurrency: int, seconds: float, tag: str,
                           path: str = "unary", peer: KvbatonClient | None = None) -> dict:
    """``path``: "unary" sends Offer and Complete as unary calls (one client);
    "session" sends them over the engines' sessions (``kv`` is the prefill engine's
    client, ``peer`` the decode engine's, each with its own connection and stream)."""
    pre, dec = f"pre-{tag}", f"dec-{tag}"
    dkv = peer or kv
    if path == "session":
        def offer(req, timeout):
            return dkv.session.offer(req)

        def complete(req, timeout):
            return kv.session.complete(req)

    else:
        offer, complete = kv.rendezvous.Offer, kv.rendezvous.Complete
    await register(kv, pre, common_pb2.ENGINE_ROLE_PREFILL)
    await register(kv, dec, common_pb2.ENGINE_ROLE_DECODE)
    waiting: dict[str, asyncio.Future] = {}
    ready = asyncio.Event()

    async def consume() -> None:
        async for ev in kv.subscribe(pre, 0, heartbeats=True):
            if ev.type == rendezvous_pb2.RendezvousEvent.TYPE_HEARTBEAT:
                ready.set()
                continue
            fut = waiting.pop(ev.transfer.transfer_id, None)
            if fut is not None and not fut.done():
                fut.set_result(time.perf_counter())

    consumer = asyncio.ensure_future(consume())
    await asyncio.wait_for(ready.wait(), 10)
    latencies: list[float] = []
    errors = 0
    blocks = list(range(64))  # a 1k-token request in 16-token blocks
    interval = concurrency / rate if rate else 0.0
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal errors
        i = 0
        next_at = time.perf_counter() + (interval * w / concurrency)
        while time.perf_counter() < deadline:
            if interval:
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                next_at += interval
            tid = f"{tag}-{w}-{i}"
            i += 1
            fut = asyncio.get_running_loop().create_future()
            waiting[tid] = fut
            t0 = time.perf_counter()
            try:
                await asyncio.gather(
                    offer(rendezvous_pb2.OfferRequest(transfer_id=tid, decode_engine_id=dec, block_ids=blocks), timeout=5),
                    complete(rendezvous_pb2.CompleteRequest(transfer_id=tid, prefill_engine_id=pre, block_ids=blocks),
                             timeout=5))
                t_match = await asyncio.wait_for(fut, 5)
                latencies.append((t_match - t0) * 1000)
            except Exception:  # noqa: BLE001 - any failure counts as an error of the open-loop run
                errors += 1
                waiting.pop(tid, None)

    sessions = [dkv.session, kv.session] if path == "session" else []
    before = [dict(x.stats) for x in sessions]
    t_start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - t_start
    sent = [(x.stats["sent_calls"] - b["sent_calls"], x.stats["sent_batches"] - b["sent_batches"])
            for x, b in zip(sessions, before)]
    consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    return {
        "path": path, "target_rate": rate, "concurrency": concurrency, "matches": len(latencies), "errors": errors,
        "matches_per_s": len(latencies) / elapsed,
        "p50_ms": pct(latencies, 50), "p90_ms": pct(latencies, 90), "p99_ms": pct(latencies, 99),
        "mean_ms": statistics.fmean(latencies) if latencies else float("nan"),
        # Session path: calls per SessionRequest message (how much batching the load made).
        **({"calls_per_batch": sum(c for c, _ in sent) / max(sum(b for _, b in sent), 1)} if sent else {}),
    }


async def bench_renewals(kv: KvbatonClient, *, leases: int, batch: int, seconds: float, in_flight: int = 4) -> dict:
    convs = [f"bench-conv-{i}" for i in range(leases)]
    for i in range(0, leases, 200):
        await asyncio.gather(*(kv.call(kv.lease.Grant, lease_pb2.GrantRequest(
            conversation_id=c, engine_id="bench-dec", ttl_ms=30_000)) for c in convs[i:i + 200]))
    sent = asyncio.Semaphore(in_flight)
    stop_at = time.perf_counter() + seconds
    ok = 0
    bad = 0

    async def requests():
        seq = 0
        while time.perf_counter() < stop_at:
            await sent.acquire()
            start = (seq * batch) % leases
            chunk = [convs[(start + j) % leases] for j in range(batch)]
            yield lease_pb2.KeepAliveRequest(seq=seq, renewals=[lease_pb2.RenewRequest(conversation_id=c) for c in chunk])
            seq += 1

    t0 = time.perf_counter()
    async for resp in kv.lease.KeepAlive(requests()):
        sent.release()
        for r in resp.results:
            if r.status == lease_pb2.RENEW_STATUS_OK:
                ok += 1
            else:
                bad += 1
    elapsed = time.perf_counter() - t0
    return {"leases": leases, "batch": batch, "renewals": ok, "failed": bad, "renewals_per_s": ok / elapsed,
            "seconds": elapsed}


async def store_revision(url: str) -> int | None:
    """The etcd revision (one per write transaction), to count the writes renewals cost."""
    if not url.startswith("etcd://"):
        return None
    from kvbaton.services.store.etcd import EtcdStore

    s = await EtcdStore.connect(url[len("etcd://"):].split(","))
    try:
        return await s.current_revision()
    finally:
        await s.close()


async def run(args) -> dict:
    port = free_port()
    env = dict(os.environ, KVBATON_LOG_LEVEL="WARNING")
    server = subprocess.Popen([sys.executable, "-m", "kvbaton.cli", "serve", "--insecure", "--listen", f"127.0.0.1:{port}",
                               "--store", args.store], env=env, start_new_session=True)
    results: dict = {"store": args.store, "machine": f"{os.cpu_count()} cores", "rendezvous": [], "renewals": None}
    try:
        async with KvbatonClient(f"127.0.0.1:{port}", timeout_s=5) as kv, \
                KvbatonClient(f"127.0.0.1:{port}", timeout_s=5) as peer:
            await kv.wait_ready(30)
            store_pids = getattr(args, "store_pids", [])
            for path, rate in [(path, rate) for path in args.path for rate in args.rate]:
                s0, c0 = cpu_seconds(server.pid), cpu_seconds()
                e0 = sum(cpu_seconds(p) for p in store_pids)
                r = await bench_rendezvous(kv, rate=rate, concurrency=args.concurrency, seconds=args.seconds,
                                           tag=f"{path[0]}{int(rate)}", path=path, peer=peer)
                r["server_cpu_us_per_match"] = (cpu_seconds(server.pid) - s0) / max(r["matches"], 1) * 1e6
                r["client_cpu_us_per_match"] = (cpu_seconds() - c0) / max(r["matches"], 1) * 1e6
                if store_pids:  # the etcd members started here, all together
                    r["store_cpu_us_per_match"] = (sum(cpu_seconds(p) for p in store_pids) - e0) / max(r["matches"], 1) * 1e6
                results["rendezvous"].append(r)
                print(f"[{args.store}] {path:7s} rendezvous target {rate:>6.0f}/s conc {args.concurrency}: "
                      f"{r['matches_per_s']:7.0f} matches/s  p50 {r['p50_ms']:.2f} ms  p90 {r['p90_ms']:.2f} ms  "
                      f"p99 {r['p99_ms']:.2f} ms  errors {r['errors']}  cpu/match server {r['server_cpu_us_per_match']:.0f} us "
                      f"client {r['client_cpu_us_per_match']:.0f} us"
                      + (f" etcd {r['store_cpu_us_per_match']:.0f} us" if "store_cpu_us_per_match" in r else ""), flush=True)
            rev0 = await store_revision(args.store)
            ren = await bench_renewals(kv, leases=args.leases, batch=args.batch, seconds=args.seconds)
            rev1 = await store_revision(args.store)
            if rev0 is not None and rev1 is not None:
                ren["store_writes_per_lease_per_s"] = (rev1 - rev0) / ren["leases"] / ren["seconds"]
            results["renewals"] = ren
            print(f"[{args.store}] lease renewals over one KeepAlive stream: {ren['renewals_per_s']:,.0f}/s "
                  f"({ren['leases']} leases, batches of {ren['batch']}, failed {ren['failed']}"
                  + (f", {ren['store_writes_per_lease_per_s']:.2f} etcd writes/lease/s" if "store_writes_per_lease_per_s" in ren else "")
                  + ")", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(5)
    return results


def side_by_side(runs: list[dict]) -> str:
    rows = [["figure", *[r["store"] for r in runs]]]
    for i, rr in enumerate(runs[0]["rendezvous"]):
        rate = f"{rr['target_rate']:.0f}/s" if rr["target_rate"] else "unpaced"
        name = f"{rr.get('path', 'unary')} {rate}"
        rows.append([f"{name}: matches/s", *[f"{r['rendezvous'][i]['matches_per_s']:.0f}" for r in runs]])
        for q in ("p50", "p99"):
            rows.append([f"{name}: {q} ms", *[f"{r['rendezvous'][i][q + '_ms']:.2f}" for r in runs]])
        rows.append([f"{name}: server CPU us/match",
                     *[f"{r['rendezvous'][i]['server_cpu_us_per_match']:.0f}" for r in runs]])
        rows.append([f"{name}: client CPU us/match",
                     *[f"{r['rendezvous'][i]['client_cpu_us_per_match']:.0f}" for r in runs]])
        rows.append([f"{name}: etcd CPU us/match",
                     *[f"{r['rendezvous'][i].get('store_cpu_us_per_match', float('nan')):.0f}" for r in runs]])
    rows.append(["renewals/s (one stream)", *[f"{r['renewals']['renewals_per_s']:,.0f}" for r in runs]])
    rows.append(["store writes/lease/s", *[f"{r['renewals'].get('store_writes_per_lease_per_s', float('nan')):.2f}" for r in runs]])
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", action="append",
                   help="memory://, etcd://h:p[,h:p], or etcd3 (a 3-member etcd on loopback started here); repeatable")
    p.add_argument("--rate", type=float, action="append", help="target matches/s (repeatable; 0 = unpaced)")
    p.add_argument("--path", action="append", choices=("unary", "session"),
                   help="how engines send offers/completions: unary calls, or their Rendezvous/Session "
                        "streams (repeatable; default both, side by side)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--leases", type=int, default=2000)
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "control_plane.json"))
    args = p.parse_args()
    args.rate = args.rate or [500.0, 1000.0, 0.0]
    args.path = args.path or ["unary", "session"]
    runs = []
    for store in args.store or ["memory://"]:
        cluster = None
        if store == "etcd3":
            from kvbaton.stack.etcd_cluster import EtcdCluster

            cluster = EtcdCluster(3).start()
            store = cluster.url
            args.store_pids = [m.proc.pid for m in cluster.members]
        try:
            args.store = store
            result = asyncio.run(run(args))
            result["store"] = "etcd (3 members, loopback)" if cluster else store
            runs.append(result)
        finally:
            args.store_pids = []
            if cluster is not None:
                cluster.stop()
    print()
    print(side_by_side(runs))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(runs, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
