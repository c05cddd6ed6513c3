"""``benchmarks/fleet.py``'s TTFT split: the engines' stats lines of one turn → its segments.

A logic test on hand-written lines (the lines themselves come from real engines in the
benchmark; their fields are pinned by tests/connector/test_kvbaton_scheduler.py and
test_flows.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
fleet = pytest.importorskip("fleet")


def _lines(read: bool) -> dict[str, list[dict]]:
    p = [{"event": "admitted", "t": 100.30, "transfer_id": "T", "role": "prefill", "request_id": "rp",
          "arrival_t": 100.10, "local_hit_tokens": 0, "external_tokens": 4096 if read else 0}]
    if read:
        p += [{"event": "reuse_read", "t": 100.40, "req_id": "rp", "num_blocks": 32, "nbytes": 1, "duration_s": 0.1,
               "pinned_s": 0.02, "begun_s": 0.03, "posted_s": 0.04},
              {"event": "admitted", "t": 100.55, "transfer_id": "T", "role": "prefill", "request_id": "rp",
               "arrival_t": 100.10, "local_hit_tokens": 4096, "external_tokens": 0}]
    p.append({"event": "rpc", "rpc": "Complete", "transfer_id": "T", "t": 100.95, "latency_ms": 50.0})
    d = [{"event": "admitted", "t": 101.00, "transfer_id": "T", "role": "decode", "request_id": "rd",
          "arrival_t": 100.98, "local_hit_tokens": 4992, "external_tokens": 1088},
         {"event": "recv_done", "t": 101.10, "transfer_id": "T", "num_blocks": 9, "nbytes": 2, "duration_s": 0.1,
          "begun_s": 0.01, "posted_s": 0.02}]
    return {"p0": p, "d0": d, "p1": [{"event": "admitted", "t": 100.3, "transfer_id": "other", "role": "prefill"}]}


def test_a_reuse_turn_splits_into_queue_read_wait_and_compute() -> None:
    turn = {"transfer_id": "T", "prefill": "p0", "decode": "d0", "t_send": 100.00, "ttft_ms": 1200.0}
    got = fleet.split(turn, _lines(read=True))
    seg = got["segments_ms"]
    assert list(seg) == list(fleet.SEGMENTS)
    assert seg == pytest.approx({"client→prefill engine": 100, "prefill queue": 200, "reuse READ": 100,
                                 "READ→compute admitted": 150, "prefill compute": 350, "prefill→decode engine": 80,
                                 "decode queue": 20, "pull READ": 100, "first token": 100})
    assert sum(seg.values()) == pytest.approx(turn["ttft_ms"])
    assert got["decode_pulled_tokens"] == 1088 and got["prefill_read_tokens"] == 4096 and got["read"]["pinned_s"] == 0.02


def test_a_turn_without_a_read_has_no_read_segments_and_missing_lines_are_named() -> None:
    turn = {"transfer_id": "T", "prefill": "p0", "decode": "d0", "t_send": 100.00, "ttft_ms": 1200.0}
    seg = fleet.split(turn, _lines(read=False))["segments_ms"]
    assert seg["reuse READ"] == 0 and seg["READ→compute admitted"] == 0 and seg["prefill compute"] == pytest.approx(600)
    lines = _lines(read=False)
    lines["d0"] = [e for e in lines["d0"] if e["event"] != "recv_done"]
    assert fleet.split(turn, lines) == {"missing": ["recv_done"]}


def test_summary_counts_reuse_off_prefix_hits_per_turn() -> None:
    """Whether reuse-off's prefill caches still held the history is part of the verdict
    (the case reuse exists for needs them not to): mean hit tokens and turns with none."""
    def turn(conv: str, reuse: bool, k: int, cached: int) -> dict:
        return {"conv": conv, "reuse": reuse, "turn": k, "prompt_tokens": 1000 * k, "ttft_ms": 100.0 * k,
                "reads": 0, "read_tokens": 0, "prefill": "p0", "decode": "d0", "attempts": 1, "round": 1,
                "prefill_cached_tokens": cached}
    turns = [turn("on", True, 1, 0), turn("on", True, 2, 896),
             turn("a", False, 1, 0), turn("a", False, 2, 0),
             turn("b", False, 1, 0), turn("b", False, 2, 896),
             turn("c", False, 1, 0), turn("c", False, 2, -1)]  # -1: the engine did not say
    s = fleet.summarise({"turns": turns}, 2)
    t1, t2 = s["per_turn"]
    assert (t1["cached_off_mean"], t1["cached_off_zero"]) == (0, 3)
    assert (t2["cached_off_mean"], t2["cached_off_zero"]) == (448, 1)


def test_segments_table_gives_each_arm_its_mean_segments_at_the_longest_turn() -> None:
    seg_on = dict.fromkeys(fleet.SEGMENTS, 10.0)
    seg_off = dict.fromkeys(fleet.SEGMENTS, 100.0)

    def turn(reuse: bool, k: int, ttft: float, seg: dict, cached: int, lookup: float) -> dict:
        return {"reuse": reuse, "turn": k, "ttft_ms": ttft, "prompt_tokens": 2000, "prefill_cached_tokens": cached,
                "split": {"segments_ms": seg}, "timing_ms": {"lookup": lookup} if reuse else {}}
    res = {"config": {"turns": 2}, "fleet": {"turns": [
        turn(True, 2, 90.0, seg_on, 1500, 4.0), turn(True, 2, 110.0, seg_on, 1500, 8.0),
        turn(True, 1, 5000.0, seg_off, 0, 0.0),  # not the longest turn: not in the rows
        turn(False, 2, 900.0, seg_off, 0, 0.0)]}}
    rows = fleet.segments_table([("r.json", res)]).splitlines()
    assert rows[2] == "| `r.json` | on | 2 | 100 | " + " | ".join(["10"] * len(fleet.SEGMENTS)) + " | 500 |"
    assert rows[3] == "| `r.json` | off | 1 | 900 | " + " | ".join(["100"] * len(fleet.SEGMENTS)) + " | 2,000 |"
    # later reuse-on turns only (turn 1 has nothing to look up)
    assert rows[-1].endswith("`r.json`: median 8, mean 6, p90 8, max 8 (2 turns).")
