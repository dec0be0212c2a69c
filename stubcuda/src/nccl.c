/* libnccl.so.2 stand-in: version and error strings only. Stub runs use
 * torch's fake process group; every collective answers ncclInvalidUsage. */
int ncclGetVersion(int *v) { *v = 22800; return 0; }
const char *ncclGetErrorString(int r) { return r == 0 ? "no error" : "NCCL is not available on the stub CUDA device"; }
const char *ncclGetLastError(void *comm) { (void)comm; return "NCCL is not available on the stub CUDA device"; }
