"""The disk-backed row sample (a bounded, uniform reservoir of rows)."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from toast.hf.capture.rows import RowSample  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _pairs(n, d, start=0):
    # Row r of state 0 is r + start everywhere; state 1 is its negation, so
    # every kept row shows whether its pair stayed together.
    x = np.repeat(np.arange(start, start + n, dtype=np.float32)[:, None], d, axis=1)
    return x, -x


def test_rows_under_capacity_are_kept_in_order(tmp_path):
    with RowSample(2, 3, capacity=10, directory=tmp_path, verbose=False) as s:
        s.add(_pairs(4, 3))
        s.add(_pairs(3, 3, start=4))
        assert s.rows == 7
        np.testing.assert_array_equal(s.state(0)[:, 0], np.arange(7))


def test_reservoir_keeps_capacity_rows_with_pairs_aligned(tmp_path):
    with RowSample(2, 3, capacity=50, directory=tmp_path, verbose=False) as s:
        for b in range(20):
            s.add(_pairs(37, 3, start=37 * b))
        assert (s.seen, s.rows) == (740, 50)
        x, y = s.state(0), s.state(1)
        np.testing.assert_array_equal(x, -y)
        assert len(np.unique(x[:, 0])) == 50  # sampled without replacement


def test_reservoir_is_uniform_over_all_rows(tmp_path):
    # Over many seeds every row is kept with probability capacity / seen; the
    # first and the last quarter of the stream are kept equally often.
    first = last = 0
    for seed in range(200):
        with RowSample(1, 1, capacity=20, directory=tmp_path, seed=seed, verbose=False) as s:
            for b in range(10):
                s.add([np.arange(20 * b, 20 * b + 20, dtype=np.float32)[:, None]])
            kept = s.state(0)[:, 0]
            first += int((kept < 50).sum())
            last += int((kept >= 150).sum())
    expected = 200 * 20 * 50 / 200
    assert abs(first - expected) < 0.15 * expected
    assert abs(last - expected) < 0.15 * expected


def test_same_seed_gives_the_same_sample(tmp_path):
    kept = []
    for _ in range(2):
        with RowSample(2, 2, capacity=16, directory=tmp_path, seed=7, verbose=False) as s:
            for b in range(5):
                s.add(_pairs(11, 2, start=11 * b))
            kept.append(np.array(s.state(0)))
    np.testing.assert_array_equal(kept[0], kept[1])


def test_buffer_size_is_printed_and_the_file_has_no_name(tmp_path, capsys):
    s = RowSample(2, 8, capacity=1000, directory=tmp_path)
    assert "62.5 KiB" in capsys.readouterr().err
    s.add(_pairs(5, 8))
    assert os.listdir(tmp_path) == []  # nothing a killed run could leave
    np.testing.assert_array_equal(s.state(0), _pairs(5, 8)[0])
    s.close()


def test_bad_rows_are_rejected(tmp_path):
    with RowSample(2, 3, capacity=4, directory=tmp_path, verbose=False) as s:
        with pytest.raises(ValueError, match="expected 2 states"):
            s.add([np.zeros((2, 3))])
        with pytest.raises(ValueError, match=r"\(n, 3\)"):
            s.add([np.zeros((2, 4)), np.zeros((2, 4))])
    with pytest.raises(ValueError, match="capacity"):
        RowSample(2, 3, capacity=0, directory=tmp_path)
