"""The glibc calls of the block-by-block path (toast._malloc)."""

import ctypes.util
import sys

import pytest

from toast import _malloc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap calls are Linux's")
def test_trimming_the_heap_never_searches_for_the_c_library(monkeypatch):
    # find_library runs ldconfig in a forked child, which a watcher from
    # outside counts with the whole parent's resident memory once per block
    def search(name):
        raise AssertionError(f"find_library({name!r}) ran")

    _malloc._glibc.cache_clear()
    monkeypatch.setattr(ctypes.util, "find_library", search)
    try:
        for _ in range(3):
            _malloc.trim_heap()
        assert _malloc._glibc() is _malloc._glibc()
    finally:
        _malloc._glibc.cache_clear()
