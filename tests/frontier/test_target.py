"""Reading targets as users type them."""

import pytest

from toast.frontier.target import Target


@pytest.mark.parametrize(
    "typed, kind, value",
    [
        (0.2, "params", 0.2),
        ("20%", "params", 0.2),
        ("params=20%", "params", 0.2),
        ("MACs = 0.25", "macs", 0.25),
        ("latency=30%", "latency", 0.3),
        ("quality=10%", "quality", 0.1),
    ],
)
def test_parse_reads_kind_and_fraction(typed, kind, value):
    target = Target.parse(typed)
    assert (target.kind, target.value) == (kind, pytest.approx(value))


@pytest.mark.parametrize(
    "typed, error, said",
    [
        ("size=20%", ValueError, "target kind"),
        ("params=abc", ValueError, "cannot read target"),
        (1.5, ValueError, "between 0 and 1"),
        (0, ValueError, "between 0 and 1"),
        (True, TypeError, "target must be"),
        (float("nan"), ValueError, "finite"),
        ("blocks=0", ValueError, "whole number of blocks, at least 1"),
        ("blocks=2.5", ValueError, "a blocks= target is a whole number"),
    ],
)
def test_bad_targets_say_what_to_write(typed, error, said):
    with pytest.raises(error, match=said):
        Target.parse(typed)


def test_a_blocks_target_is_a_count_of_blocks():
    target = Target.parse("Blocks = 4")
    assert (target.kind, target.num_blocks, target.describe()) == ("blocks", 4, "4 blocks removed")
    assert Target.parse("params=20%").num_blocks is None
