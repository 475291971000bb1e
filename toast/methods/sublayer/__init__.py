"""Sub-layer pruning: removing a block's attention or its MLP (with its
pre-norm) while the residual passes through, registered as
``toast.compress(model, data, method="sublayer", num_sublayers=k)``.

- :mod:`~toast.methods.sublayer.config`: :class:`SublayerConfig` (torch-free);
- :mod:`~toast.methods.sublayer.parts`: finding the sub-layers and removing
  one by module replacement (exact parameter count);
- :mod:`~toast.methods.sublayer.scores`: the scoring pass and the measured
  greedy selection;
- :mod:`~toast.methods.sublayer.stages`: its :class:`~toast.methods.base.Stages`;
- :mod:`~toast.methods.sublayer.persist`: the saved plan's ``"sublayer"`` patch;
- :mod:`~toast.methods.sublayer.method`: the orchestrator and its report,
  registered as ``"sublayer"``.
"""

from toast._lazy import lazy_getattr

_NAMES = {"SublayerConfig": "toast.methods.sublayer.config"}

__all__ = sorted(_NAMES)

__getattr__ = lazy_getattr(__name__, _NAMES)
