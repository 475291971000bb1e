"""The search cache keeps to its size limit: a write evicts the least
recently used entries, and a read counts as a use."""

import os

import pytest

pytest.importorskip("torch")

from toast.frontier.cache import SearchCache  # noqa: E402


def test_a_write_evicts_the_least_recently_used_entries_beyond_the_limit(tmp_path):
    cache = SearchCache(tmp_path, limit="3500")
    measured = {"candidate": {"value": "x" * 1000}}
    for key, used in [("a", 100), ("b", 200), ("c", 300)]:
        cache.save_measurements(key, measured)
        os.utime(tmp_path / key, (used, used))
    assert cache.load_measurements("a") == measured  # a is now the most recent
    cache.save_measurements("d", measured)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c", "d"]
    assert cache.load_measurements("b") == {}


def test_a_bad_limit_in_the_environment_fails_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setenv("TOAST_CACHE_LIMIT", "ten gigs")
    with pytest.raises(ValueError, match="TOAST_CACHE_LIMIT"):
        SearchCache(tmp_path)
    assert SearchCache(None).root is None  # no cache: the limit is never read


def test_a_cached_calibration_states_its_size_and_the_caches(tmp_path):
    from toast._validation import format_size
    from toast.methods.calibrate import Calibrated

    cache = SearchCache(tmp_path, limit="1GiB")
    said = cache.save_calibrated("k", Calibrated(passes=1))
    size = (tmp_path / "k" / "calibration.pkl").stat().st_size
    assert f"calibration cached: {format_size(size)}" in said and "1.00 GiB limit" in said
    assert cache.load_calibrated("k") == Calibrated(passes=1)
    assert SearchCache(None).save_calibrated("k", Calibrated()) == ""
