"""The language-model loss as low-memory trainers compute it.

``Workload.loss`` picks how the cross-entropy is computed from the last hidden
states; ``Workload.logits_to_keep`` limits the logits to the last tokens. The
model's own loss (``"hf"`` with all tokens) is run by the step directly; this
module runs the others through the real model:

* ``"hf"`` with ``logits_to_keep=k``: the model's own forward with
  ``logits_to_keep=k`` (transformers 5.23 ``LlamaForCausalLM.forward``:
  ``slice_logits_to_keep`` then ``lm_head``), and the model's own
  ``loss_function`` (``loss/loss_utils.py`` ``ForCausalLMLoss``: logits
  ``.float()``, labels padded and shifted, cross-entropy) on the last ``k``
  labels. The last kept position has no next token and is ignored, as in the
  full loss. This is the loss of the last ``k`` positions,
  the completion-only loss TRL computes with ``logits_to_keep``.
* ``"no-upcast"``: the model's own forward without labels (its logits,
  softcapping or scaling included), then ``ForCausalLMLoss``'s steps without
  its ``logits.float()``: labels padded and shifted, ``cross_entropy`` on the
  logits in their own dtype. Trainers that call ``F.cross_entropy`` on bf16
  logits (LitGPT's ``chunked_cross_entropy`` without an lm_head chunk size)
  keep a log-softmax the logits' size, not an fp32 copy and its gradient.
  Works for every causal LM (not with ``output_router_logits``, whose router
  loss the model adds only with labels) and under every method.
* ``"chunked"``: torchtune 0.6.1 ``CEWithChunkedOutputLoss``
  (``torchtune/modules/loss/ce_chunked_output_loss.py``) fed by
  ``TransformerDecoder.chunked_output`` (``torchtune/modules/transformer.py``):
  the last hidden state is split along the sequence, the output projection runs
  per chunk, and each chunk's logits are upcast and reduced in turn. Plain
  torch ops, run as they are. ``loss_chunk_upcast=False`` drops the per-chunk
  ``.float()``. Any causal LM whose forward, read at trace time, applies only
  its output projection, optionally followed by final-logit softcapping
  (Gemma 2/3) or a constant logit scale (Granite, Cohere), is modelled; the
  same transform runs on each chunk.
* ``"cce"``: Cut Cross-Entropy (``cut-cross-entropy`` 25.1.1, see
  :mod:`llmem_plugin.techniques.cce`): no logits at all; any causal LM whose forward
  projects (and optionally softcaps) the last hidden state.
* ``"liger"``: liger-kernel 0.8.5's fused linear cross-entropy
  (``liger_kernel/ops/fused_linear_cross_entropy.py``, driven by
  ``liger_kernel/transformers/model/llama.py`` ``lce_forward`` and
  ``model/loss_utils.py`` ``LigerForCausalLMLoss``). Its Triton kernels cannot
  run here: :class:`_FusedLinearCrossEntropy` performs liger's torch-side
  allocations as liger does and emulates the kernels, which only write into
  existing buffers, by computing their values inside
  :func:`llmem_plugin.trace._pause.untracked`.

The ``"chunked"`` and ``"liger"`` heads replace the causal LM's ``forward``
for the duration of the call (liger's ``apply_liger_kernel_to_*`` patches the
class ``forward`` the same way), so wrappers (peft, DDP) run as usual.

Known limitations:
    * ``"liger"`` covers the architectures in :data:`LIGER_ARCHS` (those with
      an ``lce_forward``); ``"chunked"`` covers the forwards
      :func:`logit_transform` recognises; others raise.
    * ``"chunked"`` and ``"liger"`` cannot be combined with ``logits_to_keep``.
    * liger's RMSNorm, RoPE and SwiGLU kernels (on by default in
      ``apply_liger_kernel_to_*``) are not modelled: the layers run as
      transformers writes them.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from llmem_plugin.trace._pause import untracked
from llmem_plugin.errors import ConfigError
from llmem_plugin.workload import LossImpl, Runner, Workload

__all__ = ["IGNORE_INDEX", "LIGER_ARCHS", "fabric_cast", "forward_with_loss", "liger_chunk_size",
           "liger_fused_linear_cross_entropy", "logit_transform", "unsupported"]

# transformers loss_utils.py ForCausalLMLoss and torchtune CEWithChunkedOutputLoss
# both default ignore_index to -100 (torch.nn.functional.cross_entropy's default).
IGNORE_INDEX = -100

# Architectures with an lce_forward in liger-kernel 0.8.5
# (liger_kernel/transformers/model/{llama,mistral,qwen2,qwen3}.py), each
# `LigerForCausalLMLoss(hidden_states, lm_head.weight, labels, hidden_size)`.
LIGER_ARCHS = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# Methods whose model states are replicated on every rank, so lm_head's full
# weight is a plain tensor when the head runs. Under parameter sharding
# (ZeRO-3, FSDP, Gemini) or tensor parallelism the weight is gathered or split
# by the engine around lm_head's own forward, which liger bypasses (it reads
# `lm_head.weight`) and the chunked head calls once per chunk; neither is
# modelled.
_REPLICATED_METHODS = frozenset({"single", "ddp", "zero1", "zero2", "zero2-offload",
                                 "lowlevel-zero1", "lowlevel-zero2"})


def unsupported(method: str, workload: Workload) -> str | None:
    """Why ``workload``'s loss cannot be estimated under ``method``, or None.

    Args:
        method: ``"single"`` or a name from ``llmem_plugin.methods.method_names()``.
        workload: The workload to check.

    Returns:
        One sentence naming the combination, with a HINT; None if modelled.
    """
    if workload.loss in (LossImpl.HF, LossImpl.NO_UPCAST):
        return None  # the model's own forward computes the logits, under any method
    if workload.logits_to_keep:
        return (f"--loss {workload.loss.value} with --logits-to-keep {workload.logits_to_keep} is not modelled "
                "(neither torchtune's chunked loss nor liger's fused loss takes it). "
                "HINT: use --loss hf with --logits-to-keep, or drop --logits-to-keep")
    if method not in _REPLICATED_METHODS:
        return (f"--loss {workload.loss.value} under '{method}' is not modelled: the engine shards or splits "
                "lm_head's weight around its forward. HINT: use --loss hf with this method, or one of "
                f"{', '.join(sorted(_REPLICATED_METHODS - {'single'}))}")
    return None


def fabric_cast(value):
    """Lightning Fabric's ``precision.convert_output`` (``_FabricModule.forward``,
    Lightning 2.1-2.4 ``fabric/plugins/precision/half.py``, ``bitsandbytes.py``:
    ``apply_to_collection(..., _convert_fp_tensor, dst_type=torch.get_default_dtype())``):
    every floating tensor, nested in lists, tuples and mappings, becomes
    ``tensor.to(torch.float32)`` (itself when already fp32), in a new container of
    the same type; the 16-bit originals go with the old one
    (:attr:`Workload.outputs_to_fp32`, :mod:`llmem_plugin.models.litgpt`)."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float32) if value.is_floating_point() else value
    if isinstance(value, Mapping):
        return type(value)(**{k: fabric_cast(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(fabric_cast(v) for v in value)
    return value


def forward_with_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                      workload: Workload, drop_previous=None,
                      extra: Mapping[str, torch.Tensor] | None = None) -> Mapping[str, torch.Tensor]:
    """Run ``model``'s forward and the workload's loss.

    Called inside the workload's autocast region, as a trainer calls its
    forward and loss.

    Args:
        model: A causal LM, possibly wrapped (peft, DDP).
        input_ids: ``(batch, seq)`` token ids.
        labels: ``(batch, seq)`` labels, unshifted (the loss shifts them).
        workload: Picks the loss (``loss``, ``logits_to_keep``, ``loss_chunks``).
        extra: The batch's other inputs (a packed row's positions and boundaries), passed to the backbone by
            the heads that replace the forward.
        drop_previous: Releases what a plain loop holds of its last micro-step;
            called once the logits exist and before a loss the loop computes on
            them (``no-upcast``, and a ``chunked`` head that returns its chunks).

    Returns:
        The model output, a mapping with ``"loss"`` (and ``"logits"`` where the
        model returns them).

    Raises:
        ConfigError: an architecture or combination that is not modelled.
    """
    causal_lm = _causal_lm(model)
    reason = unsupported("single", workload)
    if reason:
        raise ConfigError(reason)
    if workload.loss is LossImpl.HF:
        return _hf_logits_to_keep(model, causal_lm, input_ids, labels, workload.logits_to_keep)
    arch = causal_lm.config.model_type
    if getattr(causal_lm.config, "output_router_logits", False):
        raise ConfigError(f"--loss {workload.loss.value} with output_router_logits on '{arch}' is not modelled "
                          "(the router loss is added by the model's own forward). HINT: use --loss hf")
    if workload.loss is LossImpl.NO_UPCAST:
        return _no_upcast(model, causal_lm, input_ids, labels, workload.logits_to_keep, workload.outputs_to_fp32,
                          drop_previous)
    if workload.loss is LossImpl.CHUNKED:
        head = _chunked_head(workload.loss_chunks, workload.loss_chunk_upcast, logit_transform(causal_lm),
                             keep_logits=workload.runner is Runner.PLAIN_LOOP, outputs_to_fp32=workload.outputs_to_fp32,
                             drop_previous=drop_previous)
    elif workload.loss is LossImpl.CCE:
        head = _cce_head(causal_lm)
    elif workload.loss is LossImpl.TRL_FUSED:
        head = _trl_head(causal_lm, dpo=workload.reference_model)
    else:
        _check_arch(arch, LIGER_ARCHS, workload.loss)
        head = _liger_head
    with _forward_replaced(causal_lm, head):
        return model(input_ids=input_ids, labels=labels, use_cache=False, **(extra or {}))


def _causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers causal LM inside ``model`` (peft and DDP wrap it; the
    first ``PreTrainedModel`` in module order is the outermost)."""
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            if m.get_output_embeddings() is None:
                raise ConfigError(f"'{type(m).__name__}' has no language-model head; --loss and --logits-to-keep "
                                  "apply to causal LMs. HINT: pass a *ForCausalLM model")
            return m
    raise ConfigError(f"no transformers model inside '{type(model).__name__}'. HINT: build it with llmem's modelbuild")


def _check_arch(arch: str, known: frozenset[str], loss: LossImpl) -> None:
    if arch not in known:
        raise ConfigError(f"--loss {loss.value} is not modelled for architecture '{arch}'; modelled: "
                          f"{', '.join(sorted(known))}. HINT: use --loss hf for this model")


def _next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels shifted by one with the last position ignored, as
    ``ForCausalLMLoss`` builds them: ``pad(labels, (0, 1), -100)[..., 1:]``."""
    return nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def _hf_logits_to_keep(model: nn.Module, causal_lm: PreTrainedModel, input_ids: torch.Tensor,
                       labels: torch.Tensor, keep: int) -> Mapping[str, torch.Tensor]:
    if "logits_to_keep" not in inspect.signature(type(causal_lm).forward).parameters:
        raise ConfigError(f"'{type(causal_lm).__name__}.forward' takes no logits_to_keep. "
                          "HINT: drop --logits-to-keep for this model")
    out = model(input_ids=input_ids, use_cache=False, logits_to_keep=keep)
    # The last k labels, shifted inside ForCausalLMLoss: logits[:, j] (position
    # s-k+j) predicts token s-k+j+1, and the last position is ignored.
    out["loss"] = causal_lm.loss_function(logits=out["logits"], labels=labels[:, -keep:],
                                          vocab_size=causal_lm.config.vocab_size)
    return out


def _no_upcast(model: nn.Module, causal_lm: PreTrainedModel, input_ids: torch.Tensor, labels: torch.Tensor,
               keep: int, outputs_to_fp32: bool = False, drop_previous=None) -> Mapping[str, torch.Tensor]:
    kwargs = {}
    if keep:
        if "logits_to_keep" not in inspect.signature(type(causal_lm).forward).parameters:
            raise ConfigError(f"'{type(causal_lm).__name__}.forward' takes no logits_to_keep. "
                              "HINT: drop --logits-to-keep for this model")
        kwargs["logits_to_keep"] = keep
        labels = labels[:, -keep:]
    out = model(input_ids=input_ids, use_cache=False, **kwargs)
    if outputs_to_fp32:  # the loop's wrapper casts the returned logits before the loop's loss (Fabric)
        out["logits"] = fabric_cast(out["logits"])
    if drop_previous is not None:  # the loop's `outputs = model(...)` returns, before its own loss
        drop_previous()
    logits = out["logits"]
    # ForCausalLMLoss (transformers loss/loss_utils.py) without `logits = logits.float()`:
    # labels padded with ignore_index and shifted, both flattened, mean over the kept labels.
    shift = _next_token_labels(labels)
    out["loss"] = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), shift.view(-1),
                                              ignore_index=IGNORE_INDEX, reduction="mean")
    return out


# The statements a causal LM's forward may run between its output projection
# and its loss for the chunked head to reproduce it per chunk (transformers
# 5.x modeling_<arch>.py): Gemma 2/3's final-logit softcapping, Granite's
# `logits / config.logits_scaling`, Cohere's `logits * self.logit_scale`.
_SOFTCAP = ("if self.config.final_logit_softcapping is not None:",
            "logits = logits / self.config.final_logit_softcapping",
            "logits = torch.tanh(logits)",
            "logits = logits * self.config.final_logit_softcapping")
# The whole statement: the projection of the (optionally sliced) hidden states
# and nothing else on the line (a trailing `* multiplier` or `.float()` fails it).
_HEAD_LINE = re.compile(r"^(\w+) = self\.(lm_head|embed_out)\(hidden_states(\[[^\]]*\])?\)(\.contiguous\(\))?$")
# Before the projection the forward may only take the base model's output
# (`hidden_states = outputs.last_hidden_state` / `outputs[0]`) and slice it to
# the kept positions (transformers 5.24 `slice_logits_to_keep`); any other
# statement that computes hidden_states from itself (MiniCPM3's scaling) is
# not reproduced. OPT's trailing `.contiguous()` copies nothing (the
# projection's output is contiguous).
_SELF_TRANSFORM = re.compile(r"^hidden_states = (?!slice_logits_to_keep\(hidden_states, logits_to_keep\)$).*\bhidden_states\b")


def logit_transform(causal_lm: PreTrainedModel):
    """What ``causal_lm``'s forward does to the output projection's result
    before its loss, as a function of one chunk's logits.

    Read from the class's forward source: the statements after the line that
    calls the output projection on the hidden states, up to ``loss = None``.

    Raises:
        ConfigError: The forward does something else there (or cannot be read).
    """
    cls = type(causal_lm)
    try:
        lines = [ln.split("#")[0].strip() for ln in inspect.getsource(cls.forward).splitlines()]
    except (OSError, TypeError):
        lines = []
    lines = [ln for ln in lines if ln]
    start = next((i for i, ln in enumerate(lines) if _HEAD_LINE.match(ln)), None)
    end = next((i for i, ln in enumerate(lines) if ln == "loss = None"), None)
    if start is None or end is None or end < start:
        raise ConfigError(f"--loss chunked is not modelled for '{cls.__name__}': its forward does not compute "
                          "logits from the output projection in one recognised statement. HINT: use --loss hf "
                          "or --loss no-upcast for this model")
    before = [ln for ln in lines[:start] if _SELF_TRANSFORM.match(ln)]
    if before:
        raise ConfigError(f"--loss chunked is not modelled for '{cls.__name__}': its forward runs {before[0]!r} "
                          "before the output projection. HINT: use --loss hf or --loss no-upcast")
    between = tuple(lines[start + 1:end])
    cfg = causal_lm.config
    if not between:
        return lambda logits: logits
    if between == _SOFTCAP:
        cap = cfg.final_logit_softcapping
        return (lambda logits: logits) if cap is None else (lambda logits: torch.tanh(logits / cap) * cap)
    if between == ("logits = logits / self.config.logits_scaling",):
        return lambda logits: logits / cfg.logits_scaling
    if between == ("logits = logits * self.logit_scale",):
        return lambda logits: logits * causal_lm.logit_scale
    raise ConfigError(f"--loss chunked is not modelled for '{cls.__name__}': its forward runs "
                      f"{between[0]!r} on the logits before the loss. HINT: use --loss hf or --loss no-upcast")


def _chunked_head(num_chunks: int, upcast: bool = True, transform=lambda logits: logits, keep_logits: bool = False,
                  outputs_to_fp32: bool = False, drop_previous=None):
    """The chunked head; ``keep_logits``: the chunks are returned with the loss
    (a model that returns its chunk logits to the loop: litgpt's
    ``GPT.forward(lm_head_chunk_size=...)``), so a loop that keeps its outputs
    keeps them. ``outputs_to_fp32``: the loop's wrapper casts the returned
    chunks to fp32 before the loop's loss runs on them (Lightning Fabric's
    ``convert_output``, :attr:`Workload.outputs_to_fp32`). ``drop_previous``:
    with ``keep_logits``, the loop's last chunks and loss are released once
    the new chunks exist, where litgpt's ``fit()`` rebinds ``logits``."""

    def head(self: PreTrainedModel, hidden: torch.Tensor, labels: torch.Tensor):
        # TransformerDecoder.chunked_output: [output(c) for c in h.chunk(n, dim=1)];
        # every chunk's logits exist before the loss runs. The model's own
        # logit transform (softcapping, scaling) runs on each chunk.
        output = self.get_output_embeddings()
        logits = [transform(output(chunk)) for chunk in hidden.chunk(num_chunks, dim=1)]
        del hidden
        if outputs_to_fp32:  # the wrapper's cast of the returned chunks, before the loop's loss
            logits = fabric_cast(logits)
        if keep_logits and drop_previous is not None:
            drop_previous()  # the loop's `logits = model(...)` returns (the wrapper's cast included)
        # torchtune recipes (full_finetune_single_device.py _loss_step): labels
        # shifted left, a column of ignore_index appended (torch.hstack).
        ignore = torch.full((labels.shape[0], 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
        labels = torch.hstack((labels[..., 1:], ignore))
        # CEWithChunkedOutputLoss.forward: sum of per-chunk cross-entropies
        # (logits.float(), reduction="sum") over the count of non-ignored labels.
        total_elements = (labels != IGNORE_INDEX).sum()
        label_chunks = [c.reshape(-1) for c in labels.chunk(num_chunks, dim=1)]
        logits = [c.reshape(-1, c.size(-1)) for c in logits]
        total_loss = 0.0
        for logits_chunk, labels_chunk in zip(logits, label_chunks):
            total_loss += nn.functional.cross_entropy(logits_chunk.float() if upcast else logits_chunk, labels_chunk,
                                                      ignore_index=IGNORE_INDEX, reduction="sum")
        if keep_logits:
            return total_loss / total_elements, tuple(logits)
        return total_loss / total_elements

    return head


@contextlib.contextmanager
def _forward_replaced(causal_lm: PreTrainedModel, head) -> Iterator[None]:
    """Give ``causal_lm`` a forward that runs its base model and then ``head``
    on the last hidden state (an instance attribute, so ``__call__`` and every
    wrapper reach it); the class forward is back on exit."""
    base = getattr(causal_lm, causal_lm.base_model_prefix)

    def forward(input_ids=None, labels=None, use_cache=None, **kwargs):
        # Wrappers pass their own keywords (peft: attention_mask, inputs_embeds,
        # output_attentions, ...); the base model takes them as the class forward does.
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        # The last hidden state goes straight to the head, which owns the only reference: the chunked head
        # releases it once its projections ran, as a model whose forward returns the chunk logits does
        # (torchtune's, litgpt's) before the loss runs.
        result = head(causal_lm, base(input_ids=input_ids, use_cache=use_cache, **kwargs)[0], labels)
        loss, logits = result if isinstance(result, tuple) else (result, None)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    previous = causal_lm.__dict__.get("forward")  # an instance-level forward someone else installed
    causal_lm.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del causal_lm.forward
        else:
            causal_lm.forward = previous


# ----------------------------------------------------------------------------- cut cross-entropy


def _projection_only(causal_lm: PreTrainedModel, loss: str) -> float | None:
    """The final-logit softcap of a model whose forward only projects (and softcaps) the last hidden state, as
    the fused heads (cut-cross-entropy's, TRL's) read it; others raise."""
    try:
        logit_transform(causal_lm)  # only its projection, or softcapping, or a logit scale
    except ConfigError:
        raise ConfigError(f"--loss {loss} is not modelled for '{type(causal_lm).__name__}': its forward does more "
                          "to the logits than project and softcap them. HINT: use --loss hf") from None
    cfg = causal_lm.config
    if getattr(cfg, "logits_scaling", None) not in (None, 1, 1.0) or hasattr(causal_lm, "logit_scale"):
        raise ConfigError(f"--loss {loss} is not modelled for '{type(causal_lm).__name__}', which scales its "
                          "logits. HINT: use --loss hf")
    return getattr(cfg, "final_logit_softcapping", None)


def _head_weight(causal_lm: PreTrainedModel, loss: str) -> torch.Tensor:
    """``lm_head.weight`` of a plain bias-free ``nn.Linear``, which the fused heads multiply by themselves."""
    lm_head = causal_lm.get_output_embeddings()
    if type(lm_head) is not nn.Linear or lm_head.bias is not None:
        raise ConfigError(f"--loss {loss} reads lm_head.weight of a plain bias-free nn.Linear; this model's head is "
                          f"'{type(lm_head).__name__}'. HINT: leave lm_head out of --lora-targets, or use --loss hf")
    return lm_head.weight


def _cce_head(causal_lm: PreTrainedModel):
    """The ``cut_cross_entropy.transformers`` patched forward after the base model:
    ``linear_cross_entropy(hidden, lm_head.weight, labels, shift=True, softcap=...)``."""
    softcap = _projection_only(causal_lm, "cce")

    def head(self: PreTrainedModel, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from llmem_plugin.techniques.cce import cce_loss

        return cce_loss(hidden, _head_weight(self, "cce"), labels, softcap)

    return head


# ----------------------------------------------------------------------------- TRL's fused head


def _trl_head(causal_lm: PreTrainedModel, *, dpo: bool = False):
    """TRL 1.16 ``_fused_forward`` after the backbone, with SFTTrainer's loss, or DPOTrainer's when the
    step runs a reference model (:mod:`llmem_plugin.techniques.trl_head`); TRL itself refuses a LoRA on ``lm_head``."""
    softcap = _projection_only(causal_lm, "trl-fused")

    def head(self: PreTrainedModel, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from llmem_plugin.techniques.trl_head import fused_dpo_loss, fused_sft_loss

        loss = fused_dpo_loss if dpo else fused_sft_loss
        return loss(hidden, _head_weight(self, "trl-fused"), labels, softcap=softcap)

    return head


def trl_reference_head(causal_lm: PreTrainedModel, outputs: tuple[str, ...]):
    """The reference's fused head for DPO: per-row log-probability sums (:func:`llmem_plugin.techniques.trl_head.fused_sequence_logps`)."""
    softcap = _projection_only(causal_lm, "trl-fused")

    def head(self: PreTrainedModel, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from llmem_plugin.techniques.trl_head import fused_sequence_logps

        return fused_sequence_logps(hidden, _head_weight(self, "trl-fused"), labels, softcap=softcap, outputs=outputs)

    return head


# ----------------------------------------------------------------------------- liger


def liger_chunk_size(num_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Rows of logits liger materializes at once.

    fused_linear_cross_entropy.py (0.8.5, ``chunk_mem_const=1``):
    ``inc_factor = cdiv(V, H)``, ``chunk_size = next_power_of_2(cdiv(BT, inc_factor))``,
    capped at ``BT``, so one chunk's logits are about ``BT x H`` elements.

    Args:
        num_tokens: ``BT``, rows of the flattened hidden states.
        hidden_size: ``H``.
        vocab_size: ``V``, rows of the output projection.

    Returns:
        The chunk size in rows.
    """
    inc_factor = -(-vocab_size // hidden_size)
    rows = -(-num_tokens // inc_factor)
    return min(1 << (rows - 1).bit_length(), num_tokens)


def _mm_out(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """liger's ``_can_use_mm_out`` inside its forward (grad mode is off there):
    ``torch.mm(out=)`` into preallocated buffers when the operands share a
    float dtype that autocast, if on, would not change."""
    if x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    # The trace runs CUDA's autocast policy on the CPU autocast state.
    if torch.is_autocast_enabled("cpu"):
        return x.dtype == torch.get_autocast_dtype("cpu")
    return True


def _ce_kernel(logits: torch.Tensor, target: torch.Tensor, loss_out: torch.Tensor, n_valid: int,
               with_grad: bool) -> None:
    """``liger_cross_entropy_kernel`` (ops/cross_entropy.py, reduction="mean"):
    per row ``loss = (lse - x_y) / n_valid`` into ``loss_out``, and the
    gradient ``(softmax(x) - onehot(y)) / n_valid`` over ``logits`` in place;
    ignored rows get zero loss and zero gradient. Allocates nothing on the GPU."""
    with untracked():
        if is_fake(logits):
            return
        x = logits.float()
        valid = target != IGNORE_INDEX
        safe = torch.where(valid, target, torch.zeros_like(target))
        lse = torch.logsumexp(x, dim=-1)
        picked = x.gather(1, safe[:, None])[:, 0]
        loss_out.copy_(torch.where(valid, (lse - picked) / n_valid, torch.zeros_like(lse)))
        if with_grad:
            grad = torch.softmax(x, dim=-1)
            grad[torch.arange(len(safe)), safe] -= 1.0
            logits.copy_(grad / n_valid * valid[:, None])


def _compute_capability() -> tuple[int, int]:
    # The GPU the trace emulates (set by cuda_emulation through patch_sdpa).
    from llmem_plugin.trace.emulation import sdpa

    return sdpa._active_target.compute_capability


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """liger's ``LigerFusedLinearCrossEntropyFunction`` with reduction "mean",
    no bias, class weights, smoothing, softcap or z-loss (as ``lce_forward``
    calls it). Forward computes the loss and both gradients chunk by chunk and
    keeps the gradients; backward scales them in place."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        num_tokens, hidden_size = x.shape
        chunk = liger_chunk_size(num_tokens, hidden_size, weight.shape[0])
        with_grad = x.requires_grad
        # accum_dtype=None: the accumulators take the parameter's dtype.
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight) if with_grad and weight.requires_grad else None
        loss_1d = torch.zeros(num_tokens, dtype=torch.float32, device=x.device)
        n_valid = (target != IGNORE_INDEX).sum().item()
        use_mm_out = _mm_out(x, weight)
        logits_buffer = torch.empty((chunk, weight.shape[0]), dtype=x.dtype, device=x.device) if use_mm_out else None
        sm80 = _compute_capability()[0] >= 8
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            x_chunk = x[start:end]
            if logits_buffer is not None:
                logits = logits_buffer[: end - start]
                torch.mm(x_chunk, weight.t(), out=logits)
            else:
                logits = x_chunk @ weight.t()
            _ce_kernel(logits, target[start:end], loss_1d[start:end], n_valid, with_grad)
            grad_logits = logits  # the kernel left the gradient in the logits
            del logits
            if with_grad:
                if use_mm_out and grad_logits.dtype == grad_input.dtype:
                    torch.mm(grad_logits, weight, out=grad_input[start:end])
                else:
                    grad_input[start:end] = grad_logits @ weight
            if grad_weight is not None:
                _accumulate_grad_weight(grad_weight, grad_logits, x_chunk, sm80)
            del grad_logits, x_chunk
        del logits_buffer
        loss = torch.sum(loss_1d)
        ctx.save_for_backward(grad_input.detach(), None if grad_weight is None else grad_weight.detach())
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_input, grad_weight = ctx.saved_tensors
        # fused_linear_cross_entropy_backward: torch.equal(grad_output,
        # torch.tensor(1.0, device=...)) allocates a device scalar; the scaling
        # (element_mul_kernel) is in place.
        one = torch.ones((), dtype=torch.float32, device=grad_output.device)
        with untracked():
            if not is_fake(grad_output) and not torch.equal(grad_output, one):
                grad_input.mul_(grad_output)
                if grad_weight is not None:
                    grad_weight.mul_(grad_output)
        del one
        return grad_input, grad_weight, None


def liger_fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``x @ weight.T`` against ``target``, allocating what
    liger's ``LigerFusedLinearCrossEntropyFunction`` allocates on CUDA.

    Args:
        x: ``(BT, H)`` hidden states.
        weight: ``(V, H)`` output projection.
        target: ``(BT,)`` class ids, ``IGNORE_INDEX`` where ignored.

    Returns:
        The scalar fp32 loss; its backward yields liger's gradients.
    """
    return _FusedLinearCrossEntropy.apply(x, weight, target)


def _accumulate_grad_weight(grad_weight: torch.Tensor, grad_logits: torch.Tensor, x_chunk: torch.Tensor,
                            sm80: bool) -> None:
    """``grad_weight += grad_logits.T @ x_chunk`` along liger's three paths."""
    low = (torch.float16, torch.bfloat16)
    if sm80 and grad_logits.dtype in low and grad_weight.dtype in (torch.float32, grad_logits.dtype):
        # torch.addmm(..., out=grad_weight) (out_dtype=fp32 for an fp32
        # accumulator): in place, after casting the input chunk to the logits' dtype.
        x_low = x_chunk if x_chunk.dtype == grad_logits.dtype else x_chunk.to(grad_logits.dtype)
        with untracked():
            if not is_fake(grad_weight):
                grad_weight.add_((grad_logits.t().float() @ x_low.float()).to(grad_weight.dtype))
        del x_low
    else:
        # Legacy path: a (V, H) product, upcast, then added.
        grad_weight += torch.mm(grad_logits.t(), x_chunk).float()


def _liger_head(self: PreTrainedModel, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``lce_forward`` after the base model: ``LigerForCausalLMLoss`` on the
    whole sequence (``logits_to_keep=0``)."""
    lm_head = self.get_output_embeddings()
    if type(lm_head) is not nn.Linear or lm_head.bias is not None:
        raise ConfigError(f"--loss liger reads lm_head.weight of a plain bias-free nn.Linear; this model's head is "
                          f"'{type(lm_head).__name__}'. HINT: leave lm_head out of --lora-targets, or use --loss hf")
    shift_labels = _next_token_labels(labels)
    x = hidden.view(-1, self.config.hidden_size)
    return liger_fused_linear_cross_entropy(x, lm_head.weight, shift_labels.view(-1))
