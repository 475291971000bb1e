"""What the counts of :mod:`toast.accounting` read from a Hugging Face config:
:class:`Arch`, the sizes of a supported architecture (:func:`arch_of`), and
the options every count checks (the translator kinds of
:data:`TRANSLATOR_KINDS`, the model classes a ``head`` names).

Both the parameter counts (:mod:`toast.accounting.params`) and the MAC
counts (:mod:`toast.accounting`) start from here, so that the two agree on
what a config describes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from toast._validation import Options, check
from toast.core.kinds import TranslatorKind, kind_names

__all__ = [
    "HADAMARD_KINDS",
    "TRANSLATOR_KINDS",
    "Arch",
    "Head",
    "TranslatorKind",
    "arch_of",
    "check_head",
    "check_translator",
    "pair",
]

Head = Literal["base", "none", "classifier"]

#: Translator kinds a config-only prediction knows: every kind of
#: :data:`toast.core.kinds.KINDS` (``identity``, ``linear`` ``x W``, ``affine``
#: ``x W + b``, ``diagonal``, ``orthogonal``, the ``d × d`` maps of
#: :mod:`toast.core.patch` in the Hadamard basis, ``mlp``, ``resmlp``), each
#: counted by the module it is stored as. Both tuples are kept for their
#: importers; the checks read the table when they run.
HADAMARD_KINDS = kind_names(hadamard=True)
TRANSLATOR_KINDS: tuple[str, ...] = kind_names()

_HEADS = ("base", "none", "classifier")

_FAMILIES = {
    "vit": "vit", "deit": "deit", "dinov2": "dinov2", "clip_vision_model": "clip_vision",
    "bert": "bert",
}  # fmt: skip


@dataclass(frozen=True)
class Arch:
    """The sizes of a supported architecture, read from its config."""

    family: str
    hidden: int
    heads: int
    layers: int
    ffn: int  # MLP hidden width
    swiglu: bool  # DINOv2's SwiGLU feed-forward (gate, up, down)
    qkv_bias: bool
    num_labels: int
    pooler_out: int
    # vision
    channels: int = 0
    patch: tuple[int, int] = (0, 0)
    grid_image: tuple[int, int] = (0, 0)  # config image size: position-embedding grid
    prefix: int = 0  # CLS (+ distillation) tokens
    mask_token: bool = False
    # text
    vocab: int = 0
    max_positions: int = 0
    type_vocab: int = 0

    @property
    def vision(self) -> bool:
        return self.family != "bert"

    def patches(self, image: tuple[int, int]) -> int:
        return (image[0] // self.patch[0]) * (image[1] // self.patch[1])


def pair(value: Any) -> tuple[int, int]:
    """``(h, w)`` from an HF size field: an int (square) or a 2-sequence."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"expected an int or a pair, got {value!r}")
        return int(value[0]), int(value[1])
    return int(value), int(value)


def arch_of(config: Any) -> Arch:
    """The sizes ``config`` describes; ``ValueError`` for a family
    :mod:`toast.accounting` does not count."""
    model_type = getattr(config, "model_type", None)
    family = _FAMILIES.get(str(model_type))
    if family is None:
        raise ValueError(
            f"toast.accounting counts {sorted(_FAMILIES)} configs, got model_type "
            f"{model_type!r} ({type(config).__name__})"
        )
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    # The fields every family shares; each family below fills in the rest.
    common = Arch(
        family=family,
        hidden=hidden,
        heads=heads,
        layers=int(config.num_hidden_layers),
        ffn=0,
        swiglu=False,
        qkv_bias=True,
        num_labels=int(getattr(config, "num_labels", 0) or 0),
        pooler_out=0,
    )
    if family == "bert":
        return replace(
            common,
            ffn=int(config.intermediate_size),
            pooler_out=hidden,
            vocab=int(config.vocab_size),
            max_positions=int(config.max_position_embeddings),
            type_vocab=int(config.type_vocab_size),
        )
    vision = replace(
        common,
        channels=int(config.num_channels),
        patch=pair(config.patch_size),
        grid_image=pair(config.image_size),
        prefix=1,
    )
    if family == "dinov2":
        return _dinov2_arch(vision, config)
    if family == "clip_vision":
        return replace(vision, ffn=int(config.intermediate_size))
    # vit, deit
    return replace(
        vision,
        ffn=int(config.intermediate_size),
        qkv_bias=bool(config.qkv_bias),
        pooler_out=int(getattr(config, "pooler_output_size", None) or hidden),
        prefix=2 if family == "deit" else 1,
    )


def _dinov2_arch(vision: Arch, config: Any) -> Arch:
    ffn = int(vision.hidden * config.mlp_ratio)
    swiglu = bool(getattr(config, "use_swiglu_ffn", False))
    if swiglu:  # Dinov2SwiGLUFFN's hidden width, rounded up to a multiple of 8
        ffn = (int(ffn * 2 / 3) + 7) // 8 * 8
    return replace(
        vision,
        ffn=ffn,
        swiglu=swiglu,
        qkv_bias=bool(config.qkv_bias),
        mask_token=bool(getattr(config, "use_mask_token", True)),
    )


def check_translator(translator: str) -> None:
    """``ValueError`` unless ``translator`` is a kind of
    :data:`toast.core.kinds.KINDS` (looked up now: a kind added to the table
    is accepted)."""
    check("translator", translator, Options(kind_names()))


def check_head(arch: Arch, head: str) -> None:
    """``ValueError`` unless ``head`` names a model class ``arch`` has."""
    check("head", head, Options(_HEADS))
    if head == "classifier" and arch.family == "clip_vision":
        raise ValueError(
            "a CLIP vision config has no classification model (CLIPForImageClassification "
            "takes a full CLIPConfig); use head='base'"
        )
