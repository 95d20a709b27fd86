#!/usr/bin/env bash
# The megatron-core version matrix: for each supported minor, a venv under .venvs/ that holds
# only that megatron-core (no dependencies) and sees everything else (torch, numpy, psutil, tpinv)
# through a .pth line adding the main venv's site-packages after its own; then the megatron tests run
# in it.  Reuses a venv whose megatron-core is already the wanted version.
#   tools/ci_megatron_versions.sh [VERSION ...]    (default: 0.12.3 0.13.1 0.14.0 0.15.3; 0.16.1 is
#                                                   the main venv's, tested by the main test step)
#   MCORE_TESTS="tests/distributed/test_megatron_gpt.py ..." to choose the tests,
#   MCORE_PYTEST_ARGS="-n 2" for pytest's options (default: -n 0).
# Measured on a shared 2-core machine: about 4 minutes (units + GPT test) to 8 minutes (with the
# training-loop test) per version; the megatron-core wheel install itself takes about 20 s.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.12.3 0.13.1 0.14.0 0.15.3)
MAIN=.venv
[ -x "$MAIN/bin/python" ] || { echo "no main venv at $MAIN: install it first (README step 1)"; exit 2; }
SITE=$("$MAIN/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
TESTS=${MCORE_TESTS:-"tests/unit/test_megatron_keys.py tests/unit/test_megatron_units.py tests/distributed/test_megatron_gpt.py tests/distributed/test_megatron_train.py"}
ARGS=${MCORE_PYTEST_ARGS:-"-n 0"}
status=0
for v in "${VERSIONS[@]}"; do
  venv=.venvs/mc${v//./}
  start=$(date +%s)
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv --without-pip "$venv"
  fi
  vsite=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir, not a bare path: the main venv's own .pth files (tpinv's editable finder) must run
  echo "import site; site.addsitedir('$SITE')" > "$vsite/_tpinv_main_venv.pth"
  have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>/dev/null || true)
  if [ "$have" != "$v" ] || ! [ -d "$vsite/megatron/core" ]; then
    "$MAIN/bin/python" -m pip install -q --no-deps --upgrade --target "$vsite" "megatron-core==$v"
  fi
  got=$("$venv/bin/python" -c 'import megatron.core, importlib.metadata as m; print(m.version("megatron-core"), megatron.core.__file__)')
  echo "== megatron-core $v: $got"
  # shellcheck disable=SC2086
  if ! "$venv/bin/python" -m pytest -q -p no:cacheprovider $ARGS $TESTS; then status=1; fi
  echo "== megatron-core $v: $(( $(date +%s) - start )) s"
done
exit $status
