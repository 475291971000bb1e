"""toast: make pretrained transformers smaller and faster with no training.

The core measures how well each span of blocks is explained by a closed-form
map (the block error matrix) from streaming moments of captured activations,
and fits the translators that replace redundant spans. The methods share
that infrastructure, each run by ``toast.compress(model, data, method=...)``:
TOAST (``"toast"``), ReplaceMe (``"replaceme"``), ToaSt (``"toast-vit"``),
token merging (``"tome"``) and plain removal (``"remove"``);
``toast.search`` measures them all and their combinations and ``toast.analyze`` gives TOAST's error
matrix. ``toast.evaluate`` measures a model's accuracy on
lm-evaluation-harness tasks and the share of the original's it retains.

``__all__`` is the whole top level: compressing, evaluating, its configs, loading and
saving, counting, and the core's ``Moments``, ``error_matrix`` and
``fit_translator``. Everything else lives in its package:
:mod:`toast.core` (solvers, metrics, errors and warnings, BLAS threads),
:mod:`toast.hf` (block discovery, capture, text data, quality),
:mod:`toast.io` (saves; ``replace_spans``, whose patched model saves as a
toast save), :mod:`toast.frontier` (the search's results and targets),
:mod:`toast.translators`, :mod:`toast.accounting`, and :mod:`toast.methods`
with one package per method (``from toast.methods.replaceme import
replaceme``; ``toast.methods.heads.scwp.prune_heads``). These
seven packages are attributes of ``toast`` without importing them first. Only the
NumPy core is imported eagerly; everything that needs torch loads on first
use.
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

from toast._lazy import lazy_getattr as _lazy_getattr  # noqa: E402
from toast.core import Moments, error_matrix, fit_translator  # noqa: E402

__version__ = "0.1.0"

_NAMES = {
    # compressing: every method, by name or by measurement
    "compress": "toast.methods",
    "search": "toast.frontier",
    "analyze": "toast.methods.translate.analysis",
    # measuring: accuracy on lm-evaluation-harness tasks, retained against the original
    "evaluate": "toast.io.evaluation",
    # the options of calibration and of each method
    "Calibration": "toast.hf.data.calibration",
    "ToastConfig": "toast.methods.translate.config",
    "ReplaceMeConfig": "toast.methods.replaceme.config",
    "ToastVitConfig": "toast.methods.heads.config",
    "RemoveConfig": "toast.methods.remove.config",
    "TomeConfig": "toast.methods.merge.config",
    # loading, saving and counting
    "load_model": "toast.io.local",
    "load_tokenizer": "toast.io.local",
    "save_pretrained": "toast.io.save",
    "load_pretrained": "toast.io.load",
    "macs": "toast.accounting",
    "count_params": "toast.hf.model.params",
    # subpackages, reachable as attributes without importing them first
    "accounting": "toast.accounting",
    "hf": "toast.hf",
    "io": "toast.io",
    "methods": "toast.methods",
    "frontier": "toast.frontier",
    "translators": "toast.translators",
}

__getattr__ = _lazy_getattr(__name__, _NAMES)

__all__ = [
    "compress",
    "search",
    "analyze",
    "evaluate",
    "Calibration",
    "ToastConfig",
    "ReplaceMeConfig",
    "ToastVitConfig",
    "RemoveConfig",
    "TomeConfig",
    "Moments",
    "error_matrix",
    "fit_translator",
    "load_pretrained",
    "save_pretrained",
    "load_model",
    "load_tokenizer",
    "macs",
    "count_params",
    "__version__",
]

# ``core`` is imported above; the rest load on first use.
_SUBPACKAGES = ("core", *(name for name, module in _NAMES.items() if module == f"toast.{name}"))


def __dir__() -> list[str]:
    """The public names and the subpackages, loaded or not (tab completion
    sees what ``toast.`` offers, not what happens to be imported)."""
    return sorted({*__all__, *_SUBPACKAGES, *(n for n in globals() if n.startswith("__"))})
