"""toast.evaluate on lm-evaluation-harness, offline: a tiny random Llama on a
multiple-choice task written from local text, against a log-likelihood
comparison computed here with torch, and the retained performance and the
reference cache against their definitions."""

from __future__ import annotations

import copy
import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

import toast  # noqa: E402
from tests.hf.evaluate.conftest import by_hand, tiny_llama  # noqa: E402
from toast.hf.evaluate.harness import TaskReport, task_accuracy, weights_digest  # noqa: E402
from toast.hf.evaluate.tasks import resolve_tasks  # noqa: E402
from toast.hf.model.surgery import remove_blocks  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _rows(local_task) -> list[dict]:
    lines = local_task.with_suffix(".jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_accuracy_on_a_local_task_equals_a_direct_log_likelihood_comparison(
    llama, tokenizer, local_task, tmp_path
):
    report = toast.evaluate(llama, local_task, tokenizer, progress=False, cache=tmp_path)
    acc, acc_norm = by_hand(llama, tokenizer, _rows(local_task))
    metrics = report.metrics["continuation"]
    assert metrics["acc"] == pytest.approx(acc) and metrics["acc_norm"] == pytest.approx(acc_norm)
    assert report.headline == {"continuation": "acc_norm"}
    assert report.accuracy == {"continuation": pytest.approx(acc_norm)}
    assert report.average == pytest.approx(acc_norm)
    n = len(_rows(local_task))
    stderr = math.sqrt(acc * (1 - acc) / (n - 1))  # the harness's sample stderr of a mean
    assert metrics["acc_stderr"] == pytest.approx(stderr)
    assert report.harness["n-samples"]["continuation"]["effective"] == n
    assert report.reference is None and report.retained is None


def test_a_compressed_copy_retains_its_average_over_the_references_times_100(
    llama, tokenizer, local_task, tmp_path
):
    pruned = remove_blocks(copy.deepcopy(llama), [(1, 3)])
    report = toast.evaluate(pruned, local_task, tokenizer, reference=llama, cache=tmp_path)
    alone = toast.evaluate(llama, local_task, tokenizer, progress=False, cache=False)
    assert report.reference is not None
    assert report.reference.accuracy == alone.accuracy
    assert report.retained == pytest.approx(report.average / alone.average * 100)
    assert report.retained_by_task == {
        "continuation": pytest.approx(
            report.accuracy["continuation"] / alone.accuracy["continuation"] * 100
        )
    }


def _counting(model):
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_the_reference_is_measured_once_then_read_from_the_cache(
    llama, tokenizer, local_task, tmp_path
):
    reference = copy.deepcopy(llama)
    calls = _counting(reference)
    first = toast.evaluate(llama, local_task, tokenizer, reference, progress=False, cache=tmp_path)
    measured = len(calls)
    second = toast.evaluate(llama, local_task, tokenizer, reference, progress=False, cache=tmp_path)
    assert measured > 0 and len(calls) == measured  # no second harness run for the reference
    assert second.reference == first.reference
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_changed_weights_or_settings_miss_the_reference_cache(
    llama, tokenizer, local_task, tmp_path
):
    reference = copy.deepcopy(llama)
    calls = _counting(reference)
    units = resolve_tasks(local_task)
    toast.evaluate(llama, units, tokenizer, reference, progress=False, cache=tmp_path)
    toast.evaluate(llama, units, tokenizer, reference, limit=5, progress=False, cache=tmp_path)
    with torch.no_grad():
        reference.lm_head.weight[0, 0] += 1.0
    before = len(calls)
    toast.evaluate(llama, units, tokenizer, reference, limit=5, progress=False, cache=tmp_path)
    assert len(calls) > before
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_the_weights_digest_follows_the_tensors_not_the_object():
    a, b, c = tiny_llama(seed=0), tiny_llama(seed=0), tiny_llama(seed=1)
    assert weights_digest(a) == weights_digest(b) != weights_digest(c)


def test_a_saved_report_reloads_equal_with_its_markdown_beside(
    llama, tokenizer, local_task, tmp_path
):
    pruned = remove_blocks(copy.deepcopy(llama), [(2, 3)])
    report = toast.evaluate(
        pruned, local_task, tokenizer, llama, limit=8, progress=False, cache=tmp_path / "cache"
    )
    path = report.save(tmp_path / "out" / "report.json")
    again = TaskReport.load(path)
    assert again == report and again.retained == report.retained
    assert (tmp_path / "out" / "report.md").read_text() == report.to_markdown() + "\n"
    assert report.harness["n-samples"]["continuation"]["effective"] == 8
    data = json.loads(path.read_text())
    assert (
        data["harness"]["results"]["continuation"]["acc,none"]
        == report.metrics["continuation"]["acc"]
    )
    assert data["toast"]["retained"] == report.retained


def test_the_markdown_table_shows_each_task_the_average_and_the_retained_share(
    llama, tokenizer, local_task, tmp_path
):
    pruned = remove_blocks(copy.deepcopy(llama), [(1, 2)])
    report = toast.evaluate(pruned, local_task, tokenizer, llama, limit=6, progress=False,
                            cache=tmp_path)  # fmt: skip
    table = report.to_markdown().splitlines()
    assert table[0].startswith("| task | metric | accuracy (%)") and "retained (%)" in table[0]
    row = table[2].split("|")
    assert row[1].strip() == "continuation" and row[2].strip() == "acc_norm"
    assert float(row[3]) == pytest.approx(100 * report.accuracy["continuation"], abs=0.005)
    assert "**average**" in table[3] and f"{report.retained:.1f}" in table[3]
    assert "limit 6 documents per task" in table[-2]
    assert table[-1] == f"Data: continuation: {local_task.resolve()}"


def test_a_reference_report_measured_otherwise_is_refused(llama, tokenizer, local_task, tmp_path):
    reference = toast.evaluate(llama, local_task, tokenizer, limit=4, progress=False, cache=False)
    with pytest.raises(ValueError, match="limit=4 and this model with limit=None"):
        toast.evaluate(llama, local_task, tokenizer, reference, progress=False, cache=False)


def test_a_reference_report_measured_alike_gives_the_retained_share(llama, tokenizer, local_task):
    reference = toast.evaluate(llama, local_task, tokenizer, limit=4, progress=False, cache=False)
    report = toast.evaluate(llama, local_task, tokenizer, reference, limit=4, progress=False)
    assert report.retained == pytest.approx(100.0)


def test_task_accuracy_is_the_reports_average(llama, tokenizer, local_task):
    report = toast.evaluate(llama, local_task, tokenizer, limit=6, progress=False, cache=False)
    assert task_accuracy(llama, tokenizer, resolve_tasks(local_task), limit=6) == report.average


def test_a_model_folder_is_read_with_its_own_tokenizer(llama, tokenizer, local_task, tmp_path):
    llama.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    from_disk = toast.evaluate(tmp_path / "model", local_task, limit=6, progress=False)
    in_memory = toast.evaluate(llama, local_task, tokenizer, limit=6, progress=False)
    assert from_disk.metrics == in_memory.metrics


def test_a_module_without_a_tokenizer_asks_for_one(llama, local_task):
    with pytest.raises(ValueError, match=r"pass tokenizer=toast.load_tokenizer"):
        toast.evaluate(llama, local_task, progress=False)


def test_the_users_tokenizer_and_the_models_mode_are_not_changed(llama, local_task):
    from tests.hf.evaluate.conftest import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.pad_token = None
    llama.train()
    try:
        toast.evaluate(llama, local_task, tokenizer, limit=2, progress=False, cache=False)
        assert tokenizer.pad_token is None and llama.training
    finally:
        llama.eval()


def test_progress_names_each_task_against_the_total(llama, tokenizer, local_task, capsys):
    toast.evaluate(llama, [local_task], tokenizer, limit=2, cache=False)
    err = capsys.readouterr().err
    assert "model: task 1/1 continuation acc_norm" in err
    assert "Running loglikelihood requests" not in err  # the harness's own bars are silenced


def test_bfloat16_scores_a_float32_model_under_autocast_and_caches_its_reference_apart(
    llama, tokenizer, local_task, tmp_path
):
    reference = copy.deepcopy(llama)
    seen = []
    handles = [
        m.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        for m in llama.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    units = resolve_tasks(local_task)
    try:
        toast.evaluate(
            llama, units, tokenizer, reference, progress=False, cache=tmp_path,
            compute_dtype="bfloat16",
        )  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    assert set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in llama.parameters())
    toast.evaluate(llama, units, tokenizer, reference, progress=False, cache=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2  # a float32 reference is not a bf16 one
