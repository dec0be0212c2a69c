"""Make a CPU trace allocate what the same step allocates on a CUDA GPU.

The trace runs on (fake) CPU tensors because fake CUDA tensors abort autograd
on CPU-only torch builds (shared FACTS). Wherever the CPU and CUDA code paths
allocate differently, :func:`cuda_emulation` switches the CPU path to the CUDA
behaviour for the duration of the trace:

* autocast follows the CUDA op policy (:mod:`.autocast`);
* ``scaled_dot_product_attention`` selects a CUDA backend and allocates what
  that kernel allocates (:mod:`.sdpa`);
* dropout uses the fused kernel CUDA uses (:func:`_cuda_dropout`);
* ``sum`` / ``mean`` reductions that CUDA splits across thread blocks
  allocate its scratch buffer and semaphores, and the first cuBLAS call of
  each phase marks where its thread's workspace is created (:mod:`.kernels`);
* transformers builds the same causal mask (none) it builds in a real run
  (:func:`_real_run_masking`);
* TRL's fused LM head takes its CUDA path: the compact gather of the valid
  positions and the Triton folds (:func:`_trl_triton_head`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

__all__ = ["cuda_emulation", "autocast_region", "DEFAULT_COMPUTE_CAPABILITY"]

# The default GPU generation that decides CUDA kernel choices (SDPA backends):
# sm90, Hopper (H100/H200), the GPUs this project's ground truth runs on.
DEFAULT_COMPUTE_CAPABILITY = (9, 0)


@contextlib.contextmanager
def cuda_emulation(
    *,
    autocast_dtype: torch.dtype | None,
    compute_capability: tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY,
    num_sms: int | None = None,
    mark: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Emulate CUDA's allocation behaviour on CPU for the duration of the block.

    Args:
        autocast_dtype: The autocast dtype of mixed precision, or None for
            none. Autocast itself is entered per forward, with
            :func:`autocast_region`; this installs the CUDA op policy.
        compute_capability: GPU generation whose kernel choices to follow.
        num_sms: The GPU's multiprocessor count (SDPA heuristics, reduction
            launch configurations); None: the generation's default.
        mark: Told where CUDA would create a thread's cuBLAS workspace
            (:mod:`.kernels`); the tracker's ``mark`` in a trace.
    """
    from llmem_plugin.trace.emulation.kernels import cuda_kernels
    from llmem_plugin.trace.emulation.sdpa import CudaSdpaTarget, patch_sdpa

    with contextlib.ExitStack() as stack:
        stack.enter_context(_real_run_masking())
        stack.enter_context(_cuda_dropout())
        stack.enter_context(patch_sdpa(compute_capability=compute_capability, num_sms=num_sms))
        # The resolved multiprocessor count (a table default when num_sms is None).
        sms = CudaSdpaTarget(compute_capability=tuple(compute_capability), num_sms=num_sms).num_sms
        stack.enter_context(cuda_kernels(compute_capability=compute_capability, num_sms=sms, mark=mark))
        stack.enter_context(_trl_triton_head())
        if autocast_dtype is not None:
            from llmem_plugin.trace.emulation.autocast import cuda_autocast_policy

            # The policy covers the whole step: checkpointed layers re-enter
            # autocast when they recompute during backward.
            stack.enter_context(cuda_autocast_policy())
        yield


def autocast_region(dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """The ``torch.autocast("cuda", dtype)`` region a trainer wraps its forward and loss in."""
    if dtype is None:
        return contextlib.nullcontext()
    from llmem_plugin.trace.emulation.autocast import cuda_autocast

    return cuda_autocast(dtype)


@contextlib.contextmanager
def _real_run_masking() -> Iterator[None]:
    """Make transformers' mask builders treat fake tensors as ordinary tensors.

    ``transformers.masking_utils`` calls ``is_tracing(tensor)``, which is true
    for FakeTensors, and then materialises an explicit boolean causal mask
    instead of letting SDPA use ``is_causal=True`` as a real run does (shared
    FACTS: +0.5 MB on a tiny model, and a different SDPA kernel). The trace
    passes no padding mask, so no value of a fake tensor is ever read.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a core dependency
        yield
        return
    from torch._subclasses.fake_tensor import is_fake

    original = masking_utils.is_tracing

    def is_tracing(tensor=None) -> bool:
        return original(None if tensor is not None and is_fake(tensor) else tensor)

    def find_packed_sequence_indices(position_ids):
        # The traced batch is unpacked (one sequence per row, positions
        # 0..s-1), for which a real run returns None after reading the values.
        # The tensors it reads them through are allocated first, as in
        # transformers/masking_utils.py (5.x): the diff against a prepended
        # first-minus-one, the cumsum of the breaks and the last column's test
        # (seen on the stub CUDA device; benchmarks/results/stub-wholestep-2026-11-25.md).
        first_dummy_value = position_ids[:, :1] - 1
        position_diff = torch.diff(position_ids, prepend=first_dummy_value, dim=-1)
        packed_sequence_mask = (position_diff != 1).cumsum(-1)
        (packed_sequence_mask[:, -1] == 0).all()
        return None

    original_packed = masking_utils.find_packed_sequence_indices
    masking_utils.is_tracing = is_tracing
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking_utils.is_tracing = original
        masking_utils.find_packed_sequence_indices = original_packed


class _TritonLaunch:
    """``kernel[grid](*args)`` for a Triton kernel of TRL's fused head, run as TRL's torch fold of the same
    arguments (the fold writes the kernel's outputs in place) with its temporaries untracked: the Triton
    kernel allocates nothing."""

    def __init__(self, fold: Callable) -> None:
        self.fold = fold

    def __getitem__(self, grid: object) -> Callable:
        from llmem_plugin.trace._pause import untracked

        def launch(*args, **kwargs) -> None:
            with untracked():
                self.fold(*args, **kwargs)
        return launch


@contextlib.contextmanager
def _trl_triton_head() -> Iterator[None]:
    """Run TRL's fused LM head (trl 1.16, trl/kernels/chunked_logprob.py) on its CUDA path in a real CPU run.

    ``_fused_forward`` (trl/trainer/utils.py) scores only the valid positions when ``_use_triton(device)``
    (CUDA or XPU with Triton), and every position otherwise; the folds are then Triton kernels that write
    into buffers allocated before them, where the CPU path runs torch ops with ``[tokens, chunk]`` fp32
    temporaries; and ``_addmm_fp32`` accumulates 16-bit tiles with ``torch.addmm(out_dtype=float32,
    out=acc)`` on CUDA (no allocation) where the CPU path upcasts both operands. Everything TRL allocates
    itself (statistics, tile buffer, casts, gathers, scatters, gradient accumulators) runs unchanged.
    Nothing is patched unless TRL's kernels are already imported.
    """
    import sys

    kernels = sys.modules.get("trl.kernels.chunked_logprob")
    if kernels is None or not hasattr(kernels, "_forward_tile"):
        yield
        return
    from llmem_plugin.trace._pause import untracked

    original_addmm = kernels._addmm_fp32

    def addmm_fp32(acc, a, b):
        # CUDA's addmm(out_dtype=float32, out=acc) from torch 2.8 (TRL's _MM_OUT_DTYPE); before it TRL upcasts
        # both operands on CUDA too, which the original runs.
        if getattr(kernels, "_MM_OUT_DTYPE", True) and a.dtype in (torch.float16, torch.bfloat16):
            with untracked():
                acc.addmm_(a.float(), b.float())
        else:
            original_addmm(acc, a, b)

    def use_triton(device) -> bool:
        return True

    saved = []
    patches = [(kernels, "_use_triton", use_triton), (kernels, "_addmm_fp32", addmm_fp32),
               (kernels, "_forward_kernel", _TritonLaunch(kernels._forward_tile)),
               (kernels, "_backward_kernel", _TritonLaunch(kernels._backward_tile))]
    if not hasattr(kernels, "triton"):  # the backward's launch grid reads triton.cdiv
        import types

        patches.append((kernels, "triton", types.SimpleNamespace(cdiv=lambda a, b: -(-a // b))))
    utils = sys.modules.get("trl.trainer.utils")
    if utils is not None and hasattr(utils, "_use_triton"):
        patches.append((utils, "_use_triton", use_triton))
    missing = object()
    try:
        for owner, name, value in patches:
            saved.append((owner, name, getattr(owner, name, missing)))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


@contextlib.contextmanager
def _cuda_dropout() -> Iterator[None]:
    """Route training-mode dropout through ``native_dropout`` as CUDA does.

    aten/src/ATen/native/Dropout.cpp: ``dropout`` takes the fused
    ``native_dropout`` kernel when ``is_fused_kernel_acceptable`` (CUDA/XPU
    tensor, 0 < p < 1, numel > 0); it returns the output and a *bool* mask,
    which autograd saves. On CPU the fallback ``_dropout_impl`` saves a noise
    tensor of the input's dtype instead (4x the bytes in fp32).
    """
    original = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0.0 < p < 1.0 and input.numel() > 0 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return original(input, p, training, inplace)

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original
