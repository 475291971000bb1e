"""The search plot: the hand-written SVG (tooltips, escaping, degenerate data)
and the matplotlib figure (one marker per point, y scale)."""

import math
import xml.etree.ElementTree as ET

import pytest

from toast.frontier.plot import Point, front_figure, front_svg

NS = "{http://www.w3.org/2000/svg}"


def _search() -> list[Point]:
    """A small perplexity search: two families, a front, a chosen point, the
    original and two plain removals, in no particular order."""
    return [
        Point(90.0, 400.0, "toast affine blocks[2:6]", "spans: [2, 6)", family="toast"),
        Point(120.0, 14.0, "original", role="original"),
        Point(100.0, 60.0, "toast blocks[3:5]", "spans: [3, 5)", role="front", family="toast"),
        Point(95.0, 250.0, "replaceme blocks[4:7]", "cut: 4..7", family="replaceme"),
        Point(110.0, 30.0, "toast blocks[4:5]", "spans: [4, 5)", role="chosen", family="toast"),
        Point(115.0, 18.0, "replaceme blocks[5:6]", role="front", family="replaceme"),
        Point(100.0, 900.0, "drop blocks[3:5]", role="plain"),
        Point(105.0, 120.0, "replaceme blocks[3:5]", family="replaceme"),
    ]


def _svg(points, **kwargs) -> ET.Element:
    kwargs.setdefault("higher_is_better", False)
    return ET.fromstring(front_svg(points, "parameters (M)", "perplexity", **kwargs))


def _point_groups(root: ET.Element) -> list[ET.Element]:
    return [g for g in root.iter(f"{NS}g") if g.get("class") == "point"]


def _title_text(group: ET.Element) -> str:
    title = group.find(f"{NS}title")
    assert title is not None and title.text is not None
    return title.text


def _numbers(text: str) -> list[float]:
    return [float(v) for v in text.replace(",", " ").split()]


@pytest.fixture
def figure_of():
    """Builds figures with front_figure and closes them all afterwards."""
    plt = pytest.importorskip("matplotlib.pyplot")
    made = []

    def build(points, higher_is_better=False):
        fig = front_figure(
            points, "parameters (M)", "perplexity", higher_is_better=higher_is_better
        )
        made.append(fig)
        return fig

    yield build
    for fig in made:
        plt.close(fig)
    assert not set(plt.get_fignums()) & {fig.number for fig in made}


def test_svg_parses_with_an_svg_root_of_the_requested_size():
    root = _svg(_search(), width=500, height=300)
    assert root.tag == f"{NS}svg"
    assert (root.get("width"), root.get("height")) == ("500", "300")
    assert root.get("viewBox") == "0 0 500 300"


def test_svg_has_one_title_per_point_with_its_label_and_detail():
    points = _search()
    groups = _point_groups(_svg(points))
    assert len(groups) == len(points)
    assert len([t for g in groups for t in g.iter(f"{NS}title")]) == len(points)
    for group in groups:
        point = points[int(group.get("data-index"))]
        text = _title_text(group)
        assert text.split("\n")[0] == point.label
        assert point.detail in text


def test_svg_special_characters_round_trip_exactly():
    label = "toast <affine> & \"blocks[4:6]\" 'x' $5"
    detail = "spans: [4, 6) & [7, 8)\nridge: <1e-3>\r\n\tdone"
    family = 'a&b "<c>"\n'
    root = _svg([Point(1.0, 2.0, label, detail, family=family)])
    (group,) = _point_groups(root)
    assert _title_text(group).startswith(f"{label}\n{detail}\n")
    assert group.get("data-family") == family


def test_svg_replaces_characters_xml_cannot_carry():
    (group,) = _point_groups(_svg([Point(1.0, 2.0, "bad\x00\x1bname")]))
    assert _title_text(group).startswith("bad\ufffd\ufffdname")


def test_svg_points_keep_their_roles_with_the_chosen_drawn_last():
    points = _search()
    groups = _point_groups(_svg(points))
    assert [g.get("data-role") for g in groups if g.get("data-role") == "chosen"] == ["chosen"]
    for group in groups:
        assert group.get("data-role") == points[int(group.get("data-index"))].role
    assert groups[-1].get("data-role") == "chosen"
    assert sorted(int(g.get("data-index")) for g in groups) == list(range(len(points)))


@pytest.mark.parametrize(
    "points",
    [
        [Point(5.0, 3.0, "one")],
        [Point(5.0, 3.0, "a", role="front"), Point(5.0, 7.0, "b", role="front")],
        [Point(0.0, 0.0, "a"), Point(0.0, 0.0, "b", role="chosen")],
        [Point(1e-320, 1e300, "tiny x"), Point(1e-320, -1e300, "huge y")],
    ],
    ids=["one-point", "equal-x", "equal-x-and-y", "extreme-values"],
)
def test_svg_degenerate_input_gives_finite_coordinates(points):
    root = _svg(points)
    assert len(_point_groups(root)) == len(points)
    checked = 0
    for element in root.iter():
        for name, value in element.attrib.items():
            if name == "points":
                numbers = _numbers(value)
            elif name in ("x", "y", "x1", "x2", "y1", "y2", "cx", "cy", "r", "width", "height"):
                numbers = [float(value)]
            else:
                continue
            assert all(math.isfinite(v) for v in numbers), (element.tag, name, value)
            checked += len(numbers)
    assert checked > 0


def test_svg_skips_points_that_are_not_finite():
    points = [
        Point(1.0, 2.0, "kept"),
        Point(math.nan, 2.0, "nan x"),
        Point(3.0, math.inf, "inf y", role="front"),
        Point(4.0, 5.0, "kept too", role="chosen"),
    ]
    groups = _point_groups(_svg(points))
    assert sorted(int(g.get("data-index")) for g in groups) == [0, 3]


def test_svg_with_no_finite_point_still_renders_a_note():
    root = _svg([Point(math.nan, 1.0, "failed")])
    assert _point_groups(root) == []
    assert any(t.text == "no point with finite values" for t in root.iter(f"{NS}text"))


@pytest.mark.parametrize("plot", [front_svg, front_figure], ids=["svg", "figure"])
def test_empty_points_raise_value_error(plot):
    with pytest.raises(ValueError, match="no measured point to plot"):
        plot([], "parameters", "perplexity", higher_is_better=False)


def test_unknown_role_is_rejected():
    with pytest.raises(ValueError, match="unknown point role 'best'"):
        Point(1.0, 2.0, "x", role="best")


def _centre_x(group: ET.Element) -> float:
    """The x of a point's marker: a circle's centre, or a star's top vertex."""
    shape = next(iter(group))
    if shape.tag == f"{NS}circle":
        return float(shape.get("cx"))
    return _numbers(shape.get("points"))[0]


def test_svg_front_polyline_visits_front_and_chosen_points_by_increasing_x():
    root = _svg(_search())
    (line,) = [e for e in root.iter(f"{NS}polyline") if e.get("class") == "front"]
    xs = _numbers(line.get("points"))[::2]
    front = [g for g in _point_groups(root) if g.get("data-role") in ("front", "chosen")]
    assert len(front) == 3
    assert xs == sorted(_centre_x(g) for g in front)
    assert xs == sorted(xs) and len(set(xs)) == len(xs)


def test_svg_axis_ticks_are_round_numbers():
    root = _svg([Point(0.13, 0.71, "a"), Point(0.92, 0.88, "b")], higher_is_better=True)
    axes = next(g for g in root.iter(f"{NS}g") if g.get("class") == "axes")
    ticks = [float(t.text) for t in axes.iter(f"{NS}text") if t.text[0].isdigit()]
    assert 6 <= len(ticks) <= 14
    for tick in ticks:
        assert round(tick * 20) == pytest.approx(tick * 20)


def test_svg_y_label_says_which_way_is_better():
    texts = [t.text for t in _svg(_search()).iter(f"{NS}text")]
    assert "perplexity (lower is better)" in texts
    texts = [t.text for t in _svg(_search(), higher_is_better=True).iter(f"{NS}text")]
    assert "perplexity (higher is better)" in texts


def test_figure_has_one_marker_per_finite_point(figure_of):
    points = [*_search(), Point(math.nan, 3.0, "failed"), Point(2.0, math.inf, "diverged")]
    ax = figure_of(points).axes[0]
    scattered = sum(len(c.get_offsets()) for c in ax.collections)
    marked = sum(
        len(line.get_xdata()) for line in ax.lines if line.get_marker() not in ("None", "")
    )
    assert scattered + marked == len(points) - 2
    assert ax.get_legend() is not None


def test_figure_y_scale_is_log_for_a_wide_perplexity_range(figure_of):
    ax = figure_of(_search(), higher_is_better=False).axes[0]
    assert ax.get_yscale() == "log"
    assert ax.get_ylabel() == "perplexity (lower is better)"


@pytest.mark.parametrize(
    ("ys", "higher_is_better"),
    [((14.0, 20.0, 40.0), False), ((0.1, 0.5, 2.0), True), ((0.0, 5.0, 500.0), False)],
    ids=["narrow-perplexity", "higher-is-better", "non-positive"],
)
def test_figure_y_scale_is_linear_otherwise(figure_of, ys, higher_is_better):
    points = [Point(float(k), y, f"p{k}") for k, y in enumerate(ys)]
    ax = figure_of(points, higher_is_better=higher_is_better).axes[0]
    assert ax.get_yscale() == "linear"


def test_figure_draws_with_special_characters_in_labels(figure_of, tmp_path):
    points = [Point(1.0, 2.0, "cost $5 <&>", role="chosen"), Point(2.0, 1.0, "$x", role="original")]
    figure_of(points).savefig(tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
