"""TOAST Tables 1–3 (and Table 18's "Params."): the "Params." and "GFLOPs"
columns reproduced from architecture configs alone (no weights, no model).

Configs are those of the checkpoints the paper's code loads:

- DeiT-S: ``facebook/deit-small-patch16-224``, a ``ViTConfig`` (d = 384, 6
  heads, 12 layers, MLP 1536, patch 16, 224).
- DINO-B: ``facebook/dinov2-base`` (d = 768, 12 heads, 12 layers, patch 14,
  position grid 518 = 37², run at 224 → 257 tokens).
- ViT-L: ``google/vit-large-patch16-224`` (d = 1024, 16 heads, 24 layers).
- ViT-B: ``google/vit-base-patch16-224`` (d = 768, 12 heads, 12 layers).

The paper's code loads them with ``AutoModel`` (``head="base"``: ViT and DeiT
keep a randomly initialised pooler), which is what its totals count. The
paper's "s→e" approximates the output of block e from that of block s, i.e.
removes blocks s+1…e: toast's span ``(s + 1, e + 1)``.

Conventions (``toast.accounting``): "Params." of a compressed row is
``paper_params_removed`` (TOAST subtracts ``d² + d`` per removed block);
"GFLOPs" is ``MacReport.fvcore_gflops`` at batch 1 and 224×224.
"""

import pytest

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

from toast import accounting  # noqa: E402

PARAMS_TOL_M = 0.01  # millions
# The task allows 0.05 GFLOPs; every entry is within one unit of the printed
# second decimal, so hold the tighter bound.
GFLOPS_TOL = 0.01

CONFIGS = {
    "DeiT-S": lambda: transformers.ViTConfig(
        hidden_size=384,
        num_hidden_layers=12,
        num_attention_heads=6,
        intermediate_size=1536,
        patch_size=16,
        image_size=224,
    ),
    "DINO-B": lambda: transformers.Dinov2Config(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        mlp_ratio=4,
        patch_size=14,
        image_size=518,
    ),
    "ViT-L": lambda: transformers.ViTConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        patch_size=16,
        image_size=224,
    ),
    "ViT-B": lambda: transformers.ViTConfig(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        patch_size=16,
        image_size=224,
    ),
}

# (model, approximation, Params. [M], identity GFLOPs, linear GFLOPs)
TABLE_1 = [  # DeiT-S, ImageNet-1k
    ("DeiT-S", "2→4", -3.25, 4.15, 4.18),
    ("DeiT-S", "9→11", -3.25, 4.15, 4.18),
    ("DeiT-S", "0→1", -1.62, 4.56, 4.59),
    ("DeiT-S", "10→11", -1.62, 4.56, 4.59),
    ("DeiT-S", "original", 21.81, 4.97, 4.97),
]
TABLE_2 = [  # ImageNet-1k
    ("DeiT-S", "3→4, 9→11", -4.88, 3.74, 3.80),
    ("DeiT-S", "3→4, 9→10", -3.25, 4.15, 4.21),
    ("DeiT-S", "2→3", -1.62, 4.56, 4.59),
    ("DeiT-S", "10→11", -1.62, 4.56, 4.59),
    ("DeiT-S", "original", 21.81, 4.97, 4.97),
    ("DINO-B", "0→4", -26, 16.32, 16.47),
    ("DINO-B", "0→1, 2→3, 4→5", -19.5, 18.34, 18.80),
    ("DINO-B", "0→1, 2→3", -13, 20.37, 20.67),
    ("DINO-B", "0→1", -6.5, 22.39, 22.54),
    ("DINO-B", "5→6", -6.5, 22.39, 22.54),
    ("DINO-B", "original", 86.58, 24.42, 24.42),
    ("ViT-L", "2→4, 18→23", -80.83, 45.05, 45.47),
    ("ViT-L", "17→23", -69.28, 47.70, 47.90),
    ("ViT-L", "3→4, 19→23", -57.74, 50.34, 50.75),
    ("ViT-L", "3→4, 20→23", -46.19, 52.98, 53.39),
    ("ViT-L", "3→4, 21→23", -34.64, 55.62, 56.03),
    ("ViT-L", "7→8, 15→16", -23.09, 58.26, 58.67),
    ("ViT-L", "16→17, 22→23", -23.09, 58.26, 58.67),
    ("ViT-L", "3→4", -11.55, 60.90, 61.11),
    ("ViT-L", "22→23", -11.55, 60.90, 61.11),
    ("ViT-L", "original", 304.35, 63.54, 63.54),
]
TABLE_3 = [  # CIFAR-100F: same columns, some other approximations
    ("DeiT-S", "3→4, 9→11", -4.88, 3.74, 3.80),
    ("DeiT-S", "9→11", -3.25, 4.15, 4.18),
    ("DeiT-S", "8→9", -1.62, 4.56, 4.59),
    ("DeiT-S", "9→10", -1.62, 4.56, 4.59),
    ("DeiT-S", "original", 21.81, 4.97, 4.97),
    ("DINO-B", "0→4", -26, 16.32, 16.47),
    ("DINO-B", "0→1, 2→3, 4→5", -19.5, 18.34, 18.80),
    ("DINO-B", "0→1, 2→3", -13, 20.37, 20.67),
    ("DINO-B", "0→1", -6.5, 22.39, 22.54),
    ("DINO-B", "2→3", -6.5, 22.39, 22.54),
    ("DINO-B", "original", 86.58, 24.42, 24.42),
    ("ViT-L", "2→4, 18→23", -80.83, 45.05, 45.47),
    ("ViT-L", "17→23", -69.28, 47.70, 47.90),
    ("ViT-L", "3→4, 19→23", -57.74, 50.34, 50.75),
    ("ViT-L", "3→4, 20→23", -46.19, 52.98, 53.39),
    ("ViT-L", "20→23", -34.64, 55.62, 55.82),
    ("ViT-L", "3→4, 21→23", -34.64, 55.62, 56.03),
    ("ViT-L", "20→22", -23.09, 58.26, 58.47),
    ("ViT-L", "3→4, 21→22", -23.09, 58.26, 58.67),
    ("ViT-L", "20→21", -11.55, 60.90, 61.11),
    ("ViT-L", "21→22", -11.55, 60.90, 61.11),
    ("ViT-L", "original", 304.35, 63.54, 63.54),
]
TABLE_18 = [  # ViT-B "Params." (no GFLOPs column)
    ("ViT-B", "1→5", -25.99),
    ("ViT-B", "2→5", -19.49),
    ("ViT-B", "1→3", -13),
    ("ViT-B", "3→5", -13),
    ("ViT-B", "2→4", -13),
    ("ViT-B", "8→10", -13),
    ("ViT-B", "9→11", -13),
    ("ViT-B", "3→4", -6.5),
    ("ViT-B", "4→5", -6.5),
    ("ViT-B", "0→1", -6.5),
    ("ViT-B", "1→2", -6.5),
    ("ViT-B", "2→3", -6.5),
    ("ViT-B", "original", 86.39),
]

ROWS = (
    [("Table 1", *r) for r in TABLE_1]
    + [("Table 2", *r) for r in TABLE_2]
    + [("Table 3", *r) for r in TABLE_3]
)
ROW_IDS = [f"{t}-{m}-{a}" for t, m, a, *_ in ROWS]


def spans(approximation):
    """Toast spans of TOAST's "s→e, s'→e'" notation (removes blocks s+1…e)."""
    if approximation == "original":
        return []
    out = []
    for part in approximation.split(","):
        s, e = (int(v) for v in part.strip().split("→"))
        out.append((s + 1, e + 1))
    return out


def gflops(model, approximation, translator):
    report = accounting.macs(
        CONFIGS[model](), image_size=224, removed_spans=spans(approximation), translator=translator
    )
    return report.fvcore_gflops


def test_spans_follow_the_papers_block_numbering():
    """TOAST "s→e" (the tables' span notation) removes blocks s+1…e."""
    assert spans("2→4") == [(3, 5)]
    assert spans("3→4, 9→11") == [(4, 5), (10, 12)]


@pytest.mark.parametrize(("table", "model", "approx", "params", "_id", "_lin"), ROWS, ids=ROW_IDS)
def test_params_column(table, model, approx, params, _id, _lin, paper_record):
    """TOAST Tables 1–3, "Params.": the original row is the total of
    ``AutoModel`` (ViT/DeiT with pooler); other rows are the parameters
    removed, (#removed blocks) × (P_block − d² − d)."""
    cfg = CONFIGS[model]()
    if approx == "original":
        value = accounting.count_params_from_config(cfg, head="base") / 1e6
    else:
        value = -accounting.paper_params_removed(cfg, spans(approx)) / 1e6
    paper_record(f"TOAST {table}", f"{model} {approx}: Params. (M)", params, round(value, 3))
    assert abs(value - params) <= PARAMS_TOL_M, (table, model, approx, value)


@pytest.mark.parametrize(("table", "model", "approx", "_params", "ident", "lin"), ROWS, ids=ROW_IDS)
def test_gflops_columns(table, model, approx, _params, ident, lin, paper_record):
    """TOAST Tables 1–3, "Id. GFLOPs" and "Lin. GFLOPs": one 224×224 image,
    ``fvcore_gflops`` convention; a linear translator per span adds N·d²."""
    for translator, printed in (("identity", ident), ("linear", lin)):
        value = gflops(model, approx, translator)
        item = f"{model} {approx}: GFLOPs ({translator})"
        paper_record(f"TOAST {table}", item, printed, round(value, 3))
        assert abs(value - printed) <= GFLOPS_TOL, (table, model, approx, translator, value)


def test_gflops_round_to_the_printed_digits_except_three_dino_b_figures():
    """TOAST Tables 1–3, GFLOPs: every DeiT-S and ViT-L entry rounds to the
    printed value. Three DINO-B figures come out 0.005–0.009 above it: one
    block removed (22.3969 vs 22.39 identity, 22.5484 vs 22.54 linear; rows
    0→1, 2→3, 5→6) and three single-block spans (18.3459 vs 18.34,
    identity). No single convention found fits DINO-B's and ViT-L's totals
    to the last digit at once (ViT-L pins the softmax term at 2 FLOPs per
    score; DINO-B alone would want about 1.5), and the paper's counting
    code is not released."""
    off = set()
    for _, model, approx, _p, ident, lin in ROWS:
        removed = sum(stop - start for start, stop in spans(approx))
        for translator, printed in (("identity", ident), ("linear", lin)):
            if round(gflops(model, approx, translator), 2) != printed:
                off.add((model, removed, len(spans(approx)), translator))
    assert off == {
        ("DINO-B", 1, 1, "identity"),
        ("DINO-B", 1, 1, "linear"),
        ("DINO-B", 3, 3, "identity"),
    }


@pytest.mark.parametrize(("model", "approx", "params"), TABLE_18, ids=[r[1] for r in TABLE_18])
def test_vit_b_params_column(model, approx, params):
    """TOAST Table 18 (ViT-B), "Params.": same convention as Tables 1–3."""
    cfg = CONFIGS[model]()
    if approx == "original":
        value = accounting.count_params_from_config(cfg, head="base") / 1e6
    else:
        value = -accounting.paper_params_removed(cfg, spans(approx)) / 1e6
    assert abs(value - params) <= PARAMS_TOL_M, (approx, value)


def test_exact_count_of_a_two_block_span_removes_more_than_the_paper_says():
    """TOAST Table 1, 2→4 (−3.25M): the compressed model really holds one
    bias-free d×d translator, so it is 2·1,774,464 − 384² = 3,401,472
    parameters smaller (−3.40M); the paper subtracts d² + d per block."""
    cfg = CONFIGS["DeiT-S"]()
    total = accounting.count_params_from_config(cfg)
    linear = accounting.count_params_from_config(cfg, removed_spans=[(3, 5)], translator="linear")
    assert total - linear == 3_401_472
    assert accounting.paper_params_removed(cfg, [(3, 5)]) == 3_253_248


def test_gflops_depend_on_counts_of_removed_blocks_and_spans_only():
    """TOAST Table 2: rows removing the same number of blocks with the same
    number of spans have equal GFLOPs (e.g. ViT-L 7→8, 15→16 and 16→17,
    22→23: 58.26 / 58.67)."""
    a = gflops("ViT-L", "7→8, 15→16", "linear")
    b = gflops("ViT-L", "16→17, 22→23", "linear")
    assert a == b
