"""The report plot of a compression search: measured quality against size or latency.

Every measured candidate is a point; the Pareto front is highlighted, the chosen
candidate, the original model and the "plain removal" baselines are marked, so a
reader sees at once what the search bought and what it was compared with.

Two renderings come from the same points. :func:`front_figure` is a matplotlib
figure for the saved PNG. :func:`front_svg` is a small SVG written by hand, with
no dependency, whose points each carry a ``<title>`` child: browsers and Jupyter
show it on hover, which makes the notebook's ``_repr_html_`` interactive (which
candidate is that dot, with which spans and settings) without plotly or widgets.

Points whose coordinates are NaN or infinite cannot be placed and are skipped
(a failed measurement must not cost the whole report); no point at all is an
error of the caller.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["ROLES", "Point", "front_figure", "front_svg"]

# Drawing order, bottom layer first: the marked points stay visible (and
# hoverable) above the crowd of candidates.
ROLES: tuple[str, ...] = ("candidate", "plain", "front", "original", "chosen")

# Family colours, given in order of first appearance; red is kept for the front.
_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
)
_UNNAMED = "#7f7f7f"  # candidates of no named family stay grey
_STRONG = "#d62728"  # the front line, front outlines and the chosen star
_PLAIN = "#444444"
_EMPTY_NOTE = "no point with finite values"

# Characters XML 1.0 cannot carry at all (C0 controls but tab/newline/CR, lone
# surrogates, U+FFFE/U+FFFF): replaced so that the document still parses.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


@dataclass(frozen=True)
class Point:
    """One measured candidate of a search, placed at ``(x, y)``.

    ``role`` decides how it is drawn (one of :data:`ROLES`); ``family`` gives
    its colour, so that the methods of a mixed search can be told apart.
    ``label`` names it in the legend and tooltip; ``detail`` (one item a line)
    is the tooltip's longer text.
    """

    x: float
    y: float
    label: str
    detail: str = ""
    role: str = "candidate"
    family: str = ""

    def __post_init__(self) -> None:
        # A misspelt role would silently draw the chosen point as a grey dot.
        if self.role not in ROLES:
            raise ValueError(f"unknown point role {self.role!r}: expected one of {ROLES}")


@dataclass(frozen=True)
class _Placed:
    """A point with finite float coordinates and its index in the input."""

    index: int
    x: float
    y: float
    point: Point


@dataclass
class _Group:
    """The points drawn alike, which share one legend entry."""

    role: str
    colour: str
    members: list[_Placed] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The legend text: candidates by family, marked points by their name
        when there is one of them."""
        first = self.members[0].point
        if self.role == "candidate":
            return f"{first.family} candidates" if first.family else "candidates"
        if self.role == "plain":
            return "plain removal"
        if self.role == "front":
            return "Pareto front"
        names = {m.point.label for m in self.members}
        return f"{self.role} ({first.label})" if len(names) == 1 and first.label else self.role


def _coordinates(point: Point) -> tuple[float, float] | None:
    """The point's coordinates as floats, or None when it cannot be placed."""
    try:
        x, y = float(point.x), float(point.y)
    except (TypeError, ValueError, OverflowError):
        return None
    return (x, y) if math.isfinite(x) and math.isfinite(y) else None


def _placed(points: Sequence[Point]) -> list[_Placed]:
    """The placeable points in drawing order: by role layer, then input order."""
    if len(points) == 0:
        raise ValueError("no measured point to plot")
    placed = []
    for index, point in enumerate(points):
        xy = _coordinates(point)
        if xy is not None:
            placed.append(_Placed(index, xy[0], xy[1], point))
    layer = {role: k for k, role in enumerate(ROLES)}
    return sorted(placed, key=lambda p: (layer[p.point.role], p.index))


def _family_colours(points: Sequence[Point]) -> dict[str, str]:
    """A colour per family, by first appearance in the input, so that the
    figure and the SVG agree and a family keeps its colour across roles."""
    colours: dict[str, str] = {}
    named = 0
    for point in points:
        if point.family not in colours:
            if point.family:
                colours[point.family] = _PALETTE[named % len(_PALETTE)]
                named += 1
            else:
                colours[point.family] = _UNNAMED
    return colours


def _groups(placed: Sequence[_Placed], colours: dict[str, str]) -> list[_Group]:
    """Candidates split by family (the colour tells the family); every other
    role is one group whatever its families, as its marker already says it."""
    groups: dict[tuple[str, str], _Group] = {}
    for item in placed:
        role, family = item.point.role, item.point.family
        key = (role, family if role == "candidate" else "")
        if key not in groups:
            groups[key] = _Group(role, colours[family])
        groups[key].members.append(item)
    return list(groups.values())


def _paint(role: str, colour: str) -> tuple[str, str]:
    """Fill and outline of a marker: the role decides, the family colour fills
    the plain dots of candidates and front points."""
    if role == "plain":
        return "none", _PLAIN
    if role == "front":
        return colour, _STRONG
    if role == "original":
        return "black", "black"
    if role == "chosen":
        return _STRONG, "black"
    return colour, "none"


def _front_path(placed: Sequence[_Placed]) -> list[_Placed]:
    """The front (and chosen) points by increasing x, the line's vertices."""
    front = [p for p in placed if p.point.role in ("front", "chosen")]
    return sorted(front, key=lambda p: (p.x, p.y, p.index))


def _log_y(placed: Sequence[_Placed], higher_is_better: bool) -> bool:
    """Perplexities of damaged models span decades, which a linear axis would
    squash into one line; accuracies and cosines stay linear."""
    ys = [p.y for p in placed]
    if higher_is_better or not ys or min(ys) <= 0:
        return False
    return max(ys) / min(ys) > 10


def _y_title(y_label: str, higher_is_better: bool) -> str:
    """The y label with its direction: perplexity and accuracy read opposite ways."""
    return f"{y_label} ({'higher' if higher_is_better else 'lower'} is better)"


def _title(title: str, x_label: str, y_label: str) -> str:
    return title or f"{y_label} against {x_label}"


# --------------------------------------------------------------------------- matplotlib

_MPL_STYLE: dict[str, dict[str, Any]] = {
    "candidate": {"marker": "o", "s": 22, "alpha": 0.55, "linewidths": 0.0, "zorder": 3},
    "plain": {"marker": "s", "s": 42, "linewidths": 1.3, "zorder": 4},
    "front": {"marker": "o", "s": 64, "linewidths": 1.6, "zorder": 5},
    "original": {"marker": "D", "s": 64, "linewidths": 0.8, "zorder": 6},
    "chosen": {"marker": "*", "s": 260, "linewidths": 0.8, "zorder": 7},
}


def _literal(text: str) -> str:
    """Text matplotlib shows as written: a ``$`` would otherwise start mathtext
    and a label such as ``cost $5`` would fail when the figure is drawn."""
    return text.replace("$", r"\$")


def front_figure(
    points: Sequence[Point],
    x_label: str,
    y_label: str,
    *,
    higher_is_better: bool,
    title: str = "",
) -> Figure:
    """The search plot as a matplotlib figure, for the saved PNG report.

    Every placeable point is exactly one marker (one scatter per legend entry);
    the front is a line without markers beneath them. The caller saves and
    closes the figure. Raises ValueError when ``points`` is empty.
    """
    placed = _placed(points)
    colours = _family_colours(points)
    import matplotlib

    # Headless by default, but never switch a backend already chosen (a
    # notebook's inline one): switching closes the user's open figures.
    if "matplotlib.pyplot" not in sys.modules and not os.environ.get("MPLBACKEND"):
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.5), layout="constrained")
    path = _front_path(placed)
    if len(path) >= 2:
        ax.plot([p.x for p in path], [p.y for p in path], color=_STRONG, lw=1.5, zorder=2)
    for group in _groups(placed, colours):
        fills = [_paint(group.role, colours[m.point.family])[0] for m in group.members]
        ax.scatter(
            [m.x for m in group.members],
            [m.y for m in group.members],
            facecolors=fills,
            edgecolors=_paint(group.role, group.colour)[1],
            label=_literal(group.label),
            **_MPL_STYLE[group.role],
        )
    if not placed:
        ax.text(0.5, 0.5, _EMPTY_NOTE, transform=ax.transAxes, ha="center", va="center")
    if _log_y(placed, higher_is_better):
        from matplotlib.ticker import LogFormatter

        ax.set_yscale("log")
        # Plain numbers (60, 200) read better than 6x10^1 for perplexities.
        ax.yaxis.set_major_formatter(LogFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    ax.set_xlabel(_literal(x_label))
    ax.set_ylabel(_literal(_y_title(y_label, higher_is_better)))
    ax.set_title(_literal(_title(title, x_label, y_label)))
    ax.grid(alpha=0.3)
    if placed:
        ax.legend(fontsize=8, loc="best")
    return fig


# --------------------------------------------------------------------------- SVG


def _xml(text: str, attribute: bool = False) -> str:
    """XML-escaped text that parses back to exactly ``text``: a carriage
    return (and, in attributes, newline and tab) would be normalised by the
    parser, so they are written as character references."""
    text = _NOT_XML.sub("\ufffd", str(text))
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = text.replace("\r", "&#13;")
    if attribute:
        text = text.replace('"', "&quot;").replace("\n", "&#10;").replace("\t", "&#9;")
    return text


def _num(value: float) -> str:
    return f"{value:.2f}"


@dataclass(frozen=True)
class _Axis:
    """An axis range and its ticks, in log10 units when ``log``."""

    lo: float
    hi: float
    ticks: tuple[float, ...]
    log: bool = False

    def fraction(self, value: float) -> float:
        """Where ``value`` falls, 0 at ``lo`` and 1 at ``hi``; the middle when
        the range is empty or too wide for a float, rather than a NaN."""
        return self.at(math.log10(value) if self.log else value)

    def at(self, unit: float) -> float:
        """The fraction of a position in axis units (log10 ones when ``log``)."""
        t = (unit - self.lo) / (self.hi - self.lo) if self.hi != self.lo else 0.5
        return t if math.isfinite(t) else 0.5

    def text(self, tick: float) -> str:
        """A tick's label, with as many digits as the step needs (ticks
        1000000.5 apart must not all read 1e+06) and a true zero for the
        rounding residue of a tick at zero."""
        if self.log:
            return f"{10.0**tick:g}" if abs(tick) < 300 else f"1e{tick:+.0f}"
        step = abs(self.ticks[1] - self.ticks[0]) if len(self.ticks) > 1 else 0.0
        if not (math.isfinite(step) and step > 0):
            return f"{tick:.6g}"
        if abs(tick) <= step * 1e-9:
            return "0"
        largest = max(abs(self.lo), abs(self.hi))
        digits = math.floor(math.log10(largest)) - math.floor(math.log10(step)) + 2
        return f"{tick:.{min(max(digits, 3), 17)}g}"


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten at least ``raw``."""
    magnitude = 10.0 ** math.floor(math.log10(raw))
    for mantissa in (1.0, 2.0, 2.5, 5.0):
        if mantissa * magnitude >= raw:
            return mantissa * magnitude
    return 10.0 * magnitude


def _linear_axis(lo: float, hi: float, count: int = 5) -> _Axis:
    """Round ticks, about ``count`` intervals, enclosing ``[lo, hi]``; an
    empty range (one point, equal values) is widened around its value."""
    if lo == hi:
        pad = abs(lo) * 0.05 or 1.0
        lo, hi = lo - pad, hi + pad
    span = hi - lo
    if not (math.isfinite(span) and span > 0):
        return _Axis(lo, hi, (lo, hi))
    step = _nice_step(span / count)
    if not (math.isfinite(step) and step > 0):
        return _Axis(lo, hi, (lo, hi))
    first, last = math.floor(lo / step), math.ceil(hi / step)
    ticks = tuple(k * step for k in range(first, last + 1))
    if len(ticks) < 2 or not all(math.isfinite(t) for t in ticks):
        return _Axis(lo, hi, (lo, hi))
    return _Axis(ticks[0], ticks[-1], ticks)


def _log_axis(lo: float, hi: float, count: int = 5) -> _Axis:
    """Decades enclosing ``[lo, hi]`` (both positive): every k-th one ticked
    so that there are at most about ``count`` + 1 ticks, with 2 and 5 times
    each decade as well when there are only one or two."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    last = max(last, first + 1)
    stride = max(1, math.ceil((last - first) / count))
    last = first + math.ceil((last - first) / stride) * stride
    ticks = [float(k) for k in range(first, last + 1, stride)]
    if last - first <= 2:
        ticks += [k + math.log10(m) for k in range(first, last) for m in (2.0, 5.0)]
    return _Axis(float(first), float(last), tuple(sorted(ticks)), True)


@dataclass(frozen=True)
class _Frame:
    """The plot area in pixels and the two axes that map data into it."""

    left: float
    top: float
    width: float
    height: float
    x: _Axis
    y: _Axis

    def px(self, x: float, y: float) -> tuple[float, float]:
        return (
            self.left + self.x.fraction(x) * self.width,
            self.top + (1.0 - self.y.fraction(y)) * self.height,
        )


def _shape(role: str, cx: float, cy: float, colour: str) -> str:
    """The marker of a role at ``(cx, cy)``: a dot, a hollow square (plain
    removal), a diamond (original) or a star (chosen)."""
    fill, stroke = _paint(role, colour)
    paint = f'fill="{fill}" stroke="{stroke}"'
    if role == "plain":
        return (
            f'<rect x="{_num(cx - 4.5)}" y="{_num(cy - 4.5)}" width="9" height="9" '
            f'{paint} stroke-width="1.3"/>'
        )
    if role in ("original", "chosen"):
        spikes, outer, inner = (2, 6.5, 6.5) if role == "original" else (5, 9.0, 3.8)
        corners = []
        for k in range(2 * spikes):
            radius = outer if k % 2 == 0 else inner
            angle = math.pi * k / spikes - math.pi / 2
            corners.append(
                f"{_num(cx + radius * math.cos(angle))},{_num(cy + radius * math.sin(angle))}"
            )
        return f'<polygon points="{" ".join(corners)}" {paint} stroke-width="0.8"/>'
    if role == "front":
        return f'<circle cx="{_num(cx)}" cy="{_num(cy)}" r="5.5" {paint} stroke-width="1.6"/>'
    return f'<circle cx="{_num(cx)}" cy="{_num(cy)}" r="3.8" {paint} fill-opacity="0.6"/>'


def _tooltip(item: _Placed, x_label: str, y_label: str) -> str:
    """Label, detail, then the measured values, one item a line."""
    point = item.point
    lines = [point.label]
    if point.detail:
        lines.append(point.detail)
    lines.append(f"{y_label}: {item.y:.6g}; {x_label}: {item.x:.6g}")
    return "\n".join(lines)


def _svg_points(
    placed: Sequence[_Placed], colours: dict[str, str], frame: _Frame, x_label: str, y_label: str
) -> list[str]:
    """The front line, then one ``<g class="point">`` per point with its
    ``<title>`` tooltip, in drawing order (``data-index`` is the input index)."""
    parts = []
    path = _front_path(placed)
    if len(path) >= 2:
        vertices = " ".join(",".join(map(_num, frame.px(p.x, p.y))) for p in path)
        parts.append(
            f'<polyline class="front" points="{vertices}" fill="none" stroke="{_STRONG}" '
            'stroke-width="1.5"/>'
        )
    for item in placed:
        cx, cy = frame.px(item.x, item.y)
        role, family = item.point.role, item.point.family
        parts.append(
            f'<g class="point" data-role="{role}" data-family="{_xml(family, True)}" '
            f'data-index="{item.index}">{_shape(role, cx, cy, colours[family])}'
            f"<title>{_xml(_tooltip(item, x_label, y_label))}</title></g>"
        )
    return parts


def _grid_line(x1: float, y1: float, x2: float, y2: float) -> str:
    return (
        f'<line x1="{_num(x1)}" y1="{_num(y1)}" x2="{_num(x2)}" y2="{_num(y2)}" stroke="#e4e4e4"/>'
    )


def _svg_axes(frame: _Frame, x_label: str, y_title: str) -> list[str]:
    """Grid, frame, tick labels and axis labels."""
    left, top, right = frame.left, frame.top, frame.left + frame.width
    bottom = frame.top + frame.height
    parts = ['<g class="axes">']
    for tick in frame.x.ticks:
        px = left + frame.x.at(tick) * frame.width
        parts.append(_grid_line(px, top, px, bottom))
        parts.append(
            f'<text x="{_num(px)}" y="{_num(bottom + 15)}" text-anchor="middle">'
            f"{_xml(frame.x.text(tick))}</text>"
        )
    for tick in frame.y.ticks:
        py = bottom - frame.y.at(tick) * frame.height
        parts.append(_grid_line(left, py, right, py))
        parts.append(
            f'<text x="{_num(left - 6)}" y="{_num(py + 4)}" text-anchor="end">'
            f"{_xml(frame.y.text(tick))}</text>"
        )
    parts.append(
        f'<rect x="{_num(left)}" y="{_num(top)}" width="{_num(frame.width)}" '
        f'height="{_num(frame.height)}" fill="none" stroke="#444444"/>'
    )
    middle_y = top + frame.height / 2
    parts.append(
        f'<text x="{_num(left + frame.width / 2)}" y="{_num(bottom + 36)}" '
        f'text-anchor="middle">{_xml(x_label)}</text>'
    )
    parts.append(
        f'<text x="16" y="{_num(middle_y)}" text-anchor="middle" '
        f'transform="rotate(-90 16 {_num(middle_y)})">{_xml(y_title)}</text>'
    )
    parts.append("</g>")
    return parts


def _svg_legend(groups: Sequence[_Group], width: int, top: float) -> tuple[list[str], float]:
    """One entry per group, flowed into rows across the width; returns the
    elements and the height they take."""
    parts = ['<g class="legend">']
    x, y, rows = 12.0, top, 0
    for group in groups:
        text = group.label
        size = 22.0 + 6.2 * len(text) + 12.0
        if rows == 0 or (x + size > width - 8 and x > 12.0):
            x, rows = 12.0, rows + 1
            y = top + 16.0 * (rows - 1)
        parts.append(_shape(group.role, x + 8, y, group.colour))
        parts.append(f'<text x="{_num(x + 20)}" y="{_num(y + 4)}">{_xml(text)}</text>')
        x += size
    parts.append("</g>")
    return parts, 16.0 * rows


def _svg_frame(
    placed: Sequence[_Placed], log_y: bool, width: int, height: int, top: float
) -> _Frame:
    """The plot area left by the margins, and axes that enclose the points."""
    left, right, bottom = 74.0, 18.0, 48.0
    if placed:
        xs, ys = [p.x for p in placed], [p.y for p in placed]
        x_axis = _linear_axis(min(xs), max(xs))
        y_axis = _log_axis(min(ys), max(ys)) if log_y else _linear_axis(min(ys), max(ys))
    else:
        x_axis = y_axis = _linear_axis(0.0, 1.0)
    plot_width = max(width - left - right, 10.0)
    plot_height = max(height - top - bottom, 10.0)
    return _Frame(left, top, plot_width, plot_height, x_axis, y_axis)


def front_svg(
    points: Sequence[Point],
    x_label: str,
    y_label: str,
    *,
    higher_is_better: bool,
    title: str = "",
    width: int = 640,
    height: int = 420,
) -> str:
    """The search plot as a self-contained SVG string whose points show a
    tooltip on hover, for the notebook's ``_repr_html_``.

    Same data and choices as :func:`front_figure` (front line, markers per
    role, log y for wide perplexities), written by hand so that it is small
    and needs nothing installed. Each placeable point is a
    ``<g class="point" data-role=... data-index=...>`` holding its marker and a
    ``<title>`` (label, detail, values). Raises ValueError when ``points`` is
    empty or the size is not positive.
    """
    placed = _placed(points)
    if width <= 0 or height <= 0:
        raise ValueError(f"the SVG size must be positive, not {width}x{height}")
    colours = _family_colours(points)
    heading = _title(title, x_label, y_label)
    legend, legend_height = _svg_legend(_groups(placed, colours), width, 40.0)
    frame = _svg_frame(
        placed, _log_y(placed, higher_is_better), width, height, 44.0 + legend_height
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="toast-front" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" '
        f'font-size="11" role="img" aria-label="{_xml(heading, True)}">',
        "<style>.toast-front .point:hover > :first-child { stroke-width: 3; }</style>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{_num(width / 2)}" y="20" text-anchor="middle" font-size="13">'
        f"{_xml(heading)}</text>",
        *legend,
        *_svg_axes(frame, x_label, _y_title(y_label, higher_is_better)),
        *_svg_points(placed, colours, frame, x_label, y_label),
    ]
    if not placed:
        parts.append(
            f'<text x="{_num(frame.left + frame.width / 2)}" '
            f'y="{_num(frame.top + frame.height / 2)}" text-anchor="middle">{_EMPTY_NOTE}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)
