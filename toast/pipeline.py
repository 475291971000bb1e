"""``toast.compress``: analyse, plan, fit and patch in one pass over the data."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from toast.analysis import Analysis, Span, analyze
from toast.core import fit_translator
from toast.patch import replace_spans

__all__ = ["CompressionReport", "compress", "count_params"]


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
            f"by {len(self.spans)} {self.translator} translator(s), fitted on {self.rows} rows.",
            "",
            "| blocks | paper (s→e) | predicted error | condition |",
            "|---|---|---:|---:|",
        ]
        for span, cond in zip(self.spans, self.conditions, strict=True):
            lines.append(
                f"| [{span.start}:{span.stop}] | {span.paper} | {span.error:.4g} | {cond:.3g} |"
            )
        lines += [
            "",
            f"Parameters: {self.params_before:,} → {self.params_after:,} "
            f"(−{100 * self.compression_by_params:.1f}%); blocks: {self.blocks_before} → "
            f"{self.blocks_after} (−{100 * self.compression_by_blocks:.1f}%).",
        ]
        return "\n".join(lines)


def compress(
    model: nn.Module,
    loader: Iterable,
    *,
    method: Literal["toast"] = "toast",
    budget: int | None = None,
    max_error: float | None = None,
    translator: str = "affine",
    metric: str = "linear",
    estimator: Literal["cv", "gcv", "in_sample"] = "cv",
    folds: int = 5,
    tokens: str = "all",
    blocks: str | None = None,
    ridge: float | None = None,
    max_batches: int | None = None,
    max_samples: int | None = None,
    progress: bool = True,
) -> tuple[nn.Module, CompressionReport]:
    """Replaces redundant spans of blocks by closed-form translators, in place.

    One pass over ``loader`` gives the moments; the error matrix (``metric``,
    ``estimator``) ranks spans; :meth:`Analysis.plan` picks non-overlapping
    spans removing up to ``budget`` blocks (each within ``max_error`` if
    given); each span gets a ``translator`` fitted on the original model's
    activations (the papers' protocol) and the model is patched. Returns the
    model and a :class:`CompressionReport`.
    """
    if method != "toast":
        raise ValueError(f"method must be 'toast', got {method!r}")
    if budget is None and max_error is None:
        raise ValueError("give budget=<blocks to remove>, max_error=..., or both")
    analysis = analyze(
        model,
        loader,
        metric=metric,
        estimator=estimator,
        folds=folds,
        tokens=tokens,
        blocks=blocks,
        max_batches=max_batches,
        max_samples=max_samples,
        progress=progress,
    )
    spans = analysis.plan(max_blocks=budget, max_error=max_error)
    if not spans:
        raise ValueError(
            "no span satisfies the constraints (max_error too small?); inspect "
            "toast.analyze(...).errors"
        )
    fitted = [
        fit_translator(analysis.moments, s.start, s.stop, kind=translator, ridge=ridge)
        for s in spans
    ]
    blocks_before = analysis.num_blocks
    params_before = count_params(model)
    replace_spans(model, [(s.start, s.stop) for s in spans], fitted, blocks=blocks)
    report = CompressionReport(
        method=method,
        translator=translator,
        spans=spans,
        conditions=[t.condition for t in fitted],
        blocks_before=blocks_before,
        blocks_after=blocks_before - sum(s.num_blocks for s in spans) + len(spans),
        params_before=params_before,
        params_after=count_params(model),
        rows=analysis.rows,
        analysis=analysis,
    )
    return model, report
