#!/usr/bin/env bash
# Sanitizer pass: rebuild toast._core in place with AddressSanitizer +
# UndefinedBehaviorSanitizer, run pytest with the sanitizer runtimes preloaded into
# the (uninstrumented) Python interpreter, then rebuild the normal extension.
#
#   bash scripts/asan.sh                 # pytest tests -m "not slow"
#   bash scripts/asan.sh tests/test_x.py # custom pytest arguments
#
# torch 2.13.0 (CPU) imports and runs fine with libasan preloaded, so the whole
# suite (torch-based tests included) runs under the sanitizers.
set -euo pipefail
export TOAST_SANITIZE=1
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"

# Whatever happens, put back a normal (uninstrumented) build: an ASan-built
# _core cannot be imported without LD_PRELOAD.
restore() {
    local rc=$?
    _log "restoring the normal (uninstrumented) build of toast._core"
    TOAST_SANITIZE=0 "$VPY" setup.py -q build_ext --inplace --force || rc=1
    exit "$rc"
}
trap restore EXIT

CC_BIN="${CC:-gcc}"
LIBASAN="$("$CC_BIN" -print-file-name=libasan.so)"
LIBUBSAN="$("$CC_BIN" -print-file-name=libubsan.so)"
for lib in "$LIBASAN" "$LIBUBSAN"; do
    [ -e "$lib" ] || { _log "sanitizer runtime not found: $lib (install gcc's libasan/libubsan)"; exit 1; }
done

if [ "$#" -eq 0 ]; then
    set -- tests -m "not slow"
fi

_log "running pytest under ASan+UBSan: $*"
# - detect_leaks=0: CPython/numpy/torch keep allocations alive at exit by design.
# - allocator_may_return_null=1: huge malloc()s return NULL (so MemoryError paths
#   are exercised) instead of ASan aborting on "allocation-size-too-big".
# - PYTHONMALLOC=malloc: Python objects go through malloc, visible to ASan.
# (no `exec` here, so that the EXIT trap runs)
LD_PRELOAD="$LIBASAN:$LIBUBSAN${LD_PRELOAD:+:$LD_PRELOAD}" \
ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:allocator_may_return_null=1}" \
UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}" \
PYTHONMALLOC=malloc \
    "$VPY" -m pytest -p no:cacheprovider --capture=sys "$@"
