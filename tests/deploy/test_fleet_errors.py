"""``benchmarks/fleet.py`` records a turn's HTTP or transport error and goes on.

Before, one non-200 answer (the router's ``503 no prefill engine available`` while every
prefill re-registered) raised out of the conversation's thread and ended the whole run.
Against a stand-in router (aiohttp, in the test's loop; the benchmark's synchronous client
runs in a thread): a turn answered 503, one whose connection drops before the answer and
one whose stream is cut mid-answer are recorded (status, message, time), the conversation
goes on with its next turn, and the summary, ``--table`` and ``--runs`` count the errors
per arm. A results file from before still prints as it did (no error column)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
fleet = pytest.importorskip("fleet")

OLD = ROOT / "benchmarks" / "results" / "fleet_compute8_alternate_quiet.json"
ARGS = argparse.Namespace(first_tokens=4, turns=5, output_tokens=2, new_tokens=3, think_s=0.0)
# What the stand-in router does with each turn of a conversation.
PLAN = ["ok", "503", "drop", "cut", "ok"]


class StandInRouter:
    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.prompts.append(body["prompt"])
        what = PLAN[(len(self.prompts) - 1) % len(PLAN)]
        if what == "503":
            return web.json_response({"error": {"message": "no prefill engine available: waited 5.0 s for one",
                                                "type": "ServiceUnavailable", "code": 503}},
                                     status=503, headers={"Retry-After": "5", "X-Kvbaton-Attempts": "1"})
        if what == "drop":  # connection closed before any answer
            request.transport.close()  # type: ignore[union-attr]
            raise ConnectionResetError
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Kvbaton-Prefill": "p0",
                                           "X-Kvbaton-Decode": "d0", "X-Kvbaton-Transfer-Id": "t",
                                           "Server-Timing": "prefill;dur=1.0, decode;dur=2.0"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"token_ids": [7]}]}\n\n')
        if what == "cut":  # tokens went out, then the stream broke
            request.transport.close()  # type: ignore[union-attr]
            return resp
        await resp.write(b'data: {"choices": [{"token_ids": [8]}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class NoLease:
    """The reuse arm waits for decode's lease after each answered turn: none here."""

    def __init__(self, cp: str) -> None:
        self.waits: list[str] = []

    def wait(self, conv: str, num_tokens: int, timeout_s: float = 10.0) -> str | None:
        self.waits.append(conv)
        return "d0"

    def __enter__(self) -> NoLease:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@pytest.fixture
async def router():
    stand_in = StandInRouter()
    app = web.Application()
    app.router.add_post("/v1/completions", stand_in.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    stand_in.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[attr-defined]
    yield stand_in
    await runner.cleanup()


async def _conversation(router, conv: str, reuse: bool) -> list[dict]:
    stack = argparse.Namespace(cp_address="unused")
    return await asyncio.wait_for(asyncio.to_thread(fleet.conversation, stack, router.url, conv, reuse, 1, ARGS), 60)


async def test_errors_are_recorded_and_the_conversation_goes_on(router, monkeypatch):
    monkeypatch.setattr(fleet, "LeaseWaiter", NoLease)
    t0 = time.time()
    turns = await _conversation(router, "c-on", True)
    assert [t["turn"] for t in turns] == [1, 2, 3, 4, 5]
    ok, refused, dropped, cut, again = turns
    assert ok["ttft_ms"] is not None and ok["output"] == [7, 8] and "error" not in ok
    assert refused["error"]["status"] == 503 and refused["ttft_ms"] is None
    assert refused["error"]["message"] == "no prefill engine available: waited 5.0 s for one"
    assert refused["error"]["headers"]["Retry-After"] == "5"
    for t in (dropped, cut):
        assert t["error"]["status"] is None and t["error"]["message"] and t["output"] == []
    assert cut["prefill"] == "p0"  # the headers came before the stream broke
    for t in (refused, dropped, cut):
        assert t0 <= t["t_send"] <= t["error"]["t"] <= time.time()
    assert again["output"] == [7, 8] and "error" not in again
    # Each next prompt: the last one + the answer (none after an error) + 3 fresh tokens.
    p = router.prompts
    assert len(p) == 5 and len(p[0]) == 4
    assert p[1][:4] == p[0] and p[1][4:6] == [7, 8] and len(p[1]) == 4 + 2 + 3
    for a, b in zip(p[1:], p[2:]):
        assert b[:len(a)] == a and len(b) == len(a) + 3


async def test_the_summary_tables_and_verdict_count_errors_per_arm(router, monkeypatch):
    monkeypatch.setattr(fleet, "LeaseWaiter", NoLease)
    on = await _conversation(router, "c-on", True)
    off = await _conversation(router, "c-off", False)
    turns = [dict(t, round=1) for t in on + off]
    fleet.attribute(turns, {}, [])
    for t in turns:
        t["split"] = {"missing": []}
    run = {"turns": turns, "rounds": [], "router_decision_us_in_run": {"n": 1, "p50": 1.0, "p99": 1.0},
           "router_stats": {}, "last_turns_equal_single": [True, True], "startup_s": 1.0, "records_errors": True}
    s = fleet.summarise(run, ARGS.turns)
    assert s["errors"] == {"recorded": True, "on": {"count": 3, "by_status": {"503": 1, "transport": 2}},
                           "off": {"count": 3, "by_status": {"503": 1, "transport": 2}}}
    assert [p["turn"] for p in s["per_turn"]] == [1, 5]  # turns 2-4 got no answer in either arm
    assert s["affinity_later_turns"] == 1  # turn 1 -> 5 of the reuse-on conversation
    old = json.loads(OLD.read_text())
    result = {**old, "fleet": run, "config": {**old["config"], "turns": ARGS.turns, "rounds": 1}}
    table = fleet.markdown(result)
    assert "turns that got an HTTP or transport error, on / off: 3 (503 ×1, transport ×2) / 3 (503 ×1, " \
           "transport ×2)." in table
    rows = fleet.runs_table([("old.json", old), ("new.json", result)]).splitlines()
    assert rows[0].endswith("| turns with an error on / off |")
    assert rows[2].endswith("| – |") and rows[3].endswith("| 3 (503 ×1, transport ×2) / 3 (503 ×1, transport ×2) |")


def test_a_results_file_from_before_prints_as_it_did():
    old = json.loads(OLD.read_text())
    assert "records_errors" not in old["fleet"]
    s = fleet.summarise(old["fleet"], old["config"]["turns"])
    assert s["errors"] == {"recorded": False, "on": {"count": 0, "by_status": {}},
                           "off": {"count": 0, "by_status": {}}}
    assert "error" not in fleet.markdown(old)
    assert "error" not in fleet.runs_table([(OLD.name, old)])
    assert fleet.segments_table([(OLD.name, old)])
