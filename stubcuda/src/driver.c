/* libcuda.so.1 stand-in: the driver API calls torch makes directly
 * (libcaffe2_nvrtc.so links libcuda.so.1) or through
 * cudaGetDriverEntryPointByVersion. The virtual-memory calls behind
 * expandable segments (cuMemCreate/Map/AddressReserve...) are real enough for
 * the caching allocator: cuMemCreate charges the same capacity as cudaMalloc,
 * and address reservations come from the same never-touched arena.
 * Written from the CUDA 13.0 driver API reference. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stubcuda.h"

enum { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_OUT_OF_MEMORY = 2,
       CUDA_ERROR_NOT_SUPPORTED = 801 };

typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

extern int cudaDeviceGetAttribute(int *value, int attr, int dev);

static char g_ctx[64];

int cuInit(unsigned flags) { (void)flags; stubcuda_device(); return CUDA_SUCCESS; }
int cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }
int cuDeviceGet(int *dev, int ordinal) {
    if (ordinal < 0 || ordinal >= stubcuda_device()->num_devices) return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *dev = ordinal;
    return CUDA_SUCCESS;
}
int cuDeviceGetCount(int *n) { *n = stubcuda_device()->num_devices; return CUDA_SUCCESS; }
/* CUdevice_attribute and cudaDeviceAttr share their numbering. */
int cuDeviceGetAttribute(int *v, int attr, int dev) { return cudaDeviceGetAttribute(v, attr, dev) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS; }
int cuDeviceGetUuid(unsigned char *uuid, int dev) { memset(uuid, 0, 16); uuid[0] = 0x57; uuid[15] = (unsigned char)dev; return CUDA_SUCCESS; }
int cuDeviceGetUuid_v2(unsigned char *uuid, int dev) { return cuDeviceGetUuid(uuid, dev); }
int cuCtxGetCurrent(void **ctx) { *ctx = g_ctx; return CUDA_SUCCESS; }
int cuCtxSetCurrent(void *ctx) { (void)ctx; return CUDA_SUCCESS; }
int cuCtxPushCurrent(void *ctx) { (void)ctx; return CUDA_SUCCESS; }
int cuCtxPopCurrent(void **ctx) { if (ctx) *ctx = g_ctx; return CUDA_SUCCESS; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { (void)dev; *ctx = g_ctx; return CUDA_SUCCESS; }
int cuDevicePrimaryCtxGetState(int dev, unsigned *flags, int *active) {
    (void)dev; if (flags) *flags = 0; if (active) *active = 1; return CUDA_SUCCESS;
}
int cuGetErrorString(int e, const char **s) {
    *s = e == CUDA_SUCCESS ? "no error"
       : e == CUDA_ERROR_OUT_OF_MEMORY ? "out of memory"
       : e == CUDA_ERROR_NOT_SUPPORTED ? "operation not supported on the stub CUDA device"
       : "stub CUDA device error";
    return CUDA_SUCCESS;
}
int cuGetErrorName(int e, const char **s) {
    *s = e == CUDA_SUCCESS ? "CUDA_SUCCESS"
       : e == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY"
       : e == CUDA_ERROR_NOT_SUPPORTED ? "CUDA_ERROR_NOT_SUPPORTED" : "CUDA_ERROR_UNKNOWN";
    return CUDA_SUCCESS;
}

/* ---- virtual memory management (expandable segments) ------------------- */

typedef struct { size_t bytes; } physical_t;

int cuMemGetAllocationGranularity(size_t *g, const void *prop, int option) {
    (void)prop; (void)option; *g = STUB_GRANULE; return CUDA_SUCCESS;
}
int cuMemCreate(CUmemGenericAllocationHandle *h, size_t bytes, const void *prop, unsigned long long flags) {
    (void)prop; (void)flags;
    if (bytes == 0 || bytes % STUB_GRANULE) return CUDA_ERROR_INVALID_VALUE;
    if (stubcuda_charge(bytes)) return CUDA_ERROR_OUT_OF_MEMORY;
    physical_t *p = malloc(sizeof *p);
    p->bytes = bytes;
    *h = (CUmemGenericAllocationHandle)(uintptr_t)p;
    return CUDA_SUCCESS;
}
int cuMemRelease(CUmemGenericAllocationHandle h) {
    physical_t *p = (physical_t *)(uintptr_t)h;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    stubcuda_uncharge(p->bytes);
    free(p);
    return CUDA_SUCCESS;
}
int cuMemAddressReserve(CUdeviceptr *ptr, size_t bytes, size_t align, CUdeviceptr addr, unsigned long long flags) {
    (void)addr; (void)flags;
    void *p = stubcuda_reserve(bytes, align ? align : STUB_GRANULE);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}
int cuMemAddressFree(CUdeviceptr ptr, size_t bytes) { (void)ptr; (void)bytes; return CUDA_SUCCESS; }
int cuMemMap(CUdeviceptr ptr, size_t bytes, size_t off, CUmemGenericAllocationHandle h, unsigned long long fl) {
    (void)ptr; (void)bytes; (void)off; (void)h; (void)fl; return CUDA_SUCCESS;
}
int cuMemUnmap(CUdeviceptr ptr, size_t bytes) { (void)ptr; (void)bytes; return CUDA_SUCCESS; }
int cuMemSetAccess(CUdeviceptr ptr, size_t bytes, const void *desc, size_t n) {
    (void)ptr; (void)bytes; (void)desc; (void)n; return CUDA_SUCCESS;
}
int cuMemsetD32Async(CUdeviceptr p, unsigned v, size_t n, void *s) { (void)p; (void)v; (void)n; (void)s; return CUDA_SUCCESS; }
int cuStreamWriteValue32(void *s, CUdeviceptr p, unsigned v, unsigned f) { (void)s; (void)p; (void)v; (void)f; return CUDA_SUCCESS; }

/* ---- modules and launches: no-ops -------------------------------------- */

static char g_module[64], g_function[64];
int cuModuleLoadData(void **m, const void *img) { (void)img; *m = g_module; return CUDA_SUCCESS; }
int cuModuleLoadDataEx(void **m, const void *img, unsigned n, void *o, void **v) {
    (void)img; (void)n; (void)o; (void)v; *m = g_module; return CUDA_SUCCESS;
}
int cuModuleGetFunction(void **f, void *m, const char *name) { (void)m; (void)name; *f = g_function; return CUDA_SUCCESS; }
int cuModuleUnload(void *m) { (void)m; return CUDA_SUCCESS; }
int cuLaunchKernel(void) { return CUDA_SUCCESS; }
int cuLaunchCooperativeKernel(void) { return CUDA_SUCCESS; }
int cuFuncSetCacheConfig(void *f, int c) { (void)f; (void)c; return CUDA_SUCCESS; }
int cuFuncSetAttribute(void *f, int a, int v) { (void)f; (void)a; (void)v; return CUDA_SUCCESS; }
int cuFuncGetAttribute(int *v, int a, void *f) { (void)a; (void)f; *v = 0; return CUDA_SUCCESS; }
int cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, void *f, int block, size_t smem) {
    (void)f; (void)smem; *n = block > 0 && block <= 2048 ? 2048 / block : 1; return CUDA_SUCCESS;
}
