"""A stopped run leaves nothing behind: SIGTERM during a block-by-block
calibration exits 143 after the clean-up Ctrl-C gets, ``kill -9`` leaves no
buffer (they are files with no name), and what a killed run left beside an
output folder goes when the next command writes there. A stopped program
ends as soon as its clean-up and the ``atexit`` handlers have run: neither
the interpreter's teardown nor a worker thread holds it up."""

import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.conftest import default_sigint  # noqa: E402
from toast.cli import main, program  # noqa: E402

pytestmark = pytest.mark.hf

# The CLI with block 1 of the sequential pass held up: the process says when
# it is there (block 0 has run, every buffer exists) and waits to be stopped.
_HELD_AT_BLOCK_1 = textwrap.dedent(
    """
    import sys, time
    import toast.hf.capture.sequential as sequential
    load = sequential.DiskModel.load_block
    def held(self, index):
        block = load(self, index)
        if index == 1:
            print("calibrating", flush=True)
            time.sleep(300)
        return block
    sequential.DiskModel.load_block = held
    from toast.cli import program
    program(sys.argv[1:])
    """
)


# The ``toast`` program with its command held up, and everything that would
# keep a stopped process alive if it went through the interpreter's normal
# exit: a worker thread that never ends (not a daemon: the exit would join
# it) and a teardown that takes ten minutes (a ``__del__`` the interpreter
# runs when it clears the modules). A temporary folder is left to its
# ``atexit`` finalizer; the command's own clean-up prints a line.
_HELD_COMMAND = textwrap.dedent(
    """
    import importlib, sys, tempfile, threading, time
    cli = importlib.import_module("toast.cli.main")

    class SlowTeardown:
        def __del__(self):
            time.sleep(600)

    teardown = SlowTeardown()
    left_to_atexit = tempfile.TemporaryDirectory()

    def held(args):
        threading.Thread(target=threading.Event().wait, name="busy worker").start()
        try:
            print("running", flush=True)
            time.sleep(600)
        finally:
            print("cleaned up", file=sys.stderr)

    cli._dispatch = held
    cli.program(["cache", "list"])
    """
)


def _argv(local_llama, out):
    model, data = str(local_llama / "model"), str(local_llama / "calib.txt")
    return ["compress", model, "--data", data, "--method", "replaceme", "--num-blocks", "1"] + [
        "--path", "disk", "--no-progress", "--out", str(out),
    ]  # fmt: skip


def _open_in(pid: int, folder: Path) -> list[str]:
    """The files process ``pid`` holds open in ``folder`` (named or not)."""
    fds = Path(f"/proc/{pid}/fd")
    links = []
    for fd in fds.iterdir():
        try:
            links.append(os.readlink(fd))
        except OSError:
            continue
    return [link for link in links if link.startswith(f"{folder}/")]


def _calibrating(local_llama, tmp_path):
    """A ``toast compress`` from disk, inside its calibration; its TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-c", _HELD_AT_BLOCK_1, *_argv(local_llama, tmp_path / "out")]
    env = {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"calibrating":
        proc.kill()
        raise AssertionError(f"never reached block 1: {proc.communicate()[1].decode()[-2000:]}")
    assert _open_in(proc.pid, tmp), "the calibration buffers should be in $TMPDIR"
    return proc, tmp


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc")
def test_sigterm_during_calibration_exits_143_and_leaves_nothing(local_llama, tmp_path):
    proc, tmp = _calibrating(local_llama, tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err.decode()
    assert err.decode().strip().splitlines()[-1] == "toast compress: stopped by SIGTERM"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]  # no --out, no staging
    assert list(tmp.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc")
def test_kill_9_during_calibration_leaves_no_buffer(local_llama, tmp_path):
    proc, tmp = _calibrating(local_llama, tmp_path)
    proc.kill()
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert list(tmp.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]


def test_what_a_killed_run_staged_goes_when_the_next_command_writes_there(local_llama, tmp_path):
    out = tmp_path / "out"
    staging = "from toast._scratch import hidden_sibling; import sys, time\n"
    staging += "print(hidden_sibling(sys.argv[1]), flush=True); time.sleep(300)\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", staging, str(out)], stdout=subprocess.PIPE, text=True
    )
    left = Path(proc.stdout.readline().strip())
    proc.kill()
    proc.communicate(timeout=60)
    (left / "model.safetensors").write_bytes(b"half written")
    assert left.parent == tmp_path and left.name.startswith(".out.tmp-")
    assert main(_argv(local_llama, out)) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize(
    ("stop", "status", "line"),
    [(signal.SIGTERM, 143, "stopped by SIGTERM"), (signal.SIGINT, 130, "interrupted")],
)
def test_a_stopped_program_ends_at_once_after_its_clean_up(tmp_path, stop, status, line):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELD_COMMAND],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=default_sigint,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 300)
        assert ready and proc.stdout.readline().strip() == b"running", proc.stderr.read()
        assert len(list(tmp_path.iterdir())) == 1  # the folder left to atexit
        proc.send_signal(stop)
        # the normal exit would wait for ever (the worker) and ten minutes (the teardown)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == status, err.decode()
    assert err.decode().splitlines()[-2:] == ["cleaned up", f"toast cache: {line}"]
    assert list(tmp_path.iterdir()) == []  # the atexit handlers ran


def test_the_program_exits_with_the_status_of_main(monkeypatch):
    cli = sys.modules["toast.cli.main"]
    monkeypatch.setattr(cli, "_dispatch", lambda args: 3)
    with pytest.raises(SystemExit) as exited:
        program(["cache", "list"])
    assert exited.value.code == 3
