#!/usr/bin/env bash
# Run the toast demo from a fresh clone: creates .venv if needed, installs
# torch==2.13.0 first, then toast-compress[demo] (editable), rebuilds the C extension,
# and runs `python -m toast demo`. Extra arguments go to the demo.
set -euo pipefail
# A venv set up for the tests already has everything the demo needs.
if [ -z "${TOAST_EXTRAS:-}" ] && [ -f "$(dirname "${BASH_SOURCE[0]}")/../.venv/.toast-install-stamp" ]; then
    TOAST_EXTRAS="$(sed -n 's/.*\[\(.*\)\]$/\1/p' "$(dirname "${BASH_SOURCE[0]}")/../.venv/.toast-install-stamp")"
fi
export TOAST_EXTRAS="${TOAST_EXTRAS:-demo}"
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec "$TOAST_VENV/bin/python" -m toast demo "$@"
