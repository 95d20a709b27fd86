#!/usr/bin/env bash
# Check the import-layer contract in .importlinter.  tpinv.models is installed from models/
# (setup.cfg package_dir), which grimp cannot see, so lint a view of the tree: tpinv/'s
# entries plus tpinv/models, all links to the sources.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
view="$(mktemp -d)"
trap 'rm -rf "$view"' EXIT
mkdir "$view/tpinv"
for entry in "$repo"/tpinv/*; do ln -s "$entry" "$view/tpinv/"; done
ln -s "$repo/models" "$view/tpinv/models"
cd "$view"
PYTHONPATH="$view" "$repo/.venv/bin/lint-imports" --config "$repo/.importlinter" "$@"
