/*
 * _coremodule.c -- the CPython binding of the toast C core (toast._core).
 *
 * A thin layer: parse arguments, read NumPy arrays and DLPack tensors
 * (torch CPU tensors, bfloat16 included) in place, release the GIL around
 * kernels, and turn core error codes into Python exceptions. The friendly
 * API (argument names, defaults, validation messages) lives in
 * toast/core.py on top of this module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "toast_core.h"

/* ------------------------------------------------------------ DLPack ABI */

/* The stable DLPack C ABI (v0.x "dltensor" capsules). */
typedef struct {
    int32_t device_type;
    int32_t device_id;
} dl_device;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} dl_dtype;

typedef struct {
    void *data;
    dl_device device;
    int32_t ndim;
    dl_dtype dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} dl_tensor;

typedef struct dl_managed_tensor {
    dl_tensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed_tensor *self);
} dl_managed_tensor;

enum { DL_CPU = 1 };
enum { DL_FLOAT = 2, DL_BFLOAT = 4 };

/* ------------------------------------------------------------ errors */

/* toast._core.NonFiniteError(ValueError): the data holds NaN or Inf. Its
 * `state` attribute is the index of the failing entry of the states list
 * of Moments._update, or None where the failure is not about a state. */
static PyObject *NonFiniteError;

/* Raises NonFiniteError(msg) with .state = state (None when < 0). */
static PyObject *raise_non_finite(const char *msg, int state)
{
    PyObject *exc = PyObject_CallFunction(NonFiniteError, "s", msg);
    if (exc == NULL)
        return NULL;
    PyObject *value = state >= 0 ? PyLong_FromLong(state) : Py_NewRef(Py_None);
    if (value == NULL || PyObject_SetAttrString(exc, "state", value) < 0) {
        Py_XDECREF(value);
        Py_DECREF(exc);
        return NULL;
    }
    Py_DECREF(value);
    PyErr_SetObject(NonFiniteError, exc);
    Py_DECREF(exc);
    return NULL;
}

/* Turns a core error into an exception. state_arg: err->arg names a state
 * (Moments updates), reported as NonFiniteError.state. */
static PyObject *raise_error_of(const toast_error *err, int state_arg)
{
    PyObject *type;
    switch (err->code) {
    case TOAST_ENOMEM: type = PyExc_MemoryError; break;
    case TOAST_ETYPE: type = PyExc_TypeError; break;
    case TOAST_EOVERFLOW: type = PyExc_OverflowError; break;
    case TOAST_ELAPACK: type = PyExc_RuntimeError; break;
    case TOAST_ENONFINITE:
        return raise_non_finite(err->msg, state_arg ? err->arg : -1);
    default: type = PyExc_ValueError; break;
    }
    PyErr_SetString(type, err->msg);
    return NULL;
}

static PyObject *raise_core_error(const toast_error *err)
{
    return raise_error_of(err, 0);
}

/* ------------------------------------------------------------ Moments */

typedef struct {
    PyObject_HEAD
    toast_moments *m;
    PyThread_type_lock lock;
} MomentsObject;

static PyTypeObject Moments_Type;

static int moments_ready(MomentsObject *self)
{
    if (self->m == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "Moments object is not initialised");
        return 0;
    }
    return 1;
}

static PyObject *Moments_new(PyTypeObject *type, PyObject *args,
                             PyObject *kwds)
{
    (void)args;
    (void)kwds;
    MomentsObject *self = (MomentsObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static int Moments_init(MomentsObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"num_states", "dim",    "folds",
                             "span",       "precision", "rowstats",
                             "sources",    "diagonals", NULL};
    int S, d, folds = 0, span = -1, precision = 0, rowstats = 1, sources = 0;
    int diagonals = 0;
    toast_error err = {0};
    toast_moments *m = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ii|iiipip", kwlist, &S, &d,
                                     &folds, &span, &precision, &rowstats,
                                     &sources, &diagonals))
        return -1;
    if (self->m != NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "Moments object is already initialised");
        return -1;
    }
    if (toast_moments_new(S, d, folds, span, (toast_precision)precision, &m,
                          &err) != TOAST_OK ||
        toast_moments_restrict(m, rowstats, sources == 0 ? S : sources,
                               &err) != TOAST_OK ||
        (diagonals && toast_moments_keep_diagonals(m, &err) != TOAST_OK)) {
        toast_moments_free(m);
        raise_core_error(&err);
        return -1;
    }
    self->m = m;
    return 0;
}

/* Takes the object's lock from a thread that holds the GIL. Waiting for it
 * with the GIL held would deadlock against a kernel that holds the lock and
 * takes the GIL to poll for signals (error_matrix), so the GIL is released
 * before any wait, as CPython's _bz2module.c does. */
static void lock_holding_gil(MomentsObject *self)
{
    if (PyThread_acquire_lock(self->lock, NOWAIT_LOCK))
        return;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    Py_END_ALLOW_THREADS
}

static void Moments_dealloc(MomentsObject *self)
{
    toast_moments_free(self->m);
    if (self->lock != NULL)
        PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* --- reading one state without copying */

typedef struct {
    toast_view view;
    int ndim;          /* 2 or 3 */
    int64_t shape[3];
    PyObject *owner;   /* the array, or the DLPack capsule; owned */
    dl_managed_tensor *consumed; /* a capsule we consumed: we delete it */
} state_ref;

static int dtype_from_numpy(int typenum, toast_dtype *out)
{
    switch (typenum) {
    case NPY_HALF: *out = TOAST_FLOAT16; return 1;
    case NPY_FLOAT: *out = TOAST_FLOAT32; return 1;
    case NPY_DOUBLE: *out = TOAST_FLOAT64; return 1;
    default: return 0;
    }
}

static int dtype_from_dlpack(dl_dtype t, toast_dtype *out, int *itemsize)
{
    if (t.lanes != 1)
        return 0;
    if (t.code == DL_FLOAT && t.bits == 16)
        *out = TOAST_FLOAT16;
    else if (t.code == DL_FLOAT && t.bits == 32)
        *out = TOAST_FLOAT32;
    else if (t.code == DL_FLOAT && t.bits == 64)
        *out = TOAST_FLOAT64;
    else if (t.code == DL_BFLOAT && t.bits == 16)
        *out = TOAST_BFLOAT16;
    else
        return 0;
    *itemsize = t.bits / 8;
    return 1;
}

/* Fills view fields from a shape and byte strides (ndim 2 or 3). */
static void set_view_layout(state_ref *ref, const int64_t *strides)
{
    toast_view *v = &ref->view;
    if (ref->ndim == 2) {
        v->outer = ref->shape[0];
        v->inner = 1;
        v->outer_stride = strides[0];
        v->inner_stride = 0;
        v->col_stride = strides[1];
    } else {
        v->outer = ref->shape[0];
        v->inner = ref->shape[1];
        v->outer_stride = strides[0];
        v->inner_stride = strides[1];
        v->col_stride = strides[2];
    }
}

static int bad_ndim(const char *name, int k, int ndim)
{
    PyErr_Format(PyExc_ValueError,
                 "%s[%d] must have shape (rows, dim) or (batch, tokens, dim), "
                 "got %d dimension(s)", name, k, ndim);
    return 0;
}

static int state_from_numpy(PyObject *obj, int k, state_ref *ref)
{
    PyArrayObject *a = (PyArrayObject *)obj;
    int64_t strides[3];

    if (!dtype_from_numpy(PyArray_TYPE(a), &ref->view.dtype)) {
        PyObject *descr = PyObject_Str((PyObject *)PyArray_DESCR(a));
        PyErr_Format(PyExc_TypeError,
                     "states[%d] has dtype %S; expected float16, bfloat16, "
                     "float32 or float64", k, descr ? descr : Py_None);
        Py_XDECREF(descr);
        return 0;
    }
    if (!PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(PyExc_TypeError,
                     "states[%d] is not in native byte order", k);
        return 0;
    }
    ref->ndim = PyArray_NDIM(a);
    if (ref->ndim != 2 && ref->ndim != 3)
        return bad_ndim("states", k, ref->ndim);
    for (int q = 0; q < ref->ndim; q++) {
        ref->shape[q] = PyArray_DIM(a, q);
        strides[q] = PyArray_STRIDE(a, q);
    }
    ref->view.data = PyArray_DATA(a);
    set_view_layout(ref, strides);
    Py_INCREF(obj);
    ref->owner = obj;
    return 1;
}

/* Reads a "dltensor" capsule. A capsule produced by calling __dlpack__
 * stays unconsumed (releasing it runs the producer's deleter); a capsule the
 * caller passed in is consumed, as the protocol asks: renamed and deleted
 * by us when the update is done. */
static int state_from_capsule(PyObject *capsule, int k, int consume,
                              state_ref *ref)
{
    dl_managed_tensor *mt;
    int64_t strides[3];
    int itemsize = 0;

    if (!PyCapsule_IsValid(capsule, "dltensor")) {
        PyErr_Format(PyExc_TypeError,
                     "states[%d] is not an unused 'dltensor' DLPack capsule",
                     k);
        return 0;
    }
    mt = (dl_managed_tensor *)PyCapsule_GetPointer(capsule, "dltensor");
    Py_INCREF(capsule);
    ref->owner = capsule;
    if (consume) {
        if (PyCapsule_SetName(capsule, "used_dltensor") < 0)
            return 0;
        ref->consumed = mt;
    }
    const dl_tensor *t = &mt->dl_tensor;
    if (t->device.device_type != DL_CPU) {
        PyErr_Format(PyExc_ValueError,
                     "states[%d] is not on the CPU (DLPack device type %d); "
                     "move it to the CPU or accumulate with the torch backend",
                     k, (int)t->device.device_type);
        return 0;
    }
    if (!dtype_from_dlpack(t->dtype, &ref->view.dtype, &itemsize)) {
        PyErr_Format(PyExc_TypeError,
                     "states[%d] has DLPack dtype (code %d, %d bits); expected "
                     "float16, bfloat16, float32 or float64", k,
                     (int)t->dtype.code, (int)t->dtype.bits);
        return 0;
    }
    ref->ndim = t->ndim;
    if (ref->ndim != 2 && ref->ndim != 3)
        return bad_ndim("states", k, ref->ndim);
    int64_t compact = itemsize;
    for (int q = ref->ndim - 1; q >= 0; q--) {
        ref->shape[q] = t->shape[q];
        if (t->strides != NULL) {
            if (t->strides[q] > INT64_MAX / 16 || t->strides[q] < -INT64_MAX / 16) {
                PyErr_Format(PyExc_ValueError,
                             "states[%d] has an out-of-range stride", k);
                return 0;
            }
            strides[q] = t->strides[q] * itemsize;
        } else {
            strides[q] = compact;
        }
        if (t->shape[q] > 0 && compact > INT64_MAX / t->shape[q]) {
            PyErr_Format(PyExc_ValueError, "states[%d] is too large", k);
            return 0;
        }
        compact *= t->shape[q] > 0 ? t->shape[q] : 1;
    }
    ref->view.data = (const char *)t->data + t->byte_offset;
    set_view_layout(ref, strides);
    return 1;
}

static int state_from_dlpack(PyObject *obj, int k, state_ref *ref)
{
    PyObject *capsule = PyObject_CallMethod(obj, "__dlpack__", NULL);
    if (capsule == NULL)
        return 0;
    int ok = state_from_capsule(capsule, k, 0, ref);
    Py_DECREF(capsule);
    return ok;
}

static int get_state(PyObject *obj, int k, state_ref *ref)
{
    memset(ref, 0, sizeof *ref);
    if (PyArray_Check(obj))
        return state_from_numpy(obj, k, ref);
    if (PyCapsule_CheckExact(obj))
        return state_from_capsule(obj, k, 1, ref);
    if (PyObject_HasAttrString(obj, "__dlpack__"))
        return state_from_dlpack(obj, k, ref);
    PyErr_Format(PyExc_TypeError,
                 "states[%d] must be a NumPy array or a tensor supporting "
                 "DLPack (e.g. a torch CPU tensor) or a DLPack capsule, got %.100s", k,
                 Py_TYPE(obj)->tp_name);
    return 0;
}

static void release_states(state_ref *refs, int n)
{
    /* Deleters and capsule destructors may run Python code (numpy's and
     * ctypes-made ones do): never with the update's exception pending. */
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    for (int k = 0; k < n; k++) {
        if (refs[k].consumed != NULL && refs[k].consumed->deleter != NULL)
            refs[k].consumed->deleter(refs[k].consumed);
        refs[k].consumed = NULL;
        Py_CLEAR(refs[k].owner);
    }
    PyErr_Restore(type, value, traceback);
}

/* Checks that every state has width d and the leading shape of states[0]. */
static int check_state_shapes(const state_ref *refs, int S, int d)
{
    for (int k = 0; k < S; k++) {
        const state_ref *r = &refs[k];
        if (r->shape[r->ndim - 1] != d) {
            PyErr_Format(PyExc_ValueError,
                         "states[%d] has width %lld but the moments have "
                         "dim=%d", k, (long long)r->shape[r->ndim - 1], d);
            return 0;
        }
        int same = r->ndim == refs[0].ndim;
        for (int q = 0; same && q < r->ndim - 1; q++)
            same = r->shape[q] == refs[0].shape[q];
        if (!same) {
            PyErr_Format(PyExc_ValueError,
                         "states[%d] has a different leading shape than "
                         "states[0]", k);
            return 0;
        }
    }
    return 1;
}

/* A 1-D contiguous array of `typenum` with exactly `rows` entries. */
static PyArrayObject *row_array(PyObject *obj, int typenum, int64_t rows,
                                const char *name)
{
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(
        obj, typenum, 1, 1, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (a == NULL)
        return NULL;
    if (PyArray_DIM(a, 0) != rows) {
        PyErr_Format(PyExc_ValueError,
                     "%s has %lld entries but the states have %lld rows",
                     name, (long long)PyArray_DIM(a, 0), (long long)rows);
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

static PyObject *Moments_update(MomentsObject *self, PyObject *args)
{
    PyObject *states, *mask_obj = Py_None, *fold_obj = Py_None;
    PyArrayObject *mask = NULL, *fold = NULL;
    state_ref *refs = NULL;
    toast_view *views = NULL;
    toast_error err = {0};
    toast_status st = TOAST_OK;
    PyObject *result = NULL;
    int got = 0;

    if (!PyArg_ParseTuple(args, "O|OO", &states, &mask_obj, &fold_obj))
        return NULL;
    if (!moments_ready(self))
        return NULL;
    const int S = toast_moments_num_states(self->m);
    if (!PyList_Check(states) && !PyTuple_Check(states)) {
        PyErr_SetString(PyExc_TypeError,
                        "states must be a list or tuple of arrays");
        return NULL;
    }
    if (PySequence_Fast_GET_SIZE(states) != S) {
        PyErr_Format(PyExc_ValueError,
                     "expected %d states, got %zd", S,
                     PySequence_Fast_GET_SIZE(states));
        return NULL;
    }
    refs = PyMem_Calloc((size_t)S, sizeof *refs);
    views = PyMem_Calloc((size_t)S, sizeof *views);
    if (refs == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < S; got++) {
        if (!get_state(PySequence_Fast_GET_ITEM(states, got), got,
                       &refs[got])) {
            got++; /* release the partly filled reference too */
            goto done;
        }
        views[got] = refs[got].view;
    }
    if (!check_state_shapes(refs, S, toast_moments_dim(self->m)))
        goto done;
    int64_t rows = views[0].outer * views[0].inner;
    if (mask_obj != Py_None &&
        (mask = row_array(mask_obj, NPY_BOOL, rows, "mask")) == NULL)
        goto done;
    if (fold_obj != Py_None &&
        (fold = row_array(fold_obj, NPY_INT64, rows, "fold")) == NULL)
        goto done;
    const uint8_t *mask_data = mask ? (const uint8_t *)PyArray_DATA(mask)
                                    : NULL;
    const int64_t *fold_data = fold ? (const int64_t *)PyArray_DATA(fold)
                                    : NULL;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = toast_moments_update(self->m, views, mask_data, fold_data, &err);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (st != TOAST_OK) {
        raise_error_of(&err, 1);
        goto done;
    }
    result = Py_NewRef(self);
done:
    if (refs != NULL)
        release_states(refs, got);
    PyMem_Free(refs);
    PyMem_Free(views);
    Py_XDECREF(mask);
    Py_XDECREF(fold);
    return result;
}

static PyObject *Moments_release_workspace(MomentsObject *self,
                                           PyObject *unused)
{
    (void)unused;
    if (!moments_ready(self))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    toast_moments_release_workspace(self->m);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Moments_merge(MomentsObject *self, PyObject *other)
{
    toast_error err = {0};
    toast_status st;

    if (!PyObject_TypeCheck(other, &Moments_Type)) {
        PyErr_Format(PyExc_TypeError, "can only merge Moments, got %.100s",
                     Py_TYPE(other)->tp_name);
        return NULL;
    }
    MomentsObject *src = (MomentsObject *)other;
    if (!moments_ready(self) || !moments_ready(src))
        return NULL;
    /* Lock both in address order so that a.merge(b) and b.merge(a) in two
     * threads cannot deadlock; merging an object into itself doubles it. */
    PyThread_type_lock first = self->lock, second = src->lock;
    if ((uintptr_t)first > (uintptr_t)second) {
        first = src->lock;
        second = self->lock;
    }
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(first, WAIT_LOCK);
    if (second != first)
        PyThread_acquire_lock(second, WAIT_LOCK);
    st = toast_moments_merge(self->m, src->m, &err);
    if (second != first)
        PyThread_release_lock(second);
    PyThread_release_lock(first);
    Py_END_ALLOW_THREADS
    if (st != TOAST_OK)
        return raise_core_error(&err);
    return Py_NewRef(self);
}

static int parse_sets(const toast_moments *m, int sel, int k)
{
    if (sel < TOAST_SETS_ALL || sel > TOAST_SETS_EXCEPT) {
        PyErr_Format(PyExc_ValueError, "unknown fold selection %d", sel);
        return 0;
    }
    const int folds = toast_moments_folds(m);
    if (sel != TOAST_SETS_ALL && (folds == 0 || k < 0 || k >= folds)) {
        PyErr_Format(PyExc_ValueError,
                     "fold %d is out of range for moments with %d folds", k,
                     folds);
        return 0;
    }
    return 1;
}

static PyObject *Moments_count(MomentsObject *self, PyObject *args)
{
    int sel = 0, k = 0;
    if (!PyArg_ParseTuple(args, "|ii", &sel, &k) || !moments_ready(self) ||
        !parse_sets(self->m, sel, k))
        return NULL;
    lock_holding_gil(self);
    double n = toast_moments_count(self->m, (toast_sets)sel, k);
    PyThread_release_lock(self->lock);
    return PyLong_FromDouble(n);
}

static int check_index(const toast_moments *m, int i, const char *name)
{
    const int S = toast_moments_num_states(m);
    if (i < 0 || i >= S) {
        PyErr_Format(PyExc_ValueError,
                     "%s=%d is out of range for %d states", name, i, S);
        return 0;
    }
    return 1;
}

static PyObject *Moments_sums(MomentsObject *self, PyObject *args)
{
    int i, sel = 0, k = 0;
    if (!PyArg_ParseTuple(args, "i|ii", &i, &sel, &k) || !moments_ready(self) ||
        !check_index(self->m, i, "i") || !parse_sets(self->m, sel, k))
        return NULL;
    npy_intp dims[1] = {toast_moments_dim(self->m)};
    PyObject *out = PyArray_SimpleNew(1, dims, NPY_DOUBLE);
    if (out == NULL)
        return NULL;
    double *dst = PyArray_DATA((PyArrayObject *)out);
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    toast_moments_sums(self->m, (toast_sets)sel, k, i, dst);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    return out;
}

static PyObject *Moments_cross(MomentsObject *self, PyObject *args)
{
    int i, j, sel = 0, k = 0;
    toast_error err = {0};
    toast_status st;
    if (!PyArg_ParseTuple(args, "ii|ii", &i, &j, &sel, &k) ||
        !moments_ready(self) || !parse_sets(self->m, sel, k))
        return NULL;
    const int d = toast_moments_dim(self->m);
    npy_intp dims[2] = {d, d};
    PyObject *out = PyArray_SimpleNew(2, dims, NPY_DOUBLE);
    if (out == NULL)
        return NULL;
    double *dst = PyArray_DATA((PyArrayObject *)out);
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    st = toast_moments_cross(self->m, (toast_sets)sel, k, i, j, dst, &err);
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
    if (st != TOAST_OK) {
        Py_DECREF(out);
        return raise_core_error(&err);
    }
    return out;
}

static PyObject *Moments_has_pair(MomentsObject *self, PyObject *args)
{
    int i, j;
    if (!PyArg_ParseTuple(args, "ii", &i, &j) || !moments_ready(self))
        return NULL;
    int lo = i < j ? i : j, hi = i < j ? j : i;
    return PyBool_FromLong(toast_moments_pair(self->m, lo, hi) >= 0);
}

/* A copy of the whole storage as a flat float64 array (for pickling). */
static PyObject *Moments_get_data(MomentsObject *self, PyObject *unused)
{
    (void)unused;
    if (!moments_ready(self))
        return NULL;
    npy_intp dims[1] = {(npy_intp)toast_moments_storage_len(self->m)};
    PyObject *out = PyArray_SimpleNew(1, dims, NPY_DOUBLE);
    if (out == NULL)
        return NULL;
    lock_holding_gil(self);
    memcpy(PyArray_DATA((PyArrayObject *)out), toast_moments_data(self->m),
           (size_t)dims[0] * sizeof(double));
    PyThread_release_lock(self->lock);
    return out;
}

static PyObject *Moments_set_data(MomentsObject *self, PyObject *args)
{
    PyObject *obj;
    long long next_row;
    toast_error err = {0};
    if (!PyArg_ParseTuple(args, "OL", &obj, &next_row) || !moments_ready(self))
        return NULL;
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(
        obj, NPY_DOUBLE, 1, 1, NPY_ARRAY_IN_ARRAY);
    if (a == NULL)
        return NULL;
    lock_holding_gil(self);
    toast_status st = toast_moments_set_data(
        self->m, PyArray_DATA(a), (size_t)PyArray_DIM(a, 0),
        (int64_t)next_row, &err);
    PyThread_release_lock(self->lock);
    Py_DECREF(a);
    if (st != TOAST_OK)
        return raise_core_error(&err); /* ValueError */
    Py_RETURN_NONE;
}

#define MOMENTS_INT_GETTER(NAME, EXPR)                                     \
    static PyObject *Moments_get_##NAME(MomentsObject *self, void *c)      \
    {                                                                      \
        (void)c;                                                           \
        if (!moments_ready(self))                                          \
            return NULL;                                                   \
        return PyLong_FromLongLong((long long)(EXPR));                     \
    }

MOMENTS_INT_GETTER(num_states, toast_moments_num_states(self->m))
MOMENTS_INT_GETTER(dim, toast_moments_dim(self->m))
MOMENTS_INT_GETTER(folds, toast_moments_folds(self->m))
MOMENTS_INT_GETTER(span, toast_moments_span(self->m))
MOMENTS_INT_GETTER(precision_code, toast_moments_precision(self->m))
MOMENTS_INT_GETTER(rows, toast_moments_rows(self->m))
MOMENTS_INT_GETTER(rowstats, toast_moments_has_rowstats(self->m))
MOMENTS_INT_GETTER(sources, toast_moments_sources(self->m))
MOMENTS_INT_GETTER(diagonals, toast_moments_diagonals(self->m))

static PyObject *Moments_get_nbytes(MomentsObject *self, void *c)
{
    size_t n;
    (void)c;
    if (!moments_ready(self))
        return NULL;
    const toast_moments *m = self->m;
    toast_moments_nbytes(toast_moments_num_states(m), toast_moments_dim(m),
                         toast_moments_folds(m), toast_moments_span(m), &n,
                         NULL);
    return PyLong_FromSize_t(n);
}

/* --- the storage layout, from the core (Python never restates it) */

/* A tuple of n ints from size_t or int values. */
static PyObject *int_tuple(const size_t *sizes, const int *ints, int n)
{
    PyObject *t = PyTuple_New(n);
    for (int k = 0; t != NULL && k < n; k++) {
        PyObject *v = sizes != NULL ? PyLong_FromSize_t(sizes[k])
                                    : PyLong_FromLong(ints[k]);
        if (v == NULL)
            Py_CLEAR(t);
        else
            PyTuple_SET_ITEM(t, k, v);
    }
    return t;
}

/* The panel offsets and block counts of a layout as two tuples. */
static int panel_tuples(const toast_moments_layout *l, PyObject **offsets,
                        PyObject **blocks)
{
    const int S = l->num_states;
    size_t *off = PyMem_Malloc((size_t)S * sizeof *off);
    int *nb = PyMem_Malloc((size_t)S * sizeof *nb);
    *offsets = *blocks = NULL;
    if (off == NULL || nb == NULL) {
        PyErr_NoMemory();
    } else {
        toast_moments_panels(l, off, nb);
        *offsets = int_tuple(off, NULL, S);
        *blocks = *offsets == NULL ? NULL : int_tuple(NULL, nb, S);
        if (*blocks == NULL)
            Py_CLEAR(*offsets);
    }
    PyMem_Free(off);
    PyMem_Free(nb);
    return *blocks != NULL;
}

/* The layout as a dict (keys as in toast_moments_layout, plus rowstats,
 * storage_len, panel_offsets and panel_blocks). */
static PyObject *layout_dict(const toast_moments_layout *l)
{
    PyObject *offsets, *blocks;
    if (!panel_tuples(l, &offsets, &blocks))
        return NULL;
    return Py_BuildValue(
        "{sisisisisisisisnsnsnsnsnsnsNsN}", "num_states", l->num_states,
        "dim", l->dim, "folds", l->folds, "span", l->span, "nsets", l->nsets,
        "npairs", l->npairs, "rowstats", (int)TOAST_RS_COUNT, "set_len",
        (Py_ssize_t)l->set_len, "storage_len",
        (Py_ssize_t)(l->set_len * (size_t)l->nsets), "off_count",
        (Py_ssize_t)l->off_count, "off_sums", (Py_ssize_t)l->off_sums,
        "off_rowstats", (Py_ssize_t)l->off_rowstats, "off_blocks",
        (Py_ssize_t)l->off_blocks, "panel_offsets", offsets, "panel_blocks",
        blocks);
}

static PyObject *Moments_layout(MomentsObject *self, PyObject *unused)
{
    toast_moments_layout l;
    (void)unused;
    if (!moments_ready(self))
        return NULL;
    toast_moments_get_layout(self->m, &l);
    return layout_dict(&l);
}

static PyMethodDef Moments_methods[] = {
    {"_update", (PyCFunction)Moments_update, METH_VARARGS,
     "_update($self, states, mask=None, fold=None, /)\n--\n\n"
     "Add rows (GIL released). NaN or Inf raises NonFiniteError with "
     ".state the index of the failing entry of states."},
    {"release_workspace", (PyCFunction)Moments_release_workspace, METH_NOARGS,
     "release_workspace($self, /)\n--\n\n"
     "Free the scratch memory updates keep between batches (up to "
     "~100 MB); the next update allocates it again."},
    {"_merge", (PyCFunction)Moments_merge, METH_O,
     "_merge($self, other, /)\n--\n\n"
     "Add another Moments of the same shape in place."},
    {"_count", (PyCFunction)Moments_count, METH_VARARGS,
     "_count($self, sel=0, fold=0, /)\n--\n\n"
     "Rows in the selected folds (sel: SETS_ALL, SETS_ONLY, SETS_EXCEPT)."},
    {"_sums", (PyCFunction)Moments_sums, METH_VARARGS,
     "_sums($self, i, sel=0, fold=0, /)\n--\n\n"
     "(d,) column sums of state i."},
    {"_cross", (PyCFunction)Moments_cross, METH_VARARGS,
     "_cross($self, i, j, sel=0, fold=0, /)\n--\n\n"
     "(d, d) X_i^T X_j."},
    {"_has_pair", (PyCFunction)Moments_has_pair, METH_VARARGS,
     "_has_pair($self, i, j, /)\n--\n\n"
     "Whether the cross block of states i and j is kept."},
    {"_get_data", (PyCFunction)Moments_get_data, METH_NOARGS,
     "_get_data($self, /)\n--\n\n"
     "A copy of the flat float64 storage (see layout())."},
    {"_set_data", (PyCFunction)Moments_set_data, METH_VARARGS,
     "_set_data($self, data, next_row, /)\n--\n\n"
     "Replace the storage and the row counter (unpickling, reductions)."},
    {"layout", (PyCFunction)Moments_layout, METH_NOARGS,
     "layout($self, /)\n--\n\n"
     "Where each quantity lives in the storage, as a dict: see "
     "toast._core.moments_layout."},
    {NULL, NULL, 0, NULL}
};

static PyGetSetDef Moments_getset[] = {
    {"num_states", (getter)Moments_get_num_states, NULL, "number of states",
     NULL},
    {"dim", (getter)Moments_get_dim, NULL, "feature width d", NULL},
    {"folds", (getter)Moments_get_folds, NULL, "number of folds (0: none)",
     NULL},
    {"span", (getter)Moments_get_span, NULL,
     "largest j - i whose cross block is kept", NULL},
    {"_precision_code", (getter)Moments_get_precision_code, NULL, NULL, NULL},
    {"rows", (getter)Moments_get_rows, NULL, "number of accepted rows", NULL},
    {"_rowstats", (getter)Moments_get_rowstats, NULL,
     "1 when updates form the per-row pair statistics", NULL},
    {"_sources", (getter)Moments_get_sources, NULL,
     "states whose row panels updates form", NULL},
    {"_diagonals", (getter)Moments_get_diagonals, NULL,
     "1 when the diagonal blocks past the sources are formed", NULL},
    {"nbytes", (getter)Moments_get_nbytes, NULL,
     "bytes held by the moments", NULL},
    {NULL, NULL, NULL, NULL, NULL}
};

static PyTypeObject Moments_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "toast._core.Moments",
    .tp_basicsize = sizeof(MomentsObject),
    .tp_dealloc = (destructor)Moments_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Moments(num_states, dim, folds=0, span=-1, precision=0, "
              "rowstats=True, sources=0)\n"
              "--\n\n"
              "Streaming moments (C storage). Use toast.Moments.",
    .tp_methods = Moments_methods,
    .tp_getset = Moments_getset,
    .tp_init = (initproc)Moments_init,
    .tp_new = Moments_new,
};

/* ------------------------------------------------------------ functions */

static MomentsObject *as_moments(PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, &Moments_Type)) {
        PyErr_Format(PyExc_TypeError, "expected Moments, got %.100s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    MomentsObject *mo = (MomentsObject *)obj;
    return moments_ready(mo) ? mo : NULL;
}

static PyObject *core_estimate_nbytes(PyObject *mod, PyObject *args)
{
    int S, d, folds = 0, span = -1;
    size_t n;
    toast_error err = {0};
    (void)mod;
    if (!PyArg_ParseTuple(args, "ii|ii", &S, &d, &folds, &span))
        return NULL;
    if (toast_moments_nbytes(S, d, folds, span, &n, &err) != TOAST_OK)
        return raise_core_error(&err);
    return PyLong_FromSize_t(n);
}

static PyObject *core_moments_layout(PyObject *mod, PyObject *args)
{
    int S, d, folds = 0, span = -1;
    toast_moments_layout l;
    toast_error err = {0};
    (void)mod;
    if (!PyArg_ParseTuple(args, "ii|ii", &S, &d, &folds, &span))
        return NULL;
    if (toast_moments_layout_of(S, d, folds, span, &l, &err) != TOAST_OK)
        return raise_core_error(&err);
    return layout_dict(&l);
}

/* Poll function for long kernels run without the GIL: takes the GIL and
 * runs pending signal handlers (Ctrl-C raises KeyboardInterrupt there),
 * then the optional Python callable `extra` (tests use it to interrupt at
 * a chosen point). A raised exception stops the kernel and stays set for
 * the caller. */
static int poll_signals(void *extra)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int stop = PyErr_CheckSignals() < 0;
    if (!stop && extra != NULL) {
        PyObject *r = PyObject_CallNoArgs((PyObject *)extra);
        stop = r == NULL;
        Py_XDECREF(r);
    }
    PyGILState_Release(gil);
    return stop;
}

static PyObject *core_error_matrix(PyObject *mod, PyObject *args)
{
    PyObject *obj, *poll = NULL;
    int metric, est, ridge_rel = 0;
    double ridge = 0.0;
    toast_error err = {0};
    toast_status st;
    (void)mod;
    if (!PyArg_ParseTuple(args, "Oii|dpO", &obj, &metric, &est, &ridge,
                          &ridge_rel, &poll))
        return NULL;
    if (poll == Py_None)
        poll = NULL;
    if (poll != NULL && !PyCallable_Check(poll)) {
        PyErr_SetString(PyExc_TypeError, "poll must be callable or None");
        return NULL;
    }
    MomentsObject *mo = as_moments(obj);
    if (mo == NULL)
        return NULL;
    const int S = toast_moments_num_states(mo->m);
    npy_intp dims[2] = {S, S}, cdims[1] = {S};
    PyObject *E = PyArray_SimpleNew(2, dims, NPY_DOUBLE);
    PyObject *cond = PyArray_SimpleNew(1, cdims, NPY_DOUBLE);
    if (E == NULL || cond == NULL) {
        Py_XDECREF(E);
        Py_XDECREF(cond);
        return NULL;
    }
    double *e = PyArray_DATA((PyArrayObject *)E);
    double *c = PyArray_DATA((PyArrayObject *)cond);
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(mo->lock, WAIT_LOCK);
    st = toast_error_matrix_poll(mo->m, (toast_metric)metric,
                                 (toast_estimator)est, ridge, ridge_rel, e, c,
                                 poll_signals, poll, &err);
    PyThread_release_lock(mo->lock);
    Py_END_ALLOW_THREADS
    if (st != TOAST_OK) {
        Py_DECREF(E);
        Py_DECREF(cond);
        if (st == TOAST_EINTERRUPTED && PyErr_Occurred())
            return NULL; /* the signal handler's exception */
        return raise_core_error(&err);
    }
    return Py_BuildValue("(NN)", E, cond);
}

/* (W, b, condition, rank, method) */
static PyObject *fit_result(PyObject *W, PyObject *b,
                            const toast_solve_info *info)
{
    return Py_BuildValue("(NNdii)", W, b, info->condition, info->rank,
                         (int)info->method);
}

static int new_fit_arrays(int d, PyObject **W, PyObject **b)
{
    npy_intp wd[2] = {d, d}, bd[1] = {d};
    *W = PyArray_SimpleNew(2, wd, NPY_DOUBLE);
    *b = PyArray_SimpleNew(1, bd, NPY_DOUBLE);
    if (*W == NULL || *b == NULL) {
        Py_CLEAR(*W);
        Py_CLEAR(*b);
        return 0;
    }
    return 1;
}

/* Runs toast_fit (states idx[0] -> idx[1]) or, with `residual`,
 * toast_fit_residual (states idx[0], idx[1], idx[2]) with the GIL released;
 * returns (W, b, condition, rank, method). */
static PyObject *run_fit(PyObject *obj, const int idx[3], int residual,
                         const toast_fit_options *opt)
{
    PyObject *W, *b;
    toast_error err = {0};
    toast_solve_info info = {0};
    toast_status st;
    MomentsObject *mo = as_moments(obj);
    if (mo == NULL || !new_fit_arrays(toast_moments_dim(mo->m), &W, &b))
        return NULL;
    double *w = PyArray_DATA((PyArrayObject *)W);
    double *bias = PyArray_DATA((PyArrayObject *)b);
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(mo->lock, WAIT_LOCK);
    if (residual)
        st = toast_fit_residual(mo->m, idx[0], idx[1], idx[2], opt, w, bias,
                                &info, &err);
    else
        st = toast_fit(mo->m, idx[0], idx[1], opt, w, bias, &info, &err);
    PyThread_release_lock(mo->lock);
    Py_END_ALLOW_THREADS
    if (st != TOAST_OK) {
        Py_DECREF(W);
        Py_DECREF(b);
        return raise_core_error(&err);
    }
    return fit_result(W, b, &info);
}

static PyObject *core_fit(PyObject *mod, PyObject *args)
{
    PyObject *obj;
    int idx[3] = {0, 0, 0}, kind, center = 0, ridge_rel = 0, sel = 0, fold = 0;
    double ridge = 0.0;
    (void)mod;
    if (!PyArg_ParseTuple(args, "Oiii|pdpii", &obj, &idx[0], &idx[1], &kind,
                          &center, &ridge, &ridge_rel, &sel, &fold))
        return NULL;
    toast_fit_options opt = {(toast_fit_kind)kind, center, ridge, ridge_rel,
                             (toast_sets)sel, fold};
    return run_fit(obj, idx, 0, &opt);
}

static PyObject *core_fit_residual(PyObject *mod, PyObject *args)
{
    PyObject *obj;
    int idx[3], center = 0, ridge_rel = 0;
    double ridge = 0.0;
    (void)mod;
    if (!PyArg_ParseTuple(args, "Oiii|pdp", &obj, &idx[0], &idx[1], &idx[2],
                          &center, &ridge, &ridge_rel))
        return NULL;
    toast_fit_options opt = {TOAST_FIT_LEASTSQ, center, ridge, ridge_rel,
                             TOAST_SETS_ALL, 0};
    return run_fit(obj, idx, 1, &opt);
}

static PyObject *core_solve_gram(PyObject *mod, PyObject *args)
{
    PyObject *a_obj, *b_obj, *W = NULL, *result = NULL;
    PyArrayObject *A = NULL, *B = NULL;
    double ridge = 0.0;
    toast_error err = {0};
    toast_solve_info info = {0};
    toast_status st;
    (void)mod;
    if (!PyArg_ParseTuple(args, "OO|d", &a_obj, &b_obj, &ridge))
        return NULL;
    A = (PyArrayObject *)PyArray_FROMANY(a_obj, NPY_DOUBLE, 2, 2,
                                         NPY_ARRAY_IN_ARRAY);
    if (A == NULL)
        goto done;
    B = (PyArrayObject *)PyArray_FROMANY(b_obj, NPY_DOUBLE, 2, 2,
                                         NPY_ARRAY_IN_ARRAY);
    if (B == NULL)
        goto done;
    npy_intp d = PyArray_DIM(A, 0), m = PyArray_DIM(B, 1);
    if (PyArray_DIM(A, 1) != d || PyArray_DIM(B, 0) != d || d == 0 || m == 0 ||
        d > INT32_MAX || m > INT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "A must be square (d, d) and B (d, m) with d, m >= 1; got "
                     "A %lldx%lld and B %lldx%lld", (long long)PyArray_DIM(A, 0),
                     (long long)PyArray_DIM(A, 1), (long long)PyArray_DIM(B, 0),
                     (long long)PyArray_DIM(B, 1));
        goto done;
    }
    npy_intp wd[2] = {d, m};
    W = PyArray_SimpleNew(2, wd, NPY_DOUBLE);
    if (W == NULL)
        goto done;
    const double *a = PyArray_DATA(A), *bb = PyArray_DATA(B);
    double *w = PyArray_DATA((PyArrayObject *)W);
    Py_BEGIN_ALLOW_THREADS
    st = toast_solve_gram((int)d, a, bb, (int)m, ridge, w, &info, &err);
    Py_END_ALLOW_THREADS
    if (st != TOAST_OK) {
        raise_core_error(&err);
        goto done;
    }
    result = Py_BuildValue("(Odii)", W, info.condition, info.rank,
                           (int)info.method);
done:
    Py_XDECREF(A);
    Py_XDECREF(B);
    Py_XDECREF(W);
    return result;
}

/* ------------------------------------------------------------ centers */

/* Whether every dimension of a is in [1, 2^31 - 1] (the core's int sizes);
 * sets a ValueError naming the array otherwise. */
static int sizes_fit_int(PyArrayObject *a, const char *name)
{
    for (int q = 0; q < PyArray_NDIM(a); q++)
        if (PyArray_DIM(a, q) < 1 || PyArray_DIM(a, q) > INT32_MAX) {
            PyErr_Format(PyExc_ValueError,
                         "%s has a dimension of size %lld; every size must be "
                         "in [1, 2^31 - 1]", name,
                         (long long)PyArray_DIM(a, q));
            return 0;
        }
    return 1;
}

/* A C-contiguous float64 copy (or view) of obj with ndim in [lo, hi] and no
 * empty dimension; NULL with an exception set otherwise. Complex, object and
 * string input is refused (no safe cast to float64). */
static PyArrayObject *points_array(PyObject *obj, const char *name, int lo,
                                   int hi)
{
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(
        obj, NPY_DOUBLE, 0, 0, NPY_ARRAY_IN_ARRAY);
    if (a == NULL)
        return NULL;
    int nd = PyArray_NDIM(a);
    if (nd < lo || nd > hi) {
        PyErr_Format(PyExc_ValueError,
                     "%s must have %d to %d dimensions, got %d", name, lo, hi,
                     nd);
        Py_DECREF(a);
        return NULL;
    }
    if (!sizes_fit_int(a, name)) {
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

static PyObject *core_geometric_median(PyObject *mod, PyObject *args)
{
    PyObject *x_obj, *w_obj = Py_None, *y = NULL, *result = NULL;
    PyArrayObject *X = NULL, *Wt = NULL;
    double tol = TOAST_GM_TOL;
    int max_iter = TOAST_GM_MAX_ITER;
    toast_error err = {0};
    toast_gm_info info = {0, 0, 0};
    toast_status st;
    (void)mod;
    if (!PyArg_ParseTuple(args, "O|Odi", &x_obj, &w_obj, &tol, &max_iter))
        return NULL;
    X = points_array(x_obj, "X", 2, 2);
    if (X == NULL)
        goto done;
    npy_intp n = PyArray_DIM(X, 0), p = PyArray_DIM(X, 1);
    if (w_obj != Py_None) {
        Wt = points_array(w_obj, "weights", 1, 1);
        if (Wt == NULL)
            goto done;
        if (PyArray_DIM(Wt, 0) != n) {
            PyErr_Format(PyExc_ValueError,
                         "weights has %lld entries for %lld points",
                         (long long)PyArray_DIM(Wt, 0), (long long)n);
            goto done;
        }
    }
    y = PyArray_SimpleNew(1, &p, NPY_DOUBLE);
    if (y == NULL)
        goto done;
    const double *x = PyArray_DATA(X);
    const double *w = Wt == NULL ? NULL : PyArray_DATA(Wt);
    double *yd = PyArray_DATA((PyArrayObject *)y);
    Py_BEGIN_ALLOW_THREADS
    st = toast_geometric_median((int)n, (int)p, x, w, tol, max_iter, yd,
                                &info, &err);
    Py_END_ALLOW_THREADS
    if (st != TOAST_OK) {
        raise_core_error(&err);
        goto done;
    }
    result = Py_BuildValue("(Oiii)", y, info.iterations, info.converged,
                           info.hits);
done:
    Py_XDECREF(X);
    Py_XDECREF(Wt);
    Py_XDECREF(y);
    return result;
}

static PyObject *core_coordinate_median(PyObject *mod, PyObject *obj)
{
    PyObject *y = NULL;
    toast_error err = {0};
    toast_status st;
    (void)mod;
    PyArrayObject *X = points_array(obj, "X", 2, 2);
    if (X == NULL)
        return NULL;
    npy_intp n = PyArray_DIM(X, 0), p = PyArray_DIM(X, 1);
    y = PyArray_SimpleNew(1, &p, NPY_DOUBLE);
    if (y != NULL) {
        const double *x = PyArray_DATA(X);
        double *yd = PyArray_DATA((PyArrayObject *)y);
        Py_BEGIN_ALLOW_THREADS
        st = toast_coordinate_median((int)n, (int)p, x, yd, &err);
        Py_END_ALLOW_THREADS
        if (st != TOAST_OK) {
            raise_core_error(&err);
            Py_CLEAR(y);
        }
    }
    Py_DECREF(X);
    return y;
}

/* Runs the batch with the GIL released; infos copied into the two arrays. */
static toast_status run_dim_scores(int G, int n, int p, const double *x,
                                   int kind, double tol, int max_iter,
                                   double *scores, int32_t *iters,
                                   npy_bool *conv, toast_error *err)
{
    toast_gm_info *infos = malloc((size_t)G * sizeof *infos);
    if (infos == NULL)
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate %d iteration reports", G);
    toast_status st = toast_dim_scores_batch(G, n, p, x, (toast_dimscore)kind,
                                             tol, max_iter, scores, infos,
                                             err);
    for (int g = 0; st == TOAST_OK && g < G; g++) {
        iters[g] = infos[g].iterations;
        conv[g] = (npy_bool)(infos[g].converged != 0);
    }
    free(infos);
    return st;
}

static PyObject *core_dim_scores(PyObject *mod, PyObject *args)
{
    PyObject *x_obj, *scores = NULL, *iters = NULL, *conv = NULL;
    PyObject *result = NULL;
    int kind, max_iter = TOAST_GM_MAX_ITER;
    double tol = TOAST_GM_TOL;
    toast_error err = {0};
    toast_status st;
    (void)mod;
    if (!PyArg_ParseTuple(args, "Oi|di", &x_obj, &kind, &tol, &max_iter))
        return NULL;
    PyArrayObject *X = points_array(x_obj, "X", 3, 3);
    if (X == NULL)
        return NULL;
    npy_intp G = PyArray_DIM(X, 0), n = PyArray_DIM(X, 1),
             p = PyArray_DIM(X, 2);
    npy_intp sd[2] = {G, n};
    scores = PyArray_SimpleNew(2, sd, NPY_DOUBLE);
    iters = PyArray_SimpleNew(1, &G, NPY_INT32);
    conv = PyArray_SimpleNew(1, &G, NPY_BOOL);
    if (scores == NULL || iters == NULL || conv == NULL)
        goto done;
    const double *x = PyArray_DATA(X);
    double *sc = PyArray_DATA((PyArrayObject *)scores);
    int32_t *it = PyArray_DATA((PyArrayObject *)iters);
    npy_bool *cv = PyArray_DATA((PyArrayObject *)conv);
    Py_BEGIN_ALLOW_THREADS
    st = run_dim_scores((int)G, (int)n, (int)p, x, kind, tol, max_iter, sc,
                        it, cv, &err);
    Py_END_ALLOW_THREADS
    if (st != TOAST_OK) {
        raise_core_error(&err);
        goto done;
    }
    result = Py_BuildValue("(OOO)", scores, iters, conv);
done:
    Py_DECREF(X);
    Py_XDECREF(scores);
    Py_XDECREF(iters);
    Py_XDECREF(conv);
    return result;
}

/* ------------------------------------------------------------ TCS */

/* A C-contiguous float32 array of exactly nd dimensions, none empty, from
 * a float32 NumPy array only (no casts: activations come as float32). */
static PyArrayObject *float32_array(PyObject *obj, const char *name, int nd)
{
    if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != NPY_FLOAT) {
        PyErr_Format(PyExc_TypeError, "%s must be a float32 NumPy array, got %s",
                     name, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(
        obj, NPY_FLOAT, nd, nd, NPY_ARRAY_IN_ARRAY);
    if (a == NULL)
        return NULL;
    if (!sizes_fit_int(a, name)) {
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

static PyObject *core_tcs_cls_attention(PyObject *mod, PyObject *args)
{
    PyObject *q_obj, *k_obj, *out = NULL;
    PyArrayObject *Q = NULL, *K = NULL;
    int heads;
    double scale;
    toast_error err = {0};
    toast_status st;
    (void)mod;
    if (!PyArg_ParseTuple(args, "OOid", &q_obj, &k_obj, &heads, &scale))
        return NULL;
    Q = float32_array(q_obj, "q", 2);
    K = Q == NULL ? NULL : float32_array(k_obj, "K", 3);
    if (K == NULL)
        goto done;
    npy_intp B = PyArray_DIM(K, 0), N = PyArray_DIM(K, 1),
             W = PyArray_DIM(K, 2);
    if (heads < 1 || W % heads != 0 || PyArray_DIM(Q, 0) != B ||
        PyArray_DIM(Q, 1) != W) {
        PyErr_Format(PyExc_ValueError,
                     "need q (B, H*d) and K (B, N, H*d) with H = %d dividing "
                     "the width; got q %lldx%lld, K %lldx%lldx%lld", heads,
                     (long long)PyArray_DIM(Q, 0), (long long)PyArray_DIM(Q, 1),
                     (long long)B, (long long)N, (long long)W);
        goto done;
    }
    npy_intp od[2] = {B, N};
    out = PyArray_SimpleNew(2, od, NPY_FLOAT);
    if (out == NULL)
        goto done;
    const float *q = PyArray_DATA(Q), *kk = PyArray_DATA(K);
    float *o = PyArray_DATA((PyArrayObject *)out);
    Py_BEGIN_ALLOW_THREADS
    st = toast_tcs_cls_attention((int)B, (int)N, heads, (int)(W / heads), q,
                                 kk, scale, o, &err);
    Py_END_ALLOW_THREADS
    if (st != TOAST_OK) {
        raise_core_error(&err);
        Py_CLEAR(out);
    }
done:
    Py_XDECREF(Q);
    Py_XDECREF(K);
    return out;
}

static PyObject *core_tcs_select(PyObject *mod, PyObject *args)
{
    PyObject *x_obj, *s_obj, *a_obj, *out = NULL;
    PyArrayObject *X = NULL, *S = NULL, *A = NULL;
    int k, batch_scope;
    double cls_w, patch_w;
    toast_error err = {0};
    toast_status st;
    (void)mod;
    if (!PyArg_ParseTuple(args, "OOOiddp", &x_obj, &s_obj, &a_obj, &k, &cls_w,
                          &patch_w, &batch_scope))
        return NULL;
    X = float32_array(x_obj, "X", 3);
    if (X == NULL)
        goto done;
    S = (PyArrayObject *)PyArray_FROMANY(s_obj, NPY_INT64, 1, 1,
                                         NPY_ARRAY_IN_ARRAY);
    if (S == NULL)
        goto done;
    npy_intp B = PyArray_DIM(X, 0), N = PyArray_DIM(X, 1),
             C = PyArray_DIM(X, 2), m = PyArray_DIM(S, 0);
    if (m > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many sampled tokens");
        goto done;
    }
    if (a_obj != Py_None) {
        A = float32_array(a_obj, "attn", 2);
        if (A == NULL)
            goto done;
        if (PyArray_DIM(A, 0) != B || PyArray_DIM(A, 1) != N) {
            PyErr_Format(PyExc_ValueError,
                         "attn must have shape (%lld, %lld), got (%lld, %lld)",
                         (long long)B, (long long)N,
                         (long long)PyArray_DIM(A, 0),
                         (long long)PyArray_DIM(A, 1));
            goto done;
        }
    }
    npy_intp od[2] = {batch_scope ? 1 : B, k > 0 ? k : 0};
    out = PyArray_SimpleNew(2, od, NPY_INT64);
    if (out == NULL)
        goto done;
    toast_tcs_options opt = {cls_w, patch_w, batch_scope};
    const float *x = PyArray_DATA(X);
    const int64_t *smp = PyArray_DATA(S);
    const float *a = A == NULL ? NULL : PyArray_DATA(A);
    int64_t *o = PyArray_DATA((PyArrayObject *)out);
    Py_BEGIN_ALLOW_THREADS
    st = toast_tcs_select((int)B, (int)N, (int)C, x, (int)m, smp, a, &opt, k,
                          o, &err);
    Py_END_ALLOW_THREADS
    if (st != TOAST_OK) {
        raise_core_error(&err);
        Py_CLEAR(out);
    }
done:
    Py_XDECREF(X);
    Py_XDECREF(S);
    Py_XDECREF(A);
    return out;
}

static PyMethodDef core_methods[] = {
    {"estimate_nbytes", core_estimate_nbytes, METH_VARARGS,
     "estimate_nbytes($module, num_states, dim, folds=0, span=-1, /)\n--\n\n"
     "Bytes of storage moments of this shape would hold."},
    {"moments_layout", core_moments_layout, METH_VARARGS,
     "moments_layout($module, num_states, dim, folds=0, span=-1, /)\n--\n\n"
     "The storage layout of moments of this shape as a dict: num_states, "
     "dim, folds, span, nsets, npairs, rowstats (RS_COUNT), set_len and "
     "storage_len (doubles), off_count, off_sums, off_rowstats, off_blocks "
     "(offsets within a set), panel_offsets and panel_blocks (per state)."},
    {"error_matrix", core_error_matrix, METH_VARARGS,
     "error_matrix($module, m, metric, estimator, ridge=0.0, "
     "ridge_relative=False, poll=None, /)\n--\n\n"
     "(E, cond) for METRIC_* and EST_* codes. Checks for signals as it "
     "goes."},
    {"fit", core_fit, METH_VARARGS,
     "fit($module, m, i, j, kind, center=False, ridge=0.0, "
     "ridge_relative=False, sel=0, fold=0, /)\n--\n\n"
     "(W, b, condition, rank, method) for a FIT_* kind; method is a "
     "METHOD_* code."},
    {"fit_residual", core_fit_residual, METH_VARARGS,
     "fit_residual($module, m, mi, yi, li, center=False, ridge=0.0, "
     "ridge_relative=False, /)\n--\n\n"
     "(W, b, condition, rank, method): argmin_T ||M T + Y - L||."},
    {"solve_gram", core_solve_gram, METH_VARARGS,
     "solve_gram($module, A, B, ridge=0.0, /)\n--\n\n"
     "(W, condition, rank, method): (A + ridge I) W = B."},
    {"geometric_median", core_geometric_median, METH_VARARGS,
     "geometric_median($module, X, weights=None, tol=1e-10, max_iter=1000, "
     "/)\n--\n\n"
     "(y, iterations, converged, hits). Weiszfeld with Vardi-Zhang steps."},
    {"coordinate_median", core_coordinate_median, METH_O,
     "coordinate_median($module, X, /)\n--\n\n"
     "y, the lower median of every column."},
    {"dim_scores", core_dim_scores, METH_VARARGS,
     "dim_scores($module, X, kind, tol=1e-10, max_iter=1000, /)\n--\n\n"
     "(scores, iterations, converged) for X of shape (groups, n, p); kind: "
     "a DIMSCORE_* code."},
    {"tcs_cls_attention", core_tcs_cls_attention, METH_VARARGS,
     "tcs_cls_attention($module, q, K, heads, scale, /)\n--\n\n"
     "(B, N) float32: the CLS attention row averaged over heads, q (B, H*d), "
     "K (B, N, H*d)."},
    {"tcs_select", core_tcs_select, METH_VARARGS,
     "tcs_select($module, X, sample, attn, k, cls_weight, patch_weight, "
     "batch_scope, /)\n--\n\n"
     "(B or 1, k) int64 kept channels, ascending; X (B, N, C) float32, "
     "sample int64 token positions, attn (B, N) float32 or None."},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "toast._core",
    .m_doc = "C core of toast: moments, translators, error matrices, "
             "geometric medians and head-dimension scores.",
    .m_size = -1,
    .m_methods = core_methods,
};

/* The core's enums and limits, as module constants. */
static const struct {
    const char *name;
    long value;
} core_constants[] = {
    {"METRIC_LINEAR", TOAST_METRIC_LINEAR},
    {"METRIC_AFFINE", TOAST_METRIC_AFFINE},
    {"METRIC_MSE", TOAST_METRIC_MSE},
    {"METRIC_BR", TOAST_METRIC_BR},
    {"METRIC_COSINE", TOAST_METRIC_COSINE},
    {"METRIC_ANGULAR", TOAST_METRIC_ANGULAR},
    {"METRIC_EUCLIDEAN", TOAST_METRIC_EUCLIDEAN},
    {"METRIC_CKA", TOAST_METRIC_CKA},
    {"EST_IN_SAMPLE", TOAST_EST_IN_SAMPLE},
    {"EST_CV", TOAST_EST_CV},
    {"EST_GCV", TOAST_EST_GCV},
    {"PRECISION_FLOAT64", TOAST_PRECISION_FLOAT64},
    {"PRECISION_MIXED", TOAST_PRECISION_MIXED},
    {"FIT_IDENTITY", TOAST_FIT_IDENTITY},
    {"FIT_LEASTSQ", TOAST_FIT_LEASTSQ},
    {"FIT_DIAGONAL", TOAST_FIT_DIAGONAL},
    {"FIT_ORTHOGONAL", TOAST_FIT_ORTHOGONAL},
    {"METHOD_NONE", TOAST_METHOD_NONE},
    {"METHOD_CHOLESKY", TOAST_METHOD_CHOLESKY},
    {"METHOD_EIGH", TOAST_METHOD_EIGH},
    {"METHOD_SVD", TOAST_METHOD_SVD},
    {"SETS_ALL", TOAST_SETS_ALL},
    {"SETS_ONLY", TOAST_SETS_ONLY},
    {"SETS_EXCEPT", TOAST_SETS_EXCEPT},
    {"RS_COS", TOAST_RS_COS},
    {"RS_ANGLE", TOAST_RS_ANGLE},
    {"RS_DIST", TOAST_RS_DIST},
    {"RS_SQDIST", TOAST_RS_SQDIST},
    {"RS_COUNT", TOAST_RS_COUNT},
    {"DIMSCORE_GEOMEDIAN", TOAST_DIMSCORE_GEOMEDIAN},
    {"DIMSCORE_COORD_MEDIAN", TOAST_DIMSCORE_COORD_MEDIAN},
    {"DIMSCORE_FPGM", TOAST_DIMSCORE_FPGM},
    {"DIMSCORE_L1", TOAST_DIMSCORE_L1},
    {"DIMSCORE_L2", TOAST_DIMSCORE_L2},
    {"CHUNK_MAX_ROWS", TOAST_CHUNK_MAX_ROWS},
    {"GM_MAX_ITER", TOAST_GM_MAX_ITER},
};

static int add_float(PyObject *mod, const char *name, double value)
{
    PyObject *v = PyFloat_FromDouble(value);
    int ok = v != NULL && PyModule_AddObjectRef(mod, name, v) == 0;
    Py_XDECREF(v);
    return ok;
}

static int add_constants(PyObject *mod)
{
    const size_t n = sizeof core_constants / sizeof core_constants[0];
    for (size_t k = 0; k < n; k++)
        if (PyModule_AddIntConstant(mod, core_constants[k].name,
                                    core_constants[k].value) < 0)
            return 0;
    return add_float(mod, "GM_TOL", TOAST_GM_TOL) &&
           add_float(mod, "CHOL_MIN_RCOND", TOAST_CHOL_MIN_RCOND);
}

/* NonFiniteError, a ValueError whose instances carry `state`. */
static int add_non_finite_error(PyObject *mod)
{
    PyObject *dict = Py_BuildValue("{sO}", "state", Py_None);
    if (dict == NULL)
        return 0;
    NonFiniteError = PyErr_NewExceptionWithDoc(
        "toast._core.NonFiniteError",
        "The data holds NaN or Inf. `state`: the index of the failing entry "
        "of the states passed to an update, or None.",
        PyExc_ValueError, dict);
    Py_DECREF(dict);
    return NonFiniteError != NULL &&
           PyModule_AddObjectRef(mod, "NonFiniteError", NonFiniteError) == 0;
}

PyMODINIT_FUNC PyInit__core(void)
{
    import_array();
    if (PyType_Ready(&Moments_Type) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&core_module);
    if (mod == NULL)
        return NULL;
    if (PyModule_AddObjectRef(mod, "Moments", (PyObject *)&Moments_Type) < 0 ||
        !add_constants(mod) || !add_non_finite_error(mod)) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
