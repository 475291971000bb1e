"""The one driver: ``toast.compress`` of a staged method builds what
``toast.search`` restricted to that method builds at the same size with a
measurement budget of one (a method registered with nothing but its
stages: ``test_adding_a_method.py``)."""

from __future__ import annotations

import copy
import math

import pytest

import toast
from toast.methods.base import Plan
from toast.methods.driver import Request, compress_with_stages, first_choice, runner_of

from ..frontier.conftest import CALIBRATION_LENGTH, tiny_llama, token_batches

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.hf


def _plan(family: str, spans: tuple, predicted: float, methods: tuple = ("m",)) -> Plan:
    blocks = sum(b - a for a, b in spans)
    return Plan(methods, family, spans, "identity", 100 - blocks, predicted)


def test_first_choice_is_the_best_predicted_of_the_first_family_at_the_size_asked():
    plans = [
        _plan("zeta", ((1, 3),), 0.01),  # a later family, better predicted: not compared
        _plan("alpha", ((2, 4),), 0.5),
        _plan("alpha", ((1, 3),), 0.3),
        _plan("alpha", ((1, 2),), 0.1),  # the wrong size
        _plan("alpha", ((3, 5),), math.nan),
    ]
    assert first_choice(plans, 2) == plans[2]
    assert first_choice(plans, 3) is None


def test_first_choice_is_what_the_search_measures_first():
    from toast.frontier.selection import Ranked

    plans = [
        _plan("plain", ((1, 3),), 0.4),
        _plan("plain", ((2, 4),), 0.2),
        _plan("shortgpt", ((4, 6),), 0.1),
        _plan("plain-x", ((3, 5),), 0.05),
        _plan("plain", ((1, 2), (3, 4)), 0.3, ("m", "n")),
    ]
    assert Ranked(plans, 1).next() == first_choice(plans, 2)


def test_a_request_reaches_as_far_as_its_widest_span():
    assert Request(spans=((1, 3), (4, 8))).reach == 4
    assert Request(count=3).reach == 3


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("method", ["remove", "linearpatch"])
@pytest.mark.parametrize("n", [1, 2])
def test_compress_builds_what_the_search_restricted_to_the_method_builds(method, n):
    model = tiny_llama()
    data, heldout = token_batches(6, CALIBRATION_LENGTH, 1), token_batches(2, 12, 2)
    compressed, report = toast.compress(
        copy.deepcopy(model), data, method=method, num_blocks=n, progress=False
    )
    found = toast.search(
        model, data, heldout, target=f"blocks={n}", methods=[method], max_measured=1,
        cache=False, latency=False, progress=False,
    )  # fmt: skip
    assert found.best is not None
    assert tuple((s.start, s.stop) for s in report.spans) == found.best.candidate.spans
    assert _same_weights(compressed, found.model)


def test_a_blocks_target_measures_only_plans_of_that_many_blocks():
    model = tiny_llama()
    data, heldout = token_batches(6, CALIBRATION_LENGTH, 1), token_batches(2, 12, 2)
    found = toast.search(
        model, data, heldout, target="blocks=2", methods=["remove"], max_measured=3,
        cache=False, latency=False, progress=False,
    )  # fmt: skip
    assert found.measured and all(m.candidate.blocks_removed == 2 for m in found.measured)


def test_every_method_compresses_through_the_one_driver():
    """No method keeps a driver of its own: ``compress`` runs each one's
    stages, and a folder goes block by block exactly where they can."""
    from toast.methods import available_methods, get_method
    from toast.methods.driver import compress_from_disk_with_stages, disk_runner_of

    on_disk = set()
    for name in available_methods():
        method = get_method(name)
        assert not hasattr(method, "run") and not hasattr(method, "run_from_disk")
        assert runner_of(method).func is compress_with_stages
        disk = disk_runner_of(method)
        assert (disk is None) == (not method.stages.from_disk)
        if disk is not None:
            assert disk.func is compress_from_disk_with_stages
            on_disk.add(name)
    assert {"remove", "toast", "replaceme", "linearpatch", "sublayer"} <= on_disk


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_llama().save_pretrained(folder, max_shard_size="20KB")
    return folder


@pytest.mark.parametrize("selection", ["error", "block_influence"])
def test_compress_of_a_folder_block_by_block_writes_what_compress_in_memory_builds(
    checkpoint, tmp_path, selection
):
    transformers = pytest.importorskip("transformers")
    data, heldout = token_batches(4, CALIBRATION_LENGTH, 1), token_batches(2, 12, 2)
    options = {"method": "remove", "num_blocks": 2, "selection": selection, "progress": False}
    report = toast.compress(
        checkpoint, data, output=tmp_path / "out", sequential=True, heldout=heldout, **options
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    memory, memory_report = toast.compress(model, data, heldout=heldout, **options)
    written = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert [(s.start, s.stop) for s in report.spans] == [
        (s.start, s.stop) for s in memory_report.spans
    ]
    assert _same_weights(written, memory)
    assert report.quality.compressed == pytest.approx(memory_report.quality.compressed, rel=1e-5)


def test_sleb_from_a_folder_says_it_needs_the_model_in_memory(checkpoint, tmp_path):
    data = token_batches(2, CALIBRATION_LENGTH, 1)
    with pytest.raises(ValueError, match="needs the model in memory"):
        toast.compress(
            checkpoint, data, method="remove", num_blocks=1, selection="sleb",
            output=tmp_path / "out", sequential=True, progress=False,
        )  # fmt: skip
