"""What every compression method provides, and the registry that
``toast.compress(model, data, method=...)`` dispatches through.

A method is a name, a typed config (a frozen dataclass whose class-level
``_parameter_constraints`` table, in :mod:`toast._validation`'s terms, its
``__post_init__`` checks every field against, and from which the CLI takes
each option's allowed values) and a ``run(model, data, config,
before_surgery=None)`` returning the compressed model and a :class:`Report`.
A method that removes blocks calls ``before_surgery(spans, stack)`` once
its spans are chosen and before it changes the model, so that the caller
can measure plain removal of those very blocks on the intact model
(:mod:`toast.methods.runner`). Methods register themselves
when their package is imported; :mod:`toast.methods` imports them all.

Each method also has :class:`Stages`, the parts of the method that
``toast.search`` runs separately: what it needs captured, its calibration,
the :class:`Plan` s it proposes (each with its exact size and predicted
error) and how a plan is applied. One shared pass (:func:`capture_shared`)
serves every method that needs the moments of the block states; the model's
structure is found once per call (:func:`find_layout`) and passed down.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toast.hf.data.calibration import CALIBRATION_OPTIONS, Calibration
from toast.methods.span_plans import best_windows, span_error, span_family_plans, span_plans
from toast.methods.stages import (
    BaseStages,
    Layout,
    Needs,
    Part,
    Plan,
    Shared,
    Sizes,
    Stages,
    Stats,
    capture_shared,
    capture_shared_from_disk,
)

if TYPE_CHECKING:
    from torch import nn

    from toast.hf.evaluate.quality import Quality
    from toast.hf.model.blocks import BlockStack
    from toast.spans import Span

#: Called by a method with its chosen spans and the model's block stack,
#: before the model changes.
BeforeSurgery = Callable[["Sequence[Span]", "BlockStack"], None]

__all__ = [
    "BaseStages",
    "Layout",
    "Method",
    "Needs",
    "Part",
    "Plan",
    "Report",
    "Shared",
    "Sizes",
    "Stages",
    "Stats",
    "best_windows",
    "capture_shared",
    "capture_shared_from_disk",
    "find_layout",
    "get_method",
    "make_config",
    "method_names",
    "register",
    "span_error",
    "span_family_plans",
    "span_plans",
    "staged_methods",
]


class Report:
    """Common ground of every method's report.

    Subclasses are dataclasses with at least ``method``, ``blocks_before``,
    ``blocks_after``, ``params_before`` and ``params_after``, and write
    :meth:`to_markdown`, ending it with :meth:`quality_markdown`.
    ``quality`` is the measured held-out quality (:class:`toast.hf.evaluate.quality.Quality`)
    when the method ran with held-out data, else None.
    """

    method: str
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    quality: Quality | None = None

    @property
    def blocks_removed(self) -> int:
        """Transformer blocks the model lost (a translator block counts as
        replacing, not keeping, its span)."""
        return self.blocks_before - self.blocks_after

    @property
    def compression_by_blocks(self) -> float:
        """Fraction of blocks removed (the papers' "25%")."""
        return self.blocks_removed / self.blocks_before

    @property
    def compression_by_params(self) -> float:
        """Fraction of parameters removed."""
        return 1.0 - self.params_after / self.params_before

    def params_line(self) -> str:
        """One markdown line: parameters before → after."""
        return (
            f"Parameters: {self.params_before:,} → {self.params_after:,} "
            f"(−{100 * self.compression_by_params:.1f}%)"
        )

    def quality_markdown(self) -> str:
        """The measured-quality section ("" when nothing was measured)."""
        return "" if self.quality is None else "\n\n" + self.quality.to_markdown()

    def to_markdown(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Method:
    """A registered compression method.

    ``config`` is its config dataclass; ``stages`` its :class:`Stages`,
    which both front doors run: ``toast.search`` as they are, and
    ``toast.compress`` configured by the user's config through the one
    driver (:mod:`toast.methods.driver`), in memory and, where the stages
    say ``from_disk``, block by block on a checkpoint that stays on disk
    (:mod:`toast.methods.pipeline`, its statistics fitted to what
    ``max_memory`` leaves by the stages' ``within_memory``); ``needs_data``
    says whether ``data`` may be None.
    """

    name: str
    config: type
    stages: Stages
    needs_data: bool = True
    summary: str = ""


_REGISTRY: dict[str, Method] = {}

#: Every method: its name → (the module whose import registers it, its
#: config dataclass as ``"module:Class"``). Adding a method adds its line
#: here. The registering modules import torch; most configs do not, so the
#: CLI builds a method's options and ``--help`` from the config alone.
METHODS = {
    "linearpatch": (
        "toast.methods.linearpatch.method",
        "toast.methods.linearpatch.config:LinearPatchConfig",
    ),
    "remove": ("toast.methods.remove.method", "toast.methods.remove.config:RemoveConfig"),
    "replaceme": (
        "toast.methods.replaceme.method",
        "toast.methods.replaceme.config:ReplaceMeConfig",
    ),
    "toast": ("toast.methods.translate.compress", "toast.methods.translate.config:ToastConfig"),
    "toast-vit": (
        "toast.methods.heads.compress",
        "toast.methods.heads.config:ToastVitConfig",
    ),
    "sublayer": (
        "toast.methods.sublayer.method",
        "toast.methods.sublayer.config:SublayerConfig",
    ),
    "tome": ("toast.methods.merge.method", "toast.methods.merge.config:TomeConfig"),
    "rapid": ("toast.methods.merge.method", "toast.methods.merge.config:RapidConfig"),
    "token-transforming": (
        "toast.methods.merge.method",
        "toast.methods.merge.config:TransformingConfig",
    ),
    "atm": ("toast.methods.merge.method", "toast.methods.merge.config:AtmConfig"),
    "pitome": ("toast.methods.merge.method", "toast.methods.merge.config:PitomeConfig"),
}


def register_all() -> None:
    """Imports every method of :data:`METHODS`, which registers it. Every
    lookup of the registry does this first, so that no caller depends on
    which method happened to be imported before; done on first use, so
    that importing a config (e.g. for the CLI's ``--help``) needs no torch."""
    for module, _ in METHODS.values():
        importlib.import_module(module)


def register(method: Method) -> Method:
    """Adds ``method`` to the registry (a second method of the same name is
    an error: names are how users choose)."""
    if method.name in _REGISTRY and _REGISTRY[method.name] is not method:
        raise ValueError(f"a method named {method.name!r} is registered already")
    _REGISTRY[method.name] = method
    return method


def method_names() -> list[str]:
    """Names of the registered methods."""
    register_all()
    return sorted(_REGISTRY)


def get_method(name: str) -> Method:
    """The method registered as ``name``."""
    register_all()
    if name not in _REGISTRY:
        raise ValueError(f"method must be one of {method_names()}; got {name!r}")
    return _REGISTRY[name]


def make_config(method: Method, params: Mapping[str, Any]) -> Any:
    """``method.config`` built from keyword ``params``: calibration options
    (``max_samples``, ``seed``...) go into its ``calibration`` field, the
    rest are its own fields or their other names (its ``ALIASES``, such as
    TOAST's ``budget`` for ``num_blocks``); an option it does not have is a
    ``TypeError`` that lists the ones it has."""
    names = {f.name for f in dataclasses.fields(method.config)}
    names |= set(getattr(method.config, "ALIASES", {}))
    calibration_options, own = Calibration.split(params)
    unknown = sorted(set(own) - names)
    if calibration_options and "calibration" not in names:
        unknown += sorted(calibration_options)
    if unknown:
        allowed = sorted(names - {"calibration"})
        if "calibration" in names:
            allowed += list(CALIBRATION_OPTIONS)
        raise TypeError(
            f"method={method.name!r} has no option(s) {unknown}; its options are {allowed}"
        )
    if "calibration" in names:
        own["calibration"] = Calibration.from_options(own.get("calibration"), **calibration_options)
    return method.config(**own)


def staged_methods() -> list[Method]:
    """The registered methods, by name (each is its :class:`Stages`)."""
    return [_REGISTRY[name] for name in method_names()]


def find_layout(model: nn.Module, blocks: str | BlockStack | None = None) -> Layout:
    """The model's :class:`Layout`: its block stack (``blocks`` names the
    list when discovery cannot find it alone, or is the stack found
    already, looked up again by its path) and the structure each staged
    method finds with it; the one discovery of a public call."""
    from toast.hf.model.blocks import find_blocks

    stack = find_blocks(model, blocks)
    parts = {}
    for method in staged_methods():
        found = method.stages.structure(model, stack)
        if found is not None:
            parts[method.name] = found
    return Layout(stack, parts)
