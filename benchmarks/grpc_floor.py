"""The gRPC floor under the control plane: server CPU per message of a bare grpc.aio
bidirectional stream that does nothing but answer, open loop.

Why: a rendezvous match on the session path costs about five gRPC messages on the server
(two calls in, two answers out, one MATCH event out; fewer when calls batch). What one
message costs with no kvbaton code at all says how much of the server's CPU per match
(`benchmarks/control_plane.py`) is gRPC's and the event loop's, and so what cutting
kvbaton's own work can buy.

    .venv/bin/python benchmarks/grpc_floor.py [--loop asyncio --loop uvloop] [--rate 1000] [--messages 4000]

A server process (a Rendezvous servicer whose Session answers every request with one
response of empty results) and this client, which sends one SessionRequest every
1/rate s on one stream without waiting. Per loop: the server's CPU (user+system, from
/proc) per request/response pair, split by thread (the Python loop thread, gRPC's
completion-queue poller thread, gRPC core's event-engine threads). Results JSON with the
configuration, the git commit and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc

from benchmarks.control_plane import cpu_seconds, git_commit
from kvbaton.stack.ports import free_port
from kvbaton.v1 import rendezvous_pb2 as pb
from kvbaton.v1 import rendezvous_pb2_grpc as pb_grpc


class Echo(pb_grpc.RendezvousServicer):
    async def Session(self, request_iterator, context):
        async for req in request_iterator:
            yield pb.SessionResponse(results=[pb.SessionResult(seq=c.seq) for c in req.calls])


async def _serve(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_RendezvousServicer_to_server(Echo(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of ``pid``, keyed 'name/tid'."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = pathlib.Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{name}/{tid}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


async def _drive(port: int, pid: int, rate: float, n: int) -> dict:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    await asyncio.wait_for(channel.channel_ready(), 20)
    stub = pb_grpc.RendezvousStub(channel)
    queue: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (item := await queue.get()) is not None:
            yield item

    call = stub.Session(requests())
    # Warm up: the stream open and the first messages are not the steady state.
    for i in range(100):
        queue.put_nowait(pb.SessionRequest(calls=[pb.SessionCall(seq=i)]))
    got = 0
    async for resp in call:
        got += len(resp.results)
        if got >= 100:
            break
    t0, c0, th0 = time.perf_counter(), cpu_seconds(pid), threads_cpu(pid)
    start = time.perf_counter()
    for i in range(n):
        due = start + i / rate
        if (delay := due - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        queue.put_nowait(pb.SessionRequest(calls=[pb.SessionCall(seq=1000 + i)]))
    got = 0
    async for resp in call:
        got += len(resp.results)
        if got >= n:
            break
    wall, cpu, th1 = time.perf_counter() - t0, cpu_seconds(pid) - c0, threads_cpu(pid)
    queue.put_nowait(None)
    call.cancel()
    await channel.close()
    kinds: collections.Counter[str] = collections.Counter()
    for key, end in th1.items():
        used = end - th0.get(key, 0.0)
        name = key.split("/")[0]
        kinds["event_engine" if name.startswith("event_engine") else name] += used
    return {"messages": n, "rate": rate, "achieved_rate": n / wall, "server_cpu_us_per_pair": cpu / n * 1e6,
            "by_thread_us_per_pair": {k: v / n * 1e6 for k, v in kinds.items()}}


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":  # the server process
        if sys.argv[2] == "uvloop":
            import uvloop

            uvloop.run(_serve(int(sys.argv[3])))
        else:
            asyncio.run(_serve(int(sys.argv[3])))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loop", action="append", choices=("asyncio", "uvloop"))
    p.add_argument("--rate", type=float, default=1000.0, help="requests/s sent")
    p.add_argument("--messages", type=int, default=4000)
    p.add_argument("--repeat", type=int, default=2, help="runs per loop, alternating loops")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grpc_floor.json"))
    args = p.parse_args()
    loops = args.loop or ["asyncio", "uvloop"]
    results = {"script": "benchmarks/grpc_floor.py", "argv": sys.argv[1:], "commit": git_commit(),
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": f"{os.cpu_count()} cores",
               "grpc": grpc.__version__, "runs": []}
    for _ in range(args.repeat):
        for loop_name in loops:
            port = free_port()
            server = subprocess.Popen([sys.executable, __file__, "--serve", loop_name, str(port)])
            try:
                r = asyncio.run(_drive(port, server.pid, args.rate, args.messages))
            finally:
                server.kill()
                server.wait(10)
            r.update(loop=loop_name, loadavg_at_start=os.getloadavg())
            results["runs"].append(r)
            print(f"{loop_name:8s} {r['server_cpu_us_per_pair']:5.0f} us per request+response "
                  f"({', '.join(f'{k} {v:.0f}' for k, v in sorted(r['by_thread_us_per_pair'].items()))}), "
                  f"achieved {r['achieved_rate']:.0f}/s", flush=True)
    pathlib.Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
