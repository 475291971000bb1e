"""Analytic MAC and parameter counts (toast.accounting) against independent
references: ``sum(p.numel())`` of instantiated tiny models and torch's
``FlopCounterMode`` (2 FLOPs per multiply-accumulate, eager attention)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

from torch import nn  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import toast  # noqa: E402
from tests._helpers.kinds import translator_of  # noqa: E402
from toast import accounting  # noqa: E402
from toast.core import Translator  # noqa: E402
from toast.core.kinds import KINDS, Kind, kind_names  # noqa: E402
from toast.translators import translator_module  # noqa: E402

D = 32
LAYERS = 4
SPAN = (1, 3)  # blocks 1 and 2 of 4
_VISION = {"hidden_size": D, "num_hidden_layers": LAYERS, "num_attention_heads": 4}
_SMALL = {**_VISION, "image_size": 16, "patch_size": 4}


def _config(name):
    """A fresh tiny config (replace_spans edits the config of its model)."""
    t = transformers
    return {
        "vit": lambda: t.ViTConfig(**_SMALL, intermediate_size=64, num_labels=5),
        # no QKV bias, a non-square image and a pooler narrower than d
        "vit_rect": lambda: t.ViTConfig(
            **_VISION,
            image_size=(16, 12),
            patch_size=4,
            intermediate_size=48,
            qkv_bias=False,
            pooler_output_size=24,
            num_labels=3,
        ),
        "deit": lambda: t.DeiTConfig(**_SMALL, intermediate_size=64, num_labels=5),
        "dinov2": lambda: t.Dinov2Config(**_SMALL, mlp_ratio=2, num_labels=5),
        "dinov2_swiglu": lambda: t.Dinov2Config(
            **_SMALL, mlp_ratio=3, use_swiglu_ffn=True, use_mask_token=False, num_labels=5
        ),
        "clip_vision": lambda: t.CLIPVisionConfig(**_SMALL, intermediate_size=64),
        "bert": lambda: t.BertConfig(
            **_VISION,
            vocab_size=97,
            intermediate_size=64,
            max_position_embeddings=40,
            type_vocab_size=2,
            num_labels=3,
        ),
    }[name]()


FAMILIES = ["vit", "vit_rect", "deit", "dinov2", "dinov2_swiglu", "clip_vision", "bert"]
CASES = [(f, h) for f in FAMILIES for h in ("base", "none", "classifier")]
CASES = [c for c in CASES if c != ("clip_vision", "classifier")]
IDS = [f"{f}-{h}" for f, h in CASES]
SEQ = 11


def _build(family, head, seed=0):
    """The model class each ``head`` names, with eager attention (so that
    FlopCounterMode sees the attention matmuls)."""
    cfg = _config(family)
    torch.manual_seed(seed)
    t = transformers
    if head == "base":
        model = t.AutoModel.from_config(cfg)
    elif head == "classifier":
        model = {
            "vit": t.ViTForImageClassification,
            "deit": t.DeiTForImageClassification,
            "dinov2": t.Dinov2ForImageClassification,
            "bert": t.BertForSequenceClassification,
        }[family.split("_")[0]](cfg)
    elif family.startswith("vit"):
        model = t.ViTModel(cfg, add_pooling_layer=False)
    elif family == "deit":
        model = t.DeiTModel(cfg, add_pooling_layer=False)
    elif family == "bert":
        model = t.BertModel(cfg, add_pooling_layer=False)
    else:  # DINOv2 and CLIP vision have no pooler to drop
        model = t.AutoModel.from_config(cfg)
    model.set_attn_implementation("eager")
    return model.eval()


def _inputs(family, batch, image=None):
    gen = torch.Generator().manual_seed(1)
    if family == "bert":
        return {"input_ids": torch.randint(0, 97, (batch, SEQ), generator=gen)}
    cfg = _config(family)
    h, w = accounting.pair(image if image is not None else cfg.image_size)
    return {"pixel_values": torch.randn(batch, 3, h, w, generator=gen)}


def _counter_flops(model, inputs):
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(**inputs)
    return counter.get_total_flops()


def _numel(model):
    return sum(p.numel() for p in model.parameters())


def _size_kw(family):
    return {"seq_len": SEQ} if family == "bert" else {}


@pytest.mark.parametrize(("family", "head"), CASES, ids=IDS)
def test_config_param_count_equals_numel_of_the_built_model(family, head):
    model = _build(family, head)
    assert accounting.count_params_from_config(_config(family), head=head) == _numel(model)


@pytest.mark.parametrize(("family", "head"), CASES, ids=IDS)
def test_config_macs_are_half_the_flop_counter_total(family, head):
    model = _build(family, head)
    report = accounting.macs(_config(family), head=head, batch=2, **_size_kw(family))
    assert 2 * report.macs == _counter_flops(model, _inputs(family, 2))


@pytest.mark.parametrize(("family", "head"), CASES, ids=IDS)
def test_model_report_equals_config_report(family, head):
    model = _build(family, head)
    from_model = accounting.macs(model, batch=3, **_size_kw(family))
    assert from_model == accounting.macs(_config(family), head=head, batch=3, **_size_kw(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_with_a_linear_translator_matches_counter_and_prediction(family):
    head = "base"
    model = _build(family, head)
    toast.io.replace_spans(model, [SPAN], [nn.Linear(D, D, bias=False)])
    report = accounting.macs(model, batch=2, **_size_kw(family))
    assert 2 * report.macs == _counter_flops(model, _inputs(family, 2))
    predicted = accounting.macs(
        _config(family),
        head=head,
        batch=2,
        removed_spans=[SPAN],
        translator="linear",
        **_size_kw(family),
    )
    assert report == predicted
    assert len(report.per_block) == LAYERS - 2
    assert report.translators[0].dense == 2 * report.tokens * D * D
    params = accounting.count_params_from_config(
        _config(family), head=head, removed_spans=[SPAN], translator="linear"
    )
    assert params == _numel(model)


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_translator_kind_is_predicted_from_the_config(kind):
    model = _build("deit", "none")
    translators = [translator_of(kind, D, seed) for seed in (0, 1)]
    toast.io.replace_spans(model, [(0, 1), SPAN], translators)
    kw = {"head": "none", "removed_spans": [(0, 1), SPAN], "translator": kind}
    assert accounting.count_params_from_config(_config("deit"), **kw) == _numel(model)
    report = accounting.macs(model, batch=2)
    assert report == accounting.macs(_config("deit"), batch=2, **kw)
    assert 2 * report.macs == _counter_flops(model, _inputs("deit", 2))


@pytest.mark.parametrize("kind", list(KINDS))
def test_translator_params_are_those_of_the_module(kind):
    assert accounting.translator_params(kind, D) == _numel(translator_of(kind, D)), kind


def test_the_accounting_kind_lists_are_the_table():
    assert accounting.TRANSLATOR_KINDS == tuple(KINDS)
    assert accounting.arch.HADAMARD_KINDS == kind_names(hadamard=True)


def test_a_kind_added_to_the_table_is_accepted_and_counted(monkeypatch):
    monkeypatch.setitem(KINDS, "made_up", Kind("made_up", "linear", bias=True))
    weight, bias = np.eye(D), np.full(D, 0.5)
    made_up = translator_module(Translator("made_up", weight, bias, 1.0, D, "none"))
    model = _build("deit", "none")
    toast.io.replace_spans(model, [SPAN], [made_up])
    kw = {"head": "none", "removed_spans": [SPAN], "translator": "made_up"}
    assert accounting.count_params_from_config(_config("deit"), **kw) == _numel(model)
    assert accounting.macs(model, batch=2) == accounting.macs(_config("deit"), batch=2, **kw)
    assert accounting.translator_params("made_up", D) == D * D + D


def test_dinov2_counts_follow_the_input_resolution_not_the_config_grid():
    model = _build("dinov2", "base")
    report = accounting.macs(model, image_size=24, batch=2)
    assert report.tokens == (24 // 4) ** 2 + 1
    assert 2 * report.macs == _counter_flops(model, _inputs("dinov2", 2, image=24))


def test_block_params_equal_numel_of_one_block():
    for family in FAMILIES:
        model = _build(family, "none")
        block = toast.hf.find_blocks(model).blocks[0]
        assert accounting.block_params_from_config(_config(family)) == _numel(block), family


def test_removing_blocks_with_identity_subtracts_whole_blocks():
    cfg = _config("vit")
    full = accounting.macs(cfg)
    cut = accounting.macs(cfg, removed_spans=[(0, 1), SPAN], translator="identity")
    assert full.total.fvcore_flops - cut.total.fvcore_flops == 3 * full.per_block[0].fvcore_flops
    assert full.macs - cut.macs == 3 * full.per_block[0].macs


def test_each_linear_span_adds_tokens_times_d_squared():
    cfg = _config("dinov2")
    ident = accounting.macs(cfg, removed_spans=[(0, 1), SPAN])
    linear = accounting.macs(cfg, removed_spans=[(0, 1), SPAN], translator="linear")
    assert linear.macs - ident.macs == 2 * ident.tokens * D * D


def test_counts_scale_linearly_with_the_batch():
    one = accounting.macs(_config("bert"), seq_len=SEQ)
    five = accounting.macs(_config("bert"), seq_len=SEQ, batch=5)
    assert five.total == one.total.scaled(5)
    assert five.gflops == pytest.approx(5 * one.gflops)


def test_conventions_weight_the_components():
    c = accounting.Counts(dense=1, attention=2, softmax=3, norm=4)
    assert (c.macs, c.flops, c.fvcore_flops) == (3, 6, 1 + 2 * 2 + 2 * 3 + 5 * 4)
    report = accounting.macs(_config("vit"))
    assert report.gflops == pytest.approx(2 * report.gmacs)
    assert report.gmacs == report.macs / 1e9


def test_attention_terms_are_quadratic_in_tokens():
    report = accounting.macs(_config("clip_vision"))
    n = report.tokens
    block = report.per_block[0]
    assert (block.attention, block.softmax, block.norm) == (2 * n * n * D, 4 * n * n, 2 * n * D)


def test_paper_params_removed_is_the_affine_saving_for_one_block_spans():
    cfg = _config("vit")
    full = accounting.count_params_from_config(cfg)
    spans = [(0, 1), (2, 3)]
    affine = accounting.count_params_from_config(cfg, removed_spans=spans, translator="affine")
    assert accounting.paper_params_removed(cfg, spans) == full - affine


def test_paper_params_removed_understates_multi_block_spans_by_extra_translators():
    # TOAST subtracts d² + d per removed block; a span has one translator.
    cfg = _config("vit")
    full = accounting.count_params_from_config(cfg)
    affine = accounting.count_params_from_config(cfg, removed_spans=[(0, 3)], translator="affine")
    understated = (full - affine) - accounting.paper_params_removed(cfg, [(0, 3)])
    assert understated == 2 * (D * D + D)


@pytest.mark.parametrize("spans", [[(2, 1)], [(-1, 1)], [(0, LAYERS + 1)], [(0, 2), (1, 3)]])
def test_invalid_spans_are_rejected(spans):
    with pytest.raises(ValueError):
        accounting.macs(_config("vit"), removed_spans=spans)
    with pytest.raises(ValueError):
        accounting.count_params_from_config(_config("vit"), removed_spans=spans)


def test_unknown_translator_and_head_are_rejected():
    with pytest.raises(ValueError, match="translator must be one of 'identity', .*; got 'conv'"):
        accounting.macs(_config("vit"), translator="conv")
    with pytest.raises(ValueError, match="head must be one of 'base', 'none', 'classifier'"):
        accounting.count_params_from_config(_config("vit"), head="pooled")
    with pytest.raises(ValueError, match=r"batch must be an int in \[1, inf\); got 0"):
        accounting.macs(_config("vit"), batch=0)
    with pytest.raises(ValueError, match="CLIP"):
        accounting.count_params_from_config(_config("clip_vision"), head="classifier")


def test_unsupported_model_type_is_rejected():
    cfg = transformers.LlamaConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ValueError, match="llama"):
        accounting.macs(cfg, seq_len=4)


def test_text_model_needs_a_sequence_length():
    with pytest.raises(ValueError, match="seq_len"):
        accounting.macs(_config("bert"))
    with pytest.raises(ValueError, match="seq_len"):
        accounting.macs(_config("bert"), seq_len=41)


def test_a_model_is_counted_as_it_is():
    model = _build("vit", "none")
    with pytest.raises(ValueError, match="as it is"):
        accounting.macs(model, removed_spans=[SPAN])


def test_per_token_heads_are_refused():
    model = transformers.BertForMaskedLM(_config("bert"))
    with pytest.raises(ValueError, match="per-token"):
        accounting.macs(model, seq_len=SEQ)


def test_translator_of_an_unknown_structure_is_refused():
    model = _build("vit", "none")
    toast.io.replace_spans(model, [SPAN], [nn.Conv1d(D, D, 1)])
    with pytest.raises(TypeError, match="Conv1d"):
        accounting.macs(model)


def test_macs_returns_a_mac_report_only():
    """One return type: ToaSt's pruned-ViT convention is
    toast.methods.heads.toast_macs."""
    assert isinstance(toast.macs(_config("vit")), accounting.MacReport)
    with pytest.raises(TypeError, match="head_sparsity"):
        accounting.macs(_config("vit"), head_sparsity=0.9)
    import toast.methods.heads as toast_vit
    from toast.methods.heads.macs import toast_macs

    assert toast_vit.toast_macs is toast_macs


@pytest.mark.parametrize(("value", "expected"), [(224, (224, 224)), ((16, 14), (16, 14))])
def test_pair_reads_square_and_rectangular_sizes(value, expected):
    assert accounting.pair(value) == expected
    assert accounting.pair(list(value) if isinstance(value, tuple) else value) == expected


def test_pair_refuses_other_lengths():
    with pytest.raises(ValueError, match="pair"):
        accounting.pair((1, 2, 3))


# -- the "linear" convention: nn.Linear layers only, toast.search's macs= target


def _linear_per_row(model, inside=None):
    """Σ in × out over the ``nn.Linear`` layers (of ``inside``, default all):
    one row's MACs through every one of them."""
    modules = (inside or model).modules()
    return sum(m.in_features * m.out_features for m in modules if isinstance(m, nn.Linear))


def test_linear_convention_is_every_linear_layer_once_per_token():
    model = _build("vit", "none")  # no pooler or classifier: every layer sees every token
    tokens = (16 // 4) ** 2 + 1  # patches and CLS
    report = toast.macs(model, convention="linear")
    assert report.convention == "linear"
    assert report.macs == tokens * _linear_per_row(model)
    assert report.tokens == tokens


def test_linear_convention_of_a_text_model_follows_seq_len_and_batch():
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, vocab_size=97,
        )
    ).eval()  # fmt: skip
    report = toast.macs(model, convention="linear", seq_len=SEQ, batch=3)
    assert report.macs == 3 * SEQ * _linear_per_row(model)
    assert len(report.per_block) == LAYERS
    first_block = model.model.layers[0]
    assert report.per_block[0].dense == 3 * SEQ * _linear_per_row(model, first_block)


def test_linear_convention_puts_pooled_heads_outside_the_blocks():
    model = _build("vit", "classifier")  # the classifier sees the CLS token only
    report = toast.macs(model, convention="linear")
    tokens = (16 // 4) ** 2 + 1
    blocks = tokens * sum(_linear_per_row(model, b) for b in toast.hf.find_blocks(model).blocks)
    assert report.head.dense == _linear_per_row(model, model.classifier)
    assert report.macs == blocks + report.head.dense


def test_linear_convention_counts_translators_apart():
    model = _build("vit", "none")
    toast.io.replace_spans(model, [SPAN], [nn.Linear(D, D, bias=False)])
    report = toast.macs(model, convention="linear")
    tokens = (16 // 4) ** 2 + 1
    assert len(report.per_block) == LAYERS - (SPAN[1] - SPAN[0])
    assert [t.dense for t in report.translators] == [tokens * D * D]


def test_linear_convention_needs_a_model_and_takes_no_prediction():
    with pytest.raises(TypeError, match="not its config"):
        toast.macs(_config("vit"), convention="linear")
    with pytest.raises(ValueError, match="convention"):
        toast.macs(_config("vit"), convention="fvcore")
    with pytest.raises(ValueError, match="as it is"):
        toast.macs(_build("vit", "none"), convention="linear", removed_spans=[SPAN])
