#!/usr/bin/env python3
"""Atheris fuzz harness for toast's C core through its binding (toast._core).

Each input drives one short scenario:

* constructing Moments with random sizes, folds, pairs, precision, row
  statistics and sources, now and
  then absurd ones (overflowing products, INT_MAX states, negative values,
  wrong types), checked for consistency with ``Moments.estimate_nbytes``;
* updates with random shapes (2-D, 3-D, wrong ranks, zero-size dimensions),
  strides (slices, transposes, negative strides, broadcast zero strides,
  unaligned buffers, byte-swapped data), dtypes (float16/32/64, ints, bool,
  object, complex, strings; torch float/bfloat16/int/complex tensors, tensors
  that require grad; DLPack capsules from torch and numpy, and hand-made
  capsules with overflowing shapes, negative sizes, odd dtypes, non-CPU
  devices), NaN/Inf, masks and fold ids of wrong shapes, dtypes and values;
* then queries, error_matrix, fit_translator, fit_residual, solve_gram and the
  raw ``toast._core`` entry points with random (often invalid) arguments,
  pickling and merging;
* a second thread calling count, pickling, merging or updating the moments
  while error_matrix holds them and polls for signals under the GIL;
* the centers of ToaSt's head pruning (geometric_median, coordinate_median,
  dim_scores; raw and through toast.methods.heads.median) and its token channel
  selection (tcs_select, tcs_cls_attention) on random, huge, non-finite and
  badly shaped input, checking finite results, shapes and index ranges.

Failures (reported by libFuzzer with the input that caused them):

* a crash or sanitizer report (run with ``make fuzz-ci``: the extension is
  built with ASan+UBSan), or a hang (``-timeout``);
* any exception other than TypeError, ValueError, OverflowError and
  MemoryError, and any warning other than IllConditionedWarning and
  InSampleWarning (warnings are turned into errors);
* a broken invariant: a failing update must leave the moments unchanged; the
  row count must match the stored counts; pickling must round-trip exactly;
  construction must agree with estimate_nbytes; result shapes; a consumed
  DLPack capsule's deleter must run exactly once.

Only the harness and toast's Python code are coverage-instrumented (atheris
instruments Python bytecode; native edge coverage would need clang's
-fsanitize=fuzzer-no-link, and the build uses gcc). To let the fuzzer see
what the C code did, every call also reports its outcome (``ok`` or the
exception type and message with numbers removed, plus solver method and
rank) as an extra coverage feature, so inputs that reach a new error path or
solver branch in C are kept.

Usage: python fuzz/fuzz_core.py [libFuzzer flags] [corpus dirs]; see
scripts/fuzz.sh (``make fuzz-ci``, ``make fuzz-long``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import re
import sys
import threading
import warnings
import zlib

import atheris
import numpy as np
import torch

with atheris.instrument_imports(include=["toast"]):
    import toast
    from toast import _core
    from toast.core import IllConditionedWarning, InSampleWarning
    from toast.core.metrics import _ESTIMATOR_CODES, _METRIC_CODES
    from toast.methods.heads import median as toast_median

EXPECTED = (TypeError, ValueError, OverflowError, MemoryError)
# The private binding (toast._core) also passes on what a DLPack producer raises
# when asked to export: torch raises BufferError for tensors that require grad.
# (toast.Moments.update detaches tensors first, so the public API never does.)
EXPECTED_RAW_UPDATE = (*EXPECTED, BufferError)
FAILED = object()  # result of a call that raised an expected exception

# Everything must be small: each execution should take a few milliseconds.
MAX_NBYTES = 1 << 20  # moments built from fuzzed sizes (bigger ones: estimate only)

# ------------------------------------------------------------------ outcome features

_NCOUNTERS = 8192
_COUNTERS = [atheris._reserve_counter() for _ in range(_NCOUNTERS)]
_NUMBERS = re.compile(r"-?\d+(\.\d+)?(e[-+]?\d+)?|0x[0-9a-f]+", re.IGNORECASE)


def feature(*parts: object) -> None:
    """Marks an outcome as coverage, so inputs reaching new C paths are kept."""
    tag = "|".join(str(p) for p in parts)
    atheris._trace_branch(_COUNTERS[zlib.crc32(tag.encode()) % _NCOUNTERS])


def attempt(name: str, fn, *args, expected=EXPECTED, **kwargs):
    """Calls fn; expected exceptions give FAILED, anything else propagates."""
    try:
        result = fn(*args, **kwargs)
    except expected as exc:
        msg = _NUMBERS.sub("#", str(exc))[:64]
        feature(name, type(exc).__name__, msg)
        return FAILED
    feature(name, "ok")
    return result


@contextlib.contextmanager
def quiet():
    """For building inputs (casts of NaN to int etc.): no warnings."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------ values

SPECIAL = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    1e-310,
    5e-324,
    6e-8,
    1e-45,
    65504.0,
    65520.0,
    3.4e38,
    3.5e38,
    1e154,
    1e200,
    1.7e308,
    -1.7e308,
    float("nan"),
    float("inf"),
    float("-inf"),
]


def values(fdp, n: int) -> np.ndarray:
    mode = fdp.ConsumeIntInRange(0, 5)
    if mode <= 1:
        vals = fdp.ConsumeIntListInRange(n, -3, 3)
    elif mode == 2:
        vals = fdp.ConsumeFloatListInRange(n, -10.0, 10.0)
    elif mode == 3:
        vals = fdp.ConsumeRegularFloatList(n)
    elif mode == 4:
        vals = fdp.ConsumeFloatList(n)  # NaN, Inf, huge
    else:
        vals = [SPECIAL[fdp.ConsumeIntInRange(0, len(SPECIAL) - 1)] for _ in range(n)]
    out = np.zeros(n, dtype=np.float64)
    out[: len(vals)] = vals
    return out


def small_int(fdp, lo: int, hi: int, weird: list | None = None):
    """Mostly an int in [lo, hi]; sometimes a value from ``weird``."""
    if weird and fdp.ConsumeIntInRange(0, 15) == 0:
        return fdp.PickValueInList(weird)
    return fdp.ConsumeIntInRange(lo, hi)


WEIRD_INDEX = [2**31, -(2**31) - 1, 2**63, -1, True, 1.0, "0", None, np.int64(1), np.uint8(0)]

# ------------------------------------------------------------------ DLPack capsules

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_PyCapsule_GetName = ctypes.pythonapi.PyCapsule_GetName
_PyCapsule_GetName.restype = ctypes.c_char_p
_PyCapsule_GetName.argtypes = [ctypes.py_object]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]


class CraftedCapsule:
    """A hand-made "dltensor" capsule over a buffer this object keeps alive.

    Shapes are either backed by the buffer (strides within it) or so large
    that their element count overflows int64 (with zero strides): the
    binding must reject those before reading anything."""

    def __init__(self, buf: np.ndarray, shape, strides, code, bits, lanes, device, offset):
        self.buf = buf
        self.deleted = 0
        self.shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * len(strides))(*strides)
        self.mt = DLManagedTensor()
        t = self.mt.dl_tensor
        t.data = buf.ctypes.data
        t.device = DLDevice(device, 0)
        t.ndim = len(shape)
        t.dtype = DLDataType(code, bits, lanes)
        t.shape = self.shape
        t.strides = self.strides
        t.byte_offset = offset

        def deleter(_ptr):
            self.deleted += 1

        self.deleter = _DELETER(deleter)
        self.mt.deleter = self.deleter
        self.capsule = _PyCapsule_New(ctypes.addressof(self.mt), b"dltensor", None)

    def consumed(self) -> bool:
        return _PyCapsule_GetName(self.capsule) == b"used_dltensor"


def crafted_capsule(fdp, lead: tuple[int, ...], d: int, keep: list) -> object:
    kind = fdp.ConsumeIntInRange(0, 7)
    code, bits, lanes, device, offset = 2, 64, 1, 1, 0
    rows = int(np.prod(lead)) if lead else 1
    buf = np.zeros(max(rows * d, 1) + 8, dtype=np.float64)
    buf[: rows * d] = values(fdp, rows * d)
    shape: list[int] = [*lead, d]
    strides: list[int] | None = None
    if kind == 0:  # valid and compact, strides NULL, with a byte offset in the buffer
        offset = 8 * fdp.ConsumeIntInRange(0, 8)
    elif kind == 1:  # element count overflows int64 (zero strides: nothing is read)
        big = fdp.PickValueInList([2**62, 2**63 - 1, 2**40, 2**33, 2**31])
        shape = [big, fdp.PickValueInList([2**62, 2**40, 2**31, 2**24 + 1]), d]
        strides = [0, 0, fdp.PickValueInList([0, 1])]
        if big * shape[1] < 2**63:  # would be a huge valid array: make it overflow
            shape[1] = 2**62
    elif kind == 2:  # negative or zero sizes
        shape = [fdp.ConsumeIntInRange(-3, 0), *([d] if fdp.ConsumeBool() else [2, d])]
        if fdp.ConsumeBool():
            shape[-1] = fdp.ConsumeIntInRange(-2, 0)
        strides = [0] * len(shape)
    elif kind == 3:  # odd dtypes
        code = fdp.PickValueInList([0, 1, 2, 4, 5, 6, 7, 255])
        bits = fdp.PickValueInList([1, 8, 16, 32, 64, 128, 0, 255])
        lanes = fdp.PickValueInList([1, 1, 2, 0, 65535])
        strides = [0] * len(shape)
    elif kind == 4:  # not on the CPU
        device = fdp.PickValueInList([2, 3, 4, 7, 13, 0, -1])
    elif kind == 5:  # wrong number of dimensions (shape array sized to match)
        shape = [1] * fdp.PickValueInList([0, 1, 4, 5, 64])
        strides = [0] * len(shape)
    elif kind == 6:  # out-of-range strides
        strides = [fdp.PickValueInList([2**62, -(2**62), 2**61, 2**59 + 1])] * len(shape)
    else:  # valid with explicit element strides (row-major)
        strides = [int(np.prod(shape[q + 1 :])) for q in range(len(shape))]
    cap = CraftedCapsule(buf, shape, strides, code, bits, lanes, device, offset)
    keep.append(cap)
    return cap.capsule


# ------------------------------------------------------------------ states

NP_DTYPES = {
    "f8": np.float64,
    "f4": np.float32,
    "f2": np.float16,
    "i4": np.int32,
    "i8": np.int64,
    "u1": np.uint8,
    "b1": np.bool_,
    "c8": np.complex64,
    "c16": np.complex128,
    "O": object,
    ">f8": np.dtype(">f8"),
    ">f4": np.dtype(">f4"),
    "U3": np.dtype("U3"),
    "M8": np.dtype("datetime64[s]"),
}
TORCH_DTYPES = {
    "f8": torch.float64,
    "f4": torch.float32,
    "f2": torch.float16,
    "bf16": torch.bfloat16,
    "i4": torch.int32,
    "b1": torch.bool,
    "c8": torch.complex64,
    "f8e4": getattr(torch, "float8_e4m3fn", torch.float16),
}
FLOAT_CODES = ["f8", "f4", "f2", "bf16"]
LAYOUTS = ["c", "c", "T", "slice", "neg", "negcol", "bcast", "unaligned", "readonly", "offset"]
CONTAINERS = ["np", "np", "torch", "torch", "capsule", "crafted", "list", "scalar", "none"]


def state_spec(fdp) -> dict:
    if fdp.ConsumeIntInRange(0, 3):
        dtype = fdp.PickValueInList(FLOAT_CODES)
    else:
        dtype = fdp.PickValueInList(sorted(set(NP_DTYPES) | set(TORCH_DTYPES)))
    return {
        "dtype": dtype,
        "layout": fdp.PickValueInList(LAYOUTS),
        "container": fdp.PickValueInList(CONTAINERS),
        "grad": fdp.ConsumeIntInRange(0, 7) == 0,
    }


def numpy_layout(x: np.ndarray, layout: str) -> np.ndarray:
    if layout == "T":
        return np.asfortranarray(x)
    if layout == "slice":
        big = np.repeat(x, 2, axis=0)
        return big[::2]
    if layout == "neg":
        return np.ascontiguousarray(x[::-1])[::-1]
    if layout == "negcol":
        return np.ascontiguousarray(x[..., ::-1])[..., ::-1]
    if layout == "bcast" and x.shape[0] > 0:
        return np.broadcast_to(x[:1], x.shape)
    if layout == "unaligned" and x.dtype.kind in "fciub" and x.dtype.itemsize > 1:
        raw = bytearray(x.nbytes + 1)
        y = np.frombuffer(raw, dtype=x.dtype, count=x.size, offset=1).reshape(x.shape)
        y[...] = x
        return y
    if layout == "readonly":
        x = x.copy()
        x.setflags(write=False)
        return x
    if layout == "offset" and x.ndim >= 1:
        big = np.concatenate([x[:1], x]) if x.shape[0] else x
        return big[1:] if x.shape[0] else big
    return x


def torch_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "T" and t.ndim >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if layout == "slice" and t.ndim >= 1:
        return torch.repeat_interleave(t, 2, dim=0)[::2]
    if layout == "bcast" and t.ndim >= 1 and t.shape[0] > 0:
        return t[:1].expand(t.shape)
    if layout == "offset" and t.ndim >= 1 and t.shape[0] > 0:
        return torch.cat([t[:1], t])[1:]
    return t


def make_state(fdp, spec: dict, shape: tuple[int, ...], keep: list) -> object:
    container = spec["container"]
    if container == "none":
        return None
    if container == "scalar":
        return fdp.PickValueInList([1.0, 0, "x", b"y", float("nan"), [1.0], {}])
    n = int(np.prod(shape)) if shape else 1
    with quiet():
        x = values(fdp, n).reshape(shape)
        if container == "crafted":
            return crafted_capsule(fdp, shape[:-1], shape[-1] if shape else 0, keep)
        if container == "list":
            return x.tolist()
        if container in ("torch", "capsule") and spec["dtype"] in TORCH_DTYPES:
            t = torch.from_numpy(x.copy()).to(TORCH_DTYPES[spec["dtype"]])
            t = torch_layout(t, spec["layout"])
            if spec["grad"] and t.is_floating_point():
                t = t.detach().requires_grad_(True)
            if container == "capsule":
                try:
                    return t.detach().__dlpack__()
                except Exception:  # the producer refused: not toast's business
                    return t.detach()
            return t
        try:
            a = x.astype(NP_DTYPES.get(spec["dtype"], np.float32))
        except (TypeError, ValueError):  # e.g. float -> datetime64
            a = x
        a = numpy_layout(a, spec["layout"])
        if container == "capsule":
            try:
                return a.__dlpack__()
            except Exception:  # e.g. numpy refuses unaligned or read-only data
                return a
        return a


def leading_shape(fdp, nd: int) -> tuple[int, ...]:
    if nd == 3:
        return (small_int(fdp, 0, 3), small_int(fdp, 0, 3))
    rows = fdp.ConsumeIntInRange(0, 6) if fdp.ConsumeIntInRange(0, 7) else 0
    return (max(rows, 1),) if fdp.ConsumeIntInRange(0, 7) else (rows,)


def rows_arg(fdp, lead: tuple[int, ...], kind: str, folds: int):
    n = int(np.prod(lead))
    choice = fdp.ConsumeIntInRange(0, 11)
    if choice <= 3:
        return None
    with quiet():
        if kind == "mask":
            good = np.array(
                [fdp.ConsumeIntInRange(0, 3) > 0 for _ in range(n)], dtype=bool
            ).reshape(lead)
        else:
            good = np.array(
                [fdp.ConsumeIntInRange(0, max(folds, 2) - 1) for _ in range(n)], dtype=np.int64
            ).reshape(lead)
        if choice <= 6:
            return good
        if choice == 7:
            return good.reshape(-1)
        if choice == 8:
            return torch.from_numpy(good.copy())
        if choice == 9:
            return good.tolist()
        if choice == 10:  # wrong length or rank
            return np.resize(good, (n + fdp.ConsumeIntInRange(1, 2),))
        bad = fdp.ConsumeIntInRange(0, 6)
        if bad == 0:
            return good.astype(np.float64)
        if bad == 1:
            return good.astype(np.int8 if kind == "mask" else bool)
        if bad == 2:
            return np.full(lead, fdp.PickValueInList([2**63 - 1, -(2**63), -1, 2**31]))
        if bad == 3:
            return np.full(lead, 2**64 - 1, dtype=np.uint64)
        if bad == 4:
            return good.astype(object)
        if bad == 5:
            return fdp.PickValueInList([True, 3, "x", 1.5, b"\x01"])
        return np.broadcast_to(good.reshape(-1)[:1], lead) if n else good


# ------------------------------------------------------------------ moments

METRIC_NAMES = [*toast.core.METRICS, "bogus", "", None, 3]
ESTIMATORS = ["cv", "gcv", "in_sample", "loo", None]
KINDS = ["identity", "linear", "affine", "ridge", "diagonal", "orthogonal", "bogus", None]
RIDGES = [0.0, 0.0, 1e-3, 1.0, 1e-300, 1e300, -1.0, float("nan"), float("inf"), "x", None]
FOLDS = [0, 0, 2, 3, 5, 1, -1, True, 2.0]
PAIRS = ["all", "all", "consecutive", 1, 2, 3, 0, -1, "x", True, 1.5, None]
PRECISIONS = ["float64", "float64", "mixed", "half", 0, None]


class Target:
    """The moments under test and what the harness knows about them."""

    def __init__(self, m, raw: bool):
        self.m = m
        self.raw = raw  # a bare toast._core.Moments: only the _methods exist
        self.tampered = False  # storage replaced with arbitrary values

    @property
    def S(self) -> int:
        return self.m.num_states

    @property
    def d(self) -> int:
        return self.m.dim


SOURCES = [None, None, 1, 2, 3, 0, 9]


def make_moments(fdp) -> Target | None:
    S = small_int(fdp, 1, 4, [0, -1, 2**31, True, 2.5, "3"])
    d = small_int(fdp, 1, 6, [0, -1, 2**31, None])
    folds = fdp.PickValueInList(FOLDS)
    if fdp.ConsumeIntInRange(0, 5) == 0:
        span = small_int(fdp, -2, 4, [2**31, -(2**31)])
        prec = small_int(fdp, -1, 2)
        rowstats, sources = fdp.ConsumeBool(), small_int(fdp, -1, 5)
        m = attempt("raw_new", _core.Moments, S, d, folds, span, prec, rowstats, sources)
        raw = True
    else:
        pairs = fdp.PickValueInList(PAIRS)
        prec = fdp.PickValueInList(PRECISIONS)
        # what updates form: every block and row statistic, or fewer (reads
        # of what was not formed must raise, never return zeros)
        asked = {"row_stats": fdp.ConsumeBool(), "sources": fdp.PickValueInList(SOURCES)}
        m = attempt("new", toast.Moments, S, d, folds=folds, pairs=pairs, precision=prec, **asked)
        raw = False
    if m is FAILED:
        return None
    assert m.nbytes > 0 and m.rows == 0
    return Target(m, raw)


def check_update_outcome(t: Target, before, rows_before: int, failed: bool) -> None:
    m = t.m
    if failed:
        # A failing update leaves the moments unchanged.
        assert m.rows == rows_before, (m.rows, rows_before)
        assert np.array_equal(m._get_data(), before, equal_nan=True)
        return
    assert m.rows >= rows_before
    if not t.tampered:
        assert m._count() == m.rows, (m._count(), m.rows)
        if m.folds:
            total = sum(m._count(1, k) for k in range(m.folds))
            assert total == m.rows, (total, m.rows)


def do_update(fdp, t: Target, keep: list) -> None:
    S, d = t.S, t.d
    nd = fdp.PickValueInList([2, 2, 2, 3, 3, 1, 4])
    lead = leading_shape(fdp, 3 if nd == 3 else 2)
    if nd == 1:
        lead = ()
    elif nd == 4:
        lead = (*lead, 1)
    common = state_spec(fdp)
    nstates = S if fdp.ConsumeIntInRange(0, 15) else S + fdp.PickValueInList([-1, 1, 2])
    states = []
    for _ in range(max(nstates, 0)):
        spec = common if fdp.ConsumeIntInRange(0, 7) else state_spec(fdp)
        width = d if fdp.ConsumeIntInRange(0, 15) else fdp.PickValueInList([0, d + 1, d - 1])
        shape = (*lead, max(width, 0)) if nd != 1 else (max(width, 0),)
        if fdp.ConsumeIntInRange(0, 15) == 0 and len(lead) >= 1:  # another leading shape
            shape = (lead[0] + 1, *shape[1:])
        states.append(make_state(fdp, spec, shape, keep))
    seq = fdp.PickValueInList(["list", "list", "list", "tuple", "gen", "array", "dict"])
    if seq == "tuple":
        states = tuple(states)
    elif seq == "gen":
        states = iter(states)
    elif seq == "dict":
        states = dict(enumerate(states))
    elif seq == "array":
        with quiet():
            try:
                states = np.array(states, dtype=object)
            except Exception:
                states = tuple(states)
    mask = rows_arg(fdp, lead or (1,), "mask", 0)
    fold = rows_arg(fdp, lead or (1,), "fold", t.m.folds) if fdp.ConsumeBool() else None

    before, rows_before = t.m._get_data(), t.m.rows
    if t.raw or fdp.ConsumeIntInRange(0, 7) == 0:
        r = attempt("raw_update", t.m._update, states, mask, fold, expected=EXPECTED_RAW_UPDATE)
    else:
        r = attempt("update", t.m.update, states, mask=mask, fold=fold)
    feature("update", common["dtype"], common["layout"], common["container"], r is FAILED)
    check_update_outcome(t, before, rows_before, r is FAILED)
    # A capsule the binding consumed is deleted exactly once, the others never.
    for obj in keep:
        if isinstance(obj, CraftedCapsule):
            assert obj.deleted == (1 if obj.consumed() else 0), (obj.deleted, obj.consumed())


def pick_index(fdp, S: int):
    return small_int(fdp, -1, S, WEIRD_INDEX)


def pick_fold(fdp, folds: int):
    if fdp.ConsumeIntInRange(0, 2) == 0:
        return None
    return small_int(fdp, -1, max(folds, 1), WEIRD_INDEX)


def check_matrix(E, S: int) -> None:
    assert isinstance(E, np.ndarray) and E.shape == (S, S) and E.dtype == np.float64
    assert np.isnan(E[np.tril_indices(S)]).all()


def check_translator(tr, d: int) -> None:
    assert tr.weight.shape == (d, d) and tr.bias.shape == (d,), (tr.weight.shape, d)
    assert tr.method in ("none", "cholesky", "eigh", "svd"), tr.method
    assert 0 <= tr.rank <= d, tr.rank
    feature("translator", tr.kind, tr.method, tr.rank == d)


def query(fdp, t: Target) -> None:
    m, S, d = t.m, t.S, t.d
    op = fdp.ConsumeIntInRange(0, 13)
    if t.raw and op < 7:
        op += 7
    if op == 0:
        E = attempt(
            "error_matrix",
            toast.error_matrix,
            m,
            metric=fdp.PickValueInList(METRIC_NAMES),
            estimator=fdp.PickValueInList(ESTIMATORS),
            ridge=fdp.PickValueInList(RIDGES),
            ridge_relative=fdp.PickValueInList([False, True, 0, "yes"]),
        )
        if E is not FAILED:
            check_matrix(E, S)
    elif op == 1:
        kwargs = {}
        if fdp.ConsumeBool():
            kwargs["ridge"] = fdp.PickValueInList(RIDGES)
        if fdp.ConsumeBool():
            kwargs["center"] = fdp.PickValueInList([None, True, False, 1])
        if fdp.ConsumeBool():
            kwargs["exclude_fold"] = pick_fold(fdp, m.folds)
        kwargs["ridge_relative"] = fdp.ConsumeBool()
        tr = attempt(
            "fit_translator",
            toast.fit_translator,
            m,
            pick_index(fdp, S),
            pick_index(fdp, S),
            kind=fdp.PickValueInList(KINDS),
            **kwargs,
        )
        if tr is not FAILED:
            check_translator(tr, d)
    elif op == 2:
        tr = attempt(
            "fit_residual",
            toast.core.fit_residual,
            m,
            pick_index(fdp, S),
            pick_index(fdp, S),
            pick_index(fdp, S),
            ridge=fdp.PickValueInList(RIDGES),
            ridge_relative=fdp.ConsumeBool(),
            center=fdp.ConsumeBool(),
        )
        if tr is not FAILED:
            check_translator(tr, d)
    elif op == 3:
        f = pick_fold(fdp, m.folds)
        attempt("count", m.count, f)
        s = attempt("sum", m.sum, pick_index(fdp, S), f)
        if s is not FAILED:
            assert s.shape == (d,)
        c = attempt("cross", m.cross, pick_index(fdp, S), pick_index(fdp, S), f)
        if c is not FAILED:
            assert c.shape == (d, d)
        attempt("has_pair", m.has_pair, pick_index(fdp, S), pick_index(fdp, S))
        rows = attempt("fold_rows", lambda: m.fold_rows)
        if rows is not FAILED and not t.tampered:
            assert rows.shape == (m.folds,) and int(rows.sum()) == (m.rows if m.folds else 0)
    elif op == 4:
        m2 = attempt("pickle", lambda: pickle.loads(pickle.dumps(m)))
        if m2 is not FAILED:
            assert type(m2) is type(m) and m2.rows == m.rows
            assert np.array_equal(m2._get_data(), m._get_data(), equal_nan=True)
    elif op == 5:
        which = fdp.ConsumeIntInRange(0, 3)
        if which == 0:
            other = m
        elif which == 1:
            other = attempt(
                "merge_peer",
                toast.Moments,
                S,
                d,
                folds=m.folds,
                pairs=m.span if m.span else "all",
            )
        elif which == 2:
            other = attempt("merge_peer", toast.Moments, S + 1, d)
        else:
            other = fdp.PickValueInList([None, 1, "m", np.zeros(3)])
        if other is FAILED:
            return
        before, rows = m._get_data(), m.rows
        r = attempt("merge", m.merge, other)
        if r is FAILED:
            assert m.rows == rows and np.array_equal(m._get_data(), before, equal_nan=True)
        elif not t.tampered:
            assert m._count() == m.rows
    elif op == 6:
        m.release_workspace()
        assert m.nbytes == toast.Moments.estimate_nbytes(S, d, m.folds, m.span or "all")
    elif op in (7, 8):
        E = attempt(
            "raw_error_matrix",
            _core.error_matrix,
            m,
            small_int(fdp, -1, 8, [2**31, 2**40]),
            small_int(fdp, -1, 3, [2**31]),
            fdp.PickValueInList([0.0, 1e-6, -1.0, float("nan"), float("inf"), 1e300]),
            fdp.ConsumeBool(),
        )
        if E is not FAILED:
            check_matrix(E[0], S)
            assert E[1].shape == (S,)
    elif op == 9:
        r = attempt(
            "raw_fit",
            _core.fit,
            m,
            pick_index(fdp, S),
            pick_index(fdp, S),
            small_int(fdp, -1, 4, [2**31]),
            fdp.ConsumeBool(),
            fdp.PickValueInList([0.0, 1e-3, -1.0, float("nan"), float("inf"), 1e300]),
            fdp.ConsumeBool(),
            small_int(fdp, -1, 3, [2**31]),
            small_int(fdp, -1, max(m.folds, 1), [2**31]),
        )
        if r is not FAILED:
            assert r[0].shape == (d, d) and r[1].shape == (d,)
            feature("raw_fit_method", r[4], r[3] == d)
    elif op == 10:
        r = attempt(
            "raw_fit_residual",
            _core.fit_residual,
            m,
            pick_index(fdp, S),
            pick_index(fdp, S),
            pick_index(fdp, S),
            fdp.ConsumeBool(),
            fdp.PickValueInList([0.0, 1e-3, -1.0, float("nan"), 1e300]),
            fdp.ConsumeBool(),
        )
        if r is not FAILED:
            assert r[0].shape == (d, d) and r[1].shape == (d,)
    elif op == 11:
        sel = small_int(fdp, -1, 3, [2**31])
        k = small_int(fdp, -1, max(m.folds, 1), [2**31])
        attempt("raw_count", m._count, sel, k)
        attempt("raw_sums", m._sums, pick_index(fdp, S), sel, k)
        attempt("raw_cross", m._cross, pick_index(fdp, S), pick_index(fdp, S), sel, k)
    elif op == 12:
        # Arbitrary storage, as an unpickled or corrupted object would have.
        data = m._get_data()
        n = fdp.ConsumeIntInRange(0, 4)
        with quiet():
            for _ in range(n):
                if len(data):
                    data[fdp.ConsumeIntInRange(0, len(data) - 1)] = values(fdp, 1)[0]
        length = fdp.PickValueInList([len(data), len(data), len(data) + 1, 0])
        data = np.resize(data, length)
        rows = small_int(fdp, 0, 10, [-1, 2**63 - 1, 2**63])
        if attempt("set_data", m._set_data, data, rows) is not FAILED:
            t.tampered = True
    else:
        repr(m)
        attempt("estimate", toast.Moments.estimate_nbytes, S, d, m.folds, "all")


# ------------------------------------------------------------------ sizes

SIZES = [0, 1, 2, 3, -1, -(2**31), 2**31 - 1, 2**31, 2**32 + 1, 2**63, 46340, 46341]
SIZES += [65535, 65536, 10**6, 2**20, 2**24, 2**30, True, 2.0, "3", None]
BIG_FOLDS = [0, 2, 3, 1, -1, 2**31 - 1, 2**31, 10**6, 1.0, None]
BIG_PAIRS = ["all", "consecutive", 1, 2**31 - 1, 2**31, 2**40, -1, 0]


def fuzz_sizes(fdp) -> None:
    """Construction with absurd sizes must fail cleanly and agree with estimate_nbytes."""

    def size():
        return (
            fdp.PickValueInList(SIZES)
            if fdp.ConsumeBool()
            else fdp.ConsumeIntInRange(-5, 2**31 + 5)
        )

    S, d = size(), size()
    folds, pairs = fdp.PickValueInList(BIG_FOLDS), fdp.PickValueInList(BIG_PAIRS)
    nb = attempt("estimate", toast.Moments.estimate_nbytes, S, d, folds, pairs)
    span = small_int(fdp, -3, 3, [2**31 - 1, 2**31, -(2**31)])
    raw = attempt("raw_estimate", _core.estimate_nbytes, S, d, folds, span)
    if nb is FAILED:
        m = attempt("new_absurd", toast.Moments, S, d, folds=folds, pairs=pairs)
        assert m is FAILED, "estimate_nbytes failed but the constructor did not"
    else:
        assert isinstance(nb, int) and nb > 0
        feature("estimate_size", nb.bit_length())
        if nb <= MAX_NBYTES:
            m = attempt("new_sized", toast.Moments, S, d, folds=folds, pairs=pairs)
            assert m is not FAILED and m.nbytes == nb, (S, d, folds, pairs)
    if raw is FAILED:
        m = attempt("raw_new_absurd", _core.Moments, S, d, folds, span)
        assert m is FAILED, "raw estimate failed but the constructor did not"
    elif raw <= MAX_NBYTES:
        m = attempt("raw_new_sized", _core.Moments, S, d, folds, span)
        assert m is not FAILED and m.nbytes == raw


# ------------------------------------------------------------------ solve_gram


def gram_operand(fdp, shape: tuple[int, ...]):
    kind = fdp.ConsumeIntInRange(0, 9)
    n = int(np.prod(shape)) if shape else 1
    with quiet():
        x = values(fdp, n).reshape(shape)
        if kind <= 4:
            return x
        if kind == 5:
            return x.astype(fdp.PickValueInList([np.float32, np.float16, np.int64, bool]))
        if kind == 6:
            return x.astype(fdp.PickValueInList([np.complex128, object, ">f8", "U4"]))
        if kind == 7:
            return x.tolist()
        if kind == 8:
            return torch.from_numpy(x.copy())
        return fdp.PickValueInList([None, 1.0, "A", np.float64(2.0), [[1.0], [2.0, 3.0]]])


def fuzz_solve_gram(fdp) -> None:
    k = fdp.ConsumeIntInRange(0, 5)
    cols = fdp.ConsumeIntInRange(0, 4)
    shape_a = (k, k) if fdp.ConsumeIntInRange(0, 7) else (k, k + 1) if k else (k,)
    shape_b = (k, cols) if fdp.ConsumeIntInRange(0, 7) else fdp.PickValueInList([(k,), (k + 1, 1)])
    A = gram_operand(fdp, shape_a)
    if fdp.ConsumeBool() and isinstance(A, np.ndarray) and A.ndim == 2 and A.dtype == np.float64:
        with quiet():
            A = A.T @ A  # symmetric PSD (possibly singular, possibly overflowing)
            if fdp.ConsumeBool():
                A = A[::-1, ::-1]  # non-contiguous
    B = gram_operand(fdp, shape_b)
    ridge = fdp.PickValueInList(RIDGES)
    if fdp.ConsumeBool():
        r = attempt("solve_gram", toast.core.solve_gram, A, B, ridge)
        method_names = ("cholesky", "eigh")
    else:
        r = attempt("raw_solve_gram", _core.solve_gram, A, B, ridge)
        method_names = (1, 2)
    if r is not FAILED:
        W, cond, rank, method = r
        n = np.shape(A)[0]  # A may have been replaced by A.T @ A
        assert W.shape == (n, np.shape(B)[1]), (W.shape, np.shape(A), np.shape(B))
        assert method in method_names and 0 <= rank <= n, (method, rank)
        feature("solve_gram_result", method, rank == n, np.isfinite(cond))


# ------------------------------------------------------------------ centers


def fuzz_centers(fdp) -> None:
    """geometric_median / coordinate_median / dim_scores (public and raw)."""
    groups, n, p = (
        fdp.ConsumeIntInRange(0, 3),
        fdp.ConsumeIntInRange(0, 6),
        fdp.ConsumeIntInRange(0, 5),
    )
    shape = fdp.PickValueInList([(groups, n, p), (n, p), (n,), (groups, n, p, 1)])
    X = gram_operand(fdp, shape)
    kind = fdp.ConsumeIntInRange(-1, 5)
    tol = fdp.PickValueInList([1e-10, 0.0, 1e-3, -1.0, float("nan"), float("inf")])
    max_iter = fdp.PickValueInList([0, 1, 50, 200, -1])
    op = fdp.ConsumeIntInRange(0, 6)
    if op >= 5:
        fuzz_tcs(fdp, op == 5)
        return
    if op == 0:
        r = attempt("raw_dim_scores", _core.dim_scores, X, kind, tol, max_iter)
        if r is not FAILED:
            scores, iters, conv = r
            g, rows = np.shape(X)[0], np.shape(X)[1]
            assert scores.shape == (g, rows) and iters.shape == conv.shape == (g,)
            assert np.isfinite(scores).all() and (scores >= 0).all()
            assert ((0 <= iters) & (iters <= max_iter)).all()
            feature("dim_scores", kind, bool(conv.all()))
    elif op == 1:
        names = ("geomedian", "coord_median", "fpgm", "l1", "l2", "bogus")
        kw = {"tol": tol, "max_iter": max_iter, "warn": fdp.ConsumeBool()}
        r = attempt("dim_scores", toast_median.dim_scores, X, names[max(kind, 0)], **kw)
        if r is not FAILED:
            assert np.isfinite(r[0]).all()
    elif op == 2:
        w = gram_operand(fdp, (n,)) if fdp.ConsumeBool() else None
        r = attempt("raw_geometric_median", _core.geometric_median, X, w, tol, max_iter)
        if r is not FAILED:
            y, iters, conv, hits = r
            assert y.shape == (np.shape(X)[1],) and np.isfinite(y).all()
            assert 0 <= iters <= max_iter and hits >= 0
            feature("geometric_median", bool(conv), hits > 0)
    elif op == 3:
        r = attempt(
            "geometric_median", toast_median.geometric_median, X, tol=tol, max_iter=max_iter
        )
        if r is not FAILED:
            assert np.isfinite(r.point).all()
    else:
        r = attempt("raw_coordinate_median", _core.coordinate_median, X)
        if r is not FAILED:
            A = np.asarray(X, dtype=np.float64)
            assert all(r[c] in A[:, c] for c in range(A.shape[1]))


def fuzz_tcs(fdp, select: bool) -> None:
    """tcs_select / tcs_cls_attention with random shapes, dtypes and values."""
    B, N, C = (
        fdp.ConsumeIntInRange(0, 3),
        fdp.ConsumeIntInRange(0, 5),
        fdp.ConsumeIntInRange(0, 6),
    )
    with quiet():
        X = gram_operand(fdp, (B, N, C))
        if isinstance(X, np.ndarray) and X.dtype == np.float64 and fdp.ConsumeBool():
            X = X.astype(np.float32)
    if not select:
        heads = fdp.ConsumeIntInRange(-1, 3)
        with quiet():
            q = gram_operand(fdp, (B, C))
            if isinstance(q, np.ndarray) and q.dtype == np.float64 and fdp.ConsumeBool():
                q = q.astype(np.float32)
        scale = fdp.PickValueInList([1.0, 0.125, float("nan"), 1e300])
        r = attempt("tcs_cls_attention", _core.tcs_cls_attention, q, X, heads, scale)
        if r is not FAILED:
            assert r.shape == (B, N) and np.isfinite(r).all()
        return
    m = fdp.ConsumeIntInRange(0, 4)
    sample = [fdp.ConsumeIntInRange(-1, N) for _ in range(m)]
    attn = None
    if fdp.ConsumeBool():
        with quiet():
            attn = values(fdp, max(B * N, 0)).reshape(B, N).astype(np.float32)
    k = fdp.ConsumeIntInRange(-1, C + 1)
    cw = fdp.PickValueInList([0.0, 2.0, -1.0, float("nan")])
    batch = fdp.ConsumeBool()
    r = attempt("tcs_select", _core.tcs_select, X, sample, attn, k, cw, 1.0, batch)
    if r is not FAILED:
        assert r.shape == ((1 if batch else B), k)
        assert ((0 <= r) & (r < C)).all() and (np.diff(r, axis=1) > 0).all()
        feature("tcs_select", batch, attn is None)


# ------------------------------------------------------------------ threads


def _side_call(t: Target, side: str) -> None:
    """One call on the moments from the second thread."""
    m = t.m
    if side == "count":
        m.count()
    elif side == "pickle":
        pickle.loads(pickle.dumps(m))
    elif side == "merge":
        pickle.loads(pickle.dumps(m)).merge(m)
    else:
        m.update([np.zeros((2, t.d), np.float32) for _ in range(t.S)])


def fuzz_threads(fdp, t: Target) -> None:
    """error_matrix holds the moments' lock and takes the GIL at each signal
    poll; a call from another thread that waited for the lock with the GIL
    held would hang both (libFuzzer reports it through -timeout)."""
    if t.raw or t.m.rows == 0:
        return
    side = fdp.PickValueInList(["count", "pickle", "merge", "update"])
    metric = fdp.PickValueInList(sorted(_METRIC_CODES))
    estimator = fdp.PickValueInList(sorted(_ESTIMATOR_CODES))
    polled, errors = threading.Event(), []

    def second() -> None:
        polled.wait()
        try:
            _side_call(t, side)
        except EXPECTED:
            pass
        except BaseException as exc:  # re-raised in the fuzzing thread
            errors.append(exc)

    thread = threading.Thread(target=second)
    thread.start()
    codes = (_METRIC_CODES[metric], _ESTIMATOR_CODES[estimator])
    try:
        attempt("threaded_error_matrix", _core.error_matrix, t.m, *codes, 0.0, False, polled.set)
    finally:
        polled.set()  # a kernel that failed before its first poll
        thread.join()
    if errors:
        raise errors[0]
    feature("threads", side, metric, estimator)


# ------------------------------------------------------------------ entry point


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    op = fdp.ConsumeIntInRange(0, 15)
    if op == 0:
        fuzz_solve_gram(fdp)
        return
    if op == 1:
        fuzz_sizes(fdp)
        return
    if op == 2:
        fuzz_centers(fdp)
        return
    t = make_moments(fdp)
    if t is None:
        return
    keep: list = []
    for _ in range(fdp.ConsumeIntInRange(1, 3)):
        do_update(fdp, t, keep)
    if op == 3:
        fuzz_threads(fdp, t)
        return
    for _ in range(fdp.ConsumeIntInRange(0, 6)):
        query(fdp, t)


for _fn in (
    values,
    crafted_capsule,
    make_state,
    rows_arg,
    make_moments,
    check_update_outcome,
    do_update,
    query,
    fuzz_sizes,
    fuzz_solve_gram,
    fuzz_centers,
    fuzz_tcs,
    fuzz_threads,
    gram_operand,
    one_input,
):
    atheris.instrument_func(_fn)


def _check_build() -> None:
    """With TOAST_FUZZ_EXPECT set, refuse to fuzz any other build of toast._core."""
    want = os.environ.get("TOAST_FUZZ_EXPECT")
    got = os.path.realpath(_core.__file__)
    if want and not got.startswith(os.path.realpath(want)):
        raise SystemExit(f"fuzz: toast._core is {got}, expected a build under {want}")
    print(f"fuzz: testing {got}", file=sys.stderr)


def main() -> None:
    _check_build()
    # Warnings other than toast's own two are failures.
    warnings.simplefilter("error")
    warnings.simplefilter("ignore", IllConditionedWarning)
    warnings.simplefilter("ignore", InSampleWarning)
    warnings.simplefilter("ignore", toast_median.ConvergenceWarning)
    torch.set_num_threads(1)
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
