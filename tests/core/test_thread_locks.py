"""A Moments object used from a second thread while a long kernel holds it.

``error_matrix`` holds the object's lock for seconds and takes the GIL at
each signal poll; a second thread that waited for the lock while holding the
GIL would hang both forever. A hang cannot be interrupted from inside the
process (the main thread needs the GIL too), so each case runs in a child
process whose timeout fails the test instead of hanging CI.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

_TIMEOUT_S = 120  # the kernel itself takes about a second; a hang is the only way past this

_SCRIPT = textwrap.dedent(
    """
    import pickle, sys, threading
    import numpy as np
    import toast
    from toast import _core
    from toast.core.metrics import _ESTIMATOR_CODES, _METRIC_CODES

    kernel, op = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(0)
    S, d = 13, 256
    m = toast.Moments(S, d, folds=5)
    m.update([rng.standard_normal((600, d)) for _ in range(S)])
    other = toast.Moments(S, d, folds=5)
    rows = [rng.standard_normal((8, d)) for _ in range(S)]
    count = m.count()
    running = threading.Event()

    OPS = {
        "count": lambda: m.count(),
        "pickle": lambda: pickle.loads(pickle.dumps(m)),
        "merge": lambda: other.merge(m),
        "update": lambda: m.update(rows),
    }

    def second():
        running.wait()
        for _ in range(5):
            OPS[op]()

    thread = threading.Thread(target=second)
    thread.start()
    if kernel == "error_matrix":
        codes = (_METRIC_CODES["linear"], _ESTIMATOR_CODES["cv"])
        _core.error_matrix(m, *codes, 0.0, False, running.set)
    else:
        running.set()
        for _ in range(20):
            toast.fit_translator(m, 0, 6, kind="affine")
    thread.join()
    grown = m.count() - count
    print("done", grown)
    """
)


def _run(kernel: str, op: str) -> str:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT, kernel, op],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{kernel} against {op}() from a second thread hung for {_TIMEOUT_S} s")
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize("op", ["count", "pickle", "merge", "update"])
def test_a_second_thread_gets_through_while_error_matrix_runs(op):
    word, grown = _run("error_matrix", op)
    assert word == "done"
    assert int(grown) == (5 * 8 if op == "update" else 0)  # every update landed, once


@pytest.mark.parametrize("op", ["count", "pickle", "update"])
def test_a_second_thread_gets_through_while_fit_translator_runs(op):
    word, grown = _run("fit_translator", op)
    assert word == "done"
    assert int(grown) == (5 * 8 if op == "update" else 0)
