"""toast.search end to end on tiny models: the front, the chosen model,
the cache, the report."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import pytest

import toast
from toast.frontier.cache import fingerprint
from toast.frontier.pareto import dominates

from .conftest import (
    CALIBRATION_LENGTH,
    image_batches,
    tiny_llama,
    tiny_vit,
    token_batches,
)

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.hf


def _calibration_forwards(model: torch.nn.Module) -> list[int]:
    """Counts forwards of any copy of ``model`` on calibration-width batches
    (deep copies keep the hook)."""
    count = [0]

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.shape[-1] == CALIBRATION_LENGTH:
            count[0] += 1

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return count


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    model = tiny_llama()
    data, heldout = token_batches(6, CALIBRATION_LENGTH, 1), token_batches(2, 12, 2)
    cache = tmp_path_factory.mktemp("cache")
    result = toast.search(model, data, heldout, target=0.2, cache=cache, progress=False)
    return model, data, heldout, cache, result


def test_front_is_non_dominated_and_complete(searched):
    *_, result = searched
    points = [(result.size(m.measurement), m.measurement.quality) for m in result.measured]
    higher = result.higher_is_better
    assert result.front
    for k in result.front:
        assert not any(dominates(p, points[k], higher) for p in points)
    for k in set(range(len(points))) - set(result.front):
        assert any(dominates(p, points[k], higher) for p in points)


def test_chosen_meets_the_target_and_is_the_best_measured(searched):
    *_, result = searched
    best = result.best
    assert best is not None
    assert best.measurement.params <= 0.8 * result.original.params
    eligible = [m.measurement.quality for m in result.measured]
    assert best.measurement.quality == min(eligible)  # perplexity: lower is better
    assert toast.count_params(result.model) == best.measurement.params


def test_measured_sizes_are_the_predicted_sizes(searched):
    *_, result = searched
    for m in result.measured:
        assert m.measurement.params == m.candidate.params_after


def test_search_leaves_the_model_unchanged():
    model = tiny_llama()
    before = fingerprint(model)
    data, heldout = token_batches(3, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    toast.search(model, data, heldout, max_measured=2, cache=False, latency=False, progress=False)
    assert fingerprint(model) == before


def test_chosen_model_reloads_in_a_fresh_process_with_identical_outputs(searched, tmp_path):
    *_, heldout, _, result = searched
    result.save(tmp_path)
    ids = heldout[0]["input_ids"]
    torch.save(ids, tmp_path / "ids.pt")
    with torch.inference_mode():
        expected = result.model(input_ids=ids).logits
    script = textwrap.dedent(
        f"""
        import torch, toast
        model = toast.load_pretrained({str(tmp_path / "model")!r}).eval()
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        with torch.inference_mode():
            torch.save(model(input_ids=ids).logits, {str(tmp_path / "out.pt")!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)


def test_saved_folder_holds_report_plot_and_json(searched, tmp_path):
    *_, result = searched
    result.save(tmp_path)
    for name in ("report.md", "front.png", "front.svg", "search.json", "model"):
        assert (tmp_path / name).exists(), name
    saved = json.loads((tmp_path / "search.json").read_text())
    assert saved["chosen"] == result.chosen
    assert len(saved["measured"]) == len(result.measured)


def test_cached_second_call_makes_no_calibration_pass(searched):
    model, data, heldout, cache, first = searched
    # the shared analysis; ReplaceMe's transforms, sub-layer scores, LinearPatch's statistics
    assert first.calibration_passes == 4
    forwards = _calibration_forwards(model)
    again = toast.search(model, data, heldout, target=0.3, cache=cache, progress=False)
    assert again.calibration_passes == 0
    assert forwards[0] == 0
    reused = {m.candidate.key for m in again.measured if m.cached}
    assert reused == {m.candidate.key for m in first.measured} & {
        m.candidate.key for m in again.measured
    }


def test_first_call_forwards_the_calibration_data(tmp_path):
    # the counter of the test above can see a calibration pass
    model = tiny_llama()
    forwards = _calibration_forwards(model)
    data, heldout = token_batches(3, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    toast.search(
        model, data, heldout, max_measured=1, cache=tmp_path, latency=False, progress=False
    )
    assert forwards[0] >= 3


def test_report_states_the_rank_correlation(searched):
    *_, result = searched
    text = result.to_markdown()
    assert "Spearman" in text
    assert result.best is not None and result.best.candidate.label in text


def test_quality_target_chooses_the_smallest_model_within_the_floor(tmp_path):
    model = tiny_llama()
    data, heldout = token_batches(4, CALIBRATION_LENGTH, 1), token_batches(2, 12, 2)
    result = toast.search(
        model, data, heldout, target="quality=5%", cache=tmp_path, latency=False, progress=False
    )
    floor = 1.05 * result.original.quality
    within = [m for m in result.measured if m.measurement.quality <= floor]
    assert result.best is not None
    assert result.best.measurement.params == min(m.measurement.params for m in within)


def test_vit_search_offers_head_pruning_and_combinations(tmp_path):
    model = tiny_vit()
    data, heldout = image_batches(3, 1), image_batches(1, 2)
    result = toast.search(
        model,
        data,
        heldout,
        target=0.2,
        max_measured=12,
        cache=tmp_path,
        latency=False,
        progress=False,
    )
    families = {m.candidate.family for m in result.measured}
    assert "toast-vit" in families
    assert any("+" in f for f in families)
    assert result.metric == "cosine"
    for m in result.measured:
        assert m.measurement.params == m.candidate.params_after


def test_heldout_is_required():
    model = tiny_llama()
    with pytest.raises(ValueError, match="held-out"):
        toast.search(model, token_batches(2, CALIBRATION_LENGTH, 1), cache=False)


def test_target_beyond_reach_says_so(tmp_path):
    model = tiny_llama()
    data, heldout = token_batches(2, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    result = toast.search(
        model, data, heldout, target=0.9, cache=tmp_path, latency=False, progress=False
    )
    assert result.best is None and result.model is None
    assert any("max_blocks" in note for note in result.notes)


def test_notebook_view_shows_each_candidate_on_hover(searched):
    *_, result = searched
    html = result._repr_html_()
    assert html.count("<title>") >= len(result.measured) + 1  # and the original
    for m in result.measured:
        assert m.candidate.label.replace("&", "&amp;") in html


def test_mac_target_offers_token_channel_selection_and_counts_its_savings(tmp_path):
    model = tiny_vit()
    data, heldout = image_batches(3, 1), image_batches(1, 2)
    result = toast.search(
        model,
        data,
        heldout,
        target="macs=20%",
        max_measured=40,  # room for token merging's plans beside TCS's
        methods=["remove", "toast-vit", "tome"],  # not every reducer's: TCS's are the point
        cache=tmp_path,
        latency=False,
        progress=False,
    )
    with_tcs = [m for m in result.measured if m.candidate.to_dict()["schedule"] is not None]
    assert with_tcs
    for m in with_tcs:
        # the same heads without TCS cost exactly the FFN MACs TCS saves more
        assert 0 < m.measurement.macs < result.original.macs
        assert m.measurement.params == m.candidate.params_after


def test_time_budget_stops_measuring_and_says_so(tmp_path):
    model = tiny_llama()
    data, heldout = token_batches(2, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    result = toast.search(
        model, data, heldout, max_minutes=1e-4, cache=tmp_path, latency=False, progress=False
    )
    assert len(result.measured) == 1  # the first always runs; then the budget is spent
    assert any("max_minutes" in note for note in result.notes)


def test_unreadable_cache_entry_is_recomputed_not_trusted(tmp_path):
    model = tiny_llama()
    data, heldout = token_batches(2, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    options = {"max_measured": 1, "cache": tmp_path, "latency": False, "progress": False}
    toast.search(model, data, heldout, **options)
    (entry,) = tmp_path.glob("*/calibration.pkl")
    entry.write_bytes(b"not a pickle")
    again = toast.search(model, data, heldout, **options)
    assert again.calibration_passes == 4


@pytest.mark.parametrize(
    "bad, said",
    [
        ({"cache": 3}, "cache must be"),
        ({"backend": "gpu"}, "backend must be"),
        ({"max_measured": 0}, "max_measured must be"),
        ({"max_blocks": 0}, "max_blocks must be"),
        ({"target": "weights=20%"}, "target kind"),
        ({"max_samples": -1}, "max_samples"),
    ],
)
def test_bad_arguments_name_the_problem(bad, said):
    model = tiny_llama()
    data, heldout = token_batches(1, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    with pytest.raises((ValueError, TypeError), match=said):
        toast.search(model, data, heldout, **bad)


def test_reported_macs_are_toast_macs_linear_convention(searched):
    """A user checking the search's MAC figures with toast.macs reads the same
    numbers: the original's and the chosen model's (held-out batches: 12 tokens)."""
    model, _, heldout, _, result = searched
    assert toast.macs(model, convention="linear", seq_len=12).macs == result.original.macs
    chosen = toast.macs(result.model, convention="linear", example=heldout[0]).macs
    assert chosen == result.best.measurement.macs


def test_vit_reported_macs_are_toast_macs_linear_convention(tmp_path):
    model = tiny_vit()
    data, heldout = image_batches(2, 1), image_batches(1, 2)
    result = toast.search(
        model, data, heldout, target=0.2, max_measured=3, cache=tmp_path, latency=False,
        progress=False,
    )  # fmt: skip
    assert toast.macs(model, convention="linear").macs == result.original.macs
    assert toast.macs(result.model, convention="linear").macs == result.best.measurement.macs


def test_timings_name_every_phase_of_every_measured_candidate(tmp_path):
    model = tiny_llama()
    data, heldout = token_batches(4, CALIBRATION_LENGTH, 1), token_batches(2, 12, 2)
    result = toast.search(model, data, heldout, target=0.2, cache=tmp_path, progress=False)
    timings = result.timings
    assert {"preparation", "calibration", "original: held-out", "chosen: build"} <= set(timings)
    for m in result.measured:
        for phase in ("build", "held-out", "latency", "MACs"):
            assert f"{m.candidate.label}: {phase}" in timings
    assert timings["total"] >= sum(v for k, v in timings.items() if k != "total")
    assert "Time (s): preparation" in result.to_markdown()


@pytest.mark.parametrize("caller_froze", [False, True])
def test_search_leaves_the_collectors_frozen_set_as_it_found_it(caller_froze):
    import gc

    model = tiny_llama()
    data, heldout = token_batches(3, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    if caller_froze:
        gc.freeze()
    try:
        toast.search(model, data, heldout, max_measured=2, cache=False, latency=False,
                     progress=False)  # fmt: skip
        # thawed after its measurements; a caller's frozen objects stay frozen
        assert (gc.get_freeze_count() > 0) == caller_froze
    finally:
        gc.unfreeze()


def test_each_candidate_is_freed_before_the_next_is_built(monkeypatch):
    import weakref

    bench = importlib.import_module("toast.frontier.bench")
    built_before: list[weakref.ref] = []
    alive_at_build: list[int] = []
    real = bench.build

    def tracking(*args, **kwargs):
        alive_at_build.append(sum(r() is not None for r in built_before))
        found = real(*args, **kwargs)
        built_before.append(weakref.ref(found.model))
        return found

    monkeypatch.setattr(bench, "build", tracking)
    model = tiny_llama()
    data, heldout = token_batches(4, CALIBRATION_LENGTH, 1), token_batches(2, 12, 2)
    result = toast.search(model, data, heldout, target=0.2, cache=False, progress=False)
    assert len(alive_at_build) == len(result.measured) + 1  # and the chosen model
    assert alive_at_build == [0] * len(alive_at_build)


def test_candidates_are_timed_in_three_paired_rounds_only_for_a_latency_target(searched):
    # A size target reports throughput from one paired round; a latency
    # target ranks by the timings, so they take the median of three.
    model, data, heldout, _, result = searched

    def rounds(found):
        return {m.measurement.throughput["rounds"] for m in found.measured}

    assert rounds(result) == {1}
    timed = toast.search(
        model, data, heldout, target="latency=10%", cache=False, progress=False, max_measured=2
    )
    assert rounds(timed) == {3}


def test_an_int_latency_times_every_candidate_and_the_original_at_that_batch():
    model = tiny_vit()
    data, heldout = image_batches(2, 1), image_batches(1, 2)  # held-out batches of 8
    options = {"max_measured": 2, "cache": False, "progress": False, "methods": ["remove"]}
    result = toast.search(model, data, heldout, latency=3, **options)
    timed = [m.measurement.throughput for m in result.measured]
    assert timed and all(t["batch_size"] == 3 and t["reference_forward_per_s"] for t in timed)
    with pytest.raises(ValueError, match="latency"):
        toast.search(model, data, heldout, latency=0, **options)


def test_methods_limits_the_search_to_the_named_methods():
    model = tiny_llama()
    data, heldout = token_batches(2, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    options = {"max_measured": 2, "cache": False, "latency": False, "progress": False}
    result = toast.search(model, data, heldout, methods=["remove"], **options)
    assert {m.candidate.family for m in result.measured} <= {"plain", "shortgpt"}  # remove's
    assert result.calibration_passes == 1  # the shared pass only


@pytest.mark.parametrize(
    ("methods", "error"), [(["prune"], ValueError), ([], ValueError), ("remove", TypeError)]
)
def test_methods_that_name_no_staged_method_are_refused_with_the_names(methods, error):
    model = tiny_llama()
    data = token_batches(2, CALIBRATION_LENGTH, 1)
    with pytest.raises(error, match="linearpatch"):
        toast.search(model, data, data, methods=methods, cache=False, progress=False)
