#!/usr/bin/env bash
# mypy cannot follow setuptools' editable-install finder, and our packages live in folders whose
# names differ from their import names (runtime/ -> keyshift.runtime). Give mypy a tree that
# matches the import names, made of links to the real folders, and check that: the packages,
# then the tests, the kind suite and the examples (which import the packages as users do), then
# the benchmarks and the Spark demo (scripts that import each other by file name, so each is
# checked from its own folder). The four runs share one cache, outside the tree that is made
# anew each time: each run imports much of what the one before analysed (our packages, PySpark's
# typed sources, the stubs), which a fresh clone's CI would otherwise analyse up to four times.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tree="$root/.typecheck"
mypy=("$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache")
rm -rf "$tree" && mkdir -p "$tree/keyshift"
for pkg in runtime policies operator spark; do
  ln -s "$root/$pkg" "$tree/keyshift/$pkg"
done
for dir in tests e2e examples; do
  ln -s "$root/$dir" "$tree/$dir"
done
cd "$tree"
"${mypy[@]}" --explicit-package-bases \
  -p keyshift.runtime -p keyshift.policies -p keyshift.operator -p keyshift.spark "$@"
"${mypy[@]}" --explicit-package-bases --exclude '^examples/spark/' tests e2e examples "$@"
for scripts in bench examples/spark; do
  (cd "$root/$scripts" && MYPYPATH="$tree" "${mypy[@]}" ./*.py "$@")
done
