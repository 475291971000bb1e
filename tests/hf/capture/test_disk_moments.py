"""Moments from a checkpoint on disk: with a bounded span of pairs only the
states a window needs wait on disk, and the moments are the in-memory ones."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.hf.capture import disk_moments  # noqa: E402
from toast.hf.capture.sequential import DiskModel, DiskStates  # noqa: E402
from toast.hf.capture.states import capture_moments  # noqa: E402
from toast.hf.data.calibration import Calibration  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


class _Counted(DiskStates):
    """DiskStates that records how many state files were open at once."""

    open_now = 0
    most = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _Counted.open_now += 1
        _Counted.most = max(_Counted.most, _Counted.open_now)

    def close(self) -> None:
        if self._fd >= 0:
            _Counted.open_now -= 1
        super().close()


@pytest.mark.parametrize(("pairs", "files"), [("consecutive", 2), (2, 3), ("all", None)])
def test_only_the_states_a_window_needs_wait_on_disk(pairs, files, tmp_path, monkeypatch):
    model, data = R.decoder("llama"), R.text_loader(n=16)
    model.save_pretrained(tmp_path / "model")
    monkeypatch.setattr(disk_moments, "DiskStates", _Counted)
    _Counted.open_now = _Counted.most = 0
    options = {"folds": 0, "pairs": pairs, "calibration": Calibration(progress=False)}
    got, _ = disk_moments.capture_moments_from_disk(
        DiskModel.open(tmp_path / "model"), data, **options
    )
    assert _Counted.most == (files or R.LAYERS + 1) and _Counted.open_now == 0
    want, _ = capture_moments(model, data, **options)
    both = ~np.isnan(got._get_data())  # far pairs' row statistics: NaN from a window
    assert both.all() == (pairs == "all")
    np.testing.assert_allclose(got._get_data()[both], want._get_data()[both], rtol=1e-10)
