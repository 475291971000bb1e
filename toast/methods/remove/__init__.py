"""Plain block removal: the baseline every other method is measured
against, registered as ``toast.compress(model, data, method="remove")``.

- :mod:`~toast.methods.remove.config`: :class:`RemoveConfig` (torch-free);
- :mod:`~toast.methods.remove.stages`: its :class:`~toast.methods.base.Stages`
  (the identity-span error of every span, from the shared pass);
- :mod:`~toast.methods.remove.method`: the orchestrator and its report,
  registered as ``"remove"``.
"""

from toast._lazy import lazy_getattr

_NAMES = {"RemoveConfig": "toast.methods.remove.config"}

__all__ = sorted(_NAMES)

__getattr__ = lazy_getattr(__name__, _NAMES)
