"""The allowed values of ToaSt's options: what its config validates against
without importing torch (``toast.ToastVitConfig`` stays as light as the
other configs), and what the pruning and TCS modules read."""

from __future__ import annotations

__all__ = ["COUPLINGS", "FORMS", "INDEX_SETS", "TCS_CHOICES"]

#: SCWP's index sets of the pruned dimensions (ToaSt §3.1).
INDEX_SETS = ("shared", "independent", "nonaligned")
#: Which projections a head's score couples.
COUPLINGS = ("coupled", "q_only", "k_only", "proj_only", "average")
#: Pruned heads removed from the weights, or masked in place.
FORMS = ("dense", "masked")
#: The allowed values of every TCS choice (see :mod:`toast.methods.heads.tcs`).
TCS_CHOICES: dict[str, tuple[str, ...]] = {
    "score": ("auto", "eq6", "eq7"),
    "weights": ("paper", "normalized"),
    "scope": ("image", "batch"),
    "form": ("dense", "masked"),
    "resample": ("fixed", "call"),
    "fc2_sample": ("same", "fresh"),
    "hidden": ("all", "kept"),
    "backend": ("auto", "c", "torch"),
}
