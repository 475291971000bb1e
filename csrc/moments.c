/*
 * moments.c -- streaming first and second moments of S layer states.
 *
 * An update converts its rows chunk by chunk into packed row-major buffers
 * (one per state, rows grouped by fold), then adds, per fold: the row
 * count, the column sums, per-row pair statistics, and the cross blocks
 * X_i^T X_j with one BLAS call per kept pair (dsyrk on the diagonal).
 */
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "toast_blas.h"
#include "toast_core.h"

/* Workspace target for one chunk of converted rows. */
#define CHUNK_BYTES ((size_t)96 << 20)
#define CHUNK_MIN_ROWS 64
/* Bytes between the values touch_pages writes: the smallest page size. */
#define TOUCH_STRIDE ((size_t)4096)

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

/* The opaque moments (see toast_core.h for the storage layout). */
struct toast_moments {
    toast_moments_layout lay;
    toast_precision precision;
    int *pair_index;   /* S*S; block index of (i, j), i <= j, or -1 */
    int *panel_blocks; /* S: blocks in the row panel of state i */
    size_t *panel_off; /* S: offset of that panel within a set */
    double *data;      /* nsets * set_len */
    int rowstats;      /* 1: updates form the per-row pair statistics */
    int sources;       /* updates form the panels of states < sources */
    int diagonals;     /* 1: and the diagonal blocks of states >= sources */
    int64_t next_row;  /* rows accepted so far: row id of the next row */
    void *workspace;   /* update scratch kept between updates, or NULL */
    int touched;       /* 1: the storage updates write is resident */
};

/* ------------------------------------------------------------ sizes */

static int mul_size(size_t a, size_t b, size_t *out)
{
    if (a != 0 && b > SIZE_MAX / a)
        return 0;
    *out = a * b;
    return 1;
}

static int add_size(size_t a, size_t b, size_t *out)
{
    if (b > SIZE_MAX - a)
        return 0;
    *out = a + b;
    return 1;
}

/* Kept pairs (i, j), i <= j, j - i <= span (0 <= span <= S - 1), in closed
 * form: sum over i of min(span, S-1-i) + 1. -1 when it exceeds INT_MAX
 * (counting them one by one took O(S * span) steps for absurd S). */
static int count_pairs(int S, int span)
{
    const int64_t s = span;
    const int64_t n = (int64_t)S * (s + 1) - s * (s + 1) / 2;
    return n > INT_MAX ? -1 : (int)n;
}

/* Doubles in one set: count, sums, row statistics, blocks. */
static int set_length(int S, int d, int npairs, size_t *len)
{
    size_t sd, ss, dd, blocks, total;
    if (!mul_size((size_t)S, (size_t)d, &sd) ||
        !mul_size((size_t)S, (size_t)S * TOAST_RS_COUNT, &ss) ||
        !mul_size((size_t)d, (size_t)d, &dd) ||
        !mul_size(dd, (size_t)npairs, &blocks) ||
        !add_size(1, sd, &total) || !add_size(total, ss, &total) ||
        !add_size(total, blocks, &total))
        return 0;
    *len = total;
    return 1;
}

static toast_status check_shape(int S, int d, int folds, int *span,
                                toast_error *err)
{
    if (S < 1)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "num_states must be >= 1, got %d", S);
    if (d < 1)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "dim must be >= 1, got %d", d);
    if (folds == 1 || folds < 0)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "folds must be 0 or >= 2, got %d", folds);
    if ((int64_t)S * d > INT32_MAX)
        return toast_set_error(err, TOAST_EOVERFLOW, -1,
                               "num_states * dim = %lld exceeds the BLAS "
                               "index range", (long long)S * d);
    if (*span < 0 || *span > S - 1)
        *span = S - 1;
    return TOAST_OK;
}

static toast_status too_large(int S, int d, int folds, toast_error *err)
{
    return toast_set_error(err, TOAST_EOVERFLOW, -1,
                           "moments of %d states x %d features with %d "
                           "folds do not fit in memory addresses", S, d,
                           folds);
}

toast_status toast_moments_layout_of(int S, int d, int folds, int span,
                                     toast_moments_layout *out,
                                     toast_error *err)
{
    toast_moments_layout l;
    toast_status st = check_shape(S, d, folds, &span, err);
    if (st != TOAST_OK)
        return st;
    l.num_states = S;
    l.dim = d;
    l.folds = folds;
    l.span = span;
    l.nsets = folds > 0 ? folds : 1;
    l.npairs = count_pairs(S, span);
    if (l.npairs < 0 || !set_length(S, d, l.npairs, &l.set_len))
        return too_large(S, d, folds, err);
    /* set_length proved that these offsets do not overflow */
    l.off_count = 0;
    l.off_sums = 1;
    l.off_rowstats = l.off_sums + (size_t)S * d;
    l.off_blocks = l.off_rowstats + (size_t)TOAST_RS_COUNT * S * S;
    *out = l;
    return TOAST_OK;
}

void toast_moments_panels(const toast_moments_layout *layout, size_t *offsets,
                          int *blocks)
{
    const int S = layout->num_states, span = layout->span;
    const size_t dd = (size_t)layout->dim * layout->dim;
    size_t off = layout->off_blocks;
    for (int i = 0; i < S; i++) {
        blocks[i] = (span < S - 1 - i ? span : S - 1 - i) + 1;
        offsets[i] = off;
        off += (size_t)blocks[i] * dd;
    }
}

/* Bytes of the pair index and panel tables of S states. */
static int index_bytes(int S, size_t *out)
{
    size_t n;
    return mul_size((size_t)S * (size_t)S + (size_t)S, sizeof(int), &n) &&
           add_size(n, (size_t)S * sizeof(size_t), out);
}

toast_status toast_moments_nbytes(int S, int d, int folds, int span,
                                  size_t *out, toast_error *err)
{
    toast_moments_layout l;
    size_t len, data_bytes, index, total;
    toast_status st = toast_moments_layout_of(S, d, folds, span, &l, err);
    if (st != TOAST_OK)
        return st;
    if (!mul_size(l.set_len, (size_t)l.nsets, &len) ||
        !mul_size(len, sizeof(double), &data_bytes) ||
        !index_bytes(S, &index) ||
        !add_size(data_bytes, index, &total) ||
        !add_size(total, sizeof(toast_moments), &total))
        return too_large(S, d, folds, err);
    *out = total;
    return TOAST_OK;
}

/* ------------------------------------------------------------ lifetime */

/* Allocates the tables and the zeroed storage of m (layout set). */
static int moments_alloc(toast_moments *m)
{
    const int S = m->lay.num_states;
    m->pair_index = malloc((size_t)S * S * sizeof(int));
    m->panel_blocks = malloc((size_t)S * sizeof(int));
    m->panel_off = malloc((size_t)S * sizeof(size_t));
    /* the product was checked by toast_moments_nbytes */
    m->data = calloc(m->lay.set_len * (size_t)m->lay.nsets, sizeof(double));
    return m->pair_index != NULL && m->panel_blocks != NULL &&
           m->panel_off != NULL && m->data != NULL;
}

static void fill_pair_index(toast_moments *m)
{
    const int S = m->lay.num_states, span = m->lay.span;
    int p = 0;
    for (int i = 0; i < S; i++)
        for (int j = 0; j < S; j++)
            m->pair_index[i * S + j] = (j >= i && j - i <= span) ? p++ : -1;
}

toast_status toast_moments_new(int S, int d, int folds, int span,
                               toast_precision precision,
                               toast_moments **out, toast_error *err)
{
    size_t nbytes;
    toast_moments *m;

    *out = NULL;
    toast_status st = toast_moments_nbytes(S, d, folds, span, &nbytes, err);
    if (st != TOAST_OK)
        return st;
    if (precision != TOAST_PRECISION_FLOAT64 &&
        precision != TOAST_PRECISION_MIXED)
        return toast_set_error(err, TOAST_EINVAL, -1, "unknown precision %d",
                               (int)precision);
    m = calloc(1, sizeof *m);
    if (m == NULL)
        goto nomem;
    toast_moments_layout_of(S, d, folds, span, &m->lay, err); /* checked */
    m->precision = precision;
    m->rowstats = 1;
    m->sources = S;
    if (!moments_alloc(m))
        goto nomem;
    fill_pair_index(m);
    toast_moments_panels(&m->lay, m->panel_off, m->panel_blocks);
    *out = m;
    return TOAST_OK;

nomem:
    toast_moments_free(m);
    return toast_set_error(err, TOAST_ENOMEM, -1,
                           "cannot allocate %zu bytes for moments", nbytes);
}

void toast_moments_free(toast_moments *m)
{
    if (m == NULL)
        return;
    toast_moments_release_workspace(m);
    free(m->pair_index);
    free(m->panel_blocks);
    free(m->panel_off);
    free(m->data);
    free(m);
}

/* ------------------------------------------------------------ accessors */

int toast_moments_num_states(const toast_moments *m)
{
    return m->lay.num_states;
}

int toast_moments_dim(const toast_moments *m) { return m->lay.dim; }

int toast_moments_folds(const toast_moments *m) { return m->lay.folds; }

int toast_moments_span(const toast_moments *m) { return m->lay.span; }

toast_precision toast_moments_precision(const toast_moments *m)
{
    return m->precision;
}

int64_t toast_moments_rows(const toast_moments *m) { return m->next_row; }

int toast_moments_has_rowstats(const toast_moments *m) { return m->rowstats; }

int toast_moments_sources(const toast_moments *m) { return m->sources; }

int toast_moments_diagonals(const toast_moments *m) { return m->diagonals; }

toast_status toast_moments_keep_diagonals(toast_moments *m, toast_error *err)
{
    if (m->next_row != 0)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "what moments form can only be restricted "
                               "before the first update");
    m->diagonals = 1;
    return TOAST_OK;
}

toast_status toast_moments_restrict(toast_moments *m, int rowstats,
                                    int sources, toast_error *err)
{
    if (m->next_row != 0)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "what moments form can only be restricted "
                               "before the first update");
    if (sources < 1 || sources > m->lay.num_states)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "sources must be in [1, %d], got %d",
                               m->lay.num_states, sources);
    m->rowstats = rowstats != 0;
    m->sources = sources;
    return TOAST_OK;
}

void toast_moments_get_layout(const toast_moments *m,
                              toast_moments_layout *out)
{
    *out = m->lay;
}

size_t toast_moments_storage_len(const toast_moments *m)
{
    return m->lay.set_len * (size_t)m->lay.nsets;
}

const double *toast_moments_data(const toast_moments *m) { return m->data; }

toast_status toast_moments_set_data(toast_moments *m, const double *data,
                                    size_t len, int64_t rows,
                                    toast_error *err)
{
    const size_t want = toast_moments_storage_len(m);
    if (len != want)
        return toast_set_error(err, TOAST_ESHAPE, -1,
                               "state has %zu values but these moments hold "
                               "%zu", len, want);
    if (rows < 0)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "the row count must be >= 0, got %lld",
                               (long long)rows);
    memmove(m->data, data, len * sizeof(double));
    m->next_row = rows;
    return TOAST_OK;
}

int toast_moments_pair(const toast_moments *m, int i, int j)
{
    const int S = m->lay.num_states;
    if (i < 0 || j < 0 || i >= S || j >= S || i > j || i >= m->sources)
        return -1;
    return m->pair_index[i * S + j];
}

/* ------------------------------------------------------------ reading input */

static float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    uint32_t bits;
    float f;

    if (exponent == 0) {
        /* zero or subnormal: mantissa * 2^-24, exact in binary32 */
        f = (float)mantissa * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    if (exponent == 31)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float bfloat_to_float(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static const unsigned char *row_pointer(const toast_view *v, int64_t r)
{
    int64_t outer = r / v->inner, inner = r % v->inner;
    return (const unsigned char *)v->data + outer * v->outer_stride +
           inner * v->inner_stride;
}

/* Loads row r of v (d elements) into dst, converting to T. Elements are
 * read with memcpy because array elements need not be aligned. */
#define DEFINE_LOAD_ROW(NAME, T, SAME)                                     \
    static void NAME(const toast_view *v, int64_t r, int d, T *dst)        \
    {                                                                      \
        const unsigned char *p = row_pointer(v, r);                        \
        const int64_t cs = v->col_stride;                                  \
        if (v->dtype == SAME && cs == (int64_t)sizeof(T)) {                \
            memcpy(dst, p, (size_t)d * sizeof(T));                         \
            return;                                                        \
        }                                                                  \
        switch (v->dtype) {                                                \
        case TOAST_FLOAT64:                                                \
            for (int c = 0; c < d; c++, p += cs) {                         \
                double x;                                                  \
                memcpy(&x, p, sizeof x);                                   \
                dst[c] = (T)x;                                             \
            }                                                              \
            break;                                                         \
        case TOAST_FLOAT32:                                                \
            for (int c = 0; c < d; c++, p += cs) {                         \
                float x;                                                   \
                memcpy(&x, p, sizeof x);                                   \
                dst[c] = (T)x;                                             \
            }                                                              \
            break;                                                         \
        case TOAST_FLOAT16:                                                \
            for (int c = 0; c < d; c++, p += cs) {                         \
                uint16_t x;                                                \
                memcpy(&x, p, sizeof x);                                   \
                dst[c] = (T)half_to_float(x);                              \
            }                                                              \
            break;                                                         \
        case TOAST_BFLOAT16:                                               \
            for (int c = 0; c < d; c++, p += cs) {                         \
                uint16_t x;                                                \
                memcpy(&x, p, sizeof x);                                   \
                dst[c] = (T)bfloat_to_float(x);                            \
            }                                                              \
            break;                                                         \
        }                                                                  \
    }

DEFINE_LOAD_ROW(load_row_f64, double, TOAST_FLOAT64)
DEFINE_LOAD_ROW(load_row_f32, float, TOAST_FLOAT32)

/* 0 when some element of a contiguous row is NaN or Inf: x * 0 is 0 for
 * every finite x and NaN otherwise, so one branch-free (vectorisable) sum
 * tells. */
#define DEFINE_CONTIGUOUS_FINITE(NAME, T)                                  \
    static int NAME(const unsigned char *p, int d)                         \
    {                                                                      \
        T acc = 0;                                                         \
        _Pragma("omp simd reduction(+ : acc)")                             \
        for (int c = 0; c < d; c++) {                                      \
            T x;                                                           \
            memcpy(&x, p + (size_t)c * sizeof x, sizeof x);                \
            acc += x * (T)0;                                               \
        }                                                                  \
        return acc == (T)0;                                                \
    }

DEFINE_CONTIGUOUS_FINITE(contiguous_finite_f64, double)
DEFINE_CONTIGUOUS_FINITE(contiguous_finite_f32, float)

/* 1 when every element of row r is finite (the dtype is dispatched once
 * per row, not per element). */
static int row_is_finite(const toast_view *v, int64_t r, int d)
{
    const unsigned char *p = row_pointer(v, r);
    const int64_t cs = v->col_stride;
    int ok = 1;
    if (v->dtype == TOAST_FLOAT64 && cs == (int64_t)sizeof(double))
        return contiguous_finite_f64(p, d);
    if (v->dtype == TOAST_FLOAT32 && cs == (int64_t)sizeof(float))
        return contiguous_finite_f32(p, d);
    switch (v->dtype) {
    case TOAST_FLOAT64:
        for (int c = 0; c < d; c++, p += cs) {
            double x;
            memcpy(&x, p, sizeof x);
            ok &= isfinite(x) != 0;
        }
        break;
    case TOAST_FLOAT32:
        for (int c = 0; c < d; c++, p += cs) {
            float x;
            memcpy(&x, p, sizeof x);
            ok &= isfinite(x) != 0;
        }
        break;
    case TOAST_FLOAT16:
        for (int c = 0; c < d; c++, p += cs) {
            uint16_t x;
            memcpy(&x, p, sizeof x);
            ok &= ((x >> 10) & 0x1fu) != 0x1fu;
        }
        break;
    case TOAST_BFLOAT16:
        for (int c = 0; c < d; c++, p += cs) {
            uint16_t x;
            memcpy(&x, p, sizeof x);
            ok &= ((x >> 7) & 0xffu) != 0xffu;
        }
        break;
    }
    return ok;
}

static const char *dtype_name(toast_dtype t)
{
    switch (t) {
    case TOAST_FLOAT16: return "float16";
    case TOAST_BFLOAT16: return "bfloat16";
    case TOAST_FLOAT32: return "float32";
    case TOAST_FLOAT64: return "float64";
    }
    return "unknown";
}

/* Checks dtypes, row counts, masks, fold ids and finiteness. */
static toast_status validate_update(const toast_moments *m,
                                    const toast_view *views,
                                    const uint8_t *mask,
                                    const int64_t *fold_ids, int64_t *rows_out,
                                    toast_error *err)
{
    int64_t rows = -1;
    for (int s = 0; s < m->lay.num_states; s++) {
        const toast_view *v = &views[s];
        if (v->dtype != TOAST_FLOAT16 && v->dtype != TOAST_BFLOAT16 &&
            v->dtype != TOAST_FLOAT32 && v->dtype != TOAST_FLOAT64)
            return toast_set_error(err, TOAST_ETYPE, s,
                                   "states[%d] has an unsupported dtype", s);
        if (v->outer < 0 || v->inner < 1 ||
            (v->outer > 0 && v->inner > INT64_MAX / v->outer))
            return toast_set_error(err, TOAST_ESHAPE, s,
                                   "states[%d] has an invalid shape", s);
        int64_t r = v->outer * v->inner;
        if (rows >= 0 && r != rows)
            return toast_set_error(err, TOAST_ESHAPE, s,
                                   "states[%d] has %lld rows but states[0] "
                                   "has %lld", s, (long long)r,
                                   (long long)rows);
        rows = r;
    }
    if (rows == 0)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "states have zero rows");
    if (fold_ids != NULL && m->lay.folds == 0)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "fold ids were given but the moments have "
                               "no folds");
    for (int64_t r = 0; fold_ids != NULL && r < rows; r++) {
        if ((mask == NULL || mask[r]) &&
            (fold_ids[r] < 0 || fold_ids[r] >= m->lay.folds))
            return toast_set_error(err, TOAST_ERANGE, -1,
                                   "fold id %lld at row %lld is outside "
                                   "[0, %d)", (long long)fold_ids[r],
                                   (long long)r, m->lay.folds);
    }
    for (int s = 0; s < m->lay.num_states; s++) {
        for (int64_t r = 0; r < rows; r++) {
            if ((mask == NULL || mask[r]) &&
                !row_is_finite(&views[s], r, m->lay.dim))
                return toast_set_error(err, TOAST_ENONFINITE, s,
                                       "states[%d] contains NaN or Inf (row "
                                       "%lld, %s)", s, (long long)r,
                                       dtype_name(views[s].dtype));
        }
    }
    *rows_out = rows;
    return TOAST_OK;
}

/* ------------------------------------------------------------ kernels */

/* Dot products in float64. The simd reduction (enabled by -fopenmp-simd,
 * no OpenMP runtime) fixes one summation order per build, so results are
 * reproducible run to run. */
static double dot_f64(const double *a, const double *b, int n)
{
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int c = 0; c < n; c++)
        s += a[c] * b[c];
    return s;
}

static double dot_f32(const float *a, const float *b, int n)
{
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int c = 0; c < n; c++)
        s += (double)a[c] * (double)b[c];
    return s;
}

/* Cosine with the conventions: two zero vectors agree (1), one zero
 * vector is orthogonal to anything (0). */
static double cosine_of(double dot, double nii, double njj)
{
    if (nii <= 0.0 && njj <= 0.0)
        return 1.0;
    if (nii <= 0.0 || njj <= 0.0)
        return 0.0;
    double c = dot / (sqrt(nii) * sqrt(njj));
    return c > 1.0 ? 1.0 : (c < -1.0 ? -1.0 : c);
}

/* Bytes between consecutive rows of v when that is one positive stride
 * (rows r and r + 1 always this far apart), else 0. */
static int64_t direct_stride(const toast_view *v)
{
    if (v->inner == 1)
        return v->outer_stride > 0 ? v->outer_stride : 0;
    if (v->outer > 1 && v->outer_stride != v->inner * v->inner_stride)
        return 0;
    return v->inner_stride > 0 ? v->inner_stride : 0;
}

/* 1 when every state already holds its rows in the working type `want`
 * (element size `elem`), contiguous within a row, aligned and with a
 * uniform row stride BLAS can take as a leading dimension: the kernels
 * then read the caller's arrays without a copy. */
static int views_direct(const toast_view *views, int S, int d,
                        toast_dtype want, size_t elem)
{
    for (int s = 0; s < S; s++) {
        const toast_view *v = &views[s];
        int64_t stride = direct_stride(v);
        if (v->dtype != want || v->col_stride != (int64_t)elem ||
            stride == 0 || stride % (int64_t)elem != 0 ||
            stride / (int64_t)elem < d ||
            stride / (int64_t)elem > INT_MAX ||
            (uintptr_t)v->data % elem != 0)
            return 0;
    }
    return 1;
}

/* One chunk of rows as the kernels read them: row k of state s starts at
 * element k * ld[s] of base[s]. Packed chunks are copies (per state, `cap`
 * rows of d values, double or float, rows stored whole so that adjacent
 * states share one leading dimension); direct chunks point into the
 * caller's arrays when those already hold rows in the working type. */
typedef struct {
    int S, d, cap;
    int mixed;
    int packed;         /* 1: base/ld point into buf */
    const void **base;  /* S: first element of each state's rows */
    size_t *ld;         /* S: elements between consecutive rows */
    void *buf;          /* S * cap * d elements */
    double *norms;      /* S: squared norms of the current row */
    float *scratch;     /* d x (widest panel), mixed precision only */
    int64_t *row;       /* cap: input row of each packed slot */
    int *fold;          /* cap: fold of each collected row */
    int *slot;          /* cap: packed position of each collected row */
    int *start;         /* nsets + 1: fold ranges after grouping */
} chunk;

static void chunk_free(chunk *c)
{
    free(c->base);
    free(c->ld);
    free(c->buf);
    free(c->norms);
    free(c->scratch);
    free(c->row);
    free(c->fold);
    free(c->slot);
    free(c->start);
}

static size_t chunk_capacity(const toast_moments *m, int64_t rows,
                             size_t *per_row)
{
    size_t elem = m->precision == TOAST_PRECISION_MIXED ? sizeof(float)
                                                        : sizeof(double);
    size_t cap;
    *per_row = (size_t)m->lay.num_states * m->lay.dim * elem;
    cap = CHUNK_BYTES / *per_row;
    if (cap < CHUNK_MIN_ROWS)
        cap = CHUNK_MIN_ROWS;
    if (cap > TOAST_CHUNK_MAX_ROWS)
        cap = TOAST_CHUNK_MAX_ROWS;
    if ((int64_t)cap > rows)
        cap = (size_t)rows;
    return cap;
}

/* The update workspace, kept on the moments between updates (allocating
 * and faulting in ~100 MB per batch costs more than the arithmetic of a
 * small batch); grown when a batch needs a larger chunk. */
static toast_status chunk_get(toast_moments *m, int64_t rows, chunk **out,
                              toast_error *err)
{
    size_t per_row;
    size_t cap = chunk_capacity(m, rows, &per_row);
    chunk *c = m->workspace;

    if (c != NULL && (size_t)c->cap >= cap) {
        *out = c;
        return TOAST_OK;
    }
    toast_moments_release_workspace(m);
    c = calloc(1, sizeof *c);
    if (c == NULL)
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate the update workspace");
    c->S = m->lay.num_states;
    c->d = m->lay.dim;
    c->cap = (int)cap;
    c->mixed = m->precision == TOAST_PRECISION_MIXED;
    c->buf = malloc(cap * per_row);
    c->base = malloc((size_t)c->S * sizeof(void *));
    c->ld = malloc((size_t)c->S * sizeof(size_t));
    c->norms = malloc((size_t)m->lay.num_states * sizeof(double));
    c->row = malloc(cap * sizeof(int64_t));
    c->fold = malloc(cap * sizeof(int));
    c->slot = malloc(cap * sizeof(int));
    c->start = malloc(((size_t)m->lay.nsets + 1) * sizeof(int));
    if (c->mixed)
        c->scratch = malloc((size_t)c->d * c->d * m->panel_blocks[0] *
                            sizeof(float));
    if (c->buf == NULL || c->base == NULL || c->ld == NULL ||
        c->norms == NULL || c->row == NULL ||
        c->fold == NULL || c->slot == NULL || c->start == NULL ||
        (c->mixed && c->scratch == NULL)) {
        chunk_free(c);
        free(c);
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate %zu bytes of workspace",
                               cap * per_row);
    }
    m->workspace = c;
    *out = c;
    return TOAST_OK;
}

void toast_moments_release_workspace(toast_moments *m)
{
    if (m->workspace != NULL) {
        chunk_free(m->workspace);
        free(m->workspace);
        m->workspace = NULL;
    }
}

/* Element offset of state s in packed row `slot`: rows are stored whole,
 * [x_0 | x_1 | ... | x_{S-1}], so the states i..j of a range of rows form
 * one matrix with leading dimension S*d. */
static size_t packed_offset(const chunk *c, int s, int slot)
{
    return ((size_t)slot * c->S + s) * c->d;
}

/* Groups the n collected rows by fold (stable counting sort) and converts
 * them into the packed buffers. */
static void chunk_pack(chunk *c, const toast_view *views, int n, int nsets)
{
    int *start = c->start;
    for (int f = 0; f <= nsets; f++)
        start[f] = 0;
    for (int k = 0; k < n; k++)
        start[c->fold[k] + 1]++;
    for (int f = 0; f < nsets; f++)
        start[f + 1] += start[f];
    /* start[f] is the first slot of fold f; handing out slots advances it
     * to the end of fold f, so shift it back by one fold afterwards. */
    for (int k = 0; k < n; k++)
        c->slot[k] = start[c->fold[k]]++;
    for (int f = nsets; f > 0; f--)
        start[f] = start[f - 1];
    start[0] = 0;

    c->packed = 1;
    for (int s = 0; s < c->S; s++) {
        size_t first = packed_offset(c, s, 0);
        c->base[s] = c->mixed ? (const void *)((const float *)c->buf + first)
                              : (const void *)((const double *)c->buf + first);
        c->ld[s] = (size_t)c->S * c->d;
        for (int k = 0; k < n; k++) {
            size_t at = packed_offset(c, s, c->slot[k]);
            if (c->mixed)
                load_row_f32(&views[s], c->row[k], c->d, (float *)c->buf + at);
            else
                load_row_f64(&views[s], c->row[k], c->d,
                             (double *)c->buf + at);
        }
    }
}

static const float *rows_f32(const chunk *c, int s, int k)
{
    return (const float *)c->base[s] + (size_t)k * c->ld[s];
}

static const double *rows_f64(const chunk *c, int s, int k)
{
    return (const double *)c->base[s] + (size_t)k * c->ld[s];
}

static double row_dot(const chunk *c, int si, int sj, int k)
{
    if (c->mixed)
        return dot_f32(rows_f32(c, si, k), rows_f32(c, sj, k), c->d);
    return dot_f64(rows_f64(c, si, k), rows_f64(c, sj, k), c->d);
}

/* Points the chunk at rows [r0, r0 + n) of the caller's arrays (see
 * direct_layout: every state holds them in the working type with a
 * uniform row stride). */
static void chunk_direct(chunk *c, const toast_view *views, int64_t r0)
{
    c->packed = 0;
    for (int s = 0; s < c->S; s++) {
        c->base[s] = row_pointer(&views[s], r0);
        c->ld[s] = (size_t)direct_stride(&views[s]) /
                   (c->mixed ? sizeof(float) : sizeof(double));
    }
}

/* Count and column sums of slots [a, b) into one set. */
static void add_sums(const toast_moments *m, const chunk *c, int a, int b,
                     double *set)
{
    const int d = m->lay.dim;

    set[0] += (double)(b - a);
    for (int s = 0; s < m->lay.num_states; s++) {
        double *restrict sum = set + m->lay.off_sums + (size_t)s * d;
        for (int k = a; k < b; k++) {
            if (c->mixed) {
                const float *restrict x = rows_f32(c, s, k);
#pragma omp simd
                for (int e = 0; e < d; e++)
                    sum[e] += x[e];
            } else {
                const double *restrict x = rows_f64(c, s, k);
#pragma omp simd
                for (int e = 0; e < d; e++)
                    sum[e] += x[e];
            }
        }
    }
}

/* Per-row pair statistics of slots [a, b) into one set. */
static void add_row_stats(const toast_moments *m, const chunk *c, int a, int b,
                          double *set)
{
    const int S = m->lay.num_states;
    double *rs = set + m->lay.off_rowstats;
    const size_t plane = (size_t)S * S;

    for (int k = a; k < b; k++) {
        for (int s = 0; s < S; s++)
            c->norms[s] = row_dot(c, s, s, k);
        for (int i = 0; i < S; i++) {
            for (int j = i + 1; j < S; j++) {
                double dot = row_dot(c, i, j, k);
                double cs = cosine_of(dot, c->norms[i], c->norms[j]);
                double sq = c->norms[i] + c->norms[j] - 2.0 * dot;
                if (sq < 0.0)
                    sq = 0.0;
                size_t at = (size_t)i * S + j;
                rs[TOAST_RS_COS * plane + at] += cs;
                rs[TOAST_RS_ANGLE * plane + at] += acos(cs) / M_PI;
                rs[TOAST_RS_DIST * plane + at] += sqrt(sq);
                rs[TOAST_RS_SQDIST * plane + at] += sq;
            }
        }
    }
}

/* Row panel of state i, float64: X_i^T X_i by dsyrk (upper triangle: half
 * the multiply-adds), then X_i^T [X_i+1 | ...]: one dgemm when the chunk
 * is packed (adjacent states share a leading dimension), else one per
 * block. */
static void add_panel_f64(const toast_moments *m, const chunk *c, int i,
                          int a, int n, int blocks, double *P)
{
    /* forms the first `blocks` blocks of the panel (its full width apart) */
    const int d = m->lay.dim;
    const int width = m->panel_blocks[i] * d;
    const double *X = rows_f64(c, i, a);
    const int ld = (int)c->ld[i];

    toast_dsyrk(TOAST_CblasRowMajor, TOAST_CblasUpper, TOAST_CblasTrans, d, n,
                1.0, X, ld, 1.0, P, width);
    if (blocks > 1 && c->packed)
        toast_dgemm(TOAST_CblasRowMajor, TOAST_CblasTrans, TOAST_CblasNoTrans,
                    d, (blocks - 1) * d, n, 1.0, X, ld, X + d, ld, 1.0, P + d,
                    width);
    for (int b = 1; b < blocks && !c->packed; b++)
        toast_dgemm(TOAST_CblasRowMajor, TOAST_CblasTrans, TOAST_CblasNoTrans,
                    d, d, n, 1.0, X, ld, rows_f64(c, i + b, a),
                    (int)c->ld[i + b], 1.0, P + (size_t)b * d, width);
}

/* Row panel of state i, mixed: the same products in float32 into the
 * scratch panel, then added to the float64 sums (upper triangle of the
 * diagonal block only: ssyrk leaves the lower one unwritten). */
static void add_panel_mixed(const toast_moments *m, const chunk *c, int i,
                            int a, int n, int blocks, double *P)
{
    const int d = m->lay.dim;
    const size_t width = (size_t)m->panel_blocks[i] * d;
    const size_t formed = (size_t)blocks * d;
    const float *X = rows_f32(c, i, a);
    const int ld = (int)c->ld[i];
    float *T = c->scratch;

    toast_ssyrk(TOAST_CblasRowMajor, TOAST_CblasUpper, TOAST_CblasTrans, d, n,
                1.0f, X, ld, 0.0f, T, (int)width);
    if (blocks > 1 && c->packed)
        toast_sgemm(TOAST_CblasRowMajor, TOAST_CblasTrans, TOAST_CblasNoTrans,
                    d, (int)formed - d, n, 1.0f, X, ld, X + d, ld, 0.0f, T + d,
                    (int)width);
    for (int b = 1; b < blocks && !c->packed; b++)
        toast_sgemm(TOAST_CblasRowMajor, TOAST_CblasTrans, TOAST_CblasNoTrans,
                    d, d, n, 1.0f, X, ld, rows_f32(c, i + b, a),
                    (int)c->ld[i + b], 0.0f, T + (size_t)b * d, (int)width);
    for (size_t r = 0; r < (size_t)d; r++) {
        const float *src = T + r * width;
        double *dst = P + r * width;
        for (size_t e = r; e < formed; e++)
            dst[e] += src[e];
    }
}

/* Cross blocks of slots [a, b) into one set: one panel per source state,
 * X_i^T [X_i | X_i+1 | ... ], which keeps BLAS calls few and large. */
static void add_cross_blocks(const toast_moments *m, const chunk *c, int a,
                             int b, double *set)
{
    const int S = m->lay.num_states;
    for (int i = 0; i < (m->diagonals ? S : m->sources); i++) {
        double *P = set + m->panel_off[i];
        /* past the sources, the diagonal block alone: one block wide */
        int blocks = i < m->sources ? m->panel_blocks[i] : 1;
        if (c->mixed)
            add_panel_mixed(m, c, i, a, b - a, blocks, P);
        else
            add_panel_f64(m, c, i, a, b - a, blocks, P);
    }
}

/* Reads and writes back one value on every page of p[0:n] (volatile: the
 * stores stay), faulting the pages in without changing them. */
static void touch_pages(double *p, size_t n)
{
    volatile double *v = p;
    const size_t step = TOUCH_STRIDE / sizeof(double);
    for (size_t k = 0; k < n; k += step)
        v[k] = v[k];
    if (n > 0)
        v[n - 1] = v[n - 1];
}

/* Faults in, from the calling thread, the storage that updates write:
 * the sums, the row statistics and the panels (of the sources; the
 * diagonal blocks of the other states). The calloc'ed storage is
 * otherwise first touched inside the BLAS calls, by all of its threads at
 * once: on the project's 2-core VM the first update of SmolLM2's moments
 * (385 MB) took 1.5 s with two OpenBLAS threads, 0.3 s with one, and the
 * second 0.03 s either way. */
static void touch_storage(toast_moments *m)
{
    const int S = m->lay.num_states, d = m->lay.dim;
    for (int f = 0; f < m->lay.nsets; f++) {
        double *set = m->data + (size_t)f * m->lay.set_len;
        touch_pages(set, m->lay.off_blocks);
        for (int i = 0; i < (m->diagonals ? S : m->sources); i++) {
            const size_t width = (size_t)m->panel_blocks[i] * d;
            double *P = set + m->panel_off[i];
            if (i < m->sources)
                touch_pages(P, (size_t)d * width);
            else
                for (int r = 0; r < d; r++)
                    touch_pages(P + (size_t)r * width, (size_t)d);
        }
    }
    m->touched = 1;
}

static void chunk_accumulate(toast_moments *m, const chunk *c)
{
    for (int f = 0; f < m->lay.nsets; f++) {
        int a = c->start[f], b = c->start[f + 1];
        if (b <= a)
            continue;
        double *set = m->data + (size_t)f * m->lay.set_len;
        add_sums(m, c, a, b, set);
        if (m->rowstats)
            add_row_stats(m, c, a, b, set);
        add_cross_blocks(m, c, a, b, set);
    }
}

/* Every row, without masks or folds, read in place: in chunks of
 * TOAST_CHUNK_MAX_ROWS in mixed precision (the float32 products' bound),
 * else in as few BLAS calls as an int row count allows (each call streams
 * the float64 panels once, so fewer calls move less memory). */
static int64_t update_direct(toast_moments *m, chunk *c,
                             const toast_view *views, int64_t rows)
{
    const int64_t step = c->mixed ? TOAST_CHUNK_MAX_ROWS : INT_MAX;
    for (int64_t r = 0; r < rows; r += step) {
        int n = rows - r < step ? (int)(rows - r) : (int)step;
        chunk_direct(c, views, r);
        c->start[0] = 0;
        c->start[1] = n;
        chunk_accumulate(m, c);
    }
    return rows;
}

/* The rows the mask keeps, dealt to folds, converted and grouped into the
 * packed buffer chunk by chunk. */
static int64_t update_packed(toast_moments *m, chunk *c,
                             const toast_view *views, int64_t rows,
                             const uint8_t *mask, const int64_t *fold_ids)
{
    int64_t accepted = 0;
    int n = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (mask != NULL && !mask[r])
            continue;
        c->row[n] = r;
        if (fold_ids != NULL)
            c->fold[n] = (int)fold_ids[r];
        else if (m->lay.folds > 0)
            c->fold[n] = (int)((m->next_row + accepted) % m->lay.folds);
        else
            c->fold[n] = 0;
        accepted++;
        if (++n == c->cap) {
            chunk_pack(c, views, n, m->lay.nsets);
            chunk_accumulate(m, c);
            n = 0;
        }
    }
    if (n > 0) {
        chunk_pack(c, views, n, m->lay.nsets);
        chunk_accumulate(m, c);
    }
    return accepted;
}

toast_status toast_moments_update(toast_moments *m, const toast_view *views,
                                  const uint8_t *mask, const int64_t *fold_ids,
                                  toast_error *err)
{
    int64_t rows = 0;
    chunk *c = NULL;
    toast_status st = validate_update(m, views, mask, fold_ids, &rows, err);
    if (st != TOAST_OK)
        return st;
    if (m->next_row > INT64_MAX - rows)
        return toast_set_error(err, TOAST_EOVERFLOW, -1,
                               "the row counter (%lld) would overflow",
                               (long long)m->next_row);
    st = chunk_get(m, rows, &c, err);
    if (st != TOAST_OK)
        return st;
    if (!m->touched)
        touch_storage(m);
    const int direct =
        mask == NULL && m->lay.nsets == 1 &&
        views_direct(views, m->lay.num_states, m->lay.dim,
                     c->mixed ? TOAST_FLOAT32 : TOAST_FLOAT64,
                     c->mixed ? sizeof(float) : sizeof(double));

    int64_t accepted = direct ? update_direct(m, c, views, rows)
                              : update_packed(m, c, views, rows, mask,
                                              fold_ids);
    m->next_row += accepted;
    return TOAST_OK;
}

toast_status toast_moments_merge(toast_moments *dst, const toast_moments *src,
                                 toast_error *err)
{
    const toast_moments_layout *a = &src->lay, *b = &dst->lay;
    if (a->num_states != b->num_states || a->dim != b->dim ||
        a->folds != b->folds || a->span != b->span ||
        src->rowstats != dst->rowstats || src->sources != dst->sources ||
        src->diagonals != dst->diagonals)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "cannot merge moments of (states=%d, dim=%d, "
                               "folds=%d, span=%d, rowstats=%d, sources=%d) "
                               "into (states=%d, dim=%d, folds=%d, span=%d, "
                               "rowstats=%d, sources=%d)", a->num_states,
                               a->dim, a->folds, a->span, src->rowstats,
                               src->sources, b->num_states, b->dim, b->folds,
                               b->span, dst->rowstats, dst->sources);
    if (src->next_row > INT64_MAX - dst->next_row)
        return toast_set_error(err, TOAST_EOVERFLOW, -1,
                               "the merged row counter (%lld + %lld) would "
                               "overflow", (long long)dst->next_row,
                               (long long)src->next_row);
    size_t total = toast_moments_storage_len(dst);
    for (size_t e = 0; e < total; e++)
        dst->data[e] += src->data[e];
    dst->next_row += src->next_row;
    return TOAST_OK;
}

/* ------------------------------------------------------------ queries */

static int set_selected(toast_sets sel, int k, int f)
{
    switch (sel) {
    case TOAST_SETS_ONLY: return f == k;
    case TOAST_SETS_EXCEPT: return f != k;
    default: return 1;
    }
}

/* out[0:len] = sum over the selected sets of data[off : off + len]. */
static void combine(const toast_moments *m, toast_sets sel, int k, size_t off,
                    size_t len, double *out)
{
    memset(out, 0, len * sizeof(double));
    for (int f = 0; f < m->lay.nsets; f++) {
        if (!set_selected(sel, k, f))
            continue;
        const double *src = m->data + (size_t)f * m->lay.set_len + off;
        for (size_t e = 0; e < len; e++)
            out[e] += src[e];
    }
}

double toast_moments_count(const toast_moments *m, toast_sets sel, int k)
{
    double n;
    combine(m, sel, k, 0, 1, &n);
    return n;
}

void toast_moments_sums(const toast_moments *m, toast_sets sel, int k, int i,
                        double *out)
{
    const size_t d = (size_t)m->lay.dim;
    combine(m, sel, k, m->lay.off_sums + (size_t)i * d, d, out);
}

double toast_moments_rowstat(const toast_moments *m, toast_sets sel, int k,
                             int stat, int i, int j)
{
    double v;
    const size_t S = (size_t)m->lay.num_states;
    size_t at = m->lay.off_rowstats + (size_t)stat * S * S + (size_t)i * S + j;
    combine(m, sel, k, at, 1, &v);
    return v;
}

/* out (d x d) = sum over the selected sets of block (i, j), i <= j, read
 * from the row panel of state i. */
static void combine_block(const toast_moments *m, toast_sets sel, int k,
                          int i, int j, double *out)
{
    const int d = m->lay.dim;
    const size_t width = (size_t)m->panel_blocks[i] * d;
    const size_t first = m->panel_off[i] + (size_t)(j - i) * d;
    memset(out, 0, (size_t)d * d * sizeof(double));
    for (int f = 0; f < m->lay.nsets; f++) {
        if (!set_selected(sel, k, f))
            continue;
        const double *panel = m->data + (size_t)f * m->lay.set_len + first;
        for (int r = 0; r < d; r++) {
            const double *src = panel + (size_t)r * width;
            double *dst = out + (size_t)r * d;
            for (int c = 0; c < d; c++)
                dst[c] += src[c];
        }
    }
}

static void transpose_square(double *a, int d)
{
    for (int r = 0; r < d; r++)
        for (int c = r + 1; c < d; c++) {
            double t = a[(size_t)r * d + c];
            a[(size_t)r * d + c] = a[(size_t)c * d + r];
            a[(size_t)c * d + r] = t;
        }
}

toast_status toast_moments_cross(const toast_moments *m, toast_sets sel, int k,
                                 int i, int j, double *out, toast_error *err)
{
    const int d = m->lay.dim;
    int lo = i < j ? i : j, hi = i < j ? j : i;
    if (i < 0 || j < 0 || i >= m->lay.num_states || j >= m->lay.num_states)
        return toast_set_error(err, TOAST_ERANGE, -1,
                               "state pair (%d, %d) is out of range for %d "
                               "states", i, j, m->lay.num_states);
    if (lo >= m->sources && !(lo == hi && m->diagonals))
        return toast_set_error(err, TOAST_ENOTSTORED, -1,
                               "the cross block (%d, %d) is not kept: these "
                               "moments form the blocks of states < %d only "
                               "(sources=%d)", lo, hi, m->sources,
                               m->sources);
    /* a diagonal past the sources is kept only with diagonals (above) */
    int p = lo >= m->sources ? m->pair_index[lo * m->lay.num_states + hi]
                             : toast_moments_pair(m, lo, hi);
    if (p < 0)
        return toast_set_error(err, TOAST_ENOTSTORED, -1,
                               "the cross block (%d, %d) is not kept: these "
                               "moments keep pairs up to span %d", lo, hi,
                               m->lay.span);
    combine_block(m, sel, k, lo, hi, out);
    if (lo == hi) {
        for (int r = 0; r < d; r++)
            for (int c = 0; c < r; c++)
                out[(size_t)r * d + c] = out[(size_t)c * d + r];
    } else if (i > j) {
        transpose_square(out, d);
    }
    return TOAST_OK;
}
