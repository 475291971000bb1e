/*
 * solve.c -- closed-form translators from moments.
 *
 * Least squares from moments solves the normal equations
 * (X^T X + ridge I) W = X^T Y with the policy documented in toast_core.h:
 * Cholesky when well conditioned, an eigendecomposition pseudo-inverse
 * otherwise. A bias is fitted by centering: with n rows, column sums s_x and
 * s_y, X_c^T Y_c = X^T Y - s_x s_y^T / n and b = mean_y - mean_x W.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "toast_blas.h"
#include "toast_core.h"
#include "toast_internal.h"

/* ------------------------------------------------------------ factor */

toast_status toast_factor_init(toast_factor *f, int d, toast_error *err)
{
    memset(f, 0, sizeof *f);
    /* dsyevd with eigenvectors: lwork >= 1 + 6d + 2d^2, liwork >= 3 + 5d,
     * both LAPACK ints */
    int64_t lwork = 1 + 6 * (int64_t)d + 2 * (int64_t)d * d;
    if (d < 1)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "a factorization needs d >= 1, got %d", d);
    if (lwork > INT32_MAX)
        return toast_set_error(err, TOAST_EOVERFLOW, -1,
                               "a %d x %d factorization exceeds LAPACK's "
                               "32-bit workspace sizes", d, d);
    f->d = d;
    f->lwork = (int)lwork;
    f->liwork = 3 + 5 * d;
    f->a = malloc((size_t)d * d * sizeof(double));
    f->s = malloc((size_t)d * sizeof(double));
    f->work = malloc((size_t)f->lwork * sizeof(double));
    f->iwork = malloc((size_t)f->liwork * sizeof(int));
    if (f->a == NULL || f->s == NULL || f->work == NULL || f->iwork == NULL) {
        toast_factor_free(f);
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate a %d x %d factorization", d,
                               d);
    }
    return TOAST_OK;
}

void toast_factor_free(toast_factor *f)
{
    free(f->a);
    free(f->s);
    free(f->work);
    free(f->iwork);
    memset(f, 0, sizeof *f);
}

/* Cholesky of A + ridge I; returns 1 when accepted by the policy. */
static int try_cholesky(toast_factor *f, const double *A, double ridge)
{
    const int d = f->d;
    int info = 0;
    double anorm, rcond = 0.0;

    memcpy(f->a, A, (size_t)d * d * sizeof(double));
    for (int r = 0; r < d; r++)
        f->a[(size_t)r * d + r] += ridge;
    /* The matrix is symmetric, so its row-major storage is also its
     * column-major storage. LAPACK's 'L' factor A = L L^T in column-major
     * is, read row-major, the upper factor U = L^T with A = U^T U. */
    anorm = toast_dlansy("1", "L", &d, f->a, &d, f->work, 1, 1);
    toast_dpotrf("L", &d, f->a, &d, &info, 1);
    if (info != 0)
        return 0;
    toast_dpocon("L", &d, f->a, &d, &anorm, &rcond, f->work, f->iwork, &info,
                 1);
    if (info != 0 || !(rcond >= TOAST_CHOL_MIN_RCOND))
        return 0;
    f->method = TOAST_METHOD_CHOLESKY;
    f->info.condition = 1.0 / rcond;
    f->info.rank = d;
    return 1;
}

static toast_status eigendecompose(toast_factor *f, const double *A,
                                   double ridge, toast_error *err)
{
    const int d = f->d;
    int info = 0;

    memcpy(f->a, A, (size_t)d * d * sizeof(double));
    toast_dsyevd("V", "L", &d, f->a, &d, f->s, f->work, &f->lwork, f->iwork,
                 &f->liwork, &info, 1, 1);
    if (info != 0)
        return toast_set_error(err, TOAST_ELAPACK, -1,
                               "the eigensolver (dsyevd) failed with info=%d",
                               info);
    /* Column-major eigenvectors read row-major: row k of f->a is the k-th
     * eigenvector, i.e. f->a holds V^T. */
    double top = f->s[d - 1] + ridge;
    double cut = (double)d * DBL_EPSILON * top;
    double low = INFINITY;
    int rank = 0;
    for (int k = 0; k < d; k++) {
        double v = f->s[k] + ridge;
        if (top > 0.0 && v > cut) {
            rank++;
            if (v < low)
                low = v;
        }
    }
    f->method = TOAST_METHOD_EIGH;
    f->info.rank = rank;
    f->info.condition = rank == d ? top / low : INFINITY;
    return TOAST_OK;
}

toast_status toast_factor_compute(toast_factor *f, const double *A,
                                  double ridge, int force_eigh,
                                  toast_error *err)
{
    if (!(ridge >= 0.0) || !isfinite(ridge))
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "ridge must be a finite number >= 0, got %g",
                               ridge);
    for (size_t e = 0; e < (size_t)f->d * f->d; e++)
        if (!isfinite(A[e]))
            return toast_set_error(err, TOAST_ENONFINITE, -1,
                                   "the Gram matrix contains NaN or Inf");
    f->ridge = ridge;
    if (!force_eigh && try_cholesky(f, A, ridge)) {
        f->info.method = TOAST_METHOD_CHOLESKY;
        return TOAST_OK;
    }
    toast_status st = eigendecompose(f, A, ridge, err);
    f->info.method = f->method;
    return st;
}

/* Reciprocal of s + ridge, or 0 for eigenvalues cut by the policy. */
static double eig_inverse(const toast_factor *f, int k)
{
    double top = f->s[f->d - 1] + f->ridge;
    double v = f->s[k] + f->ridge;
    if (!(top > 0.0) || v <= (double)f->d * DBL_EPSILON * top)
        return 0.0;
    return 1.0 / v;
}

toast_status toast_factor_solve(const toast_factor *f, const double *B, int m,
                                double *W, double *tmp, toast_error *err)
{
    const int d = f->d;
    (void)err;
    if (f->method == TOAST_METHOD_CHOLESKY) {
        memcpy(W, B, (size_t)d * m * sizeof(double));
        /* U^T U W = B: solve U^T Z = B, then U W = Z. */
        toast_dtrsm(TOAST_CblasRowMajor, TOAST_CblasLeft, TOAST_CblasUpper,
                    TOAST_CblasTrans, TOAST_CblasNonUnit, d, m, 1.0, f->a, d,
                    W, m);
        toast_dtrsm(TOAST_CblasRowMajor, TOAST_CblasLeft, TOAST_CblasUpper,
                    TOAST_CblasNoTrans, TOAST_CblasNonUnit, d, m, 1.0, f->a, d,
                    W, m);
        return TOAST_OK;
    }
    /* W = V diag(1/(s+ridge)) V^T B, f->a = V^T. */
    toast_dgemm(TOAST_CblasRowMajor, TOAST_CblasNoTrans, TOAST_CblasNoTrans, d,
                m, d, 1.0, f->a, d, B, m, 0.0, tmp, m);
    for (int k = 0; k < d; k++) {
        double inv = eig_inverse(f, k);
        for (int c = 0; c < m; c++)
            tmp[(size_t)k * m + c] *= inv;
    }
    toast_dgemm(TOAST_CblasRowMajor, TOAST_CblasTrans, TOAST_CblasNoTrans, d, m,
                d, 1.0, f->a, d, tmp, m, 0.0, W, m);
    return TOAST_OK;
}

toast_status toast_solve_gram(int d, const double *A, const double *B, int m,
                              double ridge, double *W, toast_solve_info *info,
                              toast_error *err)
{
    toast_factor f;
    double *tmp;
    toast_status st;

    if (d < 1 || m < 1)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "empty system (%d x %d)", d, m);
    st = toast_factor_init(&f, d, err);
    if (st != TOAST_OK)
        return st;
    tmp = malloc((size_t)d * m * sizeof(double));
    if (tmp == NULL) {
        toast_factor_free(&f);
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate solver workspace");
    }
    st = toast_factor_compute(&f, A, ridge, 0, err);
    if (st == TOAST_OK)
        st = toast_factor_solve(&f, B, m, W, tmp, err);
    if (st == TOAST_OK && info != NULL)
        *info = f.info;
    free(tmp);
    toast_factor_free(&f);
    return st;
}

/* ------------------------------------------------------------ fits */

/* Gram pieces of one fit: A = X^T X, B = X^T Y (centered on request). */
typedef struct {
    int d;
    double n;
    double *A, *B, *mx, *my, *tmp;
} fit_work;

static void fit_work_free(fit_work *w)
{
    free(w->A);
    free(w->B);
    free(w->mx);
    free(w->my);
    free(w->tmp);
}

static toast_status fit_work_init(fit_work *w, int d, toast_error *err)
{
    size_t dd = (size_t)d * d;
    memset(w, 0, sizeof *w);
    w->d = d;
    w->A = malloc(dd * sizeof(double));
    w->B = malloc(dd * sizeof(double));
    w->mx = malloc((size_t)d * sizeof(double));
    w->my = malloc((size_t)d * sizeof(double));
    w->tmp = malloc(dd * sizeof(double));
    if (!w->A || !w->B || !w->mx || !w->my || !w->tmp) {
        fit_work_free(w);
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate fit workspace for d=%d", d);
    }
    return TOAST_OK;
}

static toast_status check_options(const toast_moments *m,
                                  const toast_fit_options *opt,
                                  toast_error *err)
{
    if (!(opt->ridge >= 0.0) || !isfinite(opt->ridge))
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "ridge must be a finite number >= 0, got %g",
                               opt->ridge);
    if (opt->sel != TOAST_SETS_ALL) {
        if (toast_moments_folds(m) == 0)
            return toast_set_error(err, TOAST_EINVAL, -1,
                                   "a fold was selected but the moments "
                                   "have no folds");
        if (opt->fold < 0 || opt->fold >= toast_moments_folds(m))
            return toast_set_error(err, TOAST_ERANGE, -1,
                                   "fold %d is out of range [0, %d)",
                                   opt->fold, toast_moments_folds(m));
    }
    return TOAST_OK;
}

static toast_status check_state(const toast_moments *m, int i, const char *what,
                                toast_error *err)
{
    if (i < 0 || i >= toast_moments_num_states(m))
        return toast_set_error(err, TOAST_ERANGE, -1,
                               "%s state %d is out of range [0, %d)", what, i,
                               toast_moments_num_states(m));
    return TOAST_OK;
}

/* Loads A = X_i^T X_i and B = X_i^T Y (Y given as the difference of states
 * yp - ym when ym >= 0, else state yp), centered when asked. */
static toast_status load_system(const toast_moments *m, int i, int yp, int ym,
                                const toast_fit_options *opt, fit_work *w,
                                toast_error *err)
{
    const int d = toast_moments_dim(m);
    toast_status st;

    w->n = toast_moments_count(m, opt->sel, opt->fold);
    if (!(w->n > 0.0))
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "no rows to fit from: update the moments "
                               "first");
    st = toast_moments_cross(m, opt->sel, opt->fold, i, i, w->A, err);
    if (st == TOAST_OK)
        st = toast_moments_cross(m, opt->sel, opt->fold, i, yp, w->B, err);
    if (st == TOAST_OK && ym >= 0)
        st = toast_moments_cross(m, opt->sel, opt->fold, i, ym, w->tmp, err);
    if (st != TOAST_OK)
        return st;
    toast_moments_sums(m, opt->sel, opt->fold, i, w->mx);
    toast_moments_sums(m, opt->sel, opt->fold, yp, w->my);
    if (ym >= 0) {
        for (size_t e = 0; e < (size_t)d * d; e++)
            w->B[e] -= w->tmp[e];
        toast_moments_sums(m, opt->sel, opt->fold, ym, w->tmp);
        for (int c = 0; c < d; c++)
            w->my[c] -= w->tmp[c];
    }
    if (opt->center) { /* mx, my still hold column sums here */
        toast_center_cross(w->A, w->mx, w->mx, w->n, d);
        toast_center_cross(w->B, w->mx, w->my, w->n, d);
    }
    for (int c = 0; c < d; c++) {
        w->mx[c] /= w->n;
        w->my[c] /= w->n;
    }
    /* Finite activations can still overflow the float64 sums (|x| ~ 1e154
     * and up); every kind needs a finite system (the SVD of the orthogonal
     * fit reported such input as a LAPACK failure, the diagonal fit
     * returned zeros). */
    for (size_t e = 0; e < (size_t)d * d; e++)
        if (!isfinite(w->A[e]) || !isfinite(w->B[e]))
            return toast_set_error(err, TOAST_ENONFINITE, -1,
                                   "the moments of states %d and %d contain "
                                   "Inf or NaN (float64 sums overflowed: "
                                   "the activations are too large)", i, yp);
    for (int c = 0; c < d; c++)
        if (!isfinite(w->mx[c]) || !isfinite(w->my[c]))
            return toast_set_error(err, TOAST_ENONFINITE, -1,
                                   "the column sums of states %d and %d "
                                   "contain Inf or NaN (float64 sums "
                                   "overflowed)", i, yp);
    return TOAST_OK;
}

static double effective_ridge(const toast_fit_options *opt, const double *A,
                              int d)
{
    return opt->ridge_relative ? opt->ridge * toast_trace(A, d) / d : opt->ridge;
}

static void solve_diagonal(const fit_work *w, double ridge, double *W,
                           toast_solve_info *info)
{
    const int d = w->d;
    double top = 0.0, low = INFINITY;
    int rank = 0;
    memset(W, 0, (size_t)d * d * sizeof(double));
    for (int k = 0; k < d; k++) {
        double a = w->A[(size_t)k * d + k] + ridge;
        if (a > top)
            top = a;
    }
    for (int k = 0; k < d; k++) {
        double a = w->A[(size_t)k * d + k] + ridge;
        if (top > 0.0 && a > (double)d * DBL_EPSILON * top) {
            W[(size_t)k * d + k] = w->B[(size_t)k * d + k] / a;
            rank++;
            if (a < low)
                low = a;
        }
    }
    info->method = TOAST_METHOD_NONE;
    info->rank = rank;
    info->condition = rank == d ? top / low : INFINITY;
}

/* Procrustes: W = U V^T from the SVD B = U diag(sigma) V^T. */
static toast_status solve_orthogonal(fit_work *w, double *W,
                                     toast_solve_info *info, toast_error *err)
{
    const int d = w->d;
    int info_l = 0, lwork = -1;
    double query;
    double *sv = NULL, *u = NULL, *vt = NULL, *work = NULL;
    int *iwork = NULL;
    toast_status st = TOAST_OK;

    sv = malloc((size_t)d * sizeof(double));
    u = malloc((size_t)d * d * sizeof(double));
    vt = malloc((size_t)d * d * sizeof(double));
    iwork = malloc((size_t)8 * d * sizeof(int));
    if (!sv || !u || !vt || !iwork) {
        st = toast_set_error(err, TOAST_ENOMEM, -1,
                             "cannot allocate SVD workspace");
        goto done;
    }
    /* Read column-major, the row-major buffer of B is B^T = V S U^T, so
     * LAPACK returns u = V and vt = U^T; the column-major product u * vt
     * = V U^T = W^T is W when read row-major. */
    toast_dgesdd("A", &d, &d, w->B, &d, sv, u, &d, vt, &d, &query, &lwork,
                 iwork, &info_l, 1);
    if (info_l != 0) {
        st = toast_set_error(err, TOAST_ELAPACK, -1,
                             "dgesdd workspace query failed (info=%d)",
                             info_l);
        goto done;
    }
    lwork = (int)query;
    work = malloc((size_t)lwork * sizeof(double));
    if (work == NULL) {
        st = toast_set_error(err, TOAST_ENOMEM, -1,
                             "cannot allocate SVD workspace");
        goto done;
    }
    toast_dgesdd("A", &d, &d, w->B, &d, sv, u, &d, vt, &d, work, &lwork,
                 iwork, &info_l, 1);
    if (info_l != 0) {
        st = toast_set_error(err, TOAST_ELAPACK, -1,
                             "the SVD (dgesdd) failed with info=%d", info_l);
        goto done;
    }
    toast_dgemm(TOAST_CblasColMajor, TOAST_CblasNoTrans, TOAST_CblasNoTrans, d,
                d, d, 1.0, u, d, vt, d, 0.0, W, d);
    int rank = 0;
    for (int k = 0; k < d; k++)
        if (sv[0] > 0.0 && sv[k] > (double)d * DBL_EPSILON * sv[0])
            rank++;
    info->method = TOAST_METHOD_SVD;
    info->rank = rank;
    info->condition = rank == d ? sv[0] / sv[d - 1] : INFINITY;
done:
    free(sv);
    free(u);
    free(vt);
    free(work);
    free(iwork);
    return st;
}

/* Solves the loaded system by kind and sets the bias. */
static toast_status solve_loaded(fit_work *w, const toast_fit_options *opt,
                                 double *W, double *b, toast_solve_info *info,
                                 toast_error *err)
{
    const int d = w->d;
    double ridge = effective_ridge(opt, w->A, d);
    toast_status st = TOAST_OK;

    switch (opt->kind) {
    case TOAST_FIT_LEASTSQ:
        st = toast_solve_gram(d, w->A, w->B, d, ridge, W, info, err);
        break;
    case TOAST_FIT_DIAGONAL:
        solve_diagonal(w, ridge, W, info);
        break;
    case TOAST_FIT_ORTHOGONAL:
        st = solve_orthogonal(w, W, info, err);
        break;
    default:
        return toast_set_error(err, TOAST_EINVAL, -1, "unknown fit kind %d",
                               (int)opt->kind);
    }
    if (st != TOAST_OK)
        return st;
    /* b = mean_y - mean_x W (zero without centering). */
    for (int c = 0; c < d; c++) {
        double v = 0.0;
        if (opt->center) {
            v = w->my[c];
            for (int r = 0; r < d; r++)
                v -= w->mx[r] * W[(size_t)r * d + c];
        }
        b[c] = v;
    }
    return TOAST_OK;
}

static void set_identity(int d, double *W, double *b, toast_solve_info *info)
{
    memset(W, 0, (size_t)d * d * sizeof(double));
    for (int k = 0; k < d; k++)
        W[(size_t)k * d + k] = 1.0;
    memset(b, 0, (size_t)d * sizeof(double));
    info->method = TOAST_METHOD_NONE;
    info->rank = d;
    info->condition = 1.0;
}

toast_status toast_fit(const toast_moments *m, int i, int j,
                       const toast_fit_options *opt, double *W, double *b,
                       toast_solve_info *info, toast_error *err)
{
    fit_work w;
    toast_status st;

    if ((st = check_state(m, i, "source", err)) != TOAST_OK ||
        (st = check_state(m, j, "target", err)) != TOAST_OK ||
        (st = check_options(m, opt, err)) != TOAST_OK)
        return st;
    if (opt->kind == TOAST_FIT_IDENTITY) {
        set_identity(toast_moments_dim(m), W, b, info);
        return TOAST_OK;
    }
    st = fit_work_init(&w, toast_moments_dim(m), err);
    if (st != TOAST_OK)
        return st;
    st = load_system(m, i, j, -1, opt, &w, err);
    if (st == TOAST_OK)
        st = solve_loaded(&w, opt, W, b, info, err);
    fit_work_free(&w);
    return st;
}

toast_status toast_fit_residual(const toast_moments *m, int mi, int yi, int li,
                                const toast_fit_options *opt, double *W,
                                double *b, toast_solve_info *info,
                                toast_error *err)
{
    fit_work w;
    toast_status st;

    if ((st = check_state(m, mi, "input", err)) != TOAST_OK ||
        (st = check_state(m, yi, "residual", err)) != TOAST_OK ||
        (st = check_state(m, li, "target", err)) != TOAST_OK ||
        (st = check_options(m, opt, err)) != TOAST_OK)
        return st;
    if (opt->kind != TOAST_FIT_LEASTSQ)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "the residual form supports least squares "
                               "only");
    st = fit_work_init(&w, toast_moments_dim(m), err);
    if (st != TOAST_OK)
        return st;
    st = load_system(m, mi, li, yi, opt, &w, err);
    if (st == TOAST_OK)
        st = solve_loaded(&w, opt, W, b, info, err);
    fit_work_free(&w);
    return st;
}
