"""TOAST / TBA / RBA: the block error matrix of a model, the exact plan of
spans to replace, and closed-form (or trained) translators in their place."""

from toast.methods.toast.analysis import Analysis, analyze
from toast.methods.toast.compress import METHOD, compress_toast
from toast.methods.toast.config import ToastConfig
from toast.methods.toast.fitting import FewRowsWarning
from toast.methods.toast.report import CompressionReport

__all__ = [
    "METHOD",
    "Analysis",
    "CompressionReport",
    "FewRowsWarning",
    "ToastConfig",
    "analyze",
    "compress_toast",
]
