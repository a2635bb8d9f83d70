#!/usr/bin/env bash
# The whole test suite from a bare Python 3.11: a venv with the package and its test
# extra, the reference-library environments for cross-checks (tests/reference), then
# ruff and pytest on two xdist workers (a test file per worker at a time; arguments after this
# script go to pytest, `-n 0` for one process). Re-running reuses what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ERNIE_IR_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[test,paddle]"
if [ -f tests/reference/install_envs.sh ]; then
  export ERNIE_IR_REFENVS="${ERNIE_IR_REFENVS:-$HOME/.cache/ernie-ir/refenvs}"
  bash tests/reference/install_envs.sh
fi
"$VENV/bin/ruff" check ernie_ir tests benchmarks
export PATH="$PWD/$VENV/bin:$PATH"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
