"""ReplaceMe (toast.methods.replaceme): distances, cut selection, the LS/cosine
transforms, folding into the down-projection and block removal.

References are independent of toast: NumPy solves on rows captured by the
tests' own hooks, and explicit-T models built by hooks and pass-through
blocks (``replaceme_models.explicit_reference``).
"""

import copy
import math
import re

import numpy as np
import pytest
from scipy import linalg as scipy_linalg

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import assert_rel, rel_err  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.core.patch import fit_patch  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.methods.replaceme import (  # noqa: E402
    DistanceProfile,
    NotFoldableError,
    ReplaceMeReport,
    down_projection,
    fit_cosine,
    fold_transform,
    profile_distances,
    replaceme,
)
from toast.spans import Span  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SPAN = (2, 4)  # blocks 2 and 3 removed, T folded into block 1


def _down(model, block):
    return down_projection(find_blocks(model).blocks[block])


def _compress(model, loader, **kw):
    kw.setdefault("progress", False)
    # every batch fits, as the references here are computed on every batch
    # (the held-out check and the placements it measures: test_check.py,
    # test_auto_placement.py, test_defaults_measure.py)
    kw.setdefault("check_fraction", 0.0)
    return replaceme(model, loader, **kw)


# -- item 1: folded == explicit T, every family ------------------------------------


@pytest.mark.parametrize("name", [*R.DECODERS, *R.ENCODERS])
def test_folded_model_equals_the_explicit_transform_model(name):
    decoder = name in R.DECODERS
    model = R.decoder(name) if decoder else R.encoder(name)
    loader = R.text_loader() if decoder else R.image_loader()
    original = copy.deepcopy(model)
    stack = find_blocks(original)
    down = _down(original, SPAN[0] - 1)
    model, report = _compress(model, loader, spans=[SPAN], objective="ls")
    t = report.transforms[0]
    assert rel_err(t, np.eye(R.HIDDEN)) > 0.05  # a real transform, not ~identity
    ref = R.explicit_reference(original, stack.blocks, [(down.module, SPAN, t)])
    for batch in loader[:2]:
        assert_rel(R.outputs(model, batch), R.outputs(ref, batch), 1e-5, name)
    assert find_blocks(model).num_blocks == R.LAYERS - 2


def test_a_bias_of_the_down_projection_is_transformed_too():
    # OPT's fc2 (and CLIP's) has a bias: b ← b T, checked on the module alone.
    lin = torch.nn.Linear(5, 3).double()
    conv = transformers.pytorch_utils.Conv1D(3, 5).double()
    torch.nn.init.normal_(conv.bias)
    t = np.random.default_rng(0).standard_normal((3, 3))
    x = torch.randn(7, 5, dtype=torch.float64)
    for module, layout in ((lin, "linear"), (conv, "conv1d")):
        with torch.no_grad():
            expected = module(x).numpy() @ t
            fold_transform(toast.hf.model.blocks.Projection("p", module, layout), t)
            assert_rel(module(x).numpy(), expected, 1e-12, layout)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_placement_mlp_keeps_t_as_a_module_and_equals_the_folded_model(name):
    loader = R.text_loader()
    folded, rf = _compress(R.decoder(name), loader, spans=[SPAN])
    kept, rk = _compress(R.decoder(name), loader, spans=[SPAN], placement="mlp")
    assert np.array_equal(rf.transforms[0], rk.transforms[0])
    assert rk.params_after == rf.params_after + R.HIDDEN**2
    assert_rel(R.outputs(kept, loader[0]), R.outputs(folded, loader[0]), 1e-5)


def test_placement_block_puts_a_separate_transform_on_the_residual_stream(tmp_path):
    loader = R.text_loader()
    model = R.decoder("llama")
    original = copy.deepcopy(model)
    model, report = _compress(model, loader, spans=[SPAN], placement="block")
    # reference: T on the full output of block 1, fitted L_2 T ≈ L_4 in NumPy
    rows = _capture(original, loader, [1, 3], down_of=None)
    x, y = rows["L1"], rows["L3"]
    assert_rel(report.transforms[0], np.linalg.solve(x.T @ x, x.T @ y), 1e-8)
    assert report.params_after == report.params_before - 2 * _block_params(original) + 32 * 32
    path = toast.save_pretrained(model, tmp_path / "m")
    again = toast.load_pretrained(path)
    assert_rel(R.outputs(again, loader[0]), R.outputs(model, loader[0]), 1e-6)


def _block_params(model):
    return sum(p.numel() for p in find_blocks(model).blocks[0].parameters())


# -- the LS transform against NumPy ---------------------------------------------------


def _capture(model, loader, blocks, down_of, include_padding=False):
    """Rows of the outputs of ``blocks`` (``L{b}``) and the MLP output of block
    ``down_of`` (``M``), by the test's own hooks, float64, pad rows dropped."""
    stack = find_blocks(model)
    seen: dict[str, list] = {}
    current: dict[str, torch.Tensor] = {}
    handles = []
    for b in blocks:

        def block_hook(module, args, out, b=b):
            current[f"L{b}"] = out[0] if isinstance(out, tuple) else out

        handles.append(stack.blocks[b].register_forward_hook(block_hook))
    if down_of is not None:
        down = _down(model, down_of).module

        def down_hook(module, args, out):
            current["M"] = out

        handles.append(down.register_forward_hook(down_hook))
    try:
        with torch.no_grad():
            for batch in loader:
                model(**batch, use_cache=False)
                keep = batch["attention_mask"].reshape(-1).bool()
                for key, value in current.items():
                    rows = value.reshape(-1, value.shape[-1]).double()
                    seen.setdefault(key, []).append(rows if include_padding else rows[keep])
    finally:
        for h in handles:
            h.remove()
    return {k: torch.cat(v).numpy() for k, v in seen.items()}


@pytest.mark.parametrize(
    ("structure", "ridge"),
    [
        ("full", 0.0),
        ("full", 0.3),
        ("diagonal", 0.0),
        ("orthogonal", 0.0),
        ("rotated_diagonal", 0.0),
    ],
)
def test_ls_transform_equals_numpy_on_the_same_rows(structure, ridge):
    loader = R.text_loader()
    model = R.decoder("llama")
    rows = _capture(model, loader, [1, 3], down_of=1)
    m, target = rows["M"], rows["L3"] - rows["L1"] + rows["M"]  # L_{k+n} − Y_k
    if structure == "full":  # (MᵀM + αI)⁻¹ Mᵀ(L − Y)
        expected = np.linalg.solve(m.T @ m + ridge * np.eye(32), m.T @ target)
    elif structure == "diagonal":  # Eq. 13
        expected = np.diag((m * target).sum(0) / (m * m).sum(0))
    elif structure == "orthogonal":  # Procrustes: U Vᵀ of SVD(Mᵀ(L − Y))
        u, _, vt = np.linalg.svd(m.T @ target)
        expected = u @ vt
    else:  # LinearPatch's form H diag(d) Hᵀ, d the LS scale of each rotated channel
        h = scipy_linalg.hadamard(32) / math.sqrt(32)
        mh, th = m @ h, target @ h
        expected = h @ np.diag((mh * th).sum(0) / (mh * mh).sum(0)) @ h.T
    _, report = _compress(model, loader, spans=[SPAN], structure=structure, ridge=ridge)
    assert report.rows == m.shape[0]
    assert_rel(report.transforms[0], expected, 1e-8, structure)


def test_patch_ridge_is_the_core_fit_on_the_cut_rows_and_beats_its_prior():
    loader = R.text_loader()
    model = R.decoder("llama")
    rows = _capture(model, loader, [1, 3], down_of=1)
    m, target = rows["M"], rows["L3"] - rows["L1"] + rows["M"]
    gram, cross, rss = m.T @ m, m.T @ target, float((target**2).sum())
    expected = fit_patch("patch_ridge", gram, cross, rss, m.shape[0]).weight
    _, report = _compress(model, loader, spans=[SPAN], structure="patch_ridge")
    assert_rel(report.transforms[0], expected, 1e-8)
    _, prior = _compress(copy.deepcopy(model), loader, spans=[SPAN], structure="rotated_diagonal")

    def residual(t):
        return float(((m @ t - target) ** 2).sum())

    assert residual(report.transforms[0]) <= residual(prior.transforms[0]) * (1 + 1e-9)


def test_include_padding_fits_on_every_position_as_the_reference_does():
    loader = R.text_loader()
    model = R.decoder("llama")
    rows = _capture(model, loader, [1, 3], down_of=1, include_padding=True)
    m, target = rows["M"], rows["L3"] - rows["L1"] + rows["M"]
    _, report = _compress(model, loader, spans=[SPAN], include_padding=True)
    assert report.rows == sum(b["input_ids"].numel() for b in loader) == m.shape[0]
    assert_rel(report.transforms[0], np.linalg.solve(m.T @ m, m.T @ target), 1e-8)


def test_ls_backend_torch_equals_the_c_core():
    loader = R.text_loader()
    _, c = _compress(R.decoder("llama"), loader, spans=[SPAN], backend="c")
    _, t = _compress(R.decoder("llama"), loader, spans=[SPAN], backend="torch")
    assert_rel(t.transforms[0], c.transforms[0], 1e-10)


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_ls_in_mixed_precision_is_the_float64_fit_to_float32_rounding(backend):
    # float32 products of well-conditioned rows: T within what float32 sums allow
    loader = R.text_loader()
    _, exact = _compress(R.decoder("llama"), loader, spans=[SPAN], backend=backend)
    _, mixed = _compress(
        R.decoder("llama"), loader, spans=[SPAN], backend=backend, precision="mixed"
    )
    assert_rel(mixed.transforms[0], exact.transforms[0], 1e-4)
    assert not np.array_equal(mixed.transforms[0], exact.transforms[0])


# -- item 3: planted transform; cosine from LS ------------------------------------------


def _planted_llama(k=8, seed=0):
    """A tiny Llama whose blocks 2..3 map ``Y + M ↦ Y + M T*`` exactly.

    The first ``k`` coordinates (U) carry only block 1's MLP output; the
    embeddings and every attention and MLP output before it write only into
    the rest (V). Blocks 2 and 3 have no attention and a linear MLP acting on
    U alone (their norms removed), ``x ↦ x + x A_b`` with ``A_b`` zero outside
    U×U, so together they multiply the U part by ``T* = (I + A_2)(I + A_3)``.
    """
    model = R.decoder("llama", seed)
    blocks = find_blocks(model).blocks
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, :k] = 0
        for b in range(2):
            blocks[b].self_attn.o_proj.weight[:k] = 0
        blocks[0].mlp.down_proj.weight[:k] = 0
        blocks[1].mlp.down_proj.weight[k:] = 0
        planted = np.eye(32)
        for b in (2, 3):
            blocks[b].self_attn.o_proj.weight.zero_()
            a = np.zeros((32, 32))
            a[:k, :k] = 0.5 * rng.standard_normal((k, k))
            planted = planted @ (np.eye(32) + a)
            linear = torch.nn.Linear(32, 32, bias=False)
            linear.weight.copy_(torch.as_tensor(a.T, dtype=torch.float32))
            blocks[b].mlp = linear
            blocks[b].post_attention_layernorm = torch.nn.Identity()
    return model, planted[:k, :k]


def test_ls_recovers_a_planted_transform_and_the_folded_model_is_exact():
    loader = R.text_loader()
    model, planted = _planted_llama()
    original = copy.deepcopy(model)
    with pytest.warns(toast.core.IllConditionedWarning):  # M spans only U: a pseudo-inverse
        model, report = _compress(model, loader, spans=[SPAN])
    t = report.transforms[0]
    assert_rel(t[:8, :8], planted, 1e-6, "T on U")
    for batch in loader:
        assert_rel(R.outputs(model, batch), R.outputs(original, batch), 1e-5)


@pytest.mark.parametrize(("solver", "loss"), [("adam", "approximate"), ("lbfgs", "exact")])
def test_cosine_started_from_ls_does_not_get_worse_on_its_own_objective(solver, loss):
    loader = R.text_loader(96)
    kw = {"spans": [SPAN], "objective": "cosine", "init": "ls", "solver": solver, "loss": loss}
    # check_fraction=0: one fit from LS (a checked fit's refit goes on from its transform)
    _, report = _compress(R.decoder("llama"), loader, lbfgs_steps=30, check_fraction=0.0, **kw)
    before, after = report.objectives[0]
    assert after < before, (before, after)


def test_cosine_objective_recorded_equals_a_numpy_evaluation_from_its_ls_start():
    loader = R.text_loader()
    model = R.decoder("llama")
    rows = _capture(model, loader, [1, 3], down_of=1)
    m, target = rows["M"], rows["L3"] - rows["L1"] + rows["M"]
    _, report = _compress(
        copy.deepcopy(model), loader, spans=[SPAN], objective="cosine", loss="approximate"
    )
    _, ls = _compress(model, loader, spans=[SPAN], objective="ls")
    t = report.transforms[0]

    def objective(t):
        p = m @ t
        cos = (p * target).sum(1) / np.linalg.norm(p, axis=1) / np.linalg.norm(target, axis=1)
        return float(np.mean(1 - cos))

    before, after = report.objectives[0]
    assert math.isclose(before, objective(ls.transforms[0]), rel_tol=1e-5)
    assert math.isclose(after, objective(t), rel_tol=1e-4)
    assert after < before


def test_the_paper_preset_is_the_papers_protocol():
    config = toast.ReplaceMeConfig.paper(num_blocks=2, objective="cosine", seed=3)
    assert (config.solver, config.lr, config.rows_per_step, config.epochs) == (
        "adam",
        1e-4,
        1024,
        10,
    )
    assert (config.init, config.massive_rows, config.check_fraction, config.candidates) == (
        "identity",
        "fit",
        0.0,
        1,
    )
    assert config.objective == "cosine" and config.calibration.seed == 3


def test_fit_cosine_penalties_shrink_the_transform():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 8)).astype(np.float32)
    b = a @ rng.standard_normal((8, 8)).astype(np.float32)
    plain = fit_cosine(a, b, lr=1e-2, epochs=5, progress=False)
    for penalty in ("l1", "l2"):
        shrunk = fit_cosine(
            a, b, lr=1e-2, epochs=5, penalty=penalty, penalty_weight=0.05, progress=False
        )
        assert np.abs(shrunk.transform).sum() < np.abs(plain.transform).sum(), penalty


def test_fit_cosine_diagonal_structure_trains_only_the_diagonal():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 6)).astype(np.float32)
    b = a * np.array([1, 2, 3, -1, 0.5, 4], dtype=np.float32)
    fit = fit_cosine(a, b, structure="diagonal", solver="lbfgs", progress=False)
    assert np.count_nonzero(fit.transform - np.diag(np.diagonal(fit.transform))) == 0
    assert fit.final < 1e-6


# -- item 6 (second half): the cosine buffer honours a byte limit ----------------------


def test_cosine_buffer_honours_the_byte_limit(capsys):
    loader = R.text_loader(96)
    limit = 100 * 2 * 32 * 4 + 17  # room for 100 rows of (M, L − Y) in float32
    _, report = replaceme(
        R.decoder("llama"),
        loader,
        spans=[SPAN],
        objective="cosine",
        loss="approximate",
        epochs=1,
        max_buffer_bytes=limit,
    )
    assert 0 < report.buffer_bytes <= limit
    assert report.rows_kept == 100 < report.rows
    assert re.search(r"disk-backed row buffer of 25\.0 KiB \(100 rows", capsys.readouterr().err)


def test_a_byte_limit_below_one_row_is_an_error():
    with pytest.raises(ValueError, match="cannot hold one row"):
        _compress(
            R.decoder("llama"),
            R.text_loader(),
            spans=[SPAN],
            objective="cosine",
            max_buffer_bytes=100,
        )


def test_the_buffer_is_sized_by_the_calibration_rows_when_they_fit():
    loader = R.text_loader()
    _, report = _compress(R.decoder("llama"), loader, num_blocks=2, objective="cosine")
    assert report.rows_kept == report.rows
    assert report.buffer_bytes == report.rows * 3 * 32 * 4  # M, Y and L (the exact loss)


# -- distances ---------------------------------------------------------------------------


def _reference_distances(model, loader, tokens, last="hook"):
    """Angular distances from output_hidden_states (states 0..L−1) and, for
    state L, a hook on the last block (its output before the final norm) or
    ``hidden_states[-1]`` (``last="hidden"``, normalised in Llama)."""
    stack = find_blocks(model)
    hooked = {}
    handle = stack.blocks[-1].register_forward_hook(lambda m, a, o: hooked.update(L=o))
    sums, count = 0.0, 0
    try:
        with torch.no_grad():
            for batch in loader:
                out = model(**batch, output_hidden_states=True, use_cache=False)
                final = hooked["L"] if last == "hook" else out.hidden_states[-1]
                states = torch.stack([*out.hidden_states[:-1], final]).double().numpy()
                mask = batch["attention_mask"].numpy().astype(bool)
                if tokens == "last":
                    idx = np.array([np.flatnonzero(row).max() for row in mask])
                    rows = states[:, np.arange(len(idx)), idx]  # (S, B, d)
                else:
                    rows = states[:, mask]
                u = rows / np.linalg.norm(rows, axis=-1, keepdims=True)
                cos = np.clip(np.einsum("ird,jrd->ijr", u, u), -1, 1)
                sums = sums + (np.arccos(cos) / np.pi).sum(-1)
                count += rows.shape[1]
    finally:
        handle.remove()
    return sums / count


@pytest.mark.parametrize(("tokens", "left"), [("last", False), ("last", True), ("all", False)])
def test_angular_distances_equal_numpy_on_the_chosen_tokens(tokens, left):
    model = R.decoder("llama")
    loader = R.text_loader(left=left)
    profile = profile_distances(model, loader, tokens=tokens, progress=False)
    expected = _reference_distances(model, loader, tokens)
    upper = np.triu(np.ones_like(expected, dtype=bool), 1)
    assert_rel(profile.matrix("angular")[upper], expected[upper], 1e-10)
    assert np.isnan(profile.matrix()[~upper]).all()


def test_the_last_state_is_taken_before_the_final_norm():
    model = R.decoder("llama")
    with torch.no_grad():  # a norm that changes directions, as a trained one does
        model.model.norm.weight.uniform_(0.2, 2.0)
    loader = R.text_loader()
    profile = profile_distances(model, loader, progress=False)
    pre_norm = _reference_distances(model, loader, "last", last="hook")
    post_norm = _reference_distances(model, loader, "last", last="hidden")
    L = R.LAYERS
    assert math.isclose(profile.matrix()[L - 2, L], pre_norm[L - 2, L], rel_tol=1e-10)
    assert abs(post_norm[L - 2, L] - pre_norm[L - 2, L]) > 1e-3


def test_cosine_and_l2_distances_follow_their_definitions():
    model = R.decoder("llama")
    loader = R.text_loader()
    profile = profile_distances(model, loader, tokens="all", progress=False)
    rows = _capture(model, loader, [0, 2], down_of=None)
    a, b = rows["L0"], rows["L2"]  # states 1 and 3
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert math.isclose(profile.matrix("cosine")[1, 3], np.mean(1 - cos), rel_tol=1e-10)
    l2 = np.linalg.norm(a - b, axis=1).mean()
    assert math.isclose(profile.matrix("l2")[1, 3], l2, rel_tol=1e-8)
    assert profile.token_rows == sum(int(x["attention_mask"].sum()) for x in loader)


def test_the_chosen_cut_is_the_window_of_smallest_distance():
    loader = R.text_loader()
    model = R.decoder("llama")
    profile = profile_distances(model, loader, progress=False)
    w = profile.windows(2)
    best = int(np.argmin(w[1:])) + 1  # windows start at block 1 at the earliest
    _, report = _compress(model, loader, num_blocks=2, predicted_candidates=0)
    assert (report.spans[0].start, report.spans[0].stop) == (best, best + 2)
    assert report.spans[0].error == pytest.approx(w[best])
    assert report.spans[0].paper == f"{best - 1}→{best + 1}"


def _profile(window_distances, total=8):
    """A synthetic profile whose windows of every size have the given values
    at their start (only the tested window size matters)."""
    d = np.full((total + 1, total + 1), np.nan)
    for i in range(total + 1):
        for j in range(i + 1, total + 1):
            d[i, j] = window_distances[i] if i < len(window_distances) else 9.0
    return DistanceProfile({"angular": d, "cosine": d, "l2": d}, "last", 10, "layers")


def test_min_start_is_enforced():
    profile = _profile([0.0, 0.01, 0.5, 0.4, 0.3, 0.2, 0.9])
    assert profile.select(2, min_start=1)[0].start == 1
    assert profile.select(2, min_start=3)[0].start == 5
    with pytest.raises(ValueError, match=r"min_start must be an int in \[1, 6\]; got 7"):
        profile.select(2, min_start=7)
    with pytest.raises(ValueError, match=r"min_start must be an int in \[1, 6\]; got 0"):
        profile.select(2, min_start=0)


def test_several_cuts_are_greedy_and_non_overlapping():
    profile = _profile([0.0, 0.1, 0.15, 0.3, 0.2, 0.12, 0.5])
    # windows of 2: ascending 1 (0.1), 5 (0.12), 2 (overlaps 1), 4 (overlaps 5)
    cuts = profile.select(4, num_cuts=2)
    assert [(c.start, c.stop) for c in cuts] == [(1, 3), (5, 7)]


def test_adjacent_windows_merge_or_are_forbidden():
    profile = _profile([0.0, 0.1, 0.5, 0.12, 0.6, 0.7, 0.2])
    merged = profile.select(4, num_cuts=2, adjacent="merge")
    assert [(c.start, c.stop) for c in merged] == [(1, 5)]
    assert merged[0].error == profile.matrix()[1, 5]
    apart = profile.select(4, num_cuts=2, adjacent="forbid")
    assert [(c.start, c.stop) for c in apart] == [(1, 3), (6, 8)]
    with pytest.raises(ValueError, match="cannot place 3 non-overlapping windows"):
        profile.select(6, num_cuts=3, adjacent="forbid")


def test_profile_csv_matches_the_reference_layout(tmp_path):
    profile = _profile([0.0, 0.1, 0.2, 0.3])
    profile.to_csv(tmp_path / "d.csv", window=2)
    lines = (tmp_path / "d.csv").read_text().splitlines()
    assert lines[0] == "block_start,block_end,average_distance"
    assert lines[2] == "1,3,0.1" and len(lines) == 1 + 7


def test_profile_plot_draws_distance_against_window_start():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    profile = _profile([0.0, 0.1, 0.2, 0.3])
    fig = profile.plot(2, cuts=profile.select(2))
    line = fig.axes[0].lines[0]
    assert np.array_equal(line.get_ydata(), profile.windows(2))
    assert "window blocks[s:s+2]" in fig.axes[0].get_xlabel()


# -- several cuts --------------------------------------------------------------------------


def test_independent_cuts_are_all_estimated_on_the_original_model():
    loader = R.text_loader()
    model = R.decoder("llama")
    original = copy.deepcopy(model)
    spans = [(1, 2), (3, 5)]
    rows = _capture(original, loader, [0, 1, 2, 4], down_of=0)
    rows2 = _capture(original, loader, [2], down_of=2)
    model, report = _compress(model, loader, spans=spans)
    for k, (m, lk, ls) in enumerate(
        [(rows["M"], rows["L0"], rows["L1"]), (rows2["M"], rows["L2"], rows["L4"])]
    ):
        target = ls - lk + m
        assert_rel(report.transforms[k], np.linalg.solve(m.T @ m, m.T @ target), 1e-8)
    assert find_blocks(model).num_blocks == R.LAYERS - 3
    cuts = [
        (_down(original, s - 1).module, (s, e), t)
        for (s, e), t in zip(spans, report.transforms, strict=True)
    ]
    ref = R.explicit_reference(original, find_blocks(original).blocks, cuts)
    assert_rel(R.outputs(model, loader[0]), R.outputs(ref, loader[0]), 1e-5)


def test_sequential_cuts_estimate_each_on_the_model_already_cut():
    loader = R.text_loader()
    model, report = _compress(R.decoder("llama"), loader, spans=[(1, 2), (3, 5)], fit="sequential")
    step, _ = _compress(R.decoder("llama"), loader, spans=[(1, 2)])
    step, second = _compress(step, loader, spans=[(2, 4)])
    assert_rel(report.transforms[1], second.transforms[0], 1e-10)
    assert_rel(R.outputs(model, loader[0]), R.outputs(step, loader[0]), 1e-6)


def test_adjacent_spans_cannot_both_be_folded():
    with pytest.raises(ValueError, match=r"adjacent: .* merge them into \(1, 5\)"):
        _compress(R.decoder("llama"), R.text_loader(), spans=[(1, 3), (3, 5)])


# -- removal, renumbering, generation ---------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gpt2", "opt"])
def test_removal_renumbers_layers_and_generate_with_the_cache_works(name):
    loader = R.text_loader()
    model, _ = _compress(R.decoder(name), loader, num_blocks=2)
    blocks = find_blocks(model).blocks
    assert model.config.num_hidden_layers == R.LAYERS - 2 == len(blocks)
    for position, block in enumerate(blocks):
        indices = {
            m.layer_idx for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int)
        }
        assert indices == {position}
    if getattr(model.config, "layer_types", None) is not None:
        assert len(model.config.layer_types) == R.LAYERS - 2
    prompt = {k: v[:2, :4] for k, v in loader[0].items()}
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    cached = model.generate(**prompt, use_cache=True, **kw)
    uncached = model.generate(**prompt, use_cache=False, **kw)
    assert torch.equal(cached, uncached)


def test_remove_blocks_keeps_per_layer_config_lists():
    model = R.decoder("qwen2")
    model.config.layer_types = ["full_attention", "sliding_attention"] * 3
    model.config.no_rope_layers = [1, 0, 1, 0, 1, 1]
    toast.hf.remove_blocks(model, [(1, 3)])
    assert model.config.layer_types == ["full_attention", "sliding_attention"] * 2
    assert model.config.no_rope_layers == [1, 0, 1, 1]


def test_uidl_removes_blocks_without_a_transform():
    loader = R.text_loader()
    model = R.decoder("llama")
    original = copy.deepcopy(model)
    model, report = _compress(model, loader, spans=[SPAN], objective="identity")
    assert report.transforms == [None]
    down = _down(original, 1).module
    ref = R.explicit_reference(original, find_blocks(original).blocks, [(down, SPAN, np.eye(32))])
    assert_rel(R.outputs(model, loader[0]), R.outputs(ref, loader[0]), 1e-6)


# -- blocks that cannot be folded ---------------------------------------------------------------


@pytest.mark.parametrize("case", ["post_ln_opt", "bert"])
def test_post_norm_blocks_are_refused_for_folding(case):
    if case == "post_ln_opt":
        cfg = R.DECODERS["opt"]()
        cfg.do_layer_norm_before = False
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    else:
        cfg = transformers.BertConfig(
            hidden_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=97,
        )
        model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    with pytest.raises(NotFoldableError, match="cannot be folded"):
        _compress(model, R.text_loader(), spans=[(2, 3)])


# -- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 6}, r"num_blocks must be an int in \[1, 5\]; got 6"),
        ({"num_blocks": 0}, r"num_blocks must be an int in \[1, inf\) or None; got 0"),
        ({"num_blocks": 3, "num_cuts": 2}, "not a multiple of num_cuts=2"),
        ({"num_blocks": 2, "min_start": 5}, r"min_start must be an int in \[1, 4\]; got 5"),
        ({"num_blocks": 2, "objective": "mse"}, "objective must be one of 'ls', 'cosine'"),
        ({"num_blocks": 2, "structure": "orthogonal", "objective": "cosine"}, "least-squares"),
        ({"num_blocks": 2, "placement": "inline"}, "placement must be one of 'auto', 'fold'"),
        ({"num_blocks": 2, "distance": "kl"}, "distance must be one of 'angular'"),
        ({"num_blocks": 2, "ridge": -1.0}, r"ridge must be a number in \[0, inf\); got -1.0"),
        ({"spans": [(0, 2)]}, "starts at block 0"),
        ({"spans": [(2, 9)]}, "must satisfy 0 <= start < stop <= 6"),
        ({"spans": [(2, 4)], "num_blocks": 3}, "but the spans remove 2"),
        ({}, "give num_blocks"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _compress(R.decoder("llama"), R.text_loader(8), **kwargs)


# -- toast.compress(method="replaceme") ----------------------------------------------


def test_compress_dispatches_to_replaceme():
    loader = R.text_loader()
    model, report = toast.compress(
        R.decoder("llama"),
        loader,
        method="replaceme",
        num_blocks=2,
        check_fraction=0.0,
        progress=False,
    )
    direct, expected = _compress(R.decoder("llama"), loader, num_blocks=2)
    assert isinstance(report, ReplaceMeReport)
    assert report.spans == expected.spans
    assert np.array_equal(report.transforms[0], expected.transforms[0])
    assert "| blocks[" in report.to_markdown()


def test_compress_refuses_options_of_another_method():
    with pytest.raises(TypeError, match=r"method='replaceme' has no option\(s\) \['translator'\]"):
        toast.compress(
            R.decoder("llama"),
            R.text_loader(),
            method="replaceme",
            num_blocks=2,
            translator="linear",
        )
    with pytest.raises(TypeError, match=r"method='toast' has no option\(s\) \['num_cuts'\]"):
        toast.compress(R.decoder("llama"), R.text_loader(), num_blocks=1, num_cuts=2)


def test_report_gives_both_index_notations_and_eq10():
    loader = R.text_loader()
    model = R.decoder("llama")
    before = sum(p.numel() for p in model.parameters())
    _, report = _compress(model, loader, spans=[SPAN])
    assert report.params_before == before
    assert report.params_after == before - 2 * _block_params(R.decoder("llama"))
    assert report.eq10_ratio == pytest.approx(100 * (1 - report.params_after / before))
    assert report.compression_by_blocks == pytest.approx(2 / 6)
    md = report.to_markdown()
    assert "| blocks[2:4] | 1→3 | (2, 4) |" in md
    assert f"{report.eq10_ratio:.2f}% by parameters (Eq. 10)" in md


def test_span_paper_notation_is_the_kept_block_and_the_last_removed():
    assert Span(2, 4, 0.0).paper == "1→3"


def test_sequential_block_placement_keeps_one_translator_per_cut_in_place():
    loader = R.text_loader()
    model, report = _compress(
        R.decoder("llama"),
        loader,
        spans=[(1, 2), (3, 5)],
        placement="block",
        objective="cosine",
        fit="sequential",
        epochs=2,
    )
    kinds = [type(b).__name__ for b in find_blocks(model).blocks]
    assert kinds == ["LlamaDecoderLayer", "TranslatorBlock"] * 2 + ["LlamaDecoderLayer"]
    assert [b.span for b in find_blocks(model).blocks if hasattr(b, "span")] == [(1, 2), (3, 5)]
    assert all(after < before for before, after in report.objectives)
    assert report.blocks_after == 5


def test_ls_transform_equals_the_core_residual_solver():
    # Two C paths: fit_translator on moments of (M, L − Y), and fit_residual
    # (ReplaceMe's residual form) on moments of (Y, M, L).
    loader = R.text_loader()
    model = R.decoder("llama")
    rows = _capture(model, loader, [1, 3], down_of=1)
    y = rows["L1"] - rows["M"]
    moments = toast.Moments(3, 32, pairs="consecutive").update([y, rows["M"], rows["L3"]])
    expected = toast.core.fit_residual(moments, m=1, y=0, target=2, ridge=0.3).weight
    _, report = _compress(model, loader, spans=[SPAN], ridge=0.3)
    assert_rel(report.transforms[0], expected, 1e-9)


def test_uidl_report_says_no_transform_was_fitted():
    _, report = _compress(R.decoder("llama"), R.text_loader(), num_blocks=2, objective="identity")
    md = report.to_markdown()
    assert "identity (UIDL: plain removal)" in md and "cut chosen on 48 rows" in md


# -- the config and the one discovery per call -------------------------------------------


def test_a_config_and_keywords_give_the_same_result():
    loader = R.text_loader()
    config = toast.ReplaceMeConfig(
        num_blocks=2,
        check_fraction=0.0,
        calibration=toast.Calibration(max_samples=16, progress=False),
    )
    _, by_config = replaceme(R.decoder("llama"), loader, config)
    _, by_keywords = _compress(R.decoder("llama"), loader, num_blocks=2, max_samples=16)
    assert by_config.spans == by_keywords.spans
    assert np.array_equal(by_config.transforms[0], by_keywords.transforms[0])
    # keywords override a config's fields (and its calibration's)
    _, overridden = replaceme(R.decoder("llama"), loader, config, spans=[SPAN], num_blocks=None)
    assert [(s.start, s.stop) for s in overridden.spans] == [SPAN]


def test_the_registered_method_runs_the_config_directly():
    from toast.methods.driver import runner_of

    method = toast.methods.base.get_method("replaceme")
    assert method.config is toast.ReplaceMeConfig
    config = toast.ReplaceMeConfig(spans=[SPAN], calibration=toast.Calibration(progress=False))
    model, report = runner_of(method)(R.decoder("llama"), R.text_loader(), config)
    assert report.blocks_after == R.LAYERS - 2 == find_blocks(model).num_blocks


def test_the_package_names_resolve_to_their_modules():
    import toast.methods.replaceme as package
    from toast.methods.replaceme import method, profile

    assert package.replaceme is method.replaceme and callable(package.replaceme)
    assert package.profile_distances is profile.profile_distances


@pytest.mark.parametrize("fit", ["independent", "sequential"])
def test_one_call_searches_for_the_blocks_once(monkeypatch, fit):
    model = R.decoder("llama")
    modules = len(list(model.named_modules()))
    calls = []
    original = toast.hf.model.blocks._is_block_list

    def counting(module):
        calls.append(module)
        return original(module)

    monkeypatch.setattr(toast.hf.model.blocks, "_is_block_list", counting)
    _compress(model, R.text_loader(), num_blocks=2, num_cuts=2, adjacent="forbid", fit=fit)
    assert len(calls) == modules  # one search over the model, then lookups by path


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_blocks": 2, "num_cuts": 0}, r"num_cuts must be an int in \[1, inf\); got 0"),
        ({"num_blocks": 2, "adjacent": "fuse"}, "adjacent must be one of 'merge', 'forbid'"),
        ({"num_blocks": 2, "distance_tokens": "first"}, "distance_tokens must be one of"),
        ({"num_blocks": 2, "min_start": 0}, r"min_start must be an int in \[1, inf\); got 0"),
        ({"num_blocks": 2, "loss": "mse"}, "loss must be one of 'approximate', 'exact'"),
        ({"num_blocks": 2, "solver": "sgd"}, "solver must be one of 'adam', 'lbfgs'"),
        ({"num_blocks": 2, "lr": 0.0}, r"lr must be a number in \(0, inf\); got 0.0"),
        ({"num_blocks": 2, "rows_per_step": 0}, r"rows_per_step must be an int in \[1, inf\)"),
        ({"num_blocks": 2, "epochs": -1}, r"epochs must be an int in \[0, inf\)"),
        ({"num_blocks": 2, "lbfgs_steps": 0}, r"lbfgs_steps must be an int in \[1, inf\)"),
        ({"num_blocks": 2, "penalty": "l0"}, "penalty must be one of 'l1', 'l2' or None"),
        ({"num_blocks": 2, "penalty_weight": math.inf}, "penalty_weight must be a number in"),
        ({"num_blocks": 2, "init": "random"}, "init must be one of 'identity', 'ls'"),
        ({"num_blocks": 2, "fit": "joint"}, "fit must be one of 'independent', 'sequential'"),
        ({"num_blocks": 2, "include_padding": 1}, "include_padding must be a bool; got 1"),
        ({"num_blocks": 2, "max_buffer_bytes": 0}, r"max_buffer_bytes must be an int in \[1"),
        ({"num_blocks": 2, "buffer_dtype": "int8"}, "buffer_dtype must be a floating-point"),
        ({"num_blocks": 2, "buffer_dir": 3}, "buffer_dir must be a str or a PathLike or None"),
        ({"num_blocks": 2, "backend": "gpu"}, "backend must be one of 'auto', 'c', 'torch'"),
        ({"num_blocks": 2, "check": "yes"}, "check must be a bool"),
        ({"num_blocks": 2, "spans": 3}, r"spans must be a list of \(start, stop\) or None"),
        ({"num_blocks": 2, "calibration": {}}, "calibration must be a Calibration"),
        ({"num_blocks": 2.0}, r"num_blocks must be an int in \[1, inf\) or None; got 2.0"),
    ],
)
def test_every_config_field_is_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        toast.ReplaceMeConfig(**kwargs)


def test_fit_cosine_checks_its_options_in_the_common_format():
    x = np.ones((4, 3))
    with pytest.raises(ValueError, match="structure must be one of 'full', 'diagonal'"):
        fit_cosine(x, x, structure="orthogonal")
    with pytest.raises(ValueError, match=r"lr must be a number in \(0, inf\); got -1"):
        fit_cosine(x, x, lr=-1)
