"""The real libraries behind the low-memory techniques, for the ground-truth runs.

The estimator traces stand-ins for bitsandbytes layers and optimizers,
flash-attn and liger-kernel; a ground-truth run must use the real thing, so
the CUDA worker builds and trains through this module instead:

* ``quantize``: random weights in the compute dtype, the linears replaced as
  transformers' bitsandbytes integration does (``replace_with_bnb_linear``
  with a ``BitsAndBytesConfig``, skipping what ``get_keys_to_not_convert``
  names), quantized by moving each weight to the device (``Params4bit`` /
  ``Int8Params``), then the QLoRA recipe: ``peft.prepare_model_for_kbit_training``
  and ``get_peft_model``.
* bitsandbytes optimizers: ``bitsandbytes.optim.AdamW8bit``, ``PagedAdamW``,
  ``PagedAdamW8bit``.
* ``flash_attention_2``: the flash-attn package through transformers.
* ``loss="liger"``: liger-kernel's fused linear cross-entropy patched into the
  architecture's CausalLM forward; ``loss="chunked"``: a plain-torch chunked
  cross-entropy with torchtune's semantics; ``logits_to_keep``: passed to the model.
* ``offload_activations``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
  or TRL's ``get_act_offloading_ctx_manager`` ("streamed").
* ``reference_model``: a DPO-style reference forward under ``no_grad``.

A library that is not installed raises :class:`Skipped`; the worker writes the
row with status "skipped" and the reason.

Known limitations:
    * liger patches the architecture's class for the whole process: fine in a
      per-case worker, not in a process that builds several models.
    * The reference log-probs use the plain-torch fallback of TRL's
      ``selective_log_softmax`` (TRL 1.16 uses a triton kernel when it can).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
from collections.abc import Callable

from llmem_plugin.workload import (
    ActivationOffload,
    AttentionImpl,
    LossImpl,
    OptimizerKind,
    Quantization,
    Workload,
)

__all__ = ["Skipped", "build_model", "forward_loss", "make_optimizer", "offload_factory", "reference_forward"]

# HF Trainer's default learning rate (TrainingArguments.learning_rate), as llmem_plugin.trace.step.
_LR = 5e-5
# torchtune CEWithChunkedOutputLoss(ignore_index=-100) (torchtune/modules/loss/ce_chunked_output_loss.py, 0.6.1);
# also the ignore index of transformers' ForCausalLMLoss (transformers/loss/loss_utils.py).
_IGNORE = -100
_WHEELS = "HINT: carry its wheel (benchmarks/groundtruth/README.md, 'Wheels')"


class Skipped(Exception):
    """The case needs a library this machine lacks; the row's status is "skipped"."""


def _require(module: str, why: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:  # also a missing dependency of the package (e.g. triton for liger)
        raise Skipped(f"{why} needs the '{module}' package, which does not import here ({e}). {_WHEELS}") from None


def _compute_dtype(wl: Workload):
    # QLoRA: bnb_4bit_compute_dtype is the dtype the step computes in.
    return wl.precision.autocast_dtype or wl.precision.param_dtype


def build_model(case, *, device: str):
    """The model ``case`` trains, built with the real libraries its workload names.

    Args:
        case: A ``matrix.Case``.
        device: "cuda" (the worker) or "cpu" (the tests).

    Returns:
        The model, in train mode, on ``device``.

    Raises:
        Skipped: A library the workload needs is not installed.
    """
    from llmem_plugin.models import modelbuild

    wl = case.workload
    if wl.loss is LossImpl.LIGER:
        _patch_liger(case.config().model_type)
    if wl.quantize is not None:
        return _build_quantized(case, device=device)
    if wl.attn_implementation is not AttentionImpl.FLASH_ATTENTION_2:
        return modelbuild.build_model(case.config(), wl, device=device)
    # modelbuild picks the estimator's flash emulation for this name; the real
    # run builds with SDPA and switches to the flash-attn package, which
    # set_attn_implementation checks for (transformers modeling_utils.py, 5.17 and 5.23).
    _require("flash_attn", "attn_implementation flash_attention_2")
    model = modelbuild.build_model(case.config(), dataclasses.replace(wl, attn_implementation="sdpa"), device=device)
    model.set_attn_implementation("flash_attention_2")
    return model


def _patch_liger(model_type: str) -> None:
    liger = _require("liger_kernel.transformers", "loss liger")
    apply = getattr(liger, f"apply_liger_kernel_to_{model_type}", None)
    if apply is None:
        raise Skipped(f"liger-kernel has no apply_liger_kernel_to_{model_type}. HINT: use a model it supports")
    # Only the fused linear cross-entropy: the estimator models no other liger kernel.
    apply(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=False, swiglu=False)


def _bnb_config(wl: Workload):
    import transformers

    if wl.quantize is Quantization.INT8:
        return transformers.BitsAndBytesConfig(load_in_8bit=True)  # llm_int8_threshold 6.0 (its default)
    return transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=wl.quantize.value, bnb_4bit_use_double_quant=wl.double_quant,
        bnb_4bit_compute_dtype=_compute_dtype(wl))


def _not_converted(model) -> list[str]:
    """The modules a quantizer leaves in the model's dtype: transformers/quantizers/quantizer_bnb_4bit.py
    (_8bit.py) ``_process_model_before_weight_loading``; torchtune leaves the same (the output projection)."""
    from transformers.quantizers.base import get_keys_to_not_convert

    return list(set(get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or [])))


def _build_torchao(case, *, device: str):
    """torchtune's QLoRA: the model in its dtype, every linear layer transformers would quantize
    replaced by torchtune's ``FrozenNF4Linear`` form (an ``nn.Linear`` whose weight is torchao's
    ``NF4Tensor`` and whose forward is ``linear_nf4``), then LoRA as the recipe adds it."""
    from torch import nn
    from transformers.quantizers.quantizers_utils import should_convert_module

    from llmem_plugin.models import modelbuild

    ao = _require("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "quantize nf4-torchao")

    class FrozenNF4Linear(nn.Linear):  # torchtune/modules/low_precision/nf4_linear.py
        def __init__(self, linear: nn.Linear) -> None:
            nn.Module.__init__(self)
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.weight = nn.Parameter(ao.to_nf4(linear.weight.data), requires_grad=False)
            self.bias = None

        def forward(self, x):
            return ao.linear_nf4(input=x, weight=self.weight)

    wl = case.workload
    plain = dataclasses.replace(wl, quantize=None, kbit_prepare="on", lora=None, grad_checkpointing=False)
    model = modelbuild.build_model(case.config(), plain, device=device)
    skip = _not_converted(model)
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and should_convert_module(name, skip):
            model.set_submodule(name, FrozenNF4Linear(module))
    return _prepare_kbit(model, wl)


def _build_quantized(case, *, device: str):
    """QLoRA as ``from_pretrained(quantization_config=...)`` plus the peft recipe builds it."""
    import torch
    from torch import nn

    if case.workload.quantize is Quantization.NF4_TORCHAO:
        return _build_torchao(case, device=device)
    bnb = _require("bitsandbytes", f"quantize {case.workload.quantize.value}")
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.pytorch_utils import Conv1D

    from llmem_plugin.models import modelbuild

    wl = case.workload
    # The checkpoint's weights in the compute dtype (from_pretrained(dtype=bf16) in the QLoRA recipe);
    # built in bf16 directly when that is the compute dtype, so no fp32 copy ever exists.
    compute = _compute_dtype(wl)
    plain = dataclasses.replace(wl, quantize=None, double_quant=False, kbit_prepare="on", lora=None,
                                grad_checkpointing=False,
                                precision="bf16" if compute == torch.bfloat16 else wl.precision)
    model = _to_loaded_dtype(modelbuild.build_model(case.config(), plain, device=device), compute)
    originals = {name: m for name, m in model.named_modules() if type(m) is nn.Linear or isinstance(m, Conv1D)}
    skip = _not_converted(model)
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=_bnb_config(wl))
    for name, module in model.named_modules():
        old = originals.get(name)
        if old is None or old is module:
            continue
        weight = old.weight.data.T if isinstance(old, Conv1D) else old.weight.data
        kwargs = dict(module.weight.__dict__)
        # transformers/integrations/bitsandbytes.py Bnb4bitQuantize / Bnb8bitQuantize: quantized on the move.
        if wl.quantize is Quantization.INT8:
            kwargs.pop("SCB", None)
            module.weight = bnb.nn.Int8Params(weight.to("cpu"), requires_grad=False, **kwargs).to(device)
        else:
            module.weight = bnb.nn.Params4bit(weight, requires_grad=False, **kwargs).to(device)
        if old.bias is not None:
            module.bias = nn.Parameter(old.bias.data, requires_grad=False)
        originals[name] = None  # drop the compute-dtype weight now
    del originals
    # transformers quantizer _process_model_after_weight_loading; peft reads it.
    setattr(model, "is_loaded_in_8bit" if wl.quantize is Quantization.INT8 else "is_loaded_in_4bit", True)
    model = _prepare_kbit(model, wl)
    if torch.cuda.is_available() and device == "cuda":
        torch.cuda.empty_cache()
    return model


def _to_loaded_dtype(model, dtype):
    """The model as ``from_pretrained(dtype=...)`` leaves it: parameters and persistent buffers in
    ``dtype``; the buffers ``__init__`` computes and never saves (a rotary ``inv_freq``, built in fp32
    by transformers' rope init) keep their dtype, which ``Module.to(dtype)`` would change."""
    kept = {}
    for module in model.modules():
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
            if buf is not None:
                kept[(module, name)] = buf
    model.to(dtype)
    for (module, name), buf in kept.items():
        module._buffers[name] = buf
    return model


def _prepare_kbit(model, wl: Workload):
    import warnings

    import peft

    if wl.kbit_prepare == "on":
        # peft/utils/other.py prepare_model_for_kbit_training (0.21): freezes everything, casts every fp16/bf16
        # parameter that is not Params4bit to fp32, and (use_gradient_checkpointing) turns checkpointing on.
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=wl.grad_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    else:  # the recipe skips it: everything frozen in its own dtype, checkpointing as configured
        for p in model.parameters():
            p.requires_grad_(False)
        if wl.grad_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    spec = wl.lora
    targets = "all-linear" if spec.target_modules == ("all-linear",) else list(spec.target_modules)
    cfg = peft.LoraConfig(r=spec.rank, lora_alpha=spec.lora_alpha, lora_dropout=spec.dropout,
                          target_modules=targets, task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(model, cfg, autocast_adapter_dtype=spec.adapter_dtype == "fp32")
    if spec.adapter_dtype == "base":  # adapters made in the model's dtype, as litgpt makes them
        from llmem_plugin.models.modelbuild import adapters_to

        adapters_to(model, wl.precision.param_dtype)
    model.train()
    return model


def make_optimizer(params, kind: OptimizerKind):
    """The real optimizer for ``kind``: bitsandbytes' for its kinds, else ``llmem_plugin.trace.step``'s.

    Raises:
        Skipped: bitsandbytes is not installed.
    """
    if not kind.is_bitsandbytes:
        from llmem_plugin.trace.step import make_optimizer as torch_optimizer

        return torch_optimizer(params, kind)
    bnb = _require("bitsandbytes", f"optimizer {kind.value}")
    cls = {OptimizerKind.ADAMW_8BIT: bnb.optim.AdamW8bit, OptimizerKind.PAGED_ADAMW: bnb.optim.PagedAdamW,
           OptimizerKind.PAGED_ADAMW_8BIT: bnb.optim.PagedAdamW8bit}[kind]
    return cls(list(params), lr=_LR)  # every other setting at its bitsandbytes default


def _causal_lm(model):
    """The transformers CausalLM inside a peft wrapper (LoRA layers stay injected)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def chunked_loss(model, input_ids, labels, num_chunks: int, upcast: bool = True, hold: list | None = None,
                 release=None):
    """torchtune's chunked-output cross-entropy on ``model``'s last hidden states.

    torchtune 0.6.1: ``TransformerDecoder.chunked_output`` runs the output
    projection on ``hidden.chunk(num_chunks, dim=1)`` (all chunks' logits are
    kept, in the compute dtype) and ``CEWithChunkedOutputLoss`` upcasts one
    chunk at a time (``logits.float()``), sums the per-chunk
    ``cross_entropy(reduction="sum")`` and divides by the number of labelled
    tokens. Labels are shifted left with an ignored last position, as
    torchtune's recipes do before the loss. ``upcast=False`` keeps each
    chunk in the compute dtype. ``hold``: a list the chunk logits are put in,
    for a loop that keeps what the model returned (litgpt's
    ``lm_head_chunk_size`` forward returns them).

    Returns:
        The scalar loss.
    """
    import torch
    import torch.nn.functional as F

    lm = _causal_lm(model)
    cfg = lm.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logits_scaling", None) \
            or getattr(cfg, "logit_scale", None):
        # The estimator applies the model's own logit transform per chunk; this plain-torch path does not.
        raise ValueError(f"loss chunked on {cfg.model_type} (softcapped or scaled logits) is not a ground-truth path")
    hidden = lm.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
    head = lm.get_output_embeddings()
    chunks = [head(h) for h in hidden.chunk(num_chunks, dim=1)]
    if hold is not None:
        hold.extend(chunks)
    del hidden
    if release is not None:  # the loop rebinds its `logits` here, before its own loss (litgpt's fit)
        release()
    shifted = F.pad(labels[:, 1:], (0, 1), value=_IGNORE)
    # CEWithChunkedOutputLoss.forward counts the labelled tokens before the chunk loop.
    total_elements = (shifted != _IGNORE).sum()
    total = torch.zeros((), device=input_ids.device)
    for logits, target in zip(chunks, shifted.chunk(num_chunks, dim=1), strict=True):
        flat = logits.reshape(-1, logits.size(-1))
        total = total + F.cross_entropy(flat.float() if upcast else flat, target.reshape(-1),
                                        ignore_index=_IGNORE, reduction="sum")
    return total / total_elements


def no_upcast_loss(model, input_ids, labels, keep: int = 0, hold: list | None = None, release=None):
    """Cross-entropy on the model's logits in their own dtype (no ``.float()``).

    The model's forward without labels (``logits_to_keep=keep`` when
    ``keep``), labels padded with the ignore index and shifted left, mean
    ``F.cross_entropy`` over the labelled tokens: transformers'
    ``ForCausalLMLoss`` without its upcast, as trainers that call
    ``F.cross_entropy`` on bf16 logits do.

    Returns:
        The scalar loss.
    """
    import torch.nn.functional as F

    kwargs = {"logits_to_keep": keep} if keep else {}
    out = model(input_ids=input_ids, use_cache=False, **kwargs)
    if hold is not None:
        hold.append(out)
    if release is not None:  # the loop rebinds its `outputs` here, before its own loss
        release()
    logits = out.logits
    if keep:
        labels = labels[:, -keep:]
    shifted = F.pad(labels, (0, 1), value=_IGNORE)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), shifted.reshape(-1), ignore_index=_IGNORE)


def forward_loss(model, input_ids, labels, wl: Workload, extra: dict | None = None, hold: list | None = None,
                 release=None):
    """The forward with the workload's loss (call it inside the workload's autocast).
    ``extra``: the task's other inputs (a vision-language model's images).
    ``hold``: a list that gets what the model returned (its output, or the
    chunk logits), for a loop that keeps it (``runner="plain-loop"``).
    ``release``: called once the model's outputs exist, where such a loop
    rebinds its name for them (releasing the last micro-step's), before a
    loss the loop computes itself.

    ``loss="hf"`` and ``"liger"`` are the model's own forward with labels (liger
    patched the forward in :func:`build_model`). ``logits_to_keep=k`` passes
    ``k`` to the model and scores the last ``k`` positions with the model's
    own ``loss_function`` (transformers/loss/loss_utils.py ForCausalLMLoss:
    fp32 upcast, labels shifted inside).

    Returns:
        The scalar loss.
    """
    if wl.outputs_to_fp32:
        raise ValueError("outputs_to_fp32 (Lightning Fabric's output cast) is not a ground-truth path here; "
                         "benchmarks/published/litgpt_stub.py runs it in litgpt's own loop")
    if wl.loss is LossImpl.CHUNKED:
        if wl.logits_to_keep:
            raise ValueError("loss chunked with logits_to_keep is not a ground-truth path")
        return chunked_loss(model, input_ids, labels, wl.loss_chunks, wl.loss_chunk_upcast, hold, release)
    if wl.loss is LossImpl.NO_UPCAST:
        return no_upcast_loss(model, input_ids, labels, wl.logits_to_keep, hold, release)
    if hold is not None and (wl.loss is not LossImpl.HF or wl.logits_to_keep):
        raise ValueError(f"a plain loop with loss {wl.loss.value} (or logits_to_keep) is not a ground-truth path")
    if wl.loss is LossImpl.CCE:
        return cce_loss(model, input_ids, labels)
    if not wl.logits_to_keep:
        out = model(input_ids=input_ids, labels=labels, use_cache=False, **(extra or {}))
        if hold is not None:
            hold.append(out)
        if release is not None:  # `outputs = model(...)`: the last step's outputs go
            release()
        return out.loss
    if wl.loss is LossImpl.LIGER:
        raise ValueError("loss liger with logits_to_keep is not a ground-truth path")
    k = wl.logits_to_keep
    lm = _causal_lm(model)
    logits = model(input_ids=input_ids, logits_to_keep=k, use_cache=False).logits
    return lm.loss_function(logits=logits, labels=labels[:, -k:], vocab_size=lm.config.get_text_config().vocab_size)


def cce_loss(model, input_ids, labels):
    """Cut Cross-Entropy as its transformers patches call it: the base model's last hidden state,
    ``linear_cross_entropy(hidden, lm_head.weight, labels, shift=True)`` with the package's defaults."""
    cce = _require("cut_cross_entropy", "loss cce")
    lm = _causal_lm(model)
    hidden = getattr(lm, lm.base_model_prefix)(input_ids=input_ids, use_cache=False)[0]
    softcap = getattr(lm.config, "final_logit_softcapping", None)
    return cce.linear_cross_entropy(hidden, lm.get_output_embeddings().weight, labels, shift=True, softcap=softcap)


def offload_factory(model, wl: Workload) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context entered around each micro-batch's forward and backward.

    Raises:
        Skipped: "streamed" without TRL.
    """
    import torch

    if wl.offload_activations is None:
        return contextlib.nullcontext
    if wl.offload_activations is ActivationOffload.SAVE_ON_CPU:
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    trl = _require("trl.models.activation_offloading", "offload_activations streamed")
    # TRL's SFTTrainer builds one context in __init__ and enters it every training step (its defaults:
    # pinned memory, streams, min_offload_size 1024 B, max_fwd_stash_size 5).
    ctx = trl.get_act_offloading_ctx_manager(model)
    return lambda: ctx


def sequence_logps(logits, input_ids):
    """Per-sequence sums of next-token log-probabilities (DPO's reference log-probs).

    TRL's ``selective_log_softmax`` without its triton kernel (trl/trainer/utils.py,
    1.16): fp32 logits use gather minus a per-row ``logsumexp``; half-precision
    logits a per-row ``log_softmax`` then gather, looping over rows to bound the transient.
    """
    import torch

    logits, target = logits[:, :-1], input_ids[:, 1:].unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        per_token = torch.gather(logits, -1, target).squeeze(-1) - lse
    else:
        per_token = torch.stack([torch.log_softmax(row, dim=-1).gather(-1, t).squeeze(-1)
                                 for row, t in zip(logits, target, strict=True)])
    return per_token.sum(-1)


def reference_forward(model, wl: Workload) -> Callable | None:
    """The frozen reference's forward for ``wl.reference_model``, or None.

    With LoRA the policy itself with its adapters disabled (peft
    ``disable_adapter``); otherwise a frozen copy of the policy in its
    parameter dtype, in eval mode, made here (so its weights are resident
    before the peaks are reset). Call the result inside the workload's
    autocast with each micro-batch's input ids, before the policy forward.
    """
    import torch

    if not wl.reference_model:
        return None
    if wl.lora is not None:
        def forward(input_ids):
            with torch.no_grad(), model.disable_adapter():
                return sequence_logps(model(input_ids=input_ids, use_cache=False).logits, input_ids)
        return forward
    # TRL's create_reference_model: a deep copy, eval mode, every parameter frozen.
    ref = copy.deepcopy(model).eval().requires_grad_(False)

    def forward_copy(input_ids):
        with torch.no_grad():
            return sequence_logps(ref(input_ids=input_ids, use_cache=False).logits, input_ids)
    forward_copy.model = ref
    return forward_copy
