"""Spans of blocks: ``(start, stop)`` slices of a model's block list.

Kept free of torch so that config-only accounting can use the same rules
as patching.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["validate_spans"]


def validate_spans(spans: Sequence[tuple[int, int]], num_blocks: int) -> list[tuple[int, int]]:
    """Sorted spans ``(start, stop)`` of blocks, checked to lie in
    ``[0, num_blocks]`` and not to overlap."""
    checked = []
    for span in spans:
        start, stop = (int(v) for v in span)
        if not 0 <= start < stop <= num_blocks:
            raise ValueError(
                f"span {tuple(span)} must satisfy 0 <= start < stop <= {num_blocks} "
                f"(blocks[start:stop] of a model with {num_blocks} blocks)"
            )
        checked.append((start, stop))
    checked.sort()
    for a, b in zip(checked, checked[1:], strict=False):
        if a[1] > b[0]:
            raise ValueError(f"spans {a} and {b} overlap")
    return checked
