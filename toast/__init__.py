"""toast: make pretrained transformers smaller and faster with no training.

The core measures how well each span of blocks is explained by a closed-form
map (the block error matrix) from streaming moments of captured activations,
and fits the translators that replace redundant spans.
"""

from toast.core import (
    METRICS,
    IllConditionedWarning,
    InSampleWarning,
    Moments,
    Translator,
    error_matrix,
    fit_residual,
    fit_translator,
    solve_gram,
)

__version__ = "0.1.0"

from toast.blas import blas_threads

# The Hugging Face glue needs torch; load it on first use so that the core
# (NumPy only) imports without it.
_LAZY = {
    "Analysis": "toast.analysis",
    "Span": "toast.analysis",
    "analyze": "toast.analysis",
    "capture_moments": "toast.capture",
    "find_blocks": "toast.hf",
    "find_head": "toast.hf",
    "block_parts": "toast.hf",
    "BlockParts": "toast.hf",
    "BlockStack": "toast.hf",
    "CompressionReport": "toast.pipeline",
    "compress": "toast.pipeline",
    "count_params": "toast.pipeline",
    "CorruptedSaveError": "toast.io",
    "ForwardError": "toast.capture",
    "FewRowsWarning": "toast.pipeline",
    "MacReport": "toast.accounting",
    "count_params_from_config": "toast.accounting",
    "load_pretrained": "toast.io",
    "macs": "toast.accounting",
    "paper_params_removed": "toast.accounting",
    "save_pretrained": "toast.io",
    "MLPTranslator": "toast.translators",
    "ResMLPTranslator": "toast.translators",
    "RowSample": "toast.rows",
    "capture_rows": "toast.rows",
    "train_translator": "toast.translators",
    "TranslatorBlock": "toast.patch",
    "replace_spans": "toast.patch",
    "translator_module": "toast.patch",
    "remove_blocks": "toast.patch",
    "DistanceProfile": "toast.replaceme",
    "ReplaceMeReport": "toast.replaceme",
    "profile_distances": "toast.replaceme",
    "replaceme": "toast.replaceme",
    "prune_heads": "toast.vit.scwp",
    "enable_tcs": "toast.vit.tcs",
    "disable_tcs": "toast.vit.tcs",
    "ToastVitReport": "toast.vit.compress",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'toast' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "METRICS",
    "Analysis",
    "BlockParts",
    "BlockStack",
    "CompressionReport",
    "CorruptedSaveError",
    "FewRowsWarning",
    "ForwardError",
    "Span",
    "TranslatorBlock",
    "analyze",
    "blas_threads",
    "capture_moments",
    "capture_rows",
    "compress",
    "count_params",
    "count_params_from_config",
    "block_parts",
    "find_blocks",
    "find_head",
    "IllConditionedWarning",
    "InSampleWarning",
    "MLPTranslator",
    "MacReport",
    "Moments",
    "ResMLPTranslator",
    "RowSample",
    "Translator",
    "__version__",
    "error_matrix",
    "fit_residual",
    "fit_translator",
    "load_pretrained",
    "macs",
    "paper_params_removed",
    "prune_heads",
    "enable_tcs",
    "disable_tcs",
    "ToastVitReport",
    "remove_blocks",
    "replace_spans",
    "replaceme",
    "profile_distances",
    "DistanceProfile",
    "ReplaceMeReport",
    "save_pretrained",
    "solve_gram",
    "train_translator",
    "translator_module",
]
