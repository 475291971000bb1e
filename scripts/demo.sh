#!/usr/bin/env bash
# Run the toast demo from a fresh clone: creates .venv if needed, installs
# torch==2.13.0 first, then toast[test] (editable), rebuilds the C extension,
# and runs `python -m toast demo`. Extra arguments go to the demo.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
exec "$TOAST_VENV/bin/python" -m toast demo "$@"
