"""``toast compress MODEL --method replaceme --data FILE --num-blocks N --out DIR``
on a local tiny Llama with a character-level tokenizer (built offline) and
local text."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.cli.conftest import TEXTS  # noqa: E402
from toast.cli import main  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

REPLACEME = ["compress", "--method", "replaceme"]


@pytest.mark.parametrize("data", ["calib.txt", "calib.jsonl"])
def test_replaceme_cli_writes_a_standard_checkpoint(local_llama, tmp_path, data, capsys):
    out = tmp_path / "pruned"
    argv = [*REPLACEME, str(local_llama / "model"), "--data", str(local_llama / data)]
    assert main([*argv, "--num-blocks", "2", "--out", str(out), "--no-progress"]) == 0
    assert "Eq. 10" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.config.num_hidden_layers == 4
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    batch = tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert model(**batch).logits.shape[:2] == batch["input_ids"].shape
    assert "| blocks[" in (out / "report.md").read_text()
    rows = (out / "layer_distances.csv").read_text().splitlines()
    assert rows[0] == "block_start,block_end,average_distance" and len(rows) == 1 + 5
    assert (out / "distances.png").read_bytes()[:4] == b"\x89PNG"


def test_replaceme_cli_cosine_with_several_cuts(local_llama, tmp_path):
    out = tmp_path / "pruned"
    argv = [*REPLACEME, str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    options = ["--objective", "cosine", "--num-cuts", "2", "--adjacent", "forbid", "--epochs", "2"]
    assert main([*argv, "--num-blocks", "2", "--out", str(out), *options, "--no-progress"]) == 0
    report = (out / "report.md").read_text()
    assert report.count("| blocks[") == 2 and "cosine" in report


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num-blocks", "6"], "num_blocks must be an int in [1, 5]; got 6"),
        (["--num-blocks", "2", "--min-start", "5"], "min_start must be an int in [1, 4]; got 5"),
        (["--num-blocks", "2", "--data", "missing.txt"], "--data missing.txt does not exist"),
    ],
)
def test_replaceme_cli_reports_bad_input(local_llama, tmp_path, extra, message, capsys):
    argv = [*REPLACEME, str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    assert main([*argv, "--out", str(tmp_path / "o"), "--no-progress", *extra]) == 2
    assert message in capsys.readouterr().err


def test_replaceme_cli_refuses_a_non_empty_out_without_overwrite(local_llama, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    argv = [*REPLACEME, str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    assert main([*argv, "--num-blocks", "1", "--out", str(out), "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").exists()


def test_replaceme_cli_names_missing_tokenizer_files(local_llama, tmp_path, capsys):
    import shutil

    model = tmp_path / "weights-only"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(local_llama / "model" / name, model / name)
    argv = [*REPLACEME, str(model), "--data", str(local_llama / "calib.txt"), "--num-blocks", "1"]
    assert main([*argv, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{model} has no tokenizer files" in err and "sentencepiece" not in err
    assert not (tmp_path / "o").exists()


def test_replaceme_cli_model_over_the_memory_budget_goes_block_by_block(
    local_llama, tmp_path, capsys
):
    from safetensors.torch import load_file

    argv = [*REPLACEME, str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--num-blocks", "2", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "disk"), "--path", "disk"]) == 0
    said = capsys.readouterr().err
    assert "sequential path, as asked" in said and "memory plan:" in said
    assert main([*argv, "--out", str(tmp_path / "memory"), "--path", "memory"]) == 0
    assert "path" not in capsys.readouterr().err  # the in-memory path is said with progress only
    a = load_file(tmp_path / "disk" / "model.safetensors")
    b = load_file(tmp_path / "memory" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "disk" / "tokenizer.json").is_file()
    assert "| blocks[" in (tmp_path / "disk" / "report.md").read_text()


def _parsed_config(*extra):
    from toast.cli.compress import config_from_args
    from toast.cli.main import _build_parser

    argv = [*REPLACEME, "m", "--data", "d.txt", "--num-blocks", "2", "--out", "o", *extra]
    return config_from_args(_build_parser("replaceme").parse_args(argv))


def test_replaceme_cli_paper_flag_is_the_papers_preset_under_the_options_given():
    from toast.methods.replaceme.config import ReplaceMeConfig

    config = _parsed_config("--paper", "--objective", "cosine", "--epochs", "3")
    preset = ReplaceMeConfig.paper(num_blocks=2, objective="cosine", epochs=3)
    assert (config.solver, config.init, config.check_fraction, config.candidates) == (
        preset.solver,
        preset.init,
        preset.check_fraction,
        preset.candidates,
    )
    assert (config.massive_rows, config.loss, config.epochs) == ("fit", "approximate", 3)


def test_replaceme_cli_options_on_by_default_are_turned_off_by_no_flags():
    assert _parsed_config().fallback is True
    assert _parsed_config("--no-fallback").fallback is False
