"""toast._cachedir: a cache folder with a size limit, least recently used
entries evicted first, and ``toast cache list|clear``."""

import os

import pytest

from toast._cachedir import cache_limit, clear, entries, evict, touch
from toast.cli.main import main


def _entry(root, name, size, used):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "data.bin").write_bytes(b"x" * size)
    os.utime(folder, (used, used))
    return folder


def test_eviction_removes_the_least_recently_used_until_within_the_limit(tmp_path):
    for name, used in [("a", 100), ("b", 300), ("c", 200), ("d", 400)]:
        _entry(tmp_path, name, 1000, used)
    removed = evict(tmp_path, 2500)
    assert [e.path.name for e in removed] == ["a", "c"]
    assert [e.path.name for e in entries(tmp_path)] == ["b", "d"]


def test_a_read_makes_an_entry_recent(tmp_path):
    old = _entry(tmp_path, "old", 1000, 100)
    _entry(tmp_path, "new", 1000, 200)
    touch(old)
    evict(tmp_path, 1000)
    assert [e.path.name for e in entries(tmp_path)] == ["old"]


def test_the_entry_just_written_stays_even_alone_over_the_limit(tmp_path):
    _entry(tmp_path, "other", 10, 100)
    _entry(tmp_path, "big", 5000, 50)
    evict(tmp_path, 1000, keep=frozenset({"big"}))
    assert [e.path.name for e in entries(tmp_path)] == ["big"]


def test_the_limit_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("TOAST_CACHE_LIMIT", "20GiB")
    assert cache_limit() == 20 * 2**30
    monkeypatch.setenv("TOAST_CACHE_LIMIT", "lots")
    with pytest.raises(ValueError, match=r"\$TOAST_CACHE_LIMIT: not a size: 'lots'"):
        cache_limit()


def test_cache_list_and_clear(tmp_path, capsys):
    _entry(tmp_path, "k1", 2048, 100)
    _entry(tmp_path, "k2", 1024, 200)
    assert main(["cache", "list", "--cache", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{tmp_path}: 2 entries, 3.0 KiB of ")
    assert [line.split()[-1] for line in lines[1:]] == ["k2", "k1"]  # most recent first
    assert main(["cache", "clear", "--cache", str(tmp_path)]) == 0
    assert "removed 2 entries (3.0 KiB)" in capsys.readouterr().out
    assert entries(tmp_path) == [] and clear(tmp_path) == []


def test_cache_gguf_lists_the_converted_gguf_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOAST_CACHE", str(tmp_path))
    _entry(tmp_path / "gguf", "model-abc", 1024, 100)
    _entry(tmp_path / "search", "k1", 2048, 100)
    assert main(["cache", "list", "--gguf"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{tmp_path / 'gguf'}: 1 entries, 1.0 KiB of ")
    assert main(["cache", "list", "--gguf", "--cache", str(tmp_path)]) == 2
    assert "--cache and --gguf name two folders" in capsys.readouterr().err
