/* libcublas.so.13 stand-in: handles, streams, math/pointer modes and the
 * workspace torch hands over with cublasSetWorkspace_v2 (torch allocates it
 * through its caching allocator, so it shows in the allocator's statistics).
 * Every BLAS routine the generated part declares returns
 * CUBLAS_STATUS_SUCCESS without computing: device memory has no contents.
 * The real cuBLAS carries a static CUDA runtime that needs a real driver.
 * Written from the cuBLAS 13 API reference. */
#include <stdlib.h>

enum { CUBLAS_STATUS_SUCCESS = 0 };

typedef struct { void *stream; int math_mode; int pointer_mode; void *workspace; size_t workspace_bytes; } handle_t;

int cublasCreate_v2(handle_t **h) { *h = calloc(1, sizeof **h); return CUBLAS_STATUS_SUCCESS; }
int cublasDestroy_v2(handle_t *h) { free(h); return CUBLAS_STATUS_SUCCESS; }
int cublasSetStream_v2(handle_t *h, void *s) { h->stream = s; return CUBLAS_STATUS_SUCCESS; }
int cublasGetStream_v2(handle_t *h, void **s) { *s = h->stream; return CUBLAS_STATUS_SUCCESS; }
int cublasSetWorkspace_v2(handle_t *h, void *ws, size_t bytes) {
    h->workspace = ws; h->workspace_bytes = bytes; return CUBLAS_STATUS_SUCCESS;
}
int cublasSetMathMode(handle_t *h, int mode) { h->math_mode = mode; return CUBLAS_STATUS_SUCCESS; }
int cublasGetMathMode(handle_t *h, int *mode) { *mode = h->math_mode; return CUBLAS_STATUS_SUCCESS; }
int cublasSetPointerMode_v2(handle_t *h, int mode) { h->pointer_mode = mode; return CUBLAS_STATUS_SUCCESS; }
int cublasGetPointerMode_v2(handle_t *h, int *mode) { *mode = h->pointer_mode; return CUBLAS_STATUS_SUCCESS; }
int cublasSetSmCountTarget(handle_t *h, int n) { (void)h; (void)n; return CUBLAS_STATUS_SUCCESS; }
int cublasGetVersion_v2(handle_t *h, int *v) { (void)h; *v = 130100; return CUBLAS_STATUS_SUCCESS; }
const char *cublasGetStatusString(int s) { return s == 0 ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_NOT_SUPPORTED"; }
const char *cublasGetStatusName(int s) { return cublasGetStatusString(s); }
