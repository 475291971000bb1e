"""The command line fails fast, keeps one overwrite policy, exits cleanly on
Ctrl-C and prints plain help (``toast.cli.checks`` and ``toast.cli.main``)."""

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
hf_models = pytest.importorskip("tests._helpers.hf_models")

import toast.io.local  # noqa: E402
from tests.conftest import default_sigint  # noqa: E402
from toast.cli import main  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

COMMANDS = ["analyze", "compress"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random ViT saved with save_pretrained and 8 RGB images of its size."""
    root = tmp_path_factory.mktemp("tiny_vit")
    hf_models.build(hf_models.FAMILIES[0]).save_pretrained(root / "model")
    rng = np.random.default_rng(0)
    folder = root / "images" / "0"
    folder.mkdir(parents=True)
    for k in range(8):
        pixels = rng.integers(0, 256, (hf_models.IMAGE, hf_models.IMAGE, 3), dtype=np.uint8)
        Image.fromarray(pixels, mode="RGB").save(folder / f"{k}.png")
    return root


@pytest.fixture
def no_loading(monkeypatch):
    """Loading the model is a test failure: the mistake had to be caught first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the command line was checked")

    monkeypatch.setattr(toast.io.local, "load_model", refuse)


def _argv(command, tiny, out, *extra):
    argv = [command, str(tiny / "model"), "--data", str(tiny / "images"), "--out", str(out)]
    if command == "compress" and "--max-error" not in extra:
        argv += ["--budget", "1"]
    return [*argv, "--no-progress", *extra]


def _unwritable(tmp_path: Path) -> Path:
    """A folder nobody may create files in (root ignores permissions: then /sys)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    for candidate in (folder, Path("/sys")):
        try:
            (candidate / "probe").mkdir()
        except OSError:
            return candidate
        (candidate / "probe").rmdir()
    pytest.skip("no unwritable folder on this machine")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_read_only_out_is_refused_before_loading(command, tiny, tmp_path, no_loading, capsys):
    out = _unwritable(tmp_path) / "result"
    assert main(_argv(command, tiny, out)) == 2
    err = capsys.readouterr().err
    assert "cannot write in" in err and "Traceback" not in err


def test_a_missing_budget_is_reported_before_loading(tiny, tmp_path, no_loading, capsys):
    argv = _argv("compress", tiny, tmp_path / "out")
    argv.remove("--budget")
    argv.remove("1")
    assert main(argv) == 2
    assert "give num_blocks=" in capsys.readouterr().err


def test_num_blocks_and_budget_that_differ_are_reported_before_loading(
    tiny, tmp_path, no_loading, capsys
):
    argv = _argv("compress", tiny, tmp_path / "out", "--num-blocks", "2")  # and --budget 1
    assert main(argv) == 2
    assert "num_blocks=2 and budget=1 differ" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_a_missing_data_file_is_named_as_missing(command, tiny, tmp_path, no_loading, capsys):
    argv = _argv(command, tiny, tmp_path / "out")
    argv[argv.index("--data") + 1] = str(tmp_path / "calib.txt")
    assert main(argv) == 2
    assert f"--data {tmp_path / 'calib.txt'} does not exist" in capsys.readouterr().err


def test_a_missing_model_folder_is_named_as_missing(tiny, tmp_path, no_loading, capsys):
    argv = _argv("analyze", tiny, tmp_path / "out")
    argv[1] = str(tmp_path / "nowhere")
    assert main(argv) == 2
    assert "does not exist" in capsys.readouterr().err


def test_text_data_with_a_model_without_tokenizer_files_is_refused(
    tiny, tmp_path, no_loading, capsys
):
    (tmp_path / "calib.txt").write_text("one text\n")
    argv = _argv("analyze", tiny, tmp_path / "out")
    argv[argv.index("--data") + 1] = str(tmp_path / "calib.txt")
    assert main(argv) == 2
    assert "has no tokenizer files" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_a_non_empty_out_needs_overwrite(command, tiny, tmp_path, no_loading, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "spans.csv").write_text("x\n")
    assert main(_argv(command, tiny, out)) == 2
    assert "exists and is not empty (pass --overwrite)" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_overwrite_never_replaces_a_folder_toast_did_not_write(
    command, tiny, tmp_path, no_loading, capsys
):
    out = tmp_path / "home"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    assert main(_argv(command, tiny, out, "--overwrite")) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (out / "thesis.tex").read_text() == "precious"


@pytest.mark.parametrize("flag,value", [("--ridge", "-1"), ("--batch-size", "0")])
def test_a_bad_number_is_refused_before_loading(flag, value, tiny, tmp_path, no_loading, capsys):
    assert main(_argv("analyze", tiny, tmp_path / "out", flag, value)) == 2
    assert f"{flag} must be" in capsys.readouterr().err


def test_an_empty_existing_out_is_accepted_by_both_commands(tiny, tmp_path):
    for command in COMMANDS:
        out = tmp_path / command
        out.mkdir()
        assert main(_argv(command, tiny, out, "--quiet")) == 0
        assert (out / "heatmap.png").is_file()


def test_overwrite_replaces_a_previous_result_whole(tiny, tmp_path):
    out = tmp_path / "out"
    assert main(_argv("analyze", tiny, out, "--quiet")) == 0
    (out / "stale.txt").write_text("from an earlier run")
    assert main(_argv("compress", tiny, out, "--quiet", "--overwrite")) == 0
    assert (out / "report.md").is_file() and not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging folder left


class _Interrupted:
    """Batches that stand for a user pressing Ctrl-C during calibration."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        yield self.batches[0]
        raise KeyboardInterrupt


@pytest.mark.parametrize("command", COMMANDS)
def test_ctrl_c_prints_one_line_exits_130_and_leaves_nothing(
    command, tiny, tmp_path, monkeypatch, capsys
):
    load = toast.io.local.load_batches
    monkeypatch.setattr(
        toast.io.local, "load_batches", lambda *a, **k: _Interrupted(list(load(*a, **k)))
    )
    out = tmp_path / "out"
    assert main(_argv(command, tiny, out)) == 130
    assert capsys.readouterr().err.splitlines() == [f"toast {command}: interrupted"]
    assert list(tmp_path.iterdir()) == []  # neither --out nor a staging folder


def test_sigint_in_a_real_process_exits_130_with_one_line(tiny, tmp_path):
    # A real SIGINT, sent by the process to itself once the model has loaded.
    code = (
        "import os, signal, sys\n"
        "import toast.io.local as local\n"
        "load = local.load_model\n"
        "def load_then_interrupt(path):\n"
        "    model = load(path)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    return model\n"
        "local.load_model = load_then_interrupt\n"
        "from toast.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / "out"
    argv = [sys.executable, "-c", code, *_argv("compress", tiny, out, "--quiet")]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, preexec_fn=default_sigint
    )
    assert done.returncode == 128 + signal.SIGINT
    assert done.stderr.strip().splitlines() == ["toast compress: interrupted"]
    assert not out.exists()


def test_quiet_prints_only_the_result(tiny, tmp_path, capsys):
    assert main(_argv("compress", tiny, tmp_path / "out", "--quiet")) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "predicted error" in captured.out


def test_no_progress_silences_transformers_loading_bar(tiny, tmp_path):
    from transformers.utils import logging

    logging.enable_progress_bar()
    try:
        assert main(_argv("analyze", tiny, tmp_path / "out")) == 0  # --no-progress
        assert not logging.is_progress_bar_enabled()
    finally:
        logging.enable_progress_bar()


def test_ridge_and_include_first_block_reach_the_plan(tiny, tmp_path, monkeypatch):
    from toast.methods.translate.analysis import Analysis

    seen = {}
    plan = Analysis.plan

    def spy(self, *args, **kwargs):
        seen.update(ridge=self.ridge, first=kwargs.get("include_first_block"))
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(Analysis, "plan", spy)
    extra = ["--quiet", "--ridge", "0.5", "--include-first-block"]
    assert main(_argv("compress", tiny, tmp_path / "out", *extra)) == 0
    assert seen == {"ridge": 0.5, "first": True}


def test_blocks_names_the_block_list(tiny, tmp_path, capsys):
    argv = _argv("analyze", tiny, tmp_path / "out", "--blocks", "encoder.nothing")
    assert main(argv) == 2
    assert "has no attribute path 'encoder.nothing'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "command",
    [["analyze"], ["compress"], ["compress", "--method", "replaceme"], ["demo"]],
    ids=" ".join,
)
def test_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text and "imports nothing" not in text
    assert "Exit status: 0 done" in text


def test_exit_statuses_are_in_the_top_level_help(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "130 interrupted" in " ".join(capsys.readouterr().out.split())


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_environment_is_left_alone_with_progress_on_a_terminal(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    argv = [a for a in _argv("analyze", tiny, tmp_path / "out") if a != "--no-progress"]
    assert main(argv) == 0
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ


def test_library_bars_are_silenced_when_stderr_is_not_a_terminal(tiny, tmp_path, monkeypatch):
    # a log file or a pipe would get their carriage-return frames
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    argv = [a for a in _argv("analyze", tiny, tmp_path / "out") if a != "--no-progress"]
    assert main(argv) == 0
    assert os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1"


def test_the_command_line_and_the_loader_know_the_same_tokenizer_files():
    from toast.cli.checks import TOKENIZER_FILES

    assert TOKENIZER_FILES == toast.io.local.TOKENIZER_FILES


def test_load_tokenizer_names_a_folder_without_tokenizer_files(tiny):
    with pytest.raises(ValueError, match="has no tokenizer files"):
        toast.io.local.load_tokenizer(tiny / "model")


def test_load_batches_names_missing_data_as_missing(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="calib.txt does not exist"):
        toast.io.local.load_batches(tiny / "model", tmp_path / "calib.txt")


def test_the_readme_shows_every_command_with_an_example():
    from toast.cli.main import _build_parser

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Command line", 1)[1].split("\n## ", 1)[0]
    commands = _build_parser()._subparsers._group_actions[0].choices
    for command in commands:
        assert f"\ntoast {command} " in section, command


@pytest.mark.parametrize("llm", [[], ["--llm"]])
def test_the_demo_checks_its_out_before_any_work(llm, tmp_path, monkeypatch, capsys):
    import toast.cli.demo
    import toast.cli.demo_llm

    def refuse(*args, **kwargs):
        raise AssertionError("the demo started before its --out was checked")

    monkeypatch.setattr(toast.cli.demo, "run_demo", refuse)
    monkeypatch.setattr(toast.cli.demo_llm, "run_llm_demo", refuse)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not the demo's")
    assert main(["demo", *llm, "--out", str(foreign), "--no-progress"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    out = _unwritable(tmp_path) / "demo"
    assert main(["demo", *llm, "--out", str(out), "--no-progress"]) == 2
    assert "cannot write in" in capsys.readouterr().err
