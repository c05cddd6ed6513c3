"""scripts/check_numbers.py (run by scripts/lint.sh): the repository passes, and each of
its three checks catches what it is for."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("check_numbers", ROOT / "scripts" / "check_numbers.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_docs_trace(capsys) -> None:
    assert _load().main() == 0, capsys.readouterr().out


def test_a_table_of_measurements_needs_a_citation() -> None:
    cn = _load()
    table = "| mode | p50 ms | p99 ms |\n|---|---|---|\n| push | 12.5 | 40.1 |\n"
    settings = "| key | default | what |\n|---|---|---|\n| `timeout_s` | 30 | bound |\n"
    doc = ROOT / "README.md"
    assert cn.table_problems(doc, "## Speed\n\n" + table)
    assert not cn.table_problems(doc, "## Speed\n\nFrom `results/fleet_evict.json`:\n\n" + table)
    assert not cn.table_problems(doc, "## Settings\n\n" + settings)  # one default per row: not a measurement


def test_citations_resolve_and_results_record_their_commit(tmp_path: Path) -> None:
    cn = _load()
    assert cn.cited("see `results/datapath_*.{json,md}` and benchmarks/results/x.json.") == [
        "benchmarks/results/datapath_*.{json,md}", "benchmarks/results/x.json"]
    assert cn.resolve("benchmarks/results/datapath_gpu.{json,md}")
    assert not cn.resolve("benchmarks/results/no_such_run.json")
    cn.RESULTS = tmp_path
    good, bare = tmp_path / "good.json", tmp_path / "bare.json"
    good.write_text(json.dumps({"commit": "abc", "config": {"rate": 1}}))
    bare.write_text(json.dumps({"rows": [1, 2]}))
    (problem,) = cn.provenance_problems({good, bare}, {})
    assert problem.startswith("bare.json: no commit/configuration in the file"), problem
    assert cn.provenance_problems({bare}, {"bare.json": {"committed_in": "abc", "config": "defaults"}}) == []
