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
    NonFiniteError,
    Translator,
    error_matrix,
    fit_residual,
    fit_translator,
    solve_gram,
)

__version__ = "0.1.0"

from toast.core.blas import blas_threads

# The Hugging Face glue needs torch; load it on first use so that the core
# (NumPy only) imports without it.
_LAZY = {
    "all_reduce_moments": "toast.hf.distributed",
    "Analysis": "toast.methods.toast.analysis",
    "Span": "toast.spans",
    "analyze": "toast.methods.toast.analysis",
    "capture_moments": "toast.hf.capture",
    "Calibration": "toast.hf.calibration",
    "ToastConfig": "toast.methods.toast",
    "ReplaceMeConfig": "toast.methods.replaceme",
    "ToastVitConfig": "toast.methods.toast_vit",
    "find_blocks": "toast.hf.blocks",
    "find_head": "toast.hf.blocks",
    "block_parts": "toast.hf.blocks",
    "BlockParts": "toast.hf.blocks",
    "BlockStack": "toast.hf.blocks",
    "CompressionReport": "toast.methods.toast",
    "compress": "toast.methods",
    "count_params": "toast.hf.params",
    "CorruptedSaveError": "toast.io",
    "ForwardError": "toast.hf.capture",
    "FewRowsWarning": "toast.methods.toast",
    "MacReport": "toast.accounting",
    "count_params_from_config": "toast.accounting",
    "load_pretrained": "toast.io",
    "macs": "toast.accounting",
    "paper_params_removed": "toast.accounting",
    "save_pretrained": "toast.io",
    "MLPTranslator": "toast.translators",
    "ResMLPTranslator": "toast.translators",
    "RowSample": "toast.hf.rows",
    "capture_rows": "toast.hf.rows",
    "train_translator": "toast.translators",
    "TranslatorBlock": "toast.translators",
    "replace_spans": "toast.hf.surgery",
    "translator_module": "toast.translators",
    "remove_blocks": "toast.hf.surgery",
    "DistanceProfile": "toast.methods.replaceme",
    "ReplaceMeReport": "toast.methods.replaceme",
    "profile_distances": "toast.methods.replaceme",
    "replaceme": "toast.methods.replaceme",
    "prune_heads": "toast.methods.toast_vit.scwp",
    "enable_tcs": "toast.methods.toast_vit.tcs",
    "disable_tcs": "toast.methods.toast_vit.tcs",
    "ToastVitReport": "toast.methods.toast_vit.compress",
    "toast_macs": "toast.methods.toast_vit.macs",
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
    "NonFiniteError",
    "ResMLPTranslator",
    "RowSample",
    "Translator",
    "__version__",
    "all_reduce_moments",
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
    "toast_macs",
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
