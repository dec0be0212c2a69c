"""What CUDA kernels allocate inside an op, that the CPU kernels of the trace do not.

One dispatch mode, entered by :func:`llmem_plugin.trace.emulation.cuda_emulation`
inside the tracker, looks at every ATen op of the traced step:

* **Reduction scratch.** A ``sum`` / ``mean`` that CUDA splits across thread
  blocks allocates a buffer and semaphores after its output and frees them
  before returning (:mod:`.reduce`); here the same two allocations are made
  and dropped, so the tracker sees them in the same place.
* **Scans into another dtype.** ``cumsum``/``cumprod`` copy their input into
  the output's dtype first (:func:`_cum_input_copy`).
* **Split copies.** ``split_with_sizes_copy.out`` (FSDP2's all-gather
  copy-out) packs its launch metadata into a device tensor
  (:func:`_split_copy_metadata_numel`).
* **Dropout.** CUDA's fused kernel allocates the mask before the output
  (:func:`_dropout_mask_first`).
* **Softmax backward.** CUDA's ``_softmax_backward_data`` computes
  ``grad * output`` into a temporary the size of the gradient, after its
  output and freed on return (aten/src/ATen/native/cuda/SoftMax.cu,
  ``softmax_backward_cuda_out``): one per eager-attention layer in backward
  (64 MiB per layer for Gemma-2-2B at 2 x 1024 tokens, on the stub).
* **Gradient accumulation in place.** Where two gradients of one input meet,
  the autograd engine adds them in place on a real run but out of place
  under the tracer (:func:`_accumulates_in_place`); the mode turns the
  engine's ``add`` back into ``add_``.
* **cuBLAS first use.** A thread's cuBLAS handle and its workspace (32 MiB on
  sm90, torch 2.13) are created by the thread's first cuBLAS call, after that
  call's output is allocated (aten/src/ATen/cuda/CublasHandlePool.cpp,
  ``getCurrentCUDABlasHandle`` sets the workspace when the gemm asks for the
  handle). The workspace is an overhead, not a tensor of the trace
  (:func:`llmem_plugin.device.overheads.workspace_allocations`); the mode only marks
  the spot (``mark("cublas")``, once per phase: forward runs on the main
  thread, backward on the autograd engine's device thread) and
  :func:`llmem_plugin.estimate.allocator_events` inserts the workspace there.
  On the stub CUDA device, placing it at the start of backward instead
  (before the loss gradient's first matmul) cost one 4.6 GiB segment on
  Qwen2.5-0.5B (benchmarks/results/stub-wholestep-2026-11-25.md).

Known limitations:
    * Ops that reach cuBLAS through other names (``_scaled_mm``, cuBLASLt
      grouped GEMMs) do not mark.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
from torch.utils._python_dispatch import TorchDispatchMode

from llmem_plugin.trace.emulation.reduce import MAX_THREADS_PER_SM, REDUCE_OPS, acc_bytes, global_reduce_bytes

__all__ = ["CUBLAS_OPS", "cublas_call", "cuda_kernels"]

_aten = torch.ops.aten
# ATen ops whose CUDA kernels call cuBLAS (aten/src/ATen/native/cuda/Blas.cpp):
# matmul, linear and einsum decompose into these.
CUBLAS_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.addbmm.default,
    _aten.mv.default, _aten.addmv.default, _aten.dot.default, _aten.vdot.default, _aten._addmm_activation.default,
})
_SOFTMAX_BACKWARD = _aten._softmax_backward_data.default
_NATIVE_DROPOUT = _aten.native_dropout.default
_SPLIT_WITH_SIZES_COPY_OUT = _aten.split_with_sizes_copy.out
# aten/src/ATen/native/cuda/TensorShape.cu: BLOCK_SIZE (128) threads of BYTES_PER_THREAD (16) bytes.
_SPLIT_BLOCK_BYTES = 128 * 16
_CUM_OPS = frozenset({_aten.cumsum.default, _aten.cumprod.default})
_ADD = _aten.add.Tensor
# Frames between a dispatch mode and the code that called the op.
_DISPATCH_FRAMES = (os.sep + "_dynamo" + os.sep, os.sep + "torch" + os.sep + "_compile.py")


def _engine_frame():
    """The ``_engine_run_backward`` frame when the op being dispatched was called by the autograd
    engine itself (C++: a derivative formula or the engine's gradient accumulation), not by Python
    code such as a custom ``Function.backward``; else None."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == __file__
                                 or any(part in frame.f_code.co_filename for part in _DISPATCH_FRAMES)):
        frame = frame.f_back
    return frame if frame is not None and frame.f_code.co_name == "_engine_run_backward" else None


def _held_by_a_caller(old: torch.Tensor, frame) -> bool:
    """Whether ``old`` is a gradient some ``backward()`` call handed the engine and still holds.

    torch/autograd/graph.py ``_engine_run_backward(t_outputs, grad_tensors, ...)``: its caller keeps
    ``grad_tensors`` for the whole run. Reentrant checkpointing (torch/utils/checkpoint.py
    ``CheckpointFunction.backward``) runs its inner backward with the gradients it was given, so where
    one of them meets a second gradient of the same input (the residual stream inside the block) the
    engine's buffer does not hold the last reference, and CUDA adds out of place (the stub device).
    """
    storage = old.untyped_storage()._cdata
    while frame is not None:
        if frame.f_code.co_name == "_engine_run_backward":
            args = frame.f_locals.get("args") or ()
            grads = args[0] if args else ()
            for g in grads if isinstance(grads, (tuple, list)) else ():
                if isinstance(g, torch.Tensor) and g.untyped_storage()._cdata == storage:
                    return True
        frame = frame.f_back
    return False


def _accumulates_in_place(args: tuple, kwargs: dict) -> bool:
    """Whether this ``add`` is the engine summing two gradients of one input, which a
    CUDA run does in place.

    torch/csrc/autograd/input_buffer.cpp ``accumulate`` (torch 2.13): with grad
    mode off, ``buffer[pos] = old_var.add_(var)`` when ``can_accumulate_inplace(old_var)``
    -- a plain tensor (not a tensor subclass), non-overlapping and dense, whose
    last reference the buffer holds, storage included (so not a view) -- else
    ``old_var + var``. Under the
    tracer every tensor is a FakeTensor and a dispatch mode holds references,
    so the engine always takes the out-of-place branch and the trace gains a
    transient the size of the gradient at every fan-in (residual streams,
    rotary halves, tied embeddings: 2.2 GiB for Gemma-2-2B's embedding
    gradient). A real run holds the last reference at that point: the other
    consumers of a gradient shared by two inputs have run before the second
    gradient of an input can arrive. Derivative formulas that add with grad
    mode off (none on the traced models' paths) are taken for accumulation.
    """
    if kwargs or len(args) != 2 or torch.is_grad_enabled() or torch._C._current_autograd_node() is None:
        return False
    old, var = args
    if not (isinstance(old, torch.Tensor) and isinstance(var, torch.Tensor)):
        return False
    if old.shape != var.shape or old.dtype != var.dtype or old.is_sparse or var.is_sparse:
        return False
    # A view (a transposed weight gradient from TBackward, a reshaped one)
    # shares its storage with its base, which the view keeps alive:
    # ``storage().use_count() == 1`` fails and CUDA adds out of place (seen on
    # the stub for Llama-3.2-1B's tied embedding under checkpointing).
    if old._is_view() or not is_non_overlapping_and_dense(old):
        return False
    frame = _engine_frame()
    return frame is not None and not _held_by_a_caller(old, frame)
def _promoted_input(x: torch.Tensor, out: object) -> torch.Tensor | None:
    """The input copy a sum or mean into a wider dtype makes (a bool or int32
    ``sum`` into int64), after its output and freed once the kernel returns.

    ReduceOpsUtils.h ``make_reduction_from_shape_and_dtype`` reduces in the
    output's dtype (``in_dtype = out_dtype``) except for fp16/bf16 into fp32 on
    CUDA, and ``make_reduction`` hands ``self.to(in_dtype)`` to the iterator.
    The copy is internal to the op, so a dispatch-level trace does not see it
    (the stub CUDA device does: tests/stub/test_device.py).
    """
    if not isinstance(out, torch.Tensor) or not isinstance(x, torch.Tensor) or out.dtype == x.dtype:
        return None
    if x.dtype in (torch.float16, torch.bfloat16) and out.dtype == torch.float32:
        return None  # gpu_lowp_to_f32: the kernel reads the 16-bit input itself
    if x.is_complex() or out.is_complex():
        return None
    return torch.empty_like(x, dtype=out.dtype)


def _is_fsdp_split_copy(func) -> bool:
    """FSDP2's ``fsdp::split_with_sizes_copy`` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):
    a custom op over ``split_with_sizes_copy.out`` with its arguments, seen here in place of the aten op."""
    return getattr(func, "namespace", None) == "fsdp" and func.__name__.startswith("split_with_sizes_copy")


def _split_copy_metadata_numel(args: tuple, kwargs: dict, num_sms: int, max_threads_per_sm: int) -> int:
    """int64 elements of the metadata CUDA's ``split_with_sizes_copy.out`` copies to the device, or 0 where
    it takes the composite path (FSDP2's all-gather copy-out, a few hundred bytes per group).

    aten/src/ATen/native/cuda/TensorShape.cu ``split_with_sizes_copy_out_cuda``: when the input and every
    output are non-overlapping and dense and of one dtype, ``..._contiguous_no_cast`` packs five int64
    vectors (``pack_vecs``): the n destination and n source addresses, the n splits' chunk bytes, one
    split index per thread block, and n + 1 block cumsums. Each split takes ``ceil(chunk bytes /
    (2048 * iters_per_chunk))`` blocks, ``iters_per_chunk`` regulating the grid to at most
    ``num_sms * max_threads_per_sm / 128 * 2`` blocks.
    """
    x = args[0]
    sizes = list(args[1] if len(args) > 1 else
                 kwargs.get("split_sizes", kwargs.get("all_gather_input_split_sizes", ())))
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    out = kwargs.get("out") or (args[3] if len(args) > 3 else None)
    if not isinstance(x, torch.Tensor) or not out or x.dim() == 0:
        return 0
    if not is_non_overlapping_and_dense(x) or any(
            not is_non_overlapping_and_dense(t) or t.dtype != x.dtype for t in out):
        return 0
    dim = dim % x.dim()
    num_chunks = 1
    for d in range(dim):
        num_chunks *= x.size(d)
    chunk_bytes = [n * x.stride(dim) * x.element_size() for n in sizes]
    num_blocks = sum(-(-c // _SPLIT_BLOCK_BYTES) for c in chunk_bytes)
    max_blocks = int(num_sms * max_threads_per_sm / 128 * 2.0)
    iter_factor = -(-num_blocks * num_chunks // max_blocks)
    chunks_per_block = min(math.ceil(math.sqrt(iter_factor)), num_chunks)
    iters_per_chunk = -(-iter_factor // max(chunks_per_block, 1))
    blocks = sum(-(-c // (_SPLIT_BLOCK_BYTES * iters_per_chunk)) for c in chunk_bytes)
    return 4 * len(sizes) + 1 + blocks


def _fused_dropout(args: tuple, kwargs: dict) -> bool:
    """Whether ``native_dropout(input, p, train)`` runs CUDA's fused kernel (``dropout_cuda``), not a
    short-cut: train not False and p != 1 (Dropout.cu ``native_dropout_cuda``), a non-empty input
    (``dropout_cuda`` returns a clone and the mask before its output for an empty one)."""
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p")
    train = args[2] if len(args) > 2 else kwargs.get("train")
    return (isinstance(x, torch.Tensor) and isinstance(p, (int, float)) and 0.0 <= p < 1.0 and x.numel() > 0
            and train is not False)


def _dropout_mask_first(func, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA's ``dropout_cuda`` (Dropout.cu) allocates the bool mask, then the output; the CPU and fake
    kernels make the output first (on the stub device the mask comes first)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from llmem_plugin.trace._pause import untracked

    x = args[0]
    mask = torch.empty_like(x, dtype=torch.bool)
    out = torch.empty_like(x)
    if not isinstance(x, FakeTensor):  # a real run: the values, computed untracked
        with untracked():
            value, keep = func(*args, **kwargs)
            out.copy_(value)
            mask.copy_(keep)
            del value, keep
    return out, mask


def _cum_input_copy(x: torch.Tensor, out: object) -> torch.Tensor | None:
    """The input copy ``cumsum``/``cumprod`` into another dtype makes (a bool mask's ``cumsum`` into
    int64), after the output and freed once the scan returns.

    ReduceOps.cpp ``impl_func_cum_ops`` hands ``self.to(result.scalar_type())`` to the scan stub (the
    XPU port in torch-xpu-ops' ``ScanKernels``/``ReduceOps`` keeps the same line); ``to`` copies when
    the dtypes differ, preserving the input's strides. A 0-dim or empty input takes no copy (``fill_`` /
    ``zero_``). Seen on the stub CUDA device in transformers' ``find_packed_sequence_indices``
    (``(position_diff != 1).cumsum(-1)``, once per forward).
    """
    if not isinstance(out, torch.Tensor) or not isinstance(x, torch.Tensor) or out.dtype == x.dtype:
        return None
    if x.dim() == 0 or x.numel() == 0:
        return None
    return torch.empty_like(x, dtype=out.dtype)  # preserve_format, as ``to`` copies


# Threads per multiprocessor where the table has no entry: sm90's.
_DEFAULT_MAX_THREADS_PER_SM = 2048


class _CudaKernelMode(TorchDispatchMode):
    def __init__(self, num_sms: int, max_threads_per_sm: int, mark: Callable[[str], None] | None) -> None:
        super().__init__()
        self.num_sms = num_sms
        self.max_threads_per_sm = max_threads_per_sm
        self.mark = mark

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ADD and _accumulates_in_place(args, kwargs):
            return args[0].add_(args[1])
        if func is _NATIVE_DROPOUT and _fused_dropout(args, kwargs):
            return _dropout_mask_first(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in CUBLAS_OPS:
            if self.mark is not None:
                self.mark("cublas")
        elif func in REDUCE_OPS:
            copy = _promoted_input(args[0], out)
            self._reduce_scratch(args, kwargs)
            del copy
        elif func is _SPLIT_WITH_SIZES_COPY_OUT or _is_fsdp_split_copy(func):
            numel = _split_copy_metadata_numel(args, kwargs, self.num_sms, self.max_threads_per_sm)
            if numel:  # pack_vecs: one int64 device tensor, freed when the launch returns
                metadata = torch.empty(numel, dtype=torch.int64, device=args[0].device)
                del metadata
        elif func in _CUM_OPS:
            copy = _cum_input_copy(args[0], out)
            del copy
        elif func is _SOFTMAX_BACKWARD:
            # SoftMax.cu, softmax_backward_cuda_out: ``Tensor tmp = grad * output;``
            # after grad_input is allocated, freed on return (the CPU kernel makes none).
            grad, output = args[0], args[1]
            tmp = torch.empty(torch.broadcast_shapes(grad.shape, output.shape),
                              dtype=torch.result_type(grad, output), device=grad.device)
            del tmp
        return out

    def _reduce_scratch(self, args, kwargs) -> None:
        x = args[0]
        if not x.dtype.is_floating_point or x.numel() <= 1:
            return
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        buffer, semaphores = global_reduce_bytes(x, dims, acc_bytes=acc_bytes(x.dtype), num_sms=self.num_sms,
                                                 max_threads_per_sm=self.max_threads_per_sm)
        if buffer:
            # Reduce.cuh gpu_reduce_kernel: after the output; DataPtr locals, freed in reverse order.
            buf = torch.empty(buffer, dtype=torch.uint8, device=x.device)
            sem = torch.empty(semaphores, dtype=torch.uint8, device=x.device)
            del sem, buf


def cublas_call() -> None:
    """Mark a cuBLAS call that an emulated kernel makes without dispatching a matmul (bitsandbytes'
    dequantize-then-``F.linear`` fallback, whose output the emulation allocates itself): the active
    mode marks the spot as it does after a CUBLAS_OPS op. Outside :func:`cuda_kernels`, nothing."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, _CudaKernelMode) and mode.mark is not None:
            mode.mark("cublas")


@contextlib.contextmanager
def cuda_kernels(*, compute_capability: tuple[int, int], num_sms: int,
                 mark: Callable[[str], None] | None = None) -> Iterator[None]:
    """Emulate the CUDA kernels' own allocations for the duration of the block.

    Args:
        compute_capability: The GPU's, for its resident threads per multiprocessor.
        num_sms: The GPU's multiprocessor count.
        mark: Called with "cublas" after every cuBLAS op (the tracker keeps
            the first per phase: ``MemoryTracker.mark``); None to mark nothing.
    """
    threads = MAX_THREADS_PER_SM.get(tuple(compute_capability), _DEFAULT_MAX_THREADS_PER_SM)
    with _CudaKernelMode(num_sms, threads, mark):
        yield
