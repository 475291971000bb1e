"""toast.Calibration: one options type for every calibration pass."""

import dataclasses
import subprocess
import sys

import pytest

from toast.hf.data.calibration import CALIBRATION_OPTIONS, Calibration


def test_defaults_read_the_whole_loader_in_order():
    cal = Calibration()
    assert (cal.max_batches, cal.max_samples, cal.sample, cal.seed) == (None, None, "first", 0)


@pytest.mark.parametrize(
    "options,message",
    [
        ({"max_samples": 0}, "max_samples must be an int in [1, inf) or None; got 0"),
        ({"max_batches": -2}, "max_batches must be an int in [1, inf) or None; got -2"),
        ({"sample": "last"}, "sample must be one of 'first', 'random'; got 'last'"),
        ({"seed": -1}, "seed must be an int in [0, inf); got -1"),
        ({"progress": "yes"}, "progress must be a bool; got 'yes'"),
    ],
)
def test_bad_options_are_refused_when_the_calibration_is_built(options, message):
    with pytest.raises(ValueError) as info:
        Calibration(**options)
    assert str(info.value) == message


def test_from_options_overrides_a_given_calibration_without_changing_it():
    base = Calibration(max_samples=8, seed=3)
    cal = Calibration.from_options(base, max_samples=4)
    assert (cal.max_samples, cal.seed) == (4, 3)
    assert base.max_samples == 8
    assert Calibration.from_options(base) is base


def test_from_options_names_an_unknown_option_and_lists_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown calibration option\(s\) \['max_sample'\]"):
        Calibration.from_options(max_sample=3)


def test_split_separates_calibration_options_from_the_rest():
    mine, rest = Calibration.split({"seed": 1, "budget": 2, "progress": False})
    assert mine == {"seed": 1, "progress": False} and rest == {"budget": 2}


def test_option_names_are_the_dataclass_fields():
    assert CALIBRATION_OPTIONS == tuple(f.name for f in dataclasses.fields(Calibration))


def test_building_a_calibration_or_a_config_does_not_import_torch():
    code = (
        "import sys; import toast.methods.translate.config as c; c.ToastConfig(budget=1); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
