"""TOAST / TBA / RBA: the block error matrix of a model, the exact plan of
spans to replace, and closed-form (or trained) translators in their place.

- :mod:`~toast.methods.translate.config`: :class:`ToastConfig` (torch-free);
- :mod:`~toast.methods.translate.analysis`: :func:`analyze` → :class:`Analysis`
  (error matrix, top spans, plan, heatmap); :func:`analyze_from_disk`, the
  same from a checkpoint on disk, block by block;
- :mod:`~toast.methods.translate.fitting`: translators of planned spans;
- :mod:`~toast.methods.translate.compress`: the orchestrator, registered as ``"toast"``;
- :mod:`~toast.methods.translate.from_disk`: analysis, closed-form fit and a toast
  save of a checkpoint on disk, without loading the model;
- :mod:`~toast.methods.translate.report`: :class:`CompressionReport`.
"""

from toast._lazy import lazy_getattr

__all__ = [
    "Analysis",
    "CompressionReport",
    "FewRowsWarning",
    "ToastConfig",
    "analyze",
    "analyze_from_disk",
    "compress_from_disk",
    "compress_toast",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "Analysis": "toast.methods.translate.analysis",
        "analyze": "toast.methods.translate.analysis",
        "analyze_from_disk": "toast.methods.translate.analysis",
        "compress_toast": "toast.methods.translate.compress",
        "compress_from_disk": "toast.methods.translate.from_disk",
        "ToastConfig": "toast.methods.translate.config",
        "FewRowsWarning": "toast.methods.translate.fitting",
        "CompressionReport": "toast.methods.translate.report",
    },
)
