"""Checks the size rules of the package: no function longer than 80 lines and
no module longer than 700 lines under toast/ (data tables are assignments,
not functions, so they do not count against the function limit).

Usage: python scripts/check_layout.py [ROOT]   (exit 1 and a list on failure)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 700


def violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n") + (not text.endswith("\n"))
        if lines > MAX_MODULE_LINES:
            found.append(f"{path}: module of {lines} lines (limit {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(
                        f"{path}:{node.lineno}: {node.name}() is {length} lines "
                        f"(limit {MAX_FUNCTION_LINES})"
                    )
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "toast"
    found = violations(root)
    for line in found:
        print(line)
    print(f"layout: {len(found)} violation(s) under {root}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
