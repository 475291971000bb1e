/*
 * metrics.c -- the block error matrix from moments.
 *
 * For the linear metrics every source state i is factored once per
 * training set and reused for all targets j > i. With W fitted on a
 * training set and a test set with moments (G_xx, G_xy, s_x, s_y, T_yy =
 * trace(Y^T Y), n), the residual of y - x W - b is, without storing rows,
 *
 *   RSS = T_yy - 2 <W, G_xy> + <W, G_xx W> - 2 b.(s_y - s_x W) + n |b|^2
 *
 * and the error is sqrt(sum RSS / sum T_yy) over the test sets (one set,
 * the training set itself, for in-sample and GCV).
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "toast_blas.h"
#include "toast_core.h"
#include "toast_internal.h"

typedef struct {
    int d;
    double *A, *A0, *B, *W, *AW, *tmp;
    double *sx, *sy, *mx, *my, *bias; /* training sums, means, bias */
    double *tx, *ty;                  /* test sums */
    toast_factor f;
} em_work;

static void em_free(em_work *w)
{
    free(w->A);
    free(w->A0);
    free(w->B);
    free(w->W);
    free(w->AW);
    free(w->tmp);
    free(w->sx);
    free(w->sy);
    free(w->mx);
    free(w->my);
    free(w->bias);
    free(w->tx);
    free(w->ty);
    toast_factor_free(&w->f);
}

static toast_status em_init(em_work *w, int d, toast_error *err)
{
    size_t dd = (size_t)d * d, dv = (size_t)d * sizeof(double);
    memset(w, 0, sizeof *w);
    w->d = d;
    w->A = malloc(dd * sizeof(double));
    w->A0 = malloc(dd * sizeof(double));
    w->B = malloc(dd * sizeof(double));
    w->W = malloc(dd * sizeof(double));
    w->AW = malloc(dd * sizeof(double));
    w->tmp = malloc(dd * sizeof(double));
    w->sx = malloc(dv);
    w->sy = malloc(dv);
    w->mx = malloc(dv);
    w->my = malloc(dv);
    w->bias = malloc(dv);
    w->tx = malloc(dv);
    w->ty = malloc(dv);
    if (!w->A || !w->A0 || !w->B || !w->W || !w->AW || !w->tmp || !w->sx ||
        !w->sy || !w->mx || !w->my || !w->bias || !w->tx || !w->ty) {
        em_free(w);
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate error-matrix workspace");
    }
    return toast_factor_init(&w->f, d, err);
}

static double frob_dot(const double *a, const double *b, size_t n)
{
    double s = 0.0;
    for (size_t e = 0; e < n; e++)
        s += a[e] * b[e];
    return s;
}

static int has_rows(const toast_moments *m, int i)
{
    for (int j = i + 1; j < toast_moments_num_states(m); j++)
        if (toast_moments_pair(m, i, j) >= 0)
            return 1;
    return 0;
}

/* Factors the (centered) Gram of state i over a training set. Leaves the
 * unregularized Gram in A0, its column sums in sx, and the mean in mx. */
static toast_status factor_source(const toast_moments *m, em_work *w, int i,
                                  toast_sets sel, int k, int affine,
                                  double ridge, int ridge_rel, int eigh,
                                  double n, toast_error *err)
{
    const int d = toast_moments_dim(m);
    toast_status st = toast_moments_cross(m, sel, k, i, i, w->A0, err);
    if (st != TOAST_OK)
        return st;
    toast_moments_sums(m, sel, k, i, w->sx);
    for (int c = 0; c < d; c++)
        w->mx[c] = w->sx[c] / n;
    if (affine)
        toast_center_cross(w->A0, w->sx, w->sx, n, d);
    double lambda = ridge_rel ? ridge * toast_trace(w->A0, d) / d : ridge;
    return toast_factor_compute(&w->f, w->A0, lambda, eigh, err);
}

/* Solves W (and bias) for target j on the factored training set. */
static toast_status solve_target(const toast_moments *m, em_work *w, int i,
                                 int j, toast_sets sel, int k, int affine,
                                 double n, toast_error *err)
{
    const int d = toast_moments_dim(m);
    toast_status st = toast_moments_cross(m, sel, k, i, j, w->B, err);
    if (st != TOAST_OK)
        return st;
    toast_moments_sums(m, sel, k, j, w->sy);
    for (int c = 0; c < d; c++)
        w->my[c] = w->sy[c] / n;
    if (affine)
        toast_center_cross(w->B, w->sx, w->sy, n, d);
    st = toast_factor_solve(&w->f, w->B, d, w->W, w->tmp, err);
    if (st != TOAST_OK)
        return st;
    for (int c = 0; c < d; c++) {
        double v = 0.0;
        if (affine) {
            v = w->my[c];
            for (int r = 0; r < d; r++)
                v -= w->mx[r] * w->W[(size_t)r * d + c];
        }
        w->bias[c] = v;
    }
    return TOAST_OK;
}

static toast_status trace_of_block(const toast_moments *m, toast_sets sel,
                                   int k, int j, double *scratch, double *out,
                                   toast_error *err)
{
    toast_status st = toast_moments_cross(m, sel, k, j, j, scratch, err);
    if (st == TOAST_OK)
        *out = toast_trace(scratch, toast_moments_dim(m));
    return st;
}

/* Loads the test-set Gram of source state i into w->A and its column sums
 * into w->tx: shared by every target j of that source and test set. */
static toast_status load_test_source(const toast_moments *m, em_work *w,
                                     int i, toast_sets sel, int k,
                                     toast_error *err)
{
    toast_moments_sums(m, sel, k, i, w->tx);
    return toast_moments_cross(m, sel, k, i, i, w->A, err);
}

/* RSS of the current W, bias on a test set (formula in the header); the
 * test set's source Gram and sums come from load_test_source. */
static toast_status test_rss(const toast_moments *m, em_work *w, int i, int j,
                             toast_sets sel, int k, double *rss,
                             double *tyy, toast_error *err)
{
    const int d = toast_moments_dim(m);
    const size_t dd = (size_t)d * d;
    double n = toast_moments_count(m, sel, k);
    toast_status st;

    st = trace_of_block(m, sel, k, j, w->tmp, tyy, err);
    if (st != TOAST_OK)
        return st;
    /* <W, G_xy> */
    st = toast_moments_cross(m, sel, k, i, j, w->tmp, err);
    if (st != TOAST_OK)
        return st;
    double r = *tyy - 2.0 * frob_dot(w->W, w->tmp, dd);
    /* <W, G_xx W> */
    toast_dgemm(TOAST_CblasRowMajor, TOAST_CblasNoTrans, TOAST_CblasNoTrans, d,
                d, d, 1.0, w->A, d, w->W, d, 0.0, w->AW, d);
    r += frob_dot(w->W, w->AW, dd);
    /* bias terms with the test sums s_x and s_y */
    toast_moments_sums(m, sel, k, j, w->ty);
    double bb = 0.0, bres = 0.0;
    for (int c = 0; c < d; c++) {
        double res = w->ty[c];
        for (int q = 0; q < d; q++)
            res -= w->tx[q] * w->W[(size_t)q * d + c];
        bres += w->bias[c] * res;
        bb += w->bias[c] * w->bias[c];
    }
    r += -2.0 * bres + n * bb;
    *rss = r > 0.0 ? r : 0.0;
    return TOAST_OK;
}

/* GCV error of pair (i, j) on the eigen-factored Gram of i. */
static toast_status gcv_error(const toast_moments *m, em_work *w, int i, int j,
                              int affine, double n, double *out,
                              toast_error *err)
{
    const int d = toast_moments_dim(m);
    double rss, tyy;
    toast_status st = solve_target(m, w, i, j, TOAST_SETS_ALL, 0, affine, n,
                                   err);
    if (st == TOAST_OK)
        st = test_rss(m, w, i, j, TOAST_SETS_ALL, 0, &rss, &tyy, err);
    if (st != TOAST_OK)
        return st;
    /* tr(H) = sum s/(s + ridge) over the kept eigenvalues, +1 for a bias */
    double trh = affine ? 1.0 : 0.0;
    double top = w->f.s[d - 1] + w->f.ridge;
    for (int q = 0; q < d; q++) {
        double v = w->f.s[q] + w->f.ridge;
        if (top > 0.0 && v > (double)d * DBL_EPSILON * top)
            trh += w->f.s[q] / v;
    }
    if (!(tyy > 0.0) || trh >= n)
        *out = NAN;
    else
        *out = sqrt(rss / tyy) / (1.0 - trh / n);
    return TOAST_OK;
}

/* In-sample RSS of pair (i, j) on the factored Gram of i (all rows). With
 * W solving (G + lambda I) W = C, <W, G W> = <W, C> - lambda |W|^2, so
 *
 *   RSS = T_yy - <W, C> - lambda |W|^2     (T_yy and C centered if affine)
 *
 * without the product G W that test_rss forms; with a Cholesky factor
 * G = U^T U and no ridge, <W, C> = |U^-T C|^2: one triangular solve a
 * target (d^3 flops, against 4 d^3 for solve_target + test_rss). T_yy is
 * returned uncentered, as test_rss returns it. */
static toast_status in_sample_rss(const toast_moments *m, em_work *w, int i,
                                  int j, int affine, double n, double *rss,
                                  double *tyy, toast_error *err)
{
    const int d = toast_moments_dim(m);
    const size_t dd = (size_t)d * d;
    toast_status st = trace_of_block(m, TOAST_SETS_ALL, 0, j, w->tmp, tyy,
                                     err);
    if (st == TOAST_OK)
        st = toast_moments_cross(m, TOAST_SETS_ALL, 0, i, j, w->B, err);
    if (st != TOAST_OK)
        return st;
    double t = *tyy, fit;
    if (affine) {
        toast_moments_sums(m, TOAST_SETS_ALL, 0, j, w->sy);
        toast_center_cross(w->B, w->sx, w->sy, n, d);
        for (int c = 0; c < d; c++)
            t -= w->sy[c] * w->sy[c] / n;
    }
    if (w->f.method == TOAST_METHOD_CHOLESKY && w->f.ridge == 0.0) {
        memcpy(w->W, w->B, dd * sizeof(double));
        toast_dtrsm(TOAST_CblasRowMajor, TOAST_CblasLeft, TOAST_CblasUpper,
                    TOAST_CblasTrans, TOAST_CblasNonUnit, d, d, 1.0, w->f.a,
                    d, w->W, d);
        fit = frob_dot(w->W, w->W, dd);
    } else {
        st = toast_factor_solve(&w->f, w->B, d, w->W, w->tmp, err);
        if (st != TOAST_OK)
            return st;
        fit = frob_dot(w->W, w->B, dd) + w->f.ridge * frob_dot(w->W, w->W, dd);
    }
    *rss = t - fit > 0.0 ? t - fit : 0.0;
    return TOAST_OK;
}

/* GCV of pair (i, j) without a ridge on a Cholesky-factored Gram of i: the
 * factor exists only when the condition number is below 1/TOAST_CHOL_MIN_RCOND,
 * far from where the eigen path cuts an eigenvalue (d eps), so every
 * eigenvalue counts, tr(H) = d (+1 for a bias), and the error is the
 * in-sample one over (1 - tr(H)/n): no eigendecomposition (about 9 d^3 a
 * source) and one triangular solve a target. */
static toast_status gcv_cholesky(const toast_moments *m, em_work *w, int i,
                                 int j, int affine, double n, double *out,
                                 toast_error *err)
{
    double rss, tyy;
    const double trh = toast_moments_dim(m) + (affine ? 1.0 : 0.0);
    toast_status st = in_sample_rss(m, w, i, j, affine, n, &rss, &tyy, err);
    if (st != TOAST_OK)
        return st;
    if (!(tyy > 0.0) || trh >= n)
        *out = NAN;
    else
        *out = sqrt(rss / tyy) / (1.0 - trh / n);
    return TOAST_OK;
}

typedef struct {
    toast_poll_fn fn;
    void *ctx;
} em_poll;

/* TOAST_EINTERRUPTED when the caller's poll function asks to stop. */
static toast_status check_poll(const em_poll *poll, toast_error *err)
{
    if (poll->fn != NULL && poll->fn(poll->ctx))
        return toast_set_error(err, TOAST_EINTERRUPTED, -1,
                               "the error matrix was interrupted");
    return TOAST_OK;
}

static toast_status linear_matrix(const toast_moments *m, int affine,
                                  toast_estimator est, double ridge,
                                  int ridge_rel, double *E, double *cond,
                                  const em_poll *poll, toast_error *err)
{
    const int S = toast_moments_num_states(m);
    em_work w;
    toast_status st;

    if (est == TOAST_EST_CV && toast_moments_folds(m) < 2)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "the cv estimator needs moments with folds "
                               ">= 2");
    st = em_init(&w, toast_moments_dim(m), err);
    if (st != TOAST_OK)
        return st;

    const int nfolds = est == TOAST_EST_CV ? toast_moments_folds(m) : 1;
    const toast_sets sel = est == TOAST_EST_CV ? TOAST_SETS_EXCEPT
                                               : TOAST_SETS_ALL;
    const toast_sets test_sel = est == TOAST_EST_CV ? TOAST_SETS_ONLY
                                                    : TOAST_SETS_ALL;
    /* per (i, j): sum of RSS and of T_yy over folds */
    double *rss = calloc((size_t)S * S, sizeof(double));
    double *tyy = calloc((size_t)S * S, sizeof(double));
    if (rss == NULL || tyy == NULL) {
        st = toast_set_error(err, TOAST_ENOMEM, -1,
                             "cannot allocate error-matrix workspace");
        goto done;
    }
    for (int i = 0; i < S - 1 && st == TOAST_OK; i++) {
        if (!has_rows(m, i))
            continue;
        for (int k = 0; k < nfolds && st == TOAST_OK; k++) {
            double n = toast_moments_count(m, sel, k);
            if (!(n > 0.0) || (est == TOAST_EST_CV &&
                               !(toast_moments_count(m, test_sel, k) > 0.0)))
                continue;
            /* GCV needs the eigenvalues only with a ridge (gcv_cholesky) */
            st = factor_source(m, &w, i, sel, k, affine, ridge, ridge_rel,
                               est == TOAST_EST_GCV && ridge > 0.0, n, err);
            if (st == TOAST_OK)
                st = load_test_source(m, &w, i, test_sel, k, err);
            if (st != TOAST_OK)
                break;
            if (cond != NULL && (isnan(cond[i]) ||
                                 w.f.info.condition > cond[i]))
                cond[i] = w.f.info.condition;
            for (int j = i + 1; j < S && st == TOAST_OK; j++) {
                if (toast_moments_pair(m, i, j) < 0)
                    continue;
                st = check_poll(poll, err);
                if (st != TOAST_OK)
                    break;
                if (est == TOAST_EST_GCV) {
                    st = w.f.method == TOAST_METHOD_CHOLESKY
                             ? gcv_cholesky(m, &w, i, j, affine, n,
                                            &E[i * S + j], err)
                             : gcv_error(m, &w, i, j, affine, n,
                                         &E[i * S + j], err);
                    continue;
                }
                double r, t;
                if (est == TOAST_EST_IN_SAMPLE) {
                    st = in_sample_rss(m, &w, i, j, affine, n, &r, &t, err);
                } else {
                    st = solve_target(m, &w, i, j, sel, k, affine, n, err);
                    if (st == TOAST_OK)
                        st = test_rss(m, &w, i, j, test_sel, k, &r, &t, err);
                }
                if (st == TOAST_OK) {
                    rss[i * S + j] += r;
                    tyy[i * S + j] += t;
                }
            }
        }
        if (est == TOAST_EST_GCV)
            continue;
        for (int j = i + 1; j < S; j++) {
            size_t at = (size_t)i * S + j;
            if (toast_moments_pair(m, i, j) >= 0 && tyy[at] > 0.0)
                E[at] = sqrt(rss[at] / tyy[at]);
        }
    }
done:
    free(rss);
    free(tyy);
    em_free(&w);
    return st;
}

/* Linear CKA of the centered states i and j. */
static toast_status cka_matrix(const toast_moments *m, double *E,
                               const em_poll *poll, toast_error *err)
{
    const int S = toast_moments_num_states(m), d = toast_moments_dim(m);
    const size_t dd = (size_t)d * d;
    double n = toast_moments_count(m, TOAST_SETS_ALL, 0);
    double *G = malloc(dd * sizeof(double));
    double *si = malloc((size_t)d * sizeof(double));
    double *sj = malloc((size_t)d * sizeof(double));
    double *self = malloc((size_t)S * sizeof(double));
    toast_status st = TOAST_OK;

    if (!G || !si || !sj || !self) {
        st = toast_set_error(err, TOAST_ENOMEM, -1,
                             "cannot allocate CKA workspace");
        goto done;
    }
    if (!(n > 0.0))
        goto done;
    for (int i = 0; i < S && st == TOAST_OK; i++) {
        st = toast_moments_cross(m, TOAST_SETS_ALL, 0, i, i, G, err);
        toast_moments_sums(m, TOAST_SETS_ALL, 0, i, si);
        toast_center_cross(G, si, si, n, d);
        self[i] = sqrt(frob_dot(G, G, dd));
    }
    for (int i = 0; i < S && st == TOAST_OK; i++) {
        for (int j = i + 1; j < S && st == TOAST_OK; j++) {
            if (toast_moments_pair(m, i, j) < 0)
                continue;
            st = check_poll(poll, err);
            if (st == TOAST_OK)
                st = toast_moments_cross(m, TOAST_SETS_ALL, 0, i, j, G, err);
            if (st != TOAST_OK)
                break;
            toast_moments_sums(m, TOAST_SETS_ALL, 0, i, si);
            toast_moments_sums(m, TOAST_SETS_ALL, 0, j, sj);
            toast_center_cross(G, si, sj, n, d);
            double den = self[i] * self[j];
            if (den > 0.0)
                E[i * S + j] = frob_dot(G, G, dd) / den;
        }
    }
done:
    free(G);
    free(si);
    free(sj);
    free(self);
    return st;
}

/* Metrics averaged per row from the row statistics. */
static void row_metric_matrix(const toast_moments *m, toast_metric metric,
                              double *E)
{
    const int S = toast_moments_num_states(m);
    double n = toast_moments_count(m, TOAST_SETS_ALL, 0);
    if (!(n > 0.0))
        return;
    for (int i = 0; i < S; i++) {
        for (int j = i + 1; j < S; j++) {
            double v;
            switch (metric) {
            case TOAST_METRIC_MSE:
            case TOAST_METRIC_BR:
                v = toast_moments_rowstat(m, TOAST_SETS_ALL, 0,
                                          TOAST_RS_SQDIST, i, j) / n;
                if (metric == TOAST_METRIC_BR)
                    v = -v;
                break;
            case TOAST_METRIC_COSINE:
                v = 1.0 - toast_moments_rowstat(m, TOAST_SETS_ALL, 0,
                                                TOAST_RS_COS, i, j) / n;
                break;
            case TOAST_METRIC_ANGULAR:
                v = toast_moments_rowstat(m, TOAST_SETS_ALL, 0,
                                          TOAST_RS_ANGLE, i, j) / n;
                break;
            default: /* TOAST_METRIC_EUCLIDEAN */
                v = toast_moments_rowstat(m, TOAST_SETS_ALL, 0, TOAST_RS_DIST,
                                          i, j) / n;
                break;
            }
            E[i * S + j] = v;
        }
    }
}

toast_status toast_error_matrix(const toast_moments *m, toast_metric metric,
                                toast_estimator est, double ridge,
                                int ridge_relative, double *E, double *cond,
                                toast_error *err)
{
    return toast_error_matrix_poll(m, metric, est, ridge, ridge_relative, E,
                                   cond, NULL, NULL, err);
}

toast_status toast_error_matrix_poll(const toast_moments *m,
                                     toast_metric metric, toast_estimator est,
                                     double ridge, int ridge_relative,
                                     double *E, double *cond,
                                     toast_poll_fn poll_fn, void *poll_ctx,
                                     toast_error *err)
{
    const int S = toast_moments_num_states(m);
    const em_poll poll = {poll_fn, poll_ctx};
    for (size_t e = 0; e < (size_t)S * S; e++)
        E[e] = NAN;
    for (int i = 0; cond != NULL && i < S; i++)
        cond[i] = NAN;
    if (!(ridge >= 0.0) || !isfinite(ridge))
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "ridge must be a finite number >= 0, got %g",
                               ridge);
    if (est != TOAST_EST_IN_SAMPLE && est != TOAST_EST_CV &&
        est != TOAST_EST_GCV)
        return toast_set_error(err, TOAST_EINVAL, -1, "unknown estimator %d",
                               (int)est);
    switch (metric) {
    case TOAST_METRIC_LINEAR:
    case TOAST_METRIC_AFFINE:
        return linear_matrix(m, metric == TOAST_METRIC_AFFINE, est, ridge,
                             ridge_relative, E, cond, &poll, err);
    case TOAST_METRIC_CKA:
        return cka_matrix(m, E, &poll, err);
    case TOAST_METRIC_MSE:
    case TOAST_METRIC_BR:
    case TOAST_METRIC_COSINE:
    case TOAST_METRIC_ANGULAR:
    case TOAST_METRIC_EUCLIDEAN:
        if (!toast_moments_has_rowstats(m))
            return toast_set_error(err, TOAST_ENOTSTORED, -1,
                                   "these moments were built without row "
                                   "statistics (row_stats=False); the row "
                                   "metrics need them");
        row_metric_matrix(m, metric, E);
        return TOAST_OK;
    }
    return toast_set_error(err, TOAST_EINVAL, -1, "unknown metric %d",
                           (int)metric);
}
