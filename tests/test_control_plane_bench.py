"""benchmarks/control_plane.py in the fleet's shape: a prefill at TP > 1 (a Subscribe stream
per writing rank, each getting the MATCH) over mutual TLS with a bearer token, against the
real server and the floor (canned answers), both real ``kvbaton serve`` processes.

Why a test: the issue-17 tables quote these modes; a mode that silently measured something
else (the floor not delivering to the rank streams, a plaintext fallback) would make the
numbers lie. One short point each, so it proves the modes work, not how fast they are.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_tp2_over_mtls_matches_every_transfer_on_every_rank_stream(tmp_path):
    out = tmp_path / "cp.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "control_plane.py"), "--path", "session-answer", "--rate", "60",
         "--seconds", "1", "--grace", "2", "--tp", "2", "--secure", "--floor", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["config"]["tp"] == 2 and results["config"]["secure"] is True
    variants = {st["variant"]: st for st in results["stores"]}
    assert set(variants) == {"current", "floor"}
    for name, st in variants.items():
        (point,) = st["points"]
        assert point["tp"] == 2
        assert point["transfers"] > 0 and point["matches"] == point["accepted"] == point["transfers"], (name, point)
        assert point["lost"] == 0 and set(point["answers"]) == {"OK"}, (name, point)
        # Two calls in, two answers out (fewer when batched), and the MATCH on both rank
        # streams: at least the two stream messages per match beyond one call each way.
        assert point["messages_per_match"] >= 3.5, (name, point)
    # The keys and tokens made for the run are not left behind.
    assert results["config"]["pki"] and not Path(results["config"]["pki"]).exists()


def test_the_shape_table_pairs_each_round_of_this_server_with_the_floors(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("control_plane_bench", ROOT / "benchmarks" / "control_plane.py")
    assert spec is not None and spec.loader is not None
    cp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cp)

    def point(cpu: float, msgs: float, p99: float, lost: int = 0) -> dict:
        return {"target_rate": 500.0, "server_cpu_us_per_match": cpu, "messages_per_match": msgs, "p99_ms": p99,
                "answers": {"OK": 10}, "lost": lost}

    stores = [{"variant": "current", "round": 1, "points": [point(900, 7.8, 4.0)]},
              {"variant": "floor", "round": 1, "points": [point(600, 7.8, 3.0)]},
              {"variant": "floor", "round": 2, "points": [point(650, 7.7, 3.5)]},
              {"variant": "current", "round": 2, "points": [point(1000, 7.7, 5.0, lost=1)]}]
    f = tmp_path / "shape.json"
    f.write_text(json.dumps({"config": {"generators": 8, "tp": 4, "secure": True}, "stores": stores}))
    header, rule, row = cp.shape_table([str(f)]).splitlines()
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:5] == ["`shape.json`", "8", "4", "yes", "500"]
    assert cells[5] == "7.70–7.80 / 7.70–7.80"
    assert cells[6:9] == ["900–1,000", "600–650", "300–350"]  # round 1: 900-600, round 2: 1000-650
    assert cells[9] == "4.0–5.0 / 3.0–3.5" and cells[10] == "OK; 1 lost"
