"""In-process CPU per rendezvous match: the Session servicer, the rendezvous domain and the
memory store, with no gRPC and no network.

Why: ``control_plane.py`` measures the whole server (gRPC, its poller thread, the loop) on
a 2-core machine shared with other work, where one run's spread is larger than most single
changes to kvbaton's own code. This drives the same Python objects ``kvbaton serve`` builds
(``RendezvousServicer`` over ``RendezvousService`` over ``InstrumentedStore(MemoryStore)``,
with the registrar's engine and pair checks and the server's collector thresholds) from
one process: each transfer's offer goes in on the decode's ``Session``, then, once
answered, its completion on the prefill's; messages cross as bytes (parsed and serialized
as gRPC would) and the prefill has a ``Subscribe`` stream open. CPU time of the process
per match (``time.process_time``), the load generator's own share included, so only
differences between variants mean anything; the floor variant (``floor_server.py``'s
canned answers) shows what is not kvbaton's rendezvous code.

    .venv/bin/python benchmarks/rendezvous_cpu.py [--baseline REV] [--rounds 5] [--matches 4000] [--out FILE]

Variants: this tree, ``--baseline`` (a commit, exported with ``git archive`` as
``control_plane.py --baseline`` does) and the floor; paths ``session`` (the MATCH on the
prefill's stream) and ``session-answer`` (on the completion's answer). Each (variant,
path) runs in a fresh process once per round, rounds interleaved; the JSON keeps every
round and the median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


async def one_run(matches: int, answer: bool, floor: bool) -> dict:
    """In the child: ``matches`` transfers after 500 to warm up; CPU per match."""
    import gc

    from prometheus_client import CollectorRegistry

    from kvbaton import logs
    from kvbaton.services import gc_policy
    from kvbaton.services.api.rendezvous import RendezvousServicer
    from kvbaton.services.domain.registrar import RegistrarService
    from kvbaton.services.domain.rendezvous import RendezvousService
    from kvbaton.services.metrics import InstrumentedStore, ServiceMetrics
    from kvbaton.services.store.memory import MemoryStore
    from kvbaton.v1 import common_pb2, registrar_pb2
    from kvbaton.v1 import rendezvous_pb2 as pb

    logs.configure("WARNING")
    if floor:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import floor_server

        floor_server.install()

    class Ctx:  # what Subscribe asks of its gRPC context
        async def send_initial_metadata(self, md) -> None:
            pass

    store = MemoryStore()
    metrics = ServiceMetrics(CollectorRegistry())
    inst = InstrumentedStore(store, metrics)
    reg = RegistrarService(inst, metrics=metrics)
    rdv = RendezvousService(inst, engine_exists=reg.engine_exists, pair_check=reg.pair_verdict, metrics=metrics,
                            retained_lookup=reg.find_retained)
    await rdv.start(run_sweeper=True)
    gc_policy.set_threshold(gc_policy.SERVE_THRESHOLD)
    gc.freeze()
    gc_policy.install(asyncio.get_running_loop())
    svc = RendezvousServicer(rdv)  # no load shedding: this loop never waits, so it would read as overloaded
    for eid, role in (("pre", common_pb2.ENGINE_ROLE_PREFILL), ("dec", common_pb2.ENGINE_ROLE_DECODE)):
        rank = registrar_pb2.EngineRank(
            engine_id=eid, role=role, tp_size=1, agent_name=eid, agent_metadata=b"m",
            geometry=common_pb2.KvGeometry(region_base_addrs=[1], bytes_per_block=32768, num_blocks=100000,
                                           tokens_per_block=16, dtype="bfloat16", fingerprint="bench"))
        await reg.register_engine(rank, 600_000)
    loop = asyncio.get_running_loop()
    matched = [0]
    codes: dict[int, int] = {}
    answered = asyncio.Event()

    async def subscribe() -> None:
        req = pb.SubscribeRequest.FromString(pb.SubscribeRequest(engine_id="pre").SerializeToString())
        async for ev in svc.Subscribe(req, Ctx()):
            ev.SerializeToString()
            if ev.type == pb.RendezvousEvent.TYPE_MATCH:
                matched[0] += 1

    async def requests(q: asyncio.Queue):
        while (b := await q.get()) is not None:
            yield pb.SessionRequest.FromString(b)

    async def session(q: asyncio.Queue) -> None:
        async for resp in svc.Session(requests(q), Ctx()):
            resp.SerializeToString()
            for r in resp.results:
                matched[0] += r.rendezvous.match_delivered
                if r.code:
                    codes[r.code] = codes.get(r.code, 0) + 1
                answered.set()

    sub = loop.create_task(subscribe())
    qd: asyncio.Queue = asyncio.Queue()
    qp: asyncio.Queue = asyncio.Queue()
    sessions = [loop.create_task(session(qd)), loop.create_task(session(qp))]
    await asyncio.sleep(0.05)
    blocks = list(range(64))  # a 1k-token request in 16-token blocks, as control_plane.py sends
    seq = [0]

    def call(**body) -> bytes:
        seq[0] += 1
        return pb.SessionRequest(calls=[pb.SessionCall(seq=seq[0], **body)]).SerializeToString()

    async def run(n: int, tag: str) -> None:
        for i in range(n):
            tid = f"{tag}-{i}"
            answered.clear()
            qd.put_nowait(call(offer=pb.OfferRequest(transfer_id=tid, decode_engine_id="dec", block_ids=blocks,
                                                     timeout_ms=10_000)))
            await answered.wait()
            answered.clear()
            qp.put_nowait(call(complete=pb.CompleteRequest(transfer_id=tid, prefill_engine_id="pre", block_ids=blocks,
                                                           timeout_ms=10_000, match_in_answer=answer)))
            await answered.wait()
            for _ in range(3):  # the stream's event goes out before the next transfer
                await asyncio.sleep(0)

    await run(500, "warm")
    m0 = matched[0]
    c0 = time.process_time()
    await run(matches, "m")
    for _ in range(50):
        await asyncio.sleep(0)
    cpu = time.process_time() - c0
    got = matched[0] - m0
    qd.put_nowait(None)
    qp.put_nowait(None)
    await asyncio.gather(*sessions, return_exceptions=True)
    sub.cancel()
    await asyncio.gather(sub, return_exceptions=True)
    await rdv.stop()
    return {"matches": got, "sent": matches, "non_ok_answers": codes, "cpu_us_per_match": cpu / max(got, 1) * 1e6}


def child_main() -> None:
    matches, path, variant = int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import uvloop

    print(json.dumps(uvloop.run(one_run(matches, path == "session-answer", variant == "floor"))))


def export(commit: str) -> pathlib.Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from control_plane import export_baseline

    return export_baseline(commit)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="", help="a commit to compare with (exported with git archive)")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--matches", type=int, default=4000)
    p.add_argument("--path", action="append", choices=("session", "session-answer"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rendezvous_cpu.json"))
    args = p.parse_args()
    paths = args.path or ["session", "session-answer"]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from control_plane import git_commit

    variants: list[tuple[str, str, pathlib.Path | None]] = [("current", "", None)]
    if args.baseline:
        variants.append(("baseline", args.baseline, export(args.baseline)))
    if args.floor:
        variants.append(("floor", "", None))
    runs: dict[str, dict[str, list[dict]]] = {v: {path: [] for path in paths} for v, _, _ in variants}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load0 = os.getloadavg()
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        for name, _, tree in order:
            for path in paths:
                if name == "floor" and path != "session-answer":
                    continue  # the floor answers the MATCH on the completion only
                env = dict(os.environ)
                if tree is not None:
                    env["PYTHONPATH"] = str(tree)
                out = subprocess.run([sys.executable, __file__, "--child", str(args.matches), path, name], env=env,
                                     cwd=str(tree or ROOT), capture_output=True, text=True, timeout=900)
                if out.returncode != 0:
                    raise SystemExit(f"{name} {path}: {out.stderr[-2000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                r["round"] = rnd + 1
                runs[name][path].append(r)
                print(f"round {rnd + 1} {name:8s} {path:14s} {r['cpu_us_per_match']:7.1f} us/match  "
                      f"({r['matches']}/{r['sent']} matched)", flush=True)
    summary = {name: {path: {"median_us": round(statistics.median(r["cpu_us_per_match"] for r in rs), 1),
                             "min_us": round(min(r["cpu_us_per_match"] for r in rs), 1),
                             "max_us": round(max(r["cpu_us_per_match"] for r in rs), 1)}
                      for path, rs in per.items() if rs}
               for name, per in runs.items()}
    result = {"script": "benchmarks/rendezvous_cpu.py", "argv": sys.argv[1:], "commit": git_commit(),
              "baseline": args.baseline, "started_utc": started, "cores": os.cpu_count(),
              "loadavg_at_start": load0, "loadavg_at_end": os.getloadavg(),
              "config": {"rounds": args.rounds, "matches": args.matches, "paths": paths, "block_ids": 64},
              "summary": summary, "runs": runs}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main()
    else:
        main()
