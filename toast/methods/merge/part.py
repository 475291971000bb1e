"""A token reducer's share of a plan (:class:`MergePart`): the setting its
stages install when they apply the plan, named in the plan's key, label
and dict as ``merge`` (ToMe's ``r`` as an int, as before other reducers
existed; another reducer's setting label as a str)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MergePart"]


@dataclass(frozen=True)
class MergePart:
    """``method``: the reducer's registered name (``"tome"``, ``"rapid"``...);
    ``setting``: ToMe's ``r`` in every block (an int) or a reducer's named
    setting (a str, e.g. ``"RAPID r=11, prune<6"``)."""

    method: str
    setting: int | str

    @property
    def fixes_tokens(self) -> bool:
        return True  # its savings are counted at the tokens it leaves

    def first_block(self) -> int | None:
        return 0  # fewer tokens from the first block on

    def key(self) -> str:
        return f"r{self.setting}" if isinstance(self.setting, int) else self.setting

    def label(self) -> tuple[str, ...]:
        if isinstance(self.setting, int):
            return (f"ToMe r={self.setting}",)
        return (self.setting,)

    def entries(self) -> dict[str, Any]:
        return {"merge": self.setting}
