"""The block-by-block path plans its peak before any pass: one block, the
embedding or head, the method's statistics fitted to what ``max_memory``
leaves; printed, and refused up front when even the least does not fit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.capture.budget import BudgetError, sequential_parts  # noqa: E402
from toast.hf.capture.sequential import DiskModel  # noqa: E402
from toast.methods.replaceme import replaceme  # noqa: E402
from toast.methods.replaceme.config import ReplaceMeConfig  # noqa: E402
from toast.methods.replaceme.memory import within_memory as replaceme_within  # noqa: E402
from toast.methods.translate.config import ToastConfig  # noqa: E402
from toast.methods.translate.memory import within_memory as toast_within  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture
def source(tmp_path):
    R.decoder("llama").save_pretrained(tmp_path / "source")
    return tmp_path / "source"


def test_the_plan_is_printed_before_the_pass_with_every_part(source, tmp_path, capsys):
    toast.compress(
        source, R.text_loader(), method="replaceme", num_blocks=1, output=tmp_path / "out",
        sequential=True, progress=True,
    )  # fmt: skip
    said = capsys.readouterr().err
    plan = next(line for line in said.splitlines() if "memory plan:" in line)
    assert "one block" in plan and "embedding or head" in plan and "statistics" in plan
    assert said.index("memory plan:") < said.index("distances")


def test_a_budget_below_the_plans_least_is_refused_before_any_pass(source, tmp_path):
    data = R.text_loader()
    parts = sequential_parts(DiskModel.open(source), data)
    least = sum(n for _, n in parts)
    with pytest.raises(BudgetError, match="needs at least .* raise --max-memory"):
        toast.compress(
            source, data, method="toast", budget=1, output=tmp_path / "out",
            sequential=True, max_memory=least // 2, progress=False,
        )  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_replaceme_holds_fewer_cuts_a_pass_when_all_do_not_fit():
    from toast.methods.replaceme import memory

    config = ReplaceMeConfig(num_blocks=2, candidates=4)  # a full T: its solve frees its moments
    d = 512
    panel = d * d * 8
    cut, solve = memory.PANELS_PER_CUT, memory.SOLVE_MATRICES_FULL
    # room for the solve, the 4 transforms kept and one cut's moments
    fitted, parts = replaceme_within(config, 9, d, room=(solve + 4 + cut) * panel)
    assert fitted.cuts_at_once == 1
    assert parts[0][1] == (cut + solve) * panel
    roomy, _ = replaceme_within(config, 9, d, room=100 * d * d * 8)
    assert roomy.cuts_at_once is None


def test_replaceme_fitted_a_cut_a_pass_equals_all_cuts_in_one_pass():
    data = R.text_loader(n=80, batch_size=4)  # 20 batches: 2 held out to choose among 4 cuts
    _, one = replaceme(R.decoder("llama"), data, num_blocks=1, cuts_at_once=1, progress=False)
    _, all_ = replaceme(R.decoder("llama"), data, num_blocks=1, progress=False)
    assert len(all_.candidates) == 4 and one.spans == all_.spans
    assert [c.used for c in one.candidates] == [c.used for c in all_.candidates]
    assert all((a == b).all() for a, b in zip(one.transforms, all_.transforms, strict=True))


def test_toast_statistics_bound_is_lowered_to_the_room_and_never_below_one_pair():
    from toast.core.chunked import JOIN_BYTES, pair_nbytes

    config = ToastConfig(budget=2)
    d, states = 1024, 17
    fitted, parts = toast_within(config, states, d, room=JOIN_BYTES + pair_nbytes(d, 0) + 1)
    assert fitted.statistics_bytes == pair_nbytes(d, 0) + 1
    assert parts == [("moments, chunked from disk", pair_nbytes(d, 0) + 1 + JOIN_BYTES)]
    starved, parts = toast_within(config, states, d, room=0)
    assert starved.statistics_bytes == pair_nbytes(d, 0)  # the least, which the plan refuses
    small, parts = toast_within(ToastConfig(budget=2), 5, 32, room=2**30)
    assert small.statistics_bytes == "auto" and parts[0][0] == "moments"


def test_toast_auto_estimator_counts_the_folds_pass_when_the_rows_are_few():
    from toast.core import Moments
    from toast.core.chunked import JOIN_BYTES, workspace_nbytes

    config = ToastConfig(budget=2)  # estimator "auto", metric "linear", 5 folds, 10% held out
    d, states = 1024, 9  # 192 MiB of moments, 960 MiB with the folds
    whole, with_folds = (
        Moments.estimate_nbytes(states, d, f, config.pairs) for f in (0, config.folds)
    )
    room = whole + JOIN_BYTES  # the pass without folds fits, the folds' pass does not
    assert whole < room < with_folds
    # 20 batches, the 10th and the 20th held out: GCV wants 5 x 1,025 rows of the other 18
    enough = [5 * 1025 // 18 + 1] * 20
    planned, parts = toast_within(config, states, d, room, enough)
    solve = workspace_nbytes(d)  # the errors' solves, beside the whole moments
    assert parts == [("moments", whole + solve)]  # GCV: one pass, no folds
    # every capture of the run (the measured choice's too) is bounded by what the solves leave
    assert planned == dataclasses.replace(config, statistics_bytes=room - solve)
    few = [5 * 1025 // 18] * 20
    for tokens in (few, None, [10**6]):  # few rows, unknown ones, one batch split by sequence
        planned, parts = toast_within(config, states, d, room, tokens)
        assert planned.statistics_bytes == room - JOIN_BYTES
        assert parts == [("moments, chunked from disk", room)]


def test_the_batches_tokens_are_counted_once_without_the_held_out_or_padding():
    from toast.hf.capture.budget import ShapeOnce

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": mask}
    held = {"input_ids": torch.zeros(5, 6, dtype=torch.long)}
    reads = []
    shape = ShapeOnce(lambda: reads.append("batches") or [batch, batch], lambda: [held])
    assert shape.tokens(None) == (5, 5) and shape(None) == (5, 6) and reads == ["batches"]
    assert ShapeOnce(lambda: [{"input_ids": torch.zeros(3, 7)}]).tokens(None) == (21,)
    assert ShapeOnce(lambda: [{"text": "raw"}]).tokens(None) is None


def test_analyze_of_a_folder_from_disk_plans_and_equals_the_loaded_model(source, capsys):
    from toast.io.local import load_model

    data = R.text_loader()
    on_disk = toast.analyze(source, data, estimator="gcv", sequential=True, progress=False)
    assert "memory plan:" in capsys.readouterr().err
    loaded = toast.analyze(load_model(source), data, estimator="gcv", progress=False)
    np.testing.assert_allclose(on_disk.errors, loaded.errors, rtol=1e-5, atol=1e-7)


def test_analyze_of_a_folder_refuses_a_budget_below_its_plan_before_any_pass(source):
    with pytest.raises(BudgetError, match="toast analyze|needs at least"):
        toast.analyze(source, R.text_loader(), sequential=True, max_memory="1KiB", progress=False)


def test_max_memory_is_refused_for_a_loaded_model():
    with pytest.raises(ValueError, match="checkpoint folder"):
        toast.analyze(R.decoder("llama"), R.text_loader(), max_memory="1GiB", progress=False)


@pytest.mark.parametrize("method", ["replaceme", "toast"])
def test_held_out_sweeps_from_disk_are_counted(source, tmp_path, capsys, method):
    # 20 batches: enough to hold some out; each sweep reads every block from disk
    size = {"num_blocks": 1} if method == "replaceme" else {"budget": 1}
    toast.compress(
        source, R.text_loader(n=80, batch_size=4), method=method, output=tmp_path / "out",
        sequential=True, progress=True, **size,
    )  # fmt: skip
    assert "held-out: " in capsys.readouterr().err


def test_analyze_of_a_folder_in_memory_passes_the_backend_on(source, monkeypatch):
    import toast.methods.translate.analysis as analysis_module

    seen = []
    real = analysis_module.capture_moments

    def recording(*args, **kwargs):
        seen.append(kwargs["backend"])
        return real(*args, **kwargs)

    monkeypatch.setattr(analysis_module, "capture_moments", recording)
    toast.analyze(source, R.text_loader(), backend="torch", sequential=False, progress=False)
    assert seen == ["torch"]


def _loaded_run_needs(folder, data, moments: int) -> int:
    """What the in-memory path needs, summed here from its parts: the
    loaded model with its margin, the statistics, one forward and the
    held-out logits of the largest batch."""
    from toast.hf.capture.budget import IN_MEMORY_MARGIN, batch_shape, in_memory_parts
    from toast.hf.model.checkpoint import Checkpoint

    checkpoint = Checkpoint(folder)
    config = checkpoint.config
    run = in_memory_parts(config, batch_shape(data, config), [("moments", moments)])
    return int(checkpoint.nbytes * (1 + IN_MEMORY_MARGIN)) + sum(n for _, n in run)


def test_a_model_that_fits_but_whose_run_does_not_goes_block_by_block(source, tmp_path, capsys):
    from toast.core import Moments
    from toast.core.chunked import workspace_nbytes
    from toast.hf.model.checkpoint import Checkpoint

    data = R.text_loader()
    config = Checkpoint(source).config
    states, width = config.num_hidden_layers + 1, config.hidden_size
    moments = Moments.estimate_nbytes(states, width, 0, ToastConfig(num_blocks=1).pairs)
    needs = _loaded_run_needs(source, data, moments + workspace_nbytes(width))  # with the solves
    assert Checkpoint(source).nbytes * 2 < needs  # the model alone would fit either budget
    said = {}
    for budget, out in ((needs, "memory"), (needs - 1, "disk")):
        toast.compress(
            source, data, method="toast", num_blocks=1, output=tmp_path / out,
            max_memory=budget, progress=True,
        )  # fmt: skip
        said[out] = capsys.readouterr().err
    assert "in-memory path: the model needs about" in said["memory"]
    assert "sequential path (block by block from disk)" in said["disk"]
    assert "memory plan:" in said["disk"]
    for part in ("moments", "one batch's forward", "held-out logits"):
        assert part in said["disk"].split("memory plan:")[0]


def test_a_search_on_a_folder_counts_its_shared_pass_before_loading_it(source):
    import functools

    from toast.frontier.source import run_beside
    from toast.hf.capture.budget import ShapeOnce, plan_checkpoint
    from toast.hf.evaluate.resume import PREFIX_BYTES

    data = R.text_loader()
    beside = functools.partial(run_beside, ShapeOnce(lambda: data))
    parts = dict(beside(DiskModel.open(source).model.config))
    assert parts["recorded held-out states"] == PREFIX_BYTES and parts["moments of the shared pass"]
    needs = _loaded_run_needs(source, data, parts["moments of the shared pass"]) + PREFIX_BYTES
    fits, _ = plan_checkpoint(source, needs, beside=beside, progress=False)
    over, disk = plan_checkpoint(source, needs - 1, beside=beside, progress=False)
    assert not fits.sequential and fits.in_memory == needs
    assert over.sequential and disk is not None


def test_a_budget_asked_for_hands_freed_memory_back_on_the_in_memory_path_too(source, monkeypatch):
    from toast.hf.capture import budget

    calls = []
    monkeypatch.setattr(budget, "return_freed_memory", lambda: calls.append(True) or True)
    plan, _ = budget.plan_checkpoint(source, "64GiB", progress=False)
    assert not plan.sequential and calls == [True]
    plan, _ = budget.plan_checkpoint(source, None, progress=False)  # no budget: glibc's default
    assert not plan.sequential and calls == [True]


def test_a_one_shot_iterator_of_batches_reaches_the_run_unread(source, tmp_path):
    # the path's choice reads the batches' shapes; an iterator would be spent by it
    data = R.text_loader()
    reports = [
        toast.compress(
            source,
            given,
            method="remove",
            num_blocks=1,
            output=tmp_path / name,
            max_memory="64GiB",
            progress=False,
        )
        for name, given in (("listed", data), ("iterated", iter(data)))
    ]
    assert [(s.start, s.error) for s in reports[0].spans] == [
        (s.start, s.error) for s in reports[1].spans
    ]
