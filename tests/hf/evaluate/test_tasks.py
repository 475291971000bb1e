"""Which tasks toast.evaluate runs, checked before any model work: the
presets against lm-evaluation-harness's own task files, local task YAML
resolved against its folder, and one-line failures for what is missing."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("lm_eval")

import toast  # noqa: E402
from toast.hf.evaluate.tasks import (  # noqa: E402
    DATASETS,
    PRESETS,
    TaskUnavailableError,
    harness_task_files,
    hub_dataset_cached,
    resolve_tasks,
    write_continuation_task,
)

TEXTS = [
    "Return the number of items in the container.",
    "Raise a ValueError when the argument is negative.",
    "The default is to read the whole file at once.",
    "Open the file and return a stream, or raise an error.",
    "Split the string at the first occurrence of sep.",
]


@pytest.fixture
def empty_datasets_cache(tmp_path, monkeypatch):
    """A machine on which no Hub dataset was ever downloaded."""
    datasets_config = pytest.importorskip("datasets.config")
    monkeypatch.setattr(datasets_config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    return tmp_path / "datasets"


def test_every_preset_task_is_a_task_of_the_installed_harness():
    files = harness_task_files()
    for preset, names in PRESETS.items():
        for name in names:
            assert name in files, (preset, name)


def test_the_preset_datasets_are_those_the_harness_yaml_declares():
    from lm_eval.tasks._yaml_loader import load_yaml

    files = harness_task_files()
    for name, (path, config_name) in DATASETS.items():
        if name == "mmlu":  # a group: its subtasks share one template
            declared = load_yaml(files["mmlu_anatomy"], resolve_func=False)
            assert declared["dataset_path"] == path
            continue
        declared = load_yaml(files[name], resolve_func=False)
        assert (declared["dataset_path"], declared.get("dataset_name")) == (path, config_name)
    assert set(DATASETS) == {name for names in PRESETS.values() for name in names}


def test_a_preset_expands_to_its_tasks_when_their_data_is_cached(empty_datasets_cache):
    for path, config_name in set(DATASETS.values()):
        namespace, name = path.split("/")
        folder = empty_datasets_cache / f"{namespace}___{name.lower()}" / (config_name or "default")
        (folder / "0.0.0" / "abc").mkdir(parents=True)
    units = resolve_tasks("linearpatch")
    assert [unit.name for unit in units] == list(PRESETS["linearpatch"])
    assert all(unit.registered and unit.spec == unit.name for unit in units)


@pytest.mark.parametrize("request_", ["hellaswag", "sleb", ["piqa"]])
def test_a_task_whose_data_is_neither_cached_nor_installed_fails_naming_the_install(
    empty_datasets_cache, request_, monkeypatch
):
    from toast.hf.evaluate import offline

    monkeypatch.setattr(offline, "data_root", lambda: None)
    with pytest.raises(TaskUnavailableError) as caught:
        resolve_tasks(request_)
    message = str(caught.value)
    assert "\n" not in message
    task = {"hellaswag": "hellaswag", "sleb": "piqa"}.get(str(request_), "piqa")
    assert message.startswith(f"task {task} needs its data, which is not on this machine")
    assert offline.INSTALL in message


def test_a_task_with_no_offline_copy_fails_naming_the_download(empty_datasets_cache):
    with pytest.raises(TaskUnavailableError) as caught:
        resolve_tasks("wsc273")
    message = str(caught.value)
    assert "\n" not in message
    assert f"task wsc273 needs the dataset {DATASETS['wsc273'][0]}" in message
    assert "TaskManager().load(['wsc273'])" in message


def test_the_cache_check_wants_the_named_config(empty_datasets_cache):
    (empty_datasets_cache / "allenai___ai2_arc" / "ARC-Easy" / "0.0.0" / "abc").mkdir(parents=True)
    assert hub_dataset_cached("allenai/ai2_arc", "ARC-Easy")
    assert not hub_dataset_cached("allenai/ai2_arc", "ARC-Challenge")
    assert not hub_dataset_cached("allenai/winogrande")


def test_a_misspelled_task_fails_with_the_names_it_may_mean():
    with pytest.raises(
        TaskUnavailableError, match=r"unknown task 'hellaswg'.*did you mean hellaswag"
    ):
        resolve_tasks(["hellaswg"])


def test_a_missing_task_fails_before_the_model_is_read(tmp_path):
    # the model folder does not exist either: the task is what is reported
    with pytest.raises(TaskUnavailableError, match="unknown task 'no_such_task'"):
        toast.evaluate(tmp_path / "no-model", "no_such_task")


def test_a_yaml_whose_data_file_is_missing_fails_naming_the_file(tmp_path):
    task = write_continuation_task(tmp_path, TEXTS, choices=2)
    task.with_suffix(".jsonl").unlink()
    with pytest.raises(TaskUnavailableError) as caught:
        resolve_tasks(task)
    assert f"data file {task.with_suffix('.jsonl')} does not exist" in str(caught.value)
    assert str(caught.value).startswith("task continuation:")


def test_a_missing_yaml_file_fails_naming_it(tmp_path):
    with pytest.raises(TaskUnavailableError, match="task file .*nope.yaml does not exist"):
        resolve_tasks(tmp_path / "nope.yaml")


def test_local_data_files_are_read_relative_to_the_yaml_not_the_working_directory(
    tmp_path, monkeypatch
):
    task = write_continuation_task(tmp_path / "task", TEXTS, choices=3)
    monkeypatch.chdir(tmp_path)
    (unit,) = resolve_tasks(os.path.relpath(task))
    assert not unit.registered and unit.name == "continuation"
    assert unit.spec["dataset_kwargs"]["data_files"] == {"test": str(task.with_suffix(".jsonl"))}


def test_a_folder_gives_one_task_per_yaml_and_a_mix_keeps_the_order(tmp_path):
    write_continuation_task(tmp_path / "tasks", TEXTS, name="b_task", choices=2)
    write_continuation_task(tmp_path / "tasks", TEXTS, name="a_task", choices=2)
    other = write_continuation_task(tmp_path / "other", TEXTS, name="c_task", choices=2)
    units = resolve_tasks([other, tmp_path / "tasks"])
    assert [unit.name for unit in units] == ["c_task", "a_task", "b_task"]


def test_a_task_asked_twice_is_refused(tmp_path):
    task = write_continuation_task(tmp_path, TEXTS, choices=2)
    with pytest.raises(ValueError, match="task continuation is asked for twice"):
        resolve_tasks([task, task])


def test_the_fingerprint_follows_the_data_files_content(tmp_path):
    task = write_continuation_task(tmp_path, TEXTS, choices=2)
    (before,) = resolve_tasks(task)
    data = task.with_suffix(".jsonl")
    rows = data.read_text().splitlines()
    data.write_text("\n".join(rows[1:]) + "\n")
    (after,) = resolve_tasks(task)
    assert before.fingerprint != after.fingerprint


def test_the_continuation_task_holds_each_true_ending_among_other_endings(tmp_path):
    task = write_continuation_task(tmp_path, TEXTS, choices=3, seed=1)
    rows = [json.loads(line) for line in task.with_suffix(".jsonl").read_text().splitlines()]
    assert len(rows) == len(TEXTS)
    for text, row in zip(TEXTS, rows, strict=True):
        assert len(row["choices"]) == len(set(row["choices"])) == 3
        assert row["context"] + " " + row["choices"][row["label"]] == text


def test_no_tasks_is_refused():
    with pytest.raises(ValueError, match="at least one task"):
        resolve_tasks([])


def test_without_the_harness_the_install_is_named(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "lm_eval", None)
    with pytest.raises(ImportError, match=r"pip install 'toast-compress\[eval\]'"):
        resolve_tasks("sleb")
