"""toast.hf.all_reduce_moments across processes (torch.distributed, gloo on loopback).

Two worker processes each accumulate half of a deterministic dataset, sum
their moments with ``toast.hf.all_reduce_moments`` and write what they then compute;
the test compares that with a single-process run of the whole dataset.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import toast
from tests._helpers import assert_rel, make_states, moments_from

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

S, N, D, FOLDS = 4, 240, 6, 3
# the repository root, so that subprocesses can import tests._helpers
REPO_ROOT = str(Path(__file__).resolve().parents[3])

WORKER = textwrap.dedent(
    """
    import datetime, json, sys
    import numpy as np
    import torch.distributed as dist

    repo_root, rank, world, out = sys.argv[1:5]
    rank, world = int(rank), int(world)
    sys.path.insert(0, repo_root)
    import toast
    from tests._helpers import make_states

    S, N, D, FOLDS = {S}, {N}, {D}, {FOLDS}
    dist.init_process_group(
        "gloo", init_method=f"file://{{out}}/rendezvous", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    states = make_states(7, S, N, D, mean=0.5)
    lo, hi = rank * N // world, (rank + 1) * N // world
    rows = np.arange(lo, hi)
    result = {{}}
    for pairs in ("all", "consecutive"):
        m = toast.Moments(S, D, folds=FOLDS, pairs=pairs)
        # this rank's shard in two batches, with the folds of the global row numbers
        mid = (lo + hi) // 2
        for a, b in ((lo, mid), (mid, hi)):
            m.update([s[a:b] for s in states], fold=np.arange(a, b) % FOLDS)
        assert m.rows == hi - lo
        assert toast.hf.all_reduce_moments(m) is m
        result[pairs + "/data"] = m._get_data()
        result[pairs + "/rows"] = np.array(m.rows)
        result[pairs + "/E_cv"] = toast.error_matrix(m, "linear", "cv")
        result[pairs + "/E_gcv"] = toast.error_matrix(m, "affine", "gcv")
        result[pairs + "/E_mse"] = toast.error_matrix(m, "mse")
        for i in range(S):
            for j in range(i, S):
                if m.has_pair(i, j):
                    result[f"{{pairs}}/cross/{{i}}/{{j}}"] = m.cross(i, j)
    # moments of another layout on one rank: every rank raises the same ValueError
    bad = toast.Moments(S, D + rank, folds=FOLDS)
    bad.update([np.ones((2, D + rank))] * S)
    try:
        toast.hf.all_reduce_moments(bad)
        result["mismatch"] = np.array("no error")
    except ValueError as exc:
        result["mismatch"] = np.array(str(exc))
    assert bad.rows == 2  # untouched
    np.savez(f"{{out}}/rank{{rank}}.npz", **result)
    dist.destroy_process_group()
    """
).format(S=S, N=N, D=D, FOLDS=FOLDS)


def _run_workers(tmp_path, world=2, worker=WORKER):
    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    # A file store for the rendezvous: no port to race for.
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), REPO_ROOT, str(r), str(world), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{out}"
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    return _run_workers(tmp_path_factory.mktemp("dist"))


@pytest.mark.parametrize("pairs", ["all", "consecutive"])
def test_all_reduce_equals_single_process(worker_results, pairs):
    states = make_states(7, S, N, D, mean=0.5)
    # single process: default folds (row r -> r % FOLDS) = the workers' explicit ids
    ref = moments_from(states, folds=FOLDS, pairs=pairs)
    expected = {
        "E_cv": toast.error_matrix(ref, "linear", "cv"),
        "E_gcv": toast.error_matrix(ref, "affine", "gcv"),
        "E_mse": toast.error_matrix(ref, "mse"),
    }
    for rank, res in enumerate(worker_results):
        assert int(res[f"{pairs}/rows"]) == N
        assert_rel(res[f"{pairs}/data"], ref._get_data(), 1e-12, f"rank {rank} storage")
        for name, E in expected.items():
            got = res[f"{pairs}/{name}"]
            assert np.array_equal(np.isnan(got), np.isnan(E)), (rank, name)
            ok = ~np.isnan(E)
            assert_rel(got[ok], E[ok], 1e-12, f"rank {rank} {name}")
        for i in range(S):
            for j in range(i, S):
                key = f"{pairs}/cross/{i}/{j}"
                assert (key in res) == ref.has_pair(i, j)
                if key in res:
                    assert_rel(res[key], ref.cross(i, j), 1e-12, f"rank {rank} {key}")
    # every rank holds bit-identical moments
    first = worker_results[0][f"{pairs}/data"]
    for res in worker_results[1:]:
        assert np.array_equal(res[f"{pairs}/data"], first)


def test_all_reduce_rejects_mismatched_layouts(worker_results):
    for res in worker_results:
        msg = str(res["mismatch"])
        assert "differ in dim" in msg, msg
        assert f"rank 0: {D}" in msg and f"rank 1: {D + 1}" in msg, msg


def test_all_reduce_needs_an_initialised_group():
    m = toast.Moments(2, 3)
    if dist.is_initialized():  # pragma: no cover - not in this test suite
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        toast.hf.all_reduce_moments(m)
    from toast.hf.capture.distributed import all_reduce_moments

    with pytest.raises(TypeError, match="toast.Moments"):
        all_reduce_moments(np.zeros(3))


# What every worker of the HF tests starts with: its rank, the world, the
# output folder, and the repository on the path.
WORKER_HEAD = textwrap.dedent(
    """
    import datetime, sys
    import numpy as np, torch
    import torch.distributed as dist

    repo_root, rank, world, out = sys.argv[1:5]
    rank, world = int(rank), int(world)
    sys.path.insert(0, repo_root)
    import toast
    """
)

HF_WORKER = WORKER_HEAD + textwrap.dedent(
    """
    from tests._helpers import hf_models

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    images = hf_models.images(20, seed=1)
    # every rank passes the same data: toast forwards batches k % world == rank
    whole = [images[k:k + 4] for k in range(0, 20, 4)]
    result = {}
    model = hf_models.build(hf_models.FAMILIES[0])
    for estimator in ("cv", "gcv", "in_sample"):
        result[estimator] = toast.analyze(model, whole, estimator=estimator, progress=False).errors
    for fit in ("independent", "sequential"):
        m, _ = toast.compress(hf_models.build(hf_models.FAMILIES[0]), whole, spans=[(1, 2), (3, 4)],
                              estimator="gcv", fit=fit, check_fraction=0, progress=False)
        result[fit] = toast.hf.find_blocks(m).blocks[3].translator.weight.detach().numpy()
    # the default check: the held-out batch is measured on the rank that owns it
    m, _ = toast.compress(hf_models.build(hf_models.FAMILIES[0]), whole, budget=2, progress=False)
    for name, p in m.state_dict().items():
        result["checked/" + name] = p.detach().numpy()
    m, _ = toast.compress(hf_models.build(hf_models.FAMILIES[0]), whole, spans=[(1, 3)],
                          estimator="gcv", translator="mlp", train_steps=3, check_fraction=0,
                          progress=False)
    result["mlp"] = toast.hf.find_blocks(m).blocks[1].translator.net[0].weight.detach().numpy()
    # shard=False: each rank passes its own shard (one of them empty), used whole
    mine = [] if rank == 1 else whole[0::2]
    result["uneven"] = toast.analyze(model, mine, estimator="gcv", shard=False,
                                     progress=False).errors
    np.savez(f"{out}/rank{rank}.npz", **result)
    dist.destroy_process_group()
    """
)


@pytest.mark.hf
def test_analyze_and_compress_agree_across_ranks_and_with_one_process(tmp_path):
    hf_models = pytest.importorskip("tests._helpers.hf_models")
    ranks = _run_workers(tmp_path, worker=HF_WORKER)
    for key in ranks[0]:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)

    torch.set_num_threads(1)
    model = hf_models.build(hf_models.FAMILIES[0])
    images = hf_models.images(20, seed=1)
    whole = [images[k : k + 4] for k in range(0, 20, 4)]
    iu = np.triu_indices(hf_models.LAYERS + 1, 1)
    # cv too: the folds are dealt by one process's row numbers
    for estimator in ("cv", "gcv", "in_sample"):
        single = toast.analyze(model, whole, estimator=estimator, progress=False).errors
        assert_rel(ranks[0][estimator][iu], single[iu], 1e-10, estimator)
    single = toast.analyze(model, whole[0::2], estimator="gcv", progress=False).errors
    assert_rel(ranks[0]["uneven"][iu], single[iu], 1e-12, "shard=False, one empty shard")
    for fit in ("independent", "sequential"):
        m, _ = toast.compress(
            hf_models.build(hf_models.FAMILIES[0]),
            whole,
            spans=[(1, 2), (3, 4)],
            estimator="gcv",
            fit=fit,
            check_fraction=0,
            progress=False,
        )
        expected = toast.hf.find_blocks(m).blocks[3].translator.weight.detach().numpy()
        assert_rel(ranks[0][fit], expected, 1e-6, fit)
    m, _ = toast.compress(hf_models.build(hf_models.FAMILIES[0]), whole, budget=2, progress=False)
    state = m.state_dict()
    got = {k.removeprefix("checked/"): v for k, v in ranks[0].items() if k.startswith("checked/")}
    assert sorted(got) == sorted(state), "the same blocks removed and replaced"
    for name, p in state.items():
        assert_rel(got[name], p.detach().numpy(), 1e-6, name)
    m, _ = toast.compress(
        hf_models.build(hf_models.FAMILIES[0]),
        whole,
        spans=[(1, 3)],
        estimator="gcv",
        translator="mlp",
        train_steps=3,
        check_fraction=0,
        progress=False,
    )
    expected = toast.hf.find_blocks(m).blocks[1].translator.net[0].weight.detach().numpy()
    assert_rel(ranks[0]["mlp"], expected, 1e-6, "mlp: every rank samples every row")


DIFFERENT_DATA_WORKER = WORKER_HEAD + textwrap.dedent(
    """
    from tests._helpers import replaceme_models as rm

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    mine = rm.text_loader(n=16, batch_size=4, seed=rank)  # each rank its own data
    said = {}
    try:
        toast.analyze(rm.decoder("llama"), mine, estimator="gcv", progress=False)
    except ValueError as exc:
        said["error"] = np.array(str(exc))
    # shard=False: each rank's own shard, used whole (the moments summed)
    kept = toast.analyze(rm.decoder("llama"), mine, estimator="gcv", progress=False, shard=False)
    said["rows"] = np.array(kept.rows)
    np.savez(f"{out}/rank{rank}.npz", **said)
    dist.destroy_process_group()
    """
)


@pytest.mark.hf
def test_ranks_passing_different_data_are_told_to_pass_the_same_or_shard_false(tmp_path):
    pytest.importorskip("tests._helpers.replaceme_models")
    ranks = _run_workers(tmp_path, worker=DIFFERENT_DATA_WORKER)
    for got in ranks:
        assert "same batches" in str(got["error"]) and "shard=False" in str(got["error"])
    assert int(ranks[0]["rows"]) == int(ranks[1]["rows"])  # summed over both shards
