/* libnvidia-ml.so.1 stand-in. c10 opens NVML when expandable segments are on
 * (GPU fabric information) and for its CUDA IPC checks; without a library it
 * calls through a null pointer. Memory queries answer zero used bytes: the
 * stand-in has no device memory outside PyTorch's allocator to report.
 * Written from the NVML API reference (nvml.h declarations, CUDA 13.0). */
#include <stdio.h>
#include <string.h>

#include "stubcuda.h"

enum { NVML_SUCCESS = 0, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_NOT_SUPPORTED = 3 };

static int handle_index(void *h) { return (int)((char *)h - (char *)0) - 1; }
static void *index_handle(int i) { return (char *)0 + i + 1; }

int nvmlInit_v2(void) { return NVML_SUCCESS; }
int nvmlInit(void) { return NVML_SUCCESS; }
int nvmlInitWithFlags(unsigned f) { (void)f; return NVML_SUCCESS; }
int nvmlShutdown(void) { return NVML_SUCCESS; }
const char *nvmlErrorString(int r) {
    return r == NVML_SUCCESS ? "Success" : r == NVML_ERROR_NOT_SUPPORTED ? "Not Supported" : "Stub NVML error";
}
int nvmlSystemGetCudaDriverVersion_v2(int *v) { *v = 13000; return NVML_SUCCESS; }
int nvmlSystemGetCudaDriverVersion(int *v) { *v = 13000; return NVML_SUCCESS; }
int nvmlSystemGetDriverVersion(char *buf, unsigned len) { snprintf(buf, len, "stubcuda"); return NVML_SUCCESS; }
int nvmlDeviceGetCount_v2(unsigned *n) { *n = (unsigned)stubcuda_device()->num_devices; return NVML_SUCCESS; }
int nvmlDeviceGetCount(unsigned *n) { return nvmlDeviceGetCount_v2(n); }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) {
    if ((int)i >= stubcuda_device()->num_devices) return NVML_ERROR_INVALID_ARGUMENT;
    *h = index_handle((int)i);
    return NVML_SUCCESS;
}
int nvmlDeviceGetHandleByIndex(unsigned i, void **h) { return nvmlDeviceGetHandleByIndex_v2(i, h); }
int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **h) {
    unsigned dom = 0, b = 0x18;
    sscanf(bus, "%x:%x", &dom, &b);
    return nvmlDeviceGetHandleByIndex_v2(b >= 0x18 ? b - 0x18 : 0, h);
}
int nvmlDeviceGetHandleByUUID(const char *uuid, void **h) { (void)uuid; return nvmlDeviceGetHandleByIndex_v2(0, h); }
int nvmlDeviceGetUUID(void *h, char *buf, unsigned len) {
    snprintf(buf, len, "GPU-57000000-0000-0000-0000-0000000000%02x", handle_index(h));
    return NVML_SUCCESS;
}
int nvmlDeviceGetName(void *h, char *buf, unsigned len) { (void)h; snprintf(buf, len, "%s", stubcuda_device()->name); return NVML_SUCCESS; }
int nvmlDeviceGetIndex(void *h, unsigned *i) { *i = (unsigned)handle_index(h); return NVML_SUCCESS; }
/* nvmlGpuFabricInfoV_t: version, clusterUuid[16], status, cliqueId, state,
 * ...; success with state 0 (NVML_GPU_FABRIC_STATE_NOT_SUPPORTED): no
 * multi-node NVLink fabric. Only the fields up to state are written. */
int nvmlDeviceGetGpuFabricInfoV(void *h, unsigned *info) {
    (void)h; memset(info + 1, 0, 16 + 3 * sizeof(unsigned)); return NVML_SUCCESS;
}
int nvmlDeviceGetComputeRunningProcesses(void *h, unsigned *count, void *infos) {
    (void)h; (void)infos; *count = 0; return NVML_SUCCESS;
}
int nvmlDeviceGetComputeRunningProcesses_v3(void *h, unsigned *count, void *infos) {
    return nvmlDeviceGetComputeRunningProcesses(h, count, infos);
}
/* nvmlMemory_t {total, free, used}: the stand-in measures nothing outside
 * PyTorch's allocator, so used is reported as 0 ("not measured"). */
int nvmlDeviceGetMemoryInfo(void *h, unsigned long long *mem) {
    (void)h; mem[0] = stubcuda_device()->total_mem; mem[1] = mem[0]; mem[2] = 0; return NVML_SUCCESS;
}
int nvmlDeviceGetP2PStatus(void *a, void *b, int idx, int *st) { (void)a; (void)b; (void)idx; (void)st; return NVML_ERROR_NOT_SUPPORTED; }
int nvmlDeviceGetNvLinkRemoteDeviceType(void *h, unsigned l, int *t) { (void)h; (void)l; (void)t; return NVML_ERROR_NOT_SUPPORTED; }
int nvmlDeviceGetNvLinkRemotePciInfo_v2(void *h, unsigned l, void *p) { (void)h; (void)l; (void)p; return NVML_ERROR_NOT_SUPPORTED; }
