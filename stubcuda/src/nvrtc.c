/* libnvrtc.so.13 stand-in: version and error strings; compiling answers
 * NVRTC_ERROR_INTERNAL_ERROR, so runtime-compiled kernels are unavailable. */
int nvrtcVersion(int *major, int *minor) { *major = 13; *minor = 0; return 0; }
const char *nvrtcGetErrorString(int r) { return r == 0 ? "NVRTC_SUCCESS" : "NVRTC unavailable on the stub CUDA device"; }
