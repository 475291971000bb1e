"""``toast search``: a local model and text in, the chosen model and the
report out; bad arguments fail before anything loads."""

import json

import pytest

import toast
from toast.cli.main import main
from toast.cli.options import EXIT_USAGE

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.hf


def test_search_writes_the_chosen_model_and_the_report(local_llama, tmp_path, capsys):
    argv = ["search", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--heldout", "0.25", "--target", "params=20%", "--max-measured", "3"]
    argv += ["--no-latency", "--no-progress", "--cache", str(tmp_path / "cache")]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "Spearman" in printed
    saved = json.loads((tmp_path / "out" / "search.json").read_text())
    assert saved["chosen"] is not None
    model = toast.load_pretrained(tmp_path / "out" / "model")
    kept = saved["measured"][saved["chosen"]]["measurement"]["params"]
    assert toast.count_params(model) == kept
    for name in ("report.md", "front.png", "front.svg"):
        assert (tmp_path / "out" / name).is_file(), name


@pytest.mark.parametrize(
    "bad, said",
    [
        (["--target", "weights=20%"], "target kind"),
        (["--target", "params=120%"], "between 0 and 1"),
        (["--max-measured", "0"], "--max-measured"),
    ],
)
def test_search_refuses_bad_arguments_before_loading(local_llama, tmp_path, capsys, bad, said):
    argv = ["search", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--heldout", "0.25", "--out", str(tmp_path / "out"), *bad]
    assert main(argv) == EXIT_USAGE
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
