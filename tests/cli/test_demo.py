"""The README's main job: ``python -m toast demo``."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("sklearn")

from toast.cli import main  # noqa: E402
from toast.cli.demo import run_demo  # noqa: E402

pytestmark = pytest.mark.hf

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.fixture(scope="module")
def demo(digits_vit, digits_cache, tmp_path_factory, build_once):
    """The demo's result, run once for the run (its folder stays in place)."""

    def run() -> object:
        out = tmp_path_factory.mktemp("demo")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            result = run_demo(out=out, cache=digits_cache, progress=False)
        result.printed = printed.getvalue()  # what `toast demo --no-progress` shows
        return result

    return build_once("demo", run)


def test_demo_without_progress_still_prints_its_result_line(demo):
    lines = demo.printed.splitlines()
    assert len(lines) == 1 and lines[0].startswith("toast demo: replaced blocks[")
    assert f"accuracy {demo.accuracy['original']:.3f}" in lines[0]


def test_the_result_line_has_every_figure_the_readme_quotes(demo):
    line = demo.printed
    assert f"{demo.accuracy['compressed']:.3f} (dropping them instead: " in line
    assert f"parameters {demo.params['original']:,} → {demo.params['compressed']:,}" in line
    assert f"MACs {1e3 * demo.gmacs['original']:.2f} M → " in line
    assert " faster on 500 images" in line and "held-out check: fitted" in line


def test_demo_writes_the_heatmap_and_the_report(demo):
    assert (demo.out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (demo.out / "report.md").read_text()
    assert "![block error matrix](heatmap.png)" in report


def test_report_numbers_are_those_of_the_run(demo):
    report = (demo.out / "report.md").read_text()
    for name in ("original", "compressed"):
        assert f"{demo.accuracy[name]:.3f}" in report
        assert f"{demo.params[name]:,}" in report
    for span in demo.spans:
        assert re.search(rf"\[{span.start}:{span.stop}\] \| {span.paper} \|", report)


def test_demo_removes_the_budget_and_keeps_accuracy(demo):
    assert sum(s.num_blocks for s in demo.spans) == 2
    assert demo.params["compressed"] < demo.params["original"]
    assert demo.gmacs["compressed"] < demo.gmacs["original"]
    # within a point of the original on the 500 test images (the shipped
    # model's translator and plain removal of its blocks are one image apart)
    assert demo.accuracy["compressed"] >= demo.accuracy["original"] - 0.01
    assert demo.accuracy["compressed"] > 0.9


def _figures(record: dict) -> dict:
    """A results record without its timings (which vary run to run)."""
    return {k: v for k, v in record.items() if k not in ("seconds", "latency_ms", "speedup")}


def test_demo_prints_the_figures_the_readme_quotes(demo):
    # the README quotes benchmarks/results/demo.json (scripts/check_docs.py)
    committed = json.loads((RESULTS / "demo.json").read_text())
    assert _figures(json.loads((demo.out / "result.json").read_text())) == _figures(committed)


def test_demo_keeps_translators_that_beat_dropping_the_blocks_on_held_out_images(demo):
    # the check the default makes: each fit against plain removal of its
    # blocks, by cosine to the original's outputs on images the fit never saw
    assert demo.checks and all(c.used == "fitted" for c in demo.checks)
    assert all(c.metric == "cosine" and c.fitted > c.plain for c in demo.checks)


@pytest.mark.parametrize("flag", ["--num-blocks", "--budget"])
def test_cli_rejects_a_number_of_blocks_the_model_cannot_take(flag, capsys):
    assert main(["demo", flag, "8", "--no-progress"]) == 2
    assert "--num-blocks must be between 1 and 6" in capsys.readouterr().err


def test_llm_demo_writes_a_loadable_checkpoint_and_measured_perplexity(
    smollm2_file, tmp_path, capsys, monkeypatch
):
    from toast.cli import demo_llm

    # what the demo does, on a sixteenth of its tokens: its figures (the full
    # run, minutes here) are CI's `python scripts/check_docs.py --rerun-demos`
    monkeypatch.setattr(demo_llm, "_LENGTH", 64)
    monkeypatch.setattr(demo_llm, "_CALIBRATION", 16)  # four batches: the last is held out
    monkeypatch.setattr(demo_llm, "_HELD_OUT", 4)
    out = tmp_path / "llm"
    assert main(["demo", "--llm", "--out", str(out), "--no-progress"]) == 0  # 4 blocks
    assert "toast demo --llm: removed blocks[" in capsys.readouterr().out  # the result line
    config = json.loads((out / "model" / "config.json").read_text())
    # 4 blocks out; a linear block in their place where the block placement measured better
    result = json.loads((out / "result.json").read_text())
    placement = result["placement"]
    assert config["num_hidden_layers"] == (27 if placement == "block" else 26)
    assert (out / "model" / "toast_plan.json").is_file() == (placement == "block")
    assert (out / "model" / "model.safetensors").is_file()
    assert "ReplaceMe" in (out / "model" / "README.md").read_text()  # the model card
    assert (out / "distances.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "Calibration: 16 × 64 tokens" in report
    ppl = {
        name: float(re.search(rf"\| {name}[^|]* \| ([0-9.]+) \|", report).group(1))
        for name in ("original", "plain removal", "compressed")
    }
    # on 768 rows of width 576 the fit may lose its held-out check: then the cut
    # is plain removal, never worse (the full demo's fit wins: README, CI)
    assert ppl["original"] < ppl["compressed"] <= ppl["plain removal"]
    # result.json holds what the report says (the README quotes the full run's)
    measured = result["perplexity"]
    assert [measured[k] for k in ("original", "plain_removal", "compressed")] == [
        pytest.approx(ppl[k], abs=0.01) for k in ("original", "plain removal", "compressed")
    ]
    assert set(result) == set(json.loads((RESULTS / "demo_llm.json").read_text()))


def test_llm_demo_rejects_a_budget_the_model_cannot_take(capsys):
    assert main(["demo", "--llm", "--budget", "30", "--no-progress"]) == 2
    assert "between 1 and 29" in capsys.readouterr().err
