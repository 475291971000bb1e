"""The one entry's method table: every name the CLI and ``toast.compress``
offer is a registered method with that very config, found without torch."""

import subprocess
import sys

import pytest

pytest.importorskip("torch")

import toast  # noqa: E402
from toast.methods import available_methods, get_method, method_config  # noqa: E402
from toast.methods.base import method_names  # noqa: E402


@pytest.mark.parametrize("name", available_methods())
def test_each_listed_method_is_registered_with_the_listed_config(name):
    assert get_method(name).name == name
    assert get_method(name).config is method_config(name)


def test_every_registered_method_is_listed():
    for name in available_methods():
        get_method(name)  # imports every listed method
    assert method_names() == available_methods()


def test_the_method_list_and_a_torch_free_config_need_no_torch():
    code = (
        "import sys\nfrom toast.methods import available_methods, method_config\n"
        "available_methods(); method_config('toast'); method_config('replaceme')\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_unknown_method_names_the_known_ones():
    with pytest.raises(ValueError, match="method must be one of"):
        method_config("prune-everything")


def test_a_toast_save_goes_in_memory_and_the_disk_path_names_why(tmp_path, capsys):
    from tests._helpers import replaceme_models as R
    from toast.hf.capture.budget import plan_checkpoint

    model, _ = toast.compress(R.decoder("llama"), R.text_loader(), budget=1, progress=False)
    toast.save_pretrained(model, tmp_path / "saved")
    plan, disk = plan_checkpoint(tmp_path / "saved", "1KiB", progress=False)
    assert not plan.sequential and disk is None
    assert "toast save" in plan.reason
    with pytest.raises(ValueError, match="is a toast save"):
        plan_checkpoint(tmp_path / "saved", sequential=True, progress=False)
    assert capsys.readouterr().err == ""  # the in-memory path is said with progress only


def test_a_folder_over_the_budget_gets_its_blocks_and_says_why(tmp_path, capsys):
    from tests._helpers import replaceme_models as R
    from toast.hf.capture.budget import plan_checkpoint

    model = R.decoder("llama")
    model.save_pretrained(tmp_path)
    plan, disk = plan_checkpoint(tmp_path, "1KiB", progress=False)
    assert plan.sequential and disk is not None
    assert disk.num_blocks == model.config.num_hidden_layers
    assert "sequential path" in capsys.readouterr().err  # said even without progress
