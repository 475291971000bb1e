"""toast.analyze and the span choices made from an error matrix."""

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("tests._helpers.hf_models")

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

import toast  # noqa: E402
from toast.methods.translate.analysis import Analysis, Span  # noqa: E402


def _analysis_of(errors: np.ndarray, metric: str = "linear") -> Analysis:
    m = toast.Moments(errors.shape[0], 2)
    return Analysis(m, errors, metric, "cv", "all", "layers")


def _random_errors(seed: int, states: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    E = np.full((states, states), np.nan)
    iu = np.triu_indices(states, 1)
    # errors grow with span length, with noise, like real matrices
    E[iu] = (iu[1] - iu[0]) * 0.1 + rng.uniform(0, 0.3, size=iu[0].size)
    return E


def _brute_force_plan(E, max_blocks, max_error, gap, first=1):
    n = E.shape[0]
    spans = [
        (i, j)
        for i in range(first, n)
        for j in range(i + 1, n)
        if np.isfinite(E[i, j]) and (max_error is None or E[i, j] <= max_error)
    ]
    best = (0, 0.0, ())
    for r in range(1, 4):
        for combo in itertools.combinations(spans, r):
            ordered = sorted(combo)
            if any(a[1] + gap > b[0] for a, b in itertools.pairwise(ordered)):
                continue
            blocks = sum(j - i for i, j in ordered)
            if max_blocks is not None and blocks > max_blocks:
                continue
            cost = sum(E[i, j] for i, j in ordered)
            if blocks > best[0] or (blocks == best[0] and cost < best[1] - 1e-12):
                best = (blocks, cost, tuple(ordered))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "max_blocks,max_error,adjacent",
    [(2, None, False), (3, None, False), (4, 0.5, False), (None, 0.35, False), (3, None, True)],
)
def test_plan_is_optimal_against_brute_force(seed, max_blocks, max_error, adjacent):
    E = _random_errors(seed)
    plan = _analysis_of(E).plan(max_blocks=max_blocks, max_error=max_error, allow_adjacent=adjacent)
    blocks, cost, _ = _brute_force_plan(E, max_blocks, max_error, gap=0 if adjacent else 1)
    assert sum(s.num_blocks for s in plan) == blocks
    assert sum(s.error for s in plan) == pytest.approx(cost, abs=1e-12)


def test_plan_keeps_a_block_between_spans_and_never_removes_block_zero():
    E = np.full((8, 8), np.nan)
    iu = np.triu_indices(8, 1)
    E[iu] = 0.01  # everything equally redundant
    plan = _analysis_of(E).plan(max_blocks=7)
    assert all(s.start >= 1 for s in plan)
    assert all(a.stop < b.start for a, b in itertools.pairwise(plan))


def test_top_spans_ranks_ascending_and_filters_by_budget():
    E = _random_errors(3)
    spans = _analysis_of(E).top_spans(k=4, budget=2)
    expected = sorted((E[i, i + 2], i) for i in range(1, E.shape[0] - 2))[:4]
    assert [(s.error, s.start) for s in spans] == expected
    assert all(s.num_blocks == 2 for s in spans)


def test_top_spans_takes_num_blocks_or_its_other_name_budget():
    analysis = _analysis_of(_random_errors(3))
    assert analysis.top_spans(k=4, num_blocks=2) == analysis.top_spans(k=4, budget=2)
    with pytest.raises(ValueError, match="num_blocks=1 and budget=2 differ"):
        analysis.top_spans(k=4, num_blocks=1, budget=2)


def test_top_spans_ranks_descending_for_similarity_metrics():
    E = _random_errors(4)
    spans = _analysis_of(E, metric="cka").top_spans(k=3)
    errors = [s.error for s in spans]
    assert errors == sorted(errors, reverse=True)


def test_span_notations():
    span = Span(3, 5, 0.25)
    assert list(span.blocks) == [3, 4]
    assert span.paper == "2→4"


def test_plan_rejects_similarity_metrics():
    with pytest.raises(ValueError, match="lower means redundant"):
        _analysis_of(_random_errors(0), metric="cka").plan(max_blocks=2)


@pytest.fixture(scope="module")
def vit_analysis():
    family = hf_models.FAMILIES[0]
    model = hf_models.build(family)
    batches = hf_models.loader(family, 40, batch_size=8)
    return toast.analyze(model, batches, folds=4, progress=False)


def test_analyze_gives_a_full_upper_triangle(vit_analysis):
    E = vit_analysis.errors
    iu = np.triu_indices(hf_models.LAYERS + 1, 1)
    assert np.isfinite(E[iu]).all()
    assert np.isnan(E[np.tril_indices(hf_models.LAYERS + 1)]).all()
    assert vit_analysis.rows == 40 * 17  # 16 patches + CLS per image


def test_other_metrics_come_from_the_same_moments(vit_analysis):
    direct = toast.error_matrix(vit_analysis.moments, metric="cosine")
    np.testing.assert_array_equal(vit_analysis.error_matrix(metric="cosine"), direct)


def test_heatmap_renders_to_png(vit_analysis, tmp_path):
    spans = vit_analysis.plan(max_blocks=2)
    fig = vit_analysis.heatmap(spans=spans)
    out = tmp_path / "heatmap.png"
    fig.savefig(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_to_dataframe_has_one_row_per_span(vit_analysis):
    pd = pytest.importorskip("pandas")
    df = vit_analysis.to_dataframe()
    n = hf_models.LAYERS + 1
    assert len(df) == n * (n - 1) // 2
    assert isinstance(df, pd.DataFrame)
    row = df[(df.start == 1) & (df.stop == 3)].iloc[0]
    assert row.s == 0 and row.e == 2
    assert row.linear == vit_analysis.errors[1, 3]


def _decoder_and_rows(n: int) -> tuple:
    R = pytest.importorskip("tests._helpers.replaceme_models")
    return R.decoder("llama"), R.text_loader(n)


@pytest.mark.parametrize(("samples", "resolved"), [(48, "gcv"), (12, "cv")])
def test_auto_estimator_is_gcv_with_enough_rows_and_cv_with_few(samples, resolved):
    from toast.methods.translate.analysis import enough_for_gcv

    model, data = _decoder_and_rows(samples)
    auto = toast.analyze(model, data, estimator="auto", pairs=3, progress=False)
    assert auto.estimator == resolved
    assert enough_for_gcv(auto.rows, auto.moments.dim, 5) == (resolved == "gcv")
    same = toast.analyze(model, data, estimator=resolved, pairs=3, progress=False)
    np.testing.assert_array_equal(auto.errors, same.errors)
    assert auto.moments.folds == same.moments.folds == (5 if resolved == "cv" else 0)


def test_compress_default_ranks_spans_as_the_auto_analysis():
    model, data = _decoder_and_rows(48)
    _, report = toast.compress(model, data, budget=2, check_fraction=0.0, progress=False)
    assert report.analysis.estimator == "gcv"
    expected = toast.analyze(
        _decoder_and_rows(48)[0], data, estimator="gcv", pairs=2, progress=False
    )
    np.testing.assert_array_equal(report.analysis.errors, expected.errors)


def test_auto_keeps_gcv_with_a_warning_when_the_folds_would_not_fit_the_bound():
    from toast.core.chunked import ChunkedMoments, pair_nbytes

    model, data = _decoder_and_rows(12)  # few rows: auto would pass again with folds
    bound = pair_nbytes(32, 0)  # one pair without folds, not with them
    with pytest.warns(UserWarning, match="few for GCV"):
        auto = toast.analyze(
            model, data, estimator="auto", pairs=3, statistics_bytes=bound, progress=False
        )
    assert auto.estimator == "gcv" and isinstance(auto.moments, ChunkedMoments)
    same = toast.analyze(
        model, data, estimator="gcv", pairs=3, statistics_bytes=bound, progress=False
    )
    np.testing.assert_array_equal(auto.errors, same.errors)
