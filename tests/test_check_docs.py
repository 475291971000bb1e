"""scripts/check_docs.py: the README's quoted figures equal their results
files, and a figure changed by hand fails the check."""

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the benchmark tables are rendered by the benchmarks' code

from tests._helpers import load_script  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_docs.py"
check_docs = load_script(SCRIPT)


@pytest.fixture
def copy(tmp_path):
    """The quoting docs and the results files, copied into ``tmp_path``
    (one missing here stays missing there, for ``check`` to name)."""
    for quote in check_docs.QUOTES:
        for name in (*quote.sources, *quote.docs):
            if not (ROOT / name).is_file():
                continue
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, tmp_path / name)
    return tmp_path


def _edit(path: Path, name: str, old: str, new: str) -> None:
    """Replaces ``old`` by ``new`` once, inside the passage ``name``."""
    text = path.read_text()
    start = text.index(f"<!-- {name} -->")
    at = text.index(old, start)
    assert at < text.index(f"<!-- /{name} -->")
    path.write_text(text[:at] + new + text[at + len(old) :])


def test_every_quoted_passage_matches_its_results_file():
    assert check_docs.check(ROOT) == []


def test_the_copy_passes_before_any_edit(copy):
    assert check_docs.check(copy) == []


@pytest.mark.parametrize(
    ("doc", "name"),
    [
        ("README.md", "demo"),
        ("README.md", "demo-llm"),
        ("README.md", "costs"),
        ("README.md", "peers"),
        ("benchmarks/README.md", "accuracy"),
        ("README.md", "highlights"),
    ],
)
def test_a_figure_changed_by_hand_fails_the_check(copy, doc, name):
    text = (copy / doc).read_text()
    passage = text[text.index(f"<!-- {name} -->") : text.index(f"<!-- /{name} -->")]
    digit = next(c for c in passage.split("-->", 1)[1] if c in "123456789")
    _edit(copy / doc, name, digit, str(int(digit) % 9 + 1))
    problems = check_docs.check(copy)
    assert len(problems) == 1 and problems[0].startswith(f"{doc}: the '{name}' passage differs")


def test_write_restores_the_passages_from_the_results(copy):
    _edit(copy / "README.md", "demo", "test accuracy", "accuracy on test")
    assert check_docs.check(copy)
    check_docs.write(copy)
    assert check_docs.check(copy) == []
    assert (copy / "README.md").read_text() == (ROOT / "README.md").read_text()


def test_a_missing_marker_is_named(copy):
    readme = copy / "README.md"
    readme.write_text(readme.read_text().replace("<!-- /demo-llm -->", ""))
    problems = check_docs.check(copy)
    assert any("'<!-- /demo-llm -->'" in p and p.startswith("README.md") for p in problems)


def test_a_missing_results_file_is_named(copy):
    (copy / "benchmarks/results/scale.json").unlink()
    problems = [p for p in check_docs.check(copy) if "'highlights'" in p]
    assert len(problems) == 1 and "no results file benchmarks/results/scale.json" in problems[0]


def test_a_demo_figure_that_moved_is_named_and_timings_are_not():
    committed = {"spans": [[4, 6]], "accuracy": {"compressed": 0.98}, "seconds": {"total": 100}}
    now = {"spans": [[4, 6]], "accuracy": {"compressed": 0.97}, "seconds": {"total": 90}}
    moved = check_docs.differences(committed, now, "demo.json")
    assert moved == [
        "demo.json: accuracy is {'compressed': 0.97} now, {'compressed': 0.98} committed"
    ]
    assert check_docs.differences(committed, {**committed, "seconds": {}}, "demo.json") == []


def test_rerun_demos_compares_each_demo_with_its_own_results_file(copy, monkeypatch):
    from toast.cli import demo, demo_llm

    def fake(source, change=None):
        def run(out, **_):
            record = json.loads((copy / source).read_text())
            record.update(change or {})
            Path(out).mkdir(parents=True)
            (Path(out) / "result.json").write_text(json.dumps(record))

        return run

    monkeypatch.setattr(demo, "run_demo", fake("benchmarks/results/demo.json"))
    monkeypatch.setattr(demo_llm, "run_llm_demo", fake("benchmarks/results/demo_llm.json"))
    assert check_docs.run_demos(copy, keep=False) == []
    moved = {"kl": 0.5}
    monkeypatch.setattr(demo_llm, "run_llm_demo", fake("benchmarks/results/demo_llm.json", moved))
    assert check_docs.run_demos(copy, keep=False) == [
        f"benchmarks/results/demo_llm.json: kl is 0.5 now, {_committed_kl()!r} committed"
    ]


def _committed_kl():
    return json.loads((ROOT / "benchmarks/results/demo_llm.json").read_text())["kl"]
