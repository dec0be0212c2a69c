"""Emulate ``attn_implementation="flash_attention_2"`` on CPU, allocation for allocation.

The flash-attn package runs on CUDA only, so transformers cannot load it here.
:func:`attn_implementation_name` registers, under :data:`ATTN_NAME`, transformers'
own flash attention wrapper (``integrations/flash_attention.py``:
``flash_attention_forward``, which transposes to ``[b, s, h, d]``, casts fp32
q/k/v to the autocast dtype and calls ``_flash_attention_forward``) with the
flash-attn functions swapped for :func:`flash_attn_func`, whose autograd
Function allocates what flash-attn's ``FlashAttnFunc`` and its CUDA kernels
allocate. The name contains "flash", so transformers' own checks
(``utils/generic.py`` ``is_flash_attention_requested``) take the flash branches,
and the flash mask function (``masking_utils.flash_attention_mask``: no mask
without padding) is registered for it. On real tensors the values come from an
fp32 CPU reference run inside :func:`llmem_plugin.trace._pause.untracked`.

Sources:

* ``[I]`` flash-attn 2.8.3 sdist, ``flash_attn/flash_attn_interface.py``
  (``FlashAttnFunc``, ``maybe_contiguous``, ``_flash_attn_forward/_backward``).
* ``[F]`` flash-attn 2.8.3 sdist, ``csrc/flash_attn/flash_api.cpp``
  (``mha_fwd``, ``set_params_splitkv``, ``num_splits_heuristic``, ``mha_bwd``).
* ``[T]`` transformers 5.23 ``modeling_flash_attention_utils.py`` and
  ``integrations/flash_attention.py``.

Known limitations:

* Packed batches reach ``flash_attn_varlen_func`` with their documents'
  boundaries, from the collator or found from the positions
  (:mod:`llmem_plugin.techniques.packing`), which is modelled; padding masks
  (``_upad_input``, a data-dependent ``nonzero``, refused in ``_attention``)
  and paged caches raise :class:`UnsupportedError`.
* ``seqlenq_ngroups_swapped`` (s_q == 1 with GQA) changes only the layout of
  ``out``/``softmax_lse``, not their sizes; the layout is not reproduced.
* Dropout values come from a CPU generator, not flash-attn's Philox stream.
* Depends on private names of transformers 5.23 (:data:`_TRANSFORMERS_HOOKS`);
  other versions raise if those names are gone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmem_plugin.trace._pause import untracked
from llmem_plugin.trace.emulation import sdpa
from llmem_plugin.errors import ConfigError, UnsupportedError

__all__ = ["ATTN_NAME", "attn_implementation_name", "check_model", "flash_attn_func", "flash_attn_varlen_func",
           "unsupported"]

# Registered name; contains "flash" so is_flash_attention_requested() [T] is true.
ATTN_NAME = "llmem_flash_attention_2"
# [F] mha_fwd/mha_bwd: "FlashAttention forward only supports head dimension at most 256".
MAX_HEAD_DIM = 256
# [F] mha_fwd: "FlashAttention only supports Ampere GPUs or newer" (is_sm8x_min).
MIN_COMPUTE_CAPABILITY = (8, 0)
# Private names of modeling_flash_attention_utils [T] that the hook replaces.
_TRANSFORMERS_HOOKS = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn",
                       "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn",
                       "_is_packed_sequence", "_lazy_define_process_function", "_pad_input", "_unpad_input",
                       "prepare_fa_kwargs_from_position_ids")
_HALF = (torch.float16, torch.bfloat16)
_F32 = torch.float32


def unsupported(method: str, workload) -> str | None:
    """Why ``workload``'s attention cannot run under ``method``, or None.

    flash-attn takes fp16/bf16 only ([F] mha_fwd: "FlashAttention only support
    fp16 and bf16 data type"); transformers casts fp32 q/k/v to the autocast
    dtype ([T] get_target_dtype), so mixed precision runs, pure fp32 does not.

    Args:
        method: ``"single"`` or a name from ``llmem_plugin.methods.method_names()``.
        workload: The workload.

    Returns:
        One sentence with a HINT, or None when supported.
    """
    if workload.attn_implementation.value != "flash_attention_2":
        return None
    if workload.precision.value == "fp32":
        return (f"--attn flash_attention_2 with --precision fp32 ({method}) cannot run: flash-attn kernels take "
                "fp16/bf16 only. HINT: pass --precision bf16-mixed (or bf16/fp16-mixed), or --attn sdpa")
    return None


def attn_implementation_name() -> str:
    """Register the emulation with transformers and return its name.

    Returns:
        The ``attn_implementation`` to build the model with (:data:`ATTN_NAME`).

    Raises:
        UnsupportedError: the installed transformers lacks the hooked names.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, flash_attention_mask)
    _install_functions()
    return ATTN_NAME


def check_model(model: torch.nn.Module) -> None:
    """Refuse a built model that a CUDA flash_attention_2 run would refuse.

    Args:
        model: The model built with :func:`attn_implementation_name`.

    Raises:
        ConfigError: the architecture does not support flash attention 2
            (``_supports_flash_attn``, modeling_utils.py ``_flash_attn_can_dispatch``),
            the model was not built with the emulation, or its head dim exceeds 256.
    """
    config = getattr(model, "config", None)
    name = type(model).__name__
    if not getattr(model, "_supports_flash_attn", False):
        raise ConfigError(f"{name} does not support --attn flash_attention_2 in transformers "
                          "(_supports_flash_attn is False). HINT: pass --attn sdpa")
    if getattr(config, "_attn_implementation", None) != ATTN_NAME:
        raise ConfigError(f"{name} was not built with attn_implementation={ATTN_NAME!r}, so --attn "
                          "flash_attention_2 cannot apply to it. HINT: pass a config instead of a built module")
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if head_dim is not None and head_dim > MAX_HEAD_DIM:
        raise ConfigError(f"head dim {head_dim} of {name} exceeds flash-attn's limit of {MAX_HEAD_DIM}. "
                          "HINT: pass --attn sdpa")


# ----------------------------------------------------------------------------- transformers hook [T]


def _hooks():
    from transformers import modeling_flash_attention_utils as mfau

    missing = [n for n in _TRANSFORMERS_HOOKS if not hasattr(mfau, n)]
    if missing:
        raise UnsupportedError(f"this transformers version lacks {', '.join(missing)} that the flash_attention_2 "
                               "emulation hooks (written for transformers 5.23). HINT: pass --attn sdpa")
    return mfau


def _install_functions() -> None:
    """Make ``lazy_import_flash_attention(ATTN_NAME)`` [T] return our functions.

    transformers caches the loaded implementation in module globals and
    re-imports only when the name changes, so setting them for our name is what
    a successful import of flash-attn would have left there.
    """
    mfau = _hooks()
    if mfau._loaded_implementation == ATTN_NAME and mfau._flash_fn is flash_attn_func:
        return
    mfau._flash_fn, mfau._flash_varlen_fn, mfau._flash_with_kvcache_fn = flash_attn_func, _varlen, None
    mfau._pad_fn, mfau._unpad_fn = mfau._pad_input, mfau._unpad_input
    # The kwargs transformers passes depend on the varlen signature (same as flash-attn 2.8.3 [I]).
    mfau._process_flash_kwargs_fn = mfau._lazy_define_process_function(_varlen)
    mfau._process_with_kvcache_kwargs_fn = dict
    mfau._loaded_implementation = ATTN_NAME


def _packed_sequence(position_ids, batch_size) -> bool:
    """``_is_packed_sequence`` [T] for the traced batch.

    A real run reads the values (an ``arange``, ``min``, difference, ``abs``,
    ``sum`` and ``bool``, then a host sync); the same ops run here, and the
    answer is the one a real run gives: packed when the step's row holds
    several documents whose boundaries the model must find from the
    positions (:func:`llmem_plugin.techniques.packing.documents`), not packed for rows
    of positions 0..s-1.
    """
    from llmem_plugin.techniques import packing

    if position_ids is None or batch_size != 1 or position_ids.shape[-1] == 1:
        return False
    start = torch.arange(position_ids.shape[1], device=position_ids.device) + position_ids.min()
    packed = (start - position_ids).abs().sum().bool()
    if sdpa._has_values(position_ids):  # a real row: transformers' own answer
        return bool(packed)
    lengths = packing.documents()
    return lengths is not None and len(lengths) > 1


def _fa_kwargs_from_positions(position_ids):
    """``prepare_fa_kwargs_from_position_ids`` [T] with the documents' boundaries known.

    The same ops allocate the same tensors; ``nonzero``, whose output size
    depends on the values, is a tensor of the known document starts.
    """
    from llmem_plugin.techniques import packing

    lengths = packing.documents()
    tensor_kwargs = {"dtype": torch.int32, "device": position_ids.device}
    position_ids = position_ids.reshape(-1)
    first = position_ids == position_ids.min()
    indices_q = first.new_empty((len(lengths), 1), dtype=torch.int64)  # first.nonzero()
    if sdpa._has_values(position_ids):
        with untracked():
            indices_q.copy_(first.nonzero())
    indices_q = indices_q.view(-1)
    cu_seq_lens_q = torch.cat((indices_q.to(**tensor_kwargs), torch.tensor(position_ids.size(), **tensor_kwargs)))
    max_length_q = cu_seq_lens_q.diff().max()
    return (cu_seq_lens_q, cu_seq_lens_q), (max_length_q, max_length_q)


def _attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' ``flash_attention_forward`` [T] with our flash functions."""
    from transformers.integrations.flash_attention import flash_attention_forward

    if attention_mask is not None:
        raise UnsupportedError("flash_attention_2 with a padding mask (transformers' _upad_input, a nonzero whose "
                               "size the mask's values decide) is not modelled. HINT: trace unpadded batches, or "
                               "pass --attn sdpa")
    _install_functions()
    mfau = _hooks()
    originals = mfau._is_packed_sequence, mfau.prepare_fa_kwargs_from_position_ids
    mfau._is_packed_sequence, mfau.prepare_fa_kwargs_from_position_ids = _packed_sequence, _fa_kwargs_from_positions
    try:
        return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)
    finally:
        mfau._is_packed_sequence, mfau.prepare_fa_kwargs_from_position_ids = originals


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
            causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
            return_attn_probs=False, block_table=None):
    """flash-attn's ``flash_attn_varlen_func`` [I] as transformers calls it.

    The packed batches a padding-free collator makes reach it with their
    sequence boundaries (``cu_seq_lens_q/k`` and ``max_length_q/k`` among the
    model's inputs, ``_flash_attention_forward`` [T]): that is
    :func:`flash_attn_varlen_func`. A padding mask (``_upad_input``, whose
    ``nonzero`` depends on the mask's values) is not modelled.
    """
    if block_table is not None:
        raise UnsupportedError("flash_attn_varlen_func with a paged KV cache is not modelled. HINT: pass --attn sdpa")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


# ----------------------------------------------------------------------------- flash-attn [I] [F]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn 2.8.3 ``flash_attn_func`` [I] with the CUDA kernels' allocations.

    Args:
        q, k, v: ``[b, s, h, d]`` and ``[b, s_k, h_k, d]``, fp16/bf16.
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic:
            As flash-attn takes them (causal is bottom-right aligned).
        alibi_slopes, return_attn_probs: Must be None/False (not modelled).

    Returns:
        The attention output ``[b, s, h, d]`` in q's dtype.

    Raises:
        ConfigError: a dtype, head dim or GPU flash-attn rejects.
        UnsupportedError: ALiBi or returned attention probabilities.
    """
    if alibi_slopes is not None or return_attn_probs:
        raise UnsupportedError("flash_attn_func with alibi_slopes or return_attn_probs is not modelled. "
                               "HINT: pass --attn sdpa")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _FlashAttnFunc.apply(q, k, v, float(dropout_p), scale, bool(causal), tuple(window_size),
                                float(softcap), bool(deterministic))


def _maybe_contiguous(t: torch.Tensor) -> torch.Tensor:  # [I] maybe_contiguous
    return t.contiguous() if t.stride(-1) != 1 else t


def _pad_head(d_og: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[I] FlashAttnFunc / FlashAttnVarlenFunc pad the head dim to a multiple of 8 (``F.pad``)."""
    return tuple(F.pad(t, [0, 8 - d_og % 8]) for t in tensors) if d_og % 8 else tensors


def _grads_out(dq, dk, dv, dk_e, dv_e, d_og):
    """GQA: the expanded dk/dv summed into dk/dv ([F] ``at::sum_out(dk, reshape(dk_expanded, {..., h_k,
    h / h_k, d}), {-2})``); the grads sliced back to the original head dim."""
    if dk_e is not dk:
        h_k = dk.size(-2)
        for e, out in ((dk_e, dk), (dv_e, dv)):
            torch.sum(e.reshape(*e.shape[:-2], h_k, e.size(-2) // h_k, e.size(-1)), dim=-2, out=out)
    if d_og % 8:
        dq, dk, dv = dq[..., :d_og], dk[..., :d_og], dv[..., :d_og]
    return dq, dk, dv


def _check_inputs(q, k, v, target) -> None:
    if q.dtype not in _HALF or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ConfigError(f"flash_attention_2 got q/k/v in {q.dtype}/{k.dtype}/{v.dtype}; flash-attn takes fp16 or "
                          "bf16 only. HINT: pass --precision bf16-mixed or bf16, or --attn sdpa")
    if q.size(-1) > MAX_HEAD_DIM:
        raise ConfigError(f"head dim {q.size(-1)} exceeds flash-attn's limit of {MAX_HEAD_DIM}. HINT: --attn sdpa")
    if q.size(2) % k.size(2):
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if tuple(target.compute_capability) < MIN_COMPUTE_CAPABILITY:
        raise ConfigError(f"flash-attn needs compute capability >= 8.0, not {target.compute_capability}. "
                          "HINT: pass --attn sdpa")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, m: int) -> int:
    return _ceil_div(a, m) * m


def _head_dim_rounded(d: int) -> int:  # [F] round_multiple(head_size, head_size <= 128 ? 32 : 64)
    return _round_up(d, 32 if d <= 128 else 64)


def _reference(q, k, v, scale, causal, window, softcap, dropout_p, seed, grad=None):
    """fp32 attention on ``[b, s, h, d]`` (k/v may have fewer heads); with
    ``grad``, the grads of q and of k/v expanded to q's heads instead."""
    _, s_q, h, _ = q.shape
    s_k, h_k = k.size(1), k.size(2)
    qf = q.detach().float().transpose(1, 2)
    kf = k.detach().float().transpose(1, 2).repeat_interleave(h // h_k, 1)
    vf = v.detach().float().transpose(1, 2).repeat_interleave(h // h_k, 1)
    leaves = [t.requires_grad_() for t in (qf, kf, vf)] if grad is not None else []
    with torch.enable_grad() if grad is not None else torch.no_grad():
        scores = qf @ kf.transpose(-2, -1) * scale
        if softcap > 0.0:
            scores = softcap * torch.tanh(scores / softcap)
        left, right = window
        right = 0 if causal else right
        i = torch.arange(s_q).unsqueeze(1) + (s_k - s_q)  # bottom-right aligned [F]
        j = torch.arange(s_k).unsqueeze(0)
        keep = torch.ones(s_q, s_k, dtype=torch.bool)
        if right >= 0:
            keep &= j <= i + right
        if left >= 0:
            keep &= j >= i - left
        scores = scores.masked_fill(~keep, -math.inf)
        probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a fully masked row outputs 0
        if dropout_p > 0.0:
            gen = torch.Generator().manual_seed(seed)
            probs = probs * (torch.rand(probs.shape, generator=gen) >= dropout_p) / (1.0 - dropout_p)
        out = (probs @ vf).transpose(1, 2)
        if grad is None:
            return out
        return [g.transpose(1, 2) for g in torch.autograd.grad(out, leaves, grad.float())]


class _FlashAttnFunc(torch.autograd.Function):
    """flash-attn's ``FlashAttnFunc`` [I] over ``mha_fwd``/``mha_bwd`` [F].

    Forward: q/k/v padded to a head dim multiple of 8 (``F.pad``),
    ``maybe_contiguous`` copies, then ``mha_fwd``: ``out = empty_like(q)``,
    fp32 ``softmax_lse [b, h, s_q]``, ``p = empty({0})``, when the split-KV
    heuristic picks n > 1 (no dropout) fp32 ``softmax_lse_accum [n, b, h, s_q]``
    and ``out_accum [n, b, h, s_q, d_rounded]`` (freed on return), and int64
    ``rng_state [2]``. Saved: padded q, k, v, ``out_padded``, ``softmax_lse``,
    ``rng_state``; returns ``out_padded[..., :d]``.

    Backward: ``dq/dk/dv = empty_like`` of the saved q/k/v, ``dout`` padded,
    ``maybe_contiguous`` copies, then ``mha_bwd``: fp32 ``softmax_d [b, h,
    round(s_q, 128)]``, fp32 ``dq_accum [b, round(s_q, 128), h, d_rounded]``
    (zeros with a leading ``ceil(num_sms / (b*h))`` split dim when
    deterministic), and for GQA ``dk/dv_expanded [b, s_k, h, d]`` summed into
    dk/dv (``at::sum_out``). Returns the grads sliced to the original head dim.
    """

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, scale, causal, window, softcap, deterministic):
        target = sdpa._active_target
        _check_inputs(q, k, v, target)
        d_og = q.size(3)
        q, k, v = _pad_head(d_og, q, k, v)
        qc, kc, vc = (_maybe_contiguous(t) for t in (q, k, v))
        b, s_q, h, d = qc.shape
        s_k = kc.size(1)
        causal = causal and s_q != 1  # [F] mha_fwd: causal is a no-op for seqlen_q == 1
        out = torch.empty_like(qc)
        lse = qc.new_empty((b, h, s_q), dtype=_F32)
        p = qc.new_empty((0,))  # S_dmask: return_softmax is False
        accum = ()
        if dropout_p == 0.0:  # [F] set_params_splitkv: SplitKV is not implemented for dropout
            block_n = 64 if d > 128 else (128 if d > 64 else 256)
            n = sdpa._flash_num_splits(b * h * _ceil_div(s_q, 64), target.num_sms * 2, _ceil_div(s_k, block_n), 128)
            if n > 1:
                accum = (qc.new_empty((n, b, h, s_q), dtype=_F32),
                         qc.new_empty((n, b, h, s_q, _head_dim_rounded(d)), dtype=_F32))
        rng_state = qc.new_empty((2,), dtype=torch.int64)
        seed = sdpa._new_seed() if dropout_p > 0.0 and sdpa._has_values(qc) else 0
        if sdpa._has_values(qc):
            with untracked():
                out.copy_(_reference(qc, kc, vc, scale, causal, window, softcap, dropout_p, seed))
        del accum, p, qc, kc, vc
        ctx.save_for_backward(q, k, v, out, lse, rng_state)
        ctx.args = (d_og, dropout_p, scale, causal, window, softcap, deterministic, seed, target)
        return out[..., :d_og] if d_og % 8 else out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, _lse, _rng_state = ctx.saved_tensors
        d_og, dropout_p, scale, causal, window, softcap, deterministic, seed, target = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        (dout_p,) = _pad_head(d_og, dout)
        dout_c, qc, kc, vc, out_c = (_maybe_contiguous(t) for t in (dout_p, q, k, v, out))
        b, s_q, h, d = qc.shape
        s_k, h_k = kc.size(1), kc.size(2)
        s_q_r, d_r = _round_up(s_q, 128), _head_dim_rounded(d)
        softmax_d = qc.new_empty((b, h, s_q_r), dtype=_F32)
        if deterministic:
            dq_accum = qc.new_zeros((_ceil_div(target.num_sms, b * h), b, s_q_r, h, d_r), dtype=_F32)
        else:
            dq_accum = qc.new_empty((b, s_q_r, h, d_r), dtype=_F32)
        gqa = h_k != h
        dk_e = qc.new_empty((b, s_k, h, d)) if gqa else dk
        dv_e = qc.new_empty((b, s_k, h, d)) if gqa else dv
        if sdpa._has_values(qc):
            with untracked():
                gq, gk, gv = _reference(qc, kc, vc, scale, causal, window, softcap, dropout_p, seed, grad=dout_c)
                dq.copy_(gq)
                dk_e.copy_(gk)
                dv_e.copy_(gv)
                del gq, gk, gv
        dq, dk, dv = _grads_out(dq, dk, dv, dk_e, dv_e, d_og)  # [F] mha_bwd
        del dk_e, dv_e, dq_accum, softmax_d, dout_c, qc, kc, vc, out_c, dout_p
        return dq, dk, dv, None, None, None, None, None, None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False):
    """flash-attn 2.8.3 ``flash_attn_varlen_func`` [I] with the CUDA kernels' allocations.

    Args:
        q, k, v: ``[total_q, h, d]`` and ``[total_k, h_k, d]``: the sequences
            of a batch concatenated, fp16/bf16.
        cu_seqlens_q, cu_seqlens_k: int32 ``[n + 1]``, where each of the n
            sequences starts (and the total).
        max_seqlen_q, max_seqlen_k: The longest sequence.
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic:
            As flash-attn takes them.
        alibi_slopes, return_attn_probs: Must be None/False (not modelled).

    Returns:
        The attention output ``[total_q, h, d]`` in q's dtype.

    Raises:
        ConfigError: a dtype, head dim or GPU flash-attn rejects.
        UnsupportedError: ALiBi, returned attention probabilities, or one
            query per sequence (flash-attn's ``seqlenq_ngroups_swapped``
            decoding layout).
    """
    if alibi_slopes is not None or return_attn_probs:
        raise UnsupportedError("flash_attn_varlen_func with alibi_slopes or return_attn_probs is not modelled. "
                               "HINT: pass --attn sdpa")
    from llmem_plugin.techniques import packing

    lengths = packing.documents()
    if lengths and not sdpa._has_values(q):  # a fake row's longest document: transformers' .item() gave no value
        max_seqlen_q = max_seqlen_k = max(lengths)
    if int(max_seqlen_q) == 1:
        raise UnsupportedError("flash_attn_varlen_func with one query per sequence (decoding) is not modelled. "
                               "HINT: estimate training steps")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                      float(dropout_p), scale, bool(causal), tuple(window_size), float(softcap),
                                      bool(deterministic))


def _sequences(cu_q, cu_k):
    """(start_q, end_q, start_k, end_k) of each sequence (real tensors only)."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return list(zip(bq, bq[1:], bk, bk[1:]))


class _FlashAttnVarlenFunc(torch.autograd.Function):
    """flash-attn's ``FlashAttnVarlenFunc`` [I] over ``mha_varlen_fwd``/``mha_varlen_bwd`` [F].

    Forward: q/k/v padded to a head dim multiple of 8, ``maybe_contiguous``
    copies, then ``mha_varlen_fwd``: ``out = empty_like(q)``, fp32
    ``softmax_lse [h, total_q]`` (unpadded), ``p = empty({0})`` and int64
    ``rng_state [2]`` (no split-KV: ``set_params_splitkv`` runs there only
    for one query per sequence). Saved: padded q, k, v, ``out_padded``,
    ``softmax_lse``, ``cu_seqlens_q/k``, ``rng_state``.

    Backward: ``dq/dk/dv = empty_like``, ``dout`` padded, ``maybe_contiguous``
    copies, then ``mha_varlen_bwd``: fp32 ``softmax_d [h, total_q + 128 n]``
    and ``dq_accum [total_q + 128 n, h, d_rounded]`` for n sequences (each
    sequence 128 rows apart; zeros with a leading ``ceil(num_sms / (n*h))``
    split dim when deterministic), and for GQA ``dk/dv_expanded [total_k,
    h, d]`` summed into dk/dv.
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window, softcap, deterministic):
        target = sdpa._active_target
        _check_inputs(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), target)
        d_og = q.size(-1)
        q, k, v = _pad_head(d_og, q, k, v)
        qc, kc, vc = (_maybe_contiguous(t) for t in (q, k, v))
        total_q, h, _ = qc.shape
        out = torch.empty_like(qc)
        lse = qc.new_empty((h, total_q), dtype=_F32)
        p = qc.new_empty((0,))  # S_dmask: return_softmax is False
        rng_state = qc.new_empty((2,), dtype=torch.int64)
        seed = sdpa._new_seed() if dropout_p > 0.0 and sdpa._has_values(qc) else 0
        if sdpa._has_values(qc):
            with untracked():
                out.copy_(torch.cat([_reference(qc[a:b][None], kc[c:e][None], vc[c:e][None], scale, causal, window,
                                                 softcap, dropout_p, seed)[0] for a, b, c, e in _sequences(cu_q, cu_k)]))
        del p, qc, kc, vc
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state)
        ctx.args = (d_og, dropout_p, scale, causal, window, softcap, deterministic, seed, target)
        return out[..., :d_og] if d_og % 8 else out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, _lse, cu_q, cu_k, _rng_state = ctx.saved_tensors
        d_og, dropout_p, scale, causal, window, softcap, deterministic, seed, target = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        (dout_p,) = _pad_head(d_og, dout)
        dout_c, qc, kc, vc, out_c = (_maybe_contiguous(t) for t in (dout_p, q, k, v, out))
        total_q, h, d = qc.shape
        total_k, h_k = kc.size(0), kc.size(1)
        n = cu_q.size(0) - 1
        rows, d_r = total_q + 128 * n, _head_dim_rounded(d)
        softmax_d = qc.new_empty((h, rows), dtype=_F32)
        if deterministic:
            dq_accum = qc.new_zeros((_ceil_div(target.num_sms, n * h), rows, h, d_r), dtype=_F32)
        else:
            dq_accum = qc.new_empty((rows, h, d_r), dtype=_F32)
        gqa = h_k != h
        dk_e = qc.new_empty((total_k, h, d)) if gqa else dk
        dv_e = qc.new_empty((total_k, h, d)) if gqa else dv
        if sdpa._has_values(qc):
            with untracked():
                grads = [_reference(qc[a:b][None], kc[c:e][None], vc[c:e][None], scale, causal, window, softcap,
                                    dropout_p, seed, grad=dout_c[a:b][None]) for a, b, c, e in _sequences(cu_q, cu_k)]
                dq.copy_(torch.cat([g[0][0] for g in grads]))
                dk_e.copy_(torch.cat([g[1][0] for g in grads]))
                dv_e.copy_(torch.cat([g[2][0] for g in grads]))
                del grads
        dq, dk, dv = _grads_out(dq, dk, dv, dk_e, dv_e, d_og)  # [F] mha_varlen_bwd
        del dk_e, dv_e, dq_accum, softmax_d, dout_c, qc, kc, vc, out_c, dout_p
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None

