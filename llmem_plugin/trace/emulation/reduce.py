"""The scratch memory of CUDA reduction kernels (sum, mean) split across thread blocks.

ATen's generic CUDA reduction (``gpu_reduce_kernel``,
aten/src/ATen/native/cuda/Reduce.cuh, torch 2.13) picks a launch
configuration (``setReduceConfig``) from the reduction's shape and the GPU's
multiprocessor count. When few outputs each reduce many inputs -- the bias
gradient of a Linear / Conv1D (``grad.sum`` over the tokens) is the typical
case in training -- it splits every output's inputs across thread blocks
("global reduce") and allocates, through the caching allocator, after the
output::

    buffer     = allocator.allocate(config.global_memory_size())
    semaphores = allocator.allocate(config.semaphore_size())

both freed when the kernel has been launched (semaphores first: reverse
declaration order). For OPT-125m at 16 x 512 tokens the fc2 bias gradient
takes a 48 MiB buffer; on the stub CUDA device (torch's real allocator) the
pair shows after every such ``sum`` (benchmarks/results/stub-wholestep-2026-11-25.md).
CPU kernels allocate nothing of the kind, so the kernel emulation
(:mod:`.kernels`) adds the pair to the trace after each ``sum`` / ``mean``
that would take the global-reduce path on the target GPU.

A sum or mean into a wider dtype (a bool or int32 ``sum``, which returns
int64) also reduces a copy of its input in that dtype, made after the output
and freed when the op returns (``make_reduction_from_shape_and_dtype``;
fp16/bf16 into fp32 on CUDA reads the input itself); the kernel emulation
adds it too (``kernels._promoted_input``, checked on the stub device).

Known limitations:
    * Only ``sum`` and ``mean`` (what the traced steps reduce with ATen's
      generic kernel and a split); norms, ``amax`` and the like are not
      emulated.
    * Inputs of 2**31 elements or more, which ATen splits into 32-bit
      indexable sub-iterations (each with its own configuration), are
      configured as one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["MAX_THREADS_PER_SM", "REDUCE_OPS", "acc_bytes", "global_reduce_bytes"]

# Reduce.cuh mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex<double> only).
_MAX_NUM_THREADS = 512
_WARP_SIZE = 32
# setReduceConfig (CUDA, not ROCm): min_values_per_thread, max_values_per_thread.
_MIN_VALUES_PER_THREAD = 16
_MAX_VALUES_PER_THREAD = 256
# gpu_reduce_kernel<scalar_t, out_t, vt0=4, input_vec_size=vt0> (sum_kernel_cuda, mean_kernel_cuda).
_INPUT_VEC_SIZE = 4
# CUDA C Programming Guide, "Technical Specifications per Compute Capability":
# maximum resident threads per multiprocessor (cudaDeviceProp.maxThreadsPerMultiProcessor).
MAX_THREADS_PER_SM = {(7, 0): 2048, (7, 5): 1024, (8, 0): 2048, (8, 6): 1536, (8, 7): 2048, (8, 9): 1536,
                       (9, 0): 2048, (10, 0): 2048, (10, 3): 2048, (12, 0): 1536}
# The ops whose CUDA kernel is gpu_reduce_kernel (ReduceSumProdKernel.cu, ReduceMomentKernel.cu).
REDUCE_OPS = {
    torch.ops.aten.sum.dim_IntList,
    torch.ops.aten.sum.default,
    torch.ops.aten.mean.dim,
    torch.ops.aten.mean.default,
}


def _last_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _iterator(shape: Sequence[int], in_strides: Sequence[int], reduced: set[int]) -> tuple[list[int], list[int],
                                                                                          list[int]]:
    """TensorIterator's view of a reduction: (shape, input strides, output strides), in elements.

    As ``reorder_dimensions`` (fastest dimension first, reduced dimensions --
    stride 0 in the output -- to the front; the output compared before the
    input) and ``coalesce_dimensions`` (aten/src/ATen/TensorIterator.cpp).
    """
    ndim = len(shape)
    out_strides, acc = [0] * ndim, 1
    for d in reversed(range(ndim)):  # the output: contiguous, keepdim, stride 0 where reduced
        if d not in reduced:
            out_strides[d] = acc
            acc *= shape[d]
    operands = [out_strides, list(in_strides)]

    def should_swap(d0: int, d1: int) -> int:
        for k, strides in enumerate(operands):
            s0, s1 = strides[d0], strides[d1]
            if k == 0 and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(reversed(range(ndim)))
    for i in range(1, ndim):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    shp = [shape[p] for p in perm]
    ops = [[s[p] for p in perm] for s in operands]
    prev = 0
    for d in range(1, ndim):
        if shp[prev] == 1 or shp[d] == 1 or all(shp[prev] * s[prev] == s[d] for s in ops):
            if shp[prev] == 1:
                for s in ops:
                    s[prev] = s[d]
            shp[prev] *= shp[d]
        else:
            prev += 1
            if prev != d:
                for s in ops:
                    s[prev] = s[d]
                shp[prev] = shp[d]
    n = prev + 1 if ndim else 0
    return shp[:n], ops[1][:n], ops[0][:n]


def global_reduce_bytes(x: torch.Tensor, dims: Sequence[int] | None, *, acc_bytes: int, num_sms: int,
                        max_threads_per_sm: int) -> tuple[int, int]:
    """``(global_memory_size, semaphore_size)`` of ``setReduceConfig`` for reducing ``x`` over ``dims``.

    Args:
        x: The input (its shape, strides and storage offset are used).
        dims: Reduced dimensions; None or empty for all.
        acc_bytes: ``sizeof(arg_t)``, the accumulation type (4 for fp32 /
            bf16 / fp16 sums and means, 8 for float64).
        num_sms: ``multiProcessorCount``.
        max_threads_per_sm: ``maxThreadsPerMultiProcessor``.

    Returns:
        Bytes of the two scratch allocations, (0, 0) when the kernel does
        not reduce across blocks.
    """
    shape = list(x.shape)
    ndim = len(shape)
    numel = math.prod(shape)
    if numel == 0:
        return 0, 0
    reduced = set(range(ndim)) if not dims else {d % ndim for d in dims}
    shp, in_st, out_st = _iterator(shape, x.stride(), reduced)
    num_outputs = math.prod(s for s, o in zip(shp, out_st, strict=True) if o != 0) if shp else 1
    num_reduce_dims = sum(1 for o in out_st if o == 0)
    inputs_per_output = numel // num_outputs
    output_vec_size = 1
    vectorize_input = False
    if shp:
        on_fastest = num_reduce_dims == len(shp) or in_st[0] < in_st[num_reduce_dims]
        if on_fastest:
            dim0, dim1, fastest = inputs_per_output, num_outputs, in_st[0]
        else:
            dim0, dim1, fastest = num_outputs, inputs_per_output, in_st[num_reduce_dims]
    else:
        on_fastest, dim0, dim1, fastest = True, 1, 1, 1
    if fastest == 1:
        if on_fastest and dim0 >= 128 and num_reduce_dims == 1:
            vectorize_input = True
            dim0 //= _INPUT_VEC_SIZE
        elif not on_fastest:
            # get_output_vec_size: 4, halved until it divides the input's address
            # (in elements), the output dimension's size and every other stride.
            vec = 4
            for n in [x.storage_offset(), shp[num_reduce_dims]] + [s for j, s in enumerate(in_st)
                                                                    if j != num_reduce_dims]:
                while n % vec:
                    vec //= 2
            output_vec_size = vec
            dim0 //= output_vec_size
    del vectorize_input  # changes dim0 only (above)
    max_threads = _MAX_NUM_THREADS // output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, _WARP_SIZE)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height
    step_input, step_output = 1, 1
    block_x_reduce = False
    if not shp or on_fastest:
        block_x_reduce = True
        step_input *= block_width
    else:
        step_output *= block_width
    values_per_thread = _div_up(inputs_per_output, step_input)
    split_across_warps = values_per_thread >= min(block_height * 16, _MAX_VALUES_PER_THREAD)
    if split_across_warps:
        step_input *= block_height
    else:
        step_output *= block_height
    target_grid = num_sms * (max_threads_per_sm // num_threads)
    grid_x = _div_up(num_outputs // output_vec_size, step_output)
    values_per_thread = _div_up(inputs_per_output, step_input)
    if not (split_across_warps and values_per_thread >= _MAX_VALUES_PER_THREAD and grid_x <= target_grid):
        return 0, 0
    ctas = max(min(_div_up(target_grid, grid_x), _div_up(values_per_thread, _MIN_VALUES_PER_THREAD)),
               _div_up(values_per_thread, _MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return 0, 0
    size = acc_bytes * num_outputs * ctas
    if not block_x_reduce:
        size *= block_width * output_vec_size
    return size, 4 * grid_x  # sizeof(int) per output block


def acc_bytes(dtype: torch.dtype) -> int:
    """``sizeof(arg_t)`` of a sum / mean over ``dtype``."""
    # at::acc_type<scalar_t, /*is_cuda=*/true>: float for half / bfloat16 / float, double for double.
    return 8 if dtype == torch.float64 else 4
