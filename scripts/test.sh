#!/usr/bin/env bash
# Run the test suite from a fresh clone: creates .venv if needed, installs
# torch==2.13.0 first, then toast-compress[test] (editable), rebuilds the C extension,
# and runs pytest. Extra arguments are passed to pytest, e.g.
#   bash scripts/test.sh -x -k moments
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
# The suite runs as without a network: lm-evaluation-harness and datasets read
# only local files and their caches (tests/hf/evaluate, tests/cli/test_eval.py).
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
exec "$TOAST_VENV/bin/python" -m pytest "$@"
