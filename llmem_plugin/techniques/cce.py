"""Cut Cross-Entropy (``cut-cross-entropy`` 25.1.1), allocation for allocation.

Cut Cross-Entropy (apple/ml-cross-entropy) computes the cross-entropy of
``hidden @ lm_head.weight.T`` in Triton kernels without materializing the
logits. Its kernels cannot run here, so :func:`cce_loss` performs the
package's torch-side allocations in its order and emulates the kernels, which
only write into buffers allocated before them; on real tensors the values are
computed by a CPU reference inside :func:`llmem_plugin.trace._pause.untracked`.

As trainers call it (the ``cut_cross_entropy.transformers`` patches, Axolotl's
``cut_cross_entropy`` plugin): ``linear_cross_entropy(hidden, lm_head.weight,
labels, shift=True)`` with the defaults ``reduction="mean"``,
``filter_eps="high"`` and ``impl="cce"``, the model's final-logit softcap
passed as ``softcap``. Sources (the wheel's files):

* ``cce.py`` ``cce_linear_cross_entropy``: ``e.contiguous()``,
  ``targets.contiguous()``, ``_build_flat_valids`` (``utils.py``: with
  ``shift`` the mask ``targets[..., 1:] != ignore_index``, its ``nonzero()``
  as int64 ``[N, 2]``, ``.to(torch.int32)``, the row index scaled in place by
  the row stride, ``sum(1)``: int64 ``[N]`` flat positions).
* ``LinearCrossEntropyFunction.forward``: ``cce_lse_forward_kernel``
  (``cce_lse_forward.py``: fp32 ``lse [N]``, uint32 ``locks [ceil(N/128)]``
  freed on return, fp32 ``logit_avg [V]`` when grad is needed and
  ``filter_eps`` is set), ``indexed_neg_dot_forward_kernel`` (``indexed_dot.py``:
  fp32 ``out [N]``; with a softcap, ``softcapping(out)``, a compiled
  elementwise op with a new fp32 ``[N]``), ``neg_dot.add_(lse)`` in place,
  ``nll.mean()``. Saved: e, c, lse, targets, valids, logit_avg.
* ``backward``: ``sort_logit_avg`` (``torch.argsort(logit_avg).to(int32)``
  under ``torch.compile``: taken as the eager ops, fp32 values and int64
  indices ``[V]`` then int32 ``[V]``), ``cce_backward_kernel``
  (``cce_backward.py``: ``de = zeros_like(e)``, ``dc = zeros_like(c,
  dtype=e.dtype)`` when lm_head trains, int32 ``de_locks [ceil(N/nd), nd]``
  and ``dc_locks [ceil(V/nd), nd]`` with ``nd = ceil(D/64)``, then ``dc.to(c.dtype)``).
* ``tl_autotune.py``: autotuning is off unless ``CCE_AUTOTUNE`` is set, so no
  buffers are cloned for benchmarking.

Known limitations: ``nonzero``'s cub scratch space (a few KiB) and the
compiled argsort's sort workspace (O(V)) are not modelled; every label counts
(the traced batch has no ignored tokens). The backward asserts bf16/fp16
hidden states, so fp32 ones are refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from llmem_plugin.trace._pause import untracked
from llmem_plugin.errors import ConfigError

__all__ = ["IGNORE_INDEX", "cce_loss"]

IGNORE_INDEX = -100  # cut_cross_entropy/constants.py


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _logits(e: torch.Tensor, c: torch.Tensor, softcap: float | None) -> torch.Tensor:
    z = e.float() @ c.float().t()
    return z if softcap is None else torch.tanh(z / softcap) * softcap


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, targets, valids, softcap):
        n, v = valids.numel(), c.size(0)
        needs_grad = e.requires_grad or c.requires_grad
        lse = e.new_full((n,), -float("inf"), dtype=torch.float32)
        locks = e.new_full((_cdiv(n, 128),), 0, dtype=torch.uint32)
        logit_avg = e.new_full((v,), 0.0, dtype=torch.float32) if needs_grad else None  # filter_eps "high"
        real = not is_fake(e)
        if real:
            with untracked():
                z = _logits(e[valids], c, softcap)
                lse.copy_(torch.logsumexp(z, dim=-1))
                if logit_avg is not None:
                    logit_avg.copy_(z.mean(0))
                del z
        del locks
        out = e.new_zeros((n,), dtype=torch.float32)
        if real:
            with untracked():
                rows, cols = e[valids].float(), c.float()[targets[valids + 1]]
                out.copy_(-(rows * cols).sum(-1))
                del rows, cols
        if softcap is not None:
            out = _softcapped(out, softcap)
        nll = out.add_(lse)
        loss = nll.mean()
        del out, nll
        ctx.save_for_backward(e, c, lse, targets, valids, logit_avg)
        ctx.softcap = softcap
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        e, c, lse, targets, valids, logit_avg = ctx.saved_tensors
        ordering = None
        if logit_avg is not None:  # sort_logit_avg
            values, indices = torch.sort(logit_avg)
            ordering = indices.to(torch.int32)
            del values, indices
        de = torch.zeros_like(e)
        dc = torch.zeros_like(c, dtype=e.dtype) if c.requires_grad else None
        nd = _cdiv(c.size(1), 64)
        de_locks = e.new_zeros((_cdiv(valids.numel(), nd), nd), dtype=torch.int32)
        dc_locks = c.new_zeros((_cdiv(c.size(0), nd), nd), dtype=torch.int32)
        if not is_fake(e):
            with untracked():
                leaf_e, leaf_c = e.detach().float().requires_grad_(), c.detach().float().requires_grad_()
                with torch.enable_grad():
                    z = _logits(leaf_e[valids], leaf_c, ctx.softcap)
                    loss = F.cross_entropy(z, targets[valids + 1].long()) * grad_out.float()
                    ge, gc = torch.autograd.grad(loss, (leaf_e, leaf_c))
                de.copy_(ge)
                if dc is not None:
                    dc.copy_(gc)
                del leaf_e, leaf_c, z, loss, ge, gc
        dc_out = None if dc is None else dc.to(c.dtype)
        del de_locks, dc_locks, dc, ordering
        return de, dc_out, None, None, None


def _softcapped(out: torch.Tensor, cap: float) -> torch.Tensor:
    """``softcapping`` (utils.py, torch.compile'd): one fused kernel, one new fp32 tensor."""
    res = torch.empty_like(out)
    with untracked():
        res.copy_(torch.tanh(out / cap) * cap)
    return res


def cce_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``linear_cross_entropy(hidden, weight, labels, shift=True)`` with its defaults.

    Args:
        hidden: ``(batch, seq, D)`` last hidden states.
        weight: ``(V, D)`` output projection.
        labels: ``(batch, seq)`` unshifted labels.
        softcap: The model's final-logit softcap, or None.

    Returns:
        The mean cross-entropy, a scalar fp32 tensor.
    """
    if torch.is_grad_enabled() and hidden.requires_grad and hidden.dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(f"--loss cce: cut-cross-entropy's backward takes bf16 or fp16 hidden states "
                          f"(cce_backward.py asserts it); this model's are {hidden.dtype}. HINT: --precision bf16, "
                          "and --kbit-prepare off with QLoRA (its fp32 norm makes the hidden states fp32)")
    e = hidden.contiguous()
    targets = labels.contiguous()
    # _build_flat_valids(targets, IGNORE_INDEX, shift=True)
    shifted = targets[..., 1:]
    mask = shifted != IGNORE_INDEX
    if is_fake(mask):
        n = mask.numel()  # every label counts in the traced batch
    else:
        with untracked():
            n = int(mask.sum())
    nz = mask.new_empty((n, shifted.dim()), dtype=torch.int64)  # nonzero()
    if not is_fake(mask):
        with untracked():
            nz.copy_(mask.nonzero())
    del mask
    valids = nz.to(torch.int32)
    del nz
    for i in range(shifted.dim() - 1):
        valids[:, i] *= shifted.stride(i)
    valids = valids.sum(1)
    del shifted
    e = e.flatten(0, -2)
    targets = targets.flatten()
    return _LinearCrossEntropy.apply(e, weight, targets, valids, softcap)
