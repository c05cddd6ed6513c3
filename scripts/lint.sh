#!/usr/bin/env bash
# Static checks (run by scripts/test.sh before pytest; configuration in pyproject.toml):
#   ruff          lint + import order over everything but generated code
#   mypy          types of kvbaton/, services/ and connector/ (generated code excluded)
#   lint-imports  import contracts: layering, no product -> tests, no cycles in a package
#   grep          benchmarks/, scripts/ and tools/ (not packages) never import tests
#   check_numbers every results file the docs cite exists and records its commit and
#                 configuration; every table of measurements cites one (scripts/check_numbers.py)
# Usage: bash scripts/lint.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PY=${KVBATON_PY:-$root/.venv/bin/python}
status=0
step() { echo "== $*" >&2; }

step "ruff check"
"$PY" -m ruff check --no-cache services connector kvbaton tests benchmarks scripts tools || status=1

# mypy and grimp (import-linter) cannot follow setuptools' editable-install finder, which maps
# kvbaton.services -> services/ and kvbaton.connector -> connector/: give them a tree of
# symbolic links shaped like the installed package instead.
mirror=$(mktemp -d)
trap 'rm -rf "$mirror"' EXIT
mkdir "$mirror/kvbaton"
for entry in kvbaton/*; do
  case $entry in kvbaton/services|kvbaton/connector|*/__pycache__) continue ;; esac
  ln -s "$root/$entry" "$mirror/kvbaton/"
done
ln -s "$root/services" "$mirror/kvbaton/services"
ln -s "$root/connector" "$mirror/kvbaton/connector"
ln -s "$root/tests" "$mirror/tests"

step "mypy (kvbaton, kvbaton.services, kvbaton.connector)"
# Paths are printed as in the checkout (kvbaton/services/x.py -> services/x.py).
if ! (cd "$mirror" && "$PY" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" \
        -p kvbaton) > "$mirror/mypy.out" 2>&1; then
  status=1
fi
sed -e 's#^kvbaton/services/#services/#' -e 's#^kvbaton/connector/#connector/#' "$mirror/mypy.out"

step "lint-imports"
(cd "$mirror" && PYTHONPATH="$mirror" "$PY" -c 'import sys; from importlinter.cli import lint_imports_command as m; sys.argv[0] = "lint-imports"; m()' \
    "$root/pyproject.toml" --no-cache) || status=1

step "no imports of tests outside tests/"
if grep -rnE '^\s*(from|import)\s+tests(\.|\s|$)' --include='*.py' benchmarks scripts tools; then
  echo "the files above import tests: move what they need into the product (kvbaton/)" >&2
  status=1
fi

step "docs numbers trace to results files"
"$PY" scripts/check_numbers.py || status=1

if [ "$status" -ne 0 ]; then echo "lint: FAILED" >&2; else echo "lint: OK" >&2; fi
exit "$status"
