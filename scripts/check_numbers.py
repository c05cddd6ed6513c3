"""Every number in the docs traces to a results file (run by scripts/lint.sh, so CI runs it).

Why: a benchmark figure in README.md, benchmarks/README.md or docs/*.md is only worth
something if anyone can find the run behind it. Checked here, cheaply, on every CI run:

1. every results path the docs cite (``results/...`` or ``benchmarks/results/...``,
   globs and ``{a,b}`` included) names at least one file that exists;
2. every cited JSON results file records the commit it was produced at and its
   configuration — in the file itself (``commit`` and one of ``config``/``argv``/
   ``args``/``setup``, at any depth), or, for files written before their scripts recorded
   a commit, in ``benchmarks/results/provenance.json`` (the commit that committed the file
   and the configuration as far as it is known), so the gap is written down;
3. every Markdown table of measurements (a body row with two or more numeric cells) sits in a section (heading to
   heading) that cites a results file, or names the script that prints it.

Exit status 1 with one line per problem; 0 and a one-line summary otherwise.
"""

from __future__ import annotations

import glob
import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROVENANCE = RESULTS / "provenance.json"
CITE = re.compile(r"(?:benchmarks/)?results/[A-Za-z0-9_.\-/{},*]+")
# A section may instead name the committed script that prints its table.
SCRIPT = re.compile(r"benchmarks/[a-z_]+\.py|tools/[a-z_]+\.py")
CONFIG_KEYS = ("config", "argv", "args", "setup")


def docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _braces(pattern: str) -> list[str]:
    """``a_{x,y}.json`` -> ``a_x.json``, ``a_y.json`` (one level, as the docs write them)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in _braces(pattern[:m.start()] + alt + pattern[m.end():])]


def cited(text: str) -> list[str]:
    """Results paths cited in ``text``, relative to the repository root."""
    out = []
    for m in CITE.finditer(text):
        path = m.group(0).rstrip(".,:/")
        if "{" in path and "}" not in path:  # a brace cut by the pattern: keep the prefix
            path = path.split("{", 1)[0] + "*"
        out.append(path if path.startswith("benchmarks/") else "benchmarks/" + path)
    return out


def resolve(path: str) -> list[Path]:
    return sorted({Path(p) for pat in _braces(path) for p in glob.glob(str(ROOT / pat))})


def _has(obj: Any, keys: tuple[str, ...], depth: int = 4) -> bool:
    if depth < 0:
        return False
    if isinstance(obj, dict):
        return any(k in keys and v for k, v in obj.items()) or any(_has(v, keys, depth - 1) for v in obj.values())
    if isinstance(obj, list) and obj:
        return _has(obj[0], keys, depth - 1)
    return False


def provenance_problems(files: set[Path], recorded: dict[str, Any]) -> list[str]:
    problems = []
    for f in sorted(files):
        if f.suffix != ".json":
            continue
        rel = str(f.relative_to(RESULTS))
        try:
            data = json.loads(f.read_text())
        except ValueError as exc:
            problems.append(f"{rel}: not JSON ({exc})")
            continue
        if _has(data, ("commit",)) and _has(data, CONFIG_KEYS):
            continue
        entry = recorded.get(rel)
        if not entry or not entry.get("committed_in") or not entry.get("config"):
            problems.append(f"{rel}: no commit/configuration in the file and none in {PROVENANCE.relative_to(ROOT)} "
                            f"(have the script write `commit` and `config` keys, or add an entry there)")
    return problems


_NUMBER = re.compile(r"^[~≈<>≤≥+-]?\s*[\d,]*\d(\.\d+)?\s*(ms|s|µs|us|%|×|x|[GMK]i?B(/s)?|/s)?$")


def _measured(row: str) -> bool:
    """A body row of a results table: two or more cells that are numbers (a settings
    table's one default per row is not a measurement)."""
    cells = [c.strip().strip("*`").strip() for c in row.strip().strip("|").split("|")]
    return sum(1 for c in cells if _NUMBER.match(c)) >= 2


def table_problems(doc: Path, text: str) -> list[str]:
    problems = []
    sections = re.split(r"(?m)^(?=#{1,6} )", text)
    line_no = 1
    for sec in sections:
        lines = sec.splitlines()
        traced = bool(CITE.search(sec) or SCRIPT.search(sec))
        for is_table, group in itertools.groupby(lines, key=lambda s: s.lstrip().startswith("|")):
            rows = list(group)
            if is_table and any(_measured(r) for r in rows[2:]) and not traced:
                problems.append(f"{doc.relative_to(ROOT)}:{line_no}: a table with numbers in a section that cites no "
                                f"results file ({rows[0].strip()[:60]})")
            line_no += len(rows)
    return problems


def main() -> int:
    recorded = json.loads(PROVENANCE.read_text()) if PROVENANCE.exists() else {}
    problems: list[str] = []
    files: set[Path] = set()
    n_cites = 0
    for doc in docs():
        text = doc.read_text()
        for path in cited(text):
            n_cites += 1
            found = resolve(path)
            if not found:
                problems.append(f"{doc.relative_to(ROOT)}: cites {path}, which does not exist")
            files.update(found)
        problems += table_problems(doc, text)
    problems += provenance_problems(files, recorded)
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"check_numbers: {n_cites} citations of {len(files)} results files in {len(docs())} documents, all traced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
