"""toast: make pretrained transformers smaller and faster with no training.

The core measures how well each span of blocks is explained by a closed-form
map (the block error matrix) from streaming moments of captured activations,
and fits the translators that replace redundant spans. Three methods share
that infrastructure: TOAST (``toast.compress``), ReplaceMe
(``toast.replaceme``) and ToaSt (``toast.prune_heads``, ``toast.enable_tcs``).

The names below are the public surface. Lower-level pieces live in their
packages: :mod:`toast.hf` (block discovery, capture, row samples, surgery),
:mod:`toast.translators`, :mod:`toast.io`, :mod:`toast.accounting` and
:mod:`toast.methods`. Only the NumPy core is imported eagerly; everything
that needs torch loads on first use.
"""

import os as _os


def _load_core() -> None:
    """Loads the C extension and with it the core's own OpenBLAS.

    OpenBLAS worker threads busy-wait for 2^28 cycles (about a tenth of a
    second) after every call before they sleep, and OpenBLAS reads how long
    only when it loads. Between the moment updates of a capture pass the
    model's forward runs on torch's thread pool, which those spinning
    threads starve: on two cores analyze's forward ran up to twice as slow
    (``benchmarks/bench_analyze.py``). The core's threads therefore sleep
    at once (2^4 cycles), unless ``OPENBLAS_THREAD_TIMEOUT`` is set already;
    the variable is set only while the library loads, so no other OpenBLAS
    sees it.
    """
    key = "OPENBLAS_THREAD_TIMEOUT"
    chosen = key in _os.environ
    if not chosen:
        _os.environ[key] = "4"
    try:
        from toast import _core  # noqa: F401
    finally:
        if not chosen:
            del _os.environ[key]


_load_core()

from toast._lazy import lazy_getattr  # noqa: E402
from toast.core import (  # noqa: E402
    METRICS,
    IllConditionedWarning,
    InSampleWarning,
    Moments,
    NonFiniteError,
    Translator,
    blas_threads,
    error_matrix,
    fit_residual,
    fit_translator,
    solve_gram,
)

__version__ = "0.1.0"

_NAMES = {
    # calibration and Hugging Face glue
    "Calibration": "toast.hf.calibration",
    "TextData": "toast.hf.text",
    "Quality": "toast.hf.quality",
    "ForwardError": "toast.hf.capture",
    "capture_moments": "toast.hf.capture",
    "find_blocks": "toast.hf.blocks",
    # through toast.io, so that the patched model's save_pretrained is guarded
    "replace_spans": "toast.io.guard",
    "count_params": "toast.hf.params",
    "all_reduce_moments": "toast.hf.distributed",
    # every method
    "compress": "toast.methods",
    "Span": "toast.spans",
    # TOAST
    "Analysis": "toast.methods.toast.analysis",
    "analyze": "toast.methods.toast.analysis",
    "ToastConfig": "toast.methods.toast.config",
    "CompressionReport": "toast.methods.toast.report",
    "FewRowsWarning": "toast.methods.toast.fitting",
    "CalibrationSizeWarning": "toast.hf.calibration",
    # ReplaceMe
    "replaceme": "toast.methods.replaceme.method",
    "profile_distances": "toast.methods.replaceme.profile",
    "ReplaceMeConfig": "toast.methods.replaceme.config",
    "ReplaceMeReport": "toast.methods.replaceme.report",
    # ToaSt
    "prune_heads": "toast.methods.toast_vit.scwp",
    "enable_tcs": "toast.methods.toast_vit.tcs",
    "disable_tcs": "toast.methods.toast_vit.tcs",
    "ToastVitConfig": "toast.methods.toast_vit.config",
    "ToastVitReport": "toast.methods.toast_vit.compress",
    "toast_macs": "toast.methods.toast_vit.macs",
    # every method at once, by measurement
    "search": "toast.frontier",
    "SearchResult": "toast.frontier",
    "Target": "toast.frontier",
    # saving and accounting
    "load_model": "toast.io.local",
    "load_tokenizer": "toast.io.local",
    "save_pretrained": "toast.io.save",
    "load_pretrained": "toast.io.load",
    "CorruptedSaveError": "toast.io.format",
    "macs": "toast.accounting",
    # subpackages, reachable as attributes without importing them first
    "accounting": "toast.accounting",
    "hf": "toast.hf",
    "io": "toast.io",
    "methods": "toast.methods",
    "frontier": "toast.frontier",
    "translators": "toast.translators",
}

__getattr__ = lazy_getattr(__name__, _NAMES)

__all__ = [
    "METRICS",
    "IllConditionedWarning",
    "InSampleWarning",
    "Moments",
    "NonFiniteError",
    "Translator",
    "__version__",
    "blas_threads",
    "error_matrix",
    "fit_residual",
    "fit_translator",
    "solve_gram",
    *(name for name, module in _NAMES.items() if module != f"toast.{name}"),
]
