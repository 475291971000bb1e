"""Concurrent updates from Python threads: the binding releases the GIL and
serializes updates on one object, so the result equals sequential updates."""

import threading

import numpy as np

import toast
from tests._helpers import assert_moments_equal, make_states

S, D, N_THREADS, BATCHES, ROWS = 3, 48, 4, 4, 500
JOIN_TIMEOUT = 60.0


def _batches():
    return [make_states(100 + b, S, ROWS, D, dtype=np.float32) for b in range(N_THREADS * BATCHES)]


def _run_threads(target, args_per_thread):
    errors = []

    def wrapped(*args):
        try:
            target(*args)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=a, daemon=True) for a in args_per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "update threads hung"
    assert not errors, errors


def test_threaded_updates_equal_sequential():
    batches = _batches()
    shared = toast.Moments(S, D)

    def work(tid):
        for b in range(tid, len(batches), N_THREADS):
            shared.update(batches[b])

    _run_threads(work, [(t,) for t in range(N_THREADS)])
    sequential = toast.Moments(S, D)
    for batch in batches:
        sequential.update(batch)
    assert shared.rows == N_THREADS * BATCHES * ROWS
    assert_moments_equal(shared, sequential, tol=1e-12)


def test_threaded_updates_with_explicit_folds_equal_sequential():
    # with explicit fold ids the result does not depend on update order
    K = 3
    batches = _batches()
    folds = [np.random.default_rng(200 + b).integers(0, K, ROWS) for b in range(len(batches))]
    shared = toast.Moments(S, D, folds=K)

    def work(tid):
        for b in range(tid, len(batches), N_THREADS):
            shared.update(batches[b], fold=folds[b])

    _run_threads(work, [(t,) for t in range(N_THREADS)])
    sequential = toast.Moments(S, D, folds=K)
    for batch, fold in zip(batches, folds, strict=True):
        sequential.update(batch, fold=fold)
    assert_moments_equal(shared, sequential, tol=1e-12)


def test_threads_on_separate_objects_match_sequential():
    batches = _batches()
    objs = [toast.Moments(S, D) for _ in range(N_THREADS)]

    def work(tid):
        for b in range(tid, len(batches), N_THREADS):
            objs[tid].update(batches[b])

    _run_threads(work, [(t,) for t in range(N_THREADS)])
    for tid in range(N_THREADS):
        ref = toast.Moments(S, D)
        for b in range(tid, len(batches), N_THREADS):
            ref.update(batches[b])
        assert_moments_equal(objs[tid], ref, tol=1e-12)


def test_concurrent_failing_and_good_updates():
    # failing updates (NaN) from some threads neither corrupt nor block others
    batches = _batches()[:8]
    bad = [b[0].copy() for b in batches[:1]]
    bad[0][3, 4] = np.nan
    bad_batch = [bad[0]] + [x.copy() for x in batches[0][1:]]
    shared = toast.Moments(S, D)
    failures = []

    def good(tid):
        for b in range(tid, len(batches), 2):
            shared.update(batches[b])

    def failing(_):
        for _ in range(10):
            try:
                shared.update(bad_batch)
            except ValueError:
                failures.append(1)

    _run_threads(lambda tid: good(tid) if tid < 2 else failing(tid), [(t,) for t in range(4)])
    assert len(failures) == 20
    sequential = toast.Moments(S, D)
    for batch in batches:
        sequential.update(batch)
    assert_moments_equal(shared, sequential, tol=1e-12)
