"""Which candidates a search measures: ranked for size targets, bisection
for a quality floor (checked against brute force)."""

import math

import pytest

from toast.frontier.selection import Bisection, Ranked
from toast.methods.base import Plan


def _candidate(family: str, blocks: int, predicted: float) -> Plan:
    spans = ((1, 1 + blocks),)
    return Plan(("remove",), family, spans, "identity", 1000 - 10 * blocks, predicted)


def _drain(selector, meets) -> list[Plan]:
    asked = []
    while (c := selector.next()) is not None:
        asked.append(c)
        selector.tell(c, meets(c))
    return asked


def test_ranked_takes_families_in_turn_best_predicted_first():
    pool = [_candidate("a", k, 0.1 * k) for k in range(1, 5)]
    pool += [_candidate("b", k, 1.0 + k) for k in range(1, 3)]
    asked = _drain(Ranked(pool, 5), lambda c: True)
    assert [(c.family, c.blocks_removed) for c in asked] == [
        ("a", 1),
        ("b", 1),
        ("a", 2),
        ("b", 2),
        ("a", 3),
    ]


def test_ranked_measures_every_method_alone_before_any_combination():
    def plan(methods: tuple[str, ...], predicted: float) -> Plan:
        family = "+".join(methods)
        return Plan(methods, family, ((1, 2),), "identity", 990, predicted)

    pool = [plan(("remove", "tome"), 0.1), plan(("remove",), 0.5), plan(("tome",), 0.9)]
    pool += [plan(("remove", "toast-vit", "tome"), 0.05)]
    asked = _drain(Ranked(pool, 3), lambda c: True)
    assert [c.family for c in asked] == ["remove", "tome", "remove+tome"]


def test_ranked_measures_every_method_before_a_second_family_of_one():
    def plan(methods: tuple[str, ...], family: str, predicted: float) -> Plan:
        return Plan(methods, family, ((1, 2),), "identity", 990, predicted)

    pool = [plan(("tome",), "tome-delayed", 0.1), plan(("tome",), "tome-front", 0.2)]
    pool += [plan(("tome",), "tome", 0.3), plan(("rapid",), "rapid", 0.4)]
    pool += [plan(("remove", "tome"), "remove+tome", 0.05)]
    asked = _drain(Ranked(pool, 4), lambda c: True)
    assert [c.family for c in asked] == ["rapid", "tome", "tome-delayed", "tome-front"]


def test_ranked_keeps_families_of_one_method_that_are_no_variants_by_name():
    def plan(methods: tuple[str, ...], family: str) -> Plan:
        return Plan(methods, family, ((1, 2),), "identity", 990, 0.1)

    pool = [plan(("sublayer",), "sublayer"), plan(("remove",), "shortgpt")]
    pool += [plan(("remove",), "plain")]
    asked = _drain(Ranked(pool, 3), lambda c: True)
    assert [c.family for c in asked] == ["plain", "shortgpt", "sublayer"]


@pytest.mark.parametrize("threshold", range(0, 18))
def test_bisection_finds_the_smallest_model_within_the_floor(threshold):
    pool = [_candidate("a", k, float(k)) for k in range(1, 17)]
    meets = lambda c: c.blocks_removed <= threshold  # noqa: E731
    asked = _drain(Bisection(pool, 100), meets)
    within = [c for c in asked if meets(c)]
    best = max((c.blocks_removed for c in within), default=0)
    assert best == min(threshold, 16)
    assert len(asked) <= math.ceil(math.log2(17)) + 1


def test_bisection_probes_the_best_predicted_candidate_of_each_size():
    worse = _candidate("a", 2, 5.0)
    better = Plan(("remove",), "a", ((3, 5),), "identity", worse.params_after, 1.0)
    asked = _drain(Bisection([worse, better], 10), lambda c: True)
    assert asked == [better]


def test_bisection_stops_at_its_limit():
    pool = [_candidate(f, k, float(k)) for f in "ab" for k in range(1, 17)]
    assert len(_drain(Bisection(pool, 3), lambda c: True)) == 3
