"""benchmarks/gc_probe.py records a server's collections, and control_plane.py hands each
benchmark point the ones that ran during it (so a stall in a point's p99 can be lined up
with a collector pass, or ruled out)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _control_plane():
    spec = importlib.util.spec_from_file_location("control_plane_bench", ROOT / "benchmarks" / "control_plane.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_probe_writes_every_collection_of_the_program_it_runs(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import gc, sys\ngc.collect(0)\ngc.collect()\nsys.exit(3)\n")
    out = tmp_path / "gc.json"
    before = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gc_probe.py"), str(script)],
                          env={"KVBATON_GC_PROBE_OUT": str(out), "PATH": ""}, timeout=60)
    assert proc.returncode == 3  # the program's own exit status
    probe = json.loads(out.read_text())
    gens = [int(p[1]) for p in probe["passes"]]
    assert gens[-2:] == [0, 2]
    assert all(before <= p[0] <= time.monotonic() and p[2] >= 0 and p[3] >= 0 for p in probe["passes"])


def test_a_module_runs_as_with_python_dash_m(tmp_path):
    (tmp_path / "probed_mod.py").write_text("import gc, sys\ngc.collect(1)\nprint(sys.argv[1:])\n")
    out = tmp_path / "gc.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gc_probe.py"), "-m", "probed_mod", "a", "b"],
                          env={"KVBATON_GC_PROBE_OUT": str(out), "PATH": ""}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['a', 'b']"
    assert 1 in [int(p[1]) for p in json.loads(out.read_text())["passes"]]


def test_each_point_gets_the_collections_within_its_window(tmp_path):
    cp = _control_plane()
    probe = {"threshold": [700, 10, 2], "passes": [
        [10.0, 0, 0.1, 0.2, 0],    # start-up: no point's
        [100.5, 0, 0.3, 0.4, 1],
        [101.0, 2, 7.5, 8.0, 5],   # a full pass over 5 ms, 1 s into the first point
        [200.2, 1, 1.0, 1.2, 0],
    ]}
    path = tmp_path / "gc.json"
    path.write_text(json.dumps(probe))
    points = [{"_window": (100.0, 110.0)}, {"_window": (200.0, 210.0)}, {"_window": (300.0, 310.0)}]
    whole = cp.attach_gc([path], points)
    assert whole["passes"] == {"0": 2, "1": 1, "2": 1} and whole["max_wall_ms"] == 8.0
    first, second, third = (p["gc"] for p in points)
    assert first["passes"] == {"0": 1, "2": 1} and first["cpu_ms"] == 7.8
    assert first["over_5ms"] == [{"at_s": 1.0, "gen": 2, "wall_ms": 8.0, "cpu_ms": 7.5}]
    assert second["passes"] == {"1": 1} and second["over_5ms"] == []
    assert third["passes"] == {} and third["max_wall_ms"] == 0.0
    assert all("_window" not in p for p in points)
    assert cp.gc_cell(first) == "1/0/1, 8.0" and cp.gc_cell(None) == "–"


def test_a_server_that_left_no_probe_output_is_said_so(tmp_path):
    cp = _control_plane()
    points = [{"_window": (1.0, 2.0)}]
    assert "error" in cp.attach_gc([tmp_path / "missing.json"], points)
    assert points == [{}]


def test_with_several_replicas_each_point_gets_every_replicas_collections(tmp_path):
    cp = _control_plane()
    paths = []
    for i, passes in enumerate(([[100.5, 0, 0.3, 0.4, 1]], [[100.7, 2, 6.0, 6.5, 3], [150.0, 0, 0.1, 0.1, 0]])):
        paths.append(tmp_path / f"gc{i}.json")
        paths[-1].write_text(json.dumps({"threshold": [700, 10, 2], "passes": passes}))
    points = [{"_window": (100.0, 110.0)}]
    whole = cp.attach_gc(paths, points)
    assert whole["passes"] == {"0": 1} and whole["replicas"][0]["passes"] == {"0": 1, "2": 1}
    (point,) = points
    assert point["gc"]["passes"] == {"0": 1}  # the first replica's, as with one
    assert [g["passes"] for g in point["gc_by_replica"]] == [{"0": 1}, {"2": 1}]
    assert point["gc_by_replica"][1]["over_5ms"] == [{"at_s": 0.7, "gen": 2, "wall_ms": 6.5, "cpu_ms": 6.0}]


def test_several_generator_processes_make_one_point():
    """--generators: latencies pooled (the p99 is over every match, not an average of
    p99s), answers and counts summed, the slowest 1 % taken from the pool."""
    cp = _control_plane()

    def part(lat, answers, lost, cpu_s):
        return {"path": "session", "target_rate": 50.0, "seconds": 1.0, "transfers": len(lat) + lost,
                "accepted": len(lat) + lost, "matches": len(lat), "p99_ms": max(lat), "answers": answers,
                "reasons": {k: [f"why {k}"] for k in answers if k != "OK"}, "lost": lost, "half": 0, "unanswered": 0,
                "send_lag_p99_ms": 0.5, "start_late_ms": 0.0, "offer_lead_ms": 0.0, "shed_retries": 1,
                "_lat_due": [[ms, i / 100] for i, ms in enumerate(lat)], "_refused": {}, "_messages": 4 * len(lat),
                "_span_s": 1.2, "_sent": [2 * len(lat), len(lat)], "_cpu_s": cpu_s}

    fast = part([1.0] * 99, {"OK": 198}, 0, 0.1)
    slow = part([2.0] * 98 + [50.0, 60.0], {"OK": 200, "RESOURCE_EXHAUSTED": 2}, 1, 0.2)
    m = cp.merge_generators([fast, slow], 100.0)
    assert m["matches"] == 199 and m["transfers"] == 200 and m["lost"] == 1
    assert m["p50_ms"] == 2.0 and m["p99_ms"] == 50.0 and m["max_ms"] == 60.0
    assert m["answers"] == {"OK": 398, "RESOURCE_EXHAUSTED": 2}
    assert m["reasons"] == {"RESOURCE_EXHAUSTED": ["why RESOURCE_EXHAUSTED"]}
    assert m["achieved_rate"] == 199 / 1.2 and m["target_rate"] == 100.0
    assert m["messages_per_match"] == 4.0 and m["calls_per_batch"] == 2.0 and m["shed_retries"] == 2
    assert m["generator_cpu_s"] == [0.1, 0.2] and [g["p99_ms"] for g in m["by_generator"]] == [1.0, 60.0]
    assert [s["ms"] for s in m["slowest_1pct"]] == [60.0]
    assert not any(k.startswith("_") for k in m)
