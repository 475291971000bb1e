"""The one entry's method table: every name the CLI and ``toast.compress``
offer is a registered method with that very config, found without torch."""

import subprocess
import sys

import pytest

pytest.importorskip("torch")

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
