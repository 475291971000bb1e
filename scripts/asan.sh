#!/usr/bin/env bash
# Sanitizer pass: build toast with AddressSanitizer + UndefinedBehaviorSanitizer into
# a private temporary directory (the in-place toast/_core*.so is left untouched, so
# other processes using this checkout are not disturbed), then run pytest against
# that build with the sanitizer runtimes preloaded into the (uninstrumented) Python.
#
#   bash scripts/asan.sh                    # pytest tests -m "not slow"
#   bash scripts/asan.sh tests/test_x.py -x # custom pytest arguments
#
# torch 2.13.0 (CPU) imports and runs fine with libasan preloaded, so the whole
# suite (torch-based tests included) runs under the sanitizers.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"   # venv + normal in-place build

find_sanitizer_runtimes   # sets LIBASAN, LIBUBSAN (setup_env.sh)

source "$(dirname "${BASH_SOURCE[0]}")/tmpdir.sh"
private_tmpdir ASAN_LIB asan   # removed at exit; left-overs of killed runs swept

_log "building toast with TOAST_SANITIZE=1 into $ASAN_LIB"
TOAST_SANITIZE=1 "$VPY" setup.py -q build --build-base "$ASAN_LIB/build" \
    --build-lib "$ASAN_LIB/lib"
rm -rf "$ASAN_LIB/build"

# Imported first (-p) so that every later `import toast` gets the sanitizer build;
# refuses to run if some other copy of toast would be tested instead.
cat > "$ASAN_LIB/lib/_toast_asan_guard.py" <<'PY'
import os

import toast._core

_want = os.path.realpath(os.path.join(os.path.dirname(__file__), "toast"))
_got = os.path.realpath(os.path.dirname(toast._core.__file__))
if _got != _want:
    raise SystemExit(f"asan: toast._core imported from {_got}, expected the sanitizer build {_want}")
print(f"asan: testing {toast._core.__file__}")
PY

if [ "$#" -eq 0 ]; then
    set -- tests -m "not slow and not hf"
fi

_log "running pytest under ASan+UBSan: $*"
# - the pytest console script (not `python -m pytest`) keeps the checkout's ./toast off
#   sys.path, so PYTHONPATH's sanitizer build is the one imported;
# - --capture=sys: sanitizer reports (written to fd 2) reach the terminal even when
#   the process aborts;
# - detect_leaks=0: CPython/numpy/torch keep allocations alive at exit by design;
# - allocator_may_return_null=1: huge malloc()s return NULL (MemoryError paths get
#   exercised) instead of ASan aborting with "allocation-size-too-big";
# - PYTHONMALLOC=malloc: Python objects go through malloc, visible to ASan.
LD_PRELOAD="$LIBASAN:$LIBUBSAN${LD_PRELOAD:+:$LD_PRELOAD}" \
ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:allocator_may_return_null=1}" \
UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}" \
PYTHONMALLOC=malloc \
PYTHONPATH="$ASAN_LIB/lib${PYTHONPATH:+:$PYTHONPATH}" \
    "$TOAST_VENV/bin/pytest" -p _toast_asan_guard -p no:cacheprovider --capture=sys "$@"
