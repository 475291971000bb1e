"""The table of translator kinds (toast.core.kinds) that fitting, saving,
loading and the counts read."""

import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from toast.core import patch
from toast.core.kinds import KINDS, MODULES, Fit, Kind, kind_entry, kind_names

ROOT = Path(__file__).resolve().parents[2]


def test_every_entry_is_filed_under_its_own_name():
    assert all(name == entry.name for name, entry in KINDS.items())


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_is_stored_as_a_known_module_and_obtained_a_known_way(name):
    entry = kind_entry(name)
    assert entry.module in MODULES and entry.fit in get_args(Fit)


def test_the_table_loads_without_torch():
    code = "import sys, toast.core.kinds; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_an_unknown_kind_is_refused_naming_the_known_ones():
    with pytest.raises(
        ValueError, match=r"unknown translator kind 'conv'; toast knows \['identity'"
    ):
        kind_entry("conv")


def test_a_linear_kind_with_a_bias_counts_one_more_vector():
    plain, biased = Kind("a", "linear"), Kind("b", "linear", bias=True)
    assert biased.params(12) - plain.params(12) == 12
    assert biased.macs(12) == plain.macs(12) == (144, 0)


def test_selections_keep_the_table_order():
    names = list(KINDS)
    for selection in (
        kind_names(module="linear"),
        kind_names(hadamard=True),
        kind_names(fit="trained"),
    ):
        assert list(selection) == sorted(selection, key=names.index)


def test_the_hadamard_lists_of_the_patch_fits_are_the_table():
    assert patch.PATCH_KINDS == kind_names(hadamard=True)
    assert patch.PATCH_FITS == kind_names(hadamard=True, fit="moments")


def test_a_kind_added_to_the_table_is_selected_at_once(monkeypatch):
    monkeypatch.setitem(KINDS, "made_up", Kind("made_up", "diagonal", fit="trained"))
    assert kind_names(fit="trained")[-1] == "made_up" and kind_entry("made_up").params(4) == 8
