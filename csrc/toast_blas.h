/*
 * toast_blas.h -- the few CBLAS and LAPACK routines the core calls.
 *
 * Declared here rather than taken from a vendor header so that the same
 * code builds against the scipy-openblas32 wheel (symbols prefixed, e.g.
 * scipy_cblas_dgemm; the build defines TOAST_BLAS_PREFIX=scipy_) and against
 * a system OpenBLAS (no prefix). Integers are 32-bit (LP64 interface).
 * LAPACK routines take Fortran hidden string lengths as trailing size_t
 * arguments.
 */
#ifndef TOAST_BLAS_H
#define TOAST_BLAS_H

#include <stddef.h>

#define TOAST_CAT_(a, b) a##b
#define TOAST_CAT(a, b) TOAST_CAT_(a, b)
#ifdef TOAST_BLAS_PREFIX
#define TOAST_BLAS(name) TOAST_CAT(TOAST_BLAS_PREFIX, name)
#else
#define TOAST_BLAS(name) name
#endif

enum { TOAST_CblasRowMajor = 101, TOAST_CblasColMajor = 102 };
enum { TOAST_CblasNoTrans = 111, TOAST_CblasTrans = 112 };
enum { TOAST_CblasUpper = 121, TOAST_CblasLower = 122 };
enum { TOAST_CblasNonUnit = 131 };
enum { TOAST_CblasLeft = 141 };

#define toast_dgemm TOAST_BLAS(cblas_dgemm)
#define toast_sgemm TOAST_BLAS(cblas_sgemm)
#define toast_dsyrk TOAST_BLAS(cblas_dsyrk)
#define toast_ssyrk TOAST_BLAS(cblas_ssyrk)
#define toast_dtrsm TOAST_BLAS(cblas_dtrsm)
#define toast_dpotrf TOAST_BLAS(dpotrf_)
#define toast_dpocon TOAST_BLAS(dpocon_)
#define toast_dlansy TOAST_BLAS(dlansy_)
#define toast_dsyevd TOAST_BLAS(dsyevd_)
#define toast_dgesdd TOAST_BLAS(dgesdd_)

void toast_dgemm(int order, int transa, int transb, int m, int n, int k,
                 double alpha, const double *a, int lda, const double *b,
                 int ldb, double beta, double *c, int ldc);
void toast_sgemm(int order, int transa, int transb, int m, int n, int k,
                 float alpha, const float *a, int lda, const float *b, int ldb,
                 float beta, float *c, int ldc);
void toast_dsyrk(int order, int uplo, int trans, int n, int k, double alpha,
                 const double *a, int lda, double beta, double *c, int ldc);
void toast_ssyrk(int order, int uplo, int trans, int n, int k, float alpha,
                 const float *a, int lda, float beta, float *c, int ldc);
void toast_dtrsm(int order, int side, int uplo, int transa, int diag, int m,
                 int n, double alpha, const double *a, int lda, double *b,
                 int ldb);

void toast_dpotrf(const char *uplo, const int *n, double *a, const int *lda,
                  int *info, size_t uplo_len);
void toast_dpocon(const char *uplo, const int *n, const double *a,
                  const int *lda, const double *anorm, double *rcond,
                  double *work, int *iwork, int *info, size_t uplo_len);
double toast_dlansy(const char *norm, const char *uplo, const int *n,
                    const double *a, const int *lda, double *work,
                    size_t norm_len, size_t uplo_len);
void toast_dsyevd(const char *jobz, const char *uplo, const int *n, double *a,
                  const int *lda, double *w, double *work, const int *lwork,
                  int *iwork, const int *liwork, int *info, size_t jobz_len,
                  size_t uplo_len);
void toast_dgesdd(const char *jobz, const int *m, const int *n, double *a,
                  const int *lda, double *s, double *u, const int *ldu,
                  double *vt, const int *ldvt, double *work, const int *lwork,
                  int *iwork, int *info, size_t jobz_len);

#endif /* TOAST_BLAS_H */
