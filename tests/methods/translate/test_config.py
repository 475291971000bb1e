"""ToastConfig's one name for how many blocks to remove: ``num_blocks``, with
``budget`` (the TOAST paper's name) accepted as another name for it."""

import dataclasses
import json

import pytest

from toast.hf.data.calibration import Calibration
from toast.methods.translate.config import ToastConfig

#: ``dataclasses.asdict(ToastConfig(budget=2, translator="linear"))`` as toast
#: wrote it while the field was named ``budget`` (JSON).
SAVED_WITH_BUDGET = """{"budget": 2, "max_error": null, "spans": null, "translator": "linear",
"fit": "independent", "metric": "linear", "estimator": "auto", "folds": 5, "tokens": "all",
"ridge": null, "include_first_block": false, "max_span": null, "max_rows": 50000,
"train_steps": 300, "lr": 0.001, "backend": "auto", "check_fraction": 0.1, "fallback": true,
"refit": true, "massive_rows": "plain", "single_window": false, "ridge_target": "zero",
"statistics_bytes": "auto", "calibration": {"blocks": null, "max_batches": null,
"max_samples": null, "sample": "first", "seed": 0, "progress": true, "distributed": null,
"group": null, "shard": true, "compute_dtype": "auto"}}"""


def _load(text):
    data = json.loads(text)
    return ToastConfig(**{**data, "calibration": Calibration(**data["calibration"])})


def test_budget_is_another_name_for_num_blocks():
    assert ToastConfig(budget=3) == ToastConfig(num_blocks=3) == ToastConfig(3)
    assert ToastConfig(budget=3).num_blocks == 3
    assert ToastConfig(num_blocks=3, budget=3).num_blocks == 3  # the same value twice is fine


def test_num_blocks_and_budget_given_with_different_values_raise_naming_both():
    with pytest.raises(ValueError, match="num_blocks=2 and budget=3 differ"):
        ToastConfig(num_blocks=2, budget=3)


def test_a_bad_budget_is_named_as_given():
    with pytest.raises(ValueError, match="budget must be an int in"):
        ToastConfig(budget=0)


def test_a_config_saved_with_budget_loads():
    loaded = _load(SAVED_WITH_BUDGET)
    assert loaded == ToastConfig(num_blocks=2, translator="linear")
    assert loaded.pairs == 2  # the plan's reach follows the loaded number of blocks


def test_a_config_saved_now_names_num_blocks_and_loads_back():
    config = ToastConfig(num_blocks=2, translator="linear")
    saved = dataclasses.asdict(config)
    assert saved["num_blocks"] == 2 and "budget" not in saved
    assert _load(json.dumps(saved)) == config


def test_replacing_num_blocks_keeps_no_stale_budget():
    config = ToastConfig(budget=2)
    assert dataclasses.replace(config, num_blocks=4).num_blocks == 4


def test_ghosted_takes_num_blocks_or_budget():
    assert ToastConfig.ghosted(num_blocks=3) == ToastConfig.ghosted(budget=3)
    assert ToastConfig.ghosted(3).num_blocks == 3
