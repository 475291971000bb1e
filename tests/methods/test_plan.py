"""A method's own setting rides in a plan as its part: a toy part, defined
here and known to no framework module, reads in the plan's key, label and
dict, is found again by its method, and says where the plan's changes
start, with no change to :mod:`toast.methods.plan` or
:mod:`toast.methods.stages`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from toast.methods.plan import SLOTS, Part, Plan


@dataclasses.dataclass(frozen=True)
class ToyPart:
    """A toy method's level, changing the blocks from ``start`` on."""

    level: int
    start: int | None = 2

    @property
    def method(self) -> str:
        return "toy"

    @property
    def fixes_tokens(self) -> bool:
        return False

    def first_block(self) -> int | None:
        return self.start

    def key(self) -> str:
        return f"toy{self.level}"

    def label(self) -> tuple[str, ...]:
        return (f"toy level {self.level}",)

    def entries(self) -> dict[str, Any]:
        return {"toy": self.level}


def _plain() -> Plan:
    return Plan(("remove",), "plain", ((3, 5),), "identity", 10, 0.5, extendable=True)


def test_a_toy_part_reads_in_key_label_and_dict():
    plan = _plain().with_part(ToyPart(3), methods=("remove", "toy"), family="plain+toy")
    assert isinstance(ToyPart(3), Part)
    assert plan.key == "plain+toy|identity|3-5|||toy3"
    assert plan.label == "plain+toy: remove blocks[3:5], toy level 3"
    entry = plan.to_dict()
    assert list(entry) == [
        "key", "methods", "family", "label", "spans", "translator", *SLOTS,
        "params", "predicted", "toy",
    ]  # fmt: skip
    assert entry["toy"] == 3 and entry["key"] == plan.key and entry["label"] == plan.label
    assert json.loads(json.dumps(entry)) == entry  # a result file's entry as it is
    assert plan.part("toy") == ToyPart(3) and _plain().part("toy") is None


def test_a_part_keeps_a_plain_plans_key_when_absent_and_plans_stay_hashable():
    plain = _plain()
    assert plain.key == "plain|identity|3-5||"  # the format before parts
    assert "toy" not in plain.to_dict()
    one = plain.with_part(ToyPart(1))
    assert len({one, plain.with_part(ToyPart(1)), plain.with_part(ToyPart(2))}) == 2
    assert one.key != plain.with_part(ToyPart(2)).key


def test_a_part_filling_a_slot_takes_the_slot_not_a_new_entry():
    @dataclasses.dataclass(frozen=True)
    class Slotted(ToyPart):
        def key(self) -> str:
            return ""

        def entries(self) -> dict[str, Any]:
            return {SLOTS[1]: f"level{self.level}"}

    plan = _plain().with_part(Slotted(4))
    assert plan.key == "plain|identity|3-5||level4"
    assert plan.to_dict()[SLOTS[1]] == "level4" and "toy" not in plan.to_dict()


def test_the_search_resumes_past_the_blocks_a_part_leaves():
    from toast.frontier.bench import first_changed_block

    assert first_changed_block(_plain(), 6) == 3
    assert first_changed_block(_plain().with_part(ToyPart(1, start=2)), 6) == 2
    assert first_changed_block(_plain().with_part(ToyPart(1, start=4)), 6) == 3
    assert first_changed_block(_plain().with_part(ToyPart(1, start=None)), 6) == 3
