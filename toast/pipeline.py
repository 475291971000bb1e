"""``toast.compress``: analyse, plan, fit and patch in one pass over the data."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from toast.analysis import Analysis, Span, analyze
from toast.capture import Tokens, capture_moments
from toast.core import Translator, fit_translator
from toast.distributed import broadcast_module, is_distributed
from toast.hf import find_blocks
from toast.patch import replace_spans, validate_spans
from toast.rows import RowSample, capture_rows
from toast.translators import train_translator

__all__ = ["CompressionReport", "FewRowsWarning", "compress", "count_params"]


def count_params(model: nn.Module) -> int:
    """Number of parameters (shared tensors counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


@dataclass
class CompressionReport:
    """What :func:`compress` did."""

    method: str
    translator: str
    spans: list[Span]
    conditions: list[float]
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    rows: int
    analysis: Analysis = field(repr=False)
    fit: str = "independent"

    @property
    def blocks_removed(self) -> int:
        return sum(s.num_blocks for s in self.spans)

    @property
    def compression_by_blocks(self) -> float:
        return self.blocks_removed / self.blocks_before

    @property
    def compression_by_params(self) -> float:
        return 1.0 - self.params_after / self.params_before

    def to_markdown(self) -> str:
        lines = [
            f"**{self.method}**: {self.blocks_removed} of {self.blocks_before} blocks replaced "
            f"by {len(self.spans)} {self.translator} translator(s) "
            f"({self.fit} fit), analysed on {self.rows} rows.",
            "",
            "| blocks | paper (s→e) | predicted error | condition |",
            "|---|---|---:|---:|",
        ]
        for span, cond in zip(self.spans, self.conditions, strict=True):
            shown = "—" if cond != cond else f"{cond:.3g}"  # NaN: a trained translator
            lines.append(
                f"| [{span.start}:{span.stop}] | {span.paper} | {span.error:.4g} | {shown} |"
            )
        lines += [
            "",
            f"Parameters: {self.params_before:,} → {self.params_after:,} "
            f"(−{100 * self.compression_by_params:.1f}%); transformer blocks: "
            f"{self.blocks_before} → {self.blocks_before - self.blocks_removed} "
            f"(−{100 * self.compression_by_blocks:.1f}%), plus {len(self.spans)} translator(s).",
        ]
        return "\n".join(lines)


class FewRowsWarning(UserWarning):
    """A translator was fitted from no more rows than features (ridge used)."""


# Ridge (relative to the mean diagonal of XᵀX) for fits with rows <= dim.
FEW_ROWS_RIDGE = 1e-3

CLOSED_FORM = ("identity", "linear", "affine", "diagonal", "orthogonal")
TRAINED = ("mlp", "resmlp")


def compress(
    model: nn.Module,
    loader: Iterable | None = None,
    *,
    method: Literal["toast", "replaceme", "toast-vit"] = "toast",
    budget: int | None = None,
    max_error: float | None = None,
    spans: Sequence[tuple[int, int]] | None = None,
    translator: str = "affine",
    fit: Literal["independent", "sequential"] = "independent",
    metric: str = "linear",
    estimator: Literal["cv", "gcv", "in_sample"] = "cv",
    folds: int = 5,
    tokens: Tokens = "all",
    blocks: str | None = None,
    ridge: float | None = None,
    max_batches: int | None = None,
    max_samples: int | None = None,
    sample: Literal["first", "random"] = "first",
    seed: int = 0,
    max_rows: int = 50_000,
    train_steps: int = 300,
    lr: float = 1e-3,
    backend: Literal["auto", "c", "torch"] = "auto",
    distributed: bool | None = None,
    group: Any = None,
    progress: bool = True,
    **options: Any,
) -> tuple[nn.Module, CompressionReport]:
    """Replaces redundant spans of blocks by translators, in place.

    One pass over ``loader`` gives the moments; the error matrix (``metric``,
    ``estimator``) ranks spans; :meth:`Analysis.plan` picks non-overlapping
    spans removing up to ``budget`` blocks (each within ``max_error`` if
    given), unless ``spans`` names them (``(start, stop)`` block slices);
    each span gets a ``translator`` and the model is patched. Returns the
    model and a :class:`CompressionReport`.

    Translators: ``"identity"``, ``"linear"``, ``"affine"`` (default),
    ``"diagonal"`` and ``"orthogonal"`` are solved in closed form from the
    moments (``ridge`` as in :func:`toast.fit_translator`); ``"mlp"`` and
    ``"resmlp"`` are TOAST's trained ablations (Adam, ``lr``,
    ``train_steps`` steps) fitted on a uniform sample of at most
    ``max_rows`` token rows kept in a disk-backed buffer (one more pass).

    ``fit="independent"`` (the papers' protocol) fits every span on the
    original model's activations, all from the analysis pass.
    ``fit="sequential"`` patches spans in order and fits each on the
    partially compressed model (input and target both from a pass over the
    model with the earlier spans already replaced), so later translators
    see the inputs they will get at inference; one pass per span.

    ``method="replaceme"`` runs :func:`toast.replaceme.replaceme` instead
    (``num_blocks=n``, ``objective="ls" | "cosine" | "identity"`` and its
    other options as keywords) and returns its ``ReplaceMeReport``.

    ``method="toast-vit"`` runs ToaSt on a ViT (:func:`toast.vit.compress.compress_vit`:
    ``head_sparsity=0.9``, ``schedule="deit_small@2.5" | {...}``, ``center``,
    ``form``, ``tcs_scope``, ... as keywords; ``loader`` only for its optional
    fine-tune) and returns its ``ToastVitReport``.
    """
    if method == "toast-vit":
        from toast.vit.compress import compress_vit

        return compress_vit(model, loader, seed=seed, lr=lr, **options)
    if method == "replaceme":
        from toast.replaceme import _from_compress

        args = {k: v for k, v in locals().items() if k not in ("model", "loader", "options")}
        return _from_compress(model, loader, options, **args)
    if options:
        raise TypeError(f"compress() got unexpected keyword arguments {sorted(options)}")
    if method != "toast":
        raise ValueError(f"method must be 'toast', 'replaceme' or 'toast-vit', got {method!r}")
    if loader is None:
        raise ValueError("method='toast' needs a loader of calibration batches")
    if translator not in CLOSED_FORM + TRAINED:
        raise ValueError(f"translator must be one of {CLOSED_FORM + TRAINED}, got {translator!r}")
    if fit not in ("independent", "sequential"):
        raise ValueError(f"fit must be 'independent' or 'sequential', got {fit!r}")
    if spans is not None and (budget is not None or max_error is not None):
        raise ValueError("give either spans=[(start, stop), ...] or budget/max_error, not both")
    if spans is None and budget is None and max_error is None:
        raise ValueError("give budget=<blocks to remove>, max_error=..., or both (or spans=...)")
    data = {
        "tokens": tokens,
        "blocks": blocks,
        "max_batches": max_batches,
        "max_samples": max_samples,
        "sample": sample,
        "seed": seed,
        "progress": progress,
    }
    ranks = {"distributed": distributed, "group": group}
    analysis = analyze(
        model,
        loader,
        metric=metric,
        estimator=estimator,
        folds=folds,
        backend=backend,
        **ranks,
        **data,
    )
    if budget is not None and not 1 <= budget < analysis.num_blocks:
        raise ValueError(
            f"budget={budget} must be between 1 and {analysis.num_blocks - 1}: the model has "
            f"{analysis.num_blocks} blocks and keeps at least one"
        )
    if spans is not None:
        chosen = validate_spans(spans, analysis.num_blocks)
        spans = [Span(a, b, float(analysis.errors[a, b])) for a, b in chosen]
    else:
        spans = analysis.plan(max_blocks=budget, max_error=max_error)
    if not spans:
        raise ValueError(
            "no span satisfies the constraints (max_error too small?); inspect "
            "toast.analyze(...).errors"
        )
    blocks_before = analysis.num_blocks
    params_before = count_params(model)
    fitter = _Fitter(translator, ridge, max_rows, train_steps, lr, seed, backend, progress, ranks)
    if fit == "independent":
        modules = fitter.fit_all(model, loader, spans, analysis, data)
        replace_spans(model, [(s.start, s.stop) for s in spans], modules, blocks=blocks)
    else:
        removed = 0
        for span in spans:
            where = (span.start - removed, span.stop - removed)
            module = fitter.fit_one_on(model, loader, where, data)
            replace_spans(model, [where], [module], blocks=blocks)
            removed += span.num_blocks - 1
    report = CompressionReport(
        method=method,
        translator=translator,
        spans=spans,
        conditions=fitter.conditions,
        blocks_before=blocks_before,
        blocks_after=blocks_before - sum(s.num_blocks for s in spans) + len(spans),
        params_before=params_before,
        params_after=count_params(model),
        rows=analysis.rows,
        analysis=analysis,
        fit=fit,
    )
    return model, report


class _Fitter:
    """Fits the translator of one kind for spans of a model."""

    def __init__(self, kind, ridge, max_rows, steps, lr, seed, backend, progress, ranks) -> None:
        self.kind, self.ridge, self.max_rows = kind, ridge, max_rows
        self.steps, self.lr, self.seed = steps, lr, seed
        self.backend, self.progress = backend, progress
        self.ranks = ranks  # distributed / group, for capture_moments
        self.conditions: list[float] = []

    def _closed_form(self, moments, i: int, j: int) -> Translator:
        ridge, relative = self.ridge, False
        if ridge is None and self.kind in ("linear", "affine") and moments.rows <= moments.dim:
            ridge, relative = FEW_ROWS_RIDGE, True
            warnings.warn(
                f"fitting blocks[{i}:{j}] from {moments.rows} rows of width {moments.dim}: "
                f"least squares is underdetermined, so a ridge of {FEW_ROWS_RIDGE} (relative "
                "to the mean diagonal of XᵀX) is used; pass ridge=... or more data",
                FewRowsWarning,
                stacklevel=4,
            )
        t = fit_translator(moments, i, j, kind=self.kind, ridge=ridge, ridge_relative=relative)
        self.conditions.append(t.condition)
        return t

    def _trained(self, sample: RowSample, i: int, j: int, like: nn.Module) -> nn.Module:
        module = train_translator(
            sample.state(i),
            sample.state(j),
            self.kind,
            steps=self.steps,
            lr=self.lr,
            seed=self.seed,
            progress=self.progress,
        )
        self.conditions.append(float("nan"))
        distributed = self.ranks["distributed"]
        if distributed or (distributed is None and is_distributed()):
            # each rank sampled its own shard: take rank 0's translator everywhere
            broadcast_module(module, group=self.ranks["group"])
        reference = next(like.parameters(), None)
        if reference is not None:
            module = module.to(dtype=reference.dtype, device=reference.device)
        return module

    def fit_all(self, model, loader, spans: list[Span], analysis: Analysis, data) -> list:
        if self.kind in CLOSED_FORM:
            return [self._closed_form(analysis.moments, s.start, s.stop) for s in spans]
        states = [k for s in spans for k in (s.start, s.stop)]
        stack = find_blocks(model, data["blocks"])
        with capture_rows(model, loader, states, capacity=self.max_rows, **data) as rows:
            return [
                self._trained(rows, 2 * k, 2 * k + 1, stack.blocks[s.start])
                for k, s in enumerate(spans)
            ]

    def fit_one_on(self, model, loader, where: tuple[int, int], data):
        if self.kind in CLOSED_FORM:
            moments, _ = capture_moments(
                model,
                loader,
                states=list(where),
                folds=0,
                backend=self.backend,
                **self.ranks,
                **data,
            )
            return self._closed_form(moments, 0, 1)
        stack = find_blocks(model, data["blocks"])
        with capture_rows(model, loader, list(where), capacity=self.max_rows, **data) as rows:
            return self._trained(rows, 0, 1, stack.blocks[where[0]])
