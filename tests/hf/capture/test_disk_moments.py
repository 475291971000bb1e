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


@pytest.mark.parametrize("observed", [False, True])
def test_rows_above_the_bound_are_written_once_and_equal_the_in_memory_buffer(
    observed, tmp_path, monkeypatch
):
    from toast.core.chunked import ChunkedMoments, pair_nbytes
    from toast.hf.capture.massive import MassiveRows

    model, data = R.decoder("llama"), R.text_loader(n=16)
    model.save_pretrained(tmp_path / "model")
    monkeypatch.setattr(disk_moments, "DiskStates", _Counted)
    _Counted.open_now = _Counted.most = 0
    options = {
        "folds": 3,
        "pairs": 2,
        "calibration": Calibration(progress=False),
        "statistics_bytes": pair_nbytes(32, 3),  # one source and one target: rows on disk
    }
    seen_disk, seen_memory = MassiveRows(), MassiveRows()
    got, _ = disk_moments.capture_moments_from_disk(
        DiskModel.open(tmp_path / "model"),
        data,
        observe=seen_disk if observed else None,
        **options,
    )
    want, _ = capture_moments(model, data, observe=seen_memory if observed else None, **options)
    assert isinstance(got, ChunkedMoments) and isinstance(want, ChunkedMoments)
    assert _Counted.most == 0, "no copy of the states besides the moments' own buffer"
    assert got.rows == want.rows
    for state in range(R.LAYERS + 1):
        np.testing.assert_array_equal(
            got.row_range(state, 0, got.rows), want.row_range(state, 0, want.rows)
        )
    requests = [("linear", "cv", 0.0), ("cosine", "gcv", 0.0)]
    for a, b in zip(got.error_matrices(requests), want.error_matrices(requests), strict=True):
        np.testing.assert_array_equal(a, b)
    if observed:
        np.testing.assert_array_equal(seen_disk.flags, seen_memory.flags)
        np.testing.assert_array_equal(seen_disk.states, seen_memory.states)


def test_a_state_with_nan_is_named_from_the_streamed_buffer(tmp_path):
    from toast.core.chunked import ChunkedMoments

    buffer = ChunkedMoments(3, 4, bound=1 << 20)
    buffer.append_state(0, torch.ones(2, 5, 4))
    bad = torch.ones(2, 5, 4)
    bad[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"states\[1\]"):
        buffer.append_state(1, bad)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    buffer.append_state(1, bad, mask)  # the NaN row masked out: nothing of it is kept
    with pytest.raises(ValueError, match="same rows"):
        buffer.complete()
