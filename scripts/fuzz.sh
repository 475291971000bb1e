#!/usr/bin/env bash
# Fuzz toast._core with atheris (fuzz/fuzz_core.py), then replay every input under
# AddressSanitizer + UndefinedBehaviorSanitizer.
#
#   bash scripts/fuzz.sh -max_total_time=90                            # make fuzz-ci
#   FUZZ_WORK=fuzz/work bash scripts/fuzz.sh -max_total_time=1800 -print_final_stats=1
#                                                                      # make fuzz-long
# Arguments are libFuzzer flags for the fuzzing phase.
#
# Two phases, because coverage-guided fuzzing and gcc's ASan do not mix here:
#   1. coverage-guided fuzzing of the normal in-place build. atheris instruments the
#      Python bytecode (harness + toast/core.py) and the harness reports each call's
#      outcome (error path, solver branch) as extra coverage. Crashes, uncaught
#      exceptions, broken invariants and hangs (-timeout) fail here.
#   2. replay of the whole corpus (committed seeds, everything phase 1 kept, and any
#      crash input) once against an ASan+UBSan build of the extension made in a
#      private temporary directory (the in-place build is left alone), with the
#      sanitizer runtimes preloaded into the (uninstrumented) Python.
# Why not fuzz the ASan build directly: gcc's libasan.so exports its own
# __sanitizer_cov_* symbols, which then shadow atheris's libFuzzer and leave the
# fuzzer blind ("no interesting inputs were found"); atheris's documented remedy
# (a Python linked with libFuzzer, clang's -fsanitize=fuzzer-no-link) needs clang.
#
# Environment:
#   FUZZ_SANITIZE=0   skip phase 2
#   FUZZ_WORK=dir     working corpus (new inputs are written there; default: a temp
#                     dir). The committed seeds in fuzz/corpus are only read.
# Crashes, timeouts and OOMs are written to fuzz/artifacts/ (not committed).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"   # venv + normal in-place build

if ! "$VPY" -c "import atheris" 2>/dev/null; then
    _log "installing atheris (the 'fuzz' extra)"
    "$VPY" -m pip install "atheris>=2.3"
fi

source "$(dirname "${BASH_SOURCE[0]}")/tmpdir.sh"
private_tmpdir TMP_DIR fuzz   # removed at exit; left-overs of killed runs swept
WORK="${FUZZ_WORK:-$TMP_DIR/corpus}"
mkdir -p "$WORK" "$TMP_DIR/empty" fuzz/artifacts

# One OpenBLAS thread: inputs are tiny, and threads only add noise.
# -timeout: one input running 10 s is a hang. -rss_limit_mb: torch (+ ASan) ~1 GB.
# PATH: libFuzzer re-executes fuzz/fuzz_core.py itself for -merge and -minimize_crash.
common=(OPENBLAS_NUM_THREADS=1 "PATH=$TOAST_VENV/bin:$PATH")
flags=(-timeout=10 -rss_limit_mb=6144 -max_len=2048 -artifact_prefix=fuzz/artifacts/)

_log "phase 1: coverage-guided fuzzing of the normal build: $*"
status=0
env "${common[@]}" TOAST_FUZZ_EXPECT="$TOAST_ROOT/toast" \
    "$VPY" fuzz/fuzz_core.py "${flags[@]}" "$@" "$WORK" fuzz/corpus || status=$?

if [ "${FUZZ_SANITIZE:-1}" = "1" ]; then
    find_sanitizer_runtimes   # sets LIBASAN, LIBUBSAN (setup_env.sh)
    _log "building toast with TOAST_SANITIZE=1 into $TMP_DIR"
    TOAST_SANITIZE=1 "$VPY" setup.py -q build --build-base "$TMP_DIR/build" \
        --build-lib "$TMP_DIR/lib"
    rm -rf "$TMP_DIR/build"
    # Crash inputs of phase 1 are replayed too.
    mkdir -p "$TMP_DIR/crashes"
    find fuzz/artifacts -maxdepth 1 -type f -newer "$TMP_DIR/empty" \
        -exec cp {} "$TMP_DIR/crashes/" \;
    _log "phase 2: every input of $WORK, fuzz/corpus and new crashes under ASan+UBSan"
    # - detect_leaks=0: CPython/numpy/torch keep allocations alive at exit by design;
    # - allocator_may_return_null=1: huge malloc()s must come back as MemoryError;
    # - PYTHONMALLOC=malloc: Python objects go through malloc, visible to ASan.
    # -runs=0: execute each input once (the empty first directory receives nothing).
    set +e
    env "${common[@]}" \
        LD_PRELOAD="$LIBASAN:$LIBUBSAN${LD_PRELOAD:+:$LD_PRELOAD}" \
        ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:allocator_may_return_null=1:quarantine_size_mb=64}" \
        UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}" \
        PYTHONMALLOC=malloc \
        PYTHONPATH="$TMP_DIR/lib${PYTHONPATH:+:$PYTHONPATH}" \
        TOAST_FUZZ_EXPECT="$TMP_DIR/lib" \
        "$VPY" fuzz/fuzz_core.py "${flags[@]}" -runs=0 "$TMP_DIR/empty" "$WORK" \
        fuzz/corpus "$TMP_DIR/crashes" 2>&1 \
        | grep -v -e "^INFO: Instrumenting" -e "Coverage symbols are being provided" \
            -e "You can likely resolve this issue" -e "no interesting inputs" \
            -e "rejected all inputs"
    # (grep hides atheris's warnings about the expected missing coverage)
    replay=${PIPESTATUS[0]}
    set -e
    if [ "$replay" -ne 0 ]; then
        _log "phase 2 FAILED (exit $replay): an input misbehaves under ASan+UBSan"
        exit "$replay"
    fi
    _log "phase 2 passed: $(find "$WORK" fuzz/corpus "$TMP_DIR/crashes" -type f | wc -l) inputs"
fi
if [ "$status" -ne 0 ]; then
    _log "phase 1 FAILED (exit $status); the input is in fuzz/artifacts/"
fi
exit "$status"
