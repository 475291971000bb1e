#!/usr/bin/env bash
# Run the test suite from a fresh clone: creates .venv if needed, installs
# torch==2.13.0 first, then toast-compress[test] (editable), rebuilds the C extension,
# and runs pytest on a worker more than the cores (at most 4; pytest-xdist, work
# stealing), each with one thread. Extra arguments are passed to pytest, e.g.
#   bash scripts/test.sh -x -k moments
#   TOAST_TEST_WORKERS=1 bash scripts/test.sh --pdb    # one process (what --pdb needs)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
# The suite runs as without a network: lm-evaluation-harness and datasets read
# only local files and their caches (tests/hf/evaluate, tests/cli/test_eval.py).
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
# The suite is mostly small models, where a process gets little from a second
# thread, and many tests wait on a child process: one thread per worker and one
# worker more than the cores finish sooner than one process with every thread
# (on 2 cores: 764 s with 3 workers, 952 s with 2, 1,518 s with one process).
# Work stealing keeps the long tests from ending the run on one worker.
cores="$(nproc 2>/dev/null || echo 1)"
workers="${TOAST_TEST_WORKERS:-$(( cores + 1 < 4 ? cores + 1 : 4 ))}"
if [ "$workers" -gt 1 ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    set -- -n "$workers" --dist worksteal "$@"
fi
exec "$TOAST_VENV/bin/python" -m pytest "$@"
