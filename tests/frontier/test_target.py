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
    ],
)
def test_bad_targets_say_what_to_write(typed, error, said):
    with pytest.raises(error, match=said):
        Target.parse(typed)
