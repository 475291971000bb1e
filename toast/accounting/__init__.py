"""Analytic multiply-accumulate (MAC) and parameter counts of transformer
encoders, from a Hugging Face config alone or from a (patched) model.

Supported families (``config.model_type``): ViT (``"vit"``), DeiT
(``"deit"``), DINOv2 (``"dinov2"``), the CLIP vision tower
(``"clip_vision_model"``) and BERT (``"bert"``).

Nothing here instantiates a model or touches weights: a config is enough to
predict the cost of the original model and of a compressed one (``removed_spans``
replaced by one translator each), which is how the "Params." and "GFLOPs"
columns of TOAST's tables are reproduced (``tests/paper``).

**Spans** are toast's: ``(start, stop)`` removes ``blocks[start:stop]`` and puts
one translator in their place (TOAST's "s→e" is ``(s + 1, e + 1)``).

**What is counted** (:class:`Counts`, per forward pass of ``batch`` inputs):

- ``dense``: multiply-accumulates of the weight matmuls: every ``nn.Linear``
  (Q, K, V and output projections, the MLP, pooler, classifier, translators)
  and the patch-embedding convolution. Biases are not counted.
- ``attention``: multiply-accumulates of ``Q·Kᵀ`` and ``A·V``: ``2·N²·d`` per
  block and input (``N`` tokens, ``d = heads × head_dim``).
- ``softmax``: attention scores, ``heads·N²`` per block and input.
- ``norm``: elements normalised by a LayerNorm.

GELU, residual additions, LayerScale, dropout, position-embedding
interpolation and other element-wise work are not counted.

**Conventions** (:class:`MacReport` properties):

- ``macs`` / ``gmacs``: ``dense + attention``, matmul multiply-accumulates only.
- ``gflops``: ``2 × macs`` (one multiply and one add), the convention of
  ``torch.utils.flop_counter.FlopCounterMode``; with eager attention it equals
  that counter's total exactly (``tests/test_accounting.py``).
- ``fvcore_gflops``: the convention of TOAST's "GFLOPs" columns (the paper says
  fvcore): one FLOP per multiply-accumulate of linear layers and the patch
  convolution (fvcore's ``1 MAC = 1 FLOP``), five per LayerNorm element
  (fvcore's norm handle with an affine), and for scaled-dot-product attention
  two FLOPs per multiply-accumulate of ``Q·Kᵀ`` and ``A·V`` plus two per softmax
  score. It was found by fitting TOAST Tables 1–3 (the paper's
  counting code is not released): with ``head="base"`` (``AutoModel``: ViT and
  DeiT with their pooler) at 224×224 it reproduces every DeiT-S and ViT-L
  GFLOPs entry to the printed two decimals (4.97, 4.56/4.59, …, 63.54,
  60.90/61.11, …, 45.05/45.47) and every DINO-B entry to within 0.0085
  (24.42, 22.39/22.54, …, 16.32/16.47; three DINO-B entries land 0.005–0.009
  above the printed value). Counting attention as plain MACs (``2·N²·d``)
  instead gives DeiT-S 4.61, not 4.97.

ToaSt's "GFLOPs" (head-dimension pruning and Token Channel Selection on
ViTs) are a third convention, matmul MACs with pruned head widths and TCS
fractions; they live with that method, in
:func:`toast.methods.heads.toast_macs`.

**Parameters**: :func:`count_params_from_config` is the exact count
(``sum(p.numel())``) of the model a config builds, with ``head``:

- ``"base"``: what ``AutoModel.from_config`` builds (``ViTModel`` and
  ``DeiTModel`` with their pooler, ``Dinov2Model``, ``CLIPVisionModel``,
  ``BertModel`` with its pooler);
- ``"none"``: the encoder without a pooler (``add_pooling_layer=False``);
- ``"classifier"``: ``AutoModelForImageClassification`` /
  ``AutoModelForSequenceClassification`` (``config.num_labels`` classes).

A compressed model has one translator per span: identity 0 parameters, linear
``d²`` (toast's translator without a bias), affine ``d² + d``.
:func:`paper_params_removed` is TOAST's own "Params." arithmetic, which
subtracts ``d² + d`` per *removed block* rather than per span.

**Where it lives**: the MAC counts (:class:`Counts`, :class:`MacReport`,
:func:`macs`) are here; the parameter counts in :mod:`toast.accounting.params`
and what both read from a config (the architecture's sizes, the translator
kinds and heads they accept) in :mod:`toast.accounting.arch`. Every public
name of the package is importable from ``toast.accounting``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING, Any

from toast._validation import Interval, Options, check
from toast.accounting.arch import (
    TRANSLATOR_KINDS,
    Arch,
    Head,
    TranslatorKind,
    arch_of,
    check_head,
    check_translator,
    pair,
)
from toast.accounting.params import (
    block_params_from_config,
    count_params_from_config,
    paper_params_removed,
    translator_params,
)
from toast.core.kinds import kind_entry
from toast.spans import validate_spans

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

__all__ = [
    "MAC_CONVENTIONS",
    "TRANSLATOR_KINDS",
    "Counts",
    "MacReport",
    "block_params_from_config",
    "count_params_from_config",
    "macs",
    "pair",
    "paper_params_removed",
    "translator_params",
]

#: What :func:`macs` counts: ``"all"`` the matmuls (linear layers, patch
#: embedding, attention products; analytic), ``"linear"`` the ``nn.Linear``
#: layers alone (counted by hooks; ``toast.search``'s ``macs=`` target).
MAC_CONVENTIONS: tuple[str, ...] = ("all", "linear")

# Model classes whose head runs on every token (or reshapes the batch): the
# head MACs of :func:`macs` assume one pooled vector per input, so refuse.
_PER_TOKEN_HEADS = (
    "MaskedLM", "MaskedImageModeling", "TokenClassification", "QuestionAnswering", "CausalLM",
    "LMHead", "PreTraining", "MultipleChoice", "Backbone",
)  # fmt: skip


@dataclass(frozen=True)
class Counts:
    """Operation counts of one part of a model, for a whole batch.

    ``dense`` and ``attention`` are multiply-accumulates (see the module
    docstring for what each covers), ``softmax`` the number of attention
    scores and ``norm`` the number of LayerNorm-normalised elements.
    """

    dense: int = 0
    attention: int = 0
    softmax: int = 0
    norm: int = 0

    @property
    def macs(self) -> int:
        """Matmul multiply-accumulates: ``dense + attention``."""
        return self.dense + self.attention

    @property
    def flops(self) -> int:
        """``2 × macs``: FlopCounterMode's convention (norms and softmax not counted)."""
        return 2 * self.macs

    @property
    def fvcore_flops(self) -> int:
        """TOAST's tables' (fvcore-style) convention:
        ``dense + 2·attention + 2·softmax + 5·norm``."""
        return self.dense + 2 * self.attention + 2 * self.softmax + 5 * self.norm

    def __add__(self, other: Counts) -> Counts:
        if not isinstance(other, Counts):
            return NotImplemented
        return Counts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __radd__(self, other: Any) -> Counts:
        # lets sum() start from 0
        if other == 0:
            return self
        return NotImplemented

    def scaled(self, factor: int) -> Counts:
        """These counts times ``factor`` (e.g. a batch size)."""
        return Counts(*(v * factor for v in astuple(self)))


@dataclass(frozen=True)
class MacReport:
    """Counts of one forward pass, part by part.

    ``embedding`` is the patch-embedding convolution (vision) plus any
    LayerNorm before the first block (CLIP's ``pre_layrnorm``, BERT's
    embedding norm); ``per_block`` holds one entry per original block still
    in the model, in order; ``translators`` one entry per translator (span),
    in order; ``final_norm`` the norm after the last block; ``head`` the
    pooler, classifier or projection. ``tokens`` is the sequence length ``N``
    seen by every block and ``batch`` the number of inputs counted.
    """

    embedding: Counts
    per_block: tuple[Counts, ...]
    translators: tuple[Counts, ...]
    final_norm: Counts
    head: Counts
    tokens: int
    batch: int
    convention: str = "all"

    @property
    def total(self) -> Counts:
        """All parts summed."""
        return (
            self.embedding
            + sum(self.per_block, Counts())
            + sum(self.translators, Counts())
            + self.final_norm
            + self.head
        )

    @property
    def macs(self) -> int:
        """Matmul multiply-accumulates of the whole forward pass."""
        return self.total.macs

    @property
    def gmacs(self) -> float:
        """``macs / 1e9``."""
        return self.macs / 1e9

    @property
    def gflops(self) -> float:
        """``2 × macs / 1e9``: torch's FlopCounterMode convention."""
        return self.total.flops / 1e9

    @property
    def fvcore_gflops(self) -> float:
        """GFLOPs in the fvcore-style convention of TOAST's tables (see the
        module docstring)."""
        return self.total.fvcore_flops / 1e9


def _block_counts(a: Arch, n: int) -> Counts:
    d, f = a.hidden, a.ffn
    projections = 4 * n * d * d
    mlp = n * (3 * d * f if a.swiglu else 2 * d * f)
    return Counts(
        dense=projections + mlp,
        attention=2 * n * n * d,
        softmax=a.heads * n * n,
        norm=2 * n * d,
    )


def _embedding_counts(a: Arch, n: int, image: tuple[int, int] | None) -> Counts:
    d = a.hidden
    if a.family == "bert":
        return Counts(norm=n * d)
    assert image is not None
    conv = a.patches(image) * a.channels * a.patch[0] * a.patch[1] * d
    pre_norm = n * d if a.family == "clip_vision" else 0
    return Counts(dense=conv, norm=pre_norm)


def _final_norm_counts(a: Arch, n: int) -> Counts:
    if a.family == "bert":
        return Counts()
    # CLIP's post_layernorm normalises the pooled CLS token only.
    return Counts(norm=a.hidden if a.family == "clip_vision" else n * a.hidden)


def _head_counts(a: Arch, head: str) -> Counts:
    d = a.hidden
    pooler = d * a.pooler_out if a.family in ("vit", "deit", "bert") else 0
    if head == "none":
        return Counts()
    if head == "base":
        return Counts(dense=pooler)
    width = 2 * d if a.family == "dinov2" else d
    classifier = width * a.num_labels
    return Counts(dense=classifier + (pooler if a.family == "bert" else 0))


def _translator_counts(kind: str, d: int, n: int) -> Counts:
    dense, norm = kind_entry(kind).macs(d)
    return Counts(dense=n * dense, norm=n * norm)


def _module_counts(module: nn.Module, n: int) -> Counts:
    """Counts of a translator module applied to ``n`` token vectors."""
    from torch import nn

    from toast.translators import DiagonalMap

    dense = norm = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            dense += n * sub.in_features * sub.out_features
        elif isinstance(sub, nn.LayerNorm):
            size = 1
            for v in sub.normalized_shape:
                size *= int(v)
            norm += n * size
        elif isinstance(sub, DiagonalMap):
            continue  # element-wise
        elif any(True for _ in sub.parameters(recurse=False)):
            raise TypeError(
                f"cannot count the operations of a translator containing "
                f"{type(sub).__name__}; toast counts Linear, LayerNorm and DiagonalMap"
            )
    return Counts(dense=dense, norm=norm)


def _tokens(a: Arch, image_size: Any, seq_len: int | None) -> tuple[int, tuple[int, int] | None]:
    if a.vision:
        image = pair(image_size) if image_size is not None else a.grid_image
        if image[0] < a.patch[0] or image[1] < a.patch[1]:
            raise ValueError(f"image_size {image} is smaller than the patch {a.patch}")
        return a.patches(image) + a.prefix, image
    if seq_len is None:
        raise ValueError(f"a {a.family} model needs seq_len (the number of tokens per input)")
    check("seq_len", seq_len, Interval(int, 1, a.max_positions))
    return int(seq_len), None


def macs(
    model_or_config: Any,
    *,
    image_size: int | tuple[int, int] | None = None,
    seq_len: int | None = None,
    batch: int = 1,
    removed_spans: Sequence[tuple[int, int]] = (),
    translator: TranslatorKind | str = "identity",
    head: Head | str | None = None,
    blocks: str | None = None,
    convention: str = "all",
    example: Any = None,
) -> MacReport:
    """Analytic operation counts of one forward pass (see the module
    docstring for what is counted and the GMACs / GFLOPs conventions).

    ``model_or_config`` is either a ``transformers`` config (nothing is
    instantiated) or an ``nn.Module`` built from one, possibly patched by
    :func:`toast.io.replace_spans`: then the blocks and translators actually in
    its block list are counted (each translator by its ``Linear`` and
    ``LayerNorm`` layers), and its pooler, classifier or projection from the
    ``nn.Linear`` layers outside the block list.

    ``image_size`` is the input resolution of vision models (default
    ``config.image_size``; DINOv2 checkpoints say 518 but run at 224);
    ``seq_len`` the token count of text models (required). For a config,
    ``removed_spans`` (toast spans ``(start, stop)``) and ``translator``
    (:data:`TRANSLATOR_KINDS`) predict a compressed model, and ``head``
    (default ``"base"``) chooses the model class as in
    :func:`count_params_from_config`. ``blocks`` names a model's block list
    when :func:`toast.hf.find_blocks` cannot find it alone.

    ``convention="linear"``: the ``nn.Linear`` layers only, by hooks on one
    forward of a model of any family (``example``, else an input of
    ``image_size`` or ``seq_len``), as ``toast.search``'s ``macs=`` target
    counts (:mod:`toast.linear_macs`). ToaSt's is :func:`toast.methods.heads.toast_macs`.
    """
    batch = check("batch", batch, Interval(int, 1, None))
    check("convention", convention, Options(MAC_CONVENTIONS))
    check_translator(translator)
    if convention == "linear":
        if removed_spans or translator != "identity" or head is not None:
            raise ValueError("convention='linear' counts a model as it is: pass no spans or head")
        return _linear_report(model_or_config, image_size, seq_len, batch, blocks, example)
    if hasattr(model_or_config, "named_modules"):  # an nn.Module (configs have no modules)
        if removed_spans or translator != "identity" or head is not None:
            raise ValueError(
                "removed_spans, translator and head describe a config; a model is "
                "counted as it is (patch it with toast.io.replace_spans first)"
            )
        module = model_or_config
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(f"{type(module).__name__} has no .config to read sizes from")
        a = arch_of(config)
        n, image = _tokens(a, image_size, seq_len)
        block_counts, translators, head_counts = _count_module(module, a, n, blocks)
    else:
        a = arch_of(model_or_config)
        n, image = _tokens(a, image_size, seq_len)
        block_counts, translators, head_counts = _count_config(
            a, n, removed_spans, translator, "base" if head is None else head
        )
    return MacReport(
        embedding=_embedding_counts(a, n, image).scaled(batch),
        per_block=tuple(b.scaled(batch) for b in block_counts),
        translators=tuple(t.scaled(batch) for t in translators),
        final_norm=_final_norm_counts(a, n).scaled(batch),
        head=head_counts.scaled(batch),
        tokens=n,
        batch=batch,
    )


_Parts = tuple[tuple[Counts, ...], tuple[Counts, ...], Counts]


def _count_config(
    a: Arch, n: int, removed_spans: Sequence[tuple[int, int]], translator: str, head: str
) -> _Parts:
    """Blocks, translators and head of the model a config builds, with
    ``removed_spans`` replaced by one ``translator`` each."""
    check_head(a, head)
    spans = validate_spans(removed_spans, a.layers)
    removed = sum(stop - start for start, stop in spans)
    block_counts = (_block_counts(a, n),) * (a.layers - removed)
    translators = tuple(_translator_counts(translator, a.hidden, n) for _ in spans)
    return block_counts, translators, _head_counts(a, head)


def _count_module(module: nn.Module, a: Arch, n: int, blocks: str | None) -> _Parts:
    """Blocks, translators and head of a (possibly patched) model."""
    from torch import nn

    from toast.hf.model.blocks import find_blocks
    from toast.translators import TranslatorBlock

    name = type(module).__name__
    if any(tag in name for tag in _PER_TOKEN_HEADS):
        raise ValueError(
            f"{name} has a per-token or multi-input head; toast.accounting counts "
            "base models and pooled classification / projection heads"
        )
    stack = find_blocks(module, blocks)
    block_counts: list[Counts] = []
    translators: list[Counts] = []
    for child in stack.blocks:
        if isinstance(child, TranslatorBlock):
            translators.append(_module_counts(child.translator, n))
        else:
            block_counts.append(_block_counts(a, n))
    # Pooler, classifier and projection layers: every Linear outside the
    # block list, each applied to one pooled vector per input.
    prefix = stack.path + "."
    head = sum(
        (
            Counts(dense=m.in_features * m.out_features)
            for path, m in module.named_modules()
            if isinstance(m, nn.Linear) and not path.startswith(prefix)
        ),
        Counts(),
    )
    return tuple(block_counts), tuple(translators), head


def _linear_report(
    module: Any, image_size: Any, seq_len: int | None, batch: int, blocks: str | None, example: Any
) -> MacReport:
    """The ``"linear"`` convention: every ``nn.Linear`` counted by hooks."""
    from toast.hf.model.blocks import find_blocks
    from toast.linear_macs import linear_counts, synthetic_example

    if not hasattr(module, "named_modules"):
        raise TypeError("convention='linear' runs the model: pass the model, not its config")
    example = synthetic_example(module, image_size, seq_len) if example is None else example
    c = linear_counts(module, example, find_blocks(module, blocks))
    blocks_, translators = (tuple(Counts(dense=batch * n) for n in ns) for ns in c.parts)
    head = Counts(dense=batch * c.outside)
    return MacReport(Counts(), blocks_, translators, Counts(), head, c.tokens, batch, "linear")
