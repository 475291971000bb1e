"""A model loaded with ``device_map`` and disk offload (accelerate hooks
moving each block's weights in for its forward) is calibrated by the
in-memory path exactly as the plain model: the same distance profile and
transform. Folding into an offloaded weight is refused with the fix."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.methods.replaceme import profile_distances, replaceme  # noqa: E402
from toast.methods.replaceme.config import ReplaceMeConfig  # noqa: E402
from toast.methods.replaceme.estimate import Estimation  # noqa: E402
from toast.spans import Span  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def _offloaded(tmp_path):
    R.decoder("llama").save_pretrained(tmp_path / "source")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "source",
        device_map="auto",
        max_memory={"cpu": 60_000},  # room for the embedding only: the blocks go to disk
        offload_folder=str(tmp_path / "offload"),
    )
    assert "disk" in set(model.hf_device_map.values())
    return model.eval()


def test_offloaded_model_gives_the_plain_models_profile_and_transform(tmp_path):
    data = R.text_loader()
    plain, offloaded = R.decoder("llama"), _offloaded(tmp_path)
    a = profile_distances(plain, data, progress=False)
    b = profile_distances(offloaded, data, progress=False)
    np.testing.assert_array_equal(a.matrix(), b.matrix())
    config = ReplaceMeConfig(num_blocks=2)
    config = ReplaceMeConfig.from_options(config, {"progress": False})
    spans = [Span(1, 3, 0.0)]
    (want,), _ = Estimation(plain, data, config, find_blocks(plain)).fit(spans)
    (got,), _ = Estimation(offloaded, data, config, find_blocks(offloaded)).fit(spans)
    assert np.linalg.norm(got.transform - want.transform) <= 1e-6 * np.linalg.norm(want.transform)


def test_folding_into_an_offloaded_weight_names_the_from_disk_writer(tmp_path):
    with pytest.raises(ValueError, match="toast.compress\\(folder"):
        replaceme(
            _offloaded(tmp_path),
            R.text_loader(),
            num_blocks=2,
            placement="fold",
            check_fraction=0.0,  # every batch fits: no fallback to plain removal
            progress=False,
        )
