#!/usr/bin/env bash
# Creates (or reuses) the project-local Python environment of the Python package and its tests
# (.venv, git-ignored), installs the package into it (`pip install .`), and with `test` runs
# tests/python with pytest. Called by ctest (Python.Package) and usable by hand:
#   scripts/python_env.sh          environment + package
#   scripts/python_env.sh test     that, then pytest tests/python (extra args go to pytest)
#   scripts/python_env.sh pytest ARGS   pytest ARGS against the package installed already
#   scripts/python_env.sh env      the environment alone, no package (the emulated-device build of
#                                  the module, make test-gpu-emulated, builds against it)
#   scripts/python_env.sh test-current
#                                  the same suite against the current PyPI torch + transformers
#                                  (python/requirements-current.txt) in .venv-current, built in
#                                  build-py-current/; opt-in, not in ctest (a ~5.6 GB venv)
# torch comes from Debian (python3-torch 1.13.1, CPU): PyPI's Linux wheels pull gigabytes of
# CUDA libraries; matplotlib (kvtier.tools.plot) is Debian's python3-matplotlib 3.6.3 too. The venv
# sees Debian's site-packages (--system-site-packages) and adds the pinned PyPI packages of
# python/requirements-test.txt. Each step is skipped when done already, so a second run costs
# the package rebuild only (incremental, in build-py/).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE="${1:-}"
if [[ "$MODE" == "test-current" ]]; then
  # Everything from PyPI (no --system-site-packages: Debian's torch 1.13 and numpy 1.24 would
  # shadow nothing, but the venv must not see them either), and its own CMake build folder:
  # build-py/'s cache names Debian's venv interpreter.
  VENV="${KVTIER_VENV_CURRENT:-$ROOT/.venv-current}"
  REQ="$ROOT/python/requirements-current.txt"
  [[ -x "$VENV/bin/python" ]] || /usr/bin/python3 -m venv "$VENV"
  PY="$VENV/bin/python"
  if ! cmp -s "$REQ" "$VENV/.kvtier-requirements"; then
    "$PY" -m pip install -q --disable-pip-version-check -r "$REQ"
    cp "$REQ" "$VENV/.kvtier-requirements"
  fi
  "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
    -C build-dir=build-py-current "$ROOT"
  shift
  cd "$ROOT"
  "$PY" -c 'import torch, transformers; print(f"python_env: torch {torch.__version__}, transformers {transformers.__version__}")'
  exec "$PY" -m pytest -q tests/python "$@"
fi
VENV="${KVTIER_VENV:-$ROOT/.venv}"
if [[ "$MODE" == "pytest" ]]; then
  # pytest on the package an earlier call installed (ctest: Python.Package, then one test per file).
  shift
  [[ -x "$VENV/bin/python" ]] || { echo "python_env: no venv at $VENV (run scripts/python_env.sh first)" >&2; exit 1; }
  cd "$ROOT"
  exec "$VENV/bin/python" -m pytest -q "$@"
fi
# The build's Debian packages plus the interpreter's (headers, venv, numpy, torch): the same
# missing-only install as `make` uses.
bash "$ROOT/scripts/deps.sh" python

# Debian's interpreter: the one python3-torch and python3-numpy are built for.
if [[ ! -x "$VENV/bin/python" ]]; then
  /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
REQ="$ROOT/python/requirements-test.txt"
STAMP="$VENV/.kvtier-requirements"
if ! cmp -s "$REQ" "$STAMP"; then
  "$PY" -m pip install -q --disable-pip-version-check -r "$REQ"
  cp "$REQ" "$STAMP"
fi
[[ "$MODE" == "env" ]] && exit 0

# No build isolation: the build requirements are in the venv already (pinned above), so a
# rebuild downloads nothing; build-py/ keeps CMake's objects between runs.
# KVTIER_PY_CUDA=on|off (set by ctest's Python.Package to its build's setting) overrides the
# package's default KVTIER_CUDA=off: with the flags of the build beside it, ccache hands pip
# that build's objects.
CUDA_DEFINE=()
[[ -n "${KVTIER_PY_CUDA:-}" ]] && CUDA_DEFINE=("--config-settings=cmake.define.KVTIER_CUDA=$KVTIER_PY_CUDA")
"$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps "${CUDA_DEFINE[@]}" "$ROOT"

if [[ "${1:-}" == "test" ]]; then
  shift
  cd "$ROOT"
  exec "$PY" -m pytest -q tests/python "$@"
fi
