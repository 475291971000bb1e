"""How a calibration pass reads its data: one :class:`Calibration` for every
method, the CLI and the low-level capture functions.

Every pass over calibration data (moments, row samples, distance profiles,
ReplaceMe's estimates) takes the same options: which block list, how many
batches or samples, which samples, the seed, the progress bar and the
process group. They live here once; functions take ``calibration=`` or the
same names as keywords (:meth:`Calibration.from_options`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from toast._validation import Interval, Options, validate_fields

__all__ = [
    "BACKENDS",
    "BACKEND_HELP",
    "CALIBRATION_OPTIONS",
    "COMPUTE_DTYPES",
    "TOKENS",
    "Calibration",
    "CalibrationSizeWarning",
    "Tokens",
    "limited",
    "warn_if_small",
]

#: What forwards may compute in (``Calibration.compute_dtype``).
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "checkpoint")

#: Rows of each sample that enter the statistics: every valid token, the
#: first (CLS) token, the masked mean, or the last valid token.
Tokens = Literal["all", "cls", "mean", "last"]
TOKENS = ("all", "cls", "mean", "last")
#: Where sums are formed: ``"c"`` in the C core on the host, ``"torch"`` on
#: the activations' device, ``"auto"`` by the device (torch off the CPU).
BACKENDS = ("auto", "c", "torch")
#: What ``--backend`` means on the command line, for every config that has one.
BACKEND_HELP = (
    "where the float64 sums are formed: c (toast's C core, on the host), torch (on the "
    "activations' device), auto (torch off the CPU, else c)"
)


@dataclass(frozen=True)
class Calibration:
    """Options of a pass over calibration data.

    ``blocks``: dotted path of the block list (``"model.layers"``) when
    discovery is ambiguous. ``max_batches`` / ``max_samples``: stop after
    that many batches / samples (the last batch is cut to fit).
    ``sample="random"`` draws a seeded random subset of ``max_samples`` from
    a DataLoader's map-style dataset (``"first"`` takes the loader's order).
    ``seed`` seeds that draw and every sampled buffer. ``progress`` shows a
    tqdm bar with batches, rows and resident memory. ``distributed``: sum
    statistics over ``torch.distributed`` ranks (None: when a process group
    is initialised); ``group`` picks the group. ``shard``: under a process
    group every rank passes the same data and forwards its share of the
    batches (batch ``k`` on rank ``k % world``, after the split a single
    process makes), the sums reduced in float64, so that every rank gets
    one process's result (:mod:`toast.hf.capture.distributed`);
    ``shard=False``: each rank passes its own shard, used whole, and only
    moments are summed. ``compute_dtype``: what the
    forwards compute in (:mod:`toast.hf.capture.compute`). From a
    checkpoint, block by block: ``"auto"`` keeps a 16-bit checkpoint's dtype
    where its matmuls are measured faster than float32's on this machine
    (AMX or AVX-512 BF16 CPUs, accelerators) and widens it one block at a
    time to float32 where they are not; ``"float32"``, ``"bfloat16"``, or
    ``"checkpoint"`` (the weights' own dtype). In memory: ``"bfloat16"``
    runs a float32 model's calibration and held-out forwards under bf16
    autocast (the weights stay float32); any other value keeps the model's
    own dtype. Statistics are float64 either way; tensors written keep the
    checkpoint's dtype.
    """

    blocks: str | None = None
    max_batches: int | None = None
    max_samples: int | None = None
    sample: Literal["first", "random"] = "first"
    seed: int = 0
    progress: bool = True
    distributed: bool | None = None
    group: Any = None
    shard: bool = True
    compute_dtype: Literal["auto", "float32", "bfloat16", "checkpoint"] = "auto"

    _parameter_constraints: ClassVar[dict[str, list[Any]]] = {
        "blocks": [str, None],
        "max_batches": [Interval(int, 1, None), None],
        "max_samples": [Interval(int, 1, None), None],
        "sample": [Options(("first", "random"))],
        "seed": [Interval(int, 0, None)],
        "progress": [bool],
        "distributed": [bool, None],
        "shard": [bool],
        "compute_dtype": [Options(COMPUTE_DTYPES)],
    }

    def __post_init__(self) -> None:
        validate_fields(self, self._parameter_constraints)

    @classmethod
    def from_options(cls, calibration: Calibration | None = None, **options: Any) -> Calibration:
        """``calibration`` with ``options`` (its field names) overriding it;
        an unknown name is a ``TypeError`` listing the known ones."""
        unknown = set(options) - set(CALIBRATION_OPTIONS)
        if unknown:
            raise TypeError(
                f"unknown calibration option(s) {sorted(unknown)}; the options are "
                f"{list(CALIBRATION_OPTIONS)}"
            )
        if calibration is None:
            return cls(**options)
        if not isinstance(calibration, Calibration):
            raise TypeError(
                f"calibration must be a toast.Calibration, got {type(calibration).__name__}"
            )
        return dataclasses.replace(calibration, **options) if options else calibration

    @staticmethod
    def split(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``params`` split into (calibration options, everything else)."""
        mine = {k: v for k, v in params.items() if k in CALIBRATION_OPTIONS}
        rest = {k: v for k, v in params.items() if k not in CALIBRATION_OPTIONS}
        return mine, rest

    @property
    def is_distributed(self) -> bool:
        """Whether statistics are summed over ranks."""
        if self.distributed is not None:
            return self.distributed
        import torch.distributed  # here: a config is built before torch is needed

        return torch.distributed.is_available() and torch.distributed.is_initialized()


#: The names a function taking calibration options accepts as keywords.
CALIBRATION_OPTIONS = tuple(f.name for f in dataclasses.fields(Calibration))


def limited(loader: Iterable, calibration: Calibration) -> Iterable:
    """The loader, restricted to a seeded random subset when asked."""
    import torch.utils.data

    if calibration.sample == "random" and calibration.max_samples is not None:
        dataset = getattr(loader, "dataset", None)
        if not isinstance(loader, torch.utils.data.DataLoader) or dataset is None:
            raise ValueError(
                "sample='random' needs a torch DataLoader over a map-style dataset; "
                "use sample='first' for other iterables"
            )
        generator = torch.Generator().manual_seed(calibration.seed)
        order = torch.randperm(len(dataset), generator=generator)
        subset = torch.utils.data.Subset(dataset, order[: calibration.max_samples].tolist())
        return torch.utils.data.DataLoader(
            subset,
            batch_size=loader.batch_size,
            collate_fn=loader.collate_fn,
            num_workers=loader.num_workers,
        )
    return loader


class CalibrationSizeWarning(UserWarning):
    """Too few calibration rows for the width: held-out errors are unreliable."""


def warn_if_small(rows: int, dim: int, folds: int, samples: int, local_rows: int) -> None:
    """Warns when ``rows`` (over ``folds`` folds, from ``samples`` samples that
    gave ``local_rows`` rows here) are fewer per fold than the width ``dim``,
    saying how many samples would suffice."""
    folds_used = max(folds, 1)
    needed = folds_used * (dim + 1)
    if rows >= needed or samples <= 0 or local_rows <= 0:
        return
    per_sample = local_rows / samples
    enough = math.ceil(needed / per_sample)
    if folds >= 2:
        shortfall = f", {rows // folds_used} rows per fold of {folds}, fewer than the width"
    else:
        shortfall = ", no more than the width"
    warnings.warn(
        f"calibration data is small for width {dim}: {rows} rows from {samples} samples"
        f"{shortfall}, so least squares fits noise and the errors are unreliable (often "
        f"above 1). About {enough} samples ({needed} rows at {per_sample:.3g} rows per "
        "sample) would suffice: give more data or raise max_samples (--max-samples on the "
        "command line)",
        CalibrationSizeWarning,
        stacklevel=4,
    )
