"""What a save folder holds besides the weights: config.json for
transformers, companions of the source folder, a model card, one file mode;
and what the compressed model's own ``save_pretrained`` does."""

from __future__ import annotations

import copy
import json
import os
import stat

import pytest
import torch

transformers = pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import hf_models as H  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.io import PLAN_NAME  # noqa: E402

pytestmark = [
    pytest.mark.hf,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning"),
]

_BERT = next(f for f in H.FAMILIES if f.name == "bert")


@pytest.fixture
def compressed():
    model = H.build(_BERT)
    data = H.loader(_BERT, 32, 8)
    return toast.compress(model, data, spans=[(1, 3)], progress=False)


def _modes(folder) -> set[int]:
    return {stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_every_file_of_a_save_follows_the_umask(compressed, tmp_path, umask_027):
    folder = toast.save_pretrained(compressed[0], tmp_path / "s")
    assert _modes(folder) == {0o640}


def test_replaceme_cli_files_follow_the_umask(tmp_path, umask_027):
    from toast.cli.compress import write_model_card

    model, report = toast.compress(
        R.decoder("llama"), R.text_loader(), method="replaceme", num_blocks=2, progress=False
    )
    model.save_pretrained(tmp_path / "r")  # transformers writes the weights 0600
    write_model_card(type(model).__name__, report, report.to_markdown(), tmp_path / "r")
    assert _modes(tmp_path / "r") == {0o640}
    assert report.to_markdown().strip() in (tmp_path / "r" / "README.md").read_text()


def test_custom_save_points_transformers_at_its_modeling_file(compressed, tmp_path):
    folder = toast.save_pretrained(compressed[0], tmp_path / "s")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "toast" and config["toast_model_type"] == "bert"
    assert config["auto_map"]["AutoModel"] == "toast_modeling.ToastModel"
    # transformers requires every module the file imports outside try blocks
    from transformers.dynamic_module_utils import get_imports

    assert "toast" not in get_imports(folder / "toast_modeling.py")


def test_plain_save_is_a_standard_checkpoint(tmp_path):
    model, _ = toast.compress(
        R.decoder("llama"), R.text_loader(), method="replaceme", num_blocks=2, progress=False
    )
    folder = toast.save_pretrained(model, tmp_path / "s")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    assert not (folder / "toast_modeling.py").exists()
    assert (folder / "generation_config.json").is_file()


def test_model_card_holds_the_report_and_how_to_load(compressed, tmp_path):
    model, report = compressed
    folder = toast.save_pretrained(model, tmp_path / "s", report=report.to_markdown())
    card = (folder / "README.md").read_text()
    assert report.to_markdown().strip() in card
    # the folder the save ends in, not the temporary sibling it was written to
    assert 'toast.load_pretrained("s")' in card
    assert 'AutoModel.from_pretrained("s", trust_remote_code=True)' in card


def test_source_companions_and_tokenizer_travel_with_the_save(compressed, tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer_config.json").write_text("{}")
    (source / "modules.json").write_text(json.dumps([{"idx": 1, "path": "1_Pooling"}]))
    (source / "1_Pooling").mkdir()
    (source / "1_Pooling" / "config.json").write_text("{}")
    folder = toast.save_pretrained(compressed[0], tmp_path / "s", source=source)
    for name in ("tokenizer_config.json", "modules.json", "1_Pooling/config.json"):
        assert (folder / name).is_file(), name


def test_model_save_pretrained_writes_a_toast_save(compressed, tmp_path):
    model = compressed[0]
    model.save_pretrained(tmp_path / "s")
    assert (tmp_path / "s" / PLAN_NAME).is_file()


def test_model_save_pretrained_refuses_a_folder_of_other_files(compressed, tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="toast.save_pretrained"):
        compressed[0].save_pretrained(tmp_path / "s")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["notes.txt"]


def test_model_save_pretrained_refuses_options_a_toast_save_would_ignore(compressed, tmp_path):
    with pytest.raises(ValueError, match="toast.save_pretrained"):
        compressed[0].save_pretrained(tmp_path / "s", push_to_hub=True)
    assert not (tmp_path / "s").exists()


def test_a_deep_copy_saves_itself_not_the_original(compressed, tmp_path):
    model = compressed[0]
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    clone.save_pretrained(tmp_path / "s")
    loaded = toast.load_pretrained(tmp_path / "s")
    assert all(not p.any() for p in loaded.parameters())


def test_unpatched_model_keeps_transformers_save(tmp_path):
    model, _ = toast.compress(
        R.decoder("llama"), R.text_loader(), method="replaceme", num_blocks=2, progress=False
    )
    model.save_pretrained(tmp_path / "s")
    assert not (tmp_path / "s" / PLAN_NAME).exists()  # transformers' own checkpoint
    assert (tmp_path / "s" / "config.json").is_file()


def test_companions_of_the_folder_a_model_was_read_from_travel_by_default(tmp_path):
    model = H.build(_BERT)
    model.save_pretrained(tmp_path / "source")
    (tmp_path / "source" / "tokenizer_config.json").write_text("{}")
    loaded = transformers.AutoModel.from_pretrained(tmp_path / "source")
    model, _ = toast.compress(loaded, H.loader(_BERT, 32, 8), spans=[(1, 3)], progress=False)
    folder = toast.save_pretrained(model, tmp_path / "s")
    assert (folder / "tokenizer_config.json").is_file()
