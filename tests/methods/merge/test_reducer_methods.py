"""RAPID, Token Transforming, ATM and PiToMe as registered methods: ``compress``
gives the model :func:`enable_reduction` gives with the same reducer, the
report counts what the model does, bad options are refused by name, saved
equals reloaded, and the command line gives the library's model."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import toast  # noqa: E402
from tests._helpers import hf_models as H  # noqa: E402
from toast.cli import main  # noqa: E402
from toast.methods.merge import merging_of  # noqa: E402
from toast.methods.merge.atm import AtmReducer, atm_thresholds  # noqa: E402
from toast.methods.merge.config import (  # noqa: E402
    AtmConfig,
    PitomeConfig,
    RapidConfig,
    TransformingConfig,
)
from toast.methods.merge.install import enable_reduction  # noqa: E402
from toast.methods.merge.pitome import PitomeReducer, pitome_margins  # noqa: E402
from toast.methods.merge.rapid import RapidReducer  # noqa: E402
from toast.methods.merge.transforming import TransformingReducer  # noqa: E402

from . import models as M  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

#: Each method's options and the reducer they must install on the tiny
#: ViTs (4 blocks): RAPID prunes in the first half by default, ATM matches
#: small to large in the last third.
CASES = {
    "rapid": ({"r": 3, "tau": 0.3}, RapidReducer((3,) * 4, 2, 0.3)),
    "token-transforming": ({"r": 3, "temperature": 0.2}, TransformingReducer((3,) * 4, 0.2)),
    "atm": (
        {"alpha": 0.3, "beta": 0.2, "theta_min": -0.2},
        AtmReducer(atm_thresholds(4, 0.3, 0.2, -0.2), 3),
    ),
    "pitome": ({"r": 3, "margin": 0.5}, PitomeReducer((3,) * 4, pitome_margins(4, 0.5))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compress_equals_enable_reduction_and_reports_the_tokens(name):
    options, reducer = CASES[name]
    images = H.images(3, seed=21)
    model, report = toast.compress(M.build("vit"), [images], method=name, **options)
    twin = M.build("vit")
    handle = enable_reduction(twin, reducer)
    assert merging_of(model).reducer == reducer
    assert torch.equal(M.run(model, images), M.run(twin, images))
    assert report.macs_after.tokens == tuple((float(n), float(k)) for n, k in handle.tokens)
    assert report.params_after == report.params_before
    assert report.macs_after.total < report.macs_before.total


def test_atm_without_data_says_its_counts_need_images():
    _, report = toast.compress(M.build("vit"), None, method="atm", alpha=0.3, theta_min=-0.2)
    assert report.macs_after is None
    assert "depend on the images" in report.to_markdown()


def test_atm_reports_the_average_count_over_the_data():
    options, reducer = CASES["atm"]
    batches = [H.images(2, seed=1), H.images(1, seed=2)]
    _, report = toast.compress(M.build("vit"), batches, method="atm", **options)
    twin = M.build("vit")
    handle = enable_reduction(twin, reducer)
    counts = []
    for images in batches:
        M.run(twin, images)
        counts.append([(len(images) * n, len(images) * k) for n, k in handle.tokens])
    expected = [(sum(c[b][0] for c in counts) / 3, sum(c[b][1] for c in counts) / 3)
                for b in range(4)]  # fmt: skip
    assert [n / 2 for n, _ in counts[0]] != [n for n, _ in counts[1]]  # the batches differ
    np.testing.assert_allclose(np.array(report.macs_after.tokens), np.array(expected))


@pytest.mark.parametrize(
    ("config", "options", "message"),
    [
        (RapidConfig, {"r": -1}, "r must be"),
        (RapidConfig, {"tau": 2.0}, "tau must be"),
        (RapidConfig, {"prune_until": -1}, "prune_until must be"),
        (TransformingConfig, {"temperature": 0.0}, "temperature must be"),
        (TransformingConfig, {"schedule": "steep"}, "schedule must be"),
        (AtmConfig, {"beta": -0.1}, "beta must be"),
        (AtmConfig, {"thresholds": "high"}, "thresholds must be"),
        (PitomeConfig, {"alpha": 0.0}, "alpha must be"),
        (PitomeConfig, {"margin": 1.5}, "margin must be"),
        (TransformingConfig, {"merge_norm": "max"}, "merge_norm must be"),
        (RapidConfig, {"merge_norm": "median"}, "merge_norm must be"),
    ],
)
def test_bad_options_are_refused_with_their_name(config, options, message):
    with pytest.raises(ValueError, match=message):
        config(**options)


def test_atm_thresholds_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="one value per block"):
        toast.compress(M.build("vit"), None, method="atm", thresholds=[0.5, 0.5])


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("family", ["deit", "dinov2_registers"])
def test_saved_equals_reloaded(name, family, tmp_path):
    options, _ = CASES[name]
    model, _ = toast.compress(M.build(family), None, method=name, **options)
    images = H.images(3, seed=24)
    expected = M.run(model, images)
    toast.save_pretrained(model, tmp_path / "save")
    loaded = toast.load_pretrained(tmp_path / "save")
    assert merging_of(loaded).state() == merging_of(model).state()
    torch.testing.assert_close(M.run(loaded, images), expected, rtol=0, atol=0)


def test_the_command_line_gives_the_library_model(tmp_path):
    model = M.build("vit")
    model.save_pretrained(tmp_path / "vit")
    model = toast.load_pretrained(tmp_path / "vit")
    out = tmp_path / "out"
    argv = ["compress", str(tmp_path / "vit"), "--method", "rapid", "--r", "3"]
    argv += ["--prune-until", "1", "--merge-norm", "max"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    expected, _ = toast.compress(
        model, method="rapid", r=3, prune_until=1, merge_norm="max", progress=False
    )
    images = H.images(2, seed=25)
    assert torch.equal(M.run(toast.load_pretrained(out), images), M.run(expected, images))
    assert "RAPID" in (out / "report.md").read_text()
