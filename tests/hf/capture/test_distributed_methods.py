"""Every method under torch.distributed equals one process (gloo on loopback).

Two worker processes are given the same data; toast shards the calibration
and held-out batches over them (batch k on rank k % 2) and reduces every
sum in float64. Each worker writes the model a method returns; the test
compares it with the same call in this process: every weight equal to
1e-6 (relative), the same blocks removed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import toast
from tests._helpers import assert_rel

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
transformers = pytest.importorskip("transformers")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

pytestmark = pytest.mark.hf

REPO_ROOT = str(Path(__file__).resolve().parents[3])

# What each case runs, in a worker and here alike: ``model, data, heldout``
# in scope; it leaves the compressed model in ``out``.
SETUP = textwrap.dedent(
    """
    import torch, toast
    from tests._helpers import replaceme_models as rm

    torch.set_num_threads(1)
    FORWARDS = [0]  # the model's forwards (calibration, held-out and the rest)

    def _count(module, args):
        FORWARDS[0] += type(module).__name__ == "LlamaForCausalLM"

    torch.nn.modules.module.register_module_forward_pre_hook(_count)

    def decoder():
        return rm.decoder("llama")

    # 7 calibration batches of uneven lengths (padding, masks), 3 held out
    data = rm.text_loader(n=28, batch_size=4, seed=1)
    heldout = rm.text_loader(n=12, batch_size=4, seed=2)

    def run(case):
        FORWARDS[0] = 0
        if case == "toast":  # the defaults: a held-out check batch, massive rows
            model, _ = toast.compress(decoder(), data, budget=2, progress=False)
        elif case == "toast_cv":  # 5-fold held-out errors: one process's folds on the ranks
            model, report = toast.compress(decoder(), data, budget=2, estimator="cv",
                                           progress=False)
            assert report.analysis.estimator == "cv"
        elif case == "toast_heldout":  # measured quality in the report too
            model, report = toast.compress(decoder(), data, budget=2, heldout=heldout,
                                           progress=False)
            return model, report.quality.metrics
        elif case == "replaceme":  # measured cut among candidates, checked, placement auto
            model, _ = toast.compress(decoder(), data, method="replaceme", num_blocks=2,
                                      progress=False)
        elif case == "linearpatch":
            model, _ = toast.compress(decoder(), data, method="linearpatch", num_blocks=2,
                                      progress=False)
        elif case in ("search", "search_latency"):  # timings: rank 0's for every rank
            result = toast.search(decoder(), data, heldout, target=0.25, max_measured=3,
                                  latency=case == "search_latency", cache=False,
                                  progress=False)
            model = result.model
        else:
            raise ValueError(case)
        return model, {}
    """
)

WORKER = SETUP + textwrap.dedent(
    """
    import datetime, sys
    import numpy as np
    import torch.distributed as dist

    out, rank, world = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cases = sys.argv[5].split(",")
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    for case in cases:
        model, metrics = run(case)
        arrays = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
        for k, v in metrics.get("compressed", {}).items():
            arrays[f"metric/{k}"] = np.array(v)
        arrays["forwards"] = np.array(FORWARDS[0])
        np.savez(f"{out}/{case}.rank{rank}.npz", **arrays)
    dist.destroy_process_group()
    """
)


def _run_workers(tmp_path: Path, cases: list[str], world: int = 2) -> None:
    script = tmp_path / "worker.py"
    script.write_text(f"import sys; sys.path.insert(0, sys.argv[1])\n{WORKER}")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop("RANK", None)  # a rendezvous of its own
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                REPO_ROOT,
                str(tmp_path),
                str(r),
                str(world),
                ",".join(cases),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{out}"


_NAMESPACE: dict = {}


def _single(case: str):
    if not _NAMESPACE:  # the very code the workers run
        exec(compile(SETUP, "setup", "exec"), _NAMESPACE)
    model, metrics = _NAMESPACE["run"](case)
    return model, metrics, _NAMESPACE["FORWARDS"][0]


def assert_same_model(ranks: list[dict], model: torch.nn.Module, what: str) -> None:
    """Every rank's weights equal the one-process model's (1e-6 relative):
    the same tensors (the same blocks removed and replaced), the same values."""
    expected = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    for rank, got in enumerate(ranks):
        weights = {k: v for k, v in got.items() if k != "forwards" and not k.startswith("metric/")}
        assert sorted(weights) == sorted(expected), f"{what}: rank {rank} has other tensors"
        for name, value in expected.items():
            assert weights[name].shape == value.shape, (what, rank, name)
            assert_rel(weights[name], value, 1e-6, f"{what}: rank {rank} {name}")


CASES = [
    "toast",
    "toast_cv",
    "toast_heldout",
    "replaceme",
    "linearpatch",
    "search",
    "search_latency",
]


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory, build_once):
    def run() -> dict:
        tmp = tmp_path_factory.mktemp("dist_methods")
        _run_workers(tmp, CASES)
        return {
            case: [dict(np.load(tmp / f"{case}.rank{r}.npz")) for r in range(2)] for case in CASES
        }

    return build_once("distributed-methods", run)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_write_the_model_of_one_process(worker_results, case):
    ranks = worker_results[case]
    model, metrics, forwards = _single(case)
    assert model is not None
    assert_same_model(ranks, model, case)
    # sharded: each rank ran fewer forwards than one process, together at least as many
    counts = [int(r["forwards"]) for r in ranks]
    assert all(c < forwards for c in counts) and sum(counts) >= forwards, (counts, forwards)
    for name, value in metrics.get("compressed", {}).items():  # held-out figures reduced
        for got in ranks:
            assert_rel(got[f"metric/{name}"], np.array(value), 1e-9, name)


def test_shards_are_what_one_process_forwards():
    from toast.hf.capture.distributed import Ranks, owned_batches

    batches = list(range(7))
    shards = [list(owned_batches(batches, Ranks(r, 3))) for r in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]
    assert list(owned_batches(batches, None)) == batches
    assert toast.Calibration().shard is True


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    found: dict[str, np.ndarray] = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(str(path)))
    return found


@pytest.mark.parametrize("method", ["toast", "replaceme", "linearpatch", "search"])
def test_torchrun_compress_writes_the_folder_of_one_process(tmp_path, method):
    from tests._helpers import replaceme_models as rm
    from tests._helpers.tokenizers import char_tokenizer
    from toast.cli import main

    letters = "abcdefghijklmnopqrstuvwxyz "
    folder = tmp_path / "llama"
    rm.decoder("llama").save_pretrained(folder)
    char_tokenizer(letters).save_pretrained(folder)
    g = np.random.default_rng(0)
    lines = ["".join(g.choice(list(letters), size=g.integers(8, 30))) for _ in range(28)]
    (tmp_path / "data.txt").write_text("\n".join(lines) + "\n")
    data = ["--data", str(tmp_path / "data.txt"), "--batch-size", "4", "--max-length", "32"]
    if method == "search":  # `toast search`: the last quarter of the lines held out
        argv = ["search", str(folder), *data, "--heldout", "0.25", "--target", "params=25%",
                "--max-measured", "3", "--no-latency", "--no-cache", "--no-progress"]  # fmt: skip
    else:
        size = ["--budget", "2"] if method == "toast" else ["--num-blocks", "2"]
        argv = ["compress", str(folder), "--method", method, *data, *size, "--no-progress"]

    torch.set_num_threads(1)
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONPATH=REPO_ROOT)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]  # fmt: skip
    done = subprocess.run(
        [*launch, "-m", "toast", *argv, "--out", str(tmp_path / "two")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    if method != "search":
        assert done.stdout.count("saved to") == 1, "rank 0 alone reports"
    if method == "search":  # the chosen model is written in the output's model/ folder
        one, two = _tensors(tmp_path / "one" / "model"), _tensors(tmp_path / "two" / "model")
    else:
        one, two = _tensors(tmp_path / "one"), _tensors(tmp_path / "two")
    assert one, "a model was written"
    assert sorted(one) == sorted(two), "the same tensors: the same blocks removed"
    for name, value in one.items():
        assert_rel(two[name].astype(np.float64), value.astype(np.float64), 1e-6, name)
    assert (tmp_path / "two" / "report.md").is_file()
    assert not list(tmp_path.glob("two*.tmp*")), "no other rank's folder left"
