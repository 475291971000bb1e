"""toast.search on a checkpoint folder, block by block from disk: the same
candidates, sizes, predictions, held-out quality and choice as the search
of the loaded model, the same saved model, at most one block's weights in
memory, and the targets it cannot measure refused before any work."""

from __future__ import annotations

import importlib
import math

import pytest

import toast
from toast.hf.capture.sequential import DiskModel

from .conftest import CALIBRATION_LENGTH, HELDOUT_LENGTH, tiny_llama, token_batches

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

#: A sharded checkpoint: each shard holds a few tensors.
SHARD = "20KB"
#: Methods with a block-by-block path (ToaSt's ViT stages run in memory only:
#: a disk search leaves them out, so the comparisons with the in-memory search
#: name methods both run); LinearPatch and sub-layer pruning are compared apart.
DISK_METHODS = ["remove", "replaceme", "toast"]


def _data():
    return token_batches(4, CALIBRATION_LENGTH, 1), token_batches(2, HELDOUT_LENGTH, 2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_llama().save_pretrained(folder, max_shard_size=SHARD)
    assert len(list(folder.glob("*.safetensors"))) > 1
    return folder


@pytest.fixture(scope="module")
def both(checkpoint, tmp_path_factory):
    """The in-memory search of the loaded checkpoint and the disk search of
    the folder, each with its saved model."""
    data, heldout = _data()
    common = {"target": 0.2, "latency": False, "cache": False, "progress": False}
    common["methods"] = DISK_METHODS
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    memory = toast.search(model, data, heldout, **common)
    disk = toast.search(checkpoint, data, heldout, sequential=True, **common)
    out = tmp_path_factory.mktemp("saved")
    memory.save(out / "memory")
    disk.save(out / "disk")
    return memory, disk, out


def test_disk_search_measures_the_same_candidates_as_in_memory(both):
    memory, disk, _ = both
    assert [m.candidate.key for m in disk.measured] == [m.candidate.key for m in memory.measured]
    assert disk.enumerated == memory.enumerated
    for d, m in zip(disk.measured, memory.measured, strict=True):
        assert d.measurement.params == m.measurement.params == m.candidate.params_after
        assert d.candidate.predicted_error == pytest.approx(m.candidate.predicted_error, rel=1e-6)
        assert d.measurement.quality == pytest.approx(m.measurement.quality, rel=1e-5)
    assert disk.original.quality == pytest.approx(memory.original.quality, rel=1e-5)
    assert disk.original.params == memory.original.params


def test_disk_search_chooses_the_same_plan(both):
    memory, disk, _ = both
    assert memory.best is not None and disk.best is not None
    assert disk.best.candidate.key == memory.best.candidate.key
    assert disk.model is None  # never loaded


def test_disk_search_notes_that_latency_is_off(both):
    _, disk, _ = both
    assert any("latency not measured" in note for note in disk.notes)


def test_disk_search_reports_macs_as_not_counted_rather_than_zero(both):
    memory, disk, _ = both
    assert all(m.measurement.macs is None for m in disk.measured) and disk.original.macs is None
    assert all(m.measurement.macs for m in memory.measured)
    row = disk.to_markdown().split("| original |", 1)[1].split("\n", 1)[0]
    assert "| — |" in row and "| 0 |" not in row


def test_disk_search_notes_the_methods_it_leaves_out(checkpoint):
    data, heldout = _data()
    common = {"target": 0.2, "latency": False, "cache": False, "progress": False}
    disk = toast.search(checkpoint, data, heldout, max_measured=1, sequential=True, **common)
    left_out = [note for note in disk.notes if "left out on the block-by-block path" in note]
    assert len(left_out) == 1
    assert "toast-vit" in left_out[0]
    assert not any(name in left_out[0] for name in ("linearpatch", "sublayer"))


def test_disk_search_of_linearpatch_and_sublayers_matches_memory(checkpoint, tmp_path):
    """Their plans from their own sweeps, measured with the patch applied or
    the sub-layers zeroed as the blocks load; the chosen one written."""
    data, heldout = _data()
    common = {"target": 0.2, "latency": False, "cache": False, "progress": False}
    common["methods"] = ["linearpatch", "sublayer"]
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    memory = toast.search(model, data, heldout, max_measured=6, **common)
    disk = toast.search(checkpoint, data, heldout, max_measured=6, sequential=True, **common)
    assert [m.candidate.key for m in disk.measured] == [m.candidate.key for m in memory.measured]
    assert {m.candidate.family for m in disk.measured} == {"linearpatch", "sublayer"}
    for d, m in zip(disk.measured, memory.measured, strict=True):
        assert d.measurement.params == m.measurement.params
        assert d.candidate.predicted_error == pytest.approx(m.candidate.predicted_error, rel=1e-9)
        assert d.measurement.quality == pytest.approx(m.measurement.quality, rel=1e-5)
    assert disk.best is not None and memory.best is not None
    assert disk.best.candidate.key == memory.best.candidate.key
    memory.save(tmp_path / "memory")
    disk.save(tmp_path / "disk")
    ids = token_batches(1, HELDOUT_LENGTH, 3)[0]["input_ids"]
    with torch.inference_mode():
        expected = toast.load_pretrained(tmp_path / "memory" / "model")(input_ids=ids).logits
        got = toast.load_pretrained(tmp_path / "disk" / "model")(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_saved_disk_model_gives_the_in_memory_saved_models_logits(both):
    _, _, out = both
    ids = token_batches(1, HELDOUT_LENGTH, 3)[0]["input_ids"]
    with torch.inference_mode():
        expected = toast.load_pretrained(out / "memory" / "model")(input_ids=ids).logits
        got = toast.load_pretrained(out / "disk" / "model")(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_every_family_of_the_disk_search_matches_memory(checkpoint):
    """Every family measured (plain, ShortGPT, TOAST, its Ghosted Layers plans, ReplaceMe),
    not only the chosen one."""
    data, heldout = _data()
    common = {"target": 0.2, "latency": False, "cache": False, "progress": False}
    common["methods"] = DISK_METHODS
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    memory = toast.search(model, data, heldout, max_measured=40, **common)
    disk = toast.search(checkpoint, data, heldout, max_measured=40, sequential=True, **common)
    families = {m.candidate.family for m in disk.measured}
    assert families == {"plain", "shortgpt", "toast", "ghosted", "replaceme"}
    worst = max(
        abs(d.measurement.quality - m.measurement.quality) / m.measurement.quality
        for d, m in zip(disk.measured, memory.measured, strict=True)
    )
    assert worst < 1e-5


def test_at_most_one_block_holds_weights_during_the_disk_search(checkpoint, monkeypatch):
    data, heldout = _data()
    opened: list[DiskModel] = []
    loaded: list[int] = []
    load = DiskModel.load_block
    real_open = DiskModel.open.__func__

    def counting_open(cls, folder, *args):
        disk = real_open(cls, folder, *args)
        opened.append(disk)
        return disk

    def counting_load(self, index):
        block = load(self, index)
        loaded.append(sum(any(not p.is_meta for p in b.parameters()) for b in self.stack.blocks))
        return block

    monkeypatch.setattr(DiskModel, "open", classmethod(counting_open))
    monkeypatch.setattr(DiskModel, "load_block", counting_load)
    toast.search(
        checkpoint,
        data,
        heldout,
        target=0.2,
        latency=False,
        cache=False,
        progress=False,
        sequential=True,
    )
    assert len(opened) == 1  # the checkpoint's structure found once
    assert loaded and max(loaded) == 1
    assert all(p.is_meta for p in opened[0].stack.blocks.parameters())


@pytest.mark.parametrize("target", ["latency=30%", "macs=25%"])
def test_a_target_the_disk_path_cannot_measure_is_refused_before_any_work(
    checkpoint, target, monkeypatch
):
    def no_loading(self, index):
        raise AssertionError("a block was loaded")

    monkeypatch.setattr(DiskModel, "load_block", no_loading)
    data, heldout = _data()
    with pytest.raises(ValueError, match="max_memory enough to load"):
        toast.search(
            checkpoint, data, heldout, target=target, cache=False, progress=False, sequential=True
        )


def test_the_disk_path_is_said_once(checkpoint, capsys):
    data, heldout = _data()
    result = toast.search(
        checkpoint, data, heldout, target=0.2, latency=False, cache=False, progress=False,
        sequential=True,
    )  # fmt: skip
    said = [line for line in capsys.readouterr().err.splitlines() if "path" in line]
    assert len(said) == 1 and "sequential path" in said[0]
    assert said[0].startswith("toast search:")
    assert result.model is None and result.best is not None


def test_a_folder_that_fits_is_loaded_and_searched_in_memory(checkpoint):
    data, heldout = _data()
    result = toast.search(
        checkpoint, data, heldout, target=0.2, cache=False, progress=False, max_memory="64GiB"
    )
    assert result.model is not None
    assert result.original.throughput is not None  # timed: the model was loaded


def test_the_disk_cache_is_keyed_on_the_checkpoints_files(checkpoint, tmp_path):
    data, heldout = _data()
    common = {"target": 0.2, "latency": False, "progress": False, "sequential": True}
    first = toast.search(checkpoint, data, heldout, cache=tmp_path, **common)
    again = toast.search(checkpoint, data, heldout, cache=tmp_path, **common)
    assert first.calibration_passes > 0 and again.calibration_passes == 0
    assert all(m.cached for m in again.measured)
    assert [m.measurement for m in again.measured] == [m.measurement for m in first.measured]
    assert not math.isnan(again.original.quality)


def test_each_familys_plan_saved_from_disk_gives_the_built_models_logits(checkpoint, tmp_path):
    """The disk writer of every family (plain removal, TOAST, ReplaceMe)
    against the plan built in memory, for the best plan of each family."""
    from toast.frontier.build import build, finish
    from toast.frontier.candidates import enumerate_candidates
    from toast.hf.data.calibration import Calibration
    from toast.methods import available_methods, get_method
    from toast.methods.base import Layout, find_layout, staged_methods
    from toast.methods.calibrate import calibrate, calibrate_from_disk, model_sizes

    data, _ = _data()
    for name in available_methods():
        get_method(name)
    methods = [m for m in staged_methods() if m.name in ("remove", "toast", "replaceme")]
    cal = Calibration(progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    layout = find_layout(model)
    in_memory = calibrate(model, data, layout, methods, cal, "auto", 2)
    disk = DiskModel.open(checkpoint)
    from_disk = calibrate_from_disk(disk, data, Layout(disk.stack), methods, cal, "auto", 2)
    plans = enumerate_candidates(methods, in_memory, model_sizes(model, layout), 2)
    ids = token_batches(1, HELDOUT_LENGTH, 3)[0]["input_ids"]
    for family in ("plain", "toast", "replaceme"):
        plan = min((p for p in plans if p.family == family), key=lambda p: p.predicted_error)
        built = finish(build(model, layout, plan, in_memory), plan, in_memory)
        stages = get_method(plan.methods[0]).stages
        saved = stages.save_from_disk(
            disk, plan, from_disk.stats[plan.methods[0]], tmp_path / family
        )
        with torch.inference_mode():
            expected = built(input_ids=ids).logits
            got = toast.load_pretrained(saved)(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=family)


def test_a_max_memory_below_the_plans_least_is_refused_before_any_pass(checkpoint, monkeypatch):
    source = importlib.import_module("toast.frontier.source")

    def no_loading(self, index):
        raise AssertionError("a block was loaded")

    monkeypatch.setattr(DiskModel, "load_block", no_loading)
    disk = DiskModel.open(checkpoint)
    layout = toast.methods.base.Layout(disk.stack)
    needed = source.statistics_bytes(disk, layout, toast.methods.base.staged_methods())
    states, width = layout.num_blocks + 1, disk.model.config.hidden_size
    assert needed == 2 * states * (states + 1) // 2 * width * width * 8  # every pair, float64
    data, heldout = _data()
    with pytest.raises(ValueError, match=r"memory plan: .* needs at least .* raise --max-memory"):
        toast.search(
            checkpoint, data, heldout, target=0.2, cache=False, progress=False,
            latency=False, max_memory="1KB",
        )  # fmt: skip  # below the model (the disk path) and below its moments


def test_the_disk_search_says_its_memory_plan_with_the_moments(checkpoint, capsys):
    data, heldout = _data()
    toast.search(
        checkpoint, data, heldout, target=0.2, cache=False, progress=False,
        latency=False, sequential=True,
    )  # fmt: skip
    said = [line for line in capsys.readouterr().err.splitlines() if "memory plan" in line]
    assert len(said) == 1 and said[0].startswith("toast search: memory plan: one block")
    assert "moments of the shared pass" in said[0]


def test_a_model_file_is_loaded_and_searched_in_memory(tmp_path, monkeypatch, capsys):
    """A ``.gguf`` file has no tensors to stream: loaded whole, said once."""
    local = importlib.import_module("toast.io.local")
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    monkeypatch.setattr(local, "load_model", lambda path: tiny_llama())
    data, heldout = _data()
    common = {"target": 0.2, "latency": False, "cache": False}
    result = toast.search(file, data, heldout, progress=True, **common)
    assert result.model is not None and result.best is not None
    said = [line for line in capsys.readouterr().err.splitlines() if "path" in line]
    assert said == ["toast search: in-memory path (model.gguf is a file)"]
    with pytest.raises(ValueError, match="needs a checkpoint folder"):
        toast.search(file, data, heldout, sequential=True, progress=False, **common)


def test_the_shared_pass_bound_follows_what_max_memory_leaves(checkpoint, monkeypatch):
    # Width 4,096 needs several sources a replay to finish: the bound is
    # what the budget leaves beside the block-by-block path's own parts.
    source = importlib.import_module("toast.frontier.source")
    from toast.core.chunked import JOIN_BYTES, pair_nbytes
    from toast.hf.capture.budget import MemoryPlan, sequential_parts

    disk = DiskModel.open(checkpoint)
    layout = toast.methods.base.Layout(disk.stack)
    methods = toast.methods.base.staged_methods()
    batches, _ = _data()
    own = sum(n for _, n in sequential_parts(disk, batches))
    width = disk.model.config.hidden_size
    least = pair_nbytes(width, 0)
    whole = source.whole_moments_bytes(disk, layout)  # every pair's moments at their peak
    assert whole // 4 > least
    half = MemoryPlan(True, own + JOIN_BYTES + whole // 2, 0, 0)
    assert source.plan_statistics(half, disk, layout, methods, batches) == whole // 4
    starved = MemoryPlan(True, own + JOIN_BYTES + least, 0, 0)
    assert source.plan_statistics(starved, disk, layout, methods, batches) == least
    huge = MemoryPlan(True, 2**40, 0, 0)
    assert source.plan_statistics(huge, disk, layout, methods, batches) == whole // 2


@pytest.mark.parametrize("native", [True, False])
def test_a_16bit_folder_searched_in_memory_computes_as_the_disk_path_and_returns_its_dtype(
    native, tmp_path, monkeypatch
):
    from toast.hf.capture import compute

    monkeypatch.setattr(compute, "native_matmul", lambda dtype, device="cpu": native)
    tiny_llama().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    data, heldout = _data()
    seen = set()

    def record(module, args, out):
        if isinstance(module, torch.nn.Linear):
            seen.add(out.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        result = toast.search(
            tmp_path / "bf16", data, heldout, target=0.2, latency=False, cache=False,
            progress=False, methods=["remove"], sequential=False,
        )  # fmt: skip
    finally:
        handle.remove()
    assert seen == {torch.bfloat16 if native else torch.float32}
    assert {p.dtype for p in result.model.parameters()} == {torch.bfloat16}
