/* Shared state of the stub CUDA device: device properties read from the
 * environment, one virtual-address arena that is reserved PROT_NONE and never
 * touched, and the capacity account that cudaMalloc and cuMemCreate charge.
 *
 * Everything here is declared by this project; no CUDA header is included.
 * Struct layouts and enum values follow the CUDA 13.0 runtime/driver API
 * reference (driver_types.h, cuda.h declarations). */
#ifndef STUBCUDA_H
#define STUBCUDA_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    char name[256];
    size_t total_mem;        /* cudaDeviceProp.totalGlobalMem */
    size_t capacity;         /* what cudaMalloc + cuMemCreate may hand out */
    int major, minor;        /* compute capability */
    int num_sms;
    int l2_bytes;
    int smem_optin_bytes;    /* cudaDevAttrMaxSharedMemoryPerBlockOptin */
    int smem_per_sm_bytes;
    int num_devices;
} stub_device_t;

/* Exported from libcudart.so.13 (version node STUBCUDA_PRIVATE) for the
 * other stand-ins. */
const stub_device_t *stubcuda_device(void);
/* Charge/uncharge the capacity; returns 0 on success, -1 when over capacity. */
int stubcuda_charge(size_t bytes);
void stubcuda_uncharge(size_t bytes);
size_t stubcuda_used(void);
/* Reserve `bytes` of address space aligned to `align` (a power of two) from
 * the arena; never returns memory that is backed. NULL when exhausted. */
void *stubcuda_reserve(size_t bytes, size_t align);
/* 1 when p lies in the arena, i.e. is a device address. */
int stubcuda_is_device(const void *p);

#define STUB_GRANULE (2u << 20) /* 2 MiB: cuMemGetAllocationGranularity on
                                   NVIDIA GPUs (CUDA driver API, virtual memory
                                   management section) and the alignment the
                                   stand-in gives cudaMalloc results. */

#endif
