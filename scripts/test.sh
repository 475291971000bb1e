#!/usr/bin/env bash
# Run the test suite from a fresh clone: creates .venv if needed, installs
# torch==2.13.0 first, then toast-compress[test] (editable), rebuilds the C extension,
# and runs pytest on one worker per core (at most 4; pytest-xdist), each with one
# thread. Extra arguments are passed to pytest, e.g.
#   bash scripts/test.sh -x -k moments
#   TOAST_TEST_WORKERS=1 bash scripts/test.sh --pdb    # one process (what --pdb needs)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
# The suite runs as without a network: lm-evaluation-harness and datasets read
# only local files and their caches (tests/hf/evaluate, tests/cli/test_eval.py).
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
# The suite is mostly small models, where a process gets little from a second
# thread: one thread per worker and a worker per core finish sooner than one
# process with every thread (and the threads a test runs with do not depend on
# the machine's cores).
cores="$(nproc 2>/dev/null || echo 1)"
workers="${TOAST_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
if [ "$workers" -gt 1 ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    set -- -n "$workers" "$@"
fi
exec "$TOAST_VENV/bin/python" -m pytest "$@"
