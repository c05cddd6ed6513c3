"""Control-plane benchmark, open loop: rendezvous matches under Poisson arrivals.

Why open loop: a closed loop (each worker waits for its match before sending the next)
slows down with the server and so never counts queueing delay; it cannot show what
happens past capacity. Here every transfer has a scheduled send time drawn from a
Poisson process; its offer (decode) and completion (prefill) are sent at that time
without waiting for anything, and its latency is the MATCH event seen on the prefill
engine's Subscribe stream minus that *scheduled* time (so a late sender counts too).

    .venv/bin/python benchmarks/control_plane.py [--store memory:// --store etcd1 --store etcd3] \
        [--path unary --path session] [--rate 250 --rate 500 ...] [--seconds 4] [--out FILE]

Per point (store × path × rate): achieved match rate, p50/p99/max latency, answers by
status code (and the first reasons of each non-OK code), ``lost`` transfers (both sides
answered OK, no MATCH within ``--grace`` seconds after the last send), ``half`` ones (one
side refused: the other expires by its deadline), and CPU per match of the server, of
this load generator and (etcd) of the etcd members, from /proc. Per store and path:
``max_rate_p99_under_ms`` = the highest swept rate whose p99 stayed under ``--p99-ms``
(10 ms by default) with every message answered OK and nothing lost, and, with
``--overload``, one more point at that factor × the highest achieved rate (what past
capacity looks like: only OK and RESOURCE_EXHAUSTED are healthy answers).

Paths: ``unary`` sends Offer and Complete as unary RPCs spread over ``--channels``
connections; ``session`` sends them over the two engines' Rendezvous/Session streams
(``KvbatonClient.session``, batched, its defaults); ``session-answer`` also opens the
prefill's subscription as its engine's sole one on the client its completions go out on
(the connector's worker at TP 1), so a completion that makes the match is answered with
it. ``--floor`` adds a server whose rendezvous answers are canned (``benchmarks/floor_server.py``;
session-answer points only): the same gRPC, loop and Session handler with no rendezvous
work, so the difference is what kvbaton's own code costs per match. ``/wN`` after a session path sets the sessions' Nagle window (``/w0``: none, the client
before it), so old and new clients run against the same server in one run. Each point
reports gRPC messages per match through the server (calls in, answers out, the prefill's
Subscribe stream). ``kvbaton serve`` runs in its own process, so the
server's CPU is its own; ``etcd1``/``etcd3`` start a 1- or 3-member etcd on loopback with
``kvbaton/stack/etcd_cluster.py``. The results JSON records the configuration, the git
commit and the load average when each store's runs started.

``--replicas N`` runs N ``kvbaton serve`` processes on one etcd (engine pairs' decode and
prefill clients round robin over them, so each transfer's two sides reach different
replicas); ``--generators G`` spreads the load over G processes of this script, each its
own engine pair and rate/G from one shared start, their latencies pooled (one Python
load generator falls behind its schedule near 1,000 transfers/s).

``--tp N`` gives the prefill N writing ranks, each with its own Subscribe stream that gets
the MATCH (the connector at TP > 1: a completion's answer can be only one rank's MATCH);
``--secure`` runs server and clients as the shipped deploy does (mutual TLS, a bearer
token on every call, peers named). ``--shape-table FILE...`` prints one row per file and
rate of such runs made with ``--floor --rounds``: what a match costs by the fleet's shape.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

import grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvbaton.client import KvbatonClient
from kvbaton.stack.pd_stack import stop_group
from kvbaton.stack.ports import free_port
from kvbaton.stack.security import StackSecurity
from kvbaton.v1 import common_pb2, registrar_pb2, rendezvous_pb2, rendezvous_pb2_grpc

MATCH = rendezvous_pb2.RendezvousEvent.TYPE_MATCH
HEARTBEAT = rendezvous_pb2.RendezvousEvent.TYPE_HEARTBEAT


def cpu_seconds(pid: int | None = None) -> float:
    """User+system CPU of a process (this one by default), from /proc."""
    fields = pathlib.Path(f"/proc/{pid or os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process (MiB), from /proc; None once it is gone."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        # Results files being written are no change to the code measured.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def make_pki(root: pathlib.Path) -> pathlib.Path:
    """``--secure``: the shipped deploy's credentials (``deploy/make-certs.sh``: a CA, the
    control plane's certificate, client certificates and bearer tokens)."""
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(root), "kvbaton"], check=True, timeout=120,
                   capture_output=True)
    return root


def client(addr: str, timeout_s: float, pki: str | None) -> KvbatonClient:
    """A load-generator client: plaintext, or with ``--secure`` mutual TLS and a bearer token
    on every call. The token is the operator's (make-certs.sh scopes engine tokens to its
    two fixed engine ids; every point here registers engines of its own): the server then
    runs the same TLS and the same per-call token check, less one set lookup of the
    engine's id per call."""
    if pki is None:
        return KvbatonClient(addr, timeout_s=timeout_s)
    return StackSecurity(pathlib.Path(pki)).client("operator", addr, timeout_s=timeout_s)


async def register(kv: KvbatonClient, engine_id: str, role, tp: int = 1) -> None:
    """The engine's ``tp`` ranks (no KV head count in the geometry, so a completion's
    ``writers`` says how many prefill ranks write, ranks 0..writers-1)."""
    for r in range(tp):
        rank = registrar_pb2.EngineRank(
            engine_id=engine_id, role=role, tp_size=tp, tp_rank=r, agent_name=f"{engine_id}-{r}", agent_metadata=b"m",
            geometry=common_pb2.KvGeometry(region_base_addrs=[1], bytes_per_block=32768, num_blocks=100000,
                                           tokens_per_block=16, dtype="bfloat16", fingerprint="bench"))
        await kv.call(kv.registrar.RegisterEngine, registrar_pb2.RegisterEngineRequest(rank=rank, ttl_ms=600_000))


class Point:
    """What one open-loop run saw: answers per message, MATCH times per transfer."""

    def __init__(self) -> None:
        self.scheduled: dict[str, float] = {}
        self.answers: dict[str, list[int]] = {}  # transfer id -> status codes of its two messages
        self.matched: dict[str, float] = {}
        self.codes: collections.Counter[str] = collections.Counter()
        self.reasons: dict[str, list[str]] = {}
        self.send_lag: list[float] = []  # how late the generator sent (ms): its own saturation
        self.refused_after: dict[str, list[float]] = {}  # code -> ms from the scheduled send to that answer
        self.stream_events = 0  # messages the prefill's Subscribe stream carried (heartbeats too)

    def answer(self, tid: str, code: grpc.StatusCode, reason: str = "") -> None:
        self.answers.setdefault(tid, []).append(0 if code == grpc.StatusCode.OK else code.value[0])
        self.codes[code.name] += 1
        if code != grpc.StatusCode.OK:
            self.refused_after.setdefault(code.name, []).append((time.perf_counter() - self.scheduled[tid]) * 1000)
            seen = self.reasons.setdefault(code.name, [])
            if len(seen) < 3 and reason not in seen:
                seen.append(reason)


async def open_loop(kv: KvbatonClient, peer: KvbatonClient, stubs: list, *, path: str, rate: float, seconds: float,
                    grace_s: float, tag: str, call_timeout_s: float, transfer_timeout_ms: int, seed: int,
                    offer_lead_ms: float = 0.0, start_at: float | None = None, raw: bool = False, tp: int = 1,
                    bind: bool = False) -> dict:
    pre, dec = f"pre-{tag}", f"dec-{tag}"
    await register(kv, pre, common_pb2.ENGINE_ROLE_PREFILL, tp)
    await register(kv, dec, common_pb2.ENGINE_ROLE_DECODE, tp)
    pt = Point()
    loop = asyncio.get_running_loop()
    ranks_seen: dict[str, int] = {}  # tp > 1: transfer id -> prefill ranks that got its MATCH

    async def consume(rank: int, ready: asyncio.Event) -> None:
        # session-answer: the prefill's subscription is its engine's only one and shares
        # the client its completions go out on (the connector's worker at TP 1), so a
        # completion that makes the match is answered with the MATCH (revision 0), which
        # the Subscribe stream then does not carry. At TP > 1 every writing rank has its
        # own stream (here on one client) and each gets the MATCH: the transfer counts as
        # matched when the last rank has it.
        async for ev in kv.subscribe(pre, rank, heartbeats=True, sole_subscriber=path == "session-answer" and tp == 1):
            if ev.revision:
                pt.stream_events += 1
            if ev.type == HEARTBEAT:
                ready.set()
            elif ev.type == MATCH:
                tid = ev.transfer.transfer_id
                if tp > 1:
                    ranks_seen[tid] = n = ranks_seen.get(tid, 0) + 1
                    if n < tp:
                        continue
                pt.matched.setdefault(tid, time.perf_counter())

    readies = [asyncio.Event() for _ in range(tp)]
    consumers = [loop.create_task(consume(r, readies[r])) for r in range(tp)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in readies)), 10)
    blocks = list(range(64))  # a 1k-token request in 16-token blocks

    def messages(tid: str):
        # bind: each side names its peer, as the router's requests do (a secured control
        # plane requires it).
        return (rendezvous_pb2.OfferRequest(transfer_id=tid, decode_engine_id=dec, block_ids=blocks,
                                            timeout_ms=transfer_timeout_ms, prefill_engine_id=pre if bind else ""),
                rendezvous_pb2.CompleteRequest(transfer_id=tid, prefill_engine_id=pre, block_ids=blocks,
                                               timeout_ms=transfer_timeout_ms, writers=tp,
                                               decode_engine_id=dec if bind else ""))

    async def send_unary(tid: str, i: int) -> None:
        stub = stubs[i % len(stubs)]
        offer, complete = messages(tid)

        async def one(method, req) -> None:
            try:
                await method(req, timeout=call_timeout_s)
                pt.answer(tid, grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                pt.answer(tid, exc.code(), (exc.details() or "") + " | " + (exc.debug_error_string() or ""))

        await asyncio.gather(one(stub.Offer, offer), one(stub.Complete, complete))

    async def send_session(tid: str, i: int) -> None:
        offer, complete = messages(tid)

        async def one(fn, req, after_s: float = 0.0) -> None:
            if after_s:
                await asyncio.sleep(after_s)
            try:
                await fn(req)
                pt.answer(tid, grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                pt.answer(tid, exc.code(), exc.details() or "")

        await asyncio.gather(one(peer.session.offer, offer), one(kv.session.complete, complete, offer_lead_ms / 1000))

    send = send_unary if path == "unary" else send_session
    rng = random.Random(seed)
    schedule, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            break
        schedule.append(t)
    sessions = [peer.session, kv.session] if path != "unary" else []
    before = [dict(x.stats) for x in sessions]
    inflight: set[asyncio.Task] = set()
    t0 = time.perf_counter() + 0.05
    start_late_ms = 0.0
    if start_at is not None:  # one of several generator processes: the start they share (time.monotonic())
        t0 = time.perf_counter() + (start_at - time.monotonic())
        start_late_ms = max(time.perf_counter() - t0, 0.0) * 1000
    for i, at in enumerate(schedule):
        due = t0 + at
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        pt.send_lag.append(max(time.perf_counter() - due, 0.0) * 1000)
        tid = f"{tag}-{i}"
        # Latency counts from when the later side was due (the completion, with a lead).
        pt.scheduled[tid] = due + (offer_lead_ms / 1000 if path != "unary" else 0.0)
        task = loop.create_task(send(tid, i))
        inflight.add(task)
        task.add_done_callback(inflight.discard)
    last_send = time.perf_counter()
    # Answers first (bounded by the call timeout), then the grace period for MATCH events.
    if inflight:
        await asyncio.wait(set(inflight), timeout=call_timeout_s * 2 + 5)
    accepted = [tid for tid, codes in pt.answers.items() if len(codes) == 2 and codes == [0, 0]]
    deadline = max(last_send + grace_s, time.perf_counter() + 0.5)
    while time.perf_counter() < deadline and any(tid not in pt.matched for tid in accepted):
        await asyncio.sleep(0.05)
    for c in consumers:
        c.cancel()
    await asyncio.gather(*consumers, return_exceptions=True)
    lat = [(pt.matched[tid] - pt.scheduled[tid]) * 1000 for tid in accepted if tid in pt.matched]
    span = (max(pt.matched.values()) - t0) if pt.matched else seconds
    # The slowest 1 %: when each was due (s into the point) and how late its MATCH came.
    # Outliers bunched in time point at a stall (a GC pass, a descheduled process, the
    # machine's other load); outliers spread out one by one at something per transfer.
    slow = sorted(((pt.matched[tid] - pt.scheduled[tid]) * 1000, pt.scheduled[tid] - t0, tid)
                  for tid in accepted if tid in pt.matched)[-max(len(lat) // 100, 1):] if lat else []
    sent = [(x.stats["sent_calls"] - b["sent_calls"], x.stats["sent_batches"] - b["sent_batches"])
            for x, b in zip(sessions, before)]
    result = {
        "path": path, "target_rate": rate, "seconds": seconds, "transfers": len(schedule),
        "accepted": len(accepted), "matches": len(lat),
        "achieved_rate": len(lat) / max(span, seconds),
        "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": max(lat) if lat else None,
        "answers": dict(pt.codes), "reasons": pt.reasons,
        "lost": sum(1 for tid in accepted if tid not in pt.matched),
        "half": sum(1 for codes in pt.answers.values() if sorted(codes)[0] == 0 and any(codes)),
        "unanswered": sum(1 for tid in pt.scheduled if len(pt.answers.get(tid, ())) < 2),
        "send_lag_p99_ms": pct(pt.send_lag, 99),
        "slowest_1pct": [{"due_s": round(due_s, 4), "ms": round(ms, 2)} for ms, due_s, _ in sorted(slow, key=lambda x: x[1])],
        # When refusals came: at once (shed) or after queueing (what a client waited for nothing).
        "refused_after_ms": {code: {"p50": pct(v, 50), "max": max(v)} for code, v in pt.refused_after.items()},
    }
    received = [x.stats["received_batches"] - b["received_batches"] for x, b in zip(sessions, before)]
    # gRPC messages per match through the server: calls in and answers out (a unary call
    # is one of each), plus what the prefill's Subscribe stream carried (heartbeats too).
    calls = sum(len(c) for c in pt.answers.values())
    wire = (sum(b for _, b in sent) + sum(received)) if sessions else 2 * calls
    result["messages_per_match"] = (wire + pt.stream_events) / max(len(lat), 1)
    result["stream_events_per_match"] = pt.stream_events / max(len(lat), 1)
    result["offer_lead_ms"] = offer_lead_ms if path != "unary" else 0.0
    result["tp"] = tp
    if start_at is not None:
        result["start_late_ms"] = start_late_ms
    if raw:  # what merge_generators() needs to pool several generator processes' points
        result["_lat_due"] = [((pt.matched[tid] - pt.scheduled[tid]) * 1000, pt.scheduled[tid] - t0)
                              for tid in accepted if tid in pt.matched]
        result["_refused"] = pt.refused_after
        result["_messages"] = wire + pt.stream_events
        result["_span_s"] = span
        result["_sent"] = [sum(c for c, _ in sent), sum(b for _, b in sent)]
    if sent:
        result["calls_per_batch"] = sum(c for c, _ in sent) / max(sum(b for _, b in sent), 1)
        # Shed calls the session clients sent again after the server's retry hint (their
        # final answers are in "answers"; the wait is in the latency).
        result["shed_retries"] = sum(x.stats.get("shed_retries", 0) - b.get("shed_retries", 0)
                                     for x, b in zip(sessions, before))
    return result


async def generator_point(job: dict) -> dict:
    """One generator process's share of a point (``--generators``): its own decode/prefill
    engine pair, the decode's clients on ``job['dec_addr']`` and the prefill's on
    ``job['pre_addr']`` (round robin over the replicas), its share of the rate from the
    shared start ``job['start_at']`` (time.monotonic(), one clock for every process here)."""
    addrs = job["unary_addrs"]
    chans = ([grpc.aio.insecure_channel(addrs[c % len(addrs)], options=[("grpc.use_local_subchannel_pool", 1)])
              for c in range(job["channels"])] if job["path"] == "unary" else [])
    try:
        async with client(job["pre_addr"], job["call_timeout"], job["pki"]) as kv, \
                client(job["dec_addr"], job["call_timeout"], job["pki"]) as peer:
            await kv.wait_ready(30)
            await peer.wait_ready(30)
            for c in chans:
                await asyncio.wait_for(c.channel_ready(), 10)
            if job["window"] is not None:
                kv.session.max_in_flight = peer.session.max_in_flight = job["window"]
            c0 = cpu_seconds()
            r = await open_loop(kv, peer, [rendezvous_pb2_grpc.RendezvousStub(c) for c in chans], path=job["path"],
                                rate=job["rate"], seconds=job["seconds"], grace_s=job["grace"], tag=job["tag"],
                                call_timeout_s=job["call_timeout"], transfer_timeout_ms=job["transfer_timeout_ms"],
                                seed=job["seed"], offer_lead_ms=job["offer_lead_ms"], start_at=job["start_at"], raw=True,
                                tp=job["tp"], bind=job["pki"] is not None)
            r["_cpu_s"] = cpu_seconds() - c0
    finally:
        for c in chans:
            await c.close(grace=0)
    return r


def merge_generators(parts: list[dict], rate: float) -> dict:
    """Several generator processes' results of one point as one point: latencies pooled
    (p50/p99/max over every match), answers and counts summed, rates summed."""
    lat_due = sorted(x for r in parts for x in r.pop("_lat_due"))
    lat = [ms for ms, _ in lat_due]
    refused: dict[str, list[float]] = {}
    for r in parts:
        for code, v in r.pop("_refused").items():
            refused.setdefault(code, []).extend(v)
    answers: collections.Counter[str] = collections.Counter()
    reasons: dict[str, list[str]] = {}
    for r in parts:
        answers.update(r["answers"])
        for code, v in r["reasons"].items():
            reasons.setdefault(code, [])
            reasons[code] += [x for x in v if x not in reasons[code]][:3 - len(reasons[code])]
    matches = len(lat)
    calls, batches = (sum(r["_sent"][i] for r in parts) for i in (0, 1))
    m = {
        "path": parts[0]["path"], "target_rate": rate, "seconds": parts[0]["seconds"],
        "transfers": sum(r["transfers"] for r in parts), "accepted": sum(r["accepted"] for r in parts),
        "matches": matches,
        "achieved_rate": matches / max(max(r["_span_s"] for r in parts), parts[0]["seconds"]),
        "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": max(lat) if lat else None,
        "answers": dict(answers), "reasons": reasons,
        **{k: sum(r[k] for r in parts) for k in ("lost", "half", "unanswered")},
        "send_lag_p99_ms": max((r["send_lag_p99_ms"] or 0.0) for r in parts),
        "start_late_ms": max(r.get("start_late_ms", 0.0) for r in parts),
        "slowest_1pct": [{"due_s": round(due_s, 4), "ms": round(ms, 2)}
                         for ms, due_s in sorted(lat_due[-max(matches // 100, 1):], key=lambda x: x[1])] if lat else [],
        "refused_after_ms": {code: {"p50": pct(v, 50), "max": max(v)} for code, v in refused.items()},
        "messages_per_match": sum(r["_messages"] for r in parts) / max(matches, 1),
        "offer_lead_ms": parts[0]["offer_lead_ms"], "tp": parts[0].get("tp", 1),
        "generator_cpu_s": [r["_cpu_s"] for r in parts],
        "by_generator": [{"target_rate": r["target_rate"], "matches": r["matches"], "p99_ms": r["p99_ms"],
                          "send_lag_p99_ms": r["send_lag_p99_ms"]} for r in parts],
    }
    if batches:
        m["calls_per_batch"] = calls / batches
        m["shed_retries"] = sum(r.get("shed_retries", 0) for r in parts)
    return m


async def run_generators(args, addrs: list[str], *, path: str, window: int | None, rate: float, tag: str,
                         seed: int) -> dict:
    """A point's load from ``args.generators`` processes of this script (``--generator-job``),
    engine pair g's decode on replica g mod N and its prefill on the next replica: with
    several replicas every transfer's two sides reach different servers, as behind a load
    balancer. Each sends rate/G from one shared start."""
    g_n, n = args.generators, len(addrs)
    start_at = time.monotonic() + args.generator_start_s
    jobs, procs, outs = [], [], []
    for g in range(g_n):
        out = tempfile.NamedTemporaryFile(prefix="kvbaton-gen-", suffix=".json", delete=False)
        out.close()
        outs.append(pathlib.Path(out.name))
        jobs.append({"dec_addr": addrs[g % n], "pre_addr": addrs[(g + 1) % n], "unary_addrs": addrs,
                     "channels": max(args.channels // g_n, 1), "call_timeout": args.call_timeout, "path": path,
                     "window": window, "rate": rate / g_n, "seconds": args.seconds, "grace": args.grace,
                     "tag": f"{tag}g{g}", "transfer_timeout_ms": args.transfer_timeout_ms, "seed": seed * 1000 + g,
                     "offer_lead_ms": args.offer_lead_ms, "start_at": start_at, "out": out.name, "tp": args.tp,
                     "pki": args.pki})
        procs.append(await asyncio.create_subprocess_exec(sys.executable, str(pathlib.Path(__file__).resolve()),
                                                          "--generator-job", json.dumps(jobs[-1])))
    codes = [await p.wait() for p in procs]
    try:
        if any(codes):
            raise RuntimeError(f"generator processes exited {codes}")
        parts = [json.loads(o.read_text()) for o in outs]
    finally:
        for o in outs:
            o.unlink(missing_ok=True)
    m = merge_generators(parts, rate)
    m["generators"] = g_n
    m["engine_pairs"] = [{"decode_replica": g % n, "prefill_replica": (g + 1) % n} for g in range(g_n)]
    return m


def generator_job(spec: str) -> int:
    job = json.loads(spec)
    r = asyncio.run(generator_point(job))
    pathlib.Path(job["out"]).write_text(json.dumps(r))
    return 0


def profile_shares(path: pathlib.Path) -> dict:
    """From py-spy's raw (folded) stacks of the server: how many samples were busy (not
    waiting in the selector) and what share of those had kvbaton's own code on the stack
    (services/ or kvbaton/, beyond the ``serve`` entry points that are always there); the
    rest is gRPC's and the event loop's."""
    total = idle = ours = 0
    entry = ("(kvbaton/cli.py:", "serve (services/server.py:")
    if not path.exists():
        return {"error": "no profile written"}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        if "(selectors.py:" in frames[-1] or frames[-1].startswith("LoopLag._wrap_selector"):
            idle += n
            continue
        mine = [f for f in frames if ("(services/" in f or "(kvbaton/" in f) and not any(e in f for e in entry)]
        ours += bool(mine)
    busy = total - idle
    return {"samples": total, "busy_samples": busy, "kvbaton_share_of_busy": ours / busy if busy else None}


PATHS = ("unary", "session", "session-answer")


def parse_path(spec: str) -> tuple[str, int | None]:
    """``session-answer/w0`` -> ("session-answer", 0); no /wN: (name, None), the default."""
    name, _, w = spec.partition("/w")
    if name not in PATHS or (w and (not w.isdigit() or name == "unary")):
        raise ValueError(f"path {spec!r}: one of {', '.join(PATHS)}, session ones optionally with /wN")
    return name, int(w) if w else None


def parse_path_arg(spec: str) -> str:
    try:
        parse_path(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def healthy(r: dict, p99_ms: float) -> bool:
    ok_only = set(r["answers"]) <= {"OK"}
    return (ok_only and r["lost"] == 0 and r["p99_ms"] is not None and r["p99_ms"] < p99_ms
            and r["achieved_rate"] >= 0.9 * r["target_rate"])


def export_baseline(commit: str) -> pathlib.Path:
    """The tree of ``commit`` in a temp dir, importable as ``kvbaton`` (with its
    ``kvbaton.services`` and ``kvbaton.connector``) ahead of this checkout's editable install."""
    dest = pathlib.Path(tempfile.mkdtemp(prefix="kvbaton-baseline-"))
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=60)
    for name in ("services", "connector"):
        link = dest / "kvbaton" / name
        if not link.exists():
            link.symlink_to(dest / name, target_is_directory=True)
    return dest


async def run_store(args, store_url: str, store_pids: list[int], variant: str = "current",
                    serve_args: tuple[str, ...] = ()) -> dict:
    env = dict(os.environ, KVBATON_LOG_LEVEL="WARNING")
    cwd = None
    if variant == "baseline":
        cwd = str(args.baseline_dir)
        env["PYTHONPATH"] = cwd
    # The floor: the same server with canned rendezvous answers (benchmarks/floor_server.py).
    entry = [str(ROOT / "benchmarks" / "floor_server.py")] if variant == "floor" else ["-m", "kvbaton.cli"]
    # --replicas: N servers on the one store (etcd), each in its own process.
    addrs, servers, gc_outs = [], [], []
    for _ in range(args.replicas):
        port = free_port()
        addrs.append(f"127.0.0.1:{port}")
        # Through benchmarks/gc_probe.py: the server's garbage collections, timed, per point.
        gc_out = tempfile.NamedTemporaryFile(prefix="kvbaton-gc-", suffix=".json", delete=False)
        gc_out.close()
        gc_outs.append(pathlib.Path(gc_out.name))
        servers.append(subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "gc_probe.py"), *entry, "serve",
                                         *(StackSecurity(pathlib.Path(args.pki)).serve_args(store_url) if args.pki
                                           else ["--insecure"]),
                                         "--listen", addrs[-1], "--store", store_url, *serve_args],
                                        env=dict(env, KVBATON_GC_PROBE_OUT=gc_out.name), start_new_session=True,
                                        cwd=cwd))
    server = servers[0]
    server_pids = [x.pid for x in servers]
    profiler = None
    if args.profile:  # py-spy on the server for this store's whole run (its own CPU is not the server's)
        profile_path = f"{args.profile}.{len(args.profiled)}.txt"
        profiler = subprocess.Popen([str(ROOT / ".venv" / "bin" / "py-spy"), "record", "-p", str(server.pid), "-r", "200",
                                     "-f", "raw", "-o", profile_path,
                                     # --native pauses the server per sample (py-spy refuses it with --nonblocking)
                                     *(["--native"] if args.profile_native else ["--nonblocking"])],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        args.profiled.append(store_url)
    out: dict = {"variant": variant, "serve_args": list(serve_args), "store_url": store_url, "loadavg_at_start": os.getloadavg(), "points": [], "summary": {},
                 "replicas": args.replicas, "generators": args.generators}
    # In this process (one generator): the decode's client on the first replica, the
    # prefill's on the next one (the same one when there is one), unary calls round robin.
    channels = [grpc.aio.insecure_channel(addrs[c % len(addrs)], options=[("grpc.use_local_subchannel_pool", 1)])
                for c in range(args.channels if "unary" in args.path else 0)]  # the unary path's only
    stubs = [rendezvous_pb2_grpc.RendezvousStub(c) for c in channels]
    try:
        async with client(addrs[1 % len(addrs)], args.call_timeout, args.pki) as kv, \
                client(addrs[0], args.call_timeout, args.pki) as peer:
            await kv.wait_ready(30)
            await peer.wait_ready(30)
            for a in addrs[2:]:
                async with client(a, args.call_timeout, args.pki) as other:
                    await other.wait_ready(30)
            for c in channels:
                await asyncio.wait_for(c.channel_ready(), 10)
            n = 0
            # Transfer and engine ids unique per server: servers of one run may share an
            # etcd cluster, where another's matched transfers would answer as duplicates.
            # (And per server run: with --rounds the same server runs again on the same etcd.)
            args.server_runs = getattr(args, "server_runs", 0) + 1
            prefix = f"{variant}{args.server_runs}-"
            for spec in args.path:
                path, window = parse_path(spec)
                if variant == "floor" and path != "session-answer":
                    continue  # the floor's points: session-answer (at --tp > 1, its MATCH on the rank streams)
                default_window = kv.session.max_in_flight
                if window is not None:  # the sessions' Nagle window (RendezvousSession.max_in_flight)
                    kv.session.max_in_flight = peer.session.max_in_flight = window
                best, top = None, 0.0
                for rate in args.rate:
                    n += 1
                    r = await measure(args, kv, peer, stubs, server_pids, store_pids, path=path, rate=rate,
                                      tag=f"{prefix}{path[0]}{n}", seed=n, addrs=addrs, window=window)
                    r["path"] = spec
                    out["points"].append(r)
                    top = max(top, r["achieved_rate"])
                    if healthy(r, args.p99_ms):
                        best = rate
                    elif r["achieved_rate"] < 0.8 * rate and args.stop_when_saturated:
                        break  # saturated: higher rates only take longer to say the same
                summary = {f"max_rate_p99_under_{args.p99_ms:g}ms": best, "max_achieved_rate": top}
                if args.overload:
                    n += 1
                    r = await measure(args, kv, peer, stubs, server_pids, store_pids, path=path,
                                      rate=round(args.overload * top), tag=f"{prefix}{path[0]}{n}", seed=n,
                                      addrs=addrs, window=window)
                    r["path"] = spec
                    r["overload_of"] = top
                    out["points"].append(r)
                    summary["overload"] = {"rate": r["target_rate"], "answers": r["answers"], "lost": r["lost"]}
                out["summary"][spec] = summary
                if window is not None:
                    kv.session.max_in_flight = peer.session.max_in_flight = default_window
    finally:
        for c in channels:
            await c.close(grace=0)
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            try:
                profiler.wait(30)
            except subprocess.TimeoutExpired:
                profiler.kill()
                profiler.wait(5)
            out["profile"] = {"file": profile_path, **profile_shares(pathlib.Path(profile_path))}
        for x in servers:
            stop_group(x)
        out["loadavg_at_end"] = os.getloadavg()
        out["gc"] = attach_gc(gc_outs, out["points"])
        for g in gc_outs:
            g.unlink(missing_ok=True)
    return out


def gc_summary(passes: list[list[float]], t0: float | None = None) -> dict:
    """Collections (gc_probe.py's [start, generation, cpu ms, wall ms, collected]): how many
    per generation, their CPU in all, the longest, and each pass over 5 ms (wall) with its
    start in s after ``t0`` (a point's start: line them up with its ``slowest_1pct``)."""
    n: dict[str, int] = {}
    for p in passes:
        n[str(int(p[1]))] = n.get(str(int(p[1])), 0) + 1
    return {"passes": n, "cpu_ms": round(sum(p[2] for p in passes), 2),
            "max_cpu_ms": round(max((p[2] for p in passes), default=0.0), 2),
            "max_wall_ms": round(max((p[3] for p in passes), default=0.0), 2),
            "over_5ms": [{"at_s": round(p[0] - t0, 3) if t0 is not None else None, "gen": int(p[1]),
                          "wall_ms": round(p[3], 2), "cpu_ms": round(p[2], 2)} for p in passes if p[3] > 5]}


def attach_gc(paths: list[pathlib.Path], points: list[dict]) -> dict:
    """Each point's collections (by its monotonic window) into the point as ``gc`` (the
    first replica's; with several, every replica's in ``gc_by_replica``); the server's
    whole life (start-up included) returned (the first replica's, the others' in ``replicas``)."""
    windows = [r.pop("_window") for r in points]
    whole = []
    for i, path in enumerate(paths):
        try:
            probe = json.loads(path.read_text())
        except (OSError, ValueError):
            whole.append({"error": "no gc probe output (the server did not exit cleanly)"})
            continue
        passes = probe["passes"]
        for r, (t0, t1) in zip(points, windows):
            g = gc_summary([p for p in passes if t0 <= p[0] < t1], t0)
            if i == 0:
                r["gc"] = g
            if len(paths) > 1:
                r.setdefault("gc_by_replica", []).append(g)
        whole.append({"threshold": probe["threshold"], **gc_summary(passes)})
    return {**whole[0], **({"replicas": whole[1:]} if len(whole) > 1 else {})}


async def measure(args, kv, peer, stubs, server_pids: list[int], store_pids: list[int], *, path: str, rate: float,
                  tag: str, seed: int, addrs: list[str], window: int | None) -> dict:
    s0, c0 = [cpu_seconds(p) for p in server_pids], cpu_seconds()
    started = time.monotonic()  # the clock benchmarks/gc_probe.py stamps collections with
    e0 = sum(cpu_seconds(p) for p in store_pids)
    if args.generators > 1:
        r = await run_generators(args, addrs, path=path, window=window, rate=rate, tag=tag, seed=seed)
    else:
        r = await open_loop(kv, peer, stubs, path=path, rate=rate, seconds=args.seconds, grace_s=args.grace, tag=tag,
                            call_timeout_s=args.call_timeout, transfer_timeout_ms=args.transfer_timeout_ms, seed=seed,
                            offer_lead_ms=args.offer_lead_ms, tp=args.tp, bind=args.pki is not None)
    per = max(r["matches"], 1)
    by_replica = [(cpu_seconds(p) - s) / per * 1e6 for p, s in zip(server_pids, s0)]
    # Every replica's CPU (with several, the sum: what a match costs the control plane).
    r["server_cpu_us_per_match"] = sum(by_replica)
    if len(server_pids) > 1:
        r["replicas"] = len(server_pids)
        r["server_cpu_us_per_match_by_replica"] = by_replica
    # Whether the server's memory stays bounded point after point (a GC setting, a cache).
    r["server_rss_mib"] = max((x for x in map(rss_mib, server_pids) if x is not None), default=None)
    r["_window"] = (started, time.monotonic())  # replaced by the point's collections (attach_gc)
    # The load generator's CPU: this process's, or with --generators the sum of theirs.
    gen_s = sum(r["generator_cpu_s"]) if "generator_cpu_s" in r else cpu_seconds() - c0
    r["client_cpu_us_per_match"] = gen_s / per * 1e6
    if store_pids:
        r["store_cpu_us_per_match"] = (sum(cpu_seconds(p) for p in store_pids) - e0) / per * 1e6
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"  {path:7s} {rate:6.0f}/s: {r['achieved_rate']:6.0f}/s  p50 {fmt(r['p50_ms'])}  p99 {fmt(r['p99_ms'])}  "
          f"max {fmt(r['max_ms'])} ms  answers {r['answers']}  lost {r['lost']}  half {r['half']}  "
          f"cpu/match server {r['server_cpu_us_per_match']:.0f} us client {r['client_cpu_us_per_match']:.0f} us"
          + (f" etcd {r['store_cpu_us_per_match']:.0f} us" if store_pids else "")
          + f"  msgs/match {r['messages_per_match']:.2f}"
          + (f"  rss {r['server_rss_mib']:.0f} MiB" if r["server_rss_mib"] is not None else "")
          + (f"  batch {r['calls_per_batch']:.1f}" if "calls_per_batch" in r else ""), flush=True)
    return r


def gc_cell(g: dict | None) -> str:
    """A point's collections as ``young/middle/full, longest ms`` (wall), e.g. ``7/1/0, 3.2``."""
    if not g:
        return "–"
    n = g["passes"]
    return f"{n.get('0', 0)}/{n.get('1', 0)}/{n.get('2', 0)}, {g['max_wall_ms']:.1f}"


def markdown(results: dict) -> str:
    """The tables the READMEs quote, from one results file (one run)."""
    p99 = results["config"]["p99_ms"]
    fmt = lambda v, nd=1: "–" if v is None else f"{v:,.{nd}f}"  # noqa: E731
    lines = [f"`{results['script']}` {' '.join(results['argv'])} — commit `{results['commit'][:12]}{'-dirty' if results['commit'].endswith('-dirty') else ''}`, "
             f"started {results['started_utc']}, {results['machine']}.", ""]
    for st in results["stores"]:
        end = f"; at end {', '.join(f'{x:.1f}' for x in st['loadavg_at_end'])}" if "loadavg_at_end" in st else ""
        rnd = f", round {st['round']}" if "round" in st else ""
        rss = any("server_rss_mib" in r for r in st["points"])  # recorded since issue 17's fourth pass
        gcs = any("gc" in r for r in st["points"])  # likewise (benchmarks/gc_probe.py)
        reps = st.get("replicas", 1)
        gens = st.get("generators", 1)
        rnd += (f", {reps} replicas" if reps > 1 else "") + (f", {gens} generator processes" if gens > 1 else "")
        tp = results["config"].get("tp", 1)
        rnd += f", prefill TP {tp} (a Subscribe stream per rank)" if tp > 1 else ""
        rnd += ", mutual TLS + bearer token" if results["config"].get("secure") else ""
        lines += [f"**{st['store']}, {st.get('variant', 'current')}{rnd}** (load average at start "
                  f"{', '.join(f'{x:.1f}' for x in st['loadavg_at_start'])}{end}):", "",
                  "| path | offered /s | achieved /s | p50 ms | p99 ms | max ms | answers | lost | server CPU µs/match "
                  "| messages/match | generator CPU µs/match" + (" | etcd CPU µs/match" if "etcd" in st["store"] else "")
                  + (" | server RSS MiB" if rss else "") + (" | GC passes (0/1/2), longest ms" if gcs else "") + " |",
                  "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:" + ("|---:" if "etcd" in st["store"] else "")
                  + ("|---:" if rss else "") + ("|---:" if gcs else "") + "|"]
        for r in st["points"]:
            answers = ", ".join(f"{k} {v:,}" for k, v in sorted(r["answers"].items()))
            over = f" (2× {r['overload_of']:,.0f})" if "overload_of" in r else ""
            lead = f" (offer {r['offer_lead_ms']:g} ms ahead)" if r.get("offer_lead_ms") else ""
            lines.append(f"| {r['path']}{lead} | {r['target_rate']:,.0f}{over} | {r['achieved_rate']:,.0f} | {fmt(r['p50_ms'], 2)} "
                         f"| {fmt(r['p99_ms'], 2)} | {fmt(r['max_ms'], 1)} | {answers} | {r['lost']} "
                         f"| {r['server_cpu_us_per_match']:,.0f} | {fmt(r.get('messages_per_match'), 2)} "
                         f"| {r['client_cpu_us_per_match']:,.0f}"
                         + (f" | {r.get('store_cpu_us_per_match', 0):,.0f}" if "etcd" in st["store"] else "")
                         + (f" | {fmt(r.get('server_rss_mib'), 0)}" if rss else "")
                         + (f" | {gc_cell(r.get('gc'))}" if gcs else "") + " |")
        for path, sm in st["summary"].items():
            lines.append(f"\n{path}: highest swept rate with p99 < {p99:g} ms, only OK answers and nothing lost: "
                         f"{fmt(sm.get(f'max_rate_p99_under_{p99:g}ms'), 0)} /s; highest achieved "
                         f"{fmt(sm['max_achieved_rate'], 0)} /s.")
        lines.append("")
    return "\n".join(lines)


def shape_table(paths: list[str]) -> str:
    """One row per (results file, offered rate) of runs made with ``--floor`` and
    ``--rounds``: messages and server CPU per match of this server and of the floor, their
    difference round by round (what kvbaton's own code costs), p99, answers: how a match's
    cost moves with the fleet's shape (engine pairs, prefill TP, TLS), each file one run."""
    def span(v: list[float], nd: int = 0) -> str:
        lo, hi = f"{min(v):,.{nd}f}", f"{max(v):,.{nd}f}"
        return lo if lo == hi else f"{lo}–{hi}"

    lines = ["| results file | engine pairs | prefill TP | TLS + token | offered /s | messages per match, this server / "
             "floor | server CPU µs per match, this server | the floor | this server − floor (same round) "
             "| p99 ms, this server / floor | answers, lost |", "|---|---:|---:|---|---:|---|---:|---:|---:|---|---|"]
    for path in paths:
        d = json.loads(pathlib.Path(path).read_text())
        cfg = d["config"]
        by: dict[tuple[str, float], dict[int, dict]] = {}
        for st in d["stores"]:
            for r in st["points"]:
                by.setdefault((st["variant"], r["target_rate"]), {})[st.get("round", 1)] = r
        for rate in sorted({rate for _, rate in by}):
            cur, flo = by.get(("current", rate), {}), by.get(("floor", rate), {})
            both = sorted(set(cur) & set(flo))
            if not both:
                continue
            pts = [cur[n] for n in both] + [flo[n] for n in both]
            answers = sorted({k for r in pts for k in r["answers"]})
            lines.append(
                f"| `{pathlib.Path(path).name}` | {cfg.get('generators', 1)} | {cfg.get('tp', 1)} "
                f"| {'yes' if cfg.get('secure') else 'no'} | {rate:,.0f} "
                f"| {span([cur[n]['messages_per_match'] for n in both], 2)} / {span([flo[n]['messages_per_match'] for n in both], 2)} "
                f"| {span([cur[n]['server_cpu_us_per_match'] for n in both])} | {span([flo[n]['server_cpu_us_per_match'] for n in both])} "
                f"| {span([cur[n]['server_cpu_us_per_match'] - flo[n]['server_cpu_us_per_match'] for n in both])} "
                f"| {span([cur[n]['p99_ms'] for n in both], 1)} / {span([flo[n]['p99_ms'] for n in both], 1)} "
                f"| {', '.join(answers)}; {sum(r['lost'] for r in pts)} lost |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--generator-job":  # one of --generators' processes
        return generator_job(sys.argv[2])
    if len(sys.argv) >= 3 and sys.argv[1] == "--shape-table":  # results files of --floor --rounds runs
        print(shape_table(sys.argv[2:]))
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        print(markdown(json.loads(pathlib.Path(sys.argv[2]).read_text())))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", action="append",
                   help="memory://, etcd://h:p[,h:p], etcd1 or etcd3 (a 1- or 3-member etcd on loopback started "
                        "here); repeatable (default memory://)")
    p.add_argument("--rate", type=float, action="append", help="offered transfers/s, swept in order (repeatable)")
    p.add_argument("--path", action="append", type=parse_path_arg,
                   help="unary, session or session-answer, the session ones optionally with /wN: the sessions' "
                        "Nagle window (messages in flight, RendezvousSession.max_in_flight; /w0: no window, the "
                        "client before it); repeatable; default unary and session")
    p.add_argument("--offer-lead-ms", type=float, default=0.0,
                   help="session paths: send each offer this long before its completion (decode offers when it "
                        "admits a request, prefill completes after computing it); latency counts from the "
                        "completion's scheduled time")
    p.add_argument("--replicas", type=int, default=1,
                   help="`kvbaton serve` processes on the one store (etcd only when > 1); the decode's client on one "
                        "replica, the prefill's on the next (round robin), so with several every transfer's two "
                        "sides reach different replicas; server CPU per match is the sum over the replicas")
    p.add_argument("--generators", type=int, default=1,
                   help="load generator processes (this script, each its own decode/prefill engine pair and rate/N "
                        "from one shared start); 1: the load comes from this process, as before")
    p.add_argument("--tp", type=int, default=1,
                   help="prefill tensor-parallel size: every completion has this many writers, and each writing "
                        "rank its own Subscribe stream that gets the MATCH (>1: session-answer falls back to the "
                        "streams, as the connector does, since the answer can only be one rank's MATCH; the "
                        "floor then offers its canned MATCH to those streams)")
    p.add_argument("--secure", action="store_true",
                   help="as the shipped deploy: mutual TLS and a bearer token on every call (credentials from "
                        "deploy/make-certs.sh in a temporary directory; session paths only); each side names its "
                        "peer engine, as the router's requests do (a secured control plane requires it)")
    p.add_argument("--generator-start-s", type=float, default=5.0,
                   help="with --generators > 1: how long after a point is set up its processes start sending (they "
                        "import gRPC and connect first; a late one records start_late_ms)")
    p.add_argument("--seconds", type=float, default=4.0, help="Poisson arrivals per point")
    p.add_argument("--grace", type=float, default=3.0, help="s after the last send to wait for MATCH events")
    p.add_argument("--channels", type=int, default=4, help="connections the unary path spreads calls over")
    p.add_argument("--call-timeout", type=float, default=5.0, help="deadline of each call (s)")
    p.add_argument("--transfer-timeout-ms", type=int, default=10_000, help="timeout_ms of each side")
    p.add_argument("--p99-ms", type=float, default=10.0)
    p.add_argument("--overload", type=float, default=0.0,
                   help="after the sweep, one point at this factor x the highest achieved rate (e.g. 2)")
    p.add_argument("--stop-when-saturated", action=argparse.BooleanOptionalAction, default=True,
                   help="skip a path's higher rates once achieved < 80%% of offered")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:SERVE-ARGS, a server of this tree run with these extra `kvbaton serve` arguments, e.g. "
                        "'uvloop:--event-loop uvloop' (repeatable, in this order; default 'current:')")
    p.add_argument("--baseline", default="",
                   help="also run every store against `kvbaton serve` of this commit (after the current tree, same run)")
    p.add_argument("--floor", action="store_true",
                   help="also run the session-answer points against benchmarks/floor_server.py (this server with "
                        "canned rendezvous answers): what a match costs beside kvbaton's rendezvous work")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the servers (variants, --baseline, --floor) this many times, every other round in "
                        "reverse order")
    p.add_argument("--profile", default="", help="py-spy the server (raw folded stacks to PROFILE.<n>.txt)")
    p.add_argument("--profile-native", action="store_true",
                   help="with --profile: py-spy --native (C frames of gRPC core, protobuf and the loop too)")
    p.add_argument("--table", metavar="RESULTS", help="only print the markdown tables of a results file")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "control_plane.json"))
    p.add_argument("--machine", default="", help="what this machine is, recorded in the results (beside its core count)")
    p.add_argument("--commit", default="", help="the commit measured, where this tree is a copy with no git history")
    args = p.parse_args()
    if args.replicas > 1 and any(not (st.startswith("etcd")) for st in (args.store or ["memory://"])):
        p.error("--replicas > 1 needs an etcd store (each memory store lives inside its own server)")
    args.rate = args.rate or [250.0, 500.0, 750.0, 1000.0, 1500.0]
    args.path = args.path or ["unary", "session"]
    args.profiled = []
    args.pki = None
    if args.secure:
        if "unary" in args.path:
            p.error("--secure: session paths only (the unary path's channels are plaintext)")
        import atexit
        import shutil

        pki_dir = tempfile.mkdtemp(prefix="kvbaton-bench-pki-")
        atexit.register(shutil.rmtree, pki_dir, ignore_errors=True)  # keys and tokens: never left behind
        args.pki = str(make_pki(pathlib.Path(pki_dir)))
    args.variant = args.variant or ["current:"]
    args.baseline_dir = export_baseline(args.baseline) if args.baseline else None
    if args.baseline:
        args.baseline_commit = subprocess.run(["git", "rev-parse", args.baseline], cwd=ROOT, capture_output=True,
                                              text=True, timeout=10).stdout.strip()
    machine = f"{os.cpu_count()} cores" + (f", {args.machine}" if args.machine else "")
    results = {"script": "benchmarks/control_plane.py", "argv": sys.argv[1:], "commit": args.commit or git_commit(),
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine,
               "loadavg_at_start": list(os.getloadavg()),
               "config": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items() if k != "out"},
               "stores": []}
    for store in args.store or ["memory://"]:
        cluster = None
        store_pids: list[int] = []
        if store in ("etcd1", "etcd3"):
            from kvbaton.stack.etcd_cluster import EtcdCluster

            cluster = EtcdCluster(int(store[-1])).start()
            store_url, store_pids = cluster.url, [m.proc.pid for m in cluster.members if m.proc is not None]
        else:
            store_url = store
        try:
            variants = [(v.split(":", 1)[0], tuple(v.split(":", 1)[1].split())) for v in args.variant]
            extra = [*([("baseline", ())] if args.baseline else []), *([("floor", ())] if args.floor else [])]
            servers = [*variants, *extra]
            for n in range(args.rounds):
                # Later rounds alternate the order, so no server always runs first (at the
                # highest load) or last: the same servers compared within one run both ways.
                for variant, serve_args in (servers if n % 2 == 0 else servers[::-1]):
                    print(f"[{store}] {variant}" + (f" (round {n + 1})" if args.rounds > 1 else ""), flush=True)
                    r = asyncio.run(run_store(args, store_url, store_pids, variant, serve_args))
                    if args.rounds > 1:
                        r["round"] = n + 1
                    r["store"] = f"etcd ({store[-1]} member{'s' if store == 'etcd3' else ''}, loopback)" if cluster else store
                    results["stores"].append(r)
        finally:
            if cluster is not None:
                cluster.stop()
    if args.baseline_dir is not None:
        import shutil

        shutil.rmtree(args.baseline_dir, ignore_errors=True)
    results["loadavg_at_end"] = list(os.getloadavg())
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
