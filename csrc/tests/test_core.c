/*
 * test_core.c -- tests of the C core without Python.
 *
 * Builds against the core sources (csrc) and OpenBLAS only (see the `ctest`, `ctest-asan`
 * and `ctest-valgrind` targets of the Makefile). Every check counts; the
 * program prints the failures and exits non-zero when there was any.
 * Nothing here may abort: bad arguments must come back as error codes.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "toast_core.h"

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

/* ------------------------------------------------------------ checks */

static int checks, failures;

#define CHECK(cond)                                                        \
    do {                                                                   \
        checks++;                                                          \
        if (!(cond)) {                                                     \
            failures++;                                                    \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__,         \
                    __LINE__, #cond);                                      \
        }                                                                  \
    } while (0)

/* |a - b| <= tol * max(1, |b|) */
#define CHECK_CLOSE(a, b, tol)                                             \
    do {                                                                   \
        double a_ = (a), b_ = (b);                                         \
        double s_ = fabs(b_) > 1.0 ? fabs(b_) : 1.0;                       \
        checks++;                                                          \
        if (!(fabs(a_ - b_) <= (tol) * s_)) {                              \
            failures++;                                                    \
            fprintf(stderr, "%s:%d: CHECK_CLOSE failed: %s = %.17g, "      \
                    "expected %s = %.17g (tol %g)\n", __FILE__, __LINE__,  \
                    #a, a_, #b, b_, (double)(tol));                        \
        }                                                                  \
    } while (0)

/* The call returns `code`; on error, err says the same and has a message. */
#define CHECK_STATUS(expr, want, errp)                                     \
    do {                                                                   \
        toast_status st_ = (expr);                                         \
        checks++;                                                          \
        if (st_ != (want) ||                                               \
            ((want) != TOAST_OK && ((errp)->code != (want) ||              \
                                    (errp)->msg[0] == '\0'))) {            \
            failures++;                                                    \
            fprintf(stderr, "%s:%d: %s returned %d, expected %s (%d); "    \
                    "error message: %s\n", __FILE__, __LINE__, #expr,      \
                    (int)st_, #want, (int)(want), (errp)->msg);            \
        }                                                                  \
    } while (0)

/* ------------------------------------------------------------ helpers */

/* Deterministic pseudo-random numbers in [-1, 1) (64-bit LCG). */
static uint64_t lcg_state = 0x9e3779b97f4a7c15ull;
static double urand(void)
{
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(lcg_state >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

/* A (rows, d) row-major float64 view. */
static toast_view view2(const void *data, toast_dtype t, int64_t rows, int d,
                        size_t itemsize)
{
    toast_view v = {data, t, rows, 1, (int64_t)(d * itemsize), 0,
                    (int64_t)itemsize};
    return v;
}

static toast_view dview(const double *x, int64_t rows, int d)
{
    return view2(x, TOAST_FLOAT64, rows, d, sizeof(double));
}

static toast_moments *new_moments(int S, int d, int folds, int span,
                                  toast_precision prec)
{
    toast_moments *m = NULL;
    toast_error err = {0};
    toast_status st = toast_moments_new(S, d, folds, span, prec, &m, &err);
    if (st != TOAST_OK || m == NULL) {
        fprintf(stderr, "toast_moments_new(%d, %d, %d, %d) failed: %s\n", S,
                d, folds, span, err.msg);
        exit(2);
    }
    return m;
}

static size_t storage_len(const toast_moments *m)
{
    return toast_moments_storage_len(m);
}

/* Largest |a - b| / max(1, |b|) over the whole storage. */
static double storage_diff(const toast_moments *a, const toast_moments *b)
{
    double worst = 0.0;
    if (storage_len(a) != storage_len(b))
        return INFINITY;
    for (size_t e = 0; e < storage_len(a); e++) {
        double s = fabs(toast_moments_data(b)[e]) > 1.0 ? fabs(toast_moments_data(b)[e]) : 1.0;
        double r = fabs(toast_moments_data(a)[e] - toast_moments_data(b)[e]) / s;
        if (!(r <= worst))
            worst = r;
    }
    return worst;
}

/* ------------------------------------------------------------ moments */

static void test_known_moments(void)
{
    /* X0 = [[1,2],[3,4],[5,6]], X1 = [[1,0],[0,1],[2,2]]; see the sums
     * worked out by hand below. */
    static const double X0[] = {1, 2, 3, 4, 5, 6};
    static const double X1[] = {1, 0, 0, 1, 2, 2};
    toast_error err = {0};
    double out[4], s[2];

    for (int prec = 0; prec <= 1; prec++) {
        toast_moments *m = new_moments(2, 2, 0, -1, (toast_precision)prec);
        toast_view v[2] = {dview(X0, 3, 2), dview(X1, 3, 2)};
        CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err), TOAST_OK,
                     &err);
        CHECK(toast_moments_rows(m) == 3);
        CHECK(toast_moments_count(m, TOAST_SETS_ALL, 0) == 3.0);

        toast_moments_sums(m, TOAST_SETS_ALL, 0, 0, s);
        CHECK(s[0] == 9.0 && s[1] == 12.0);
        toast_moments_sums(m, TOAST_SETS_ALL, 0, 1, s);
        CHECK(s[0] == 3.0 && s[1] == 3.0);

        /* X0^T X0 = [[35, 44], [44, 56]] */
        CHECK_STATUS(toast_moments_cross(m, TOAST_SETS_ALL, 0, 0, 0, out,
                                         &err), TOAST_OK, &err);
        CHECK(out[0] == 35 && out[1] == 44 && out[2] == 44 && out[3] == 56);
        /* X0^T X1 = [[11, 13], [14, 16]] and its transpose for (1, 0) */
        CHECK_STATUS(toast_moments_cross(m, TOAST_SETS_ALL, 0, 0, 1, out,
                                         &err), TOAST_OK, &err);
        CHECK(out[0] == 11 && out[1] == 13 && out[2] == 14 && out[3] == 16);
        CHECK_STATUS(toast_moments_cross(m, TOAST_SETS_ALL, 0, 1, 0, out,
                                         &err), TOAST_OK, &err);
        CHECK(out[0] == 11 && out[1] == 14 && out[2] == 13 && out[3] == 16);
        /* X1^T X1 = [[5, 4], [4, 5]] */
        CHECK_STATUS(toast_moments_cross(m, TOAST_SETS_ALL, 0, 1, 1, out,
                                         &err), TOAST_OK, &err);
        CHECK(out[0] == 5 && out[1] == 4 && out[2] == 4 && out[3] == 5);

        /* Row statistics of the pair (0, 1), row by row:
         *   dot 1, |x0|^2 5, |x1|^2 1, |x1 - x0|^2 4
         *   dot 4, 25, 1, 18
         *   dot 22, 61, 8, 25 */
        const double c1 = 1.0 / sqrt(5.0), c2 = 4.0 / 5.0,
                     c3 = 22.0 / sqrt(61.0 * 8.0);
        CHECK_CLOSE(toast_moments_rowstat(m, TOAST_SETS_ALL, 0, TOAST_RS_COS,
                                          0, 1), c1 + c2 + c3, 1e-14);
        CHECK_CLOSE(toast_moments_rowstat(m, TOAST_SETS_ALL, 0,
                                          TOAST_RS_ANGLE, 0, 1),
                    (acos(c1) + acos(c2) + acos(c3)) / M_PI, 1e-14);
        CHECK_CLOSE(toast_moments_rowstat(m, TOAST_SETS_ALL, 0, TOAST_RS_DIST,
                                          0, 1), 2.0 + sqrt(18.0) + 5.0,
                    1e-14);
        CHECK(toast_moments_rowstat(m, TOAST_SETS_ALL, 0, TOAST_RS_SQDIST, 0,
                                    1) == 47.0);

        /* The row metrics of the error matrix are these sums over n. */
        double E[4], cond[2];
        CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_MSE,
                                        TOAST_EST_IN_SAMPLE, 0.0, 0, E, cond,
                                        &err), TOAST_OK, &err);
        CHECK_CLOSE(E[1], 47.0 / 3.0, 1e-15);
        CHECK(isnan(E[0]) && isnan(E[2]) && isnan(E[3]));
        CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_BR,
                                        TOAST_EST_IN_SAMPLE, 0.0, 0, E, NULL,
                                        &err), TOAST_OK, &err);
        CHECK_CLOSE(E[1], -47.0 / 3.0, 1e-15);
        CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_EUCLIDEAN,
                                        TOAST_EST_IN_SAMPLE, 0.0, 0, E, NULL,
                                        &err), TOAST_OK, &err);
        CHECK_CLOSE(E[1], (7.0 + sqrt(18.0)) / 3.0, 1e-15);
        CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_COSINE,
                                        TOAST_EST_IN_SAMPLE, 0.0, 0, E, NULL,
                                        &err), TOAST_OK, &err);
        CHECK_CLOSE(E[1], 1.0 - (c1 + c2 + c3) / 3.0, 1e-15);
        toast_moments_free(m);
    }
}

/* The same rows read through differently laid-out views. */
static void test_strided_views(void)
{
    enum { N = 6, D = 3 };
    double rowmajor[N * D], colmajor[D * N];
    toast_error err = {0};
    for (int r = 0; r < N; r++)
        for (int c = 0; c < D; c++) {
            double x = urand();
            rowmajor[r * D + c] = x;
            colmajor[c * N + r] = x;
        }
    toast_moments *ref = new_moments(1, D, 0, -1, TOAST_PRECISION_FLOAT64);
    toast_view v = dview(rowmajor, N, D);
    CHECK_STATUS(toast_moments_update(ref, &v, NULL, NULL, &err), TOAST_OK,
                 &err);

    /* transposed storage */
    toast_moments *m = new_moments(1, D, 0, -1, TOAST_PRECISION_FLOAT64);
    toast_view t = {colmajor, TOAST_FLOAT64, N, 1, sizeof(double), 0,
                    N * sizeof(double)};
    CHECK_STATUS(toast_moments_update(m, &t, NULL, NULL, &err), TOAST_OK,
                 &err);
    CHECK(storage_diff(m, ref) <= 1e-15);
    toast_moments_free(m);

    /* rows in reverse order (negative stride) */
    m = new_moments(1, D, 0, -1, TOAST_PRECISION_FLOAT64);
    toast_view rev = {rowmajor + (N - 1) * D, TOAST_FLOAT64, N, 1,
                      -(int64_t)(D * sizeof(double)), 0, sizeof(double)};
    CHECK_STATUS(toast_moments_update(m, &rev, NULL, NULL, &err), TOAST_OK,
                 &err);
    CHECK(storage_diff(m, ref) <= 1e-14);
    toast_moments_free(m);

    /* (batch, tokens, d) = (2, 3, D) */
    m = new_moments(1, D, 0, -1, TOAST_PRECISION_FLOAT64);
    toast_view b3 = {rowmajor, TOAST_FLOAT64, 2, 3,
                     3 * D * (int64_t)sizeof(double),
                     D * (int64_t)sizeof(double), sizeof(double)};
    CHECK_STATUS(toast_moments_update(m, &b3, NULL, NULL, &err), TOAST_OK,
                 &err);
    CHECK(storage_diff(m, ref) <= 1e-15);
    toast_moments_free(m);

    /* float32 rows equal float64 rows holding the same (rounded) values */
    float f32[N * D];
    double back[N * D];
    for (int e = 0; e < N * D; e++) {
        f32[e] = (float)rowmajor[e];
        back[e] = (double)f32[e];
    }
    toast_moments *a = new_moments(1, D, 0, -1, TOAST_PRECISION_FLOAT64);
    toast_moments *b = new_moments(1, D, 0, -1, TOAST_PRECISION_FLOAT64);
    toast_view vf = view2(f32, TOAST_FLOAT32, N, D, sizeof(float));
    toast_view vb = dview(back, N, D);
    CHECK_STATUS(toast_moments_update(a, &vf, NULL, NULL, &err), TOAST_OK,
                 &err);
    CHECK_STATUS(toast_moments_update(b, &vb, NULL, NULL, &err), TOAST_OK,
                 &err);
    CHECK(storage_diff(a, b) == 0.0);
    toast_moments_free(a);
    toast_moments_free(b);
    toast_moments_free(ref);
}

enum { SN = 37, SS = 3, SD = 5 };

static void fill_states(double x[SS][SN * SD])
{
    for (int s = 0; s < SS; s++)
        for (int e = 0; e < SN * SD; e++)
            x[s][e] = urand() + 0.25 * s;
}

static void update_rows(toast_moments *m, double x[SS][SN * SD], int first,
                        int count, const int64_t *fold_ids)
{
    toast_error err = {0};
    toast_view v[SS];
    for (int s = 0; s < SS; s++)
        v[s] = dview(x[s] + (size_t)first * SD, count, SD);
    CHECK_STATUS(toast_moments_update(m, v, NULL, fold_ids, &err), TOAST_OK,
                 &err);
}

/* Rows read in place (contiguous rows of the working type, no mask, no
 * folds) give the sums the packed path forms from the same rows, and
 * restricted moments form exactly the asked blocks and nothing else. */
static void test_direct_and_restricted(void)
{
    double x[SS][SN * SD];
    float f[SS][SN * SD];
    uint8_t all[SN];
    toast_error err = {0};
    toast_view v[SS], vf[SS];
    fill_states(x);
    memset(all, 1, sizeof all);
    for (int s = 0; s < SS; s++) {
        for (int e = 0; e < SN * SD; e++)
            f[s][e] = (float)x[s][e];
        v[s] = dview(x[s], SN, SD);
        vf[s] = view2(f[s], TOAST_FLOAT32, SN, SD, sizeof(float));
    }
    for (int mixed = 0; mixed <= 1; mixed++) {
        toast_precision p = mixed ? TOAST_PRECISION_MIXED : TOAST_PRECISION_FLOAT64;
        const toast_view *in = mixed ? vf : v;
        toast_moments *direct = new_moments(SS, SD, 0, -1, p);
        toast_moments *packed = new_moments(SS, SD, 0, -1, p);
        CHECK_STATUS(toast_moments_update(direct, in, NULL, NULL, &err),
                     TOAST_OK, &err);
        CHECK_STATUS(toast_moments_update(packed, in, all, NULL, &err),
                     TOAST_OK, &err);
        /* BLAS may order the float32 products differently per stride */
        CHECK(storage_diff(direct, packed) <= (mixed ? 1e-6 : 1e-13));
        toast_moments_free(direct);
        toast_moments_free(packed);
    }

    toast_moments *full = new_moments(SS, SD, 0, -1, TOAST_PRECISION_FLOAT64);
    toast_moments *ls = new_moments(SS, SD, 0, -1, TOAST_PRECISION_FLOAT64);
    CHECK_STATUS(toast_moments_restrict(ls, 0, 0, &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_moments_restrict(ls, 0, SS + 1, &err), TOAST_EINVAL,
                 &err);
    CHECK_STATUS(toast_moments_restrict(ls, 0, 1, &err), TOAST_OK, &err);
    CHECK(toast_moments_sources(ls) == 1 && !toast_moments_has_rowstats(ls));
    CHECK_STATUS(toast_moments_update(full, v, NULL, NULL, &err), TOAST_OK,
                 &err);
    CHECK_STATUS(toast_moments_update(ls, v, NULL, NULL, &err), TOAST_OK,
                 &err);
    CHECK_STATUS(toast_moments_restrict(ls, 1, SS, &err), TOAST_EINVAL, &err);
    double a[SD * SD], b[SD * SD], E[SS * SS];
    for (int j = 0; j < SS; j++) {
        toast_moments_cross(full, TOAST_SETS_ALL, 0, 0, j, a, &err);
        CHECK_STATUS(toast_moments_cross(ls, TOAST_SETS_ALL, 0, 0, j, b, &err),
                     TOAST_OK, &err);
        CHECK(memcmp(a, b, sizeof a) == 0);
    }
    CHECK_STATUS(toast_moments_cross(ls, TOAST_SETS_ALL, 0, 1, 1, b, &err),
                 TOAST_ENOTSTORED, &err);
    CHECK(toast_moments_pair(ls, 1, 2) < 0 && toast_moments_pair(ls, 0, 2) >= 0);
    CHECK(toast_moments_rowstat(ls, TOAST_SETS_ALL, 0, TOAST_RS_COS, 0, 1) ==
          0.0);
    CHECK_STATUS(toast_error_matrix(ls, TOAST_METRIC_COSINE, TOAST_EST_GCV,
                                    0.0, 0, E, NULL, &err),
                 TOAST_ENOTSTORED, &err);
    CHECK_STATUS(toast_error_matrix(ls, TOAST_METRIC_LINEAR, TOAST_EST_GCV,
                                    0.0, 0, E, NULL, &err),
                 TOAST_ENOTSTORED, &err);
    CHECK_STATUS(toast_moments_merge(full, ls, &err), TOAST_EINVAL, &err);
    toast_moments_free(full);
    toast_moments_free(ls);
}

static void test_streaming_and_merge(void)
{
    static double x[SS][SN * SD];
    int64_t ids[SN];
    fill_states(x);
    for (int r = 0; r < SN; r++)
        ids[r] = (r * 7) % 4;

    for (int folds = 0; folds <= 3; folds += 3) {
        for (int span = 0; span <= SS - 1; span++) {
            /* one update == two updates (fold ids continue across them) */
            toast_moments *one = new_moments(SS, SD, folds, span,
                                             TOAST_PRECISION_FLOAT64);
            toast_moments *two = new_moments(SS, SD, folds, span,
                                             TOAST_PRECISION_FLOAT64);
            update_rows(one, x, 0, SN, NULL);
            update_rows(two, x, 0, 20, NULL);
            update_rows(two, x, 20, SN - 20, NULL);
            CHECK(toast_moments_rows(one) == SN && toast_moments_rows(two) == SN);
            CHECK(storage_diff(two, one) <= 1e-13);
            toast_moments_free(one);
            toast_moments_free(two);
        }
    }

    /* merge of two halves == one update (explicit fold ids, 4 folds) */
    toast_error err = {0};
    toast_moments *one = new_moments(SS, SD, 4, 1, TOAST_PRECISION_FLOAT64);
    toast_moments *a = new_moments(SS, SD, 4, 1, TOAST_PRECISION_FLOAT64);
    toast_moments *b = new_moments(SS, SD, 4, 1, TOAST_PRECISION_FLOAT64);
    update_rows(one, x, 0, SN, ids);
    update_rows(a, x, 0, 11, ids);
    update_rows(b, x, 11, SN - 11, ids + 11);
    CHECK_STATUS(toast_moments_merge(a, b, &err), TOAST_OK, &err);
    CHECK(toast_moments_rows(a) == SN);
    CHECK(storage_diff(a, one) <= 1e-13);
    for (int k = 0; k < 4; k++) {
        int expect = 0;
        for (int r = 0; r < SN; r++)
            expect += ids[r] == k;
        CHECK(toast_moments_count(a, TOAST_SETS_ONLY, k) == expect);
        CHECK(toast_moments_count(a, TOAST_SETS_EXCEPT, k) == SN - expect);
    }

    /* row counters that would overflow: an error, nothing changed */
    toast_moments *big = new_moments(SS, SD, 4, 1, TOAST_PRECISION_FLOAT64);
    CHECK_STATUS(toast_moments_set_data(big, toast_moments_data(big),
                                        storage_len(big), INT64_MAX - 5,
                                        &err), TOAST_OK, &err);
    double first = toast_moments_data(a)[0];
    CHECK_STATUS(toast_moments_merge(a, big, &err), TOAST_EOVERFLOW, &err);
    CHECK(toast_moments_rows(a) == SN && toast_moments_data(a)[0] == first);
    CHECK_STATUS(toast_moments_merge(big, a, &err), TOAST_EOVERFLOW, &err);
    CHECK(toast_moments_rows(big) == INT64_MAX - 5 && toast_moments_data(big)[0] == 0.0);
    toast_view vb[SS];
    for (int s = 0; s < SS; s++)
        vb[s] = dview(x[s], 6, SD);
    CHECK_STATUS(toast_moments_update(big, vb, NULL, NULL, &err),
                 TOAST_EOVERFLOW, &err);
    CHECK(toast_moments_rows(big) == INT64_MAX - 5 && toast_moments_data(big)[0] == 0.0);
    vb[0].outer = vb[1].outer = vb[2].outer = 5; /* exactly fits */
    CHECK_STATUS(toast_moments_update(big, vb, NULL, NULL, &err), TOAST_OK,
                 &err);
    CHECK(toast_moments_rows(big) == INT64_MAX);
    toast_moments_free(big);

    /* merging mismatched moments fails and changes nothing */
    toast_moments *other = new_moments(SS, SD, 4, 2, TOAST_PRECISION_FLOAT64);
    double before = toast_moments_data(a)[0];
    CHECK_STATUS(toast_moments_merge(a, other, &err), TOAST_EINVAL, &err);
    CHECK(toast_moments_data(a)[0] == before && toast_moments_rows(a) == SN);
    toast_moments_free(other);
    other = new_moments(SS, SD + 1, 4, 1, TOAST_PRECISION_FLOAT64);
    CHECK_STATUS(toast_moments_merge(a, other, &err), TOAST_EINVAL, &err);
    toast_moments_free(other);
    other = new_moments(SS, SD, 0, 1, TOAST_PRECISION_FLOAT64);
    CHECK_STATUS(toast_moments_merge(a, other, &err), TOAST_EINVAL, &err);
    toast_moments_free(other);

    toast_moments_free(one);
    toast_moments_free(a);
    toast_moments_free(b);
}

/* ------------------------------------------------------------ dtypes */

/* Independent decodings of the 16-bit formats. */
static double decode_half(uint16_t h)
{
    int e = (h >> 10) & 0x1f, mant = h & 0x3ff;
    double v = e == 0 ? ldexp(mant, -24) : ldexp(1024 + mant, e - 25);
    return (h & 0x8000) ? -v : v;
}

static double decode_bfloat(uint16_t h)
{
    int e = (h >> 7) & 0xff, mant = h & 0x7f;
    double v = e == 0 ? ldexp(mant, -133) : ldexp(128 + mant, e - 134);
    return (h & 0x8000) ? -v : v;
}

static int half_finite(uint16_t h) { return ((h >> 10) & 0x1f) != 0x1f; }
static int bfloat_finite(uint16_t h) { return ((h >> 7) & 0xff) != 0xff; }

/* Every finite 16-bit pattern: a one-row update of W values gives sums equal
 * to the decoded values exactly (they are exact in binary32 and float64),
 * and the diagonal of X^T X their squares. Both precisions. */
enum { W16 = 64 };
static void check_all_patterns(toast_dtype t, double (*decode)(uint16_t),
                               int (*finite)(uint16_t))
{
    toast_error err = {0};
    uint16_t row[W16];
    double sums[W16], *gram = malloc(sizeof(double) * W16 * W16);
    int n = 0, bad = 0, bad_sq = 0, rows = 0;
    uint32_t h = 0;

    if (gram == NULL) {
        CHECK(gram != NULL);
        return;
    }
    while (h <= 0xffff) {
        n = 0;
        while (n < W16 && h <= 0xffff) {
            if (finite((uint16_t)h))
                row[n++] = (uint16_t)h;
            h++;
        }
        while (n < W16) /* pad the last row with +0 and -0 */
            row[n] = (n & 1) ? 0x8000 : 0x0000, n++;
        for (int prec = 0; prec <= 1; prec++) {
            toast_moments *m = new_moments(1, W16, 0, -1,
                                           (toast_precision)prec);
            toast_view v = view2(row, t, 1, W16, sizeof(uint16_t));
            CHECK_STATUS(toast_moments_update(m, &v, NULL, NULL, &err),
                         TOAST_OK, &err);
            toast_moments_sums(m, TOAST_SETS_ALL, 0, 0, sums);
            toast_moments_cross(m, TOAST_SETS_ALL, 0, 0, 0, gram, &err);
            for (int c = 0; c < W16; c++) {
                double want = decode(row[c]);
                if (sums[c] != want) {
                    if (bad++ < 5)
                        fprintf(stderr, "dtype %d pattern 0x%04x: got %.17g, "
                                "expected %.17g\n", (int)t, row[c], sums[c],
                                want);
                }
                /* squares: exact in float64; in mixed precision the
                 * product is float32 (relative rounding 2^-24) */
                double sq = gram[c * W16 + c], want_sq = want * want;
                if (prec == 0 ? sq != want_sq
                              : !(fabs(sq - want_sq) <= 0x1p-23 * want_sq))
                    bad_sq++;
            }
            toast_moments_free(m);
        }
        rows++;
    }
    CHECK(bad == 0);
    CHECK(rows > 900);
    /* float32 products of the largest bfloat16 values overflow; count only
     * the float64 path and the representable mixed-precision squares */
    CHECK(t == TOAST_BFLOAT16 || bad_sq == 0);
    free(gram);
}

static void test_half_formats(void)
{
    /* spot checks of well-known patterns against literal values */
    static const struct {
        uint16_t bits;
        double value;
    } half[] = {
        {0x3c00, 1.0},   {0xc000, -2.0},  {0x3555, 0.333251953125},
        {0x7bff, 65504.0}, {0x0400, 0x1p-14},  {0x0001, 0x1p-24},
        {0x03ff, 1023 * 0x1p-24}, {0x8001, -0x1p-24}, {0x0000, 0.0},
        {0x8000, -0.0},
    }, bf16[] = {
        {0x3f80, 1.0},   {0xc000, -2.0},  {0x3eab, 0.333984375},
        {0x7f7f, 0x1.fep127}, {0x0080, 0x1p-126}, {0x0001, 0x1p-133},
        {0x007f, 127 * 0x1p-133}, {0x8001, -0x1p-133}, {0x0000, 0.0},
        {0x8000, -0.0},
    };
    for (size_t k = 0; k < sizeof half / sizeof half[0]; k++) {
        CHECK(decode_half(half[k].bits) == half[k].value);
        CHECK(decode_bfloat(bf16[k].bits) == bf16[k].value);
    }
    /* The same patterns through the core: one row of 10 values. */
    for (int fmt = 0; fmt < 2; fmt++) {
        uint16_t row[10];
        double sums[10];
        toast_error err = {0};
        for (int k = 0; k < 10; k++)
            row[k] = fmt == 0 ? half[k].bits : bf16[k].bits;
        toast_moments *m = new_moments(1, 10, 0, -1, TOAST_PRECISION_FLOAT64);
        toast_view v = view2(row, fmt == 0 ? TOAST_FLOAT16 : TOAST_BFLOAT16, 1,
                             10, sizeof(uint16_t));
        CHECK_STATUS(toast_moments_update(m, &v, NULL, NULL, &err), TOAST_OK,
                     &err);
        toast_moments_sums(m, TOAST_SETS_ALL, 0, 0, sums);
        for (int k = 0; k < 10; k++)
            CHECK(sums[k] == (fmt == 0 ? half[k].value : bf16[k].value));
        toast_moments_free(m);
    }
    /* Exhaustively: every finite pattern of both formats. */
    check_all_patterns(TOAST_FLOAT16, decode_half, half_finite);
    check_all_patterns(TOAST_BFLOAT16, decode_bfloat, bfloat_finite);

    /* Every non-finite pattern (Inf, -Inf, every NaN payload) is rejected. */
    int accepted = 0;
    for (int fmt = 0; fmt < 2; fmt++) {
        toast_moments *m = new_moments(1, 2, 0, -1, TOAST_PRECISION_FLOAT64);
        for (uint32_t h = 0; h <= 0xffff; h++) {
            int finite = fmt == 0 ? half_finite((uint16_t)h)
                                  : bfloat_finite((uint16_t)h);
            if (finite)
                continue;
            uint16_t row[2] = {0x3c00, (uint16_t)h};
            toast_error err = {0};
            toast_view v = view2(row, fmt == 0 ? TOAST_FLOAT16 : TOAST_BFLOAT16,
                                 1, 2, sizeof(uint16_t));
            if (toast_moments_update(m, &v, NULL, NULL, &err) !=
                TOAST_ENONFINITE)
                accepted++;
        }
        CHECK(toast_moments_rows(m) == 0 && toast_moments_data(m)[0] == 0.0);
        toast_moments_free(m);
    }
    CHECK(accepted == 0);
}

/* ------------------------------------------------------------ NaN */

static void test_nonfinite_rejected(void)
{
    static double x[SS][SN * SD];
    toast_error err = {0};
    fill_states(x);
    toast_moments *m = new_moments(SS, SD, 3, -1, TOAST_PRECISION_FLOAT64);
    update_rows(m, x, 0, 10, NULL);
    const size_t len = storage_len(m);
    double *copy = malloc(len * sizeof(double));
    CHECK(copy != NULL);
    if (copy == NULL)
        return;
    memcpy(copy, toast_moments_data(m), len * sizeof(double));

    const double bad[] = {NAN, INFINITY, -INFINITY};
    for (int b = 0; b < 3; b++) {
        double saved = x[2][(SN - 1) * SD + 4];
        x[2][(SN - 1) * SD + 4] = bad[b]; /* last row, last state */
        toast_view v[SS];
        for (int s = 0; s < SS; s++)
            v[s] = dview(x[s], SN, SD);
        CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err),
                     TOAST_ENONFINITE, &err);
        CHECK(err.arg == 2);
        CHECK(toast_moments_rows(m) == 10);
        CHECK(memcmp(copy, toast_moments_data(m), len * sizeof(double)) == 0);

        /* a masked-out NaN row is not an error */
        uint8_t mask[SN];
        for (int r = 0; r < SN; r++)
            mask[r] = r != SN - 1;
        toast_moments *t = new_moments(SS, SD, 0, -1,
                                       TOAST_PRECISION_FLOAT64);
        CHECK_STATUS(toast_moments_update(t, v, mask, NULL, &err), TOAST_OK,
                     &err);
        CHECK(toast_moments_rows(t) == SN - 1);
        toast_moments_free(t);
        x[2][(SN - 1) * SD + 4] = saved;
    }
    /* float32 NaN too */
    float f[4] = {1.0f, 2.0f, NAN, 0.0f};
    toast_moments *one = new_moments(1, 2, 0, -1, TOAST_PRECISION_MIXED);
    toast_view vf = view2(f, TOAST_FLOAT32, 2, 2, sizeof(float));
    CHECK_STATUS(toast_moments_update(one, &vf, NULL, NULL, &err),
                 TOAST_ENONFINITE, &err);
    CHECK(toast_moments_rows(one) == 0 && toast_moments_data(one)[0] == 0.0);
    toast_moments_free(one);
    free(copy);
    toast_moments_free(m);
}

/* ------------------------------------------------------------ folds */

static void test_fold_assignment(void)
{
    /* one state, d = 1: row r holds the value r + 1, so the per-fold sums
     * say which rows each fold received */
    double x[9];
    toast_error err = {0};
    double s;
    for (int r = 0; r < 9; r++)
        x[r] = r + 1;

    toast_moments *m = new_moments(1, 1, 3, -1, TOAST_PRECISION_FLOAT64);
    toast_view v = dview(x, 7, 1);
    CHECK_STATUS(toast_moments_update(m, &v, NULL, NULL, &err), TOAST_OK,
                 &err);
    /* rows 0..6 -> folds 0,1,2,0,1,2,0 */
    CHECK(toast_moments_count(m, TOAST_SETS_ONLY, 0) == 3);
    CHECK(toast_moments_count(m, TOAST_SETS_ONLY, 1) == 2);
    CHECK(toast_moments_count(m, TOAST_SETS_ONLY, 2) == 2);
    toast_moments_sums(m, TOAST_SETS_ONLY, 0, 0, &s);
    CHECK(s == 1 + 4 + 7);
    toast_moments_sums(m, TOAST_SETS_ONLY, 1, 0, &s);
    CHECK(s == 2 + 5);
    toast_moments_sums(m, TOAST_SETS_EXCEPT, 1, 0, &s);
    CHECK(s == 1 + 3 + 4 + 6 + 7);
    /* the count continues across updates: rows 7, 8 -> folds 1, 2 */
    v = dview(x + 7, 2, 1);
    CHECK_STATUS(toast_moments_update(m, &v, NULL, NULL, &err), TOAST_OK,
                 &err);
    toast_moments_sums(m, TOAST_SETS_ONLY, 1, 0, &s);
    CHECK(s == 2 + 5 + 8);
    toast_moments_sums(m, TOAST_SETS_ONLY, 2, 0, &s);
    CHECK(s == 3 + 6 + 9);
    CHECK(toast_moments_rows(m) == 9);
    toast_moments_free(m);

    /* masked rows are skipped entirely: they take no fold slot */
    uint8_t mask[9] = {1, 0, 1, 1, 0, 0, 1, 1, 1};
    m = new_moments(1, 1, 2, -1, TOAST_PRECISION_FLOAT64);
    v = dview(x, 9, 1);
    CHECK_STATUS(toast_moments_update(m, &v, mask, NULL, &err), TOAST_OK,
                 &err);
    /* accepted values 1,3,4,7,8,9 -> folds 0,1,0,1,0,1 */
    toast_moments_sums(m, TOAST_SETS_ONLY, 0, 0, &s);
    CHECK(s == 1 + 4 + 8);
    toast_moments_sums(m, TOAST_SETS_ONLY, 1, 0, &s);
    CHECK(s == 3 + 7 + 9);
    CHECK(toast_moments_rows(m) == 6);
    toast_moments_free(m);

    /* explicit ids win; ids of masked rows are not checked */
    int64_t ids[9] = {2, 99, 2, 0, -5, 7, 1, 1, 0};
    m = new_moments(1, 1, 3, -1, TOAST_PRECISION_FLOAT64);
    CHECK_STATUS(toast_moments_update(m, &v, mask, ids, &err), TOAST_OK,
                 &err);
    toast_moments_sums(m, TOAST_SETS_ONLY, 0, 0, &s);
    CHECK(s == 4 + 9);
    toast_moments_sums(m, TOAST_SETS_ONLY, 1, 0, &s);
    CHECK(s == 7 + 8);
    toast_moments_sums(m, TOAST_SETS_ONLY, 2, 0, &s);
    CHECK(s == 1 + 3);
    /* an out-of-range id of an accepted row is an error, nothing added */
    CHECK_STATUS(toast_moments_update(m, &v, NULL, ids, &err), TOAST_ERANGE,
                 &err);
    CHECK(toast_moments_count(m, TOAST_SETS_ALL, 0) == 6);
    toast_moments_free(m);
}

/* ------------------------------------------------------------ solvers */

static void test_solvers(void)
{
    toast_error err = {0};
    toast_solve_info info;
    double W[4];

    /* [[4, 2], [2, 3]] W = [[2], [1]]  ->  W = [0.5, 0] */
    const double A[] = {4, 2, 2, 3}, B[] = {2, 1};
    CHECK_STATUS(toast_solve_gram(2, A, B, 1, 0.0, W, &info, &err), TOAST_OK,
                 &err);
    CHECK(info.method == TOAST_METHOD_CHOLESKY && info.rank == 2);
    CHECK_CLOSE(W[0], 0.5, 1e-15);
    CHECK_CLOSE(W[1], 0.0, 1e-15);
    CHECK(info.condition >= 1.0 && isfinite(info.condition));

    /* two right-hand sides, with a ridge: (A + I) W = B2 */
    const double B2[] = {5, 1, 3, 1}; /* columns [5,3] and [1,1] */
    /* A + I = [[5, 2], [2, 4]], det 16, inverse [[4, -2], [-2, 5]] / 16 */
    CHECK_STATUS(toast_solve_gram(2, A, B2, 2, 1.0, W, &info, &err),
                 TOAST_OK, &err);
    CHECK_CLOSE(W[0], (4 * 5 - 2 * 3) / 16.0, 1e-15);
    CHECK_CLOSE(W[2], (-2 * 5 + 5 * 3) / 16.0, 1e-15);
    CHECK_CLOSE(W[1], (4 * 1 - 2 * 1) / 16.0, 1e-15);
    CHECK_CLOSE(W[3], (-2 * 1 + 5 * 1) / 16.0, 1e-15);

    /* singular: [[1, 1], [1, 1]] W = [[2], [2]] has the minimum-norm
     * solution pinv(A) B = [1, 1] */
    const double S1[] = {1, 1, 1, 1}, BS[] = {2, 2};
    CHECK_STATUS(toast_solve_gram(2, S1, BS, 1, 0.0, W, &info, &err),
                 TOAST_OK, &err);
    CHECK(info.method == TOAST_METHOD_EIGH);
    CHECK(info.rank == 1);
    CHECK(isinf(info.condition));
    CHECK_CLOSE(W[0], 1.0, 1e-14);
    CHECK_CLOSE(W[1], 1.0, 1e-14);

    /* zero matrix: rank 0, W = 0 */
    const double Z[] = {0, 0, 0, 0};
    CHECK_STATUS(toast_solve_gram(2, Z, BS, 1, 0.0, W, &info, &err),
                 TOAST_OK, &err);
    CHECK(info.rank == 0 && W[0] == 0.0 && W[1] == 0.0);

    /* bad arguments */
    const double N1[] = {1, NAN, NAN, 1};
    CHECK_STATUS(toast_solve_gram(2, N1, BS, 1, 0.0, W, &info, &err),
                 TOAST_ENONFINITE, &err);
    CHECK_STATUS(toast_solve_gram(0, A, B, 1, 0.0, W, &info, &err),
                 TOAST_EINVAL, &err);
    CHECK_STATUS(toast_solve_gram(2, A, B, 0, 0.0, W, &info, &err),
                 TOAST_EINVAL, &err);
    CHECK_STATUS(toast_solve_gram(2, A, B, 1, -1.0, W, &info, &err),
                 TOAST_EINVAL, &err);
    CHECK_STATUS(toast_solve_gram(2, A, B, 1, NAN, W, &info, &err),
                 TOAST_EINVAL, &err);
    CHECK_STATUS(toast_solve_gram(2, A, B, 1, INFINITY, W, &info, &err),
                 TOAST_EINVAL, &err);
}

/* ------------------------------------------------------------ fits */

enum { LN = 40, LD = 4 };

static void test_exact_linear(void)
{
    /* Y = X M exactly (up to rounding); Z = 2 X + 1 (affine) */
    static double X[LN * LD], Y[LN * LD], Z[LN * LD];
    double M[LD * LD];
    toast_error err = {0};
    for (int e = 0; e < LD * LD; e++)
        M[e] = urand();
    for (int e = 0; e < LN * LD; e++)
        X[e] = urand();
    for (int r = 0; r < LN; r++)
        for (int c = 0; c < LD; c++) {
            double v = 0.0;
            for (int q = 0; q < LD; q++)
                v += X[r * LD + q] * M[q * LD + c];
            Y[r * LD + c] = v;
            Z[r * LD + c] = 2.0 * X[r * LD + c] + 1.0;
        }
    toast_moments *m = new_moments(3, LD, 4, -1, TOAST_PRECISION_FLOAT64);
    toast_view v[3] = {dview(X, LN, LD), dview(Y, LN, LD), dview(Z, LN, LD)};
    CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err), TOAST_OK,
                 &err);

    /* The error is sqrt(RSS / T_yy) with RSS = T_yy - 2 <W, G_xy> + ...
     * from the moments: the cancellation leaves RSS ~ eps T_yy, so an exact
     * fit shows as ~sqrt(eps) ~ 1e-8, not 1e-16. */
    const double exact = 1e-6;
    double E[9], cond[3];
    const toast_estimator ests[] = {TOAST_EST_IN_SAMPLE, TOAST_EST_CV,
                                    TOAST_EST_GCV};
    for (int k = 0; k < 3; k++) {
        CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_LINEAR, ests[k], 0.0,
                                        0, E, cond, &err), TOAST_OK, &err);
        CHECK(E[0 * 3 + 1] < exact); /* Y from X: linear */
        CHECK(E[0 * 3 + 2] > 1e-3);  /* Z from X: needs a bias */
        CHECK(isnan(E[0]) && isnan(E[3 + 0]) && isnan(E[2 * 3 + 2]));
        CHECK(cond[0] >= 1.0 && cond[0] < 1e6);
        CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_AFFINE, ests[k], 0.0,
                                        0, E, cond, &err), TOAST_OK, &err);
        CHECK(E[0 * 3 + 1] < exact);
        CHECK(E[0 * 3 + 2] < exact);
    }

    /* the fitted map recovers M, and the affine fit of Z gives 2 I, 1 */
    double W[LD * LD], b[LD];
    toast_solve_info info;
    toast_fit_options opt = {TOAST_FIT_LEASTSQ, 0, 0.0, 0, TOAST_SETS_ALL, 0};
    CHECK_STATUS(toast_fit(m, 0, 1, &opt, W, b, &info, &err), TOAST_OK, &err);
    double worst = 0.0;
    for (int e = 0; e < LD * LD; e++)
        worst = fmax(worst, fabs(W[e] - M[e]));
    CHECK(worst < 1e-10);
    opt.center = 1;
    opt.sel = TOAST_SETS_EXCEPT;
    opt.fold = 2;
    CHECK_STATUS(toast_fit(m, 0, 2, &opt, W, b, &info, &err), TOAST_OK, &err);
    worst = 0.0;
    for (int r = 0; r < LD; r++) {
        worst = fmax(worst, fabs(b[r] - 1.0));
        for (int c = 0; c < LD; c++)
            worst = fmax(worst, fabs(W[r * LD + c] - (r == c ? 2.0 : 0.0)));
    }
    CHECK(worst < 1e-10);

    /* residual form: argmin |X T + Y - Z| = lstsq(X, Z - Y), with bias */
    opt.sel = TOAST_SETS_ALL;
    opt.fold = 0;
    CHECK_STATUS(toast_fit_residual(m, 0, 1, 2, &opt, W, b, &info, &err),
                 TOAST_OK, &err);
    worst = 0.0;
    for (int r = 0; r < LD; r++) {
        worst = fmax(worst, fabs(b[r] - 1.0));
        for (int c = 0; c < LD; c++)
            worst = fmax(worst, fabs(W[r * LD + c] -
                                     ((r == c ? 2.0 : 0.0) - M[r * LD + c])));
    }
    CHECK(worst < 1e-10);

    /* identity, diagonal and orthogonal kinds run */
    const toast_fit_kind kinds[] = {TOAST_FIT_IDENTITY, TOAST_FIT_DIAGONAL,
                                    TOAST_FIT_ORTHOGONAL};
    for (int k = 0; k < 3; k++) {
        toast_fit_options o = {kinds[k], 0, 0.0, 0, TOAST_SETS_ALL, 0};
        CHECK_STATUS(toast_fit(m, 0, 2, &o, W, b, &info, &err), TOAST_OK,
                     &err);
    }
    CHECK_CLOSE(W[0] * W[0] + W[4] * W[4] + W[8] * W[8] + W[12] * W[12], 1.0,
                1e-12); /* orthogonal: unit columns */

    /* CKA of a state with an exact linear image of itself */
    CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_CKA, TOAST_EST_IN_SAMPLE,
                                    0.0, 0, E, NULL, &err), TOAST_OK, &err);
    CHECK_CLOSE(E[0 * 3 + 2], 1.0, 1e-12); /* Z = 2 X + 1 */
    toast_moments_free(m);
}

/* ------------------------------------------------------------ errors */

static void test_bad_arguments(void)
{
    toast_error err = {0};
    toast_moments *m = (toast_moments *)&err; /* must be reset to NULL */
    size_t nb = 0;

    CHECK_STATUS(toast_moments_new(0, 4, 0, -1, TOAST_PRECISION_FLOAT64, &m,
                                   &err), TOAST_EINVAL, &err);
    CHECK(m == NULL);
    CHECK_STATUS(toast_moments_new(2, 0, 0, -1, TOAST_PRECISION_FLOAT64, &m,
                                   &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_moments_new(-3, 4, 0, -1, TOAST_PRECISION_FLOAT64, &m,
                                   &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_moments_new(2, 4, 1, -1, TOAST_PRECISION_FLOAT64, &m,
                                   &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_moments_new(2, 4, -2, -1, TOAST_PRECISION_FLOAT64, &m,
                                   &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_moments_new(2, 4, 0, -1, (toast_precision)7, &m, &err),
                 TOAST_EINVAL, &err);
    CHECK(m == NULL);
    CHECK_STATUS(toast_moments_new(65536, 65536, 0, -1,
                                   TOAST_PRECISION_FLOAT64, &m, &err),
                 TOAST_EOVERFLOW, &err);
    CHECK_STATUS(toast_moments_nbytes(1, 2147483647, 0, 0, &nb, &err),
                 TOAST_EOVERFLOW, &err);
    CHECK_STATUS(toast_moments_nbytes(2, 1 << 30, 0, 0, &nb, &err),
                 TOAST_EOVERFLOW, &err);
    CHECK_STATUS(toast_moments_nbytes(3, 5, 2, -1, &nb, &err), TOAST_OK,
                 &err);
    CHECK(nb > 2 * (1 + 3 * 5 + 4 * 9 + 6 * 25) * sizeof(double));
    /* no error struct: still just a status */
    CHECK(toast_moments_nbytes(0, 1, 0, 0, &nb, NULL) == TOAST_EINVAL);
    CHECK(toast_set_error(NULL, TOAST_ERANGE, 3, "x %d", 1) == TOAST_ERANGE);

    /* span 1 of 4 states: (0, 2) is not kept */
    m = new_moments(4, 3, 2, 1, TOAST_PRECISION_FLOAT64);
    double out[9], W[9], b[3], E[16], cond[4];
    toast_solve_info info;
    CHECK(toast_moments_pair(m, 0, 1) >= 0 && toast_moments_pair(m, 0, 2) < 0);
    CHECK(toast_moments_pair(m, 2, 1) < 0 && toast_moments_pair(m, -1, 0) < 0);
    CHECK(toast_moments_pair(m, 0, 4) < 0);
    CHECK_STATUS(toast_moments_cross(m, TOAST_SETS_ALL, 0, 0, 2, out, &err),
                 TOAST_ENOTSTORED, &err);
    CHECK_STATUS(toast_moments_cross(m, TOAST_SETS_ALL, 0, 3, 0, out, &err),
                 TOAST_ENOTSTORED, &err);
    CHECK_STATUS(toast_moments_cross(m, TOAST_SETS_ALL, 0, 0, 4, out, &err),
                 TOAST_ERANGE, &err);
    CHECK_STATUS(toast_moments_cross(m, TOAST_SETS_ALL, 0, -1, 0, out, &err),
                 TOAST_ERANGE, &err);

    /* fits on empty moments, out-of-range states, bad options */
    toast_fit_options opt = {TOAST_FIT_LEASTSQ, 0, 0.0, 0, TOAST_SETS_ALL, 0};
    CHECK_STATUS(toast_fit(m, 0, 1, &opt, W, b, &info, &err), TOAST_EINVAL,
                 &err);
    CHECK_STATUS(toast_fit(m, 0, 4, &opt, W, b, &info, &err), TOAST_ERANGE,
                 &err);
    CHECK_STATUS(toast_fit(m, -1, 1, &opt, W, b, &info, &err), TOAST_ERANGE,
                 &err);
    CHECK_STATUS(toast_fit_residual(m, 0, 1, 9, &opt, W, b, &info, &err),
                 TOAST_ERANGE, &err);

    /* error matrix on empty moments: all NaN, no error */
    CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_LINEAR, TOAST_EST_CV, 0.0,
                                    0, E, cond, &err), TOAST_OK, &err);
    int all_nan = 1;
    for (int e = 0; e < 16; e++)
        all_nan &= isnan(E[e]);
    CHECK(all_nan);

    /* updates: zero rows, unequal rows, bad dtype, bad shapes, bad ids */
    double x[4][6 * 3];
    for (int s = 0; s < 4; s++)
        for (int e = 0; e < 18; e++)
            x[s][e] = urand();
    toast_view v[4];
    for (int s = 0; s < 4; s++)
        v[s] = dview(x[s], 6, 3);
    v[2].outer = 0;
    CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err), TOAST_ESHAPE,
                 &err);
    for (int s = 0; s < 4; s++)
        v[s].outer = 0;
    CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err), TOAST_EINVAL,
                 &err);
    for (int s = 0; s < 4; s++)
        v[s] = dview(x[s], 6, 3);
    v[1].dtype = (toast_dtype)9;
    CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err), TOAST_ETYPE,
                 &err);
    CHECK(err.arg == 1);
    v[1].dtype = TOAST_FLOAT64;
    v[3].outer = -6;
    CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err), TOAST_ESHAPE,
                 &err);
    v[3].outer = 6;
    v[0].inner = 0;
    CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err), TOAST_ESHAPE,
                 &err);
    v[0].inner = 1;
    for (int s = 0; s < 4; s++) { /* outer * inner overflows int64 */
        v[s].outer = INT64_MAX / 2;
        v[s].inner = 4;
        v[s].outer_stride = v[s].inner_stride = 0;
    }
    CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err), TOAST_ESHAPE,
                 &err);
    for (int s = 0; s < 4; s++)
        v[s] = dview(x[s], 6, 3);
    int64_t ids[6] = {0, 1, 0, 1, 2, 0};
    CHECK_STATUS(toast_moments_update(m, v, NULL, ids, &err), TOAST_ERANGE,
                 &err);
    ids[4] = -1;
    CHECK_STATUS(toast_moments_update(m, v, NULL, ids, &err), TOAST_ERANGE,
                 &err);
    ids[4] = INT64_MIN;
    CHECK_STATUS(toast_moments_update(m, v, NULL, ids, &err), TOAST_ERANGE,
                 &err);
    CHECK(toast_moments_rows(m) == 0 && toast_moments_data(m)[0] == 0.0);
    ids[4] = 1;
    CHECK_STATUS(toast_moments_update(m, v, NULL, ids, &err), TOAST_OK, &err);
    CHECK(toast_moments_rows(m) == 6);

    /* fits and error matrices with bad options on filled moments */
    opt.ridge = -1.0;
    CHECK_STATUS(toast_fit(m, 0, 1, &opt, W, b, &info, &err), TOAST_EINVAL,
                 &err);
    opt.ridge = NAN;
    CHECK_STATUS(toast_fit(m, 0, 1, &opt, W, b, &info, &err), TOAST_EINVAL,
                 &err);
    opt.ridge = 0.0;
    opt.sel = TOAST_SETS_ONLY;
    opt.fold = 2;
    CHECK_STATUS(toast_fit(m, 0, 1, &opt, W, b, &info, &err), TOAST_ERANGE,
                 &err);
    opt.fold = -1;
    CHECK_STATUS(toast_fit(m, 0, 1, &opt, W, b, &info, &err), TOAST_ERANGE,
                 &err);
    opt.sel = TOAST_SETS_ALL;
    opt.fold = 0;
    CHECK_STATUS(toast_fit(m, 0, 2, &opt, W, b, &info, &err),
                 TOAST_ENOTSTORED, &err);
    opt.kind = (toast_fit_kind)42;
    CHECK_STATUS(toast_fit(m, 0, 1, &opt, W, b, &info, &err), TOAST_EINVAL,
                 &err);
    opt.kind = TOAST_FIT_DIAGONAL;
    CHECK_STATUS(toast_fit_residual(m, 0, 1, 1, &opt, W, b, &info, &err),
                 TOAST_EINVAL, &err);
    opt.kind = TOAST_FIT_LEASTSQ;
    CHECK_STATUS(toast_fit_residual(m, 0, 1, 2, &opt, W, b, &info, &err),
                 TOAST_ENOTSTORED, &err);
    CHECK_STATUS(toast_error_matrix(m, (toast_metric)99, TOAST_EST_CV, 0.0, 0,
                                    E, cond, &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_LINEAR,
                                    (toast_estimator)-4, 0.0, 0, E, cond,
                                    &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_LINEAR, TOAST_EST_CV,
                                    -1e-3, 0, E, cond, &err), TOAST_EINVAL,
                 &err);
    CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_AFFINE, TOAST_EST_GCV,
                                    INFINITY, 1, E, cond, &err), TOAST_EINVAL,
                 &err);
    /* unstored pairs come back as NaN, not as an error */
    CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_LINEAR, TOAST_EST_CV, 0.0,
                                    0, E, cond, &err), TOAST_OK, &err);
    CHECK(isnan(E[0 * 4 + 2]) && isnan(E[0 * 4 + 3]) && !isnan(E[0 * 4 + 1]));
    toast_moments_free(m);

    /* cv needs folds */
    m = new_moments(2, 3, 0, -1, TOAST_PRECISION_FLOAT64);
    for (int s = 0; s < 2; s++)
        v[s] = dview(x[s], 6, 3);
    CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err), TOAST_OK,
                 &err);
    CHECK_STATUS(toast_error_matrix(m, TOAST_METRIC_LINEAR, TOAST_EST_CV, 0.0,
                                    0, E, cond, &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_moments_update(m, v, NULL, ids, &err), TOAST_EINVAL,
                 &err);
    opt.sel = TOAST_SETS_EXCEPT;
    CHECK_STATUS(toast_fit(m, 0, 1, &opt, W, b, &info, &err), TOAST_EINVAL,
                 &err);
    toast_moments_release_workspace(m);
    toast_moments_release_workspace(m); /* twice is fine */
    CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err), TOAST_OK,
                 &err);
    toast_moments_free(m);
    toast_moments_free(NULL);

    /* factor objects can be freed twice */
    toast_factor f;
    CHECK_STATUS(toast_factor_init(&f, 3, &err), TOAST_OK, &err);
    toast_factor_free(&f);
    toast_factor_free(&f);
}

/* Finite activations whose float64 sums overflow: every fit kind reports
 * TOAST_ENONFINITE (found by fuzzing: the orthogonal fit's SVD failed with
 * TOAST_ELAPACK, the diagonal fit returned zeros). */
static void test_overflowing_moments(void)
{
    static const double X[] = {1e200, 1.0, 1.0, 2.0, 3.0, -1.0};
    double Y[6], W[4], b[2];
    toast_error err = {0};
    toast_solve_info info;
    for (int e = 0; e < 6; e++)
        Y[e] = 2.0 * X[e];
    toast_moments *m = new_moments(3, 2, 0, -1, TOAST_PRECISION_FLOAT64);
    toast_view v[3] = {dview(X, 3, 2), dview(Y, 3, 2), dview(X, 3, 2)};
    CHECK_STATUS(toast_moments_update(m, v, NULL, NULL, &err), TOAST_OK,
                 &err);
    const toast_fit_kind kinds[] = {TOAST_FIT_LEASTSQ, TOAST_FIT_DIAGONAL,
                                    TOAST_FIT_ORTHOGONAL};
    for (int k = 0; k < 3; k++) {
        for (int center = 0; center <= 1; center++) {
            toast_fit_options opt = {kinds[k], center, 0.0, 0, TOAST_SETS_ALL,
                                     0};
            CHECK_STATUS(toast_fit(m, 0, 1, &opt, W, b, &info, &err),
                         TOAST_ENONFINITE, &err);
        }
    }
    toast_fit_options opt = {TOAST_FIT_LEASTSQ, 1, 0.0, 0, TOAST_SETS_ALL, 0};
    CHECK_STATUS(toast_fit_residual(m, 0, 1, 2, &opt, W, b, &info, &err),
                 TOAST_ENONFINITE, &err);
    opt.kind = TOAST_FIT_IDENTITY; /* nothing to solve: fine */
    CHECK_STATUS(toast_fit(m, 0, 1, &opt, W, b, &info, &err), TOAST_OK, &err);
    toast_moments_free(m);
}

/* Sizes whose pair count or storage does not fit must fail fast, not
 * overflow or loop for minutes. */
static void test_absurd_sizes(void)
{
    toast_error err = {0};
    size_t nb = 0;
    toast_moments *m = NULL;
    /* 2^20 states of width 1: 5.5e11 pairs */
    toast_status st = toast_moments_nbytes(1 << 20, 1, 0, -1, &nb, &err);
    CHECK(st == TOAST_EOVERFLOW || st == TOAST_ENOMEM);
    st = toast_moments_new(2147483647, 1, 0, -1, TOAST_PRECISION_FLOAT64, &m,
                           &err);
    CHECK(st != TOAST_OK && m == NULL);
    st = toast_moments_new(2147483647, 1, 0, 1, TOAST_PRECISION_FLOAT64, &m,
                           &err);
    CHECK(st != TOAST_OK && m == NULL);
    /* a large but addressable request either works or reports ENOMEM */
    st = toast_moments_new(1, 1 << 24, 0, -1, TOAST_PRECISION_FLOAT64, &m,
                           &err);
    CHECK(st == TOAST_EOVERFLOW || st == TOAST_ENOMEM);
    toast_moments_free(m);
    /* the eigensolver workspace (2 d^2 doubles) must fit LAPACK's int */
    toast_factor f;
    st = toast_factor_init(&f, 40000, &err);
    CHECK(st == TOAST_EOVERFLOW);
    st = toast_factor_init(&f, 0, &err);
    CHECK(st == TOAST_EINVAL);
}

/* Counts its calls; asks to stop at call number `stop_at`. */
typedef struct {
    int calls, stop_at;
} poll_count;

static int count_polls(void *ctx)
{
    poll_count *p = ctx;
    return ++p->calls >= p->stop_at;
}

static void test_poll_interrupts_the_error_matrix(void)
{
    double x[SS][SN * SD];
    toast_error err = {0};
    toast_moments *m = new_moments(SS, SD, 3, -1, TOAST_PRECISION_FLOAT64);
    fill_states(x);
    update_rows(m, x, 0, SN, NULL);
    const toast_metric metrics[] = {TOAST_METRIC_LINEAR, TOAST_METRIC_AFFINE,
                                    TOAST_METRIC_CKA};
    const toast_estimator ests[] = {TOAST_EST_IN_SAMPLE, TOAST_EST_CV,
                                    TOAST_EST_GCV};
    double E[SS * SS], F[SS * SS];
    for (int a = 0; a < 3; a++) {
        for (int b = 0; b < 3; b++) {
            /* a poll that never stops changes nothing */
            poll_count never = {0, 1 << 30};
            CHECK_STATUS(toast_error_matrix(m, metrics[a], ests[b], 0.0, 0, E,
                                            NULL, &err), TOAST_OK, &err);
            CHECK_STATUS(toast_error_matrix_poll(m, metrics[a], ests[b], 0.0,
                                                 0, F, NULL, count_polls,
                                                 &never, &err),
                         TOAST_OK, &err);
            CHECK(memcmp(E, F, sizeof(E)) == 0);
            CHECK(never.calls > 0);
            /* a poll that stops at its second call stops the work there */
            poll_count stop = {0, 2};
            CHECK(toast_error_matrix_poll(m, metrics[a], ests[b], 0.0, 0, F,
                                          NULL, count_polls, &stop, &err) ==
                  TOAST_EINTERRUPTED);
            CHECK(stop.calls == 2);
            CHECK(strstr(err.msg, "interrupted") != NULL);
        }
    }
    toast_moments_free(m);
}

/* ------------------------------------------------------------ centers */

/* Sum of distances from y to the points, and the norm of its gradient at
 * y (sum of unit vectors from the points to y; 0 at the median when y is
 * not a data point). */
static double gm_objective(int n, int p, const double *X, const double *y,
                           double *grad_norm)
{
    double f = 0.0, g[8] = {0};
    for (int i = 0; i < n; i++) {
        double d = 0.0;
        for (int c = 0; c < p; c++)
            d += (y[c] - X[i * p + c]) * (y[c] - X[i * p + c]);
        d = sqrt(d);
        f += d;
        for (int c = 0; c < p && c < 8; c++)
            g[c] += d > 0 ? (y[c] - X[i * p + c]) / d : 0.0;
    }
    double gn = 0.0;
    for (int c = 0; c < p && c < 8; c++)
        gn += g[c] * g[c];
    *grad_norm = sqrt(gn);
    return f;
}

static void test_geometric_median_known(void)
{
    toast_error err = {0};
    toast_gm_info info;
    double y[3];

    /* Square corners: the center, off every data point. */
    double square[] = {0, 0, 2, 0, 0, 2, 2, 2};
    CHECK_STATUS(toast_geometric_median(4, 2, square, NULL, 1e-12, 1000, y,
                                        &info, &err), TOAST_OK, &err);
    CHECK_CLOSE(y[0], 1.0, 1e-12);
    CHECK_CLOSE(y[1], 1.0, 1e-12);
    CHECK(info.converged == 1);

    /* A star around the origin: the centroid is the data point (0, 0),
     * which is optimal; Vardi-Zhang stops there at once. */
    double star[] = {0, 0, 1, 0, -1, 0, 0, 1, 0, -1};
    CHECK_STATUS(toast_geometric_median(5, 2, star, NULL, 1e-12, 1000, y,
                                        &info, &err), TOAST_OK, &err);
    CHECK(y[0] == 0.0 && y[1] == 0.0);
    CHECK(info.converged == 1 && info.hits == 1 && info.iterations == 0);

    /* The centroid is the data point (0, 0), which is NOT optimal (three
     * points pull right, ||R|| ~ 1.96 > 1): the modified step must leave
     * it and converge to a point where the gradient vanishes. Plain
     * Weiszfeld would divide by zero there. */
    double trap[] = {0, 0, 5, 0, 5, 1, 5, -1, -15, 0};
    CHECK_STATUS(toast_geometric_median(5, 2, trap, NULL, 1e-13, 10000, y,
                                        &info, &err), TOAST_OK, &err);
    double gn;
    (void)gm_objective(5, 2, trap, y, &gn);
    CHECK(info.converged == 1 && info.hits >= 1);
    CHECK(y[0] > 0.1);
    CHECK(gn < 1e-8);

    /* A weight that outweighs the others: the median is that point. */
    double tri[] = {0, 0, 1, 0, 0, 1};
    double w[] = {5.0, 1.0, 1.0};
    CHECK_STATUS(toast_geometric_median(3, 2, tri, w, 1e-12, 1000, y, &info,
                                        &err), TOAST_OK, &err);
    CHECK_CLOSE(y[0], 0.0, 1e-12);
    CHECK_CLOSE(y[1], 0.0, 1e-12);
    CHECK(info.converged == 1);

    /* Identical points (and a single point): that point, no iteration. */
    double same[] = {1, 2, 3, 1, 2, 3, 1, 2, 3};
    CHECK_STATUS(toast_geometric_median(3, 3, same, NULL, 1e-12, 1000, y,
                                        &info, &err), TOAST_OK, &err);
    CHECK(y[0] == 1 && y[1] == 2 && y[2] == 3 && info.converged == 1);
    CHECK(info.iterations == 0);
    CHECK_STATUS(toast_geometric_median(1, 3, same, NULL, 1e-12, 1000, y,
                                        &info, &err), TOAST_OK, &err);
    CHECK(y[0] == 1 && y[1] == 2 && y[2] == 3);

    /* max_iter = 0: the centroid, not converged (not an error). */
    CHECK_STATUS(toast_geometric_median(4, 2, square, NULL, 1e-12, 0, y,
                                        &info, &err), TOAST_OK, &err);
    CHECK(y[0] == 1.0 && y[1] == 1.0 && info.converged == 0);
}

static void test_geometric_median_random(void)
{
    enum { N = 17, P = 6 };
    toast_error err = {0};
    toast_gm_info info;
    double X[N * P], y[P], probe[P];
    for (int e = 0; e < N * P; e++)
        X[e] = urand() + (e % P == 0 ? 3.0 : 0.0);
    CHECK_STATUS(toast_geometric_median(N, P, X, NULL, 1e-14, 100000, y,
                                        &info, &err), TOAST_OK, &err);
    CHECK(info.converged == 1);
    double gn, f = gm_objective(N, P, X, y, &gn);
    CHECK(gn < 1e-9);
    /* No probe around y does better. */
    for (int k = 0; k < 2 * P; k++) {
        memcpy(probe, y, sizeof probe);
        probe[k / 2] += (k % 2 ? -1e-4 : 1e-4);
        double g2;
        CHECK(gm_objective(N, P, X, probe, &g2) >= f);
    }
}

static void test_coordinate_median_and_scores(void)
{
    toast_error err = {0};
    toast_gm_info info;
    /* 4 points (even count: the lower median, as torch.median). */
    double X[] = {3, 10, 1, 40, 4, 20, 2, 30};
    double m[2], s[4];
    CHECK_STATUS(toast_coordinate_median(4, 2, X, m, &err), TOAST_OK, &err);
    CHECK(m[0] == 2.0 && m[1] == 20.0);
    CHECK_STATUS(toast_coordinate_median(3, 2, X, m, &err), TOAST_OK, &err);
    CHECK(m[0] == 3.0 && m[1] == 20.0);

    CHECK_STATUS(toast_dim_scores(4, 2, X, TOAST_DIMSCORE_COORD_MEDIAN, 1e-10,
                                  100, s, &info, &err), TOAST_OK, &err);
    CHECK_CLOSE(s[0], sqrt(1.0 + 100.0), 1e-15);
    CHECK_CLOSE(s[1], sqrt(1.0 + 400.0), 1e-15);
    CHECK(s[3] == 10.0);
    CHECK(info.converged == 1 && info.iterations == 0);

    CHECK_STATUS(toast_dim_scores(4, 2, X, TOAST_DIMSCORE_L1, 1e-10, 100, s,
                                  NULL, &err), TOAST_OK, &err);
    CHECK(s[0] == 13.0 && s[1] == 41.0 && s[2] == 24.0 && s[3] == 32.0);
    CHECK_STATUS(toast_dim_scores(4, 2, X, TOAST_DIMSCORE_L2, 1e-10, 100, s,
                                  NULL, &err), TOAST_OK, &err);
    CHECK_CLOSE(s[2], sqrt(416.0), 1e-15);

    double line[] = {0, 1, 3};   /* three points on a line, p = 1 */
    CHECK_STATUS(toast_dim_scores(3, 1, line, TOAST_DIMSCORE_FPGM, 1e-10, 100,
                                  s, NULL, &err), TOAST_OK, &err);
    CHECK(s[0] == 4.0 && s[1] == 3.0 && s[2] == 5.0);
    CHECK_STATUS(toast_dim_scores(3, 1, line, TOAST_DIMSCORE_GEOMEDIAN, 1e-12,
                                  100, s, &info, &err), TOAST_OK, &err);
    CHECK_CLOSE(s[0], 1.0, 1e-12);   /* the median is the data point 1 */
    CHECK_CLOSE(s[1], 0.0, 1e-12);
    CHECK_CLOSE(s[2], 2.0, 1e-12);

    /* The batch equals the groups one by one. */
    double G[2 * 8], sb[2 * 4], s1[4];
    toast_gm_info infos[2];
    for (int e = 0; e < 16; e++)
        G[e] = urand();
    CHECK_STATUS(toast_dim_scores_batch(2, 4, 2, G, TOAST_DIMSCORE_GEOMEDIAN,
                                        1e-12, 1000, sb, infos, &err),
                 TOAST_OK, &err);
    for (int g = 0; g < 2; g++) {
        CHECK_STATUS(toast_dim_scores(4, 2, G + 8 * g,
                                      TOAST_DIMSCORE_GEOMEDIAN, 1e-12, 1000,
                                      s1, &info, &err), TOAST_OK, &err);
        CHECK(memcmp(s1, sb + 4 * g, sizeof s1) == 0);
        CHECK(infos[g].iterations == info.iterations);
    }
    CHECK_STATUS(toast_dim_scores_batch(0, 4, 2, G, TOAST_DIMSCORE_L1, 1e-12,
                                        10, NULL, NULL, &err), TOAST_OK, &err);
}

static void test_center_bad_arguments(void)
{
    toast_error err = {0};
    double X[] = {0, 1, 2, 3}, y[2], s[2];
    double w_neg[] = {1, -1}, w_zero[] = {0, 0};
    double bad[] = {0, NAN, 2, 3};

    CHECK_STATUS(toast_geometric_median(0, 2, X, NULL, 1e-10, 10, y, NULL,
                                        &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_geometric_median(2, 0, X, NULL, 1e-10, 10, y, NULL,
                                        &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_geometric_median(2, 2, NULL, NULL, 1e-10, 10, y, NULL,
                                        &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_geometric_median(2, 2, X, NULL, 1e-10, 10, NULL, NULL,
                                        &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_geometric_median(2, 2, bad, NULL, 1e-10, 10, y, NULL,
                                        &err), TOAST_ENONFINITE, &err);
    CHECK(err.arg == 0);
    CHECK_STATUS(toast_geometric_median(2, 2, X, w_neg, 1e-10, 10, y, NULL,
                                        &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_geometric_median(2, 2, X, w_zero, 1e-10, 10, y, NULL,
                                        &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_geometric_median(2, 2, X, NULL, -1.0, 10, y, NULL,
                                        &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_geometric_median(2, 2, X, NULL, NAN, 10, y, NULL,
                                        &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_geometric_median(2, 2, X, NULL, 1e-10, -1, y, NULL,
                                        &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_coordinate_median(2, 2, bad, y, &err),
                 TOAST_ENONFINITE, &err);
    CHECK_STATUS(toast_coordinate_median(2, 2, X, NULL, &err), TOAST_EINVAL,
                 &err);
    CHECK_STATUS(toast_dim_scores(2, 2, X, (toast_dimscore)99, 1e-10, 10, s,
                                  NULL, &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_dim_scores(2, 2, X, TOAST_DIMSCORE_L2, 1e-10, 10, NULL,
                                  NULL, &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_dim_scores(2, 2, bad, TOAST_DIMSCORE_FPGM, 1e-10, 10,
                                  s, NULL, &err), TOAST_ENONFINITE, &err);
    CHECK_STATUS(toast_dim_scores_batch(-1, 2, 2, X, TOAST_DIMSCORE_L2, 1e-10,
                                        10, s, NULL, &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_dim_scores_batch(2, 1, 2, bad, TOAST_DIMSCORE_L2,
                                        1e-10, 10, s, NULL, &err),
                 TOAST_ENONFINITE, &err);
    CHECK(err.arg == 0);
    CHECK_STATUS(toast_dim_scores_batch(INT32_MAX, INT32_MAX, INT32_MAX, X,
                                        TOAST_DIMSCORE_L2, 1e-10, 10, s, NULL,
                                        &err), TOAST_EOVERFLOW, &err);
    double huge[] = {1.7e308, 1.7e308, -1.7e308, -1.7e308};
    CHECK_STATUS(toast_dim_scores(2, 2, huge, TOAST_DIMSCORE_L1, 1e-10, 10, s,
                                  NULL, &err), TOAST_ENONFINITE, &err);
    CHECK_STATUS(toast_dim_scores(2, 2, huge, TOAST_DIMSCORE_FPGM, 1e-10, 10,
                                  s, NULL, &err), TOAST_ENONFINITE, &err);
    double big3[] = {1.7e308, 1.7e308, 1.7e308, 1.7e308};
    CHECK_STATUS(toast_geometric_median(2, 2, big3, NULL, 1e-10, 10, y, NULL,
                                        &err), TOAST_ENONFINITE, &err);
    CHECK_STATUS(toast_geometric_median(INT32_MAX, INT32_MAX, X, NULL, 1e-10,
                                        10, y, NULL, &err),
                 TOAST_EOVERFLOW, &err);
}

/* ------------------------------------------------------------ TCS */

static void test_tcs_cls_attention(void)
{
    toast_error err = {0};
    /* B = 1, N = 3, H = 2, d = 1: head 0 q = 1, head 1 q = 0 (uniform). */
    float q[] = {1.0f, 0.0f};
    float K[] = {0, 5, 1, 5, 2, 5};  /* token n: (head 0, head 1) */
    float out[3];
    CHECK_STATUS(toast_tcs_cls_attention(1, 3, 2, 1, q, K, 1.0, out, &err),
                 TOAST_OK, &err);
    double z = 1 + exp(1.0) + exp(2.0);
    for (int n = 0; n < 3; n++)
        CHECK_CLOSE(out[n], 0.5 * exp((double)n) / z + 0.5 / 3.0, 1e-6);
    CHECK_STATUS(toast_tcs_cls_attention(1, 3, 2, 0, q, K, 1.0, out, &err),
                 TOAST_EINVAL, &err);
    CHECK_STATUS(toast_tcs_cls_attention(1, 3, 2, 1, NULL, K, 1.0, out, &err),
                 TOAST_EINVAL, &err);
    CHECK_STATUS(toast_tcs_cls_attention(1, 3, 2, 1, q, K, NAN, out, &err),
                 TOAST_EINVAL, &err);
    float Kbad[] = {0, 5, NAN, 5, 2, 5};
    CHECK_STATUS(toast_tcs_cls_attention(1, 3, 2, 1, q, Kbad, 1.0, out, &err),
                 TOAST_ENONFINITE, &err);
}

/* Brute force: the k best channels by (score desc, index asc), ascending. */
static void brute_top(int C, const double *score, int k, int64_t *out)
{
    int taken[64] = {0};
    for (int i = 0; i < k; i++) {
        int best = -1;
        for (int c = 0; c < C; c++)
            if (!taken[c] && (best < 0 || score[c] > score[best]))
                best = c;
        taken[best] = 1;
    }
    int j = 0;
    for (int c = 0; c < C; c++)
        if (taken[c])
            out[j++] = c;
}

static void test_tcs_select(void)
{
    enum { B = 3, N = 5, C = 40 };
    toast_error err = {0};
    float X[B * N * C], attn[B * N];
    for (int e = 0; e < B * N * C; e++)
        X[e] = (float)urand();
    for (int e = 0; e < B * N; e++)
        attn[e] = (float)(0.5 + 0.5 * urand());
    int64_t sample[] = {1, 3, 4};
    toast_tcs_options opt = {2.0, 1.0, 0};
    int64_t out[B * C], want[C];
    double score[C];
    for (int k = 1; k <= C; k += 13) {
        CHECK_STATUS(toast_tcs_select(B, N, C, X, 3, sample, attn, &opt, k,
                                      out, &err), TOAST_OK, &err);
        for (int b = 0; b < B; b++) {
            const float *x = X + b * N * C;
            for (int c = 0; c < C; c++) {
                double p = 0;
                for (int j = 0; j < 3; j++)
                    p += attn[b * N + sample[j]] * fabs(x[sample[j] * C + c]);
                score[c] = 2.0 * fabs(x[c]) + p / 3.0;
            }
            brute_top(C, score, k, want);
            CHECK(memcmp(out + b * k, want, (size_t)k * sizeof(int64_t)) == 0);
        }
    }
    /* Batch scope: batch-mean attention, batch-mean scores, one set. */
    toast_tcs_options bopt = {0.5, 1.0, 1};
    CHECK_STATUS(toast_tcs_select(B, N, C, X, 3, sample, attn, &bopt, 7, out,
                                  &err), TOAST_OK, &err);
    for (int c = 0; c < C; c++) {
        score[c] = 0;
        for (int b = 0; b < B; b++) {
            const float *x = X + b * N * C;
            double p = 0;
            for (int j = 0; j < 3; j++) {
                double abar = (attn[sample[j]] + attn[N + sample[j]] +
                               attn[2 * N + sample[j]]) / 3.0;
                p += abar * fabs(x[sample[j] * C + c]);
            }
            score[c] += (0.5 * fabs(x[c]) + p / 3.0) / B;
        }
    }
    brute_top(C, score, 7, want);
    CHECK(memcmp(out, want, 7 * sizeof(int64_t)) == 0);
    /* Ties: the lower channel wins; Eq. 7 without attention. */
    float T[] = {9, 9, 9, 9, 1, 2, 2, 1};  /* token 0 ignored (cls 0) */
    toast_tcs_options e7 = {0.0, 1.0, 0};
    int64_t s1[] = {1}, o2[2];
    CHECK_STATUS(toast_tcs_select(1, 2, 4, T, 1, s1, NULL, &e7, 2, o2, &err),
                 TOAST_OK, &err);
    CHECK(o2[0] == 1 && o2[1] == 2);
    /* Bad arguments. */
    int64_t bad_s[] = {5};
    CHECK_STATUS(toast_tcs_select(B, N, C, X, 1, bad_s, NULL, &opt, 3, out,
                                  &err), TOAST_ERANGE, &err);
    CHECK_STATUS(toast_tcs_select(B, N, C, X, 3, sample, NULL, &opt, 0, out,
                                  &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_tcs_select(B, N, C, X, 3, sample, NULL, &opt, C + 1,
                                  out, &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_tcs_select(B, N, C, X, 0, sample, NULL, &opt, 3, out,
                                  &err), TOAST_EINVAL, &err);
    toast_tcs_options neg = {-1.0, 1.0, 0};
    CHECK_STATUS(toast_tcs_select(B, N, C, X, 3, sample, NULL, &neg, 3, out,
                                  &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_tcs_select(B, N, C, NULL, 3, sample, NULL, &opt, 3,
                                  out, &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_tcs_select(0, N, C, X, 3, sample, NULL, &opt, 3, out,
                                  &err), TOAST_EINVAL, &err);
    CHECK_STATUS(toast_tcs_select(INT32_MAX, INT32_MAX, C, X, 3, sample, NULL,
                                  &opt, 3, out, &err), TOAST_EOVERFLOW, &err);
    X[C + 7] = NAN;  /* image 0, token 1, channel 7 */
    CHECK_STATUS(toast_tcs_select(B, N, C, X, 3, sample, NULL, &opt, 3, out,
                                  &err), TOAST_ENONFINITE, &err);
    CHECK(err.arg == 7);
}

/* ------------------------------------------------------------ layout */

/* The accessors, the layout and the panels agree with the documented
 * storage, and set_data round-trips (or refuses a wrong length). */
static void test_layout_and_accessors(void)
{
    enum { LS = 4, LD = 3 };
    toast_error err = {0};
    toast_moments_layout l, got;
    CHECK_STATUS(toast_moments_layout_of(LS, LD, 2, 1, &l, &err), TOAST_OK,
                 &err);
    CHECK(l.num_states == LS && l.dim == LD && l.folds == 2 && l.span == 1);
    CHECK(l.nsets == 2 && l.npairs == LS + (LS - 1));
    CHECK(l.off_count == 0 && l.off_sums == 1);
    CHECK(l.off_rowstats == 1 + (size_t)LS * LD);
    CHECK(l.off_blocks == l.off_rowstats + (size_t)TOAST_RS_COUNT * LS * LS);
    CHECK(l.set_len == l.off_blocks + (size_t)l.npairs * LD * LD);
    size_t off[LS];
    int blocks[LS];
    toast_moments_panels(&l, off, blocks);
    for (int i = 0; i < LS; i++) {
        CHECK(blocks[i] == (i < LS - 1 ? 2 : 1));
        CHECK(off[i] == l.off_blocks + (size_t)2 * i * LD * LD);
    }
    /* span < 0 or beyond S - 1 keeps every pair */
    CHECK_STATUS(toast_moments_layout_of(LS, LD, 0, -1, &l, &err), TOAST_OK,
                 &err);
    CHECK(l.span == LS - 1 && l.nsets == 1 &&
          l.npairs == LS * (LS + 1) / 2);
    CHECK_STATUS(toast_moments_layout_of(LS, LD, 1, -1, &l, &err),
                 TOAST_EINVAL, &err);
    CHECK_STATUS(toast_moments_layout_of(INT32_MAX, INT32_MAX, 0, -1, &l,
                                         &err), TOAST_EOVERFLOW, &err);

    toast_moments *m = new_moments(LS, LD, 2, 1, TOAST_PRECISION_MIXED);
    CHECK(toast_moments_num_states(m) == LS && toast_moments_dim(m) == LD);
    CHECK(toast_moments_folds(m) == 2 && toast_moments_span(m) == 1);
    CHECK(toast_moments_precision(m) == TOAST_PRECISION_MIXED);
    CHECK(toast_moments_rows(m) == 0);
    toast_moments_get_layout(m, &got);
    CHECK_STATUS(toast_moments_layout_of(LS, LD, 2, 1, &l, &err), TOAST_OK,
                 &err);
    CHECK(memcmp(&got, &l, sizeof l) == 0);
    const size_t len = toast_moments_storage_len(m);
    CHECK(len == 2 * l.set_len);
    double *data = calloc(len, sizeof(double));
    CHECK(data != NULL);
    if (data != NULL) {
        for (size_t e = 0; e < len; e++)
            data[e] = (double)e;
        CHECK_STATUS(toast_moments_set_data(m, data, len, 7, &err), TOAST_OK,
                     &err);
        CHECK(toast_moments_rows(m) == 7);
        CHECK(memcmp(toast_moments_data(m), data, len * sizeof(double)) == 0);
        /* the count of fold 1 sits at the start of the second set */
        CHECK(toast_moments_count(m, TOAST_SETS_ONLY, 1) == (double)l.set_len);
        CHECK_STATUS(toast_moments_set_data(m, data, len - 1, 7, &err),
                     TOAST_ESHAPE, &err);
        CHECK_STATUS(toast_moments_set_data(m, data, len, -1, &err),
                     TOAST_EINVAL, &err);
        CHECK(toast_moments_rows(m) == 7);
    }
    free(data);
    toast_moments_free(m);
}

int main(void)
{
    test_known_moments();
    test_layout_and_accessors();
    test_strided_views();
    test_streaming_and_merge();
    test_direct_and_restricted();
    test_half_formats();
    test_nonfinite_rejected();
    test_fold_assignment();
    test_solvers();
    test_exact_linear();
    test_bad_arguments();
    test_overflowing_moments();
    test_absurd_sizes();
    test_poll_interrupts_the_error_matrix();
    test_geometric_median_known();
    test_geometric_median_random();
    test_coordinate_median_and_scores();
    test_center_bad_arguments();
    test_tcs_cls_attention();
    test_tcs_select();
    printf("test_core: %d checks, %d failures\n", checks, failures);
    return failures == 0 ? 0 : 1;
}
