"""toast._scratch: buffers with no name, and named siblings that record their
owner so that what an exited owner left is swept."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from toast._scratch import hidden_sibling, owned_name, owner_alive, scratch_file, sweep

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc")


def _exited_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    return int(done.stdout)


def test_a_scratch_file_has_no_name_and_reads_back(tmp_path):
    with scratch_file(tmp_path) as f:
        os.pwrite(f.fileno(), b"kept", 100)
        assert os.listdir(tmp_path) == []
        assert os.pread(f.fileno(), 4, 100) == b"kept"


@needs_proc
def test_this_process_owns_its_siblings_and_they_stay(tmp_path):
    mine = hidden_sibling(tmp_path / "out")
    assert mine.is_dir() and mine.name.startswith(".out.tmp-")
    assert sweep(tmp_path) == [] and mine.is_dir()


@needs_proc
def test_siblings_of_an_exited_owner_are_swept(tmp_path):
    pid = _exited_pid()
    left = tmp_path / f".out.tmp-{pid}-12345-0123abcd"
    (left / "sub").mkdir(parents=True)
    file = tmp_path / f".calibration.pkl.tmp-{pid}-12345-89abcdef"
    file.write_bytes(b"half")
    other = tmp_path / ".out.tmp-notours"
    other.mkdir()
    assert sorted(sweep(tmp_path)) == sorted([left, file])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp-notours"]


@needs_proc
def test_a_reused_pid_is_not_taken_for_the_owner(tmp_path):
    stat = Path("/proc/self/stat").read_bytes()
    start = int(stat[stat.rfind(b")") + 2 :].split()[19])
    assert owner_alive(os.getpid(), start)
    assert not owner_alive(os.getpid(), start + 1)  # same pid, another process


def test_owned_name_sweeps_before_naming(tmp_path):
    left = tmp_path / f".out.old-{_exited_pid()}-1-0123abcd"
    left.mkdir()
    name = owned_name(tmp_path / "out", "old")
    assert not left.exists() and not name.exists()
    assert name.parent == tmp_path and name.name.startswith(f".out.old-{os.getpid()}-")
