"""The calibration split shared by the held-out checks."""

from __future__ import annotations

from toast.hf.evaluate.check import CheckSplit, unchecked_because


def test_holdout_keeps_one_batch_in_every_group_out_of_the_fit():
    split = CheckSplit(list(range(10)), 0.25)
    assert list(split.fit) == [0, 1, 2, 4, 5, 6, 8, 9]
    assert list(split.check) == [3, 7]
    assert list(CheckSplit(list(range(3)), 0.25).check) == []
    assert list(CheckSplit(list(range(3)), 0.0).fit) == [0, 1, 2]


def test_the_split_is_the_same_on_every_pass():
    split = CheckSplit(list(range(7)), 0.5)
    assert list(split.fit) == list(split.fit) == [0, 2, 4, 6]
    assert list(split.check) == list(split.check) == [1, 3, 5]


def test_why_nothing_is_checked_is_said():
    assert "check_fraction=0" in unchecked_because(CheckSplit([1, 2], 0.0), sequential=False)
    assert "sequential" in unchecked_because(CheckSplit(list(range(20)), 0.1), sequential=True)
    assert "fewer than 10" in unchecked_because(CheckSplit(list(range(5)), 0.1), sequential=False)
    assert unchecked_because(CheckSplit(list(range(20)), 0.1), sequential=False) == ""
