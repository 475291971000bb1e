#!/usr/bin/env bash
# Static checks of the package, as CI runs them: ruff (style, imports,
# complexity), import-linter (architecture contracts in pyproject.toml, imports
# inside functions included), the import rules of scripts/check_imports.py (no
# module uses another module's private _names; frontier/ and cli/ reach the
# methods only through toast.methods and toast.methods.base), mypy (types of
# toast/) and the size rules (functions <= 80 lines, modules <= 700 lines).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$TOAST_ROOT"
echo "==> ruff check"
"$TOAST_VENV/bin/ruff" check .
echo "==> lint-imports"
"$TOAST_VENV/bin/lint-imports"
echo "==> private names"
"$TOAST_VENV/bin/python" scripts/check_imports.py toast
echo "==> mypy toast"
"$TOAST_VENV/bin/mypy" toast
echo "==> size rules"
"$TOAST_VENV/bin/python" scripts/check_layout.py toast
echo "==> method boundaries (frontier/, cli/ use the methods' stage API only; methods never import each other)"
"$TOAST_VENV/bin/python" scripts/check_imports.py --strict toast
