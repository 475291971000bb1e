"""What :func:`toast.search` returns: every measured candidate, the
Pareto front, the chosen model and the report around them."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from toast.methods.base import Plan

from .measure import Measurement
from .objective import higher_is_better
from .pareto import spearman
from .plot import Point, front_figure, front_svg
from .target import Target

__all__ = ["Measured", "SearchResult"]

#: How the report names and prints each measured quantity.
_METRICS = {
    "perplexity": ("perplexity", ".2f"),
    "kl": ("KL", ".4f"),
    "kl_p99": ("KL p99", ".4f"),
    "agreement": ("top-1 agreement", ".4f"),
    "accuracy": ("accuracy", ".4f"),
    "cosine": ("cosine", ".4f"),
}


@dataclass(frozen=True)
class Measured:
    """A candidate and what was measured of it; ``cached`` when the
    measurement came from an earlier call."""

    candidate: Plan
    measurement: Measurement
    cached: bool = False


@dataclass
class SearchResult:
    """A search's outcome.

    ``measured``: every measured candidate; ``front``: indices into it of
    the Pareto front (size on ``size_axis`` against quality); ``chosen``:
    the index of the chosen candidate (None when none meets the target);
    ``model``: the chosen model (None likewise, and on the block-by-block
    path, which never loads it: ``writer(folder)`` then writes it from the
    checkpoint); ``original``: the
    unmodified model measured; ``enumerated``: how many candidates applied;
    ``notes``: what the search left out and why; ``timings``: seconds per
    phase; ``calibration_passes``: passes over the calibration data this
    call made (0 when the cache held them).
    """

    target: Target
    original: Measurement
    measured: list[Measured]
    front: list[int]
    chosen: int | None
    size_axis: str
    enumerated: int
    calibration_passes: int
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    model: nn.Module | None = field(default=None, repr=False)
    writer: Callable[[str | os.PathLike], Path] | None = field(default=None, repr=False)

    @property
    def metric(self) -> str:
        return self.original.metric

    @property
    def higher_is_better(self) -> bool:
        return higher_is_better(self.metric)

    @property
    def best(self) -> Measured | None:
        return None if self.chosen is None else self.measured[self.chosen]

    def size(self, m: Measurement) -> float:
        """``m``'s size on the front's axis: parameters, MACs or seconds per
        forward, relative to the original's."""
        if self.size_axis == "params":
            return m.params / self.original.params
        if self.size_axis == "macs":  # the axis only where MACs were counted
            assert m.macs is not None and self.original.macs is not None
            return m.macs / self.original.macs
        speedup = m.speedup(self.original)
        return math.nan if not speedup else 1.0 / speedup

    @property
    def spearman(self) -> float:
        """Rank correlation of predicted error with measured quality loss
        over every measured candidate (1: the prediction ranks perfectly)."""
        return self._spearman(self.measured)

    def spearman_by_family(self) -> dict[str, float]:
        families = sorted({m.candidate.family for m in self.measured})
        return {
            f: self._spearman([m for m in self.measured if m.candidate.family == f])
            for f in families
        }

    def _spearman(self, measured: list[Measured]) -> float:
        sign = -1.0 if self.higher_is_better else 1.0
        return spearman(
            [m.candidate.predicted_error for m in measured],
            [sign * m.measurement.quality for m in measured],
        )

    def table(self) -> list[dict[str, Any]]:
        """One row per measured candidate, the original first."""
        rows = [self._row("original", None, self.original, "original")]
        for k, m in enumerate(self.measured):
            role = "chosen" if k == self.chosen else "front" if k in self.front else ""
            rows.append(self._row(m.candidate.label, m.candidate, m.measurement, role))
        return rows

    def _row(self, label: str, c: Plan | None, m: Measurement, role: str) -> dict[str, Any]:
        return {
            "candidate": label,
            "role": role,
            "predicted": None if c is None else c.predicted_error,
            **m.metrics,
            self.metric: m.quality,
            "params": m.params,
            "params_kept": m.params / self.original.params,
            "macs": m.macs,
            "forward_per_s": m.forward_per_s,
            "decode_tokens_per_s": None
            if m.throughput is None
            else m.throughput.get("decode_tokens_per_s"),
            "speedup": m.speedup(self.original),
        }

    def to_markdown(self) -> str:
        """The report: target, the table of measured candidates, the rank
        correlation, and what was left out."""
        lines = [
            f"**toast.search**: {self.target.describe()}; {self.enumerated} candidates "
            f"applied, {len(self.measured)} measured on held-out data "
            f"({sum(m.cached for m in self.measured)} from the cache); calibration passes "
            f"this call: {self.calibration_passes}.",
            "",
            *self._table_lines(),
            "",
            self._ranking_line(),
        ]
        tail = self.original.metrics.get("tail_mass")
        if tail is not None:
            lines.append(
                "KL is the divergence of each candidate's next-token distribution from the "
                "original's over the original's most likely tokens and one bucket for the rest "
                f"(a lower bound of the full KL; the rest held {tail:.2g} of the original's "
                "probability on average)."
            )
        if self.original.throughput is not None:
            lines.append(f"Throughput of the original: {_describe(self.original.throughput)}.")
            lines.append(
                "Speed-ups are forward throughput against the original timed in the same, "
                "alternating rounds."
            )
        if self.timings:
            lines.append(time_line(self.timings))
        lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines)

    @property
    def metrics(self) -> list[str]:
        """Every quantity measured of the original, the objective's first
        (the tail mass of the KL's reference is said below the table)."""
        order = list(_METRICS)
        others = [k for k in self.original.metrics if k not in (self.metric, "tail_mass")]
        others.sort(key=lambda k: order.index(k) if k in order else len(order))
        return [self.metric, *others]

    def _table_lines(self) -> list[str]:
        timed = self.original.throughput
        unit = timed.get("unit", "") if timed else ""
        decode = bool(timed and timed.get("decode_tokens_per_s"))
        names = " | ".join(_name(k) for k in self.metrics)
        header = f"| candidate | predicted error | {names} | params | kept | linear MACs |"
        header += f" forward {unit or 'throughput'} |" + (" decode tokens/s |" if decode else "")
        lines = [header + " speed-up |", "|---|" + "---:|" * (header.count("|") - 1)]
        for row in self.table():
            mark = {"chosen": " **(chosen)**", "front": " (front)"}.get(row["role"], "")
            cells = [
                f"{row['candidate']}{mark}",
                _cell(row["predicted"], ".4f"),
                *(_cell(row.get(k), _spec(k)) for k in self.metrics),
                f"{row['params']:,}",
                f"{100 * row['params_kept']:.1f}%",
                _cell(row["macs"], ","),
                _cell(row["forward_per_s"], ",.0f"),
                *([_cell(row["decode_tokens_per_s"], ",.1f")] if decode else []),
                "—" if row["speedup"] is None else f"×{row['speedup']:.2f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return lines

    def _ranking_line(self) -> str:
        families = ", ".join(f"{f} {_fmt(r)}" for f, r in self.spearman_by_family().items())
        return (
            f"Ranking check: Spearman correlation of predicted error with measured "
            f"{self.metric} loss over the measured candidates = {_fmt(self.spearman)} "
            f"(by family: {families})."
        )

    def points(self) -> list[Point]:
        """The plot's points: the original, then every measured candidate."""
        points = [
            Point(self.size(self.original), self.original.quality, "original", "", "original")
        ]
        for k, m in enumerate(self.measured):
            c = m.candidate
            role = (
                "chosen"
                if k == self.chosen
                else "front"
                if k in self.front
                else ("plain" if c.family == "plain" else "candidate")
            )
            detail = self._detail(m)
            points.append(
                Point(
                    self.size(m.measurement), m.measurement.quality, c.label, detail, role, c.family
                )
            )
        return points

    def _detail(self, measured: Measured) -> str:
        """What a point's tooltip says beside its label."""
        m, c = measured.measurement, measured.candidate
        lines = [
            f"{self.metric} {m.quality:.4g} (original {self.original.quality:.4g})",
            f"params {m.params:,} ({100 * m.params / self.original.params:.1f}% kept)",
            f"predicted error {c.predicted_error:.4g}",
        ]
        if m.macs is not None:
            lines.insert(2, f"linear MACs per sample {m.macs:,}")
        speedup = m.speedup(self.original)
        if speedup is not None:
            lines.append(f"forward ×{speedup:.2f} the original's")
        if measured.cached:
            lines.append("measured by an earlier call (cache)")
        return "\n".join(lines)

    def _axes(self) -> tuple[str, str]:
        x = {"params": "parameters", "macs": "linear MACs", "latency": "time per forward"}
        size = x.get(self.size_axis, "parameters")
        quality = _name(self.metric)
        if not self.metric.startswith("task:"):
            quality = f"held-out {quality}"
        return f"{size} (fraction of the original)", quality

    def plot(self):
        """A matplotlib figure of measured quality against size (the caller
        closes it)."""
        x, y = self._axes()
        return front_figure(
            self.points(),
            x,
            y,
            higher_is_better=self.higher_is_better,
            title=f"toast.search: {self.target.describe()}",
        )

    def svg(self) -> str:
        """The same plot as SVG: hovering a point shows its spans and settings."""
        x, y = self._axes()
        return front_svg(
            self.points(),
            x,
            y,
            higher_is_better=self.higher_is_better,
            title=f"toast.search: {self.target.describe()}",
        )

    def _repr_html_(self) -> str:
        return self.svg()

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": {"kind": self.target.kind, "value": self.target.value},
            "metric": self.metric,
            "size_axis": self.size_axis,
            "original": self.original.to_dict(),
            "measured": [
                {
                    **m.candidate.to_dict(),
                    "measurement": m.measurement.to_dict(),
                    "cached": m.cached,
                }
                for m in self.measured
            ],
            "front": self.front,
            "chosen": self.chosen,
            "spearman": self.spearman,
            "spearman_by_family": self.spearman_by_family(),
            "enumerated": self.enumerated,
            "calibration_passes": self.calibration_passes,
            "notes": self.notes,
            "timings": self.timings,
        }

    def save(self, folder: str | os.PathLike) -> Path:
        """Writes ``folder/model`` (the chosen model, reloadable with
        :func:`toast.load_pretrained`; from a checkpoint searched block by
        block, written from it without loading it), ``report.md``, ``front.png``,
        ``front.svg`` and ``search.json``; returns the folder."""
        import matplotlib.pyplot as plt

        from toast.io.save import save_pretrained

        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        if self.model is not None:
            save_pretrained(self.model, out / "model")
        elif self.writer is not None:
            self.writer(out / "model")
        (out / "report.md").write_text(self.to_markdown() + "\n")
        (out / "front.svg").write_text(self.svg())
        (out / "search.json").write_text(json.dumps(_finite(self.to_dict()), indent=1))
        figure = self.plot()
        try:
            figure.savefig(out / "front.png", dpi=120, bbox_inches="tight")
        finally:
            plt.close(figure)
        return out


def _name(metric: str) -> str:
    if metric.startswith("task:"):
        return f"{metric[len('task:') :]} accuracy"
    return _METRICS.get(metric, (metric, ""))[0]


def _spec(metric: str) -> str:
    return _METRICS.get(metric, (metric, ".4f"))[1]


def _cell(value: float | None, spec: str) -> str:
    return "—" if value is None else f"{value:{spec}}"


def _fmt(value: float) -> str:
    return "n/a (fewer than 3 measured)" if not math.isfinite(value) else f"{value:+.2f}"


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity as None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _describe(throughput: dict[str, Any]) -> str:
    parts = [
        f"{throughput['forward_per_s']:,.1f} {throughput['unit']} forward "
        f"(batch {throughput['batch_size']}"
        + (f" × {throughput['seq_len']} tokens" if throughput.get("seq_len") else "")
        + ", no KV cache)"
    ]
    if throughput.get("decode_tokens_per_s"):
        parts.append(
            f"{throughput['decode_tokens_per_s']:,.1f} tokens/s decoding "
            f"{throughput['new_tokens']} new tokens with the KV cache (batch 1)"
        )
    parts.append(f"{throughput['device']}, median of {throughput['rounds']} rounds")
    return "; ".join(parts)


#: The phases of each measured model, in the order the time line says them.
_PHASES = ("build", "held-out", "latency", "MACs")


def time_line(timings: dict[str, float]) -> str:
    """``timings`` (:attr:`SearchResult.timings`) in one line: the calibration,
    the original's measurement, every candidate's phases summed, the
    chosen model's build and the total (each candidate's own in
    ``search.json``)."""
    labels = {k.rpartition(": ")[0] for k in timings if ": " in k} - {"original", "chosen"}

    def phases(labelled: set[str]) -> str:
        sums = dict.fromkeys(_PHASES, 0.0)
        for key, seconds in timings.items():
            label, _, phase = key.rpartition(": ")
            if label in labelled and phase in sums:
                sums[phase] += seconds
        return ", ".join(f"{p} {v:.1f}" for p, v in sums.items() if v)

    parts = [f"preparation {timings.get('preparation', 0.0):.1f}"]
    parts.append(f"calibration {timings.get('calibration', 0.0):.1f}")
    parts.append(f"original: {phases({'original'}) or '(cached)'}")
    if labels:
        parts.append(f"{len(labels)} candidates: {phases(labels)}")
    if "chosen: build" in timings:
        parts.append(f"chosen model built {timings['chosen: build']:.1f}")
    return f"Time (s): {'; '.join(parts)}; total {timings.get('total', 0.0):.1f}."
