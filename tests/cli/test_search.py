"""``toast search``: a local model and text in, the chosen model and the
report out; bad arguments fail before anything loads."""

import json

import pytest

import toast
from tests._helpers import paired_stderr_ref
from toast._validation import format_size
from toast.cli.main import main
from toast.cli.options import EXIT_USAGE

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.hf


def test_search_writes_the_chosen_model_and_the_report(local_llama, tmp_path, capsys):
    argv = ["search", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--heldout", "0.25", "--target", "params=20%", "--max-measured", "3"]
    argv += ["--no-latency", "--no-progress", "--cache", str(tmp_path / "cache")]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "Spearman" in printed
    saved = json.loads((tmp_path / "out" / "search.json").read_text())
    assert saved["chosen"] is not None
    model = toast.load_pretrained(tmp_path / "out" / "model")
    kept = saved["measured"][saved["chosen"]]["measurement"]["params"]
    assert toast.count_params(model) == kept
    for name in ("report.md", "front.png", "front.svg"):
        assert (tmp_path / "out" / name).is_file(), name


def test_search_follows_the_objective_and_reports_every_metric(local_llama, tmp_path, capsys):
    argv = ["search", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--heldout", "0.25", "--target", "params=20%", "--max-measured", "3"]
    argv += ["--no-latency", "--no-progress", "--cache", str(tmp_path / "cache")]
    assert main([*argv, "--objective", "kl", "--out", str(tmp_path / "out")]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "| candidate" in line)
    assert header.startswith("| candidate | predicted error | KL | perplexity |")
    saved = json.loads((tmp_path / "out" / "search.json").read_text())
    assert saved["metric"] == "kl"
    chosen = saved["measured"][saved["chosen"]]["measurement"]
    assert chosen["quality"] == chosen["metrics"]["kl"]


@pytest.mark.parametrize(
    "bad, said",
    [
        (["--target", "weights=20%"], "target kind"),
        (["--target", "params=120%"], "between 0 and 1"),
        (["--max-measured", "0"], "--max-measured"),
        (["--objective", "loss"], "objective must be one of"),
        (["--objective", "kl", "--target", "quality=10%"], "original's kl to itself is 0"),
        (["--objective", "kl", "--task-limit", "5"], "--task-limit applies"),
    ],
)
def test_search_refuses_bad_arguments_before_loading(local_llama, tmp_path, capsys, bad, said):
    argv = ["search", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--heldout", "0.25", "--out", str(tmp_path / "out"), *bad]
    assert main(argv) == EXIT_USAGE
    assert said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_search_of_a_folder_from_disk_saves_the_memory_choice(local_llama, tmp_path, capsys):
    argv = ["search", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--heldout", "0.25", "--target", "params=20%", "--max-measured", "3"]
    argv += ["--no-latency", "--no-progress", "--no-cache"]
    # the methods with a block-by-block path (LinearPatch and sub-layers run in memory only)
    argv += ["--methods", "remove", "replaceme", "toast"]
    assert main([*argv, "--path", "memory", "--out", str(tmp_path / "memory")]) == 0
    capsys.readouterr()
    assert main([*argv, "--path", "disk", "--out", str(tmp_path / "disk")]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "path" in line]
    assert len(said) == 1 and said[0].startswith("toast search: sequential path")
    on_disk = json.loads((tmp_path / "disk" / "search.json").read_text())
    in_memory = json.loads((tmp_path / "memory" / "search.json").read_text())
    assert (
        on_disk["measured"][on_disk["chosen"]]["key"]
        == (in_memory["measured"][in_memory["chosen"]]["key"])
    )
    ids = torch.tensor([[5, 9, 13, 17, 21, 25]])
    with torch.inference_mode():
        expected = toast.load_pretrained(tmp_path / "memory" / "model")(input_ids=ids).logits
        got = toast.load_pretrained(tmp_path / "disk" / "model")(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_search_from_disk_counts_its_held_out_sweeps_and_states_its_cache_entry(
    local_llama, tmp_path, capsys
):
    argv = ["search", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--heldout", "0.25", "--target", "params=20%", "--max-measured", "2", "--no-latency"]
    argv += ["--path", "disk", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    said = capsys.readouterr().err
    assert "held-out: original (sequential)" in said
    entry = next((tmp_path / "cache").glob("*/calibration.pkl"))
    assert f"calibration cached: {format_size(entry.stat().st_size)} in {entry.parent}" in said


def test_search_refuses_a_max_memory_its_moments_exceed_before_any_pass(
    local_llama, tmp_path, capsys
):
    argv = ["search", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--heldout", "0.25", "--no-progress", "--no-cache", "--max-memory", "1KB"]
    assert main([*argv, "--out", str(tmp_path / "out")]) != 0
    assert "needs at least" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_search_refuses_a_bad_max_memory_before_loading(local_llama, tmp_path, capsys):
    argv = ["search", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--heldout", "0.25", "--out", str(tmp_path / "out"), "--max-memory", "lots"]
    assert main(argv) == EXIT_USAGE
    assert "not a size" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _task_search(local_llama, tmp_path, max_measured: int, limit: int) -> tuple[list[str], str]:
    """``toast search`` arguments choosing by a local continuation task, at
    20% fewer parameters, cached under ``tmp_path / "cache"`` (no ``--out``),
    and the objective they name."""
    from tests.cli.conftest import TEXTS
    from toast.hf.evaluate.tasks import write_continuation_task

    task = write_continuation_task(tmp_path / "task", sorted(set(TEXTS)), choices=3)
    argv = ["search", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--heldout", "0.25", "--target", "params=20%", "--max-measured", str(max_measured)]
    argv += ["--no-latency", "--no-progress", "--cache", str(tmp_path / "cache")]
    objective = f"task:{task}"
    return [*argv, "--objective", objective, "--task-limit", str(limit)], objective


def test_search_with_a_task_objective_chooses_by_task_accuracy(
    local_llama, tmp_path, capsys, private_datasets_cache
):
    pytest.importorskip("lm_eval")
    argv, objective = _task_search(local_llama, tmp_path, max_measured=2, limit=6)
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "search.json").read_text())
    assert saved["metric"] == objective
    accuracies = [m["measurement"]["quality"] for m in saved["measured"]]
    assert all(0.0 <= a <= 1.0 for a in accuracies)
    meeting = [
        m
        for m in saved["measured"]
        if m["measurement"]["params"] <= 0.8 * saved["original"]["params"]
    ]
    chosen = saved["measured"][saved["chosen"]]["measurement"]
    assert "perplexity" in chosen["metrics"] and "kl" in chosen["metrics"]
    # the most accurate, or of those within one paired standard error of it
    # (the same documents), the one of lowest held-out perplexity
    best = max((m["measurement"] for m in meeting), key=lambda m: m["quality"])
    tied = [
        m["measurement"]
        for m in meeting
        if best["quality"] - m["measurement"]["quality"]
        <= paired_stderr_ref(best["documents"], m["measurement"]["documents"])
    ]
    assert chosen["metrics"]["perplexity"] == min(m["metrics"]["perplexity"] for m in tied)


def test_a_task_entry_cached_without_per_document_scores_is_measured_again(
    local_llama, tmp_path, capsys, private_datasets_cache
):
    pytest.importorskip("lm_eval")
    argv, _ = _task_search(local_llama, tmp_path, max_measured=1, limit=4)
    assert main([*argv, "--out", str(tmp_path / "first")]) == 0
    entries = list((tmp_path / "cache").rglob("measurements.json"))
    assert len(entries) == 1
    store = json.loads(entries[0].read_text())
    assert all(m["documents"] for m in store.values())
    for m in store.values():  # as an earlier release cached them
        del m["documents"]
    entries[0].write_text(json.dumps(store))
    assert main([*argv, "--out", str(tmp_path / "again")]) == 0
    saved = json.loads((tmp_path / "again" / "search.json").read_text())
    assert saved["measured"] and not any(m["cached"] for m in saved["measured"])
    assert all(m["measurement"]["documents"] for m in saved["measured"])


def test_search_with_a_task_whose_data_is_missing_fails_before_loading(
    local_llama, tmp_path, capsys
):
    pytest.importorskip("lm_eval")
    argv = ["search", str(local_llama / "model"), "--data", str(local_llama / "calib.txt")]
    argv += ["--heldout", "0.25", "--objective", f"task:{tmp_path / 'absent.yaml'}"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--no-progress"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "absent.yaml" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
