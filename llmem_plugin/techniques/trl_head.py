"""TRL 1.16's fused LM head (``--loss trl-fused``), allocation for allocation: SFTTrainer's and DPOTrainer's steps.

TRL's SFT, DPO and GRPO trainers never build the ``[tokens, vocab]`` logits:
``add_fused_lm_head`` (trl/trainer/utils.py) replaces the causal LM's forward
with ``_fused_forward``, which runs the backbone and scores the valid label
positions with ``ChunkedLogProbFunction`` (trl/kernels/chunked_logprob.py), a
custom autograd Function over ``[4096, 32768]`` tiles of ``hidden @ W.T``.
On CUDA (Triton present) the path is "compact" and the per-tile fold is a
Triton kernel that only writes into buffers allocated before it. This module
performs the torch-side allocations in TRL's order and emulates the kernels
(cuBLAS ``mm``/``addmm`` into existing buffers, the Triton folds); on real
tensors the values come from a CPU reference inside
:func:`llmem_plugin.trace._pause.untracked`. Sources, TRL 1.16.0 wheel:

* ``_fused_forward``: ``last_hidden_state[:, :-1]`` and ``labels[:, 1:]``
  (views), ``mask = labels != -100``, the compact gather
  ``hidden_states[mask]`` and ``labels[mask]`` (ATen ``index`` with a bool
  mask: ``nonzero`` as int64 ``[N, 2]``, then the gathered copy), the Function,
  each output scattered back with ``x.new_zeros(mask.shape).masked_scatter(mask, x)``,
  and ``loss = -log_probs.sum() / num_items``;
* ``ChunkedLogProbFunction.forward``: seven fp32 ``[N]`` statistics,
  ``mm_buf`` ``[min(N, 4096), 32768]`` in the compute dtype (autocast's, else
  the hidden states'), per tile ``hidden_chunk.to(cd)`` and
  ``weight[v0:v1].to(cd)`` (copies only when the dtype differs), then
  ``log_z``, ``logprobs``, ``entropy``, ``is_top1``; saved: the gathered hidden
  states, weight, bias, targets, ``log_z`` and ``entropy``;
* ``backward``: fp32 ``grad_hidden`` ``[N, H]`` and, when the head trains,
  fp32 ``grad_weight`` ``[V, H]``; a new ``mm_buf``; per tile the same
  copies (``w_chunk`` rebound each tile, so two live for a moment);
  ``torch.addmm(out_dtype=fp32, out=acc)`` for 16-bit tiles (no allocation,
  torch >= 2.8); then ``grad_hidden.to(hidden.dtype)`` and
  ``grad_weight.to(weight.dtype)``;
* SFTTrainer.compute_loss (trl/trainer/sft_trainer.py): ``per_token_loss =
  -outputs.log_probs``, its sum over the token count; the metrics are scalars.

ATen's CUDA index kernels (aten/src/ATen/native/cuda/Indexing.cu): a bool
mask index converts the mask with ``nonzero``; the backward ``index_put_``
with ``accumulate=True`` builds an int64 linear index (``index * stride``
summed over the two dims), sorts it into ``sorted_indices``/``orig_indices``;
``masked_scatter_`` keeps an int64 prefix sum of the mask; ``masked_select``
indexes with the mask. Known limitations: cub's scratch space for nonzero,
the prefix sum and the radix sort (about the size of the index arrays) is not
modelled; on the stub device these kernels read zero for the valid count, so
the N-sized arrays are checked against ATen's source, not measured.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from llmem_plugin.trace._pause import untracked

__all__ = ["DPO_OUTPUTS", "DPO_REFUSED", "IGNORE_INDEX", "SFT_OUTPUTS", "TOKEN_CHUNK_SIZE", "VOCAB_CHUNK_SIZE", "drop_fused_forwards",
           "fused_dpo_loss", "fused_sequence_logps", "fused_sft_loss", "has_fused_head"]

IGNORE_INDEX = -100
TOKEN_CHUNK_SIZE = 4096  # trl/kernels/chunked_logprob.py
# chunked_logprob.py _MM_OUT_DTYPE: torch.addmm(..., out_dtype=float32) for 16-bit tiles from torch 2.8
_MM_OUT_DTYPE = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)
VOCAB_CHUNK_SIZE = 32768  # trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE
# SFTTrainer: add_fused_lm_head(outputs=("log_probs", "entropy", "is_top1")) (sft_trainer.py)
SFT_OUTPUTS = ("entropy", "is_top1")
# DPOTrainer: outputs=("log_probs", "entropy", "mean_logits", "is_top1") (dpo_trainer.py, without use_weighting)
DPO_OUTPUTS = ("entropy", "mean_logits", "is_top1")
DPO_BETA = 0.1  # DPOConfig.beta default (trl/trainer/dpo_config.py)
# DPOConfig settings whose step is not the one modelled (dpo_trainer.py), key -> why
DPO_REFUSED = {"precompute_ref_log_probs": "the reference's log-probs are computed in a pass before training",
               "use_weighting": "WPO weighting adds a per-token output to the fused head"}


def _is_fused_forward(fn: object) -> bool:
    """``fn`` is the ``_fused_forward`` that ``add_fused_lm_head`` binds to a model instance
    (trl/trainer/utils.py; ``functools.wraps`` gives it the class forward's name, not its code's), or a wrapper
    of it: accelerate's mixed precision rebinds ``forward`` to an autocast wrapper (``__wrapped__`` chain)."""
    func = getattr(fn, "__func__", None)
    for _ in range(8):  # the wrappers' __wrapped__ chain ends at the class forward
        code = getattr(func, "__code__", None)
        if code is not None and code.co_name == "_fused_forward" and \
                code.co_filename.replace("\\", "/").endswith("trl/trainer/utils.py"):
            return True
        func = getattr(func, "__wrapped__", None)
        if func is None:
            return False
    return False


def has_fused_head(module: torch.nn.Module) -> bool:
    """Whether TRL's trainer patched ``module`` (or a module inside it, a peft model's base model) with its
    fused LM head: SFTTrainer always does (trl 1.16 sft_trainer.py, ``add_fused_lm_head``)."""
    return any(_is_fused_forward(m.__dict__.get("forward")) for m in module.modules())


def drop_fused_forwards(module: torch.nn.Module) -> None:
    """Remove TRL's per-instance forward from a copy of a live model. Its closure calls the live model's
    original forward (``original_forward``), so a copy would run the live weights; the estimate replaces
    the head itself (``--loss trl-fused``)."""
    for m in module.modules():
        if _is_fused_forward(m.__dict__.get("forward")):
            del m.__dict__["forward"]


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    # The trace runs CUDA's autocast policy on the CPU autocast state (llmem_plugin.trace.emulation.autocast).
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else hidden.dtype


def _nonzero(mask: torch.Tensor, n: int) -> torch.Tensor:
    """CUDA ``nonzero``: int64 ``[n, mask.dim()]``."""
    out = mask.new_empty((n, mask.dim()), dtype=torch.int64)
    if not is_fake(mask):
        with untracked():
            out.copy_(mask.nonzero())
    return out


class _MaskGather(torch.autograd.Function):
    """``x[mask]`` for a bool ``mask`` over ``x``'s leading dims, as ATen's CUDA ``index`` runs it."""

    @staticmethod
    def forward(ctx, x, mask, n):
        out = _gather(x, mask, n)
        ctx.save_for_backward(mask)
        ctx.shape, ctx.n = x.shape, n
        return out

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        # index_backward: grad.new_zeros(self.sizes()).index_put_(indices, grad, accumulate=True)
        result = grad.new_zeros(ctx.shape)
        nz = _nonzero(mask, ctx.n)
        strides = [mask.stride(d) for d in range(mask.dim())]
        linear = nz[:, 0] * strides[0]  # computeLinearIndex: sum of index * stride over the indexed dims
        for d in range(1, mask.dim()):
            step = nz[:, d] * strides[d]
            linear = linear + step
            del step
        del nz
        sorted_indices, orig_indices = torch.empty_like(linear), torch.empty_like(linear)
        if not is_fake(grad):
            with untracked():
                result[mask] += grad
        del linear, sorted_indices, orig_indices
        return result, None, None


def _gather(x: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """``x[mask]`` without a gradient (the targets)."""
    nz = _nonzero(mask, n)
    out = x.new_empty((n, *x.shape[mask.dim():]))
    if not is_fake(x):
        with untracked():
            out.copy_(x[mask])
    del nz
    return out


class _MaskScatter(torch.autograd.Function):
    """``zeros.masked_scatter(mask, src)``: ``clone()`` of the zeros, then ``masked_scatter_`` (an int64 prefix
    sum of the mask); the backward is ``grad.masked_select(mask)`` (an index with the mask)."""

    @staticmethod
    def forward(ctx, zeros, mask, src, n):
        out = zeros.clone()
        prefix = mask.new_empty(mask.shape, dtype=torch.int64)
        if not is_fake(out):
            with untracked():
                out[mask] = src
        del prefix
        ctx.save_for_backward(mask)
        ctx.n = n
        if src.dtype == torch.bool:
            ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return None, None, _gather(grad, mask, ctx.n), None


def _scatter(x: torch.Tensor | None, mask: torch.Tensor, n: int) -> torch.Tensor | None:
    if x is None:
        return None
    zeros = x.new_zeros(mask.shape)
    return _MaskScatter.apply(zeros, mask, x, n)


def _reference(hidden, weight, targets, softcap):
    """CPU reference of the per-token statistics (values only, untracked)."""
    z = hidden.float() @ weight.float().t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_z = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, targets[:, None]).squeeze(1) - log_z
    p = torch.softmax(z, dim=-1)
    entropy = log_z - (p * z).sum(-1)
    is_top1 = z.argmax(-1) == targets
    return z, log_z, logp, entropy, is_top1


class _ChunkedLogProb(torch.autograd.Function):
    """``ChunkedLogProbFunction`` (temperature 1, logit scale 1, no bias): log-probabilities and the requested
    ``entropy``, ``mean_logits``, ``is_top1``."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, softcap, outputs):
        ctx.set_materialize_grads(False)
        n, vocab = hidden.shape[0], weight.shape[0]
        cd = _compute_dtype(hidden)
        running_max = hidden.new_full((n,), float("-inf"), dtype=torch.float32)
        sum_exp = hidden.new_zeros((n,), dtype=torch.float32)
        x_sum_exp = hidden.new_zeros((n,), dtype=torch.float32)
        # Locals held, as in TRL, until the Function returns (the allocations are what is modelled).
        sq_sum_exp = hidden.new_zeros((n,), dtype=torch.float32)  # noqa: F841
        z_sum = hidden.new_zeros((n,), dtype=torch.float32)
        max_before_target = hidden.new_full((n,), float("-inf"), dtype=torch.float32)
        target_logit = hidden.new_zeros((n,), dtype=torch.float32)
        mm_buf = hidden.new_empty((min(n, TOKEN_CHUNK_SIZE), VOCAB_CHUNK_SIZE), dtype=cd)  # noqa: F841
        for t0 in range(0, n, TOKEN_CHUNK_SIZE):
            hidden_chunk = hidden[t0:t0 + TOKEN_CHUNK_SIZE].to(cd)  # noqa: F841
            for v0 in range(0, vocab, VOCAB_CHUNK_SIZE):
                w = weight[v0:v0 + VOCAB_CHUNK_SIZE].to(cd)  # torch.mm(hidden_chunk, weight[...].to(cd).t(), out=tile)
                del w  # cuBLAS writes the tile; the Triton fold updates the statistics in place
        # The fold's statistics give these; on real tensors their values are set from the reference below.
        log_z = running_max + torch.log(sum_exp)
        logprobs = target_logit - log_z
        entropy = log_z - x_sum_exp / sum_exp if "entropy" in outputs else None
        mean_logits = z_sum / vocab if "mean_logits" in outputs else None
        is_top1 = (target_logit >= running_max) & (target_logit > max_before_target) if "is_top1" in outputs else None
        if not is_fake(hidden):
            with untracked():
                z, ref_log_z, ref_logp, ref_entropy, ref_top1 = _reference(hidden, weight, targets, softcap)
                log_z.copy_(ref_log_z)
                logprobs.copy_(ref_logp)
                if entropy is not None:
                    entropy.copy_(ref_entropy)
                if mean_logits is not None:
                    mean_logits.copy_(z.mean(-1))
                if is_top1 is not None:
                    is_top1.copy_(ref_top1)
                del z, ref_log_z, ref_logp, ref_entropy, ref_top1
        ctx.save_for_backward(hidden, weight, targets, log_z, log_z if entropy is None else entropy)
        ctx.softcap, ctx.cd = softcap, cd
        ctx.mark_non_differentiable(*(t for t in (mean_logits, is_top1) if t is not None))
        return logprobs, entropy, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden, weight, targets, log_z, entropy = ctx.saved_tensors
        cd = ctx.cd
        n, vocab = hidden.shape[0], weight.shape[0]
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if needs_weight else None
        mm_buf = hidden.new_empty((min(n, TOKEN_CHUNK_SIZE), VOCAB_CHUNK_SIZE), dtype=cd)
        grad_logprobs = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
        grad_entropy = grad_entropy.float().contiguous() if grad_entropy is not None else None
        for t0 in range(0, n, TOKEN_CHUNK_SIZE):
            hidden_chunk = hidden[t0:t0 + TOKEN_CHUNK_SIZE].to(cd)  # noqa: F841 - held to the return, as in TRL
            for v0 in range(0, vocab, VOCAB_CHUNK_SIZE):
                w_chunk = weight[v0:v0 + VOCAB_CHUNK_SIZE].to(cd)  # rebound per tile, as in TRL
                # mm into the tile, the Triton backward fold in place, then the fp32 accumulations:
                # torch.addmm(acc, tile, w_chunk, out_dtype=fp32, out=acc) for 16-bit tiles (no allocation);
                # fp32 tiles take acc.addmm_(a.float(), b.float()), where .float() is a no-op.
                if not _MM_OUT_DTYPE and cd in (torch.float16, torch.bfloat16):
                    # torch < 2.8 has no out_dtype: both operands are upcast for each accumulation
                    tile = mm_buf[:hidden_chunk.shape[0], :w_chunk.shape[0]]
                    for a, b, need in ((tile, w_chunk, needs_hidden), (tile.t(), hidden_chunk, needs_weight)):
                        if need:
                            a32, b32 = a.float(), b.float()
                            del a32, b32
                    del tile
        if not is_fake(hidden):
            with untracked():
                h = hidden.detach().float().requires_grad_(needs_hidden)
                wt = weight.detach().float().requires_grad_(needs_weight)
                with torch.enable_grad():
                    _, _, logp, ent, _ = _reference(h, wt, targets, ctx.softcap)
                    total = (logp * grad_logprobs).sum() if grad_logprobs is not None else 0.0
                    if grad_entropy is not None:
                        total = total + (ent * grad_entropy).sum()
                    wanted = [t for t, need in ((h, needs_hidden), (wt, needs_weight)) if need]
                    grads = list(torch.autograd.grad(total, wanted)) if wanted else []
                if needs_hidden:
                    grad_hidden.copy_(grads.pop(0))
                if needs_weight:
                    grad_weight.copy_(grads.pop(0))
                del h, wt, logp, ent, total, grads
        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
                grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None)


def _valid_count(mask: torch.Tensor) -> int:
    """Labels that count: on real tensors the mask's sum; in a trace every position but the documents' first
    tokens (TRL's padding-free collator sets those to -100; llmem_plugin.techniques.packing)."""
    if not is_fake(mask):
        with untracked():
            return int(mask.sum())
    from llmem_plugin.techniques.packing import documents

    docs = documents()
    starts = 0 if docs is None else len(docs) - 1  # the first document's start is shifted out
    return mask.numel() - starts


def _fused_forward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, softcap: float | None,
                   outputs: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``_fused_forward`` after the backbone: the per-token outputs, scattered back to ``[batch, seq - 1]``
    (``log_probs`` and those in ``outputs``), and the label mask. Its own ``loss`` (``-log_probs.sum()`` over
    the valid count) is computed and dropped, as the trainers read the outputs."""
    hidden_states = hidden[:, :-1]
    labels = labels[:, 1:]
    mask = labels != IGNORE_INDEX
    n = _valid_count(mask)
    x = _MaskGather.apply(hidden_states, mask, n)
    targets = _gather(labels, mask, n)
    stats = _ChunkedLogProb.apply(x, weight, targets, softcap, outputs)
    del x, targets
    names = ("log_probs", "entropy", "mean_logits", "is_top1")
    per_token = {}
    for name, t in zip(names, stats):
        if t is not None:
            per_token[name] = _scatter(t, mask, n)
    del stats, t
    count = mask.sum()
    model_loss = -per_token["log_probs"].sum() / count.clamp(min=1)  # noqa: F841 - returned beside the outputs
    return per_token, mask


def fused_sft_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                   softcap: float | None = None) -> torch.Tensor:
    """SFTTrainer's loss through TRL's fused head on CUDA (the compact path).

    Args:
        hidden: ``(batch, seq, H)`` last hidden states of the backbone.
        weight: ``(V, H)`` the output projection's weight.
        labels: ``(batch, seq)`` unshifted labels, -100 where ignored.
        softcap: The model's final-logit softcap, or None (models that scale their logits are refused).

    Returns:
        ``-sum(log p(target)) / valid tokens``, a scalar fp32 tensor.
    """
    per_token, mask = _fused_forward(hidden, weight, labels, softcap, SFT_OUTPUTS)
    per_token_loss = -per_token["log_probs"]  # SFTTrainer.compute_loss
    loss = per_token_loss.sum() / mask.sum().clamp(min=1)
    del per_token_loss, per_token
    return loss


def fused_dpo_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                   softcap: float | None = None) -> torch.Tensor:
    """DPOTrainer's policy step through TRL's fused head (trl 1.16 dpo_trainer.py ``_compute_loss``).

    The batch is ``[chosen; rejected]`` (2 x pairs rows); the head returns ``DPO_OUTPUTS``; each row's
    log-probabilities are summed, and the sigmoid loss ``-logsigmoid(beta * (chosen - rejected))`` is
    averaged over the pairs. The reference's sums (``llmem_plugin.techniques.reference``) enter that difference in
    TRL; here the reference runs after this forward, so its two ``[pairs]`` differences (512 bytes each)
    are not in this loss.

    Returns:
        The DPO loss, a scalar fp32 tensor.
    """
    per_token, mask = _fused_forward(hidden, weight, labels, softcap, DPO_OUTPUTS)
    logps = per_token["log_probs"][:, -mask.shape[1]:].sum(dim=1)
    chosen, rejected = logps.chunk(2, dim=0)
    delta = chosen - rejected
    per_sequence_loss = -torch.nn.functional.logsigmoid(DPO_BETA * delta)
    loss = per_sequence_loss.mean()
    del per_token, logps, chosen, rejected, delta, per_sequence_loss
    return loss


def fused_sequence_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         softcap: float | None = None, outputs: tuple[str, ...] = ()) -> torch.Tensor:
    """The reference's per-row log-probability sums (DPO, under ``no_grad``): the fused head with
    ``outputs`` (the policy's own when the reference is the policy with its adapters disabled; none for a
    separate reference model, which ``add_fused_lm_head(ref_model)`` patches with its default)."""
    per_token, mask = _fused_forward(hidden, weight, labels, softcap, outputs)
    return per_token["log_probs"][:, -mask.shape[1]:].sum(dim=1)
