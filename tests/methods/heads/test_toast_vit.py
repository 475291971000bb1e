"""ToaSt for ViTs on tiny random HF models (ViT, DeiT, DINOv2, ViT-MAE, Swin):

- SCWP: dense == masked (≤ 1e-5), ρ = 0 is an exact no-op, realised per-head
  keep counts equal the request, index sets and single-sided ablations
  against independent references (the reference code's coordinate-median
  selection; SciPy geometric medians; NumPy norms);
- TCS: ratios 0 are an exact no-op, dense == masked, per-image selection is
  batch-invariant and per-batch selection is not, selections against an
  independent re-implementation of Eq. 6 / Eq. 7 from eager attention maps;
- the MAC counter against the realised module shapes; the recovery
  fine-tune; ``compress(method="toast-vit")``.
"""

import copy
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from scipy.optimize import minimize  # noqa: E402

import toast  # noqa: E402
from tests._helpers import hf_models as H  # noqa: E402
from toast.hf.model.vit import vit_blocks  # noqa: E402
from toast.methods.heads import ToastVitReport  # noqa: E402
from toast.methods.heads.finetune import finetune  # noqa: E402
from toast.methods.heads.macs import toast_macs  # noqa: E402
from toast.methods.heads.schedules import get_schedule, tcs_keep  # noqa: E402
from toast.methods.heads.scwp import prune_heads  # noqa: E402
from toast.methods.heads.tcs import disable_tcs, enable_tcs  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

FAMILIES = {f.name: f for f in H.FAMILIES if f.name in ("vit", "deit", "dinov2")}


def _mae():
    cfg = transformers.ViTMAEConfig(
        image_size=H.IMAGE, patch_size=4, hidden_size=H.HIDDEN, num_hidden_layers=H.LAYERS,
        num_attention_heads=4, intermediate_size=64, mask_ratio=0.0,
    )  # fmt: skip
    return transformers.ViTMAEModel(cfg)


def _swin():
    cfg = transformers.SwinConfig(
        image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
        window_size=4, mlp_ratio=2.0,
    )  # fmt: skip
    return transformers.SwinModel(cfg)


def build(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name in FAMILIES:
        return H.build(FAMILIES[name], seed)
    model = {"vit_mae": _mae, "swin": _swin}[name]()
    return model.eval()


def images(name: str, n: int, seed: int = 0) -> torch.Tensor:
    size = 32 if name == "swin" else H.IMAGE
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def run(model, x) -> torch.Tensor:
    kw = {}
    if model.config.model_type == "vit_mae":  # no shuffle: the identity order
        n = (H.IMAGE // 4) ** 2
        kw["noise"] = torch.arange(n, dtype=torch.float32).expand(x.shape[0], n)
    with torch.no_grad():
        return model(pixel_values=x, **kw).last_hidden_state


ALL = ["vit", "deit", "dinov2", "vit_mae", "swin"]


def _max_diff(a, b) -> float:
    return float((a - b).abs().max())


# ---------------------------------------------------------------------- SCWP


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("center", ["geomedian", "coord_median", "fpgm"])
def test_dense_equals_masked(name, center):
    model = build(name)
    x = images(name, 3)
    masked, dense = copy.deepcopy(model), copy.deepcopy(model)
    rm = prune_heads(masked, 0.5, center=center, form="masked")
    rd = prune_heads(dense, 0.5, center=center, form="dense")
    assert rm.keep_counts == rd.keep_counts and rm.keep_counts
    assert _max_diff(run(masked, x), run(dense, x)) <= 1e-5
    assert _max_diff(run(dense, x), run(model, x)) > 1e-3  # it did prune
    assert rd.params_after < rd.params_before == rm.params_after


@pytest.mark.parametrize("index_sets", ["shared", "independent"])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_equals_masked_index_sets_and_bias(index_sets, bias):
    model = build("vit")
    x = images("vit", 3)
    masked, dense = copy.deepcopy(model), copy.deepcopy(model)
    prune_heads(masked, 0.75, index_sets=index_sets, form="masked", mask_bias=bias)
    prune_heads(dense, 0.75, index_sets=index_sets, form="dense")
    assert _max_diff(run(masked, x), run(dense, x)) <= 1e-5


@pytest.mark.parametrize("name", ALL)
def test_zero_sparsity_is_an_exact_noop(name):
    model = build(name)
    x = images(name, 2)
    ref = run(model, x)
    modules = [m for m in model.modules()]
    for form in ("dense", "masked"):
        report = prune_heads(model, 0.0, form=form)
        assert report.blocks == []
        assert torch.equal(run(model, x), ref)
    assert [m for m in model.modules()] == modules


@pytest.mark.parametrize("name", ["vit", "swin"])
@pytest.mark.parametrize("rho", [0.25, 0.5, 0.6, 0.875])
def test_realised_keep_counts(name, rho):
    model = build(name)
    masked = copy.deepcopy(model)
    vm = vit_blocks(model)
    want = {b.index: math.floor(b.head_dim * (1 - rho) + 1e-9) for b in vm.blocks[1:]}
    prune_heads(model, rho, form="dense")
    prune_heads(masked, rho, form="masked")
    for blk, mblk in zip(vit_blocks(model).blocks, vit_blocks(masked).blocks, strict=True):
        h = blk.heads
        if blk.index == 0:
            assert blk.head_dim == mblk.head_dim  # block 0 skipped
            continue
        k = want[blk.index]
        assert blk.head_dim == k
        for lin in (blk.attention.q_proj, blk.attention.k_proj, blk.attention.v_proj):
            assert lin.out_features == h * k
        assert blk.attention.o_proj.in_features == h * k
        # masked: exactly k nonzero rows per head in Q, K, V and columns in O
        dk = mblk.head_dim
        for w in (
            mblk.attention.q_proj.weight,
            mblk.attention.k_proj.weight,
            mblk.attention.v_proj.weight,
            mblk.attention.o_proj.weight.t(),
        ):
            alive = w.detach().abs().sum(dim=1).reshape(h, dk) > 0
            assert alive.sum(dim=1).tolist() == [k] * h


def test_sparsity_leaving_nothing_is_refused():
    model = build("vit")  # d_k = 8: 90% would keep floor(0.8) = 0
    with pytest.raises(ValueError, match="leaves no dimension"):
        prune_heads(model, 0.9)


def _ref_code_indices(att, heads, dk, keep):
    """The ToaSt reference code (weight_pruning.py): coordinate-median score of
    cat([Q, K]) and cat([V, Oᵀ]) rows per head, independent top-k."""

    def gm_score(w):
        return torch.sqrt(torch.sum((w - torch.median(w, dim=0).values) ** 2, dim=1))

    q, k, v = (getattr(att, n).weight.detach().double() for n in ("q_proj", "k_proj", "v_proj"))
    o = att.o_proj.weight.detach().double()
    qk, vo = [], []
    for h in range(heads):
        rows = slice(h * dk, (h + 1) * dk)
        s_qk = gm_score(torch.cat([q[rows], k[rows]], dim=1))
        s_vo = gm_score(torch.cat([v[rows], o[:, rows].t()], dim=1))
        qk.append(sorted(torch.topk(s_qk, keep).indices.tolist()))
        vo.append(sorted(torch.topk(s_vo, keep).indices.tolist()))
    return np.array(qk), np.array(vo)


def test_reference_code_parity():
    model = build("deit")
    vm = vit_blocks(model)
    keep = 4
    want = {
        b.index: _ref_code_indices(b.attention, b.heads, b.head_dim, keep) for b in vm.blocks[1:]
    }
    report = prune_heads(model, 0.5, center="coord_median", index_sets="independent")
    for b in report.blocks:
        qk, vo = want[b.index]
        assert np.array_equal(b.indices["q"], qk) and np.array_equal(b.indices["k"], qk)
        assert np.array_equal(b.indices["v"], vo) and np.array_equal(b.indices["o"], vo)


def _scipy_gm_scores(points: np.ndarray) -> np.ndarray:
    def f(y):
        return np.linalg.norm(points - y, axis=1).sum()

    def g(y):
        d = np.linalg.norm(points - y, axis=1)
        return ((y - points) / d[:, None]).sum(axis=0)

    res = minimize(f, points.mean(0), jac=g, method="BFGS", options={"gtol": 1e-12})
    return np.linalg.norm(points - res.x, axis=1)


def test_geomedian_shared_indices_against_scipy():
    """Algorithm 1: one set per head from ½(I_QK + I_VO), GM by SciPy."""
    model = build("vit")
    vm = vit_blocks(model)
    keep, want = 4, {}
    for b in vm.blocks[1:]:
        a, h, dk = b.attention, b.heads, b.head_dim
        q, k, v = (
            getattr(a, n).weight.detach().double().numpy() for n in ("q_proj", "k_proj", "v_proj")
        )
        o = a.o_proj.weight.detach().double().numpy()
        sets = []
        for head in range(h):
            r = slice(head * dk, (head + 1) * dk)
            s = _scipy_gm_scores(np.hstack([q[r], k[r]])) + _scipy_gm_scores(
                np.hstack([v[r], o[:, r].T])
            )
            sets.append(sorted(np.argsort(-s)[:keep].tolist()))
        want[b.index] = np.array(sets)
    report = prune_heads(model, 0.5, form="masked")
    for b in report.blocks:
        assert all(np.array_equal(b.indices[n], want[b.index]) for n in "qkvo")


@pytest.mark.parametrize("coupling", ["q_only", "k_only", "proj_only", "average"])
def test_single_sided_ablations(coupling):
    """Table 15's ablations with L2 scores, against NumPy norms."""
    model = build("vit")
    blk = vit_blocks(model).blocks[2]
    a, h, dk = blk.attention, blk.heads, blk.head_dim
    half = {
        "q": a.q_proj.weight,
        "k": a.k_proj.weight,
        "v": a.v_proj.weight,
        "o": a.o_proj.weight.t(),
    }
    norms = {n: w.detach().double().numpy().reshape(h, dk, -1) for n, w in half.items()}
    norms = {n: np.linalg.norm(w, axis=-1) for n, w in norms.items()}
    s_qk, s_vo = {
        "q_only": (norms["q"], norms["v"]),
        "k_only": (norms["k"], norms["o"]),
        "proj_only": (norms["q"], norms["o"]),
        "average": ((norms["q"] + norms["k"]) / 2, (norms["v"] + norms["o"]) / 2),
    }[coupling]
    want = np.sort(np.argsort(-(s_qk + s_vo) / 2, axis=1, kind="stable")[:, :4], axis=1)
    report = prune_heads(model, {2: 0.5}, center="l2", coupling=coupling)
    assert np.array_equal(report.blocks[0].indices["q"], want)


def test_nonaligned_control_is_masked_only():
    model = build("vit")
    with pytest.raises(ValueError, match="no dense form"):
        prune_heads(model, 0.5, index_sets="nonaligned")
    report = prune_heads(model, 0.5, index_sets="nonaligned", form="masked")
    idx = report.blocks[0].indices
    assert not np.array_equal(idx["q"], idx["k"])  # independent sets
    assert all(idx[n].shape == (4, 4) for n in "qkvo")


def test_softmax_scale_and_rescale():
    model, rescaled = build("vit"), build("vit")
    prune_heads(model, 0.5)
    prune_heads(rescaled, 0.5, rescale=True)
    a, r = vit_blocks(model).blocks[1].attention, vit_blocks(rescaled).blocks[1].attention
    assert a.head_dim == r.head_dim == 4
    assert a.scaling == 8**-0.5 and r.scaling == 4**-0.5


def test_swin_stage_first_skip():
    model = build("swin")
    report = prune_heads(model, 0.5, skip="stage_first")
    assert sorted(report.keep_counts) == [1, 3]  # stages start at blocks 0 and 2


def test_pruning_twice_is_refused():
    model = build("vit")
    prune_heads(model, 0.5)
    with pytest.raises(ValueError, match="already head-pruned"):
        prune_heads(model, 0.5)


# ----------------------------------------------------------------------- TCS


def _schedule(model, r1=0.5, r2=0.75, ratio=0.5):
    n = vit_blocks(model).num_blocks
    return {"fc1": [0.0] + [r1] * (n - 1), "fc2": [0.0] + [r2] * (n - 1), "sample_ratio": ratio}


@pytest.mark.parametrize("name", ALL)
def test_tcs_zero_ratios_are_an_exact_noop(name):
    model = build(name)
    x = images(name, 3)
    ref = run(model, x)
    n = vit_blocks(model).num_blocks
    handle = enable_tcs(model, {"fc1": [0.0] * n, "fc2": [0.0] * n})
    assert handle.modules == {}
    assert torch.equal(run(model, x), ref)
    disable_tcs(model)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("scope", ["image", "batch"])
@pytest.mark.parametrize("backend", ["c", "torch"])
def test_tcs_dense_equals_masked(name, scope, backend):
    model = build(name)
    x = images(name, 4)
    ref = run(model, x)
    outs = {}
    for form, hidden in (("masked", "all"), ("dense", "all"), ("dense", "kept")):
        enable_tcs(model, _schedule(model), scope=scope, form=form, hidden=hidden, backend=backend)
        outs[form, hidden] = run(model, x)
        disable_tcs(model)
    assert _max_diff(outs["dense", "all"], outs["masked", "all"]) <= 1e-5
    assert _max_diff(outs["dense", "kept"], outs["masked", "all"]) <= 1e-5
    assert _max_diff(outs["masked", "all"], ref) > 1e-3
    assert torch.equal(run(model, x), ref)  # disabled: the original again


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("backend", ["c", "torch"])
def test_per_image_selection_is_batch_invariant(name, backend):
    """An image's channels and output are the same alone and in any batch;
    per-batch selection (the reference code) lacks that property."""
    model = build(name)
    x = images(name, 5)
    per = {}
    for scope in ("image", "batch"):
        handle = enable_tcs(model, _schedule(model), scope=scope, backend=backend)
        handle.record = True
        full = run(model, x)
        sel_full = {b: s for b, s in handle.selections.items()}
        swapped = run(model, x.flip(0)).flip(0)  # another batch order
        alone, same_sel = [], True
        for i in range(len(x)):
            alone.append(run(model, x[i : i + 1]))
            for b, (i1, i2) in handle.selections.items():
                f1, f2 = sel_full[b]
                same_sel &= torch.equal(i1, f1[i : i + 1] if scope == "image" else f1)
                same_sel &= torch.equal(i2, f2[i : i + 1] if scope == "image" else f2)
        per[scope] = (full, torch.cat(alone), swapped, same_sel)
        disable_tcs(model)
    full, alone, swapped, same = per["image"]
    assert same
    assert _max_diff(full, alone) <= 1e-5 and _max_diff(full, swapped) <= 1e-5
    full, alone, swapped, same = per["batch"]
    assert not same
    assert _max_diff(full, alone) > 1e-3


def test_tcs_keep_counts_and_seeds():
    model = build("vit")
    x = images("vit", 3)
    handle = enable_tcs(model, _schedule(model, 0.3, 0.9), seed=1)
    handle.record = True
    rng = torch.get_rng_state()
    out1 = run(model, x)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is untouched
    for i1, i2 in handle.selections.values():
        assert i1.shape == (3, tcs_keep(H.HIDDEN, 0.3)) == (3, 22)
        assert i2.shape == (3, tcs_keep(64, 0.9)) == (3, 6)
    assert torch.equal(run(model, x), out1)  # fixed samples: reproducible
    disable_tcs(model)
    enable_tcs(model, _schedule(model, 0.3, 0.9), seed=1)
    assert torch.equal(run(model, x), out1)
    disable_tcs(model)
    enable_tcs(model, _schedule(model, 0.3, 0.9, ratio=0.2), seed=2)
    assert not torch.equal(run(model, x), out1)
    disable_tcs(model)
    handle = enable_tcs(model, _schedule(model, 0.3, 0.9, ratio=0.2), resample="call")
    first, second = run(model, x), run(model, x)
    assert not torch.equal(first, second)
    handle.reseed()
    assert torch.equal(run(model, x), first)


def _expected_selection(name, r1, r2, ratio, score, weights, scope, backend):
    """Eq. 6 / Eq. 7 re-implemented from the eager attention map and the
    LayerNorm output of the last block (TCS on that block only)."""
    model = build(name)
    model.config._attn_implementation = "eager"
    x = images(name, 3)
    vm = vit_blocks(model)
    last = vm.blocks[-1]
    seen = {}
    hook = last.mlp.register_forward_pre_hook(lambda m, args: seen.setdefault("z", args[0]))
    with torch.no_grad():
        kw = {"output_attentions": True}
        if name == "vit_mae":
            kw["noise"] = torch.arange(16.0).expand(3, 16)
        out = model(pixel_values=x, **kw)
    hook.remove()
    z = seen["z"]
    n = vit_blocks(model).num_blocks
    sched = {"fc1": [0.0] * (n - 1) + [r1], "fc2": [0.0] * (n - 1) + [r2], "sample_ratio": ratio}
    handle = enable_tcs(model, sched, score=score, weights=weights, scope=scope, backend=backend)
    handle.record = True
    run(model, x)
    got = handle.selections[n - 1]
    sample = handle.modules[n - 1]._samples[(z.shape[1], 0)]
    patches = z.shape[1] - vm.prefix
    assert len(sample) == max(1, math.floor(patches * ratio)) == len(set(sample.tolist()))
    assert int(sample.min()) >= vm.prefix
    attn = out.attentions[-1][:, :, 0, :].mean(dim=1) if score == "eq6" else None

    def scores(v):
        mag = v[:, sample].abs()
        if score == "eq7":
            s = mag.mean(1)
        else:
            a = attn.mean(0, keepdim=True) if scope == "batch" else attn
            w = (a[:, sample, None] * mag).mean(1)
            if weights == "paper":
                s = 2.0 * v[:, 0].abs() + w
            else:
                p = v.shape[1] - 1
                s = 2.0 * v[:, 0].abs() / (1 + p) + w * p / (1 + p)
        return s.mean(0, keepdim=True) if scope == "batch" else s

    mlp = vit_blocks(model).blocks[-1].mlp
    k1, k2 = tcs_keep(z.shape[-1], r1), tcs_keep(mlp.fc2.in_features, r2)
    idx1 = torch.topk(scores(z), k1).indices.sort().values
    rows = idx1.expand(z.shape[0], -1)[:, None, :].expand(-1, z.shape[1], -1)
    zm = torch.zeros_like(z).scatter(2, rows, 1.0) * z
    hid = mlp.activation_fn(mlp.fc1(zm))
    idx2 = torch.topk(scores(hid), k2).indices.sort().values
    return got, (idx1, idx2)


@pytest.mark.parametrize(
    "name, score, weights, scope",
    [
        ("vit", "eq6", "paper", "image"),
        ("deit", "eq6", "normalized", "image"),
        ("dinov2", "eq6", "paper", "batch"),
        ("vit_mae", "eq7", "paper", "image"),
        ("vit", "eq6", "normalized", "batch"),
    ],
)
@pytest.mark.parametrize("backend", ["c", "torch"])
def test_tcs_selection_against_reference(name, score, weights, scope, backend):
    got, want = _expected_selection(name, 0.5, 0.75, 0.5, score, weights, scope, backend)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_tcs_refusals():
    swin = build("swin")
    with pytest.raises(ValueError, match="CLS"):
        enable_tcs(swin, _schedule(swin), score="eq6")
    model = build("vit")
    enable_tcs(model, _schedule(model))
    with pytest.raises(ValueError, match="already enabled"):
        enable_tcs(model, _schedule(model))
    disable_tcs(model)
    with pytest.raises(ValueError, match="12 blocks"):
        enable_tcs(model, "table11")
    with pytest.raises(ValueError, match="scope"):
        enable_tcs(model, _schedule(model), scope="dataset")
    swiglu = transformers.Dinov2Model(
        transformers.Dinov2Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=16,
            patch_size=4,
            use_swiglu_ffn=True,
        )  # fmt: skip
    )
    with pytest.raises(ValueError, match="SwiGLU"):
        enable_tcs(swiglu, {"fc1": [0, 0.5], "fc2": [0, 0.5]})


def test_tcs_keeps_state_dict_keys():
    model = build("vit")
    keys = list(model.state_dict())
    enable_tcs(model, _schedule(model))
    assert list(model.state_dict()) == keys
    disable_tcs(model)


# ----------------------------------------------------------------- accounting


def test_macs_match_realised_shapes():
    """toast_macs on the config equals MACs counted from the pruned modules."""
    model = build("vit")
    cfg = model.config
    sched = get_schedule(_schedule(model, 0.25, 0.5), 4)
    prune_heads(model, 0.5)
    enable_tcs(model, sched)
    n = (H.IMAGE // 4) ** 2 + 1
    total = 0.0
    for blk in vit_blocks(model).blocks:
        a, mlp = blk.attention, blk.block.mlp
        inner = a.q_proj.out_features
        total += n * H.HIDDEN * 3 * inner + 2 * n * n * inner + n * inner * H.HIDDEN
        r1, r2 = sched.fc1[blk.index], sched.fc2[blk.index]
        total += n * mlp.fc1.in_features * mlp.fc1.out_features * (2 - r1 - r2)
    report = toast_macs(cfg, head_sparsity=0.5, schedule=sched, num_classes=0)
    patch = (H.IMAGE // 4) ** 2 * 3 * 16 * H.HIDDEN
    assert math.isclose(report.macs - patch, total, rel_tol=1e-12)


# ------------------------------------------------------------ fine-tune, API


def _classifier():
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=5,
    )  # fmt: skip
    return transformers.ViTForImageClassification(cfg).eval()


def test_finetune_keeps_masks():
    model = _classifier()
    prune_heads(model, 0.5, form="masked")
    x = images("vit", 8)
    y = torch.arange(8) % 5
    before = vit_blocks(model).blocks[1].attention.q_proj.weight.detach().clone()
    losses = finetune(model, [(x, y), {"pixel_values": x, "labels": y}], steps=4, lr=1e-2)
    assert len(losses) == 4 and all(np.isfinite(losses))
    after = vit_blocks(model).blocks[1].attention.q_proj.weight.detach()
    pruned = before.abs().sum(dim=1) == 0
    assert pruned.sum() == 16 and (after[pruned] == 0).all()
    assert not torch.equal(after[~pruned], before[~pruned])
    assert not model.training


def test_compress_toast_vit():
    model = _classifier()
    x = images("vit", 6)
    y = torch.arange(6) % 5
    sched = {"fc1": [0, 0, 0.5], "fc2": [0, 0.5, 0.9]}
    model, report = toast.compress(
        model, [(x, y)], method="toast-vit", head_sparsity=0.5, schedule=sched, finetune_steps=2
    )
    assert isinstance(report, ToastVitReport) and report.method == "toast-vit"
    assert report.pruning.keep_counts == {1: 4, 2: 4}
    assert report.gmacs_after < report.gmacs_before and 0 < report.mac_reduction < 1
    assert report.params_after < report.params_before and len(report.finetune_losses) == 2
    assert "toast-vit" in report.to_markdown()
    assert model(pixel_values=x).logits.shape == (6, 5)
    with pytest.raises(ValueError, match="needs a loader"):
        toast.compress(_classifier(), method="toast-vit", finetune_steps=1)


@pytest.mark.parametrize("hidden", ["all", "kept"])
@pytest.mark.parametrize("form", ["dense", "masked"])
def test_finetune_through_tcs(hidden, form):
    """Gradients flow through the gathered (dense) or masked TCS matmuls."""
    model = _classifier()
    enable_tcs(model, {"fc1": [0, 0.5, 0.5], "fc2": [0, 0.5, 0.75]}, hidden=hidden, form=form)
    fc1 = vit_blocks(model).blocks[2].block.mlp.fc1
    before = fc1.weight.detach().clone()
    losses = finetune(model, [(images("vit", 4), torch.arange(4) % 5)], steps=2)
    assert all(np.isfinite(losses)) and not torch.equal(fc1.weight.detach(), before)
