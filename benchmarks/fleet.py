"""A fleet under agent conversations: 2 prefill + 2 decode vLLM engines behind a router
that discovers them, reuse on vs off in the same run (issue 13).

    flock /tmp/kvbaton-heavy.lock .venv/bin/python benchmarks/fleet.py [--convs 3] [--turns 6]
        [--first-tokens 400] [--new-tokens 300] [--output-tokens 16] [--think-s 0.5] [--mode pull]

Three parts, one results file (``benchmarks/results/fleet.json``, with the configuration and
the commit) and a plot (``benchmarks/results/fleet_ttft_per_turn.png``):

1. **Decision cost, in-process:** ``choice.Fleet.choose`` on a 2P+2D fleet and on a
   32P+32D one, with load on the engines and a conversation holder, timed per call
   (``perf_counter_ns``): p50/p99 in µs. The routers' own running numbers over the real
   run (``/kvbaton/fleet``) are reported beside them.
2. **Latency the router adds:** stand-in engines that answer at once (another process) and
   the router (its own process, pull, static 1P+1D); the client sends ``--overhead-requests``
   requests, one at a time, straight to prefill then straight to decode, and the same
   through the router; added = median(router) − median(prefill + decode). Sequential on
   purpose: this is a per-request cost, not a throughput test.
3. **The fleet:** control plane, ``p0 p1`` (core 0) and ``d0 d1`` (core 1), prefix caching on
   everywhere, one router following the registrar. ``--convs`` conversations **with** a
   conversation id (reuse on: decode retains each turn under a lease, the router keeps the
   conversation on that decode and offers its blocks to whichever prefill it chooses) and
   ``--convs`` **without** one (reuse off: each prefill has only its own prefix cache) run
   at the same time, each as an agent: a turn, ``--think-s`` of thinking, the next turn =
   previous prompt + answer + ``--new-tokens`` fresh tokens (a tool result). Closed loop
   per conversation (an agent waits for its answer), all conversations concurrent. Per
   turn: TTFT at the client (streamed), which engines served it, the tokens offered and
   the tokens prefill READ back from decode (the connectors' stats). Affinity hit rate =
   later reuse-on turns served by the decode that served (and retained) the turn before.
   The last turn of every conversation is checked against a single engine. Where each
   turn's TTFT went: the router's ``Server-Timing`` (lookup, prefill leg, decode to first
   bytes), the prefill's cached tokens (prefill engines run with
   ``--enable-prompt-tokens-details``) and the connector's ``reuse_offer`` lines (the
   prefill's own prefix-cache hit vs what decode offered). ``--prefill-kv-mib`` /
   ``--decode-kv-mib`` size the engines' KV caches: small prefill caches make the case
   reuse exists for (a prefill that no longer holds the conversation).
   A turn answered with an HTTP error (say the router's 503 while every prefill
   re-registers) or cut by a transport error is recorded with its ``error`` and the
   conversation goes on (:func:`conversation` says why); the summary, the verdict
   (``targets.errors_per_arm``), ``--table`` and ``--runs`` count such turns per arm.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from kvbaton.services.router.choice import ROLE_DECODE, ROLE_PREFILL, Fleet, PrefillHint
from kvbaton.stack.fleet_stack import FleetStack, LeaseWaiter, stream_tokens
from kvbaton.stack.pd_stack import stop_group, wait_port
from kvbaton.stack.ports import free_ports
from kvbaton.tinymodel import SHAPES, ensure_tiny_model, spec_for_shape

PY = sys.executable
BLOCK = 128
RESULTS = ROOT / "benchmarks" / "results"


def server_timing(value: str) -> dict[str, float]:
    """``lookup;dur=1.2, prefill;dur=30.5`` → ``{"lookup": 1.2, "prefill": 30.5}``."""
    out: dict[str, float] = {}
    for part in value.split(","):
        name, _, rest = part.strip().partition(";")
        if name and rest.startswith("dur="):
            out[name] = float(rest[4:])
    return out


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


# Where a turn's TTFT goes, from the engines' stats lines (benchmarks/ttft_breakdown.py
# describes each segment).
SEGMENTS = ("client→prefill engine", "prefill queue", "reuse READ", "READ→compute admitted", "prefill compute",
            "prefill→decode engine", "decode queue", "pull READ", "first token")


def stack_events(stack: FleetStack) -> dict[str, list[dict[str, Any]]]:
    evs: dict[str, list[dict[str, Any]]] = {}
    for eng in [*stack.prefill_ids, *stack.decode_ids]:
        for part in ("worker", "scheduler"):
            evs.setdefault(eng, []).extend(stack.events(eng, part=part))
    return evs


def split(turn: dict[str, Any], evs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The turn's segments (ms) from its engines' stats lines, matched by transfer id (and,
    for the reuse READ, by the prefill's request id)."""
    tid, p, d = turn["transfer_id"], turn["prefill"], turn["decode"]

    def one(eng: str, event: str, **match: Any) -> dict[str, Any] | None:
        got = [e for e in evs.get(eng, []) if e["event"] == event and all(e.get(k) == v for k, v in match.items())]
        return got[0] if got else None
    p_adms = [e for e in evs.get(p, []) if e["event"] == "admitted" and e.get("transfer_id") == tid
              and e.get("role") == "prefill"]
    p_adm = p_adms[0] if p_adms else None
    d_adm = one(d, "admitted", transfer_id=tid, role="decode")
    complete = one(p, "rpc", rpc="Complete", transfer_id=tid)
    recv = one(d, "recv_done", transfer_id=tid)
    read = one(p, "reuse_read", req_id=p_adm["request_id"]) if p_adm else None
    if not (p_adm and d_adm and complete and recv):
        return {"missing": [n for n, e in (("prefill admitted", p_adm), ("decode admitted", d_adm),
                                            ("Complete", complete), ("recv_done", recv)) if e is None]}
    t_first = turn["t_send"] + turn["ttft_ms"] / 1000
    t_finished = complete["t"] - complete["latency_ms"] / 1000
    t_read_end = read["t"] if read else p_adm["t"]
    # A READ'd leg is admitted again once its load is over (vLLM schedules it then): the
    # wait between the READ's end and that is the step granularity of an async load.
    t_compute = max(p_adms[1]["t"], t_read_end) if read and len(p_adms) > 1 else t_read_end
    marks = [turn["t_send"], p_adm["arrival_t"], p_adm["t"], t_read_end, t_compute, t_finished, d_adm["arrival_t"],
             d_adm["t"], recv["t"], t_first]
    seg = {name: round((b - a) * 1000, 1) for name, a, b in zip(SEGMENTS, marks, marks[1:])}
    return {"segments_ms": seg,
            "read": ({k: read[k] for k in ("num_blocks", "nbytes", "duration_s", "pinned_s", "begun_s", "posted_s")}
                     if read else None),
            "pull": {k: recv.get(k) for k in ("num_blocks", "nbytes", "duration_s", "begun_s", "posted_s")},
            "decode_local_hit_tokens": d_adm["local_hit_tokens"], "decode_pulled_tokens": d_adm["external_tokens"],
            "prefill_local_hit_tokens": p_adm["local_hit_tokens"], "prefill_read_tokens": p_adm["external_tokens"],
            "complete_rpc_ms": complete["latency_ms"]}


# ---------------------------------------------------------------------- 1. decision cost
def decision_cost(n_prefill: int, n_decode: int, calls: int = 20000) -> dict[str, float]:
    fleet = Fleet(slack=4, discovering=True)
    rnd = random.Random(1)
    for i in range(n_prefill):
        e = fleet.put_rank(f"p{i}", 0, 1, ROLE_PREFILL, f"http://p{i}", False)
        fleet.start_prefill(e, rnd.randrange(0, 4000))
    for i in range(n_decode):
        e = fleet.put_rank(f"d{i}", 0, 1, ROLE_DECODE, f"http://d{i}", False)
        for _ in range(rnd.randrange(0, 6)):
            fleet.start_decode(e)
    times = []
    for k in range(calls):
        holder = f"d{rnd.randrange(n_decode)}" if k % 2 else ""
        hint = PrefillHint(f"p{rnd.randrange(n_prefill)}", 4000) if k % 2 else None
        now = time.monotonic()
        t0 = time.perf_counter_ns()
        fleet.choose(now, holder, hint=hint, prompt_tokens=5000, reuse_tokens=4000 if holder else 0)
        times.append((time.perf_counter_ns() - t0) / 1000)
    return {"engines": n_prefill + n_decode, "calls": calls, "p50_us": round(_pct(times, 0.5), 2),
            "p99_us": round(_pct(times, 0.99), 2), "max_us": round(max(times), 2)}


# ---------------------------------------------------------------------- 2. router overhead
def _stand_in_engines(ports: list[int]) -> None:
    """Run in a child process: engines that answer a completion at once."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"id": "c", "object": "text_completion", "model": "m",
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                                  "kv_transfer_params": {"remote_engine_id": "p", "remote_block_ids": [1]}})

    async def main() -> None:
        for port in ports:
            app = web.Application()
            app.router.add_post("/v1/completions", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


def router_overhead(n: int, workdir: Path) -> dict[str, Any]:
    *ports, rport = free_ports(3)
    logs = [open(workdir / "standin.log", "wb"), open(workdir / "overhead-router.log", "wb")]
    eng = subprocess.Popen([PY, __file__, "--stand-in-engines", *map(str, ports)], stdout=logs[0],
                           stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    procs = [eng]
    try:
        for p in ports:
            wait_port(p, eng)
        router = subprocess.Popen([PY, "-m", "kvbaton.services.router", "--prefill", f"http://127.0.0.1:{ports[0]}",
                                   "--decode", f"http://127.0.0.1:{ports[1]}", "--mode", "pull",
                                   "--port", str(rport)], stdout=logs[1], stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=ROOT, env={**os.environ, "KVBATON_CONTROL_PLANE": ""})
        procs.append(router)
        wait_port(rport, router)
        body = json.dumps({"model": "m", "prompt": "hello " * 50, "max_tokens": 4}).encode()

        def post(url: str) -> float:
            req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
            return time.perf_counter() - t0

        for _ in range(20):  # warm connections and code paths
            post(f"http://127.0.0.1:{rport}/v1/completions")
        direct, via = [], []
        for _ in range(n):
            direct.append(post(f"http://127.0.0.1:{ports[0]}/v1/completions")
                          + post(f"http://127.0.0.1:{ports[1]}/v1/completions"))
            via.append(post(f"http://127.0.0.1:{rport}/v1/completions"))
        def ms(xs: list[float], q: float) -> float:
            return round(_pct(xs, q) * 1000, 3)

        return {"requests": n, "direct_p50_ms": ms(direct, 0.5), "direct_p99_ms": ms(direct, 0.99),
                "router_p50_ms": ms(via, 0.5), "router_p99_ms": ms(via, 0.99),
                "added_p50_ms": round((statistics.median(via) - statistics.median(direct)) * 1000, 3),
                "what": "pull, stand-in engines answering at once; direct = prefill call + decode call, "
                        "sequential, same client"}
    finally:
        for p in reversed(procs):
            stop_group(p)
        for f in logs:
            f.close()


# ---------------------------------------------------------------------- 3. the fleet
#: What a turn's request can fail with besides an HTTP error status: the connection refused,
#: dropped (before the answer or mid-stream), timed out, or a stream that is not SSE JSON.
TURN_TRANSPORT_ERRORS = (OSError, http.client.HTTPException, ValueError)


def send_turn(url: str, body: dict[str, Any], headers: dict[str, str],
              timeout_s: float = 120.0) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """One turn's request, streamed: ``(result, None)`` (:func:`stream_tokens`'s), or
    ``(None, error)`` when the answer was an HTTP error or the transport failed. The error
    is a record, not an exception, so that one refused turn (a 503 while every prefill
    re-registered) does not end the whole run: ``{"status": HTTP status or None for a
    transport error, "message": the error body's message or the exception, "t": when it
    failed (time.time()), "after_ms": since the send, "headers": the router's X-Kvbaton-*}``."""
    t0 = time.time()
    status: int | None = None
    try:
        res = stream_tokens(url, body, headers, timeout_s=timeout_s)
        if res.get("done", True):
            return res, None
        # Cut mid-answer (the router drops the connection when decode fails after tokens went
        # out): the tokens so far are not the answer.
        message, kv = f"the stream ended before data: [DONE], after {len(res['token_ids'])} tokens", res["headers"]
    except urllib.error.HTTPError as exc:
        try:
            raw = exc.read()
        except TURN_TRANSPORT_ERRORS:
            raw = b""
        try:
            message = str(json.loads(raw)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace")[:500] or str(exc.reason)
        kv = {k: v for k, v in exc.headers.items()
              if k.lower().startswith("x-kvbaton-") or k.lower() == "retry-after"} if exc.headers else {}
        status = exc.code
    except TURN_TRANSPORT_ERRORS as exc:
        # urllib.error.URLError (refused), TimeoutError, ConnectionResetError,
        # http.client.RemoteDisconnected / IncompleteRead, or a garbled chunk.
        message, kv = f"{type(exc).__name__}: {exc}"[:500], {}
    t = time.time()
    return None, {"status": status, "message": message, "t": t, "after_ms": round((t - t0) * 1000, 1),
                  "headers": kv}


def answered(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns that got an answer (every turn of a results file from before errors were
    recorded): TTFT, engines and READs exist only for these."""
    return [t for t in turns if not t.get("error")]


def conversation(stack: FleetStack, router: str, conv: str, reuse: bool, seed: int,
                 args: argparse.Namespace, start_delay_s: float = 0.0) -> list[dict[str, Any]]:
    """One agent conversation. Between turns it does only what an agent does (think) and,
    with reuse, waits for decode's lease on the turn just answered (streamed answers are not
    held by the router; a real agent's think time covers it). Nothing else: which READs and
    offers belong to a turn is read from the engines' stats lines after the run
    (:func:`attribute`), so neither arm spends the shared cores on bookkeeping mid-run.

    A turn that gets an HTTP error or a transport error is recorded with its ``error``
    (:func:`send_turn`; no TTFT, engines nor output) and the conversation **goes on**: its
    next turn is this turn's prompt + the fresh tokens, without an answer (there is none to
    append; a partial stream is dropped). Going on rather than ending keeps every
    conversation in every later turn's medians: ending would drop the failed conversation's
    later turns from one arm only, so the per-turn comparison would no longer be between the
    same conversations. The history stays a valid prompt (the failed turn's prompt is a
    prefix of the next), and with reuse the KV decode retained for the last answered turn is
    still a prefix of it, so nothing is offered that does not match. No lease is waited for
    after a failed turn (nothing new was retained).

    ``start_delay_s`` (``--stagger-s`` × the conversation's place in its group) spreads the
    first turns out: agents that all start at once send every later turn at once too, and
    then each turn's TTFT is mostly its wait behind the others' prefills."""
    rnd = random.Random(seed)
    time.sleep(start_delay_s)
    prompt = [rnd.randrange(10, 4000) for _ in range(args.first_tokens)]
    out: list[dict[str, Any]] = []
    with contextlib.ExitStack() as cleanup:
        waiter = cleanup.enter_context(LeaseWaiter(stack.cp_address)) if reuse else None
        for turn in range(1, args.turns + 1):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0.0,
                    "ignore_eos": True}
            t_send = time.time()
            res, error = send_turn(f"{router}/v1/completions", body, {"X-Session-ID": conv} if reuse else {})
            h = res["headers"] if res is not None else (error or {}).get("headers", {})
            rec = {"conv": conv, "reuse": reuse, "turn": turn, "prompt_tokens": len(prompt),
                   "t_send": t_send, "transfer_id": h.get("X-Kvbaton-Transfer-Id", ""),
                   "ttft_ms": round(res["ttft_s"] * 1000, 1) if res is not None else None,
                   "total_ms": round(res["total_s"] * 1000, 1) if res is not None else None,
                   "prefill": h.get("X-Kvbaton-Prefill"), "decode": h.get("X-Kvbaton-Decode"),
                   "attempts": int(h.get("X-Kvbaton-Attempts", 1)),
                   "offered_tokens": int(h.get("X-Kvbaton-Reuse-Tokens", 0)),
                   # Where the TTFT went (the router's Server-Timing: lookup, prefill leg, decode
                   # leg to first bytes) and how much of the prompt prefill did not compute.
                   "timing_ms": server_timing(h.get("Server-Timing", "")),
                   "prefill_cached_tokens": int(h.get("X-Kvbaton-Prefill-Cached-Tokens", -1)),
                   "prompt": prompt, "output": res["token_ids"] if res is not None else []}
            if error is not None:
                rec["error"] = error
                print(f"{conv} turn {turn}: {error['status'] or 'transport error'}: {error['message']}", flush=True)
            time.sleep(args.think_s)  # the agent thinks
            if waiter is not None and turn < args.turns and res is not None:
                full = (len(prompt) + args.output_tokens - 1) // BLOCK * BLOCK
                t_lease = time.monotonic()
                held = waiter.wait(conv, full)
                rec["lease_wait_s"] = round(time.monotonic() - t_lease, 3) if held else -1.0
            out.append(rec)
            prompt = prompt + rec["output"] + [rnd.randrange(10, 4000) for _ in range(args.new_tokens)]
    return out


def attribute(turns: list[dict[str, Any]], evs: dict[str, list[dict[str, Any]]], prefill_ids: list[str]) -> None:
    """Each reuse turn's READs from decode and prefill's reuse offers, from the stats lines
    after the run: a conversation's lines (``conversation_id``) stamped between its turn's
    send and its next turn's send belong to that turn (a conversation's turns are
    sequential; the engines stamp ``time.time()`` on this machine's one clock)."""
    by_conv: dict[str, list[dict[str, Any]]] = {}
    for t in turns:
        by_conv.setdefault(t["conv"], []).append(t)
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in prefill_ids:
        for e in evs.get(p, []):
            if e["event"] in ("reuse_read", "reuse_offer") and e.get("conversation_id"):
                lines.setdefault((e["conversation_id"], e["event"]), []).append(e)
    for conv, ts in by_conv.items():
        ts.sort(key=lambda t: t["turn"])
        for t, nxt in zip(ts, [*ts[1:], None]):
            start, end = t["t_send"], (nxt["t_send"] if nxt is not None else float("inf"))
            reads = [e for e in lines.get((conv, "reuse_read"), []) if start <= e["t"] < end]
            offers = [e for e in lines.get((conv, "reuse_offer"), []) if start <= e["t"] < end]
            t["reads"] = len(reads)
            t["read_tokens"] = sum(int(e["num_blocks"]) for e in reads) * BLOCK
            t["read_ms"] = [round(float(e["duration_s"]) * 1000, 2) for e in reads]
            # What prefill's own prefix cache held of the history when decode's was offered.
            t["reuse_offers"] = [{k: e[k] for k in ("local_hit_tokens", "reusable_tokens", "read_tokens", "decision")}
                                 for e in offers]


def run_fleet(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = ensure_tiny_model(args.model_dir, spec_for_shape(args.model_shape))
    t0 = time.monotonic()
    mib = 1024 * 1024
    role_args = {"prefill": ["--enable-prompt-tokens-details"], "decode": []}
    if args.prefill_kv_mib:
        role_args["prefill"] += ["--kv-cache-memory-bytes", str(args.prefill_kv_mib * mib)]
    if args.decode_kv_mib:
        role_args["decode"] += ["--kv-cache-memory-bytes", str(args.decode_kv_mib * mib)]
    with FleetStack(model, workdir, n_prefill=2, n_decode=2, mode=args.mode,
                    extra_config={"lease_ttl_s": 120, "kv_recompute_threshold": args.recompute_threshold},
                    engine_args=["--max-num-seqs", "16", "--max-model-len", str(args.max_model_len)],
                    role_args=role_args) as stack:
        stack.wait_routers_see(2, 2)
        stack.warm_up()
        started_s = time.monotonic() - t0
        router = stack.routers[0]
        rnd = random.Random(7)
        turns: list[dict[str, Any]] = []
        rounds: list[dict[str, Any]] = []
        for rd in range(1, args.rounds + 1):
            # One round = fresh conversations of both arms at the same time, so that what
            # the machine does meanwhile (drift, other jobs) hits both; the verdict is taken
            # per round, then over rounds.
            jobs = [(f"bench-r{rd}-on-{i}", True, 1000 * rd + i) for i in range(args.convs)] + \
                   [(f"bench-r{rd}-off-{i}", False, 1000 * rd + 500 + i) for i in range(args.convs)]
            rnd.shuffle(jobs)
            t_round = time.monotonic()
            if args.arms == "together":
                groups = [jobs]
            else:
                # --arms alternate: the round's two arms one after the other (the first arm
                # alternates between rounds), each with the fleet to itself: a fleet whose
                # agents all send conversation ids vs one whose agents send none, instead of
                # each arm's turns queueing behind the other arm's prefills.
                first = rd % 2 == 1
                groups = [[j for j in jobs if j[1] == first], [j for j in jobs if j[1] != first]]
            got = []
            for group in groups:
                with concurrent.futures.ThreadPoolExecutor(len(group)) as ex:
                    futs = [ex.submit(conversation, stack, router, c, r, s, args, k * args.stagger_s)
                            for k, (c, r, s) in enumerate(group)]
                    got += [dict(t, round=rd) for f in futs for t in f.result(timeout=1800)]
            turns += got
            rounds.append({"round": rd, "wall_s": round(time.monotonic() - t_round, 1), "loadavg": os.getloadavg()})
            last = [t for t in answered(got) if t["turn"] == args.turns]
            errors = {arm: sum(1 for t in got if t.get("error") and t["reuse"] == r) for arm, r in (("on", True),
                                                                                                ("off", False))}
            on_l, off_l = [t["ttft_ms"] for t in last if t["reuse"]], [t["ttft_ms"] for t in last if not t["reuse"]]
            if on_l and off_l:
                on, off = statistics.median(on_l), statistics.median(off_l)
                print(f"round {rd}: longest turn TTFT on {on:.0f} ms / off {off:.0f} ms = {on / off:.3f} "
                      f"({rounds[-1]['wall_s']} s; errors on {errors['on']}, off {errors['off']})", flush=True)
            else:
                print(f"round {rd}: an arm's longest turn got no answer (errors on {errors['on']}, "
                      f"off {errors['off']})", flush=True)
        evs = stack_events(stack)
        attribute(turns, evs, stack.prefill_ids)
        for t in turns:
            t["split"] = split(t, evs) if not t.get("error") else {"missing": ["the answer (an error)"]}
        with urllib.request.urlopen(f"{router}/kvbaton/fleet", timeout=10) as r:
            fleet_view = json.loads(r.read())
        in_run_cost = {**fleet_view["decision_us"], "cpu": fleet_view.get("decision_cpu_us")}
        with urllib.request.urlopen(f"{router}/kvbaton/stats", timeout=10) as r:
            router_stats = json.loads(r.read())
        # The last turn of every conversation of the first and the last round against p0
        # alone (greedy: identical).
        equal = []
        for t in turns:
            if t["turn"] == args.turns and t["round"] in (1, args.rounds) and not t.get("error"):
                single = stack.engines["p0"].post_json("/v1/completions", {
                    "model": "tiny", "prompt": t["prompt"], "max_tokens": args.output_tokens, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}, timeout_s=300)["choices"][0]["token_ids"]
                equal.append(single == t["output"])
    for t in turns:
        t.pop("prompt")
        t.pop("output")
    # records_errors: a turn's HTTP or transport error is in its record (files from before
    # this ended the run at the first one instead, so they hold none by construction).
    return {"turns": turns, "rounds": rounds, "router_decision_us_in_run": in_run_cost, "router_stats": router_stats,
            "last_turns_equal_single": equal, "startup_s": round(started_s, 1), "records_errors": True}


def _computed(t: dict[str, Any]) -> int | None:
    """Prompt tokens the prefill computed (not from its prefix cache nor READ from decode)."""
    cached = t.get("prefill_cached_tokens", -1)
    return None if cached is None or cached < 0 else t["prompt_tokens"] - cached


def _spread(xs: list[float]) -> dict[str, Any]:
    """Median, quartiles and range of per-round ratios."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    return {"n": len(s), "median": round(statistics.median(s), 3), "q1": round(q[0], 3), "q3": round(q[2], 3),
            "min": round(s[0], 3), "max": round(s[-1], 3), "values": [round(x, 3) for x in xs]}


def first_reads(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The first READ between each prefill/decode pair (a NIXL connection's set-up) vs the
    READs after it, in ms, in the order turns were served (round, turn)."""
    seen: set[tuple[str, str]] = set()
    first: list[float] = []
    later: list[float] = []
    for t in sorted(turns, key=lambda t: (t.get("round", 1), t["turn"])):
        for ms in t.get("read_ms", ()):
            pair = (t["prefill"], t["decode"])
            (later if pair in seen else first).append(ms)
            seen.add(pair)
    return {"first_per_pair_ms": first, "first_median_ms": round(statistics.median(first), 1) if first else None,
            "later_median_ms": round(statistics.median(later), 1) if later else None, "later_reads": len(later)}


def _segments(ts: list[dict[str, Any]]) -> dict[str, float] | None:
    got = [t["split"]["segments_ms"] for t in ts if "segments_ms" in t.get("split", {})]
    return {k: round(statistics.median(g[k] for g in got), 1) for k in SEGMENTS} if got else None


def errors_summary(fleet: dict[str, Any]) -> dict[str, Any]:
    """Turns that got an HTTP or transport error, per arm, by status ("transport" for none);
    ``recorded``: False for results files from before errors were recorded (such a run ended
    at its first error, so a file that exists holds none)."""
    out: dict[str, Any] = {"recorded": bool(fleet.get("records_errors"))}
    for arm, reuse in (("on", True), ("off", False)):
        errs = [t["error"] for t in fleet["turns"] if t.get("error") and t["reuse"] == reuse]
        by: dict[str, int] = {}
        for e in errs:
            key = str(e["status"]) if e.get("status") is not None else "transport"
            by[key] = by.get(key, 0) + 1
        out[arm] = {"count": len(errs), "by_status": dict(sorted(by.items()))}
    return out


def errors_text(errors: dict[str, Any]) -> str:
    """``3 / 0`` (on / off), with the statuses: ``3 (503 ×2, transport ×1) / 0``."""
    def arm(e: dict[str, Any]) -> str:
        by = ", ".join(f"{k} ×{n}" for k, n in e["by_status"].items())
        return f"{e['count']}" + (f" ({by})" if by else "")
    return f"{arm(errors['on'])} / {arm(errors['off'])}" if errors["recorded"] else "–"


def summarise(fleet: dict[str, Any], turns_n: int) -> dict[str, Any]:
    """Per turn, per round and overall, over the answered turns (:func:`answered`); the
    turns that got an error are counted per arm in ``errors``. A turn none of an arm's
    conversations got an answer to has no per-turn row."""
    per_turn = []
    turns = answered(fleet["turns"])
    prev_prefill: dict[str, str] = {}
    for k in range(1, turns_n + 1):
        on = [t for t in turns if t["reuse"] and t["turn"] == k]
        off = [t for t in turns if not t["reuse"] and t["turn"] == k]
        if not (on and off):
            continue
        def med(ts: list[dict[str, Any]], f: Any) -> float | None:
            xs = [x for x in map(f, ts) if x is not None]
            return round(statistics.median(xs), 1) if xs else None

        per_turn.append({
            "turn": k, "prompt_tokens": round(statistics.mean(t["prompt_tokens"] for t in on)),
            "ttft_on_ms": round(statistics.median(t["ttft_ms"] for t in on), 1),
            "ttft_off_ms": round(statistics.median(t["ttft_ms"] for t in off), 1),
            "reads_on": sum(t["reads"] for t in on), "read_tokens_on": sum(t["read_tokens"] for t in on),
            "convs": len(on),
            # The breakdown (medians): the prefill leg (queue + READ + compute), decode to
            # first bytes (pull READ + first token), prompt tokens prefill did not compute.
            "prefill_on_ms": med(on, lambda t: t.get("timing_ms", {}).get("prefill")),
            "prefill_off_ms": med(off, lambda t: t.get("timing_ms", {}).get("prefill")),
            "decode_on_ms": med(on, lambda t: t.get("timing_ms", {}).get("decode")),
            "decode_off_ms": med(off, lambda t: t.get("timing_ms", {}).get("decode")),
            "cached_on": med(on, lambda t: t["prefill_cached_tokens"] if t.get("prefill_cached_tokens", -1) >= 0
                             else None),
            "cached_off": med(off, lambda t: t["prefill_cached_tokens"] if t.get("prefill_cached_tokens", -1) >= 0
                              else None),
            # Reuse-off's prefix-cache hit tokens per turn, mean over the arm's turns: whether its
            # prefill caches still held the history (the case reuse exists for needs them not to).
            "cached_off_mean": (round(statistics.mean(xs), 1) if (xs := [
                t["prefill_cached_tokens"] for t in off if t.get("prefill_cached_tokens", -1) >= 0]) else None),
            "cached_off_zero": sum(1 for t in off if t.get("prefill_cached_tokens", -1) == 0),
            # Prompt tokens prefill computed (the work reuse saves), medians.
            "computed_on": med(on, _computed), "computed_off": med(off, _computed),
            # Later reuse-on turns whose prefill already held the history (no READ needed).
            "local_hits_on": sum(1 for t in on for o in t.get("reuse_offers", ())
                                 if o["local_hit_tokens"] >= o["reusable_tokens"] > 0)
            if any("reuse_offers" in t for t in on) else None,
            # Where the TTFT went (medians per segment; turns whose every stats line was found).
            "segments_on_ms": _segments(on), "segments_off_ms": _segments(off),
            "pulled_on": med(on, lambda t: t.get("split", {}).get("decode_pulled_tokens")),
            "pulled_off": med(off, lambda t: t.get("split", {}).get("decode_pulled_tokens")),
            "same_prefill_on": sum(1 for t in on if prev_prefill.get(t["conv"]) == t["prefill"]),
            "same_prefill_off": sum(1 for t in off if prev_prefill.get(t["conv"]) == t["prefill"]),
        })
        for t in on + off:
            prev_prefill[t["conv"]] = t["prefill"]
    on_later = sorted((t for t in turns if t["reuse"]), key=lambda t: (t["conv"], t["turn"]))
    hits = total = 0
    for a, b in zip(on_later, on_later[1:]):
        if a["conv"] == b["conv"]:
            total += 1
            hits += a["decode"] == b["decode"]
    last = per_turn[-1]
    # Less noisy than one turn's median of a few conversations: every later turn's TTFT.
    later_on = [t["ttft_ms"] for t in turns if t["reuse"] and t["turn"] > 1]
    later_off = [t["ttft_ms"] for t in turns if not t["reuse"] and t["turn"] > 1]
    # Per round (both arms at the same time): the longest turn's on/off (medians over the
    # round's conversations) and every later turn's; the verdict is their median over rounds.
    per_round = []
    for rd in sorted({t.get("round", 1) for t in turns}):
        rt = [t for t in turns if t.get("round", 1) == rd]
        lon = [t["ttft_ms"] for t in rt if t["reuse"] and t["turn"] == turns_n]
        loff = [t["ttft_ms"] for t in rt if not t["reuse"] and t["turn"] == turns_n]
        aon = [t["ttft_ms"] for t in rt if t["reuse"] and t["turn"] > 1]
        aoff = [t["ttft_ms"] for t in rt if not t["reuse"] and t["turn"] > 1]
        fon = [t["ttft_ms"] for t in rt if t["reuse"] and t["turn"] == 1]
        foff = [t["ttft_ms"] for t in rt if not t["reuse"] and t["turn"] == 1]
        if not (lon and loff and aon and aoff and fon and foff):
            continue
        per_round.append({
            "round": rd, "longest_on_ms": round(statistics.median(lon), 1), "longest_off_ms": round(statistics.median(loff), 1),
            "longest_on_over_off": round(statistics.median(lon) / statistics.median(loff), 3),
            "later_on_over_off": round(statistics.median(aon) / statistics.median(aoff), 3),
            "first_turn_on_over_off": round(statistics.median(fon) / statistics.median(foff), 3)})
    return {"per_turn": per_turn, "affinity_hits": hits, "affinity_later_turns": total,
            "later_turns_on_over_off": (round(statistics.median(later_on) / statistics.median(later_off), 3)
                                        if later_on and later_off else None),
            "affinity_hit_rate": round(hits / total, 3) if total else None,
            "longest_turn_on_over_off": round(last["ttft_on_ms"] / last["ttft_off_ms"], 3),
            "per_round": per_round,
            "rounds_longest_on_over_off": _spread([r["longest_on_over_off"] for r in per_round]),
            "rounds_later_on_over_off": _spread([r["later_on_over_off"] for r in per_round]),
            "rounds_first_turn_on_over_off": _spread([r["first_turn_on_over_off"] for r in per_round]),
            "rounds_meeting_half": sum(r["longest_on_over_off"] <= 0.5 for r in per_round),
            "reads": first_reads(turns),
            "retries": sum(t["attempts"] - 1 for t in fleet["turns"]),
            "errors": errors_summary(fleet)}


def plot(summary: dict[str, Any], path: Path, arms: str = "together") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pt = summary["per_turn"]
    x = [p["turn"] for p in pt]
    rounds = summary.get("per_round", [])
    fig, axes = plt.subplots(1, 3 if rounds else 2, figsize=(16 if rounds else 11, 4))
    a, b = axes[0], axes[1]
    a.plot(x, [p["ttft_off_ms"] for p in pt], "o-", label="reuse off (no conversation id)")
    a.plot(x, [p["ttft_on_ms"] for p in pt], "s-", label="reuse on (conversation id)")
    a.set_xlabel("turn")
    a.set_ylabel("TTFT, median over conversations (ms)")
    a.set_title("2P+2D fleet, prefix caching on, same run")
    a.legend()
    a.grid(alpha=0.3)
    b.bar(x, [p["read_tokens_on"] / max(1, p["convs"]) for p in pt])
    b.set_xlabel("turn")
    b.set_ylabel("tokens READ back from decode per conversation")
    b.set_title(f"reuse on; affinity hit rate {summary['affinity_hit_rate']}")
    b.grid(alpha=0.3)
    if rounds:
        c = axes[2]
        c.plot([r["round"] for r in rounds], [r["longest_on_over_off"] for r in rounds], "o-",
               label="longest turn (median of the round)")
        c.plot([r["round"] for r in rounds], [r["later_on_over_off"] for r in rounds], "s--",
               label="all later turns (median of the round)")
        c.plot([r["round"] for r in rounds], [r["first_turn_on_over_off"] for r in rounds], "x:",
               label="turn 1 (nothing to reuse)")
        c.axhline(0.5, color="red", lw=1, label="target ≤ 0.5")
        c.axhline(1.0, color="grey", lw=1)
        c.set_xlabel("round (arms one after the other)" if arms == "alternate" else "round (both arms at the same time)")
        c.set_ylabel("TTFT reuse on / off")
        c.set_title(f"per round; median longest-turn ratio {summary['rounds_longest_on_over_off'].get('median')}")
        c.legend(fontsize=7)
        c.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict[str, Any]) -> str:
    """The README's tables, from a results file (``--table results/fleet.json``); the
    summary is recomputed from the file's turns (files from before a column have "–")."""
    cfg = result["config"]
    s = summarise(result["fleet"], cfg["turns"])
    lines = [f"{cfg['convs']} conversations with reuse + {cfg['convs']} without, "
             f"{'arms alternating' if cfg.get('arms') == 'alternate' else 'concurrently'}, {cfg['turns']} turns "
             f"(+{cfg['new_tokens']} tokens a turn, {cfg['output_tokens']} out), {cfg['mode']}; "
             f"commit `{result['commit'][:7]}`",
             f"prefill KV cache {cfg.get('prefill_kv_mib') or 64} MiB, decode {cfg.get('decode_kv_mib') or 64} MiB "
             f"per engine; model shape `{cfg.get('model_shape', 'tiny')}`; load average "
             f"{result['machine']['loadavg_start'][0]:.1f} → "
             f"{result['machine']['loadavg_end'][0]:.1f}",
             "", "| turn | prompt tokens | TTFT reuse on (ms, median) | TTFT reuse off (ms, median) "
                 "| reuse READs | tokens read back | prefill leg on / off (ms) | decode to 1st byte on / off (ms) "
                 "| prompt tokens not computed on / off | prompt tokens computed on / off "
                 "| on: prefill held history | same prefill as last turn on / off |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    n_rounds = cfg.get("rounds", 1)
    if n_rounds > 1:
        how = ("one arm after the other in each (alternating which goes first), each alone on the fleet"
               if cfg.get("arms") == "alternate" else "both arms at the same time in each")
        lines.insert(2, f"{n_rounds} rounds of fresh conversations, {how}; per-turn "
                        f"medians over all {n_rounds * cfg['convs']} conversations of an arm")

    def f0(x: float | None) -> str:
        return "–" if x is None else f"{x:.0f}"
    for p in s["per_turn"]:
        lines.append(f"| {p['turn']} | {p['prompt_tokens']} | {p['ttft_on_ms']:.0f} | {p['ttft_off_ms']:.0f} "
                     f"| {p['reads_on']} | {p['read_tokens_on']} "
                     f"| {f0(p.get('prefill_on_ms'))} / {f0(p.get('prefill_off_ms'))} "
                     f"| {f0(p.get('decode_on_ms'))} / {f0(p.get('decode_off_ms'))} "
                     f"| {f0(p.get('cached_on'))} / {f0(p.get('cached_off'))} "
                     f"| {f0(p.get('computed_on'))} / {f0(p.get('computed_off'))} "
                     f"| {'–' if p.get('local_hits_on') is None else p['local_hits_on']} | {p.get('same_prefill_on', '–')} / {p.get('same_prefill_off', '–')} |")
    if any(p.get("cached_off_mean") is not None for p in s["per_turn"]):
        lines += ["", "Reuse off, prefix-cache hit tokens per turn (mean over the arm's turns; turns with none): "
                  + "; ".join(f"turn {p['turn']}: {f0(p.get('cached_off_mean'))} of {p['prompt_tokens']} "
                              f"({p.get('cached_off_zero')}/{p['convs']})" for p in s["per_turn"]) + "."]
    lines += ["", f"Affinity: {s['affinity_hits']}/{s['affinity_later_turns']} later turns on the decode holding "
                  f"their KV; longest turn TTFT on/off = {s['longest_turn_on_over_off']}"
                  + (f" (all later turns, median: {s['later_turns_on_over_off']})" if "later_turns_on_over_off" in s
                     else "") + f"; retries "
                  f"{s['retries']}; last turns equal to a single engine: "
                  f"{sum(result['fleet']['last_turns_equal_single'])}/{len(result['fleet']['last_turns_equal_single'])}"
                  + (f"; turns that got an HTTP or transport error, on / off: {errors_text(s['errors'])}"
                     if s["errors"]["recorded"] else "") + ".",
              ]
    if s["per_round"] and n_rounds > 1:
        lr, al, ft = s["rounds_longest_on_over_off"], s["rounds_later_on_over_off"], s["rounds_first_turn_on_over_off"]
        lines += ["", "| round | longest turn on (ms) | longest turn off (ms) | longest on/off | all later turns on/off "
                      "| turn 1 on/off |", "|---|---|---|---|---|---|"]
        for r in s["per_round"]:
            lines.append(f"| {r['round']} | {r['longest_on_ms']:.0f} | {r['longest_off_ms']:.0f} "
                         f"| {r['longest_on_over_off']} | {r['later_on_over_off']} | {r['first_turn_on_over_off']} |")
        lines.append(f"| **median (quartiles; range)** | | | **{lr['median']}** ({lr['q1']}–{lr['q3']}; "
                     f"{lr['min']}–{lr['max']}) | {al['median']} ({al['q1']}–{al['q3']}; {al['min']}–{al['max']}) "
                     f"| {ft['median']} ({ft['q1']}–{ft['q3']}; {ft['min']}–{ft['max']}) |")
        lines += ["", f"Rounds whose longest turn met on/off ≤ 0.5: {s['rounds_meeting_half']} of {len(s['per_round'])}."]
    last = s["per_turn"][-1]
    if last.get("segments_on_ms") and last.get("segments_off_ms"):
        lines += ["", f"Where the longest turn's TTFT went (ms, median per segment over the turns whose stats lines "
                      f"were all found; segments of different turns, so they need not add up to the TTFT median; "
                      f"tokens decode pulled from prefill: on {last.get('pulled_on')}, off {last.get('pulled_off')}):",
                  "", "| segment | reuse on | reuse off |", "|---|---|---|"]
        for k in SEGMENTS:
            lines.append(f"| {k} | {last['segments_on_ms'][k]:.0f} | {last['segments_off_ms'][k]:.0f} |")
    rd = s.get("reads") or {}
    if rd.get("first_per_pair_ms"):
        lines += ["", f"READs: first between each prefill/decode pair {rd['first_per_pair_ms']} ms "
                      f"(median {rd['first_median_ms']}); the {rd['later_reads']} after: median {rd['later_median_ms']} ms."]
    lines += ["", "| router cost | p50 | p99 |", "|---|---|---|"]
    for d in result["decision_cost"]:
        lines.append(f"| decision, {d['engines']} engines, in-process | {d['p50_us']} µs | {d['p99_us']} µs |")
    run = result["fleet"]["router_decision_us_in_run"]
    lines.append(f"| decision, in the router over the run ({run['n']}), wall | {run['p50']:.1f} µs | {run['p99']:.1f} µs |")
    if run.get("cpu"):
        lines.append(f"| decision, in the router over the run, CPU | {run['cpu']['p50']:.1f} µs "
                     f"| {run['cpu']['p99']:.1f} µs |")
    o = result["router_overhead"]
    lines.append(f"| request straight to prefill + decode (stand-ins) | {o['direct_p50_ms']} ms | {o['direct_p99_ms']} ms |")
    lines.append(f"| the same through the router | {o['router_p50_ms']} ms | {o['router_p99_ms']} ms |")
    return "\n".join(lines)


def segments_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """The longest turn's **mean** segments per arm and run (ms: they add up to the mean
    TTFT, unlike medians), the mean prompt tokens prefill computed, and the router's lookup
    over every later reuse-on turn: which costs are reuse's own and which both arms pay."""
    lines = ["| run | arm | n | TTFT | " + " | ".join(SEGMENTS) + " | prompt tokens computed |",
             "|---|---|---|---|" + "---|" * len(SEGMENTS) + "---|"]
    looks = []
    for name, res in runs:
        n_turns = res["config"]["turns"]
        for reuse in (True, False):
            ts = [t for t in answered(res["fleet"]["turns"]) if t["turn"] == n_turns and t["reuse"] == reuse
                  and "segments_ms" in t.get("split", {})]
            if not ts:
                continue
            comp = [c for c in map(_computed, ts) if c is not None]
            lines.append(f"| `{name}` | {'on' if reuse else 'off'} | {len(ts)} "
                         f"| {statistics.mean(t['ttft_ms'] for t in ts):,.0f} | "
                         + " | ".join(f"{statistics.mean(t['split']['segments_ms'][k] for t in ts):,.0f}"
                                      for k in SEGMENTS)
                         + (f" | {statistics.mean(comp):,.0f} |" if comp else " | – |"))
        lk = sorted(t.get("timing_ms", {}).get("lookup", 0.0) for t in answered(res["fleet"]["turns"])
                    if t["reuse"] and t["turn"] > 1)
        if lk:
            looks.append(f"`{name}`: median {_pct(lk, 0.5):.0f}, mean {statistics.mean(lk):.0f}, "
                         f"p90 {_pct(lk, 0.9):.0f}, max {lk[-1]:.0f} ({len(lk)} turns)")
    return "\n".join(lines + ["", "Router lookup per later reuse-on turn (ms): " + "; ".join(looks) + "."])


def runs_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """One row per results file: the configuration that matters for the verdict and the
    verdict both ways — pooled (the median TTFT at the longest turn over all of an arm's
    conversations in the run) and over rounds (the median of each round's ratio, with how
    many rounds were at or below 1/2) — beside turn 1, where neither arm can reuse anything
    (its ratio over rounds is the noise floor of a per-round ratio). When any of the files
    records errors (:func:`errors_summary`), a last column counts the turns that got one, on /
    off ("–" for a file from before: its run would have ended at the first)."""
    with_errors = any(res["fleet"].get("records_errors") for _, res in runs)
    lines = ["| results file | model shape | prefill KV (MiB per engine) | arms | conversations per arm "
             "| think / stagger (s) | rounds "
             "| load average start → end "
             "| longest turn on / off (ms, pooled medians) | pooled on/off | on/off, median of rounds "
             "(quartiles; range) | rounds ≤ ½ | turn 1 on/off, median of rounds | longest turn prompt tokens "
             "computed on / off (mean) |" + (" turns with an error on / off |" if with_errors else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if with_errors else "")]
    for name, res in runs:
        cfg, n_turns = res["config"], res["config"]["turns"]
        s = summarise(res["fleet"], n_turns)
        last, rr, first = s["per_turn"][-1], s["rounds_longest_on_over_off"], s["rounds_first_turn_on_over_off"]
        comp = {r: [c for c in (_computed(t) for t in answered(res["fleet"]["turns"]) if t["turn"] == n_turns
                                and t["reuse"] == r) if c is not None] for r in (True, False)}
        load = res["machine"]
        computed = (f"{statistics.mean(comp[True]):,.0f} / {statistics.mean(comp[False]):,.0f}"
                    if comp[True] and comp[False] else "–")  # runs without prefill-cached-token counts
        lines.append(
            f"| `{name}` | {cfg.get('model_shape', 'tiny')} | {cfg.get('prefill_kv_mib') or 64} "
            f"| {cfg.get('arms', 'together')} | {cfg['convs']} "
            f"| {cfg.get('think_s', 0.5):g} / {cfg.get('stagger_s', 0.0):g} | {rr['n']} | {load['loadavg_start'][0]:.1f} → {load['loadavg_end'][0]:.1f} "
            f"| {last['ttft_on_ms']:,.0f} / {last['ttft_off_ms']:,.0f} | {s['longest_turn_on_over_off']} "
            f"| **{rr['median']}** ({rr['q1']}–{rr['q3']}; {rr['min']}–{rr['max']}) "
            f"| {s['rounds_meeting_half']} of {rr['n']} | {first['median']} | {computed} |"
            + (f" {errors_text(s['errors'])} |" if with_errors else ""))
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--stand-in-engines":
        _stand_in_engines([int(p) for p in sys.argv[2:]])
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--table":
        print(markdown(json.loads(Path(sys.argv[2]).read_text())))
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--runs":  # --runs FILE...: one verdict row per run
        print(runs_table([(Path(f).name, json.loads(Path(f).read_text())) for f in sys.argv[2:]]))
        return 0
    if len(sys.argv) > 2 and sys.argv[1] == "--segments":  # --segments FILE...: longest-turn means, per run
        print(segments_table([(Path(f).name, json.loads(Path(f).read_text())) for f in sys.argv[2:]]))
        return 0
    if len(sys.argv) > 3 and sys.argv[1] == "--plot":  # --plot RESULTS.json OUT.png: the PNG again
        res = json.loads(Path(sys.argv[2]).read_text())
        plot(summarise(res["fleet"], res["config"]["turns"]), Path(sys.argv[3]), res["config"].get("arms", "together"))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--convs", type=int, default=3, help="conversations with reuse, and as many without")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of fresh conversations (both arms at once in each); the verdict is the median "
                         "of the rounds' longest-turn on/off ratios")
    ap.add_argument("--arms", choices=("together", "alternate"), default="together",
                    help="together: both arms' conversations at the same time in each round (the verdict); "
                         "alternate: each round runs one arm, then the other, each alone on the fleet")
    ap.add_argument("--first-tokens", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=400)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--stagger-s", type=float, default=0.0,
                    help="the k-th conversation of a group starts k x this later (0: all at once)")
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="engines' context (the tiny model allows 8192 positions)")
    ap.add_argument("--mode", choices=("pull", "push"), default="pull")
    ap.add_argument("--recompute-threshold", type=int, default=64)
    ap.add_argument("--prefill-kv-mib", type=int, default=0,
                    help="prefill engines' KV cache (MiB; 0 = the stack's 64): small = a prefix cache that "
                         "cannot hold every conversation")
    ap.add_argument("--decode-kv-mib", type=int, default=0, help="decode engines' KV cache (MiB; 0 = 64)")
    ap.add_argument("--overhead-requests", type=int, default=300)
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="tiny",
                    help="the generated model's shape (kvbaton.tinymodel.SHAPES): tiny = the tests' 2-layer "
                         "model; compute = the same KV bytes per token with ~13x the prefill work per token")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="where the model is built (default: $KVBATON_TINY_MODEL or .cache/tiny-model for tiny, "
                         ".cache/tiny-model-SHAPE otherwise)")
    ap.add_argument("--out", type=Path, default=RESULTS / "fleet.json")
    ap.add_argument("--png", type=Path, default=RESULTS / "fleet_ttft_per_turn.png")
    args = ap.parse_args()
    if args.model_dir is None:
        args.model_dir = (Path(os.environ.get("KVBATON_TINY_MODEL", ROOT / ".cache/tiny-model"))
                          if args.model_shape == "tiny" else ROOT / f".cache/tiny-model-{args.model_shape}")
    # The last turn's prompt (the first tokens, then each earlier turn's answer and fresh
    # tokens) plus its answer, with room for the chat of block rounding.
    longest = args.first_tokens + (args.turns - 1) * (args.new_tokens + args.output_tokens) + args.output_tokens
    if longest > args.max_model_len - 96:
        ap.error(f"conversations would outgrow the engines' {args.max_model_len}-token context")
    workdir = Path(tempfile.mkdtemp(prefix="kvbaton-fleet-bench-"))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=ROOT).stdout.strip())
    result: dict[str, Any] = {"benchmark": "fleet", "commit": commit, "dirty": dirty,
                              "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "nice": os.nice(0),
                                          "loadavg_start": os.getloadavg()},
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print("decision cost (in-process) ...", flush=True)
    result["decision_cost"] = [decision_cost(2, 2), decision_cost(32, 32)]
    print(json.dumps(result["decision_cost"]), flush=True)
    print("router overhead (stand-in engines) ...", flush=True)
    result["router_overhead"] = router_overhead(args.overhead_requests, workdir)
    print(json.dumps(result["router_overhead"]), flush=True)
    print(f"fleet: 2P+2D, {args.convs} conversations with reuse + {args.convs} without, {args.turns} turns ...",
          flush=True)
    result["fleet"] = run_fleet(args, workdir)
    result["summary"] = summarise(result["fleet"], args.turns)
    result["machine"]["loadavg_end"] = os.getloadavg()
    rounds = result["summary"]["rounds_longest_on_over_off"]
    result["targets"] = {
        # Over rounds: the median of the per-round ratios (one round's median is noise here).
        "longest_turn_ttft_on_le_half_off": (rounds["median"] if rounds["n"] else
                                             result["summary"]["longest_turn_on_over_off"]) <= 0.5,
        "rounds_meeting_half": f"{result['summary']['rounds_meeting_half']}/{rounds['n']}",
        "decision_p99_le_1ms": all(d["p99_us"] <= 1000 for d in result["decision_cost"]),
        # Turns that got an HTTP or transport error instead of an answer, per arm.
        "errors_per_arm": {arm: result["summary"]["errors"][arm]["count"] for arm in ("on", "off")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result["summary"], args.png, args.arms)
    s = result["summary"]
    print(f"\n{'turn':>4} {'prompt':>6} {'TTFT on':>8} {'TTFT off':>8} {'READs':>5} {'read tok':>8}")
    for p in s["per_turn"]:
        print(f"{p['turn']:>4} {p['prompt_tokens']:>6} {p['ttft_on_ms']:>8.1f} {p['ttft_off_ms']:>8.1f} "
              f"{p['reads_on']:>5} {p['read_tokens_on']:>8}")
    print(f"affinity {s['affinity_hits']}/{s['affinity_later_turns']}; longest turn on/off (pooled) "
          f"{s['longest_turn_on_over_off']}; per round {s['rounds_longest_on_over_off']}; "
          f"errors on / off {errors_text(s['errors'])}; targets {result['targets']}; results {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
