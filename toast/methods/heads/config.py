"""The options of ``toast.compress(..., method="toast-vit")``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from toast._validation import Interval, Options, Predicate, validate_fields
from toast.hf.data.calibration import Calibration
from toast.methods.heads.choices import COUPLINGS, FORMS, INDEX_SETS, TCS_CHOICES
from toast.methods.heads.median import CENTERS
from toast.methods.heads.schedules import RATIO, SAMPLE_RATIO, SKIP, Schedule

__all__ = ["ToastVitConfig"]

_PER_BLOCK = Predicate(
    lambda v: isinstance(v, Mapping) or (isinstance(v, Sequence) and not isinstance(v, str)),
    "a list with one ρ per block or a {block: ρ} mapping",
)


@dataclass(frozen=True)
class ToastVitConfig:
    """How ToaSt prunes heads, selects FFN channels and (optionally)
    fine-tunes (see :func:`toast.methods.heads.compress.compress_vit`).

    SCWP (ToaSt §3.1, Eq. 3): ``head_sparsity`` ρ (one number, one per
    block, or ``{block: ρ}``; None: the named schedule's ρ, else 0.9),
    ``center``, ``index_sets``, ``coupling``, ``form``, ``skip``,
    ``rescale``, ``mask_bias`` (:func:`toast.methods.heads.scwp.prune_heads`). TCS (§3.2,
    Eqs. 6-7): ``schedule`` (a name, a ``Schedule``, a mapping, or None for
    no TCS), ``tcs_scope``, ``tcs_form``, ``score``, ``weights``,
    ``sample_ratio``, ``hidden`` (:func:`toast.methods.heads.tcs.enable_tcs`). Recovery
    fine-tune (Table 10; needs data): ``finetune_steps`` AdamW steps with a
    cosine schedule from ``lr`` to ``min_lr``, ``weight_decay``,
    ``loss_fn(model, batch)``. ``image_size`` is the resolution the MACs
    are counted at (default the config's). ``calibration.seed`` seeds TCS's
    token samples and the fine-tune.
    """

    head_sparsity: float | Sequence[float] | Mapping[int, float] | None = None
    schedule: str | Schedule | Mapping[str, Any] | None = None
    center: str = "geomedian"
    index_sets: str = "shared"
    coupling: str = "coupled"
    form: str = "dense"
    skip: Sequence[int] | str = (0,)
    rescale: bool = False
    mask_bias: bool = False
    tcs_scope: str = "image"
    tcs_form: str = "dense"
    score: str = "auto"
    weights: str = "paper"
    sample_ratio: float | None = None
    hidden: str = "kept"
    finetune_steps: int = 0
    lr: float = 1e-3
    min_lr: float = 1e-5
    weight_decay: float = 1e-4
    loss_fn: Callable[..., Any] | None = None
    image_size: int | None = None
    calibration: Calibration = field(default_factory=Calibration)

    #: What each option means on the command line (``toast compress --method toast-vit``).
    HELP: ClassVar[dict[str, str]] = {
        "head_sparsity": "fraction of each head's dimensions pruned (the schedule's, else 0.9)",
        "schedule": "named Token Channel Selection schedule (none: no TCS)",
        "center": "what a head dimension is scored against: the geometric median (geomedian), "
        "the coordinate median (the reference code's), fpgm's sum of distances, or its l1 / "
        "l2 norm",
        "index_sets": "kept dimensions: one set per head for Q, K, V and O (shared, the "
        "paper's), one for QK and one for VO (independent, the reference code's), or each "
        "alone (nonaligned, masked form only)",
        "coupling": "what a dimension's score reads: the coupled pairs (QK, VO), one side of "
        "them or the mean of both sides' scores (Table 15's ablations)",
        "form": "dense: narrower heads; masked: the pruned weights zeroed (the same function)",
        "rescale": "softmax scale from the kept head width (default: the original width's)",
        "mask_bias": "masked form: zero the pruned dimensions' biases too",
        "tcs_scope": "TCS: channels chosen per image, or once per batch (the reference code's)",
        "tcs_form": "TCS: gather the kept channels (dense) or zero the dropped ones (masked)",
        "score": "TCS channel scores: eq6 (weighted by the CLS token's attention), eq7 (mean "
        "magnitude), auto (eq6 with a CLS token, eq7 for Swin)",
        "weights": "TCS eq6's weights of the CLS and patch terms: as the paper gives them, or "
        "normalized by the token count (the reference code's)",
        "sample_ratio": "TCS: fraction of the patch tokens scored (default: the schedule's)",
        "hidden": "TCS dense form: compute only the kept hidden channels (kept), or every one "
        "as the paper does (all)",
        "finetune_steps": "steps of the recovery fine-tune on --data (0: none)",
        "lr": "fine-tune: peak learning rate (cosine schedule down to --min-lr)",
        "min_lr": "fine-tune: final learning rate",
        "weight_decay": "fine-tune: AdamW weight decay",
        "image_size": "resolution the MACs are counted at (default the model config's)",
    }

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "head_sparsity": [RATIO, _PER_BLOCK, None],
        "schedule": [str, Schedule, Mapping, None],
        "center": [Options(CENTERS)],
        "index_sets": [Options(INDEX_SETS)],
        "coupling": [Options(COUPLINGS)],
        "form": [Options(FORMS)],
        "skip": list(SKIP),
        "rescale": [bool],
        "mask_bias": [bool],
        "tcs_scope": [Options(TCS_CHOICES["scope"])],
        "tcs_form": [Options(TCS_CHOICES["form"])],
        "score": [Options(TCS_CHOICES["score"])],
        "weights": [Options(TCS_CHOICES["weights"])],
        "sample_ratio": [SAMPLE_RATIO, None],
        "hidden": [Options(TCS_CHOICES["hidden"])],
        "finetune_steps": [Interval(int, 0, None)],
        "lr": [Interval(float, 0, None, closed="neither")],
        "min_lr": [Interval(float, 0, None)],
        "weight_decay": [Interval(float, 0, None)],
        "loss_fn": [Predicate(callable, "a callable (model, batch) -> loss"), None],
        "image_size": [Interval(int, 1, None), None],
        "calibration": [Calibration],
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr must be <= lr; got min_lr={self.min_lr}, lr={self.lr}")
