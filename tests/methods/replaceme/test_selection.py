"""ReplaceMe's ``selection=`` rules: ShortGPT's block influence equals a
computation by forward hooks, its cuts are the runs of the lowest-scoring
blocks; SLEB's first choice equals brute force over deep copies; the
predicted rule takes the window of smallest linear span error; every rule
runs with every objective; bad requests fail clearly."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.data.calibration import Calibration  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.hf.model.surgery import remove_blocks  # noqa: E402
from toast.methods.replaceme import ReplaceMeConfig, replaceme  # noqa: E402
from toast.methods.replaceme.from_disk import replaceme_from_disk  # noqa: E402
from toast.methods.selection import (  # noqa: E402
    block_influence,
    lowest_blocks,
    predicted_errors,
    runs,
    sleb,
)

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

QUIET = Calibration(progress=False)


def _hooked_influence(model: torch.nn.Module, data: list[dict]) -> np.ndarray:
    """BI_i = 1 − mean over non-pad tokens of cos(input, output) of block i,
    from hooks on the decoder layers."""
    layers = model.model.layers
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}

    def hook(i):
        def record(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            y = output[0] if isinstance(output, tuple) else output
            seen[i].append(torch.nn.functional.cosine_similarity(x.double(), y.double(), dim=-1))

        return record

    handles = [
        layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            for batch in data:
                model(**batch, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    scores = []
    for i in range(len(layers)):
        cos = [c[b["attention_mask"].bool()] for c, b in zip(seen[i], data, strict=True)]
        scores.append(1.0 - float(torch.cat(cos).mean()))
    return np.array(scores)


def test_block_influence_equals_cosines_taken_by_forward_hooks():
    model, data = R.decoder("llama"), R.text_loader()
    expected = _hooked_influence(model, data)
    found = block_influence(model, data, QUIET, find_blocks(model))
    np.testing.assert_allclose(found, expected, rtol=1e-9, atol=1e-12)


def test_block_influence_removes_the_lowest_scoring_blocks_as_runs():
    model, data = R.decoder("llama"), R.text_loader()
    scores = _hooked_influence(model, data)
    lowest = sorted(1 + np.argsort(scores[1:], kind="stable")[:3])
    assert lowest_blocks(scores, 3) == lowest
    _, report = replaceme(
        model, data, num_blocks=3, selection="block_influence", check_fraction=0.0, progress=False
    )
    assert [(s.start, s.stop) for s in report.spans] == runs(lowest)
    assert report.blocks_after == R.LAYERS - 3
    assert "block influence" in report.to_markdown()


def test_runs_are_maximal_and_sorted():
    assert runs([7, 2, 3]) == [(2, 4), (7, 8)]
    assert runs([1, 2, 3]) == [(1, 4)]


def test_sleb_first_choice_equals_brute_force_over_deep_copies():
    model, data = R.decoder("llama"), R.text_loader()
    before = copy.deepcopy(model.state_dict())
    losses = {
        b: R.next_token_loss(remove_blocks(copy.deepcopy(model), [(b, b + 1)]), data)
        for b in range(1, R.LAYERS)
    }
    brute = min(losses, key=lambda b: (losses[b], b))
    found = sleb(model, data, find_blocks(model), 1)
    assert found.order == [brute]
    assert math.isclose(found.scores[0], math.exp(losses[brute]), rel_tol=1e-6)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    _, report = replaceme(
        model, data, num_blocks=1, selection="sleb", check_fraction=0.0, progress=False
    )
    assert [(s.start, s.stop) for s in report.spans] == [(brute, brute + 1)]


def test_sleb_second_step_is_measured_on_the_model_pruned_by_the_first():
    model, data = R.decoder("llama"), R.text_loader()
    found = sleb(model, data, find_blocks(model), 2)
    first = found.order[0]
    pruned = {
        b: R.next_token_loss(remove_blocks(copy.deepcopy(model), runs([first, b])), data)
        for b in range(1, R.LAYERS)
        if b != first
    }
    assert found.order[1] == min(pruned, key=lambda b: (pruned[b], b))


def test_predicted_takes_the_window_of_smallest_linear_span_error():
    model, data = R.decoder("llama"), R.text_loader()
    table = predicted_errors(model, data, find_blocks(model), QUIET, "auto", 2)
    starts = range(1, R.LAYERS - 1)
    best = min(starts, key=lambda a: (table[a, a + 2], a))
    _, report = replaceme(
        model, data, num_blocks=2, selection="predicted", check_fraction=0.0, progress=False
    )
    assert [(s.start, s.stop) for s in report.spans] == [(best, best + 2)]
    assert report.spans[0].error == pytest.approx(table[best, best + 2])


@pytest.mark.parametrize("objective", ["ls", "cosine", "identity"])
@pytest.mark.parametrize(
    "selection", ["distance", "block_influence", "sleb", "predicted", "measured"]
)
def test_every_selection_runs_with_every_objective(selection, objective):
    _, report = replaceme(
        R.decoder("llama"),
        R.text_loader(80),
        num_blocks=2,
        selection=selection,
        objective=objective,
        lbfgs_steps=3,
        progress=False,
    )
    assert report.selection == selection
    assert report.blocks_after == R.LAYERS - 2 + R.translator_blocks(report)


def test_distance_is_the_window_of_smallest_distance_without_candidates():
    data = R.text_loader(80)
    _, distance = replaceme(R.decoder("llama"), data, num_blocks=1, selection="distance")
    _, one = replaceme(R.decoder("llama"), data, num_blocks=1, candidates=1)
    assert distance.spans == one.spans and distance.candidates == []


def test_measured_is_the_default_and_the_paper_uses_the_distance():
    assert ReplaceMeConfig(num_blocks=1).selection == "measured"
    assert ReplaceMeConfig.paper(num_blocks=1).selection == "distance"


def test_a_bad_selection_names_the_options():
    with pytest.raises(ValueError, match="selection must be one of 'distance', 'block_influence'"):
        ReplaceMeConfig(num_blocks=1, selection="shortgpt")
    with pytest.raises(ValueError, match="leave num_cuts=1"):
        ReplaceMeConfig(num_blocks=2, num_cuts=2, selection="sleb")


def test_rules_beyond_the_distance_are_refused_from_disk_before_any_pass(tmp_path):
    R.decoder("llama").save_pretrained(tmp_path / "source")
    with pytest.raises(ValueError, match="in memory only"):
        replaceme_from_disk(tmp_path / "source", R.text_loader(), num_blocks=1, selection="sleb")


def test_measured_selection_also_measures_the_windows_of_smallest_predicted_error():
    from toast.hf.evaluate.check import CheckSplit

    model, data = R.decoder("llama"), R.text_loader(80)  # 10 batches: one held out
    fit = list(CheckSplit(data, 0.1).fit)
    table = toast.analyze(copy.deepcopy(model), fit, metric="linear", estimator="gcv").errors
    predicted = {(a, a + 1) for a in sorted(range(1, R.LAYERS), key=lambda a: table[a, a + 1])[:2]}

    def measured(**options):
        _, report = replaceme(copy.deepcopy(model), data, num_blocks=1, candidates=2, **options)
        return {(c.span.start, c.span.stop) for c in report.candidates}

    by_distance = measured(predicted_candidates=0, progress=False)
    assert len(by_distance) == 2 and not predicted <= by_distance  # the test can fail
    assert measured(progress=False) == by_distance | predicted


def test_the_papers_protocol_measures_no_predicted_window():
    config = ReplaceMeConfig.paper(num_blocks=2)
    assert config.predicted_candidates == 0 and config.candidates == 1
