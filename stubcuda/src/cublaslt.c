/* libcublasLt.so.13 stand-in: descriptors are opaque heap handles, the
 * heuristic query offers one algorithm that needs no workspace, and matmul is
 * a no-op. torch sizes and allocates the Lt workspace itself, through its
 * caching allocator. Written from the cuBLASLt 13 API reference. */
#include <stdlib.h>
#include <string.h>

enum { CUBLAS_STATUS_SUCCESS = 0 };

/* cublasLtMatmulHeuristicResult_t: algo (8 x uint64), workspaceSize, state,
 * wavesCount, reserved[4]. */
typedef struct {
    unsigned long long algo[8];
    size_t workspace_size;
    int state;
    float waves_count;
    int reserved[4];
} heuristic_t;

static int create(void **d) { *d = calloc(1, 64); return CUBLAS_STATUS_SUCCESS; }
static int destroy(void *d) { free(d); return CUBLAS_STATUS_SUCCESS; }

size_t cublasLtGetVersion(void) { return 130100; }
int cublasLtCreate(void **h) { return create(h); }
int cublasLtDestroy(void *h) { return destroy(h); }
int cublasLtMatmulDescCreate(void **d, int compute, int scale) { (void)compute; (void)scale; return create(d); }
int cublasLtMatmulDescDestroy(void *d) { return destroy(d); }
int cublasLtMatmulDescSetAttribute(void *d, int a, const void *v, size_t n) { (void)d; (void)a; (void)v; (void)n; return 0; }
int cublasLtMatmulPreferenceCreate(void **d) { return create(d); }
int cublasLtMatmulPreferenceDestroy(void *d) { return destroy(d); }
int cublasLtMatmulPreferenceSetAttribute(void *d, int a, const void *v, size_t n) { (void)d; (void)a; (void)v; (void)n; return 0; }
int cublasLtMatrixLayoutCreate(void **d, int type, unsigned long long r, unsigned long long c, long long ld) {
    (void)type; (void)r; (void)c; (void)ld; return create(d);
}
int cublasLtMatrixLayoutDestroy(void *d) { return destroy(d); }
int cublasLtMatrixLayoutSetAttribute(void *d, int a, const void *v, size_t n) { (void)d; (void)a; (void)v; (void)n; return 0; }
int cublasLtMatmulAlgoGetHeuristic(void *h, void *op, void *a, void *b, void *c, void *d, void *pref,
                                   int requested, heuristic_t *results, int *returned) {
    (void)h; (void)op; (void)a; (void)b; (void)c; (void)d; (void)pref;
    if (requested < 1) { *returned = 0; return CUBLAS_STATUS_SUCCESS; }
    memset(&results[0], 0, sizeof results[0]);
    results[0].waves_count = 1.0f;
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}
int cublasLtMatmul(void) { return CUBLAS_STATUS_SUCCESS; }
