/*
 * geomedian.c -- centers and importance scores of point sets: the geometric
 * median (Weiszfeld's algorithm with Vardi & Zhang's modification), the
 * coordinate-wise median, FPGM's sum of distances, and L1 / L2 norms.
 *
 * ToaSt's structured coupled weight pruning scores the d_k coupled vectors
 * of one attention head (n points in R^p, rows of X) by their distance to
 * the head's center; the points closest to the center are the most
 * redundant. Everything here works on small dense row-major float64
 * matrices and allocates only O(n + p) scratch per call.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "toast_core.h"

/* A data point counts as coinciding with the iterate when its distance is
 * at most this fraction of the mean distance from the iterate to the data. */
#define GM_COINCIDE 1e-12

/* ------------------------------------------------------------ checks */

static toast_status check_points(int n, int p, const double *X,
                                 toast_error *err)
{
    if (n < 1 || p < 1)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "need at least one point of dimension >= 1, "
                               "got n = %d, p = %d", n, p);
    if ((size_t)n > SIZE_MAX / sizeof(double) / (size_t)p)
        return toast_set_error(err, TOAST_EOVERFLOW, -1,
                               "%d x %d points overflow size_t", n, p);
    if (X == NULL)
        return toast_set_error(err, TOAST_EINVAL, -1, "X is NULL");
    size_t total = (size_t)n * (size_t)p;
    for (size_t e = 0; e < total; e++)
        if (!isfinite(X[e]))
            return toast_set_error(err, TOAST_ENONFINITE, (int)(e / p),
                                   "point %d has a NaN or Inf coordinate",
                                   (int)(e / p));
    return TOAST_OK;
}

static toast_status check_weights(int n, const double *w, toast_error *err)
{
    if (w == NULL)
        return TOAST_OK;
    double total = 0.0;
    for (int i = 0; i < n; i++) {
        if (!isfinite(w[i]) || w[i] < 0.0)
            return toast_set_error(err, TOAST_EINVAL, i,
                                   "weight %d must be finite and >= 0, got %g",
                                   i, w[i]);
        total += w[i];
    }
    if (!(total > 0.0) || !isfinite(total))
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "the weights must have a positive finite sum");
    return TOAST_OK;
}

static toast_status check_iteration(double tol, int max_iter, toast_error *err)
{
    if (!isfinite(tol) || !(tol >= 0.0))
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "tol must be finite and >= 0, got %g", tol);
    if (max_iter < 0)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "max_iter must be >= 0, got %d", max_iter);
    return TOAST_OK;
}

/* ------------------------------------------------------------ helpers */

static int all_finite(int n, const double *v)
{
    for (int i = 0; i < n; i++)
        if (!isfinite(v[i]))
            return 0;
    return 1;
}

static double weight_of(const double *w, int i)
{
    return w == NULL ? 1.0 : w[i];
}

static double distance(const double *a, const double *b, int p)
{
    double s = 0.0;
    for (int c = 0; c < p; c++) {
        double t = a[c] - b[c];
        s += t * t;
    }
    return sqrt(s);
}

/* y = weighted centroid of the points. */
static void centroid(int n, int p, const double *X, const double *w,
                     double *y)
{
    double total = 0.0;
    memset(y, 0, (size_t)p * sizeof(double));
    for (int i = 0; i < n; i++) {
        double wi = weight_of(w, i);
        const double *x = X + (size_t)i * p;
        for (int c = 0; c < p; c++)
            y[c] += wi * x[c];
        total += wi;
    }
    for (int c = 0; c < p; c++)
        y[c] /= total;
}

/* Distances from y to every point; returns their weighted mean. */
static double distances(int n, int p, const double *X, const double *w,
                        const double *y, double *d)
{
    double sum = 0.0, total = 0.0;
    for (int i = 0; i < n; i++) {
        d[i] = distance(X + (size_t)i * p, y, p);
        sum += weight_of(w, i) * d[i];
        total += weight_of(w, i);
    }
    return sum / total;
}

/* One Weiszfeld step's ingredients: T = sum_i (w_i / d_i) x_i / D over the
 * points that do not coincide with y, D = sum of those w_i / d_i, and eta =
 * the weight of the points that do. */
typedef struct {
    double D, eta;
} gm_step;

static gm_step weiszfeld_target(int n, int p, const double *X, const double *w,
                                const double *d, double eps, double *T)
{
    gm_step s = {0.0, 0.0};
    memset(T, 0, (size_t)p * sizeof(double));
    for (int i = 0; i < n; i++) {
        double wi = weight_of(w, i);
        if (d[i] <= eps) {
            s.eta += wi;
            continue;
        }
        double a = wi / d[i];
        const double *x = X + (size_t)i * p;
        for (int c = 0; c < p; c++)
            T[c] += a * x[c];
        s.D += a;
    }
    if (s.D > 0.0)
        for (int c = 0; c < p; c++)
            T[c] /= s.D;
    return s;
}

/* Vardi & Zhang (2000): when the iterate y coincides with data of weight
 * eta, R = sum over the other points of w_i (x_i - y) / d_i = D (T - y).
 * If ||R|| <= eta, y is the median (returns 1). Otherwise the next iterate
 * is (1 - eta/||R||) T + (eta/||R||) y, written into T. */
static int vardi_zhang(int p, const double *y, gm_step s, double *T)
{
    double r = s.D * distance(T, y, p);
    if (r <= s.eta)
        return 1;
    double beta = s.eta / r;
    for (int c = 0; c < p; c++)
        T[c] = (1.0 - beta) * T[c] + beta * y[c];
    return 0;
}

/* Runs the iteration from y (the centroid) in place; scratch d (n), T (p). */
static void weiszfeld(int n, int p, const double *X, const double *w,
                      double tol, int max_iter, double *y, double *d,
                      double *T, toast_gm_info *info)
{
    for (int t = 0; t < max_iter; t++) {
        double scale = distances(n, p, X, w, y, d);
        if (scale == 0.0) {          /* every point is y */
            info->converged = 1;
            return;
        }
        gm_step s = weiszfeld_target(n, p, X, w, d, GM_COINCIDE * scale, T);
        if (s.D == 0.0) {            /* every weighted point coincides */
            info->converged = 1;
            return;
        }
        if (s.eta > 0.0) {
            info->hits++;
            if (vardi_zhang(p, y, s, T)) {
                info->converged = 1;
                return;
            }
        }
        double step = distance(T, y, p);
        memcpy(y, T, (size_t)p * sizeof(double));
        info->iterations = t + 1;
        if (step <= tol * scale) {
            info->converged = 1;
            return;
        }
    }
}

/* ------------------------------------------------------------ public */

toast_status toast_geometric_median(int n, int p, const double *X,
                                    const double *w, double tol, int max_iter,
                                    double *y, toast_gm_info *info,
                                    toast_error *err)
{
    toast_gm_info local = {0, 0, 0};
    toast_status st = check_points(n, p, X, err);
    if (st == TOAST_OK)
        st = check_weights(n, w, err);
    if (st == TOAST_OK)
        st = check_iteration(tol, max_iter, err);
    if (st == TOAST_OK && y == NULL)
        st = toast_set_error(err, TOAST_EINVAL, -1, "y is NULL");
    if (st != TOAST_OK)
        return st;
    double *d = malloc((size_t)n * sizeof(double));
    double *T = malloc((size_t)p * sizeof(double));
    if (d == NULL || T == NULL) {
        free(d);
        free(T);
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate geometric-median scratch");
    }
    centroid(n, p, X, w, y);
    weiszfeld(n, p, X, w, tol, max_iter, y, d, T, &local);
    free(d);
    free(T);
    if (!all_finite(p, y))
        return toast_set_error(err, TOAST_ENONFINITE, -1,
                               "the geometric median overflowed float64 "
                               "(coordinates too large)");
    if (info != NULL)
        *info = local;
    return TOAST_OK;
}

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Lower median of column c into y[c]; col: n doubles of scratch. */
static void column_median(int n, int p, const double *X, int c, double *col,
                          double *y)
{
    for (int i = 0; i < n; i++)
        col[i] = X[(size_t)i * p + c];
    qsort(col, (size_t)n, sizeof(double), compare_doubles);
    y[c] = col[(n - 1) / 2];
}

toast_status toast_coordinate_median(int n, int p, const double *X, double *y,
                                     toast_error *err)
{
    toast_status st = check_points(n, p, X, err);
    if (st == TOAST_OK && y == NULL)
        st = toast_set_error(err, TOAST_EINVAL, -1, "y is NULL");
    if (st != TOAST_OK)
        return st;
    double *col = malloc((size_t)n * sizeof(double));
    if (col == NULL)
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate a column of %d values", n);
    for (int c = 0; c < p; c++)
        column_median(n, p, X, c, col, y);
    free(col);
    return TOAST_OK;
}

/* scores[j] = ||x_j - center||. */
static void center_distances(int n, int p, const double *X,
                             const double *center, double *scores)
{
    for (int j = 0; j < n; j++)
        scores[j] = distance(X + (size_t)j * p, center, p);
}

/* scores[j] = sum_i ||x_j - x_i|| (each pair computed once). */
static void fpgm_scores(int n, int p, const double *X, double *scores)
{
    memset(scores, 0, (size_t)n * sizeof(double));
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++) {
            double dij = distance(X + (size_t)i * p, X + (size_t)j * p, p);
            scores[i] += dij;
            scores[j] += dij;
        }
}

static void norm_scores(int n, int p, const double *X, int l1,
                        double *scores)
{
    for (int j = 0; j < n; j++) {
        const double *x = X + (size_t)j * p;
        double s = 0.0;
        for (int c = 0; c < p; c++)
            s += l1 ? fabs(x[c]) : x[c] * x[c];
        scores[j] = l1 ? s : sqrt(s);
    }
}

/* Scores against a center computed into fresh scratch (GM or coord. median). */
static toast_status centered_scores(int n, int p, const double *X,
                                    toast_dimscore kind, double tol,
                                    int max_iter, double *scores,
                                    toast_gm_info *info, toast_error *err)
{
    double *center = malloc((size_t)p * sizeof(double));
    if (center == NULL)
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate a center of dimension %d", p);
    toast_status st =
        kind == TOAST_DIMSCORE_GEOMEDIAN
            ? toast_geometric_median(n, p, X, NULL, tol, max_iter, center,
                                     info, err)
            : toast_coordinate_median(n, p, X, center, err);
    if (st == TOAST_OK)
        center_distances(n, p, X, center, scores);
    free(center);
    return st;
}

toast_status toast_dim_scores(int n, int p, const double *X,
                              toast_dimscore kind, double tol, int max_iter,
                              double *scores, toast_gm_info *info,
                              toast_error *err)
{
    toast_gm_info local = {0, 1, 0};
    toast_status st = check_points(n, p, X, err);
    if (st == TOAST_OK)
        st = check_iteration(tol, max_iter, err);
    if (st == TOAST_OK && scores == NULL)
        st = toast_set_error(err, TOAST_EINVAL, -1, "scores is NULL");
    if (st != TOAST_OK)
        return st;
    switch (kind) {
    case TOAST_DIMSCORE_GEOMEDIAN:
    case TOAST_DIMSCORE_COORD_MEDIAN:
        st = centered_scores(n, p, X, kind, tol, max_iter, scores, &local,
                             err);
        break;
    case TOAST_DIMSCORE_FPGM:
        fpgm_scores(n, p, X, scores);
        break;
    case TOAST_DIMSCORE_L1:
    case TOAST_DIMSCORE_L2:
        norm_scores(n, p, X, kind == TOAST_DIMSCORE_L1, scores);
        break;
    default:
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "unknown score kind %d", (int)kind);
    }
    if (st == TOAST_OK && !all_finite(n, scores))
        st = toast_set_error(err, TOAST_ENONFINITE, -1,
                             "the scores overflowed float64 (coordinates too "
                             "large)");
    if (st == TOAST_OK && info != NULL)
        *info = local;
    return st;
}

toast_status toast_dim_scores_batch(int groups, int n, int p, const double *X,
                                    toast_dimscore kind, double tol,
                                    int max_iter, double *scores,
                                    toast_gm_info *infos, toast_error *err)
{
    if (groups < 0)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "groups must be >= 0, got %d", groups);
    if (n >= 1 && p >= 1 &&
        (size_t)groups > SIZE_MAX / sizeof(double) / (size_t)n / (size_t)p)
        return toast_set_error(err, TOAST_EOVERFLOW, -1,
                               "%d groups of %d x %d points overflow size_t",
                               groups, n, p);
    for (int g = 0; g < groups; g++) {
        toast_gm_info *info = infos == NULL ? NULL : infos + g;
        toast_status st = toast_dim_scores(
            n, p, X + (size_t)g * n * p, kind, tol, max_iter,
            scores == NULL ? NULL : scores + (size_t)g * n, info, err);
        if (st != TOAST_OK) {
            if (err != NULL)
                err->arg = g;
            return st;
        }
    }
    return TOAST_OK;
}
