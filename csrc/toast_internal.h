/*
 * toast_internal.h -- small dense helpers shared by the core's sources.
 * Not part of the public API. Matrices are d x d, row-major.
 */
#ifndef TOAST_INTERNAL_H
#define TOAST_INTERNAL_H

#include <stddef.h>

/* Centers a cross block from column sums: G -= s_a s_b^T / n, which turns
 * X_a^T X_b into X_a,c^T X_b,c for n rows. */
static inline void toast_center_cross(double *G, const double *sa,
                                      const double *sb, double n, int d)
{
    for (int r = 0; r < d; r++)
        for (int c = 0; c < d; c++)
            G[(size_t)r * d + c] -= sa[r] * sb[c] / n;
}

static inline double toast_trace(const double *A, int d)
{
    double t = 0.0;
    for (int k = 0; k < d; k++)
        t += A[(size_t)k * d + k];
    return t;
}

#endif /* TOAST_INTERNAL_H */
