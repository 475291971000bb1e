"""Benchmark the toast C core against the NumPy / PyTorch code a user would write.

Everything runs in ONE process, side by side, on the same synthetic data.

Data
----
ViT-B-shaped synthetic activations: ``S = 13`` residual-stream states
(embedding + 12 blocks) of width ``d = 768``, float32, produced in batches of
64 images x 197 tokens = 12,608 rows, one ``(batch, tokens, d)`` array per
state (the last, partial batch is passed as a ``(rows, d)`` array when its row
count is not a multiple of 197).  State 0 is anisotropic Gaussian noise with a
few large-mean ("massive activation") features; state ``s + 1`` is state ``s``
plus fresh anisotropic noise, so errors grow with the block distance ``j - i``.
Batch ``b`` is generated from the seed ``(seed, b)`` into buffers that are
allocated once, so every method sees bit-identical rows, and generation is
never inside a timed region or a memory window.

(a) Moment accumulation throughput
    Ours: ``toast.Moments(13, 768, pairs="all")`` and ``.update(states)`` per
    batch (also ``pairs="consecutive"``, and every ``precision=`` value the
    constructor accepts, if it has that keyword).  Reference: NumPy float32
    ``G += X.T @ X`` where ``X`` is the ``(rows_in_batch, 13 * 768)``
    concatenation of the states (NumPy detects ``X.T @ X`` and calls syrk); the
    concatenation is built outside the timed region.  Reported as rows/s; the
    ratio is ours / reference.  Each method gets one untimed warm-up call on a
    small input first.

(b) All-pairs error matrix (in-sample linear)
    Ours: wall clock of ``Moments(...)`` + ``update`` over all batches +
    ``toast.error_matrix(m, metric="linear", estimator="in_sample")``.
    Reference: store all activations in a preallocated float32 torch tensor of
    shape ``(13, rows, 768)``, then for every pair ``i < j``
    ``W = torch.linalg.lstsq(X_i, X_j).solution`` and
    ``norm(X_j - X_i @ W) / norm(X_j)``; its wall clock covers the copies into
    the store and all solves.  Ours runs before AND after the reference (so it
    is measured once in each order); its time is the mean of the two runs and
    its peak the larger one.  The two matrices are compared (max abs
    difference, no assertion).  For information: ``estimator="gcv"`` on the
    same moments, and ``estimator="cv"`` on a separate ``Moments(folds=5)``
    (update + cv; its peak memory and ``nbytes`` are reported).

(a) and (b) are repeated for every size in ``--sizes`` (rows per state).

(c) ReplaceMe's least-squares statistics
    ``--ls-rows`` float32 rows of width ``--ls-dim`` (32,768 x 576, SmolLM2's
    width) in chunks of 4,096: M, Y and L = Y + M T + noise. Reference: the
    plain torch loop a user would write, per chunk ``M64ᵀ M64`` and
    ``M64ᵀ (L64 − Y64)`` in float64. Ours: ``toast.Moments(2, d,
    row_stats=False, sources=1)`` (what ReplaceMe builds: MᵀM, Mᵀ(L − Y) and
    the sums) updated with the same chunks, the target difference taken in
    float64 as ReplaceMe does, in float64 and in mixed precision; and, for
    comparison, the moments forming every block and the row statistics.
    Every call timed in ``--ls-rounds`` interleaved rounds (medians), with
    its peak RSS and the relative error of both products against the
    reference.

Peak memory
-----------
Each phase starts after ``del`` + ``gc.collect()`` + ``malloc_trim(0)``; its
baseline is the RSS at that point (the reusable batch buffers already exist,
so they are not counted for either side).  A background thread samples
``/proc/self/statm`` (resident pages x page size) every 5 ms; the reported peak
is ``max(sample) - baseline`` in MiB.  A sampler thread needs the GIL, so a C
call that holds the GIL could hide a short peak; as a cross-check the kernel's
high-water mark ``VmHWM`` is reset at the start of each phase (``echo 5 >
/proc/self/clear_refs``) and read at the end; both numbers go to the JSON and
a warning is printed when they disagree by more than 10 %.

Threads
-------
``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` default
to ``os.cpu_count()`` (set before NumPy / torch are imported; an existing value
is kept), ``torch.set_num_threads(os.cpu_count())`` is called, and, when
threadpoolctl is installed, every loaded BLAS / OpenMP pool is limited to the
same number.  The effective settings are printed and stored in the JSON.

Run ``python benchmarks/bench_core.py --help`` for the options; results are
printed as Markdown tables and written to ``benchmarks/out/core.json`` (and
``core.md``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(os.cpu_count() or 1))
os.environ.setdefault("MKL_NUM_THREADS", str(os.cpu_count() or 1))

import argparse
import contextlib
import ctypes
import gc
import inspect
import json
import platform
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, final

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_model  # noqa: E402

import toast  # noqa: E402
from toast.hf.capture.torch_moments import TorchMoments  # noqa: E402

try:  # optional: progress bars
    from tqdm import tqdm as _tqdm
except ImportError:  # pragma: no cover - optional dependency
    _tqdm = None

try:  # optional: BLAS pool inspection / limits
    import threadpoolctl
except ImportError:  # pragma: no cover - optional dependency
    threadpoolctl = None

T = TypeVar("T")
MIB = 2.0**20
THREADS = os.cpu_count() or 1
OUT_DIR = Path(__file__).resolve().parent / "out"
PRECISION_CANDIDATES = ("float64", "mixed", "float32")


# --------------------------------------------------------------------------
# configuration and synthetic data
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """Benchmark parameters (see ``parse_args``)."""

    sizes: tuple[int, ...]
    num_states: int = 13
    dim: int = 768
    batch_images: int = 64
    tokens: int = 197
    folds: int = 5
    seed: int = 0
    reference: bool = True
    repeat_ours: bool = True
    f64_check_max_rows: int = 10_000
    ls_rows: int = 32_768
    ls_dim: int = 576
    ls_chunk: int = 4096
    ls_rounds: int = 7
    out: Path = OUT_DIR / "core.json"

    @property
    def batch_rows(self) -> int:
        return self.batch_images * self.tokens


@dataclass
class Synth:
    """Deterministic ViT-like residual-stream generator writing into fixed buffers."""

    cfg: Config
    scales: np.ndarray = field(init=False)
    offset: np.ndarray = field(init=False)
    buffers: list[np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        s, d = self.cfg.num_states, self.cfg.dim
        rng = np.random.default_rng([self.cfg.seed, 2**31 - 1])
        scales = rng.lognormal(0.0, 0.5, size=(s, d))
        scales[1:] *= 0.35  # per-block update is smaller than the stream
        self.scales = scales.astype(np.float32)
        offset = np.zeros(d, np.float32)
        offset[rng.choice(d, size=4, replace=False)] = 8.0  # massive activations
        self.offset = offset
        self.buffers = [np.empty((self.cfg.batch_rows, d), np.float32) for _ in range(s)]

    def fill(self, batch: int, rows: int) -> None:
        """Write rows ``0..rows-1`` of batch ``batch`` into the buffers."""
        rng = np.random.default_rng([self.cfg.seed, batch])
        for s, buf in enumerate(self.buffers):
            view = buf[:rows]
            rng.standard_normal(out=view, dtype=np.float32)
            view *= self.scales[s]
            view += self.offset if s == 0 else self.buffers[s - 1][:rows]

    def states(self, rows: int) -> list[np.ndarray]:
        """Views of the current batch: ``(batch, tokens, d)`` when whole images."""
        tokens, d = self.cfg.tokens, self.cfg.dim
        if rows % tokens == 0:
            return [b[:rows].reshape(rows // tokens, tokens, d) for b in self.buffers]
        return [b[:rows] for b in self.buffers]


def batch_plan(rows: int, batch_rows: int) -> list[int]:
    """Row counts of the batches covering ``rows`` rows."""
    full, rest = divmod(rows, batch_rows)
    return [batch_rows] * full + ([rest] if rest else [])


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """``tqdm`` when available (on stderr, cleared when done), else plain iteration."""
    if _tqdm is None:
        yield from items
    else:
        yield from _tqdm(items, desc=desc, total=total, leave=False, file=sys.stderr, disable=None)


def batches(synth: Synth, rows: int, desc: str) -> Iterator[tuple[int, int]]:
    """Fill each batch (untimed) and yield ``(first_row, rows_in_batch)``."""
    plan = batch_plan(rows, synth.cfg.batch_rows)
    start = 0
    for b, n in progress(enumerate(plan), desc, total=len(plan)):
        synth.fill(b, n)
        yield start, n
        start += n


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """Call ``fn`` and return its result and wall-clock seconds."""
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


# --------------------------------------------------------------------------
# memory measurement
# --------------------------------------------------------------------------

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Current resident set size from ``/proc/self/statm``."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def _status_kib(key: str) -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def usage_start() -> tuple[float, float]:
    """Wall clock and process CPU time (all threads) now."""
    return time.perf_counter(), time.process_time()


def usage_stop(start: tuple[float, float]) -> dict[str, float]:
    """Average busy cores since ``start`` and the 1-minute load average now.

    A load average above the core count means other processes competed for the
    CPU during the phase, so its timings are pessimistic.
    """
    wall = time.perf_counter() - start[0]
    cpu = time.process_time() - start[1]
    return {"wall_s": wall, "cpu_util": cpu / max(wall, 1e-9), "loadavg_1m": os.getloadavg()[0]}


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@final
class PeakRSS:
    """Context manager: RSS high-water mark above the baseline at entry."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self.hwm: int | None = None
        self.usage: dict[str, float] = {}
        self._usage = (0.0, 0.0)
        self._hwm_ok = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakRSS:
        release_memory()
        self._hwm_ok = _reset_hwm()
        self.baseline = self.peak = rss_bytes()
        self._usage = usage_start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.usage = usage_stop(self._usage)
        self.peak = max(self.peak, rss_bytes())
        hwm_kib = _status_kib("VmHWM") if self._hwm_ok else None
        self.hwm = None if hwm_kib is None else hwm_kib * 1024

    @property
    def peak_mib(self) -> float:
        return (self.peak - self.baseline) / MIB

    @property
    def hwm_mib(self) -> float | None:
        return None if self.hwm is None else (self.hwm - self.baseline) / MIB

    def as_dict(self) -> dict[str, float | None]:
        return {
            "peak_mib": self.peak_mib,
            "vmhwm_peak_mib": self.hwm_mib,
            "baseline_mib": self.baseline / MIB,
            **self.usage,
        }


def check_sampler(label: str, mem: PeakRSS) -> None:
    """Log the phase; warn when the sampled peak and VmHWM disagree by > 10 %."""
    u = mem.usage
    print(
        f"  [{label}] {u['wall_s']:.1f} s wall, peak +{mem.peak_mib:.0f} MiB, "
        f"{u['cpu_util']:.2f} cores busy, load {u['loadavg_1m']:.2f}",
        flush=True,
    )
    warn_load(label, u)
    hwm = mem.hwm_mib
    if hwm is not None and abs(hwm - mem.peak_mib) > 0.1 * max(hwm, 1.0):
        print(
            f"  note [{label}]: sampled peak {mem.peak_mib:.0f} MiB vs VmHWM {hwm:.0f} MiB"
            " (a C call may hold the GIL)",
            file=sys.stderr,
        )


def warn_load(label: str, usage: dict[str, float]) -> None:
    if usage["loadavg_1m"] > THREADS + 0.5:
        print(
            f"  note [{label}]: load average {usage['loadavg_1m']:.2f} > {THREADS} cores: "
            "other processes competed for the CPU, timings are pessimistic",
            file=sys.stderr,
            flush=True,
        )


# --------------------------------------------------------------------------
# machine info and threads
# --------------------------------------------------------------------------


def configure_threads(n: int) -> None:
    """Use ``n`` threads in torch and in every BLAS / OpenMP pool."""
    torch.set_num_threads(n)
    if threadpoolctl is not None:
        threadpoolctl.threadpool_limits(n)


def machine_info() -> dict[str, Any]:
    mem_kib = None
    try:
        with open("/proc/meminfo") as f:
            mem_kib = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    pools = []
    if threadpoolctl is not None:
        pools = [
            {
                k: p.get(k)
                for k in ("user_api", "internal_api", "num_threads", "version", "filepath")
            }
            for p in threadpoolctl.threadpool_info()
        ]
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "memory_gib": None if mem_kib is None else round(mem_kib / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "toast": getattr(toast, "__version__", "unknown"),
        "toast_path": getattr(toast, "__file__", None),
        "torch_threads": torch.get_num_threads(),
        "env": {
            v: os.environ.get(v)
            for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
        },
        "threadpools": pools,
    }


def print_machine(info: dict[str, Any]) -> None:
    print(f"CPU: {info['cpu']} | cpu_count={info['cpu_count']} affinity={info['affinity']}")
    print(f"Memory: {info['memory_gib']} GiB | {info['platform']}")
    print(
        f"python {info['python']} | numpy {info['numpy']} | torch {info['torch']} "
        f"| toast {info['toast']} ({info['toast_path']})"
    )
    print(f"threads: torch={info['torch_threads']} env={info['env']}")
    for p in info["threadpools"]:
        name = Path(p["filepath"] or "?").name
        print(f"  pool {p['internal_api']} {p['version']} threads={p['num_threads']} ({name})")


# --------------------------------------------------------------------------
# (a) throughput
# --------------------------------------------------------------------------


def precision_options() -> list[str]:
    """Values of ``Moments(precision=...)`` that construct, or [] without the keyword."""
    try:
        params = inspect.signature(toast.Moments).parameters
        has_kw = "precision" in params
    except (TypeError, ValueError):  # C type without a text signature: probe it
        params, has_kw = {}, None
    if has_kw is False:
        return []
    accepted = []
    for value in PRECISION_CANDIDATES:
        try:
            toast.Moments(1, 2, precision=value)
        except TypeError as exc:
            if "precision" in str(exc) and "unexpected" in str(exc):
                return []
        except ValueError:
            continue
        else:
            accepted.append(value)
    default = params.get("precision").default if "precision" in params else None
    if isinstance(default, str) and default in accepted:  # default first
        accepted.remove(default)
        accepted.insert(0, default)
    return accepted


def moment_variants(cfg: Config, precisions: Sequence[str]) -> dict[str, Callable[[], Any]]:
    """Name -> factory of a fresh ``toast.Moments`` for the throughput table."""
    s, d = cfg.num_states, cfg.dim
    variants: dict[str, Callable[[], Any]] = {}
    if not precisions:
        variants["toast all"] = partial(toast.Moments, s, d, pairs="all")
    for p in precisions:
        variants[f"toast all [{p}]"] = partial(toast.Moments, s, d, pairs="all", precision=p)
    variants["toast consecutive"] = partial(toast.Moments, s, d, pairs="consecutive")
    return variants


def warm_up(cfg: Config, variants: dict[str, Callable[[], Any]]) -> None:
    """One small untimed call per method (thread pools, first-call costs)."""
    rng = np.random.default_rng(1)
    states = [rng.standard_normal((256, cfg.dim), dtype=np.float32) for _ in range(cfg.num_states)]
    for make in variants.values():
        make().update(states)
    x = np.concatenate(states, axis=1)
    _ = x.T @ x
    xt = torch.from_numpy(states[0])
    torch.linalg.lstsq(xt, torch.from_numpy(states[1]))


def bench_throughput(
    cfg: Config, synth: Synth, rows: int, variants: dict[str, Callable[[], Any]]
) -> dict[str, Any]:
    """Interleave, batch by batch, every toast variant and the NumPy syrk reference."""
    width = cfg.num_states * cfg.dim
    objs = {name: make() for name, make in variants.items()}
    seconds = dict.fromkeys([*objs, "numpy syrk"], 0.0)
    x = np.empty((cfg.batch_rows, width), np.float32)
    gram = np.zeros((width, width), np.float32)
    tmp = np.empty_like(gram)
    start = usage_start()
    for _, n in batches(synth, rows, f"(a) {rows} rows"):
        states = synth.states(n)
        for name, m in objs.items():
            seconds[name] += timed(partial(m.update, states))[1]
        xb = x[:n]
        np.concatenate([b[:n] for b in synth.buffers], axis=1, out=xb)  # untimed
        t0 = time.perf_counter()
        np.matmul(xb.T, xb, out=tmp)
        gram += tmp
        seconds["numpy syrk"] += time.perf_counter() - t0
    usage = usage_stop(start)  # includes the untimed data generation
    warn_load("(a) throughput", usage)
    result: dict[str, Any] = {
        "rows": rows,
        "usage": usage,
        "methods": {k: {"seconds": v, "rows_per_s": rows / v} for k, v in seconds.items()},
        "cross_check_rel_diff": cross_check(cfg, objs, gram),
    }
    for k, v in seconds.items():
        print(f"  [(a) {k}] {v:.1f} s = {rows / v:,.0f} rows/s", flush=True)
    first_all = next(k for k in objs if k.startswith("toast all"))
    result["ratio_ours_over_ref"] = seconds["numpy syrk"] / seconds[first_all]
    result["ratio_method"] = first_all
    return result


def cross_check(cfg: Config, objs: dict[str, Any], gram: np.ndarray) -> dict[str, float]:
    """Relative Frobenius difference of ``cross(0, S-1)`` / ``cross(0, 1)`` vs the syrk Gram."""
    d, last = cfg.dim, cfg.num_states - 1
    out = {}
    for name, m in objs.items():
        j = last if name.startswith("toast all") else 1
        ref = gram[:d, j * d : (j + 1) * d].astype(np.float64)
        got = np.asarray(m.cross(0, j), np.float64)
        out[name] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    return out


# --------------------------------------------------------------------------
# (b) error matrices
# --------------------------------------------------------------------------


def feed(m: Any, synth: Synth, rows: int, desc: str) -> float:
    """Update ``m`` with every batch; return the summed update time."""
    total = 0.0
    for _, n in batches(synth, rows, desc):
        total += timed(partial(m.update, synth.states(n)))[1]
    return total


def error_matrix(m: Any, estimator: str) -> tuple[np.ndarray, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return timed(partial(toast.error_matrix, m, metric="linear", estimator=estimator))


def run_ours(
    cfg: Config, synth: Synth, rows: int, folds: int, main: str, extra: Sequence[str]
) -> dict[str, Any]:
    """Moments + update + ``main`` estimator in one memory window; ``extra`` each in its own."""
    with PeakRSS() as mem:
        m, t_new = timed(partial(toast.Moments, cfg.num_states, cfg.dim, folds=folds, pairs="all"))
        t_update = t_new + feed(m, synth, rows, f"(b) toast folds={folds} {rows} rows")
        e_main, t_main = error_matrix(m, main)
    check_sampler(f"toast folds={folds}", mem)
    result: dict[str, Any] = {
        "folds": folds,
        "estimator": main,
        "update_s": t_update,
        "error_matrix_s": t_main,
        "total_s": t_update + t_main,
        "moments_nbytes_mib": m.nbytes / MIB,
        "E": e_main,
        **mem.as_dict(),
        "extra": {},
    }
    for est in extra:
        with PeakRSS() as mem_e:
            e, t = error_matrix(m, est)
        check_sampler(f"toast folds={folds} {est}", mem_e)
        result["extra"][est] = {"seconds": t, "E": e, **mem_e.as_dict()}
    del m
    release_memory()
    return result


def lstsq_errors(store: torch.Tensor, desc: str, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """The reference: ``lstsq`` + relative residual norm for every pair ``i < j``."""
    s = store.shape[0]
    e = np.full((s, s), np.nan)
    pairs = [(i, j) for i in range(s) for j in range(i + 1, s)]
    for i, j in progress(pairs, desc):
        xi, xj = store[i].to(dtype), store[j].to(dtype)
        w = torch.linalg.lstsq(xi, xj).solution
        e[i, j] = (torch.linalg.norm(xj - xi @ w) / torch.linalg.norm(xj)).item()
    return e


def run_reference(cfg: Config, synth: Synth, rows: int) -> dict[str, Any]:
    """Store every activation in a torch tensor, then lstsq for all pairs."""
    with PeakRSS() as mem:
        store, t_store = timed(
            partial(torch.empty, (cfg.num_states, rows, cfg.dim), dtype=torch.float32)
        )
        for start, n in batches(synth, rows, f"(b) reference store {rows} rows"):
            t0 = time.perf_counter()
            for s, buf in enumerate(synth.buffers):
                store[s, start : start + n].copy_(torch.from_numpy(buf[:n]))
            t_store += time.perf_counter() - t0
        e, t_solve = timed(partial(lstsq_errors, store, f"(b) reference lstsq {rows} rows"))
    check_sampler("reference", mem)
    result: dict[str, Any] = {
        "store_s": t_store,
        "lstsq_s": t_solve,
        "total_s": t_store + t_solve,
        "E": e,
        **mem.as_dict(),
    }
    if rows <= cfg.f64_check_max_rows:  # untimed: which side is closer to float64 truth?
        result["E_f64"] = lstsq_errors(store, f"(check) float64 lstsq {rows} rows", torch.float64)
    del store
    release_memory()
    return result


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    iu = np.triu_indices_from(a, k=1)
    return float(np.max(np.abs(a[iu] - b[iu])))


def bench_error_matrix(cfg: Config, synth: Synth, rows: int) -> dict[str, Any]:
    """Ours, reference, ours again; then cv(K) and the consistency checks."""
    runs = [run_ours(cfg, synth, rows, 0, "in_sample", ("gcv",))]
    ref = run_reference(cfg, synth, rows) if cfg.reference else None
    if cfg.repeat_ours:
        runs.append(run_ours(cfg, synth, rows, 0, "in_sample", ()))
    cv = run_ours(cfg, synth, rows, cfg.folds, "cv", ("in_sample",))
    e_ours = runs[0]["E"]
    ours_time = float(np.mean([r["total_s"] for r in runs]))
    ours_peak = max(r["peak_mib"] for r in runs)
    gcv = runs[0]["extra"]["gcv"]
    n_fit = rows - cfg.dim  # gcv with ridge=0 at full rank = in_sample / (1 - d / n)
    result: dict[str, Any] = {
        "rows": rows,
        "ours": [strip(r) for r in runs],
        "ours_time_s": ours_time,
        "ours_peak_mib": ours_peak,
        "cv": strip(cv),
        "checks": {
            "gcv_vs_in_sample_over_1_minus_d_over_n": max_abs_diff(gcv["E"], e_ours * rows / n_fit)
            if n_fit > 0
            else None,
            "in_sample_folds_vs_no_folds": max_abs_diff(cv["extra"]["in_sample"]["E"], e_ours),
            "ours_repeat_max_abs_diff": max_abs_diff(runs[-1]["E"], e_ours),
        },
        "E_ours": e_ours.tolist(),
    }
    if ref is not None:
        result["reference"] = strip(ref)
        result["E_reference"] = ref["E"].tolist()
        result["max_abs_diff"] = max_abs_diff(e_ours, ref["E"])
        result["time_ratio_ref_over_ours"] = ref["total_s"] / ours_time
        result["peak_ratio_ours_over_ref"] = ours_peak / max(ref["peak_mib"], 1e-9)
        if "E_f64" in ref:
            result["checks"]["ours_vs_f64_lstsq"] = max_abs_diff(e_ours, ref["E_f64"])
            result["checks"]["ref_f32_vs_f64_lstsq"] = max_abs_diff(ref["E"], ref["E_f64"])
    return result


def strip(run: dict[str, Any]) -> dict[str, Any]:
    """JSON-able copy of a run without the matrices."""
    out = {k: v for k, v in run.items() if not k.startswith("E")}
    if "extra" in out:
        out["extra"] = {k: strip(v) for k, v in out["extra"].items()}
    return out


# --------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".3g") -> str:
    return "n/a" if x is None or not np.isfinite(x) else format(x, spec)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def throughput_table(results: Sequence[dict[str, Any]]) -> str:
    methods = list(results[0]["throughput"]["methods"])
    header = ["rows", *(f"{m} rows/s" for m in methods), "ours/ref (target ≥ 0.8)"]
    body = []
    for r in results:
        t = r["throughput"]
        rate = [f"{t['methods'][m]['rows_per_s']:,.0f}" for m in methods]
        body.append(
            [f"{r['rows']:,}", *rate, f"{t['ratio_ours_over_ref']:.2f} ({t['ratio_method']})"]
        )
    return table(header, body)


def error_table(results: Sequence[dict[str, Any]]) -> str:
    header = [
        "rows",
        "toast s (update + in_sample)",
        "reference s (store + lstsq)",
        "ref/ours (target ≥ 2)",
        "toast peak MiB",
        "reference peak MiB",
        "ours/ref peak (target ≤ 0.25)",
        "max abs ΔE",
    ]
    body = []
    for r in results:
        e = r["error_matrix"]
        ref = e.get("reference", {})
        body.append(
            [
                f"{r['rows']:,}",
                f"{e['ours_time_s']:.2f}",
                fmt(ref.get("total_s"), ".2f"),
                fmt(e.get("time_ratio_ref_over_ours"), ".2f"),
                f"{e['ours_peak_mib']:.0f}",
                fmt(ref.get("peak_mib"), ".0f"),
                fmt(e.get("peak_ratio_ours_over_ref"), ".3f"),
                fmt(e.get("max_abs_diff"), ".2e"),
            ]
        )
    return table(header, body)


def info_table(results: Sequence[dict[str, Any]], folds: int) -> str:
    header = [
        "rows",
        "gcv s",
        f"cv K={folds} s (update + cv)",
        f"cv K={folds} peak MiB",
        f"Moments nbytes MiB (K=0 / K={folds})",
        "ref store s / lstsq s",
    ]
    body = []
    for r in results:
        e = r["error_matrix"]
        ours, cv, ref = e["ours"][0], e["cv"], e.get("reference", {})
        body.append(
            [
                f"{r['rows']:,}",
                f"{ours['extra']['gcv']['seconds']:.3f}",
                f"{cv['total_s']:.2f}",
                f"{cv['peak_mib']:.0f}",
                f"{ours['moments_nbytes_mib']:.0f} / {cv['moments_nbytes_mib']:.0f}",
                f"{fmt(ref.get('store_s'), '.2f')} / {fmt(ref.get('lstsq_s'), '.2f')}",
            ]
        )
    return table(header, body)


def checks_table(results: Sequence[dict[str, Any]]) -> str:
    keys = sorted({k for r in results for k in r["error_matrix"]["checks"]})
    header = ["rows", *keys, "moments rel diff vs syrk Gram", f"max load avg ({THREADS} cores)"]
    body = []
    for r in results:
        c = r["error_matrix"]["checks"]
        cross = max(r["throughput"]["cross_check_rel_diff"].values())
        load = max(u["loadavg_1m"] for u in phase_usages(r))
        body.append(
            [
                f"{r['rows']:,}",
                *(fmt(c.get(k), ".2e") for k in keys),
                fmt(cross, ".2e"),
                f"{load:.2f}",
            ]
        )
    return table(header, body)


# --------------------------------------------------------------------------
# (c) ReplaceMe least-squares statistics
# --------------------------------------------------------------------------


def ls_chunks(rows: int, dim: int, chunk: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """float32 chunks (M, Y, L) of a residual stream: L = Y + M T + noise."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.1, 3.0, dim)
    t = torch.randn(dim, dim, generator=gen) / dim**0.5
    out = []
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        m = torch.randn(n, dim, generator=gen) * scale
        y = torch.randn(n, dim, generator=gen)
        out.append((m, y, y + m @ t + 0.1 * torch.randn(n, dim, generator=gen)))
    return out


def ls_reference(chunks: Sequence[tuple[torch.Tensor, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """The plain torch loop: float64 MᵀM and Mᵀ(L − Y) per chunk."""
    d = chunks[0][0].shape[1]
    a = torch.zeros(d, d, dtype=torch.float64)
    b = torch.zeros(d, d, dtype=torch.float64)
    for m, y, lt in chunks:
        m64 = m.double()
        a += m64.T @ m64
        b += m64.T @ (lt.double() - y.double())
    return a.numpy(), b.numpy()


def ls_toast(chunks: Sequence[tuple[torch.Tensor, ...]], backend: str = "c", **options: Any) -> Any:
    """toast's statistics of the same chunks, as ReplaceMe feeds them: the
    target difference in float64, then both in the working type (C core, or
    ``backend="torch"``: :class:`TorchMoments` on the CPU)."""
    d = chunks[0][0].shape[1]
    if backend == "torch":
        mo = TorchMoments(2, d, pairs="all", **options)
    else:
        mo = toast.Moments(2, d, pairs="all", **options)
    work = torch.float32 if options.get("precision") == "mixed" else torch.float64
    for m, y, lt in chunks:
        mo.update([m.to(work), (lt.double() - y.double()).to(work)])
    return mo.to_moments() if backend == "torch" else mo


LS_VARIANTS: dict[str, dict[str, Any]] = {
    "toast float64": {"precision": "float64", "row_stats": False, "sources": 1},
    "toast mixed": {"precision": "mixed", "row_stats": False, "sources": 1},
    "toast float64, every block + row stats": {"precision": "float64"},
    "torch backend float64": {
        "backend": "torch",
        "precision": "float64",
        "row_stats": False,
        "sources": 1,
    },
}


def bench_ls_statistics(rows: int, dim: int, chunk: int, rounds: int, seed: int) -> dict[str, Any]:
    """Interleaved rounds of the torch float64 loop and toast's variants."""
    chunks = ls_chunks(rows, dim, chunk, seed)
    calls: dict[str, Callable[[], Any]] = {"torch float64 Gram loop": lambda: ls_reference(chunks)}
    for name, options in LS_VARIANTS.items():
        calls[name] = partial(ls_toast, chunks, **options)
    for call in calls.values():
        call()  # warm-up
    seconds: dict[str, list[float]] = {k: [] for k in calls}
    peaks: dict[str, float] = dict.fromkeys(calls, 0.0)
    start = usage_start()
    for _ in progress(range(rounds), "(c) LS statistics"):
        for name, call in calls.items():
            with PeakRSS() as mem:
                seconds[name].append(timed(call)[1])
            peaks[name] = max(peaks[name], mem.peak_mib)
    usage = usage_stop(start)
    warn_load("(c) LS statistics", usage)
    a, b = ls_reference(chunks)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    ref = med["torch float64 Gram loop"]
    methods = {}
    for name, sec in med.items():
        methods[name] = {"seconds": sec, "ratio_ref_over_ours": ref / sec, "peak_mib": peaks[name]}
        if name in LS_VARIANTS:
            mo = ls_toast(chunks, **LS_VARIANTS[name])
            methods[name]["gram_rel"] = float(
                np.linalg.norm(mo.cross(0, 0) - a) / np.linalg.norm(a)
            )
            methods[name]["cross_rel"] = float(
                np.linalg.norm(mo.cross(0, 1) - b) / np.linalg.norm(b)
            )
        print(f"  [(c) {name}] {sec:.3f} s, ref/ours {ref / sec:.2f}", flush=True)
    return {
        "rows": rows,
        "dim": dim,
        "chunk": chunk,
        "rounds": rounds,
        "usage": usage,
        "methods": methods,
    }


def ls_table(ls: dict[str, Any]) -> str:
    body = []
    for name, m in ls["methods"].items():
        errors = f"{m['gram_rel']:.1e} / {m['cross_rel']:.1e}" if "gram_rel" in m else "reference"
        body.append(
            [
                name,
                f"{m['seconds']:.3f}",
                f"{m['ratio_ref_over_ours']:.2f}",
                f"{m['peak_mib']:.0f}",
                errors,
            ]
        )
    header = ["method", "s (median)", "ref/ours", "peak MiB", "rel. error MᵀM / Mᵀ(L−Y)"]
    return table(header, body)


def phase_usages(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Every phase record of one size that carries a load average."""
    e = r["error_matrix"]
    runs = [*e["ours"], e["cv"], e.get("reference", {})]
    runs += [x for run in runs for x in run.get("extra", {}).values()]
    return [r["throughput"]["usage"], *(x for x in runs if "loadavg_1m" in x)]


def report(cfg: Config, results: Sequence[dict[str, Any]], ls: dict[str, Any] | None = None) -> str:
    s, d = cfg.num_states, cfg.dim
    parts = [
        (
            f"## (a) Moment accumulation throughput (S={s}, d={d}, float32, batches of "
            f"{cfg.batch_images}x{cfg.tokens} rows)"
        ),
        throughput_table(results),
        "## (b) All-pairs in-sample linear error matrix: time and peak RSS above baseline",
        error_table(results),
        "## For information",
        info_table(results, cfg.folds),
        "## Consistency checks (max abs differences; no assertions)",
        checks_table(results),
    ]
    if ls:
        parts += [
            (
                f"## (c) ReplaceMe least-squares statistics (width {ls['dim']}, {ls['rows']:,} "
                f"float32 rows in chunks of {ls['chunk']:,}; median of {ls['rounds']} "
                f"interleaved rounds; load {ls['usage']['loadavg_1m']:.2f})"
            ),
            ls_table(ls),
        ]
    return "\n\n".join(parts)


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--sizes", default="1000,20000,100000", help="rows per state, comma separated")
    p.add_argument("--rows", type=int, help="a single size (overrides --sizes)")
    p.add_argument("--quick", action="store_true", help="sizes 1000,10000 only")
    p.add_argument("--batch-images", type=int, default=64)
    p.add_argument("--tokens", type=int, default=197)
    p.add_argument("--states", type=int, default=13)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--folds", type=int, default=5, help="K for the cv estimator")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-reference", action="store_true", help="skip the torch lstsq reference")
    p.add_argument(
        "--no-repeat", action="store_true", help="run ours only once (before the reference)"
    )
    p.add_argument(
        "--f64-check-max-rows",
        type=int,
        default=10_000,
        help="untimed float64 lstsq accuracy check up to this many rows",
    )
    p.add_argument("--ls-rows", type=int, default=32_768, help="(c): rows (0 skips it)")
    p.add_argument("--ls-dim", type=int, default=576, help="(c): width")
    p.add_argument("--ls-rounds", type=int, default=7, help="(c): interleaved rounds")
    p.add_argument("--out", type=Path, default=OUT_DIR / "core.json")
    a = p.parse_args(argv)
    if a.rows is not None:
        sizes: tuple[int, ...] = (a.rows,)
    elif a.quick:
        sizes = (1000, 10_000)
    else:
        sizes = tuple(int(x) for x in a.sizes.split(",") if x.strip())
    return Config(
        sizes=sizes,
        num_states=a.states,
        dim=a.dim,
        batch_images=a.batch_images,
        tokens=a.tokens,
        folds=a.folds,
        seed=a.seed,
        reference=not a.no_reference,
        repeat_ours=not a.no_repeat,
        f64_check_max_rows=a.f64_check_max_rows,
        ls_rows=a.ls_rows,
        ls_dim=a.ls_dim,
        ls_rounds=a.ls_rounds,
        out=a.out,
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    configure_threads(THREADS)
    info = machine_info()
    print_machine(info)
    precisions = precision_options()
    print(f"toast.Moments precision options: {precisions or 'none (no precision= keyword)'}")
    variants = moment_variants(cfg, precisions)
    warm_up(cfg, variants)
    synth = Synth(cfg)
    results = []
    for rows in cfg.sizes:
        print(f"\n=== {rows:,} rows ===", flush=True)
        thr = bench_throughput(cfg, synth, rows, variants)
        release_memory()
        err = bench_error_matrix(cfg, synth, rows)
        results.append({"rows": rows, "throughput": thr, "error_matrix": err})
        print(f"  ours/ref throughput {thr['ratio_ours_over_ref']:.2f}", flush=True)
        if "max_abs_diff" in err:
            print(
                f"  error matrix: ref/ours time {err['time_ratio_ref_over_ours']:.2f}, "
                f"ours/ref peak {err['peak_ratio_ours_over_ref']:.3f}, "
                f"max abs diff {err['max_abs_diff']:.2e}",
                flush=True,
            )
        write_outputs(cfg, info, precisions, results)  # after every size: partial results survive
    ls = None
    if cfg.ls_rows:
        print(f"\n=== (c) LS statistics, {cfg.ls_rows:,} rows ===", flush=True)
        ls = bench_ls_statistics(cfg.ls_rows, cfg.ls_dim, cfg.ls_chunk, cfg.ls_rounds, cfg.seed)
        write_outputs(cfg, info, precisions, results, ls)
    print("\n" + report(cfg, results, ls))
    print(f"\nwrote {cfg.out} and {cfg.out.with_suffix('.md')}")
    return 0


def write_outputs(
    cfg: Config,
    info: dict[str, Any],
    precisions: list[str],
    results: list[dict[str, Any]],
    ls: dict[str, Any] | None = None,
) -> None:
    """Write the JSON (everything) and the Markdown tables."""
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": {**{k: v for k, v in vars(cfg).items() if k != "out"}, "sizes": list(cfg.sizes)},
        "machine": info,
        "precisions": precisions,
        "results": results,
        "ls_statistics": ls,
    }
    cfg.out.write_text(json.dumps(payload, indent=1, default=float))
    cfg.out.with_suffix(".md").write_text(report(cfg, results, ls) + "\n")


if __name__ == "__main__":
    sys.exit(main())
