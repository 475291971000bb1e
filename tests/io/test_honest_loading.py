"""``toast.load_pretrained`` says what a folder is: a plain checkpoint loads
as one, a save from another toast or transformers version is refused naming
both versions, a damaged file is named, a checksum catches what the
structural checks cannot."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import hf_models as H  # noqa: E402
from toast.io import PLAN_NAME, WEIGHTS_NAME, CorruptedSaveError, load_pretrained  # noqa: E402

pytestmark = [
    pytest.mark.hf,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning"),
]

_BERT = next(f for f in H.FAMILIES if f.name == "bert")


def _compressed():
    model = H.build(_BERT)
    data = H.loader(_BERT, 32, 8)
    model, report = toast.compress(model, data, spans=[(1, 3)], progress=False)
    return model, report, data[0]


def _forward(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).last_hidden_state


def _edit_plan(folder, edit) -> None:
    plan = json.loads((folder / PLAN_NAME).read_text())
    edit(plan)
    (folder / PLAN_NAME).write_text(json.dumps(plan))


def test_plain_checkpoint_loads_as_a_transformers_model(tmp_path):
    model = H.build(_BERT)
    model.save_pretrained(tmp_path / "plain")  # transformers' own folder: no plan
    batch = H.loader(_BERT, 4, 4)[0]
    loaded = load_pretrained(tmp_path / "plain")
    assert type(loaded) is type(model) and not loaded.training
    assert torch.equal(_forward(loaded, batch), _forward(model, batch))


def test_save_from_a_newer_plan_format_names_both_toast_versions(tmp_path):
    model, _, _ = _compressed()
    toast.save_pretrained(model, tmp_path / "s")

    def newer(plan):
        plan["format_version"] = 99
        plan["versions"]["toast"] = "9.0.0"

    _edit_plan(tmp_path / "s", newer)
    with pytest.raises(CorruptedSaveError, match="format version 99") as info:
        load_pretrained(tmp_path / "s")
    assert "toast 9.0.0" in str(info.value) and f"toast {toast.__version__}" in str(info.value)


def test_save_from_another_transformers_major_names_both_versions(tmp_path):
    model, _, _ = _compressed()
    toast.save_pretrained(model, tmp_path / "s")
    _edit_plan(tmp_path / "s", lambda plan: plan["versions"].update(transformers="4.57.1"))
    with pytest.raises(ValueError, match="transformers 4.57.1") as info:
        load_pretrained(tmp_path / "s")
    assert f"transformers {transformers.__version__}" in str(info.value)


def test_changed_weight_values_fail_the_checksum_naming_the_file(tmp_path):
    model, _, _ = _compressed()
    folder = toast.save_pretrained(model, tmp_path / "s")
    file = folder / WEIGHTS_NAME
    data = bytearray(file.read_bytes())
    data[-4] ^= 1  # the lowest mantissa bit of the last float: same names, shapes, size
    file.write_bytes(bytes(data))
    with pytest.raises(CorruptedSaveError, match="SHA-256") as info:
        load_pretrained(folder)
    assert str(file) in str(info.value)


def test_plan_records_the_weights_checksum(tmp_path):
    from toast.io.save import sha256

    model, _, _ = _compressed()
    folder = toast.save_pretrained(model, tmp_path / "s")
    plan = json.loads((folder / PLAN_NAME).read_text())
    assert plan["weights"]["sha256"] == sha256(folder / WEIGHTS_NAME)


def test_toast_folder_without_its_plan_is_incomplete_not_plain(tmp_path):
    model, _, _ = _compressed()
    folder = toast.save_pretrained(model, tmp_path / "s")
    (folder / PLAN_NAME).unlink()
    with pytest.raises(CorruptedSaveError, match=f"{PLAN_NAME} is missing"):
        load_pretrained(folder)


def test_plan_names_the_translator_kind_as_the_report_does(tmp_path):
    model, report, _ = _compressed()
    folder = toast.save_pretrained(model, tmp_path / "s")
    plan = json.loads((folder / PLAN_NAME).read_text())
    kinds = [e["translator"]["kind"] for e in plan["layout"] if e["type"] == "translator"]
    assert kinds == ["affine"] and "affine" in report.to_markdown()
    assert plan["summary"]["translator_kinds"] == {"affine": 1}


def test_unknown_patch_type_is_refused_naming_it(tmp_path):
    model, _, _ = _compressed()
    folder = toast.save_pretrained(model, tmp_path / "s")
    _edit_plan(folder, lambda plan: plan["patches"].append({"type": "warp", "state": {}}))
    with pytest.raises(CorruptedSaveError, match="'warp', which no installed toast method"):
        load_pretrained(folder)


def test_a_plan_of_format_version_1_still_loads(tmp_path):
    model, _, batch = _compressed()
    folder = toast.save_pretrained(model, tmp_path / "s")

    def version_1(plan):  # what toast wrote before patches, versions and checksums
        plan["format_version"] = 1
        for key in ("patches", "versions"):
            plan.pop(key)
        plan["weights"].pop("sha256")

    _edit_plan(folder, version_1)
    assert torch.equal(_forward(load_pretrained(folder), batch), _forward(model, batch))
