"""Plain removal's ``selection=`` rules: ShortGPT's block influence and
SLEB choose the blocks (runs of them become spans) as the shared scoring
of :mod:`toast.methods.selection` says; the default is unchanged."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.data.calibration import Calibration  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.methods.remove.config import RemoveConfig  # noqa: E402
from toast.methods.selection import block_influence, lowest_blocks, runs, sleb  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def test_block_influence_removes_the_runs_of_the_lowest_blocks():
    model, data = R.decoder("llama"), R.text_loader()
    scores = block_influence(model, data, Calibration(progress=False), find_blocks(model))
    expected = runs(lowest_blocks(scores, 3))
    pruned, report = toast.compress(
        model, data, method="remove", num_blocks=3, selection="block_influence", progress=False
    )
    assert [(s.start, s.stop) for s in report.spans] == expected
    assert len(pruned.model.layers) == R.LAYERS - 3
    assert "block influence" in report.to_markdown()


def test_sleb_removes_the_blocks_sleb_chooses():
    model, data = R.decoder("llama"), R.text_loader()
    twin = copy.deepcopy(model)
    expected = sleb(twin, data, find_blocks(twin), 2).blocks
    _, report = toast.compress(
        model, data, method="remove", num_blocks=2, selection="sleb", progress=False
    )
    assert [b for s in report.spans for b in range(s.start, s.stop)] == expected
    assert report.selection == "sleb"


def test_the_default_is_the_identity_span_error_and_bad_rules_name_the_options():
    assert RemoveConfig(num_blocks=1).selection == "error"
    with pytest.raises(ValueError, match="selection must be one of 'error', 'block_influence'"):
        RemoveConfig(num_blocks=1, selection="distance")


def test_search_stages_propose_shortgpt_plans_from_the_shared_passs_block_influence():
    from toast.hf.data.calibration import Calibration
    from toast.hf.model.params import count_params
    from toast.methods.base import Sizes, capture_shared, find_layout
    from toast.methods.remove.stages import STAGES

    model, data = R.decoder("llama"), R.text_loader()
    layout = find_layout(model)
    calibration = Calibration(progress=False)
    shared = capture_shared(model, data, layout, calibration, "auto")
    stats = STAGES.calibrate(model, data, layout, shared, calibration, 3)
    hooked = block_influence(model, data, calibration, layout.stack)
    np.testing.assert_allclose(stats.influence, hooked, rtol=1e-6)
    sizes = Sizes(count_params(model), tuple(count_params(b) for b in layout.stack.blocks))
    plans = [p for p in STAGES.propose(stats, sizes, 3, False) if p.family == "shortgpt"]
    assert [p.spans for p in plans] == [
        tuple(runs(lowest_blocks(hooked, n, 1))) for n in range(1, 4)
    ]
