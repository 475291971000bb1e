"""Blocks of a Markdown file between ``<!-- name -->`` and ``<!-- /name -->``:
where the README and ``benchmarks/README.md`` quote a results file
(written by the benchmarks' ``--readme``, checked by ``scripts/check_docs.py``)."""

from __future__ import annotations

__all__ = ["MarkerError", "block", "replace_block"]


class MarkerError(ValueError):
    """A file lacks the markers of a block, or has them more than once."""


def _split(text: str, name: str, where: str) -> tuple[str, str, str]:
    start, stop = f"<!-- {name} -->\n", f"<!-- /{name} -->"
    if text.count(start) != 1 or text.count(stop) != 1:
        raise MarkerError(
            f"{where}: expected one '<!-- {name} -->' line and one '<!-- /{name} -->' "
            f"(found {text.count(start)} and {text.count(stop)}); put them around the quoted block"
        )
    head, rest = text.split(start, 1)
    body, tail = rest.split(stop, 1)
    return head, body, tail


def block(text: str, name: str, where: str = "the file") -> str:
    """The text between the markers, without its final newline."""
    return _split(text, name, where)[1].removesuffix("\n")


def replace_block(text: str, name: str, body: str, where: str = "the file") -> str:
    """``text`` with the block ``name`` replaced by ``body``."""
    head, _, tail = _split(text, name, where)
    return f"{head}<!-- {name} -->\n{body}\n<!-- /{name} -->{tail}"
