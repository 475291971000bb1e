"""``scripts/tmpdir.sh``: the temporary folders of the fuzzing and sanitizer
scripts are removed when the script ends or is stopped, and the folders of
runs killed with SIGKILL are swept by the next run."""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tmpdir.sh"


def _bash(body: str, tmp: Path, **kwargs) -> subprocess.Popen:
    code = f'set -euo pipefail\nsource "{SCRIPT}"\n{body}'
    # The sanitizer pass preloads its runtimes into everything it starts; the shell is
    # not what it tests, and a preloaded bash is slower to reach its signal checks.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["TMPDIR"] = str(tmp)
    return subprocess.Popen(["bash", "-c", code], env=env, text=True, **kwargs)


def _run(body: str, tmp: Path) -> str:
    proc = _bash(body, tmp, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    return out.strip()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_folder_exists_while_the_script_runs_and_is_gone_after(tmp_path):
    made = _run('private_tmpdir WORK fuzz; [ -d "$WORK" ]; echo "$WORK"', tmp_path)
    assert Path(made).name.startswith("toast-fuzz.")
    assert not Path(made).exists()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_script_leaves_nothing(tmp_path, stop):
    proc = _bash(
        'private_tmpdir WORK fuzz; echo "$WORK"; sleep 30 & wait',
        tmp_path,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    made = Path(proc.stdout.readline().strip())
    assert made.is_dir()
    try:
        # A signal that lands while bash is still starting `sleep 30 &` is acted on only
        # once that sleep ends; a user stopping a script presses again, and so does this.
        for _ in range(100):
            proc.send_signal(stop)
            try:
                proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                continue
        assert proc.poll() is not None, "the script outlived 100 signals"
        assert not made.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):  # the background sleep, if alive
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_killed_runs_folder_is_swept_by_the_next_run(tmp_path):
    killed = tmp_path / "toast-fuzz.killed"
    killed.mkdir()
    (killed / ".owner").write_text(f"{_dead_pid()}\n")
    _run("private_tmpdir WORK fuzz", tmp_path)
    assert not killed.exists()


def test_a_live_runs_folder_and_other_prefixes_are_left_alone(tmp_path):
    live = tmp_path / "toast-fuzz.live"
    live.mkdir()
    (live / ".owner").write_text(f"{os.getpid()}\n")
    other = tmp_path / "toast-asan.killed"
    other.mkdir()
    (other / ".owner").write_text(f"{_dead_pid()}\n")
    _run("private_tmpdir WORK fuzz", tmp_path)
    assert live.is_dir() and other.is_dir()


def test_a_folder_without_an_owner_is_swept_only_once_an_hour_old(tmp_path):
    fresh, old = tmp_path / "toast-fuzz.fresh", tmp_path / "toast-fuzz.old"
    fresh.mkdir()
    old.mkdir()
    hour_ago = time.time() - 2 * 3600
    os.utime(old, (hour_ago, hour_ago))
    _run("private_tmpdir WORK fuzz", tmp_path)
    assert fresh.is_dir() and not old.exists()
