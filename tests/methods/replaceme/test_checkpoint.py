"""ReplaceMe on a model folder chooses its path by the memory budget, says
which and why, and writes the same pruned checkpoint either way."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.capture.budget import memory_plan, parse_size  # noqa: E402
from toast.hf.model.checkpoint import Checkpoint  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def test_both_paths_write_the_same_checkpoint_and_say_which_they_took(tmp_path, capsys):
    model = R.decoder("llama")
    model.save_pretrained(tmp_path / "source")
    data = R.text_loader()
    options = {"method": "replaceme", "num_blocks": 2}
    small = toast.compress(
        tmp_path / "source", data, output=tmp_path / "disk", sequential=True, **options
    )
    said_small = capsys.readouterr().err
    large = toast.compress(
        tmp_path / "source", data, output=tmp_path / "memory", max_memory="64GiB", **options
    )
    said_large = capsys.readouterr().err
    assert "sequential path, as asked" in said_small
    assert "memory plan:" in said_small
    assert "in-memory path" in said_large
    assert small.spans == large.spans
    a = load_file(tmp_path / "disk" / "model.safetensors")
    b = load_file(tmp_path / "memory" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "disk" / "generation_config.json").is_file()
    assert (tmp_path / "memory" / "generation_config.json").is_file()


def test_budget_below_the_model_size_chooses_the_sequential_path(tmp_path):
    R.decoder("llama").save_pretrained(tmp_path)
    checkpoint = Checkpoint(tmp_path)
    assert memory_plan(checkpoint, checkpoint.nbytes // 2).sequential
    assert not memory_plan(checkpoint, 10 * checkpoint.nbytes).sequential


@pytest.mark.parametrize(
    ("text", "expected"), [("8GiB", 8 * 2**30), ("512M", 512 * 2**20), ("100", 100)]
)
def test_sizes_parse_in_powers_of_1024(text, expected):
    assert parse_size(text) == expected


def test_unreadable_size_names_the_expected_form():
    with pytest.raises(ValueError, match="e.g. 8GiB"):
        parse_size("a lot")
