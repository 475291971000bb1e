/*
 * toast_core.h -- the C core of toast: streaming moments of layer
 * activations, closed-form translators solved from them, the block
 * error matrix, the centers and scores of ToaSt's head-dimension
 * pruning (geometric median, coordinate median, FPGM, L1, L2), and the
 * channel scores and top-k of its token channel selection.
 *
 * Plain C11, no Python. Every function that can fail returns a
 * toast_status and fills a toast_error; nothing aborts, prints or exits.
 *
 * Conventions used throughout:
 *   - S states (layer outputs) of width d; states are indexed 0..S-1.
 *   - Activations are rows: a state holds n rows of d features.
 *   - All matrices are dense, row-major, float64, with leading dimension
 *     equal to their column count unless stated otherwise.
 *   - Row-vector convention for maps: y = x W + b, W is d x d, b is d.
 *   - "Cross block" (i, j) is X_i^T X_j, a d x d matrix (units: squared
 *     activation units, summed over rows).
 */
#ifndef TOAST_CORE_H
#define TOAST_CORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- errors */

typedef enum {
    TOAST_OK = 0,
    TOAST_ENOMEM,      /* an allocation failed */
    TOAST_EINVAL,      /* an argument has an invalid value */
    TOAST_ETYPE,       /* an argument has an unsupported type or dtype */
    TOAST_ESHAPE,      /* shapes do not agree */
    TOAST_ENONFINITE,  /* the data contains NaN or Inf */
    TOAST_ERANGE,      /* an index is out of range */
    TOAST_ENOTSTORED,  /* a cross block was not kept by the moments */
    TOAST_EOVERFLOW,   /* a size computation overflows */
    TOAST_ELAPACK,     /* LAPACK reported an internal failure */
    TOAST_EINTERRUPTED /* the caller's poll function asked to stop */
} toast_status;

#define TOAST_ERROR_MSG_SIZE 256

typedef struct {
    toast_status code;
    int arg;     /* index of the offending state, or -1 */
    char msg[TOAST_ERROR_MSG_SIZE];
} toast_error;

/* Fills err (if not NULL) and returns code. printf-style message. */
toast_status toast_set_error(toast_error *err, toast_status code, int arg,
                             const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* ---------------------------------------------------------------- input */

typedef enum {
    TOAST_FLOAT16 = 0,   /* IEEE binary16 */
    TOAST_BFLOAT16 = 1,  /* bfloat16: the top half of a binary32 */
    TOAST_FLOAT32 = 2,
    TOAST_FLOAT64 = 3
} toast_dtype;

/*
 * A read-only strided view of one state: rows x d elements.
 * Rows are enumerated as r = outer_index * inner + inner_index, so a
 * (batch, tokens, d) array is outer = batch, inner = tokens; a (rows, d)
 * array is outer = rows, inner = 1, inner_stride = 0. Strides are in bytes
 * and may be zero or negative. Elements need not be aligned.
 */
typedef struct {
    const void *data;
    toast_dtype dtype;
    int64_t outer, inner;
    int64_t outer_stride, inner_stride, col_stride;
} toast_view;

/* ---------------------------------------------------------------- moments */

/* Row statistics kept for every pair i < j, summed over rows. */
enum {
    TOAST_RS_COS = 0,   /* cos(x_i, x_j) */
    TOAST_RS_ANGLE,     /* acos(cos) / pi */
    TOAST_RS_DIST,      /* ||x_j - x_i||_2 */
    TOAST_RS_SQDIST,    /* ||x_j - x_i||_2^2 */
    TOAST_RS_COUNT
};

typedef enum {
    TOAST_PRECISION_FLOAT64 = 0, /* products and sums in float64 */
    TOAST_PRECISION_MIXED = 1    /* per-chunk float32 products, float64 sums */
} toast_precision;

/*
 * Streaming moments: an opaque object, created by toast_moments_new and
 * read through the functions below.
 *
 * Storage: nsets = max(folds, 1) sets, each of set_len doubles, in one
 * contiguous array (toast_moments_data). Within a set (offsets in doubles,
 * given by toast_moments_layout):
 *   [off_count]                  row count n (always 0)
 *   [off_sums, + S*d)            per-state column sums, state-major
 *   [off_rowstats, + RS*S*S)     row statistics (RS = TOAST_RS_COUNT),
 *                                TOAST_RS_* major, then i*S+j (only i < j
 *                                is used)
 *   [off_blocks, ...)            cross blocks as one row panel per state i:
 *                                a d x (panel_blocks[i] * d) row-major
 *                                matrix [X_i^T X_i | X_i^T X_i+1 | ...]
 *                                starting at panel_offset[i],
 *                                panel_blocks[i] = min(span, S-1-i) + 1.
 *                                Each symmetric pair is stored once
 *                                (j >= i); of a diagonal block only the
 *                                upper triangle is formed (by SYRK; the
 *                                lower holds no data: read blocks through
 *                                toast_moments_cross, which symmetrises).
 *                                Moments restricted to `sources` states
 *                                leave the panels of states >= sources
 *                                zero, and without row statistics their
 *                                region stays zero (toast_moments_restrict).
 * Keeping every quantity as a float64 sum makes merge an element-wise add.
 */
typedef struct toast_moments toast_moments;

/* Rows converted and multiplied per chunk of an update: at most this many
 * (fewer when S * d is large, see moments.c). In mixed precision each
 * chunk's products are formed in float32 and added to the float64 sums. */
#define TOAST_CHUNK_MAX_ROWS 4096

/* Where each quantity lives within one set of the storage. */
typedef struct {
    int num_states, dim, folds;
    int span;          /* pairs kept: j - i <= span (normalised, <= S-1) */
    int nsets;         /* max(folds, 1) */
    int npairs;        /* kept pairs (i, j), i <= j */
    size_t set_len;    /* doubles per set */
    size_t off_count, off_sums, off_rowstats, off_blocks;
} toast_moments_layout;

/* The layout of moments of this shape, computed without allocating. span
 * < 0 means all pairs. Fails like toast_moments_nbytes. */
toast_status toast_moments_layout_of(int S, int d, int folds, int span,
                                     toast_moments_layout *out,
                                     toast_error *err);

/* Offsets (within a set, in doubles) and block counts of the S row panels
 * of a layout: offsets and blocks have S entries each. */
void toast_moments_panels(const toast_moments_layout *layout, size_t *offsets,
                          int *blocks);

/* Bytes that toast_moments_new would allocate (storage + index), computed
 * without allocating. Fails with TOAST_EOVERFLOW when it does not fit. */
toast_status toast_moments_nbytes(int S, int d, int folds, int span,
                                  size_t *out, toast_error *err);

/* Creates zeroed moments; *out is NULL on failure. span < 0 means all. */
toast_status toast_moments_new(int S, int d, int folds, int span,
                               toast_precision precision,
                               toast_moments **out, toast_error *err);

void toast_moments_free(toast_moments *m);

/* Accessors. None fails; m must be a live object from toast_moments_new. */
int toast_moments_num_states(const toast_moments *m);
int toast_moments_dim(const toast_moments *m);
int toast_moments_folds(const toast_moments *m);   /* 0 or >= 2 */
int toast_moments_span(const toast_moments *m);    /* normalised span */
toast_precision toast_moments_precision(const toast_moments *m);
/* Rows accepted so far (the row id of the next row). */
int64_t toast_moments_rows(const toast_moments *m);
/* The storage layout (a copy). */
void toast_moments_get_layout(const toast_moments *m,
                              toast_moments_layout *out);
/* Doubles in the whole storage: nsets * set_len. */
size_t toast_moments_storage_len(const toast_moments *m);
/* The storage, read-only (storage_len doubles, laid out as above). */
const double *toast_moments_data(const toast_moments *m);

/* Replaces the storage (len doubles, must equal the storage length) and
 * the row counter (rows >= 0): restores pickled or reduced moments. */
toast_status toast_moments_set_data(toast_moments *m, const double *data,
                                    size_t len, int64_t rows,
                                    toast_error *err);

/*
 * Restricts what updates form, before the first update (TOAST_EINVAL
 * after): rowstats = 0 skips the per-row pair statistics (cosine, angle,
 * distances: the row metrics then fail), and only the row panels of the
 * first `sources` states (1 <= sources <= S) are formed, so blocks (i, j)
 * with i >= sources are not kept (toast_moments_cross: TOAST_ENOTSTORED).
 * A least-squares fit of state j from state i needs i < sources; e.g.
 * S = 2, sources = 1 forms X_0^T X_0 and X_0^T X_1 but not X_1^T X_1.
 * The storage layout is unchanged; moments merge only with moments
 * restricted alike.
 */
toast_status toast_moments_restrict(toast_moments *m, int rowstats,
                                    int sources, toast_error *err);

/* 1 when updates form the per-row pair statistics (the default). */
int toast_moments_has_rowstats(const toast_moments *m);

/* States whose row panels updates form (num_states by default). */
int toast_moments_sources(const toast_moments *m);

/* Makes updates form the diagonal block X_j^T X_j of every state j >=
 * sources as well (readable through toast_moments_cross; no other block of
 * those states): what the error matrix of the sources' pairs reads of their
 * targets (tr X_j^T X_j). Before the first update only. */
toast_status toast_moments_keep_diagonals(toast_moments *m, toast_error *err);

/* 1 when toast_moments_keep_diagonals was called. */
int toast_moments_diagonals(const toast_moments *m);

/* Block index of (i, j) with i <= j, or -1 when not kept / out of range. */
int toast_moments_pair(const toast_moments *m, int i, int j);

/*
 * Adds rows to the moments. views: S views with equal row counts.
 * mask: NULL or one byte per row, nonzero = use the row.
 * fold_ids: NULL or one id per row in [0, folds) (only with folds >= 2);
 * without ids, accepted row r (counting next_row) goes to fold r mod folds.
 * The data is checked for NaN/Inf before anything is added, so a failed
 * update leaves the moments unchanged. Not reentrant: one update (or merge)
 * at a time per object; the binding serialises them. Zero input rows is an
 * error; rows that are all masked out are not. On TOAST_ENONFINITE,
 * err->arg is the index of the first state holding NaN or Inf.
 */
toast_status toast_moments_update(toast_moments *m, const toast_view *views,
                                  const uint8_t *mask, const int64_t *fold_ids,
                                  toast_error *err);

/* Frees the update workspace (up to ~100 MB plus, in mixed precision, a
 * d x S*d float32 panel) that updates keep between calls. The next update
 * allocates it again. */
void toast_moments_release_workspace(toast_moments *m);

/* dst += src; the two must have the same S, d, folds and span. */
toast_status toast_moments_merge(toast_moments *dst, const toast_moments *src,
                                 toast_error *err);

/* Which sets a query combines. */
typedef enum {
    TOAST_SETS_ALL = 0,   /* sum of every fold */
    TOAST_SETS_ONLY,      /* fold k only */
    TOAST_SETS_EXCEPT     /* every fold but k (training set of fold k) */
} toast_sets;

/* Row count over the selected sets. */
double toast_moments_count(const toast_moments *m, toast_sets sel, int k);

/* Column sums of state i over the selected sets: out has d doubles. */
void toast_moments_sums(const toast_moments *m, toast_sets sel, int k, int i,
                        double *out);

/* Row statistic stat (TOAST_RS_*) of pair (i, j), i < j. */
double toast_moments_rowstat(const toast_moments *m, toast_sets sel, int k,
                             int stat, int i, int j);

/* Full d x d X_i^T X_j (any order of i, j) over the selected sets.
 * Diagonal blocks are symmetrised. */
toast_status toast_moments_cross(const toast_moments *m, toast_sets sel, int k,
                                 int i, int j, double *out, toast_error *err);

/* ---------------------------------------------------------------- solvers */

typedef enum {
    TOAST_METHOD_NONE = 0,  /* nothing solved (identity) */
    TOAST_METHOD_CHOLESKY,
    TOAST_METHOD_EIGH,      /* eigendecomposition pseudo-inverse */
    TOAST_METHOD_SVD
} toast_method;

typedef struct {
    double condition;   /* condition number of the system; inf if singular */
    int rank;
    toast_method method;
} toast_solve_info;

/*
 * Policy for symmetric positive semi-definite systems (A + ridge I) W = B:
 * Cholesky first; it is accepted when it succeeds and LAPACK's estimate of
 * the reciprocal 1-norm condition number is >= TOAST_CHOL_MIN_RCOND.
 * Otherwise A is eigendecomposed, A = V diag(s) V^T, and
 * W = V diag(1 / (s + ridge)) V^T B where eigenvalues with
 * s + ridge <= d * DBL_EPSILON * (max(s) + ridge) count as zero: the
 * minimum-norm solution for rank-deficient A, as numpy.linalg.lstsq gives.
 * On the Cholesky path `condition` is 1 / rcond (1-norm estimate); on the
 * eigen path it is (max s + ridge) / (min s + ridge), inf when any
 * eigenvalue was cut.
 */
#define TOAST_CHOL_MIN_RCOND 1e-10

/* A factorization reused for many right-hand sides. */
typedef struct {
    int d;
    toast_method method;
    double ridge;
    double *a;      /* d*d: Cholesky factor U (A = U^T U) or V^T rows */
    double *s;      /* d eigenvalues of A (ascending), eigen path */
    double *work;   /* scratch for the eigensolver */
    int *iwork;
    int lwork, liwork;
    toast_solve_info info;
} toast_factor;

toast_status toast_factor_init(toast_factor *f, int d, toast_error *err);
void toast_factor_free(toast_factor *f);

/* Factors A + ridge I. A is d x d symmetric (both triangles read).
 * force_eigh skips Cholesky (used when eigenvalues are needed). */
toast_status toast_factor_compute(toast_factor *f, const double *A,
                                  double ridge, int force_eigh,
                                  toast_error *err);

/* W = (A + ridge I)^+ B for B d x m. tmp: d*m doubles of scratch. */
toast_status toast_factor_solve(const toast_factor *f, const double *B, int m,
                                double *W, double *tmp, toast_error *err);

/* One-shot solve with the policy above. */
toast_status toast_solve_gram(int d, const double *A, const double *B, int m,
                              double ridge, double *W, toast_solve_info *info,
                              toast_error *err);

/* ---------------------------------------------------------------- fits */

typedef enum {
    TOAST_FIT_IDENTITY = 0,
    TOAST_FIT_LEASTSQ,     /* full d x d least squares (ridge optional) */
    TOAST_FIT_DIAGONAL,    /* per-feature scale */
    TOAST_FIT_ORTHOGONAL   /* orthogonal Procrustes */
} toast_fit_kind;

typedef struct {
    toast_fit_kind kind;
    int center;          /* fit a bias on centered moments */
    double ridge;        /* >= 0 */
    int ridge_relative;  /* ridge *= trace(Gram) / d */
    toast_sets sel;      /* rows used: all folds, or all but fold k */
    int fold;
} toast_fit_options;

/*
 * Fits y_j ~ x_i W + b from the moments. W: d*d, b: d (zero without
 * center). Needs the pair (min(i,j), max(i,j)) to be kept.
 */
toast_status toast_fit(const toast_moments *m, int i, int j,
                       const toast_fit_options *opt, double *W, double *b,
                       toast_solve_info *info, toast_error *err);

/*
 * ReplaceMe's residual form: argmin_T || M T + Y - L ||, states mi, yi, li.
 * Only TOAST_FIT_LEASTSQ (with ridge, center) is supported.
 */
toast_status toast_fit_residual(const toast_moments *m, int mi, int yi, int li,
                                const toast_fit_options *opt, double *W,
                                double *b, toast_solve_info *info,
                                toast_error *err);

/* ---------------------------------------------------------------- metrics */

typedef enum {
    TOAST_METRIC_LINEAR = 0,  /* ||Y - X W*||_F / ||Y||_F, no bias */
    TOAST_METRIC_AFFINE,      /* same with a bias */
    TOAST_METRIC_MSE,         /* mean over rows of ||y - x||^2 */
    TOAST_METRIC_BR,          /* -MSE (RBA block redundancy) */
    TOAST_METRIC_COSINE,      /* mean over rows of 1 - cos */
    TOAST_METRIC_ANGULAR,     /* mean over rows of acos(cos) / pi */
    TOAST_METRIC_EUCLIDEAN,   /* mean over rows of ||y - x|| */
    TOAST_METRIC_CKA          /* linear CKA similarity */
} toast_metric;

typedef enum {
    TOAST_EST_IN_SAMPLE = 0,
    TOAST_EST_CV,             /* K-fold held-out, needs folds >= 2 */
    TOAST_EST_GCV             /* generalized cross-validation */
} toast_estimator;

/*
 * Fills E (S*S, row-major) with the metric for every i < j; entries on and
 * below the diagonal, and pairs whose blocks are not kept (linear, affine,
 * cka), are NaN. cond (S doubles, may be NULL) receives, for the linear
 * metrics, the condition number of each source state's Gram matrix (the
 * largest over folds for cv), NaN where unused.
 */
toast_status toast_error_matrix(const toast_moments *m, toast_metric metric,
                                toast_estimator est, double ridge,
                                int ridge_relative, double *E, double *cond,
                                toast_error *err);

/*
 * Polled between units of long work (one target state of one source state
 * and fold: at most one d x d solve and a few d x d products). A nonzero
 * return stops the work, which then fails with TOAST_EINTERRUPTED; the
 * outputs are then partial. ctx is passed through untouched.
 */
typedef int (*toast_poll_fn)(void *ctx);

/* toast_error_matrix with a poll function (poll may be NULL). */
toast_status toast_error_matrix_poll(const toast_moments *m,
                                     toast_metric metric, toast_estimator est,
                                     double ridge, int ridge_relative,
                                     double *E, double *cond,
                                     toast_poll_fn poll, void *poll_ctx,
                                     toast_error *err);

/* ------------------------------------------------- centers and scores */

/*
 * Centers of n points in R^p (the rows of X, n x p) and importance scores
 * of the points (ToaSt's coupled head dimensions: one point per dimension
 * of a head, the larger the score the more important). geomedian.c.
 */

/* Defaults of the geometric median's stopping rule (see below). */
#define TOAST_GM_TOL 1e-10
#define TOAST_GM_MAX_ITER 1000

typedef struct {
    int iterations; /* Weiszfeld steps taken */
    int converged;  /* 1: the stopping rule was met (or the iterate is a
                       data point that is optimal); 0: max_iter ran out and
                       the result is the last iterate (not an error) */
    int hits;       /* steps at which the iterate coincided with data
                       points (Vardi-Zhang step taken) */
} toast_gm_info;

/*
 * Geometric median: y = argmin_y sum_i w_i ||x_i - y||_2, w NULL meaning
 * all weights 1 (weights must be finite, >= 0, with a positive sum).
 *
 * Weiszfeld's iteration started from the weighted centroid:
 *   y+ = T(y) = sum_i (w_i / d_i) x_i / sum_i (w_i / d_i),  d_i = ||x_i - y||.
 * When the iterate coincides with data points (d_i <= 1e-12 times the
 * weighted mean distance; eta = their total weight), Vardi and Zhang's
 * (2000) modification is used: with R = sum over the other points of
 * w_i (x_i - y) / d_i, y is optimal (and returned) if ||R|| <= eta;
 * otherwise y+ = (1 - eta/||R||) T' + (eta/||R||) y, T' being T over the
 * other points. This also covers duplicated points.
 *
 * Stopping rule: ||y+ - y|| <= tol * s, s = the weighted mean distance from
 * y to the points (so tol is relative to the spread of the data and
 * independent of its units), or max_iter steps. tol >= 0, max_iter >= 0
 * (0 returns the centroid, not converged). info may be NULL.
 * Fails with TOAST_ENONFINITE on NaN/Inf data or when the computation
 * overflows float64 (coordinates near DBL_MAX), TOAST_EINVAL on bad
 * arguments; y (p doubles) is unspecified on failure.
 */
toast_status toast_geometric_median(int n, int p, const double *X,
                                    const double *w, double tol, int max_iter,
                                    double *y, toast_gm_info *info,
                                    toast_error *err);

/* Coordinate-wise median: y[c] = the ((n - 1) / 2)-th smallest value of
 * column c (0-based), i.e. the lower median for even n, as torch.median
 * returns; ToaSt's reference code uses this as its "geometric median". */
toast_status toast_coordinate_median(int n, int p, const double *X, double *y,
                                     toast_error *err);

typedef enum {
    TOAST_DIMSCORE_GEOMEDIAN = 0, /* ||x_j - geometric median|| */
    TOAST_DIMSCORE_COORD_MEDIAN,  /* ||x_j - coordinate-wise median|| */
    TOAST_DIMSCORE_FPGM,          /* sum_i ||x_j - x_i|| (FPGM) */
    TOAST_DIMSCORE_L1,            /* sum_c |x_jc| */
    TOAST_DIMSCORE_L2             /* ||x_j||_2 */
} toast_dimscore;

/*
 * scores[j] (n doubles) = the score of point j by `kind`. tol and max_iter
 * are the geometric median's (checked for every kind); info (may be NULL)
 * receives its iteration report, {0, 1, 0} for the other kinds.
 * TOAST_ENONFINITE when a score overflows float64.
 */
toast_status toast_dim_scores(int n, int p, const double *X,
                              toast_dimscore kind, double tol, int max_iter,
                              double *scores, toast_gm_info *info,
                              toast_error *err);

/*
 * toast_dim_scores for `groups` independent point sets stored one after the
 * other (X: groups x n x p, scores: groups x n, infos: groups entries or
 * NULL). On failure err->arg is the failing group.
 */
toast_status toast_dim_scores_batch(int groups, int n, int p, const double *X,
                                    toast_dimscore kind, double tol,
                                    int max_iter, double *scores,
                                    toast_gm_info *infos, toast_error *err);

/* ------------------------------------------ token channel selection */

/*
 * ToaSt's Token Channel Selection (tcs.c). Activations are float32,
 * row-major (B images x N tokens x C channels, channels contiguous). All
 * work runs on the calling thread.
 */

/*
 * The CLS row of the attention map averaged over heads:
 *   out[b, n] = (1/H) sum_h softmax_n(scale * q[b, h, :] . K[b, n, h, :])
 * q: B x (H*d) (the CLS token's query), K: B x N x (H*d), out: B x N.
 * Dot products and softmax in float64.
 */
toast_status toast_tcs_cls_attention(int B, int N, int H, int d,
                                     const float *q, const float *K,
                                     double scale, float *out,
                                     toast_error *err);

typedef struct {
    double cls_weight;   /* weight of |x_cls| (token 0); 0 for Eq. 7 */
    double patch_weight; /* weight of the mean over the sampled tokens */
    int batch_scope;     /* 0: one selection per image; 1: one from the
                            batch-mean scores (attention averaged first) */
} toast_tcs_options;

/*
 * Channel scores over m sampled tokens and their top k:
 *   I[c] = cls_weight |X[b, 0, c]|
 *          + (patch_weight / m) sum_j A[b, s_j] |X[b, s_j, c]|
 * (A = attn, B x N, or 1 when attn is NULL). out receives, per image (or
 * once for batch_scope), the k channels of largest score in ascending
 * channel order; equal scores rank the lower channel first. Scores are
 * accumulated in float64. sample[j] must lie in [0, N); 1 <= k <= C.
 * TOAST_ENONFINITE when a score is NaN or Inf (err->arg: the channel).
 */
toast_status toast_tcs_select(int B, int N, int C, const float *X, int m,
                              const int64_t *sample, const float *attn,
                              const toast_tcs_options *opt, int k,
                              int64_t *out, toast_error *err);

#ifdef __cplusplus
}
#endif
#endif /* TOAST_CORE_H */
