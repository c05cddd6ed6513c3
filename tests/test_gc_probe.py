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
    whole = cp.attach_gc(path, points)
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
    assert "error" in cp.attach_gc(tmp_path / "missing.json", points)
    assert points == [{}]
