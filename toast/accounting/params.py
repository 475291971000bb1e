"""Parameter counts from a Hugging Face config alone (see
:mod:`toast.accounting` for the model classes ``head`` chooses and the
translators a compressed model holds): :func:`count_params_from_config`,
exact for the model a config builds, :func:`block_params_from_config` and
:func:`translator_params` for its parts, and :func:`paper_params_removed`,
TOAST's own "Params." arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from toast.accounting.arch import (
    Arch,
    Head,
    TranslatorKind,
    arch_of,
    check_head,
    check_translator,
)
from toast.core.kinds import kind_entry
from toast.spans import validate_spans

__all__ = [
    "block_params_from_config",
    "count_params_from_config",
    "paper_params_removed",
    "translator_params",
]


def translator_params(kind: TranslatorKind | str, dim: int) -> int:
    """Parameters of one translator of ``kind`` on ``dim`` features, from the
    module its kind is stored as (:meth:`toast.core.kinds.Kind.params`):
    identity 0, linear ``d²`` (and the other bias-free linear maps), affine
    ``d² + d``, diagonal ``2d``, MLP ``2·d·(d//2) + d//2 + d``, Res-MLP
    ``2(d² + d) + 4d``."""
    check_translator(kind)
    return kind_entry(kind).params(dim)


def _block_params(a: Arch) -> int:
    d, f = a.hidden, a.ffn
    norms = 2 * (2 * d)
    if a.family == "bert":
        return 4 * (d * d + d) + norms + (d * f + f) + (f * d + d)
    qkv = 3 * (d * d + (d if a.qkv_bias else 0))
    out = d * d + d
    if a.swiglu:
        mlp = 2 * (d * f + f) + (f * d + d)
    else:
        mlp = (d * f + f) + (f * d + d)
    layer_scale = 2 * d if a.family == "dinov2" else 0
    return norms + qkv + out + mlp + layer_scale


def _embedding_params(a: Arch) -> int:
    d = a.hidden
    if a.family == "bert":
        return (a.vocab + a.max_positions + a.type_vocab) * d + 2 * d
    positions = a.patches(a.grid_image) + a.prefix
    conv = a.channels * a.patch[0] * a.patch[1] * d
    if a.family == "clip_vision":
        # class embedding, bias-free conv, position embedding, pre_layrnorm
        return d + conv + positions * d + 2 * d
    tokens = a.prefix * d + (d if a.mask_token else 0)
    return tokens + conv + d + positions * d


def _final_norm_params(a: Arch) -> int:
    return 0 if a.family == "bert" else 2 * a.hidden


def _head_params(a: Arch, head: str) -> int:
    d = a.hidden
    pooler = a.pooler_out * d + a.pooler_out if a.family in ("vit", "deit", "bert") else 0
    if head == "none":
        return 0
    if head == "base":
        return pooler
    labels = a.num_labels
    if a.family == "dinov2":
        return 2 * d * labels + labels if labels else 0
    classifier = d * labels + labels if labels else 0
    # BERT's sequence classifier keeps the pooler; ViT and DeiT drop it.
    return classifier + (pooler if a.family == "bert" else 0)


def block_params_from_config(config: Any) -> int:
    """Parameters of one transformer block of the architecture ``config``
    describes (ViT: ``12d² + 13d`` with the default 4d MLP and QKV biases;
    DINOv2 adds LayerScale's ``2d``)."""
    return _block_params(arch_of(config))


def count_params_from_config(
    config: Any,
    *,
    removed_spans: Sequence[tuple[int, int]] = (),
    translator: TranslatorKind | str = "identity",
    head: Head | str = "base",
) -> int:
    """Exact parameter count of the model ``config`` builds, computed from
    the config alone.

    ``head`` chooses the model class (``"base"``: ``AutoModel``; ``"none"``:
    no pooler; ``"classifier"``: ``AutoModelFor…Classification``, see
    :mod:`toast.accounting`). With ``removed_spans`` (toast spans ``(start, stop)``),
    the count is that of the compressed model :func:`toast.io.replace_spans`
    builds: the blocks of every span gone and one ``translator``
    (:data:`~toast.accounting.TRANSLATOR_KINDS`) per span in their place.
    """
    a = arch_of(config)
    check_head(a, head)
    check_translator(translator)
    spans = validate_spans(removed_spans, a.layers)
    removed = sum(stop - start for start, stop in spans)
    return (
        _embedding_params(a)
        + (a.layers - removed) * _block_params(a)
        + len(spans) * translator_params(translator, a.hidden)
        + _final_norm_params(a)
        + _head_params(a, head)
    )


def paper_params_removed(config: Any, removed_spans: Sequence[tuple[int, int]]) -> int:
    """Parameters removed in TOAST's "Params." arithmetic:
    ``(#removed blocks) × (P_block − d² − d)``.

    The paper subtracts one affine translator (``d² + d``) per removed
    *block*, for identity and linear rows alike, although a span has one
    translator without a bias. For spans of one block this equals the exact
    saving with an affine translator; for longer spans it is
    ``(len(span) − 1)·(d² + d)`` below that saving.
    """
    a = arch_of(config)
    spans = validate_spans(removed_spans, a.layers)
    removed = sum(stop - start for start, stop in spans)
    return removed * (_block_params(a) - a.hidden * a.hidden - a.hidden)
