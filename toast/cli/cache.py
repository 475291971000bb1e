"""``toast cache list`` and ``toast cache clear``: what ``toast search`` keeps
between calls, or with ``--gguf`` the float32 copies of GGUF files
(:mod:`toast._cachedir`: entries, their sizes and last use, the total against
``$TOAST_CACHE_LIMIT``). Torch-free: nothing is loaded."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from toast._cachedir import (
    LIMIT_VARIABLE,
    cache_limit,
    clear,
    entries,
    gguf_cache_dir,
    search_cache_dir,
)
from toast._validation import format_size
from toast.cli.options import EXIT_STATUSES

__all__ = ["add_parser", "run"]

_HELP = "list or clear the search cache (what toast search keeps between calls)"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cache", help=_HELP, description=_HELP, epilog=EXIT_STATUSES)
    p.add_argument(
        "action",
        choices=["list", "clear"],
        help="list: entries, sizes, last use and the total against the limit "
        f"(${LIMIT_VARIABLE}, default 10GiB); clear: remove every entry",
    )
    p.add_argument(
        "--cache", default=None, help="cache folder (~/.cache/toast/search, as toast search)"
    )
    p.add_argument(
        "--gguf",
        action="store_true",
        help="the float32 copies of GGUF files a first load wrote (~/.cache/toast/gguf), "
        "not the search cache",
    )


def run(args: argparse.Namespace) -> int:
    if args.cache and args.gguf:
        raise ValueError("--cache and --gguf name two folders: give one")
    root = Path(args.cache) if args.cache else gguf_cache_dir() if args.gguf else search_cache_dir()
    if root.exists() and not root.is_dir():
        raise ValueError(f"--cache {args.cache} is a file; give the cache folder")
    if args.action == "clear":
        removed = clear(root)
        total = sum(e.size for e in removed)
        print(f"removed {len(removed)} entries ({format_size(total)}) from {root}")
        return 0
    limit = cache_limit()
    found = entries(root)
    total = sum(e.size for e in found)
    held = f"{format_size(total)} of {format_size(limit)}"
    print(f"{root}: {len(found)} entries, {held} (${LIMIT_VARIABLE})")
    for entry in reversed(found):  # most recently used first
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.used))
        print(f"  {used}  {format_size(entry.size):>10}  {entry.path.name}")
    return 0
