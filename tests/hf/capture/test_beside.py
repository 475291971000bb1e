"""Summing a batch's statistics beside the next batch's forward."""

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("tests._helpers.hf_models")

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

import toast  # noqa: E402
from toast.hf.capture import beside  # noqa: E402
from toast.hf.capture import states as capture_states  # noqa: E402

FAMILY = hf_models.FAMILIES[0]


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("toast-statistics")]


def _capture(monkeypatch, spare: bool, model=None, **options):
    monkeypatch.setattr(capture_states, "spare_cores", lambda: spare)
    model = model if model is not None else hf_models.build(FAMILY)
    batches = hf_models.loader(FAMILY, n=12, batch_size=3)
    return toast.hf.capture_moments(model, batches, progress=False, **options)[0]


@pytest.mark.parametrize("folds", [0, 3])
def test_moments_summed_beside_the_forward_equal_those_summed_in_line(monkeypatch, folds):
    threads: list[str] = []
    update = capture_states._update

    def recorded(*args):
        threads.append(threading.current_thread().name)
        update(*args)

    monkeypatch.setattr(capture_states, "_update", recorded)
    in_line = _capture(monkeypatch, False, folds=folds)
    assert set(threads) == {threading.current_thread().name}
    threads.clear()
    overlapped = _capture(monkeypatch, True, folds=folds)
    assert len(threads) == 4 and all(t.startswith("toast-statistics") for t in threads)
    assert overlapped.rows == in_line.rows
    # bit for bit: the same updates, in the same order, on the same BLAS threads
    assert np.array_equal(overlapped._get_data(), in_line._get_data())


def test_an_update_that_fails_beside_the_forward_names_the_block(monkeypatch):
    model = hf_models.build(FAMILY)
    with torch.no_grad():
        model.layers[2].mlp.fc2.bias.fill_(float("nan"))
    with pytest.raises(ValueError, match="block 2"):
        _capture(monkeypatch, True, model=model, folds=0)
    assert not _workers()


def test_no_worker_thread_outlives_a_pass(monkeypatch):
    _capture(monkeypatch, True, folds=0)
    assert not _workers()


def test_an_interrupted_pass_waits_for_the_update_in_flight_and_ends_its_worker(monkeypatch):
    model = hf_models.build(FAMILY)
    calls = {"n": 0}

    def interrupt_second_batch(module, args, output):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    handle = model.layers[0].register_forward_hook(interrupt_second_batch)
    try:
        with pytest.raises(KeyboardInterrupt):
            _capture(monkeypatch, True, model=model, folds=0)
    finally:
        handle.remove()
    assert not _workers()


def test_calls_run_in_order_with_at_most_one_in_flight():
    done: list[int] = []
    running = []

    def work(k: int) -> None:
        running.append(k)
        assert len(running) == 1, "two calls ran at once"
        time.sleep(0.01)
        done.append(k)
        running.remove(k)

    runner = beside.Beside(enabled=True)
    for k in range(5):
        runner.run(work, k)
    runner.close()
    assert done == [0, 1, 2, 3, 4]
    assert not _workers()


def test_an_error_is_raised_at_the_next_call_and_not_when_abandoned():
    def fail() -> None:
        raise RuntimeError("update failed")

    runner = beside.Beside(enabled=True)
    runner.run(fail)
    with pytest.raises(RuntimeError, match="update failed"):
        runner.run(lambda: None)
    runner.run(fail)
    runner.abandon()  # the caller's own error is the one to see
    assert not _workers()


def test_disabled_runs_each_call_at_once_in_the_callers_thread():
    seen = []
    runner = beside.Beside(enabled=False)
    runner.run(lambda: seen.append(threading.current_thread().name))
    assert seen == [threading.current_thread().name]
    runner.close()


@pytest.mark.parametrize(
    ("torch_threads", "blas_threads", "cores", "spare"),
    [(1, 1, 2, True), (2, 1, 2, False), (1, 2, 2, False), (2, 2, 4, True), (1, None, 2, True)],
)
def test_spare_cores_counts_torch_and_blas_threads(
    monkeypatch, torch_threads, blas_threads, cores, spare
):
    monkeypatch.setattr(beside.torch, "get_num_threads", lambda: torch_threads)
    monkeypatch.setattr(beside, "get_blas_threads", lambda: blas_threads)
    monkeypatch.setattr(beside, "usable_cores", lambda: cores)
    assert beside.spare_cores() is spare
