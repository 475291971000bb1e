"""toast.search's objective: the front, the target and the choice follow
the quantity asked for; every measured quantity is reported."""

from __future__ import annotations

import pytest

import toast
from toast.frontier.objective import Objective
from toast.frontier.pareto import dominates

from .conftest import CALIBRATION_LENGTH, image_batches, tiny_llama, tiny_vit, token_batches

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.hf

_QUIET = {"latency": False, "progress": False}


@pytest.fixture(scope="module")
def kl_searched(tmp_path_factory):
    model = tiny_llama()
    data, heldout = token_batches(6, CALIBRATION_LENGTH, 1), token_batches(2, 12, 2)
    cache = tmp_path_factory.mktemp("cache")
    result = toast.search(
        model, data, heldout, target=0.2, cache=cache, objective="kl", max_measured=6, **_QUIET
    )
    return model, data, heldout, cache, result


def test_kl_objective_makes_kl_the_quality_of_every_measurement(kl_searched):
    *_, result = kl_searched
    assert result.metric == "kl" and not result.higher_is_better
    assert result.original.quality == 0.0
    for m in result.measured:
        assert m.measurement.quality == m.measurement.metrics["kl"]
        assert m.measurement.quality > 0.0


def test_kl_front_is_ordered_by_measured_kl(kl_searched):
    *_, result = kl_searched
    front = sorted(result.front, key=lambda k: result.size(result.measured[k].measurement))
    kls = [result.measured[k].measurement.quality for k in front]
    # a smaller model on the front has a larger KL, else the larger one were dominated
    assert kls == sorted(kls, reverse=True)
    points = [(result.size(m.measurement), m.measurement.quality) for m in result.measured]
    for k in result.front:
        assert not any(dominates(p, points[k], False) for p in points)


def test_kl_objective_chooses_the_lowest_kl_meeting_the_target(kl_searched):
    *_, result = kl_searched
    assert result.best is not None
    meeting = [m for m in result.measured if m.measurement.params <= 0.8 * result.original.params]
    assert result.best.measurement.quality == min(m.measurement.quality for m in meeting)


def test_report_shows_every_measured_quantity(kl_searched):
    *_, result = kl_searched
    header = result.to_markdown().splitlines()[2]
    for name in ("KL", "KL p99", "perplexity", "top-1 agreement"):
        assert f"| {name} |" in header
    assert "lower bound" in result.to_markdown()


def test_objectives_share_the_cache_of_one_held_out_pass(kl_searched):
    model, data, heldout, cache, first = kl_searched
    again = toast.search(
        model,
        data,
        heldout,
        target=0.2,
        cache=cache,
        objective="perplexity",
        max_measured=6,
        **_QUIET,
    )
    assert again.calibration_passes == 0
    assert all(m.cached for m in again.measured)
    by_key = {m.candidate.key: m.measurement for m in first.measured}
    for m in again.measured:
        assert m.measurement.quality == by_key[m.candidate.key].metrics["perplexity"]


def test_agreement_objective_prefers_higher_agreement(kl_searched):
    model, data, heldout, cache, _ = kl_searched
    result = toast.search(
        model,
        data,
        heldout,
        target=0.2,
        cache=cache,
        objective="agreement",
        max_measured=6,
        **_QUIET,
    )
    assert result.higher_is_better and result.original.quality == 1.0
    meeting = [m for m in result.measured if m.measurement.params <= 0.8 * result.original.params]
    assert result.best is not None
    assert result.best.measurement.quality == max(m.measurement.quality for m in meeting)


@pytest.mark.parametrize(
    "objective, options, said",
    [
        ("loss", None, "objective must be one of"),
        ("task:", None, "names no task"),
        ("task:piqa,,arc_easy", None, "empty task name"),
        ("kl", {"limit": 3}, "task_options apply"),
        (3, None, "objective must be a string"),
    ],
)
def test_bad_objectives_name_the_problem(objective, options, said):
    with pytest.raises((ValueError, TypeError), match=said):
        Objective.parse(objective, options)


def test_relative_quality_floor_on_kl_is_refused_before_any_pass():
    model = tiny_llama()
    data, heldout = token_batches(1, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    with pytest.raises(ValueError, match="original's kl to itself is 0"):
        toast.search(model, data, heldout, target="quality=10%", objective="kl", **_QUIET)


def test_kl_objective_on_a_vit_is_refused_naming_what_it_measures(tmp_path):
    model = tiny_vit()
    with pytest.raises(ValueError, match="its held-out pass measures"):
        toast.search(
            model,
            image_batches(2, 1),
            image_batches(1, 2),
            objective="kl",
            cache=tmp_path,
            **_QUIET,
        )
    assert not list(tmp_path.iterdir())  # refused before any calibration


@pytest.fixture
def local_task(tmp_path):
    pytest.importorskip("lm_eval")
    from toast.data import stdlib_sentences
    from toast.hf.evaluate.tasks import write_continuation_task

    return write_continuation_task(tmp_path / "task", stdlib_sentences(limit=12))


def test_task_objective_needs_a_causal_lm(tmp_path, local_task):
    with pytest.raises(ValueError, match="needs a causal language model"):
        toast.search(
            tiny_vit(),
            image_batches(2, 1),
            image_batches(1, 2),
            objective=f"task:{local_task}",
            cache=tmp_path,
            **_QUIET,
        )


def test_task_objective_needs_a_tokenizer(tmp_path, local_task):
    model = tiny_llama()
    data, heldout = token_batches(2, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        toast.search(model, data, heldout, objective=f"task:{local_task}", cache=tmp_path, **_QUIET)


def test_unknown_task_options_are_named():
    with pytest.raises(ValueError, match=r"task_options has \['shots'\]"):
        Objective.parse("task:piqa", {"shots": 5})


def test_task_whose_data_is_missing_fails_before_any_pass(tmp_path):
    pytest.importorskip("lm_eval")
    model = tiny_llama()
    forwards = []
    model.register_forward_pre_hook(lambda *a: forwards.append(1))
    data, heldout = token_batches(2, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    missing = tmp_path / "absent.yaml"
    with pytest.raises(ValueError, match="absent.yaml"):
        toast.search(model, data, heldout, objective=f"task:{missing}", cache=tmp_path, **_QUIET)
    assert not forwards


def test_task_objective_cache_key_follows_the_task_data(local_task):
    objective = Objective.parse(f"task:{local_task}")
    before = objective.key()
    data = local_task.with_suffix(".jsonl")
    data.write_text(data.read_text() + data.read_text().splitlines()[0] + "\n")
    assert objective.key() != before
