"""A candidate's held-out pass resumed at its first changed block from the
original's recorded block inputs: every measured figure the whole pass's
(to rounding), the blocks before it not run, the memory bound kept, and
the whole pass wherever a resumed one would not be exact."""

from __future__ import annotations

import copy
import functools
import importlib

import pytest

import toast
from toast.frontier import measure as measure_module
from toast.frontier.bench import MemoryBench, first_changed_block
from toast.frontier.candidates import enumerate_candidates
from toast.hf.data.calibration import Calibration
from toast.hf.evaluate.quality import Evaluator
from toast.hf.evaluate.resume import PrefixMismatch, PrefixStates, unchanged_blocks
from toast.methods.base import find_layout, get_method
from toast.methods.calibrate import calibrate, model_sizes

from .conftest import CALIBRATION_LENGTH, image_batches, tiny_llama, tiny_vit, token_batches

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

#: Depth pruning (plain removal, TOAST's fit, ReplaceMe's fold) and a plan
#: changing blocks in place (sub-layer removal).
FAMILIES = ("plain", "toast", "replaceme", "sublayer")
METHODS = ("remove", "toast", "replaceme", "sublayer")


def _calibrated(model, data, macs: bool = False, methods=METHODS):
    layout = find_layout(model, None)
    staged = [get_method(m) for m in methods]
    found = calibrate(model, data, layout, staged, Calibration(progress=False), "auto", 3)
    plans = enumerate_candidates(staged, found, model_sizes(model, layout), 3, macs_matter=macs)
    return layout, found, plans


@pytest.fixture(scope="module")
def llama_case():
    model = tiny_llama()
    layout, found, plans = _calibrated(model, token_batches(4, CALIBRATION_LENGTH, 1))
    return model, layout, found, plans, token_batches(3, 12, 2)


@pytest.fixture(scope="module")
def vit_case():
    model = tiny_vit()
    layout, found, plans = _calibrated(model, image_batches(3, 1))
    return model, layout, found, plans, image_batches(2, 2)


def _benches(case, **options):
    """A bench resuming candidates and one measuring them whole, each with
    the original measured (the reference of the fidelity metrics)."""
    model, layout, found, _, heldout = case
    resumed = MemoryBench(model, layout, found, heldout, None, False, **options)
    whole = MemoryBench(model, layout, found, heldout, None, False, prefix_bytes=0)
    resumed.original(), whole.original()
    return resumed, whole


def assert_same_measurement(got, expected, what: str) -> None:
    assert got.metrics.keys() == expected.metrics.keys(), what
    for key, value in expected.metrics.items():
        assert got.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-12), (what, key)
    assert got.quality == pytest.approx(expected.quality, rel=1e-6), what
    assert (got.params, got.macs) == (expected.params, expected.macs), what


@pytest.mark.parametrize("case_name", ["llama_case", "vit_case"])
def test_a_resumed_candidate_measures_what_the_whole_one_does(case_name, request):
    case = request.getfixturevalue(case_name)
    plans = case[3]
    resumed, whole = _benches(case)
    resumed_families = set()
    for plan in [p for p in plans if p.family in FAMILIES]:
        got, expected = resumed.candidate(plan), whole.candidate(plan)
        assert_same_measurement(got, expected, plan.label)
        assert resumed.resumed[plan.key] <= first_changed_block(plan, case[1].num_blocks)
        if resumed.resumed[plan.key] > 0:
            resumed_families.add(plan.family)
    metrics = set(got.metrics)
    assert metrics >= (
        {"perplexity", "kl", "agreement"} if case_name == "llama_case" else {"cosine"}
    )
    # each kind of plan resumed somewhere: depth pruning and a block changed in place
    offered = {p.family for p in plans} & set(FAMILIES)
    assert resumed_families == offered and {"plain", "toast", "sublayer"} <= offered


def test_replaceme_resumes_before_the_block_its_transform_is_folded_into(llama_case):
    plans = [p for p in llama_case[3] if p.family == "replaceme"]
    resumed, _ = _benches(llama_case)
    for plan in plans:
        resumed.candidate(plan)
        assert resumed.resumed[plan.key] == min(a for a, _ in plan.spans) - 1


def _counted_block_forwards(monkeypatch, block_class) -> list[int]:
    """Counts runs of the blocks' own forward (a stand-in does not run it)."""
    count = [0]
    real = block_class.forward

    def forward(self, *args, **kwargs):
        count[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(block_class, "forward", forward)
    return count


def test_the_blocks_before_the_resumed_one_do_not_run(llama_case, monkeypatch):
    model, layout, _, plans, heldout = llama_case
    plan = max((p for p in plans if p.family == "plain"), key=lambda p: p.spans[0][0])
    resumed, whole = _benches(llama_case)
    count = _counted_block_forwards(monkeypatch, type(layout.stack.blocks[0]))
    resumed.candidate(plan)
    with_reuse, count[0] = count[0], 0
    whole.candidate(plan)
    at = resumed.resumed[plan.key]
    assert at == plan.spans[0][0] > 0
    # the held-out pass skipped `at` blocks per batch; the MAC count ran them all
    assert with_reuse == count[0] - at * len(heldout)


class _Calls:
    """A hook's state: the calls it saw (copied with the model, as a
    bound method's object is)."""

    def __init__(self) -> None:
        self.calls = 0

    def hook(self, module, args) -> None:
        self.calls += 1


def test_hooks_the_copies_inherit_do_not_stop_resuming(monkeypatch):
    # a hook the original's blocks carry (a profiler's, bound to an object
    # the copy copies) ran on the recorded pass: the candidates still resume
    model = tiny_llama()
    calls = _Calls()
    for block in model.model.layers:
        block.register_forward_pre_hook(calls.hook)
    layout, found, plans = _calibrated(model, token_batches(2, CALIBRATION_LENGTH, 1))
    case = (model, layout, found, plans, token_batches(2, 12, 2))
    resumed, whole = _benches(case)
    plan = next(p for p in plans if p.family == "plain")
    assert_same_measurement(resumed.candidate(plan), whole.candidate(plan), plan.label)
    assert resumed.resumed[plan.key] > 0


def test_a_bound_records_evenly_spaced_block_inputs_and_resumes_at_the_nearest(llama_case):
    model, layout, _, plans, heldout = llama_case
    everything, _ = _benches(llama_case)
    per_block = everything.prefix.nbytes // len(everything.prefix.blocks)
    bound = 2 * per_block  # room for two of the five inputs: blocks 2 and 4
    resumed, whole = _benches(llama_case, prefix_bytes=bound)
    kept = resumed.prefix.blocks
    step = resumed.prefix.step
    assert step > 1 and kept == list(range(step, layout.num_blocks, step))
    assert 0 < resumed.prefix.nbytes <= bound
    for plan in [p for p in plans if p.family in ("plain", "sublayer")]:
        assert_same_measurement(resumed.candidate(plan), whole.candidate(plan), plan.label)
        start = first_changed_block(plan, layout.num_blocks)
        assert resumed.resumed[plan.key] == max([b for b in kept if b <= start], default=0)


def test_a_bound_below_one_block_input_records_none_and_measures_whole(llama_case):
    resumed, whole = _benches(llama_case, prefix_bytes=1)
    assert resumed.prefix.blocks == []
    plan = next(p for p in llama_case[3] if p.family == "plain")
    assert_same_measurement(resumed.candidate(plan), whole.candidate(plan), plan.label)
    assert resumed.resumed[plan.key] == 0


def test_vit_plans_changing_every_block_run_whole():
    # head pruning and token merging (fewer tokens from block 0 on) change block 0
    model = tiny_vit()
    layout, found, plans = _calibrated(
        model, image_batches(2, 1), macs=True, methods=("remove", "toast-vit", "tome")
    )
    heldout = image_batches(1, 2)
    resumed, whole = _benches((model, layout, found, plans, heldout))
    families = set()
    for plan in plans:
        heads = plan.to_dict()["head_sparsity"]
        if plan.part("tome") is None and heads is None:
            continue
        families.add(plan.methods[-1])
        assert first_changed_block(plan, layout.num_blocks) == 0
        assert_same_measurement(resumed.candidate(plan), whole.candidate(plan), plan.label)
        assert resumed.resumed[plan.key] == 0
    assert families == {"toast-vit", "tome"}


def test_throughput_and_macs_time_the_whole_model(llama_case, monkeypatch):
    model, layout, found, plans, heldout = llama_case
    bench = MemoryBench(model, layout, found, heldout, None, True, rounds=1)
    bench.original()
    seen = []
    real = measure_module.paired_throughput

    def timing(candidate, reference, example, rounds, batch_size=None):
        blocks = toast.hf.model.blocks.find_blocks(candidate, layout.stack.path).blocks
        seen.append(any(type(b) is not type(layout.stack.blocks[0]) for b in blocks))
        return real(candidate, reference, example, rounds)

    monkeypatch.setattr(measure_module, "paired_throughput", timing)
    plan = next(p for p in plans if p.family == "plain")
    m = bench.candidate(plan)
    assert bench.resumed[plan.key] > 0 and m.throughput is not None
    assert seen == [False]  # no stand-in left in the timed model


def test_other_data_on_a_resumed_pass_is_refused(llama_case):
    model, layout, _, _, heldout = llama_case
    evaluator = Evaluator(heldout, progress=False, fidelity=False)
    prefix = PrefixStates(layout.stack)
    with prefix.recording(model, "auto"):
        evaluator.measure(model)
    other = Evaluator(token_batches(3, 12, 7), progress=False, fidelity=False)
    with pytest.raises(PrefixMismatch, match="batch 0"):
        with prefix.resumed(model, prefix.blocks[-1]):
            other.measure(model)
    fewer = Evaluator(heldout[:-1], progress=False, fidelity=False)
    with pytest.raises(ValueError, match="fewer batches"):
        with prefix.resumed(model, prefix.blocks[-1]):
            fewer.measure(model)
    # and the blocks are the model's own again
    assert list(model.model.layers) == list(layout.stack.blocks)
    assert all(type(b) is type(model.model.layers[0]) for b in model.model.layers)
    assert prefix.resume_point(layout.num_blocks, "bfloat16") == 0  # another compute: none


def test_unchanged_blocks_compares_classes_weights_and_settings(llama_case):
    model, layout, *_ = llama_case
    same = copy.deepcopy(model)
    assert unchanged_blocks(layout.stack, same) == layout.num_blocks
    with torch.no_grad():
        same.model.layers[3].mlp.down_proj.weight[0, 0] += 1.0
    assert unchanged_blocks(layout.stack, same) == 3
    hooked = copy.deepcopy(model)
    hooked.model.layers[2].self_attn.register_forward_hook(lambda *a: None)
    assert unchanged_blocks(layout.stack, hooked, limit=5) == 2
    assert unchanged_blocks(layout.stack, model, limit=4) == 4


def test_search_chooses_and_measures_alike_with_and_without_resuming(monkeypatch):
    search = importlib.import_module("toast.frontier.search")
    model = tiny_llama()
    data, heldout = token_batches(4, CALIBRATION_LENGTH, 1), token_batches(2, 12, 2)
    options = dict(target=0.2, max_measured=6, latency=False, cache=False, progress=False)
    passes = []
    real = PrefixStates.resumed
    monkeypatch.setattr(
        PrefixStates, "resumed", lambda self, m, at: passes.append(at) or real(self, m, at)
    )
    resumed = toast.search(model, data, heldout, **options)
    assert passes and min(passes) > 0  # some candidates resumed
    monkeypatch.setattr(PrefixStates, "resumed", real)
    monkeypatch.setattr(search, "MemoryBench", functools.partial(MemoryBench, prefix_bytes=0))
    whole = toast.search(model, data, heldout, **options)
    assert [m.candidate.key for m in resumed.measured] == [m.candidate.key for m in whole.measured]
    for got, expected in zip(resumed.measured, whole.measured, strict=True):
        assert_same_measurement(got.measurement, expected.measurement, got.candidate.label)
    assert_same_measurement(resumed.original, whole.original, "original")
    assert resumed.chosen == whole.chosen and resumed.front == whole.front
