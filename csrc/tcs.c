/*
 * tcs.c -- ToaSt's token channel selection: the CLS attention row and the
 * per-image (or per-batch) channel scores and top-k.
 *
 * The work per call is small (a few sampled tokens times the channels), so
 * everything runs on the calling thread: one C call replaces a dozen small
 * tensor operations, each of which would otherwise dispatch to (and wait
 * for) a thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "toast_core.h"

/* ------------------------------------------------------------ checks */

static toast_status check_dims(int B, int N, int C, const void *X,
                               toast_error *err)
{
    if (B < 1 || N < 1 || C < 1)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "need B, N, C >= 1, got %d, %d, %d", B, N, C);
    if ((size_t)B > SIZE_MAX / sizeof(float) / (size_t)N / (size_t)C)
        return toast_set_error(err, TOAST_EOVERFLOW, -1,
                               "%d x %d x %d values overflow size_t", B, N, C);
    if (X == NULL)
        return toast_set_error(err, TOAST_EINVAL, -1, "the input is NULL");
    return TOAST_OK;
}

static toast_status check_select(int N, int C, int m, const int64_t *sample,
                                 const toast_tcs_options *opt, int k,
                                 const int64_t *out, toast_error *err)
{
    if (opt == NULL || out == NULL)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "options and output must not be NULL");
    if (m < 1 || sample == NULL)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "need at least one sampled token, got %d", m);
    for (int j = 0; j < m; j++)
        if (sample[j] < 0 || sample[j] >= N)
            return toast_set_error(err, TOAST_ERANGE, j,
                                   "sampled token %lld is outside 0..%d",
                                   (long long)sample[j], N - 1);
    if (k < 1 || k > C)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "k must be in [1, %d], got %d", C, k);
    if (!isfinite(opt->cls_weight) || opt->cls_weight < 0 ||
        !isfinite(opt->patch_weight) || opt->patch_weight < 0)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "score weights must be finite and >= 0, got "
                               "%g and %g", opt->cls_weight,
                               opt->patch_weight);
    return TOAST_OK;
}

/* ------------------------------------------------------------ CLS row */

/* Softmax over n logits in place (float64 accumulation). */
static void softmax_row(double *v, int n)
{
    double mx = v[0], sum = 0.0;
    for (int i = 1; i < n; i++)
        if (v[i] > mx)
            mx = v[i];
    for (int i = 0; i < n; i++) {
        v[i] = exp(v[i] - mx);
        sum += v[i];
    }
    for (int i = 0; i < n; i++)
        v[i] /= sum;
}

/* Adds (1/H) softmax(scale q_h . K_h^T) of one image to out (N floats). */
static void cls_row_image(int N, int H, int d, const float *q, const float *K,
                          double scale, double *logits, float *out)
{
    size_t width = (size_t)H * d;
    for (int h = 0; h < H; h++) {
        const float *qh = q + (size_t)h * d;
        for (int n = 0; n < N; n++) {
            const float *kh = K + (size_t)n * width + (size_t)h * d;
            double s = 0.0;
            for (int c = 0; c < d; c++)
                s += (double)qh[c] * kh[c];
            logits[n] = s * scale;
        }
        softmax_row(logits, N);
        for (int n = 0; n < N; n++)
            out[n] += (float)(logits[n] / H);
    }
}

toast_status toast_tcs_cls_attention(int B, int N, int H, int d,
                                     const float *q, const float *K,
                                     double scale, float *out,
                                     toast_error *err)
{
    toast_status st = check_dims(B, N, H, K, err);
    if (st != TOAST_OK)
        return st;
    if (d < 1 || (size_t)H * (size_t)N > SIZE_MAX / sizeof(float) /
                                             (size_t)d / (size_t)B)
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "need head width d >= 1 with a representable "
                               "size, got %d", d);
    if (q == NULL || out == NULL || !isfinite(scale))
        return toast_set_error(err, TOAST_EINVAL, -1,
                               "q and out must not be NULL and the scale "
                               "must be finite");
    double *logits = malloc((size_t)N * sizeof(double));
    if (logits == NULL)
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate %d logits", N);
    size_t width = (size_t)H * d;
    memset(out, 0, (size_t)B * N * sizeof(float));
    for (int b = 0; b < B; b++)
        cls_row_image(N, H, d, q + (size_t)b * width,
                      K + (size_t)b * N * width, scale, logits,
                      out + (size_t)b * N);
    free(logits);
    for (size_t e = 0; e < (size_t)B * N; e++)
        if (!isfinite(out[e]))
            return toast_set_error(err, TOAST_ENONFINITE, (int)(e / N),
                                   "the attention row of image %d is not "
                                   "finite", (int)(e / N));
    return TOAST_OK;
}

/* ------------------------------------------------------------ scores */

/* score[c] += wc |x_0c| + (wp / m) sum_j a_j |x_{s_j} c| for one image. */
static void add_image_scores(int C, const float *X, int m,
                             const int64_t *sample, const float *a,
                             const toast_tcs_options *opt, double *score)
{
    double wp = opt->patch_weight / m;
    if (opt->cls_weight > 0)
        for (int c = 0; c < C; c++)
            score[c] += opt->cls_weight * fabs((double)X[c]);
    for (int j = 0; j < m; j++) {
        const float *row = X + (size_t)sample[j] * C;
        double w = wp * (a == NULL ? 1.0 : (double)a[sample[j]]);
        for (int c = 0; c < C; c++)
            score[c] += w * fabs((double)row[c]);
    }
}

/* Larger score first; equal scores: lower channel first. */
static int ranks_before(const double *score, int i, int j)
{
    return score[i] > score[j] || (score[i] == score[j] && i < j);
}

static void swap_int(int *a, int *b)
{
    int t = *a;
    *a = *b;
    *b = t;
}

/* Rearranges idx[lo..hi] so that its first k - lo entries rank before the
 * rest (quickselect, middle pivot). */
static void select_top(const double *score, int *idx, int lo, int hi, int k)
{
    while (lo < hi) {
        swap_int(&idx[(lo + hi) / 2], &idx[hi]);
        int pivot = idx[hi], store = lo;
        for (int i = lo; i < hi; i++)
            if (ranks_before(score, idx[i], pivot))
                swap_int(&idx[i], &idx[store++]);
        swap_int(&idx[store], &idx[hi]);
        if (store == k)
            return;
        if (store < k)
            lo = store + 1;
        else
            hi = store - 1;
    }
}

static int compare_ints(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* The k best channels of score[0..C) into out, ascending. */
static toast_status top_k(int C, const double *score, int k, int *idx,
                          int64_t *out, toast_error *err)
{
    for (int c = 0; c < C; c++) {
        if (!isfinite(score[c]))
            return toast_set_error(err, TOAST_ENONFINITE, c,
                                   "the score of channel %d is not finite",
                                   c);
        idx[c] = c;
    }
    if (k < C)
        select_top(score, idx, 0, C - 1, k);
    qsort(idx, (size_t)k, sizeof(int), compare_ints);
    for (int i = 0; i < k; i++)
        out[i] = idx[i];
    return TOAST_OK;
}

/* Batch-mean attention row (N floats) into mean. */
static void mean_rows(int B, int N, const float *a, float *mean)
{
    for (int n = 0; n < N; n++) {
        double s = 0.0;
        for (int b = 0; b < B; b++)
            s += a[(size_t)b * N + n];
        mean[n] = (float)(s / B);
    }
}

static toast_status select_batch(int B, int N, int C, const float *X, int m,
                                 const int64_t *sample, const float *attn,
                                 const toast_tcs_options *opt, int k,
                                 double *score, int *idx, int64_t *out,
                                 toast_error *err)
{
    float *abar = NULL;
    if (attn != NULL) {
        abar = malloc((size_t)N * sizeof(float));
        if (abar == NULL)
            return toast_set_error(err, TOAST_ENOMEM, -1,
                                   "cannot allocate an attention row");
        mean_rows(B, N, attn, abar);
    }
    memset(score, 0, (size_t)C * sizeof(double));
    for (int b = 0; b < B; b++)
        add_image_scores(C, X + (size_t)b * N * C, m, sample, abar, opt,
                         score);
    for (int c = 0; c < C; c++)
        score[c] /= B;
    free(abar);
    return top_k(C, score, k, idx, out, err);
}

toast_status toast_tcs_select(int B, int N, int C, const float *X, int m,
                              const int64_t *sample, const float *attn,
                              const toast_tcs_options *opt, int k,
                              int64_t *out, toast_error *err)
{
    toast_status st = check_dims(B, N, C, X, err);
    if (st == TOAST_OK)
        st = check_select(N, C, m, sample, opt, k, out, err);
    if (st != TOAST_OK)
        return st;
    double *score = malloc((size_t)C * sizeof(double));
    int *idx = malloc((size_t)C * sizeof(int));
    if (score == NULL || idx == NULL) {
        free(score);
        free(idx);
        return toast_set_error(err, TOAST_ENOMEM, -1,
                               "cannot allocate scores of %d channels", C);
    }
    if (opt->batch_scope) {
        st = select_batch(B, N, C, X, m, sample, attn, opt, k, score, idx,
                          out, err);
    } else {
        for (int b = 0; b < B && st == TOAST_OK; b++) {
            memset(score, 0, (size_t)C * sizeof(double));
            add_image_scores(C, X + (size_t)b * N * C, m, sample,
                             attn == NULL ? NULL : attn + (size_t)b * N, opt,
                             score);
            st = top_k(C, score, k, idx, out + (size_t)b * k, err);
        }
    }
    free(score);
    free(idx);
    return st;
}
