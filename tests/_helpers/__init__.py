"""Shared helpers of the test suite: data builders and independent NumPy
references (nothing here calls into toast except ``moments_from``, a thin
convenience that feeds arrays into ``toast.Moments``), the network guard's
address check, ``run_fresh`` for peak-memory measurements, and
``load_script`` for the scripts and benchmarks the suite tests."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np

import toast


def rel_err(a, b):
    """Frobenius relative error ||a - b|| / ||b|| (absolute when b == 0)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    nb = np.linalg.norm(b)
    diff = np.linalg.norm(a - b)
    return diff / nb if nb > 0 else diff


def assert_rel(a, b, tol, what=""):
    err = rel_err(a, b)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def make_states(seed, S, n, d, noise=0.3, mean=0.0, dtype=np.float64):
    """Correlated synthetic states: X0 random, X_{k+1} = X_k @ A_k + noise.

    ``mean`` shifts every state by a constant offset vector (so centered and
    uncentered statistics differ).
    """
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    states = [X]
    for _ in range(S - 1):
        A = rng.standard_normal((d, d)) / np.sqrt(d)
        X = X @ A + noise * rng.standard_normal((n, d))
        states.append(X)
    if mean:
        states = [s + mean * rng.standard_normal(d) for s in states]
    return [np.ascontiguousarray(s, dtype=dtype) for s in states]


def stored_pairs(S, span):
    """All (i, j) with i <= j and j - i <= span."""
    return [(i, j) for i in range(S) for j in range(i, S) if j - i <= span]


def moments_from(states, folds=0, pairs="all", batch=None, fold=None, mask=None):
    """Build a Moments from float arrays, optionally in fixed-size batches."""
    S = len(states)
    d = states[0].shape[-1]
    m = toast.Moments(S, d, folds=folds, pairs=pairs)
    n = states[0].shape[0]
    if batch is None:
        m.update(list(states), mask=mask, fold=fold)
        return m
    for start in range(0, n, batch):
        sl = slice(start, start + batch)
        m.update(
            [s[sl] for s in states],
            mask=None if mask is None else mask[sl],
            fold=None if fold is None else fold[sl],
        )
    return m


def lstsq(X, Y):
    return np.linalg.lstsq(X, Y, rcond=None)[0]


def lstsq_affine(X, Y):
    """Least squares with a bias column; returns (weight, bias)."""
    ones = np.ones((X.shape[0], 1))
    coef = np.linalg.lstsq(np.hstack([X, ones]), Y, rcond=None)[0]
    return coef[:-1], coef[-1]


def ridge_ref(X, Y, lam, center):
    """Closed-form ridge: W = (XᵀX + λI)⁻¹ XᵀY on (optionally) centered data,
    bias = mean(Y) - mean(X) @ W (zero when not centered)."""
    d = X.shape[1]
    if center:
        mx, my = X.mean(0), Y.mean(0)
        Xc, Yc = X - mx, Y - my
    else:
        Xc, Yc = X, Y
    W = np.linalg.solve(Xc.T @ Xc + lam * np.eye(d), Xc.T @ Yc)
    b = (my - mx @ W) if center else np.zeros(Y.shape[1])
    return W, b


def pinv_sym(A, rtol=1e-10):
    """Pseudo-inverse of a symmetric PSD matrix by eigendecomposition with an
    explicit relative cutoff (independent of numpy.linalg.pinv's defaults)."""
    w, V = np.linalg.eigh(A)
    keep = w > rtol * w.max()
    return (V[:, keep] / w[keep]) @ V[:, keep].T


def moments_snapshot(m):
    """Everything observable about a Moments, as plain Python/NumPy values."""
    S = m.num_states
    K = m.folds
    snap = {
        "rows": m.rows,
        "count": m.count(),
        "fold_rows": np.array(m.fold_rows, copy=True),
    }
    folds = [None] + list(range(K))
    for f in folds:
        snap[("count", f)] = m.count(fold=f)
        for i in range(S):
            snap[("sum", i, f)] = np.array(m.sum(i, fold=f), copy=True)
            for j in range(i, S):
                if m.has_pair(i, j):
                    snap[("cross", i, j, f)] = np.array(m.cross(i, j, fold=f), copy=True)
    return snap


def assert_moments_equal(m1, m2, tol=1e-12, exact=False):
    """Two Moments hold the same statistics (counts exactly, arrays to tol)."""
    s1, s2 = moments_snapshot(m1), moments_snapshot(m2)
    assert s1.keys() == s2.keys()
    for key in s1:
        a, b = s1[key], s2[key]
        if isinstance(a, np.ndarray) and a.dtype == np.float64:
            if exact:
                assert np.array_equal(a, b), key
            else:
                assert_rel(a, b, tol, what=str(key))
        else:
            assert np.array_equal(np.asarray(a), np.asarray(b)), (key, a, b)


def assert_moments_match_data(m, states, tol=1e-12, fold_of_row=None):
    """Moments equal NumPy float64 statistics of ``states`` (2D arrays, all
    rows accepted, in order). ``fold_of_row`` gives each row's fold id."""
    X = [np.asarray(s, dtype=np.float64) for s in states]
    n = X[0].shape[0]
    S = len(X)
    assert m.rows == n
    assert m.count() == n
    groups = [(None, np.ones(n, dtype=bool))]
    if fold_of_row is not None:
        groups += [(k, fold_of_row == k) for k in range(m.folds)]
        assert np.array_equal(np.asarray(m.fold_rows), np.bincount(fold_of_row, minlength=m.folds))
    for f, sel in groups:
        assert m.count(fold=f) == int(sel.sum())
        for i in range(S):
            assert_rel(m.sum(i, fold=f), X[i][sel].sum(0), tol, f"sum({i}) fold={f}")
            for j in range(i, S):
                if m.has_pair(i, j):
                    assert_rel(
                        m.cross(i, j, fold=f),
                        X[i][sel].T @ X[j][sel],
                        tol,
                        f"cross({i},{j}) fold={f}",
                    )


def _is_local(address) -> bool:
    import ipaddress
    import socket

    if isinstance(address, (str, bytes)):  # AF_UNIX paths
        return True
    host = address[0] if isinstance(address, tuple) and address else address
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(
                ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None)
            )
        except OSError:
            return False


class NetworkAccessError(RuntimeError):
    """A test tried to reach a non-loopback address."""


# ru_maxrss cannot serve: Linux keeps the parent's high-water mark across
# fork and exec, so once pytest has grown past the child's peak every figure
# would be pytest's. The child resets its own VmHWM and reads it.
_MEMORY_PRELUDE = """
import json, os, sys

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def _status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field + " is not in /proc/self/status")

def peak_mib():
    return _status_mib("VmHWM")

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := the current RSS
"""


def run_fresh(script: str, *args, env: dict | None = None, timeout: int = 300) -> dict:
    """Runs ``script`` (after the helpers above) in a fresh interpreter, so
    that its peak RSS belongs to what it does alone; returns the JSON object
    its last line of output prints."""
    import json
    import subprocess
    import textwrap

    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PRELUDE + textwrap.dedent(script), *map(str, args)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def peak_anon_mib(
    cmd: list[str], env: dict | None = None, timeout: float = 600
) -> tuple[int, float, str]:
    """Runs ``cmd`` and polls its anonymous resident memory (``RssAnon`` of
    ``/proc/PID/status``) from outside every 20 ms, as a user watching it
    would (file-backed pages, such as a memory-mapped checkpoint, are not
    the process's own); returns the exit status, the peak in MiB and what
    it wrote to standard error."""
    import subprocess
    import threading
    import time

    def anon(pid: int) -> float:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    said: list[str] = []
    stream = proc.stderr
    assert stream is not None
    reader = threading.Thread(target=lambda: said.append(stream.read()))
    reader.start()
    peak, deadline = 0.0, time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{cmd[:3]} ran past {timeout} s")
        try:
            peak = max(peak, anon(proc.pid))
        except OSError:  # it ended between the poll and the read
            break
        time.sleep(0.02)
    proc.wait()
    reader.join()
    return proc.returncode, peak, said[0] if said else ""


def paired_stderr_ref(mine, theirs):
    """NumPy reference of the paired standard error of two unweighted task
    averages (each a dict of per-document scores by task, same order): per
    task the variance (ddof=1) of the differences over their count, summed,
    square-rooted, over the number of tasks."""
    tasks = list(mine)
    variances = [np.var(np.subtract(mine[t], theirs[t]), ddof=1) / len(mine[t]) for t in tasks]
    return float(np.sqrt(sum(variances)) / len(tasks))


def load_script(path: Path, imports_beside: bool = False) -> ModuleType:
    """The script or benchmark at ``path`` as a module of its file's name,
    registered in ``sys.modules`` (its dataclasses look their module up);
    ``imports_beside``: its folder goes first on ``sys.path``, for the
    modules it imports from there (a benchmark's ``bench_peers``, ``_machine``)."""
    if imports_beside and str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
