"""The calibration split shared by the held-out checks."""

from __future__ import annotations

import pytest
import torch

from toast.hf.evaluate.check import CheckSplit, leading_rows, take_rows, unchecked_because


class _Generated:
    """A re-iterable without ``len``: a fresh generator on every iteration."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return (k for k in range(self.n))


#: batches -> the held-out ones with check_fraction=0.1 (groups of 10)
HELD = {2: [1], 5: [4], 9: [8], 10: [9], 25: [9, 19]}


@pytest.mark.parametrize("n", sorted(HELD))
@pytest.mark.parametrize("wrap", [list, _Generated])
def test_every_batch_goes_exactly_once_and_the_same_way_on_every_pass(n, wrap):
    split = CheckSplit(wrap(list(range(n))) if wrap is list else wrap(n), 0.1)
    fit, check = list(split.fit), list(split.check)
    assert check == HELD[n]
    assert sorted(fit + check) == list(range(n))
    assert (list(split.fit), list(split.check)) == (fit, check)
    assert split.has_check()
    assert unchecked_because(split, sequential=False) == ""


def test_groups_hold_out_the_last_of_each():
    split = CheckSplit(list(range(10)), 0.25)
    assert list(split.fit) == [0, 1, 2, 4, 5, 6, 8, 9]
    assert list(split.check) == [3, 7]
    assert list(CheckSplit(list(range(3)), 0.25).check) == [2]  # fewer than one group
    assert list(CheckSplit(list(range(7)), 0.5).check) == [1, 3, 5]


def test_check_fraction_zero_holds_nothing_out():
    for n in (1, 2, 8, 25):
        split = CheckSplit(list(range(n)), 0.0)
        assert list(split.fit) == list(range(n)) and list(split.check) == []
        assert "check_fraction=0" in unchecked_because(split, sequential=False)


def _batch(rows: int) -> dict:
    ids = torch.arange(rows * 3).reshape(rows, 3)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "note": "kept"}


def test_one_batch_is_split_by_sequence():
    batch = _batch(4)
    split = CheckSplit([batch], 0.1)
    (fit,), (held,) = list(split.fit), list(split.check)
    assert fit["input_ids"].tolist() == batch["input_ids"][:3].tolist()
    assert held["input_ids"].tolist() == batch["input_ids"][3:].tolist()
    assert held["attention_mask"].shape == (1, 3) and held["note"] == "kept"
    assert [b["input_ids"].tolist() for b in split.fit] == [fit["input_ids"].tolist()]
    assert unchecked_because(split, sequential=False) == ""
    # 20 sequences, groups of 10: the last 2 held out
    assert leading_rows(next(iter(CheckSplit([_batch(20)], 0.1).check))) == 2
    # lists and tuples of tensors (a TensorDataset's batches) too
    pair = [torch.zeros(5, 2), torch.ones(5)]
    assert [leading_rows(b) for b in CheckSplit([pair], 0.5).check] == [2]
    assert take_rows((torch.zeros(4, 2), 7), slice(0, 1), 4)[1] == 7


def test_one_batch_of_one_sequence_says_so_loudly():
    split = CheckSplit([_batch(1)], 0.1)
    assert list(split.check) == [] and len(list(split.fit)) == 1
    with pytest.warns(UserWarning, match="fewer than 2 sequences"):
        note = unchecked_because(split, sequential=False)
    assert "nothing to hold out" in note


def test_why_nothing_is_checked_is_said():
    assert "check_fraction=0" in unchecked_because(CheckSplit([1, 2], 0.0), sequential=False)
    assert "sequential" in unchecked_because(CheckSplit(list(range(20)), 0.1), sequential=True)
    assert unchecked_because(CheckSplit(list(range(5)), 0.1), sequential=False) == ""
