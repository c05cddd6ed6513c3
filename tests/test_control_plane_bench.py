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
