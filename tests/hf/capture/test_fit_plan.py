"""The block-by-block plan adapts before it refuses: a batch's forward goes
a few rows at a time when the whole batch does not fit (the states, and
so every result, the same), and a plan that cannot fit names every
setting that alone would make it fit."""

from __future__ import annotations

import importlib
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.capture.budget import (  # noqa: E402
    LEAST_LOGIT_BYTES,
    LOGIT_BYTES,
    BudgetError,
    fit_plan,
    plan_total,
    sequential_parts,
)
from toast.hf.capture.sequential import DiskModel  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SHAPE = (8, 64)


@pytest.fixture
def folder(tmp_path):
    R.decoder("llama").save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def _total(disk, shape=SHAPE, rows=None, dtype=None, logits=LEAST_LOGIT_BYTES):
    parts = sequential_parts(disk, shape=shape, rows_at_once=rows, dtype=dtype, logits=logits)
    return plan_total(parts)


def test_a_plan_whose_batch_does_not_fit_takes_the_most_rows_at_once_that_do(folder, capsys):
    disk = DiskModel.open(folder)
    whole, one = _total(disk), _total(disk, rows=1)
    assert one < whole
    budget = (one + whole) // 2
    parts, _ = fit_plan(disk, SHAPE, budget)
    rows = disk.rows_at_once
    assert rows is not None and 1 <= rows < SHAPE[0]
    assert plan_total(parts) <= budget < _total(disk, rows=rows + 1)
    assert f"one forward on {rows} of a batch's 8 rows at a time" in capsys.readouterr().err


def test_a_plan_that_fits_runs_whole_batches(folder):
    disk = DiskModel.open(folder)
    fit_plan(disk, SHAPE, _total(disk, logits=LOGIT_BYTES))
    assert disk.rows_at_once is None and disk.logit_bytes is None


def test_a_plan_lowers_the_logits_held_at_once_before_the_rows(folder, capsys):
    # long rows of a large vocabulary: the held-out logits, not the forward, decide
    disk = DiskModel.open(folder)
    shape = (8, 1 << 15)
    whole = _total(disk, shape, logits=LOGIT_BYTES)
    budget = _total(disk, shape, logits=4 * LEAST_LOGIT_BYTES)
    assert budget < whole
    parts, _ = fit_plan(disk, shape, budget)
    assert disk.rows_at_once is None and disk.logit_bytes == 4 * LEAST_LOGIT_BYTES
    assert plan_total(parts) <= budget < _total(disk, shape, logits=8 * LEAST_LOGIT_BYTES)
    assert "held-out logits 16.0 MiB at a time" in capsys.readouterr().err


def test_a_16bit_checkpoint_plans_its_embedding_and_head_in_16_bits(tmp_path, capsys):
    R.decoder("llama").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    disk = DiskModel.open(tmp_path / "bf16", compute="float32")
    head = disk.model.get_output_embeddings().weight
    outside = dict(sequential_parts(disk))["embedding or head"]
    assert disk.narrow("output") and disk.narrow("input")
    assert outside == head.numel() * (2 + 4) + 3 * LOGIT_BYTES  # a tiny head widens whole
    fit_plan(disk, SHAPE, 2**30)
    assert "embedding and head kept in bfloat16" in capsys.readouterr().err


def test_statistics_keep_their_room_before_rows_are_whole(folder):
    # statistics that take whatever is left: rows are lowered until they get it all
    disk = DiskModel.open(folder)
    wanted = 10 * 2**20

    def statistics(parts):
        return parts + [("statistics", min(wanted, max(budget - plan_total(parts), 1)))], []

    budget = _total(disk, rows=2) + wanted
    fit_plan(disk, SHAPE, budget, statistics)
    assert disk.rows_at_once == 2


def test_a_refused_plan_names_every_setting_that_alone_would_make_it_fit(tmp_path):
    R.decoder("llama").to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    disk = DiskModel.open(tmp_path / "bf16", compute="float32")
    least = _total(disk, rows=1)
    budget = least - 1
    with pytest.raises(BudgetError) as refused:
        fit_plan(disk, SHAPE, budget)
    said = str(refused.value)
    assert "--max-memory" in said
    length = int(re.search(r"--max-length (\d+)", said).group(1))
    size = int(re.search(r"--batch-size (\d+)", said).group(1))
    assert "--compute-dtype checkpoint" in said
    # each setting named fits, and is the least change that does
    assert (
        _total(disk, (SHAPE[0], length), rows=1)
        <= budget
        < _total(disk, (SHAPE[0], length + 1), rows=1)
    )
    assert _total(disk, (size, SHAPE[1]), rows=1) <= budget < _total(disk, (size + 1, SHAPE[1]), 1)
    assert _total(disk, rows=1, dtype=torch.bfloat16) <= budget


def test_a_plan_out_of_every_settings_reach_names_only_the_budget(folder):
    disk = DiskModel.open(folder)  # float32: no narrower dtype to compute in
    with pytest.raises(BudgetError) as refused:
        fit_plan(disk, SHAPE, 1024)
    said = str(refused.value)
    assert "--max-memory" in said and "--max-length" not in said
    assert "--batch-size" not in said and "--compute-dtype" not in said


@pytest.mark.parametrize(
    ("method", "size"), [("replaceme", {"num_blocks": 1}), ("toast", {"budget": 1})]
)
def test_a_method_run_a_few_rows_at_a_time_writes_the_same_model(
    folder, tmp_path, monkeypatch, method, size
):
    import toast.methods.pipeline as pipeline

    real = pipeline.fit_plan

    def three_rows(disk, *args, **kwargs):
        found = real(disk, *args, **kwargs)
        disk.rows_at_once = 3
        return found

    data = R.text_loader(n=80, batch_size=8)
    common = {"method": method, "sequential": True, "progress": False, **size}
    toast.compress(folder, data, output=tmp_path / "whole", **common)
    monkeypatch.setattr(pipeline, "fit_plan", three_rows)
    toast.compress(folder, data, output=tmp_path / "rows", **common)
    whole, rows = toast.load_model(tmp_path / "whole"), toast.load_model(tmp_path / "rows")
    a, b = whole.state_dict(), rows.state_dict()
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_search_from_disk_a_few_rows_at_a_time_chooses_and_writes_the_same(folder, monkeypatch):
    # the search plans its shared pass where it opens the checkpoint
    source = importlib.import_module("toast.frontier.source")

    real = source.fit_plan

    def three_rows(disk, *args, **kwargs):
        found = real(disk, *args, **kwargs)
        disk.rows_at_once = 3
        return found

    data, heldout = R.text_loader(n=48, batch_size=8), R.text_loader(n=16, batch_size=8, seed=1)
    common = {"target": 0.2, "cache": False, "progress": False, "latency": False, "max_measured": 2}
    whole = toast.search(folder, data, heldout, sequential=True, **common)
    monkeypatch.setattr(source, "fit_plan", three_rows)
    rows = toast.search(folder, data, heldout, sequential=True, **common)
    assert rows.best.candidate.label == whole.best.candidate.label
    assert [m.measurement.quality for m in rows.measured] == pytest.approx(
        [m.measurement.quality for m in whole.measured], rel=1e-5
    )
