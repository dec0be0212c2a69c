/* libcudnn.so.9 stand-in: enough for torch to read versions and create a
 * handle. Every compute routine answers CUDNN_STATUS_NOT_SUPPORTED (from the
 * generated part), so cuDNN kernels must be switched off in stub runs
 * (stubcuda/README.md says which). Written from the cuDNN 9 API reference. */
#include <stdio.h>
#include <stdlib.h>

enum { CUDNN_STATUS_SUCCESS = 0 };

/* The cuDNN version torch 2.13.0+cu130 was built against (9.20.0, from
 * torch._C._cudnn.getCompileVersion()): its
 * torch.backends.cudnn.version() must find the same major and a minor no
 * older than the build's. STUBCUDA_CUDNN_VERSION overrides it. */
size_t cudnnGetVersion(void) {
    const char *v = getenv("STUBCUDA_CUDNN_VERSION");
    return v && *v ? strtoull(v, NULL, 10) : 92000;
}
size_t cudnnGetCudartVersion(void) { return 13000; }
int cudnnGetProperty(int type, int *value) {
    size_t v = cudnnGetVersion();
    *value = type == 0 ? (int)(v / 10000) : type == 1 ? (int)(v / 100 % 100) : (int)(v % 100);
    return CUDNN_STATUS_SUCCESS;
}
const char *cudnnGetErrorString(int s) { return s == 0 ? "CUDNN_STATUS_SUCCESS" : "CUDNN_STATUS_NOT_SUPPORTED (stub CUDA device)"; }
void cudnnGetLastErrorString(char *buf, size_t n) { if (n) snprintf(buf, n, "stub CUDA device: cuDNN computes nothing"); }
int cudnnCreate(void **h) { *h = calloc(1, 64); return CUDNN_STATUS_SUCCESS; }
int cudnnDestroy(void *h) { free(h); return CUDNN_STATUS_SUCCESS; }
int cudnnSetStream(void *h, void *s) { ((void **)h)[0] = s; return CUDNN_STATUS_SUCCESS; }
int cudnnGetStream(void *h, void **s) { *s = ((void **)h)[0]; return CUDNN_STATUS_SUCCESS; }
