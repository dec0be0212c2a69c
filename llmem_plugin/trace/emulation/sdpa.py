"""Emulate CUDA ``scaled_dot_product_attention`` on CPU, allocation for allocation.

On CPU, ``F.scaled_dot_product_attention`` runs CPU kernels whose outputs,
saved tensors and workspaces differ from CUDA's. :func:`emulated_sdpa` picks the
backend CUDA would pick (:func:`select_backend`) and runs an autograd Function
per backend whose forward and backward allocate exactly what the CUDA kernels
allocate through the caching allocator, in their memory layout. On real tensors
the values are computed by a CPU reference inside
:func:`llmem_plugin.trace._pause.untracked` and copied into those buffers; on fake
tensors nothing is computed.

Sources (pytorch/pytorch; the index holds no copy at the v2.13.0 tag, so each
rule names the copy read, and the deltas to 2.13 are established from the
installed torch 2.13.0+cpu, git ``cf30153c``):

* ``[S]`` ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` @ ``001f694a``
  and ``sdp_utils_cpp.h`` (the copy with ``requires_same_num_heads``, whose
  strings are in the 2.13 ``libtorch_cpu.so``). ``001f694a`` already has PR
  #191085 (Jul 2026: implicit MQA, GQA for mem-efficient); 2.13 has not: its CPU
  selector returns MATH for implicit MQA. Those two rules are left out.
* ``[A]`` ``aten/src/ATen/native/transformers/attention.cpp`` (copy id 40065839):
  the composite ``scaled_dot_product_attention``; its math composite and mask
  conversion were checked op by op against the installed 2.13 (a dispatch-mode
  trace and ``torch.profiler``), which differs in ``convert_boolean_attn_mask``
  (``where(mask, 0, -inf)``, no ``logical_not``) and ``_safe_softmax``
  (``isneginf``).
* ``[U]`` ``cuda/attention.cu`` (copy embedded in rbarfinezhadfeli0/pytorch
  docs) and ``[B]`` ``cuda/attention_backward.cu`` @ ``00afd8f2``.
* ``[F]`` ``cuda/flash_attn/flash_api.cpp`` @ ``03b7c19d`` (``mha_fwd``/``mha_bwd``).
* ``[KF]``/``[KB]`` ``cuda/mem_eff_attention/kernels/cutlassF.h``/``cutlassB.h``
  and ``kernel_backward.h`` @ ``00f993df``.
* ``[C]`` ``aten/src/ATen/native/cudnn/MHA.cpp`` (copy id 57350642535) and
  NVIDIA/cudnn-frontend ``node/scaled_dot_product_flash_attention.h``
  (``CompositeSDPABackwardNode``).
* Versions: PyPI torch 2.13.0 requires ``cuda-toolkit==13.0.3`` and
  ``nvidia-cudnn-cu13==9.20.0.48`` (wheel metadata read with pip).

Known limitations:

* cuDNN sizes its plan workspaces at run time: the forward's and the backend
  engine's part of the backward's are taken as 0; the backward's frontend
  workspace (dQ_accum + softmax_sum) is modelled.
* mem-efficient kernel choice also depends on shared-memory size; it is
  modelled for sm80 and sm90 (every listed kernel fits), other GPUs raise.
* Not modelled: nested/varlen inputs, ROCm, FA3/fp8, cuDNN's
  ``use_ragged_in_dense`` option, mem-efficient batch chunking above 65535,
  return_debug_mask. The cuDNN bool-mask conversion allocates only its result
  (2.13's placement of its scalar is unverified; at most 1 KiB transient).
* Dropout values come from a CPU generator, not CUDA's Philox stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import struct
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.attention import SDPBackend

from llmem_plugin.trace._pause import untracked
from llmem_plugin.techniques.checkpointing import emulated_outputs, skip_workspace
from llmem_plugin.errors import ConfigError, UnsupportedError

__all__ = ["CudaSdpaTarget", "emulated_sdpa", "observe_attention", "patch_sdpa", "select_backend"]

# Version gates: what the PyPI torch 2.13.0 wheel ships (its Requires-Dist).
TORCH_2_13_CUDNN_VERSION = 92000  # nvidia-cudnn-cu13==9.20.0.48
TORCH_2_13_CUDA_VERSION = 13000  # cuda-toolkit==13.0.3
# Multiprocessor counts (NVIDIA datasheets: A100 108, H100 SXM/H200 132, B200 148).
_DEFAULT_NUM_SMS = {(8, 0): 108, (9, 0): 132, (10, 0): 148}
_HALF = (torch.float16, torch.bfloat16)
# The ATen ops the three kernels' Functions stand for, as op-level SAC policies name them.
_FLASH_OP = "aten._scaled_dot_product_flash_attention"
_EFFICIENT_OP = "aten._scaled_dot_product_efficient_attention"
_CUDNN_OP = "aten._scaled_dot_product_cudnn_attention"
_F32 = torch.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class CudaSdpaTarget:
    """The GPU and library versions whose SDPA behaviour is emulated.

    Args:
        compute_capability: ``(major, minor)``, e.g. ``(9, 0)`` for H100/H200.
        num_sms: Multiprocessor count (flash split-KV and deterministic
            heuristics); defaults from a table for sm80, sm90 and sm100.
        cudnn_version: Runtime cuDNN as ``major*10000 + minor*100 + patch``.
        cuda_version: CUDA the torch build was compiled with (``CUDA_VERSION``).

    Raises:
        ConfigError: an unknown GPU without ``num_sms``, or a bad value.
    """

    compute_capability: tuple[int, int] = (9, 0)
    num_sms: int | None = None
    cudnn_version: int = TORCH_2_13_CUDNN_VERSION
    cuda_version: int = TORCH_2_13_CUDA_VERSION

    def __post_init__(self) -> None:
        cc = tuple(self.compute_capability)
        if len(cc) != 2 or not all(isinstance(x, int) and x >= 0 for x in cc):
            raise ConfigError(
                f"compute_capability={self.compute_capability!r} is not (major, minor); HINT: e.g. (9, 0)."
            )
        object.__setattr__(self, "compute_capability", cc)
        if self.num_sms is None:
            if cc not in _DEFAULT_NUM_SMS:
                raise ConfigError(
                    f"num_sms is unknown for compute_capability={cc}; known: {sorted(_DEFAULT_NUM_SMS)}. "
                    "HINT: pass num_sms= (the GPU's multiprocessor count)."
                )
            object.__setattr__(self, "num_sms", _DEFAULT_NUM_SMS[cc])
        if self.num_sms <= 0:
            raise ConfigError(f"num_sms={self.num_sms} must be positive; HINT: e.g. 132 for H100 SXM.")


_DEFAULT_TARGET = CudaSdpaTarget()
_active_target = _DEFAULT_TARGET


# ----------------------------------------------------------------------------- selection


def select_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    compute_capability: tuple[int, int] = (9, 0),
    cudnn_version: int = TORCH_2_13_CUDNN_VERSION,
    cuda_version: int = TORCH_2_13_CUDA_VERSION,
) -> SDPBackend:
    """The backend ``select_sdp_backend`` [S] picks on a CUDA device.

    Honours the runtime switches (``torch.backends.cuda.*_sdp_enabled``,
    ``sdpa_kernel``), a user-set priority order, and deterministic mode.

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa:
            As for ``F.scaled_dot_product_attention`` (the mask before
            conversion; ``scale`` decides nothing).
        compute_capability: The GPU's ``(major, minor)``.
        cudnn_version: Runtime cuDNN (``major*10000 + minor*100 + patch``).
        cuda_version: CUDA the torch build targets (``major*1000 + minor*10``).

    Returns:
        An ``SDPBackend`` among FLASH_ATTENTION, EFFICIENT_ATTENTION,
        CUDNN_ATTENTION and MATH.

    Raises:
        RuntimeError: no backend is usable (as torch raises).
    """
    p = _Params(query, key, value, attn_mask, float(dropout_p), bool(is_causal), bool(enable_gqa),
                tuple(compute_capability), int(cudnn_version), int(cuda_version))
    checks = {
        SDPBackend.CUDNN_ATTENTION: _can_use_cudnn,
        SDPBackend.FLASH_ATTENTION: _can_use_flash,
        SDPBackend.EFFICIENT_ATTENTION: _can_use_efficient,
        SDPBackend.MATH: lambda _: torch.backends.cuda.math_sdp_enabled(),
    }
    for backend in _priority_order(p):
        if backend in checks and checks[backend](p):
            return backend
    raise RuntimeError("No available kernel. Aborting execution.")


@dataclasses.dataclass(frozen=True)
class _Params:  # sdp_params [S]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    dropout: float
    is_causal: bool
    enable_gqa: bool
    cc: tuple[int, int]
    cudnn: int
    cuda: int


# Context.h: the built-in order is flash, efficient, math, cudnn, overrideable.
_BUILTIN_ORDER = [1, 2, 0, 3, 4]


def _priority_order(p: _Params) -> list[SDPBackend]:
    """[S] priority_order/check_prefer_cudnn_attention: cuDNN first on sm90/sm10x.

    The first call installs cuDNN, flash, efficient, math when the runtime cuDNN
    is > 9.15.0 on sm9x/sm10x (minor 0 or 3 only for CUDA < 13, #169849), unless
    TORCH_CUDNN_SDPA_DEPRIORITIZED is set; an order set by the user wins.
    """
    order = list(torch._C._get_sdp_priority_order())
    major, minor = p.cc
    prefer = (
        os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").lower() not in ("1", "true", "on", "yes")
        and p.cudnn > 91500
        and major in (9, 10)
        and (p.cuda >= 13000 or minor in (0, 3))
    )
    if order == _BUILTIN_ORDER and prefer:
        order = [3, 1, 2, 0]
    return [SDPBackend(i) for i in order]


def _requires_grad(p: _Params) -> bool:  # input_requires_grad [S-cpp.h]
    return torch.is_grad_enabled() and (p.q.requires_grad or p.k.requires_grad or p.v.requires_grad)


def _sm_in(cc: tuple[int, int], lo: tuple[int, int], hi: tuple[int, int]) -> bool:  # check_sm_version [S]
    return lo <= cc <= hi


def _gemm_alignment(p: _Params) -> int:  # minimum_gemm_alignment [S]
    half = p.q.dtype in _HALF
    use_tc = p.cc[0] >= 8 or (p.cc[0] >= 7 and half)
    align = 4 if p.cc[0] >= 8 else 1
    return max(align, 128 // (16 if half else 32)) if use_tc else align


def _dense_common(p: _Params, ignore_singleton: bool) -> bool:
    # check_tensor_shapes, check_nonzero_sequence_lengths_dense and
    # check_last_dim_stride_equals_1_dense [S-cpp.h] (a GPU mask needs stride 1).
    if not (p.q.dim() == p.k.dim() == p.v.dim() == 4):
        return False
    if p.q.size(-2) == 0 or p.k.size(-2) == 0:
        return False
    strides_ok = p.q.stride(-1) == 1 and p.k.stride(-1) == 1 and p.v.stride(-1) == 1
    if ignore_singleton:
        strides_ok = strides_ok or p.q.size(-1) == 1
    return strides_ok and (p.mask is None or p.mask.stride(-1) == 1)


def _batch_and_heads(p: _Params, supports_gqa: bool, same_kv_heads: bool = True) -> bool:
    # check_batch_size_and_num_heads_dense / check_grouped_query_attention [S-cpp.h]
    if not (p.q.size(0) == p.k.size(0) == p.v.size(0)):
        return False
    hq, hk, hv = p.q.size(-3), p.k.size(-3), p.v.size(-3)
    if p.enable_gqa and supports_gqa:
        if same_kv_heads and hk != hv:
            return False
        return hq % hk == 0 and (same_kv_heads or hq % hv == 0)
    return hq == hk == hv


def _can_use_flash(p: _Params) -> bool:  # can_use_flash_attention [S]
    if not torch.backends.cuda.flash_sdp_enabled() or not _dense_common(p, ignore_singleton=True):
        return False
    if p.mask is not None:  # check_for_attn_mask
        return False
    d = p.q.size(-1)
    if not (d == p.k.size(-1) == p.v.size(-1) and d <= 256):  # check_head_dim_size_flash
        return False
    if not _sm_in(p.cc, (8, 0), (12, 1)):  # check_flash_attention_hardware_support
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    if _requires_grad(p) and (_sm_in(p.cc, (8, 6), (8, 9)) or _sm_in(p.cc, (12, 0), (12, 1))):
        if not (d <= 192 or (p.dropout <= 0.0 and d > 224)):
            return False
    if p.is_causal and p.q.size(-2) != p.k.size(-2):  # check_flash_causal_non_square_seqlens
        return False
    if not (p.q.dtype == p.k.dtype == p.v.dtype and p.q.dtype in _HALF):  # check_dtypes_flash_attention
        return False
    return _batch_and_heads(p, supports_gqa=True)


def _can_use_efficient(p: _Params) -> bool:  # can_use_mem_efficient_attention [S]
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return False
    if not _sm_in(p.cc, (5, 0), (12, 1)) or not (p.q.dim() == p.k.dim() == p.v.dim() == 4):
        return False
    align = _gemm_alignment(p)  # check_head_dim_size_mem_efficient
    dq, dv = p.q.size(-1), p.v.size(-1)
    if not (dq == p.k.size(-1) and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0):
        return False
    if p.cc[0] >= 8:  # check_data_ptr_alignment_mem_efficient
        align_bytes = align * p.q.element_size()
        for t in (p.q, p.k, p.v):
            if t.numel() and (t.storage_offset() * t.element_size()) % align_bytes:
                return False
    if not _dense_common(p, ignore_singleton=False):
        return False
    # 2.13 (before #191085): no GQA for mem-efficient on CUDA.
    if not _batch_and_heads(p, supports_gqa=False):
        return False
    dtypes = (*_HALF, _F32) if p.cc[0] >= 8 else (torch.float16, _F32)
    return p.q.dtype == p.k.dtype == p.v.dtype and p.q.dtype in dtypes


def _cudnn_mask_shape_ok(p: _Params) -> bool:  # check_attn_mask_shape [S-cpp.h]
    m = p.mask
    if m is None:
        return True
    if m.requires_grad:
        return False
    if m.size(-2) not in (p.q.size(2), 1) or m.size(-1) not in (p.k.size(2), 1):
        return False
    if m.dim() == 2:
        return True
    return m.dim() == 4 and m.size(0) in (1, p.q.size(0)) and m.size(1) in (1, p.q.size(1))


def _can_use_cudnn(p: _Params) -> bool:  # can_use_cudnn_attention [S]
    if p.cudnn < 90000 or (p.dropout > 0.0 and 91100 < p.cudnn < 91400):
        return False
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    if not (p.q.dim() == p.k.dim() == p.v.dim() == 4):
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False
    if not (p.q.dtype == p.k.dtype == p.v.dtype and p.q.dtype in (_HALF if p.cc[0] >= 8 else (torch.float16,))):
        return False
    if not _cudnn_mask_shape_ok(p) or not _sm_in(p.cc, (8, 0), (12, 1)):
        return False
    if p.dropout * 16.0 != math.floor(p.dropout * 16.0):  # check_cudnn_dropout
        return False
    if not _dense_common(p, ignore_singleton=True):
        return False
    if not _batch_and_heads(p, supports_gqa=True, same_kv_heads=False):
        return False
    return _cudnn_tensor_shapes(p)


def _cudnn_tensor_shapes(p: _Params) -> bool:
    # check_cudnn_tensor_shapes and check_cudnn_d256_bprop_head_dim [S]. The
    # d256 rules also need CUDNN_FRONTEND_VERSION >= 12400 (assumed met).
    b, h, s_q, d_qk = p.q.shape
    s_k, d_v = p.k.size(2), p.v.size(3)
    if b > 65535 or h > 65535 or p.cudnn < 8903 or (p.cudnn < 8906 and p.dropout != 0.0):
        return False
    sm90_or_10x = (p.cc[0] == 9 and p.cc[1] == 0) or p.cc[0] == 10
    d256 = sm90_or_10x and not (p.cc == (10, 7) and p.cudnn <= 92500) and p.cudnn > 92200
    limit = 256 if d256 else (192 if sm90_or_10x and p.cudnn >= 91100 and d_qk == 192 and d_v == 128 else 128)
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    if p.cudnn < 8906 and s_k % 64:
        return False
    if p.cudnn < 90000 and (s_q < 64 or (p.dropout != 0.0 and (s_q % 64 or s_k % 64))):
        return False
    if s_k == 1 or (p.dropout != 0.0 and s_q == 1):
        return False
    if d256 and _requires_grad(p):
        return (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
    return True


# ----------------------------------------------------------------------------- entry points


def emulated_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the allocations of the CUDA kernels.

    Follows ``scaled_dot_product_attention`` [A]: mask conversion and padding per
    backend, then the backend op. Uses the target set by :func:`patch_sdpa`
    (default: H100, torch 2.13.0 wheel). Under (CUDA-policy) autocast the
    floating inputs are cast to the autocast dtype first, as CUDA's
    lower_precision_fp wrapper of ``scaled_dot_product_attention`` does.

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa:
            As for ``F.scaled_dot_product_attention``.

    Returns:
        The attention output, in the CUDA kernel's memory layout.

    Raises:
        RuntimeError: invalid inputs or no usable backend, as torch raises.
        UnsupportedError: mem-efficient attention on a GPU other than sm80/sm90.
    """
    target = _active_target
    if torch.is_autocast_enabled("cpu"):
        # autocast_mode.h: scaled_dot_product_attention is lower_precision_fp on
        # CUDA; its floating args are cast, then the op runs with autocast off.
        # Last argument first, as the wrapper's pack expansion evaluates under GCC (autocast.py,
        # _Signature.map_tensors): the stub device allocates key's copy before query's.
        low = torch.get_autocast_dtype("cpu")
        mask_c, value_c, key_c, query_c = (
            t.to(low) if t is not None and t.is_floating_point() and t.dtype not in (low, torch.float64) else t
            for t in (attn_mask, value, key, query))
        with torch.autocast("cpu", enabled=False):
            out = emulated_sdpa(query_c, key_c, value_c, mask_c, dropout_p, is_causal, scale, enable_gqa)
        # The wrapper's temporaries die in reverse order of construction: query's copy first.
        del query_c, key_c, value_c, mask_c
        return out
    _validate_input(query, key, value, attn_mask)
    backend = select_backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                             compute_capability=target.compute_capability,
                             cudnn_version=target.cudnn_version, cuda_version=target.cuda_version)
    lse = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if backend == SDPBackend.CUDNN_ATTENTION:
        mask = _bool_mask_to_additive(attn_mask, query.dtype, fill=-65504.0)
        return _CudnnAttention.apply(query, key, value, mask, dropout_p, is_causal, scale, lse, target)
    mask = _bool_mask_to_additive(attn_mask, query.dtype)
    if backend == SDPBackend.FLASH_ATTENTION:
        og = query.size(-1)
        padded = [_pad_last_dim(t, 8) for t in (query, key, value)]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(og)  # calculate_scale on the original q
        graph = torch.is_grad_enabled() and any(t.requires_grad for t in padded)
        out = _FlashAttention.apply(*padded, dropout_p, is_causal, og_scale, target, graph)
        return out[..., :og] if out.size(-1) != og else out  # post_process_flash_output
    if backend == SDPBackend.EFFICIENT_ATTENTION:
        if target.compute_capability not in ((8, 0), (9, 0)):
            raise UnsupportedError(
                f"mem-efficient SDPA kernels are modelled for sm80 and sm90 only, not {target.compute_capability} "
                "(kernel choice depends on shared-memory sizes there). HINT: use compute_capability=(8, 0) or (9, 0)."
            )
        if mask is not None:
            mask = _preprocess_mask(mask, query, key)
        return _EfficientAttention.apply(query, key, value, mask, dropout_p, is_causal, scale, lse, target)
    return _math_sdpa(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)


@contextlib.contextmanager
def patch_sdpa(
    *,
    compute_capability: tuple[int, int] = (9, 0),
    num_sms: int | None = None,
    cudnn_version: int = TORCH_2_13_CUDNN_VERSION,
    cuda_version: int = TORCH_2_13_CUDA_VERSION,
) -> Iterator[CudaSdpaTarget]:
    """Replace ``torch.nn.functional.scaled_dot_product_attention`` for the block.

    transformers 5.23 looks the function up at call time
    (``integrations/sdpa_attention.py``: ``torch.nn.functional.scaled_dot_product_attention(...)``),
    so patching the module attribute reaches every model. Restored on exit.

    Args:
        compute_capability, num_sms, cudnn_version, cuda_version: The
            :class:`CudaSdpaTarget` to emulate.

    Yields:
        The :class:`CudaSdpaTarget` in effect.
    """
    global _active_target
    target = CudaSdpaTarget(compute_capability=compute_capability, num_sms=num_sms,
                            cudnn_version=cudnn_version, cuda_version=cuda_version)
    functional = torch.nn.functional
    original, previous = functional.scaled_dot_product_attention, _active_target
    functional.scaled_dot_product_attention, _active_target = emulated_sdpa, target
    try:
        yield target
    finally:
        functional.scaled_dot_product_attention, _active_target = original, previous


# ----------------------------------------------------------------------------- observers


# Callbacks told of every fused-kernel call: (pass, query shape, key shape,
# value shape, is_causal), pass being "forward" or "backward". The step-time
# model counts attention FLOPs with them (the fused kernels allocate but run
# no aten matmul that torch.utils.flop_counter could see).
_observers: list = []


def _notify(ctx, which: str, q=None, k=None, v=None, is_causal=False) -> None:
    if which == "forward":
        ctx.attention_shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape), bool(is_causal))
    for fn in _observers:
        fn(which, *ctx.attention_shapes)


@contextlib.contextmanager
def observe_attention(callback) -> Iterator[None]:
    """Call ``callback(pass, q_shape, k_shape, v_shape, is_causal)`` for every
    fused attention kernel (forward and backward) run inside the block."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


# ----------------------------------------------------------------------------- composite helpers [A]


def _validate_input(q, k, v, mask) -> None:  # validate_sdpa_input [A]
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError(f"Expected query, key, and value to have the same dtype, but got query.dtype: "
                           f"{q.dtype} key.dtype: {k.dtype} and value.dtype: {v.dtype} instead.")
    if not (q.device == k.device == v.device) or min(q.dim(), k.dim(), v.dim()) < 2:
        raise RuntimeError("Expected query, key, and value on one device and at least 2 dimensional.")
    if mask is not None and mask.dtype not in (torch.bool, _F32, q.dtype):
        raise RuntimeError(f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                           f"attn_mask.dtype: {mask.dtype} and  query.dtype: {q.dtype} instead.")


def _bool_mask_to_additive(mask, dtype, fill=-math.inf):
    """convert_boolean_attn_mask [A] as in 2.13: ``where(mask, 0, fill)``.

    Two 0-dim tensors on the mask's device and one mask-shaped result. The
    cuDNN variant (fill -65504) builds its scalar on the host: result only.
    """
    if mask is None or mask.dtype != torch.bool:
        return mask
    if fill != -math.inf:
        return mask.new_full(mask.shape, fill, dtype=dtype).masked_fill_(mask, 0.0)
    other = mask.new_full((), fill, dtype=dtype)
    zero = mask.new_full((), 0.0, dtype=dtype)
    return torch.where(mask, zero, other)


def _pad_last_dim(t: torch.Tensor, align: int) -> torch.Tensor:  # pad_last_dim<8, false> [A]
    rem = t.size(-1) % align
    return t if rem == 0 else torch.constant_pad_nd(t, (0, align - rem))


def _preprocess_mask(mask, q, k):  # preprocess_mask [A]: pad_bias<8> unless aligned, then expand
    strides_ok = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
    if not strides_ok:
        last = mask.size(-1)
        mask = torch.constant_pad_nd(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def _has_values(t: torch.Tensor) -> bool:
    return not isinstance(t, FakeTensor) and t.device.type != "meta"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, m: int) -> int:
    return _ceil_div(a, m) * m


# ----------------------------------------------------------------------------- CPU reference values


def _new_seed() -> int:
    with untracked():
        return int(torch.empty((), dtype=torch.int64).random_().item())


def _reference(q, k, v, bias, is_causal, scale, dropout_p, seed):
    """fp32 attention on ``[b, h, s, d]`` tensors with k/v already at q's heads."""
    qf, kf, vf = q.float(), k.float(), v.float()
    attn = qf @ kf.transpose(-2, -1) * scale
    if is_causal:
        keep = torch.ones(attn.shape[-2:], dtype=torch.bool).tril()
        attn = attn.masked_fill(~keep, -math.inf)
    if bias is not None:
        attn = attn + bias.float()
    dead = torch.isneginf(attn).all(-1, keepdim=True)
    probs = torch.softmax(attn, -1).masked_fill(dead, 0.0)
    if dropout_p > 0.0:
        gen = torch.Generator().manual_seed(seed)
        probs = probs * (torch.rand(probs.shape, generator=gen) >= dropout_p) / (1.0 - dropout_p)
    return probs @ vf


def _heads_to(t: torch.Tensor, h: int) -> torch.Tensor:
    return t if t.size(1) == h else t.repeat_interleave(h // t.size(1), dim=1)


def _reference_grads(grad, q, k, v, bias, want_bias, is_causal, scale, dropout_p, seed):
    """Grads of :func:`_reference` for q, expanded k/v (and bias)."""
    h = q.size(1)
    leaves = [q.detach().requires_grad_(), _heads_to(k.detach(), h).requires_grad_(),
              _heads_to(v.detach(), h).requires_grad_()]
    b = bias.detach().requires_grad_() if want_bias else bias
    with torch.enable_grad():
        out = _reference(*leaves, b, is_causal, scale, dropout_p, seed).to(q.dtype)
        inputs = leaves + ([b] if want_bias else [])
        return torch.autograd.grad(out, inputs, grad)


def _group_sum(g: torch.Tensor, hk: int) -> torch.Tensor:
    b, h, s, d = g.shape
    return g if h == hk else g.view(b, hk, h // hk, s, d).sum(2)


# ----------------------------------------------------------------------------- flash [U] [F] [B]


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _flash_num_splits(bhm: int, num_sms2: int, n_blocks: int, max_splits: int) -> int:
    """num_splits_heuristic [F], in the kernel's float32 arithmetic.

    ``bhm`` is b * h * ceil(s_q / 64) and ``num_sms2`` twice the SM count
    (128-thread blocks); a split count whose blocks-per-split equals the
    previous one's is ineligible; the smallest count within 85% of the best
    wave efficiency wins.
    """
    f32 = _f32
    if bhm >= f32(f32(0.8) * num_sms2):
        return 1
    max_splits = min(max_splits, num_sms2, n_blocks)

    def eligible(n: int) -> bool:
        return n == 1 or _ceil_div(n_blocks, n) != _ceil_div(n_blocks, n - 1)

    eff = [0.0] * (max_splits + 1)
    for n in range(1, max_splits + 1):
        if eligible(n):
            waves = f32(f32(float(bhm * n)) / num_sms2)
            eff[n] = f32(waves / math.ceil(waves))
    best = max(eff)
    return next((n for n in range(1, max_splits + 1) if eligible(n) and eff[n] >= 0.85 * best), 1)


class _FlashAttention(torch.autograd.Function):
    """``_scaled_dot_product_flash_attention`` on CUDA and its backward.

    Forward (``mha_fwd`` [F]) on ``q_t = q.transpose(1, 2)`` ``[b, s, h, d]``:
    ``out = empty_like(q_t)`` (so ``[b, s, h, d]`` memory for the usual
    ``[b, s, h, d] -> transpose`` inputs), fp32 ``softmax_lse [b, h, s_q]``,
    uint64 ``rng_state [2]`` and ``_unused []`` (both saved as philox seed and
    offset), and, when the split-KV heuristic picks n > 1 splits, temporaries
    ``softmax_lse_accum [n, b, h, s_q]`` and ``out_accum [n, b, h, s_q,
    round(d, 32|64)]`` in fp32. Saved for backward (derivatives.yaml): q, k, v,
    output, logsumexp, philox seed and offset.

    Backward (``_flash_attention_backward`` [B], ``mha_bwd`` [F]):
    ``grad_out.contiguous()`` and ``out.contiguous()`` of the ``[b, s, h, d]``
    views, ``dq/dk/dv = empty_like(q_t/k_t/v_t)``, fp32 ``softmax_d [b, h,
    round(s_q, 128)]`` and ``dq_accum [b, round(s_q, 128), h, round(d, 32|64)]``
    (zeros with a leading split dim when deterministic), and for GQA
    ``dk_expanded/dv_expanded [b, s_k, h, d]`` reduced into dk/dv by ``sum_out``.
    """

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, is_causal, scale, target, graph=True):
        _notify(ctx, "forward", q, k, v, is_causal)
        q_t, k_t = q.transpose(1, 2), k.transpose(1, 2)
        b, s_q, h, d = q_t.shape
        s_k, h_k = k_t.size(1), k_t.size(2)
        causal = is_causal and s_q != 1  # mha_fwd: causal is a no-op for s_q == 1
        swapped = s_q == 1 and h > h_k and not causal and dropout_p == 0.0 and d % 8 == 0
        temp_q = q_t.reshape(b, h_k, h // h_k, d).transpose(1, 2) if swapped else q_t
        s_eff, h_eff = temp_q.size(1), temp_q.size(2)
        with emulated_outputs(_FLASH_OP):
            out = torch.empty_like(temp_q)
            lse = q.new_empty((b, h_eff, s_eff), dtype=_F32)
        d_rounded = _round_up(d, 32 if d <= 128 else 64)
        accum = ()
        if dropout_p == 0.0:  # set_params_splitkv: SplitKV is not implemented for dropout
            block_n = 256 if d <= 64 else (128 if d <= 128 else 64)
            n = _flash_num_splits(b * h_eff * _ceil_div(s_eff, 64), target.num_sms * 2, _ceil_div(s_k, block_n), 128)
            if n > 1:
                zero = 0 if skip_workspace(_FLASH_OP) else 1
                accum = (q.new_empty((n * zero, b, h_eff, s_eff), dtype=_F32),
                         q.new_empty((n * zero, b, h_eff, s_eff, d_rounded), dtype=_F32))
        seed = 0
        if dropout_p > 0.0:  # rng_state is allocated, then re-allocated (the first is freed): the second is the output
            first = q.new_empty((0 if skip_workspace(_FLASH_OP) else 2,), dtype=torch.uint64)
            with emulated_outputs(_FLASH_OP):
                unused = q.new_empty((), dtype=torch.uint64)
                rng_state = q.new_empty((2,), dtype=torch.uint64)
            del first
            seed = _new_seed() if _has_values(q) else 0
        else:
            with emulated_outputs(_FLASH_OP):
                rng_state = q.new_empty((2,), dtype=torch.uint64)
                unused = q.new_empty((), dtype=torch.uint64)
        del accum
        with emulated_outputs(_FLASH_OP):
            if swapped:
                out = out.transpose(1, 2).reshape(b, 1, h, d)
                lse = lse.reshape(b, h, 1)
        attention = out.transpose(1, 2)
        if _has_values(q):
            with untracked(), torch.autograd._unsafe_preserve_version_counter(attention):
                ref = _reference(q, _heads_to(k, h), _heads_to(v, h), None, causal, scale, dropout_p, seed)
                attention.copy_(ref)  # values only: a saved output's version must not change (SAC checks it)
                del ref
        # Saved in the order the engine releases the C++ node's (Functions.h
        # ScaledDotProductFlashAttentionBackward0::release_variables: inputs, then outputs, each by name).
        if not graph:
            # No node keeps them: the op's returned tuple dies, its elements in order (lse, rng_state, unused).
            del out, lse, rng_state, unused
            return attention
        ctx.save_for_backward(k, q, v, lse, attention, rng_state, unused)
        ctx.args = (dropout_p, causal, scale, seed, target)
        return attention

    @staticmethod
    def backward(ctx, grad):
        _notify(ctx, "backward")
        k, q, v, lse, out, rng_state, unused = ctx.saved_tensors
        dropout_p, causal, scale, seed, target = ctx.args
        q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        dout = grad.transpose(1, 2).contiguous()
        out_c = out.transpose(1, 2).contiguous()
        dq, dk, dv = torch.empty_like(q_t), torch.empty_like(k_t), torch.empty_like(v_t)
        b, s_q, h, d = q_t.shape
        s_k, h_k = k_t.size(1), k_t.size(2)
        s_q_r, d_r = _round_up(s_q, 128), _round_up(d, 32 if d <= 128 else 64)
        softmax_d = q.new_empty((b, h, s_q_r), dtype=_F32)
        if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
            nsplits = _ceil_div(target.num_sms, b * h)
            dq_accum = q.new_zeros((nsplits, b, s_q_r, h, d_r), dtype=_F32)
        else:
            dq_accum = q.new_empty((b, s_q_r, h, d_r), dtype=_F32)
        gqa = h_k != h
        dk_e = q.new_empty((b, s_k, h, d)) if gqa else dk
        dv_e = q.new_empty((b, s_k, h, d)) if gqa else dv
        if _has_values(q):
            with untracked():
                gq, gk, gv = _reference_grads(grad, q, k, v, None, False, causal, scale, dropout_p, seed)
                dq.copy_(gq.transpose(1, 2))
                dk_e.copy_(gk.transpose(1, 2))
                dv_e.copy_(gv.transpose(1, 2))
                del gq, gk, gv
        if gqa:  # mha_bwd: at::sum_out(dk, reshape(dk_expanded, {b, s_k, h_k, h / h_k, d}), {3})
            torch.sum(dk_e.reshape(b, s_k, h_k, h // h_k, d), dim=3, out=dk)
            torch.sum(dv_e.reshape(b, s_k, h_k, h // h_k, d), dim=3, out=dv)
        # C++ destroys locals in reverse order of declaration: mha_bwd's dv_expanded, dk_expanded, dq_accum
        # [F]; then _flash_attention_backward's tuple (softmax_d), contiguous_out, contiguous_grad_out [B]
        # (as the stub device's allocator history shows).
        del dv_e, dk_e, dq_accum, softmax_d, out_c, dout
        grads = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None, None, None
        # The node's apply unpacks its saved tensors in declaration order and destroys them in reverse
        # when it returns; that is when they die where checkpointing holds them only through its hooks.
        del q_t, k_t, v_t, dq, dk, dv
        del unused, rng_state, out, lse, v, q, k
        return grads


# ----------------------------------------------------------------------------- mem-efficient [U] [B] [KF] [KB]

# cutlassF.h, dispatch_cutlassF_{bf16,f16,f32}_sm80 (same for all three, all aligned):
# (kQueriesPerBlock, kKeysPerBlock, kMaxK).
_CUTLASS_F_SM80 = ((64, 64, 64), (64, 128, 128), (32, 128, 65536))
# cutlassB.h, dispatch_cutlassB_{bf16,f16}_sm80 and _f32_sm80, in dispatch order:
# (kBlockSizeI, kBlockSizeJ, kMaxK, kKeysQueriesAlignedToBlockSize, kApplyDropout).
# The 128x64_k96 half kernel is dispatched on cc 86/89 only.
_CUTLASS_B_SM80_HALF = (
    (64, 64, 32, True, False), (64, 64, 32, False, False), (64, 64, 64, True, False), (64, 64, 64, False, False),
    (128, 128, 128, True, False), (128, 128, 128, False, False), (64, 64, 128, True, False),
    (64, 64, 128, False, False), (128, 64, 65536, False, False), (64, 64, 65536, False, False),
    (64, 64, 32, False, True), (64, 64, 64, False, True), (128, 128, 128, False, True),
    (64, 64, 128, False, True), (128, 64, 65536, False, True), (64, 64, 65536, False, True),
)
_CUTLASS_B_SM80_F32 = (
    (64, 64, 32, False, False), (64, 64, 64, False, False), (128, 64, 128, False, False),
    (64, 64, 128, False, False), (128, 64, 65536, False, False), (64, 64, 65536, False, False),
    (64, 64, 32, False, True), (64, 64, 64, False, True), (128, 64, 128, False, True),
    (64, 64, 128, False, True), (128, 64, 65536, False, True), (64, 64, 65536, False, True),
)


def _cutlass_f(q_t, k_t, v_t):
    """The forward kernel ``_efficient_attention_forward`` launches [U]: first fit."""
    align = 8 if q_t.dtype in _HALF else 4  # kAlignmentQ/K/V of aligned kernels (128 bits)
    max_k = max(k_t.size(-1), v_t.size(-1))
    for kernel in _CUTLASS_F_SM80:
        if kernel[2] >= max_k and not any(t.stride(2) % align for t in (q_t, k_t, v_t)):
            return kernel
    raise RuntimeError("cutlassF: no kernel found to launch!")


def _cutlass_b(q_t, k_t, v_t, use_dropout):
    """The backward kernel ``_efficient_attention_backward`` launches [B]: first fit."""
    table = _CUTLASS_B_SM80_HALF if q_t.dtype in _HALF else _CUTLASS_B_SM80_F32
    m, n, max_k = q_t.size(1), k_t.size(1), max(q_t.size(3), v_t.size(3))
    for bi, bj, kmax, seq_aligned, dropout in table:
        if kmax < max_k or (use_dropout and not dropout) or (seq_aligned and (m % bi or n % bj)):
            continue
        if any(t.stride(2) % 4 for t in (q_t, k_t, v_t)):  # GemmType::kMinimumAlignment
            continue
        return bi, bj, kmax
    raise RuntimeError("cutlassB: no kernel found to launch!")


class _EfficientAttention(torch.autograd.Function):
    """``_scaled_dot_product_efficient_attention`` on CUDA and its backward.

    Forward (``_efficient_attention_forward`` [U] on the ``[b, s, h, d]`` views):
    ``res = empty({b, s_q, h, d_v})`` returned transposed; fp32 ``logsumexp
    [b, h, round(s_q, kAlignLSE=32)]`` (last dim 0 without grad); an fp32
    ``output_accum [b, s_q, h, d_v]`` temporary when ``kNeedsOutputAccumulatorBuffer``
    (half and kMaxK > kKeysPerBlock). Seed and offset live on the host.
    Saved: q, k, v, the preprocessed bias, output, logsumexp.

    Backward (``_efficient_attention_backward`` [B], ``kernel_backward.h`` [KB]):
    ``grad_out.contiguous()``, ``grad_q/k/v = empty(q_t/k_t/v_t.sizes())``,
    ``grad_bias`` with its last dim padded to 16 when the mask needs grad, fp32
    ``delta [b, h, s_q]`` (f32 kernels compute it as
    ``(gO.float() * out.float()).sum(-1).transpose(-2, -1).contiguous()``), and
    a byte workspace of ``b*h*align4(gk + gv + gq)*4`` where
    ``gq = ceil(s_q/I)*ceil(d/J)*(4 + I*J)`` and ``gk = splits*J*align(d, I)``
    (likewise gv) only when dK/dV are not kept in registers (half, kMaxK > I).
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, dropout_p, is_causal, scale, compute_lse, target):
        _notify(ctx, "forward", q, k, v, is_causal)
        q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        b, m, h, _ = q_t.shape
        if bias is not None and bias.dtype != q.dtype:
            raise RuntimeError("invalid dtype for bias - should match query's dtype")
        _, keys_per_block, kmax = _cutlass_f(q_t, k_t, v_t)
        with emulated_outputs(_EFFICIENT_OP):
            res = q.new_empty((b, m, h, v_t.size(-1)))
            lse = q.new_empty((b, h, _round_up(m, 32) if compute_lse else 0), dtype=_F32)
        # kNeedsOutputAccumulatorBuffer: a temporary for the kernel's duration
        needs_accum = q.dtype in _HALF and kmax > keys_per_block
        zero = 0 if skip_workspace(_EFFICIENT_OP) else 1
        accum = (q.new_empty((b * zero, m, h, v_t.size(-1)), dtype=_F32),) if needs_accum else ()
        seed = _new_seed() if dropout_p > 0.0 and _has_values(q) else 0
        scale_ = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
        attention = res.transpose(1, 2)
        if _has_values(q):
            with untracked(), torch.autograd._unsafe_preserve_version_counter(attention):
                attention.copy_(_reference(q, k, v, bias, is_causal, scale_, dropout_p, seed))
        del accum
        # ScaledDotProductEfficientAttentionBackward0::release_variables order (Functions.h).
        ctx.save_for_backward(bias, k, q, v, lse, attention)
        ctx.args = (dropout_p, is_causal, scale_, seed, target)
        return attention

    @staticmethod
    def backward(ctx, grad):
        _notify(ctx, "backward")
        bias, k, q, v, lse, out = ctx.saved_tensors
        dropout_p, is_causal, scale, seed, target = ctx.args
        q_t, k_t, v_t, out_t = (t.transpose(1, 2) for t in (q, k, v, out))
        g_out = grad.transpose(1, 2).contiguous()
        b, m, h, d = q_t.shape
        n, d_v = k_t.size(1), v_t.size(3)
        grad_q, grad_k, grad_v = (t.new_empty(t.shape) for t in (q_t, k_t, v_t))
        want_bias = bias is not None and ctx.needs_input_grad[3]
        grad_bias = None
        if want_bias:
            grad_bias = bias.new_empty((*bias.shape[:-1], _round_up(bias.size(-1), 16)))[..., : bias.size(-1)]
        bi, bj, kmax = _cutlass_b(q_t, k_t, v_t, dropout_p > 0.0)
        half = q.dtype in _HALF
        if half:  # kKernelComputesDelta = kIsHalf && (kOutputInRF || sm != 70)
            delta = q.new_empty((b, h, m), dtype=_F32)
        else:
            delta = (g_out.to(_F32) * out_t.to(_F32)).sum(-1).transpose(-2, -1).contiguous()
        accum_kv = half and kmax > bi  # kNeedsAccumGradK/V = !kOutputInRF && output_t != float
        splits = _ceil_div(n, bj)
        if b * h >= 256 and n <= 2 * bj:
            splits = 1
        if accum_kv:
            splits = min(splits, 200 // (b * h))
        if splits < 1 or (torch.are_deterministic_algorithms_enabled()
                          and not torch.is_deterministic_algorithms_warn_only_enabled()):
            splits = 1
        gk = splits * bj * _round_up(d, bi) if accum_kv else 0
        gv = splits * bj * _round_up(d_v, bi) if accum_kv else 0
        gq = _ceil_div(m, bi) * _ceil_div(d, bj) * (4 + bi * bj)  # GradQTempStorage: lock, counter, pad[2], buffer
        workspace_bytes = b * h * _round_up(gk + gv + gq, 4) * 4
        workspace = q.new_empty((workspace_bytes,), dtype=torch.uint8) if workspace_bytes else None
        if workspace is not None and splits > 1:  # should_zero_workspace
            workspace.zero_()
        if _has_values(q):
            with untracked():
                grads = _reference_grads(grad, q, k, v, bias, want_bias, is_causal, scale, dropout_p, seed)
                for dst, src in zip((grad_q, grad_k, grad_v), grads):
                    dst.copy_(src.transpose(1, 2))
                if want_bias:
                    grad_bias.copy_(grads[3].sum_to_size(bias.shape))
                del grads
        # Reverse order of declaration [B]: delta is the launch lambda's, workspace and grad_out (the
        # .contiguous() copy, declared first) _efficient_attention_backward's.
        del delta, workspace, g_out
        grads = (grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2), grad_bias,
                 None, None, None, None, None)
        # The node's apply unpacks its saved tensors in declaration order and destroys them in reverse
        # when it returns; that is when they die where checkpointing holds them only through its hooks.
        del q_t, k_t, v_t, out_t, grad_q, grad_k, grad_v, grad_bias
        del out, lse, v, q, k, bias
        return grads


# ----------------------------------------------------------------------------- cuDNN [U] [B] [C]


def _alloc_matching_layout(like: torch.Tensor, shape) -> torch.Tensor:
    """alloc_with_matching_layout [C]: ``shape`` with ``like``'s dim order (argsort of strides)."""
    if tuple(like.shape) == tuple(shape):
        return torch.empty_like(like)
    order = sorted(range(len(shape)), key=lambda i: like.stride(i))  # stable, innermost first
    strides, running = [0] * len(shape), 1
    for i in order:
        strides[i], running = running, running * shape[i]
    return like.new_empty_strided(tuple(shape), tuple(strides))


class _CudnnAttention(torch.autograd.Function):
    """``_scaled_dot_product_cudnn_attention`` on CUDA and its backward.

    Forward (``_cudnn_attention_forward`` [U], ``run_cudnn_SDP_fprop`` [C]):
    int64 ``cudnn_seed`` and ``cudnn_offset`` (0-dim, always), ``o`` in q's
    layout (``alloc_with_matching_layout``), fp32 ``softmaxstats [b, h, s_q, 1]``
    when grad is needed; the cuDNN plan workspace is not modelled (0). Saved:
    q, k, v, o, stats, seed, offset, bias.

    Backward (``_cudnn_attention_backward`` [B], ``run_cudnn_SDP_bprop`` [C]):
    ``dq/dk/dv = empty_like(q/k/v)``, a copy of grad_out in o's layout only if
    its last stride is not 1 (cuDNN >= 9.5.1), and the frontend workspace of
    ``CompositeSDPABackwardNode``: fp32 ``dQ_accum [b, h, s_q, d_qk]`` plus
    ``softmax_sum [b, h, s_q, 1]`` in one block (cuDNN >= 9 without dBias or
    determinism); the backend engine's own workspace is not modelled.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, dropout_p, is_causal, scale, compute_lse, target):
        _notify(ctx, "forward", q, k, v, is_causal)
        b, h, s_q, _ = q.shape
        s_k = k.size(2)
        if bias is not None:  # expand to 4-D [U]
            heads = bias.size(1) if bias.dim() == 4 else 1
            bias = bias.expand(b, heads, s_q, s_k)
        with emulated_outputs(_CUDNN_OP):
            seed_t = q.new_empty((), dtype=torch.int64)
            offset_t = q.new_empty((), dtype=torch.int64)
            o = _alloc_matching_layout(q, (b, h, s_q, v.size(3)))
            stats = q.new_empty((b, h, s_q, 1), dtype=_F32) if compute_lse else None
        seed = _new_seed() if dropout_p > 0.0 and _has_values(q) else 0
        scale_ = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
        if _has_values(q):
            with untracked(), torch.autograd._unsafe_preserve_version_counter(o):
                o.copy_(_reference(q, _heads_to(k, h), _heads_to(v, h), bias, is_causal, scale_, dropout_p, seed))
        if not compute_lse:  # no graph (compute_lse is the grad mode's): the op's returned tuple dies in order
            del stats, seed_t, offset_t
            return o
        # ScaledDotProductCudnnAttentionBackward0::release_variables order (Functions.h).
        ctx.save_for_backward(bias, k, q, v, stats, o, offset_t, seed_t)
        ctx.args = (dropout_p, is_causal, scale_, seed)
        return o

    @staticmethod
    def backward(ctx, grad):
        _notify(ctx, "backward")
        bias, k, q, v, stats, o, offset_t, seed_t = ctx.saved_tensors
        dropout_p, is_causal, scale, seed = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        d_o = grad
        if grad.stride(-1) != 1:  # permute_to_matching_layout(o, dO)
            d_o = _alloc_matching_layout(o, grad.shape).copy_(grad)
        b, h, s_q, d_qk = q.shape
        workspace = q.new_empty((b * h * s_q * d_qk * 4 + b * h * s_q * 4,), dtype=torch.uint8)
        if _has_values(q):
            with untracked():
                gq, gk, gv = _reference_grads(grad, q, k, v, bias, False, is_causal, scale, dropout_p, seed)
                dq.copy_(gq)
                dk.copy_(_group_sum(gk, k.size(1)))
                dv.copy_(_group_sum(gv, v.size(1)))
                del gq, gk, gv
        del workspace, d_o
        grads = dq, dk, dv, None, None, None, None, None, None
        # The node's apply unpacks its saved tensors in declaration order and destroys them in reverse
        # when it returns; that is when they die where checkpointing holds them only through its hooks.
        del dq, dk, dv
        del seed_t, offset_t, o, stats, v, q, k, bias
        return grads


# ----------------------------------------------------------------------------- math [A]


class _SafeSoftmax(torch.autograd.Function):
    """``_safe_softmax`` (CompositeExplicitAutograd, so its inner ops allocate on CUDA).

    2.13 body: ``out = softmax(x)``, ``masked = isneginf(x)``,
    ``rows = all(masked, dim, keepdim)``, a 0-dim zero, and the dead rows
    zeroed in ``out`` itself: on the stub CUDA device (torch 2.13's CUDA
    build and allocator) the op allocates the softmax output, the
    ``isneginf`` mask, the ``all`` rows and a 4-byte scalar, and no
    ``where`` output (benchmarks/results/stub-wholestep-2026-11-25.md:
    a ``where`` here cost one s x s fp32 tensor per layer and 260 MiB of
    reserved memory on Llama-3.2-1B in fp32). Autograd saves only the result
    (``_softmax_backward_data``).
    """

    @staticmethod
    def forward(ctx, x, dim):
        out = torch.softmax(x, dim)
        rows = torch.isneginf(x).all(dim, keepdim=True)
        result = out.masked_fill_(rows, out.new_full((), 0.0))
        ctx.save_for_backward(result)
        ctx.dim, ctx.dtype = dim, x.dtype
        return result

    @staticmethod
    def backward(ctx, grad):
        (result,) = ctx.saved_tensors
        return torch.ops.aten._softmax_backward_data(grad, result, ctx.dim, ctx.dtype), None


def _math_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """``_scaled_dot_product_attention_math`` [A] op by op, as it runs on CUDA.

    Half/bf16 inputs are upcast to fp32 on every device (the CPU and CUDA share
    this composite; only ``allow_fp16_bf16_reduction_math_sdp`` turns it off).
    The mask is added in place (``add_``): the out-of-place branch is taken
    only for tensor subclasses (FakeTensor, dispatch modes), never on CUDA.
    """
    origin = query.dtype
    reduce_low = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()

    def upcast(t: torch.Tensor) -> torch.Tensor:
        return t.to(_F32) if t.dtype in _HALF and not reduce_low else t

    q, k, v = upcast(query), upcast(key), upcast(value)
    negative = scale is not None and scale < 0.0
    factor = math.sqrt(abs(scale) if negative else (scale if scale is not None else 1.0 / math.sqrt(q.size(-1))))
    q = q * (-factor if negative else factor)
    if is_causal:
        causal = torch.ones((q.size(-2), k.size(-2)), dtype=torch.bool, device=q.device).tril()
        attn_mask = _bool_mask_to_additive(causal, q.dtype)
    if enable_gqa and not (q.size(-3) == k.size(-3) == v.size(-3)):  # pre_process_group_query_attention_input
        if q.size(-3) % k.size(-3) or q.size(-3) % v.size(-3):
            raise RuntimeError("Number of heads in key and value must divide the number of heads in ")
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    attn = torch.matmul(q, k.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn.add_(attn_mask)
    attn = _SafeSoftmax.apply(attn, -1)
    if dropout_p > 0.0:  # at::dropout takes the fused native_dropout on CUDA (Dropout.cpp)
        attn = torch.native_dropout(attn, dropout_p, True)[0]
    # return make_tuple(matmul(attn, v).to(origin), attn.to(origin)): GCC evaluates
    # the arguments right to left (the 2.13 trace shows the cast first); SDPA drops it.
    attn_cast = attn.to(origin)
    out = torch.matmul(attn, v).to(origin)
    del attn_cast
    return out
