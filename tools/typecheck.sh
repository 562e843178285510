#!/usr/bin/env bash
# mypy cannot follow setuptools' editable-install finder, and our packages live in folders whose
# names differ from their import names (runtime/ -> keyshift.runtime). Give mypy a tree that
# matches the import names, made of links to the real folders, and check that.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tree="$root/.typecheck"
rm -rf "$tree" && mkdir -p "$tree/keyshift"
for pkg in runtime policies operator spark; do
  ln -s "$root/$pkg" "$tree/keyshift/$pkg"
done
cd "$tree"
exec "$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --explicit-package-bases \
  -p keyshift.runtime -p keyshift.policies -p keyshift.operator -p keyshift.spark "$@"
