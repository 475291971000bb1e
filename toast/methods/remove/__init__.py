"""Plain block removal: the baseline every other method is measured
against, registered as ``toast.compress(model, data, method="remove")``.

- :mod:`~toast.methods.remove.config`: :class:`RemoveConfig` (torch-free);
- :mod:`~toast.methods.remove.stages`: its :class:`~toast.methods.base.Stages`
  (the identity-span error of every span, from the shared pass; ShortGPT's
  and SLEB's rules), which ``compress`` and ``search`` run alike;
- :mod:`~toast.methods.remove.report`: its report;
- :mod:`~toast.methods.remove.method`: its registration as ``"remove"``.
"""

from toast._lazy import lazy_getattr

_NAMES = {"RemoveConfig": "toast.methods.remove.config"}

__all__ = sorted(_NAMES)

__getattr__ = lazy_getattr(__name__, _NAMES)
