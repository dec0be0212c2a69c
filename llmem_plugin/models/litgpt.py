"""litgpt's own models and training loop, traced as litgpt runs them.

A litgpt job (``litgpt finetune lora`` / ``litgpt finetune full``) trains
litgpt's ``GPT`` class, not transformers': its attention computes q, k and v
with one fused linear and keeps that output whole (v is a view of it), its
LoRA adapters on the fused projection zero-pad their product to the qkv
width, and its loop computes the loss itself. The model source
``litgpt:NAME`` (a litgpt config name, ``litgpt:Llama-2-7b-hf``, or the Hub id
its config table lists, ``litgpt:meta-llama/Llama-2-7b-hf``) builds that
class from litgpt's own config table (``litgpt.Config.from_name``: no
download), or ``litgpt:DIR`` from a checkpoint directory's
``model_config.yaml`` (``Config.from_file``), and traces the step of litgpt
0.4.13's scripts:

* the model is created as ``fabric.init_module()`` creates it under a
  ``*-true`` precision: every parameter, LoRA's included, in the precision's
  dtype; with LoRA, ``mark_only_lora_as_trainable`` freezes the rest
  (``litgpt/finetune/lora.py`` ``main``);
* ``fit()`` sets ``model.max_seq_length`` to the longest sample, which
  rebuilds the RoPE cache at that length (``GPT.max_seq_length``'s setter);
  the traced samples are ``seq_len`` tokens, so the cache has ``seq_len`` rows;
* LoRA (``finetune/lora.py`` ``fit``): ``logits = model(input_ids,
  lm_head_chunk_size=128)``, then ``logits[-1] = logits[-1][..., :-1, :]`` and
  ``chunked_cross_entropy(logits, targets[..., 1:])``, one cross-entropy per
  head chunk; full (``finetune/full.py`` ``fit``): ``logits =
  model(input_ids)``, ``chunked_cross_entropy(logits[..., :-1, :],
  targets[..., 1:])``, which flattens the sliced logits (a copy) and runs one
  cross-entropy per 128 rows;
* both loops call the model through Lightning Fabric, whose ``_FabricModule``
  returns the outputs cast to fp32 (``convert_output``, see
  :attr:`llmem_plugin.workload.Workload.outputs_to_fp32`): the cast is always
  applied here, as every litgpt script runs under Fabric;
* the loop keeps ``logits`` and ``loss`` bound through backward and into the
  next micro-step (``--runner plain-loop``); ``--runner torch`` drops them
  after backward, as for a step that follows none (lit-gpt's resource tables
  put the longest sample first).

QLoRA (``--quantize nf4|fp4``) is Lightning's ``BitsandbytesPrecision``:
every ``nn.Linear`` 4-bit, the head included, quantized from fp16, no k-bit
preparation, each layer's matmul as the given bitsandbytes version runs it
(litgpt 0.4.13 pins 0.42.0). What is not modelled is refused in one line
(:func:`unsupported`): int8, gradient checkpointing,
multi-GPU methods, fast mode, the loss paths and attention switches of
transformers' models. litgpt must be importable: litgpt 0.4.13 installed
without its pinned dependencies (pip's no-deps option, as tests/setup.sh
does); its package needs Lightning, which the adapters' extra brings.

Known limitations:
    * ``LoRAQKVLinear`` runs a grouped ``conv1d``; on a GPU with cuDNN its
      workspace (a transient of the adapter's rank, a few MiB at most) is
      not in the trace, which runs PyTorch's own convolution as a
      cuDNN-less CUDA build does.
    * validation (``validate()``, no_grad) and example generation are not
      traced; on the published configurations they peak below the step
      (``benchmarks/published/litgpt_stub.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.models.config import LITGPT_PREFIX
from llmem_plugin.workload import AttentionImpl, LossImpl, Runner, Workload

__all__ = ["LM_HEAD_CHUNK", "build", "forward_with_loss", "is_litgpt_model", "lora_flags", "loss_path", "unsupported",
           "vocab_size"]

# litgpt/finetune/lora.py fit(): `model(input_ids, lm_head_chunk_size=128)`; litgpt/utils.py
# chunked_cross_entropy's default chunk_size=128 (full.py's flattened logits).
LM_HEAD_CHUNK = 128
# litgpt.lora.Config's switches and the transformers module names that mean the same projection
# (litgpt/scripts/convert_hf_checkpoint.py copy_weights_hf_llama: q/k/v_proj -> attn.attn,
# o_proj -> attn.proj, gate/up/down_proj -> mlp.fc_1/fc_2/proj, lm_head -> lm_head).
_TARGETS = {
    "query": "query", "q_proj": "query",
    "key": "key", "k_proj": "key",
    "value": "value", "v_proj": "value",
    "projection": "projection", "o_proj": "projection",
    "mlp": "mlp", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
    "head": "head", "lm_head": "head",
}
_MLP = ("gate_proj", "up_proj", "down_proj")


def is_litgpt_model(model: nn.Module) -> bool:
    """A litgpt ``GPT`` (plain or LoRA)."""
    return any(c.__module__.startswith("litgpt.") and c.__name__ == "GPT" for c in type(model).__mro__)


def _import():
    try:
        import litgpt.lora
        import litgpt.model
        import litgpt.utils
    except ImportError as e:
        raise ConfigError(f"model source 'litgpt:...' needs litgpt, which cannot be imported ({e}). HINT: pip install "
                          "litgpt==0.4.13 without its pinned dependencies (pip's no-deps option; Lightning installed), "
                          "or pass a transformers model") from None
    return litgpt


def lora_flags(targets: tuple[str, ...] | list[str] | None) -> dict[str, bool]:
    """litgpt's ``lora_*`` switches for LoRA target module names (litgpt's or transformers')."""
    if not targets:  # LoraSpec's default, q_proj and v_proj; litgpt's config_hub default too
        targets = ("query", "value")
    unknown = [t for t in targets if t not in _TARGETS]
    if unknown:
        raise ConfigError(f"LoRA targets {', '.join(unknown)} have no litgpt switch; litgpt adapts query, key, value, "
                          f"projection, mlp and head. HINT: pass --lora-targets from {', '.join(sorted(_TARGETS))}")
    mlp = [t for t in targets if t in _MLP]
    if mlp and len(set(mlp)) != len(_MLP):
        raise ConfigError(f"LoRA targets {', '.join(mlp)}: litgpt's lora_mlp adapts all three MLP projections "
                          "together. HINT: pass gate_proj, up_proj and down_proj (or mlp), or none of them")
    chosen = {_TARGETS[t] for t in targets}
    return {f"lora_{k}": k in chosen for k in ("query", "key", "value", "projection", "mlp", "head")}


def unsupported(workload: Workload) -> str | None:
    """Why litgpt's step cannot be traced for ``workload``, in one line, or None."""
    if workload.quantize is not None:
        if workload.quantize.value not in ("nf4", "fp4"):
            return (f"--quantize {workload.quantize.value} with a litgpt model is not modelled (litgpt's 4-bit "
                    "modes run through Lightning's BitsandbytesPrecision). HINT: use --quantize nf4 or fp4")
        if not (workload.quantize_lm_head and workload.quantized_from == "fp16" and workload.kbit_prepare == "off"):
            return ("litgpt quantizes through Lightning's BitsandbytesPrecision, which converts every nn.Linear, the "
                    "head included, from fp16 and runs no k-bit preparation. HINT: pass --quantize-lm-head "
                    "--quantized-from fp16 --kbit-prepare off (the CLI's defaults for a litgpt:NAME model; in the "
                    "API quantize_lm_head=True, quantized_from='fp16', kbit_prepare='off')")
        if workload.optimizer.value != "paged-adamw":
            return (f"--optimizer {workload.optimizer.value} with a quantized litgpt model: litgpt's "
                    "instantiate_bnb_optimizer (litgpt/utils.py) makes bitsandbytes' PagedAdamW. HINT: pass "
                    "--optimizer paged-adamw (the CLI's default here)")
    if workload.grad_checkpointing:
        return ("--grad-checkpointing with a litgpt model is not modelled (litgpt's single-device scripts do not "
                "checkpoint). HINT: drop --grad-checkpointing")
    if workload.loss is not LossImpl.HF or workload.logits_to_keep:
        return ("--loss and --logits-to-keep do not apply to a litgpt model: litgpt's scripts compute their own "
                "chunked cross-entropy, which is what is traced. HINT: drop them")
    if workload.packed_docs is not None:
        return ("--packed-docs with a litgpt model is not modelled (litgpt's scripts pad each batch). HINT: drop "
                "--packed-docs")
    if workload.attn_implementation is not AttentionImpl.AUTO:
        return ("--attn does not apply to a litgpt model (its attention calls scaled_dot_product_attention). "
                "HINT: drop --attn")
    if workload.runner not in (Runner.TORCH, Runner.PLAIN_LOOP):
        return (f"--runner {workload.runner.value} with a litgpt model: litgpt's scripts run their own loop. "
                "HINT: use --runner plain-loop (litgpt's fit keeps the last step's outputs) or torch")
    if workload.precision.autocast_dtype is not None:
        return (f"--precision {workload.precision.value} with a litgpt model is not modelled (litgpt's configs "
                "train in bf16-true). HINT: use --precision bf16 (bf16-true) or fp32")
    for name in ("offload_activations", "reference_model", "task", "images", "target_len"):
        if getattr(workload, name) not in (None, False):
            return f"{name} with a litgpt model is not modelled. HINT: drop it"
    if workload.load != "direct":
        return "--load with a litgpt model is not modelled. HINT: drop --load"
    if workload.freeze_vision:
        return "freeze_vision does not apply to a litgpt model (a text model). HINT: drop it"
    return None


def build(source: str, workload: Workload, *, device: str = "meta") -> nn.Module:
    """litgpt's ``GPT`` (with LoRA: ``litgpt.lora.GPT``) for ``litgpt:NAME``, as litgpt's scripts build it."""
    reason = unsupported(workload)
    if reason:
        raise UnsupportedError(reason)
    litgpt = _import()
    name = source[len(LITGPT_PREFIX):]
    lora = workload.lora
    kwargs: dict[str, Any] = {}
    if lora is not None:
        if lora.adapter_dtype != "base" and workload.precision.param_dtype != torch.float32:
            raise ConfigError("litgpt creates its LoRA parameters in the model's dtype (inside "
                              "fabric.init_module()). HINT: pass --lora-adapter-dtype base with a litgpt model")
        alpha = lora.alpha if lora.alpha is not None else 2 * lora.rank  # LoraSpec's default (scales values only)
        kwargs = {"lora_r": lora.rank, "lora_alpha": alpha, "lora_dropout": lora.dropout,
                  **lora_flags(lora.target_modules)}
    module = litgpt.lora if lora is not None else litgpt.model
    config = _config(module.Config, name, kwargs)
    if workload.seq_len > config.block_size:
        raise ConfigError(f"seq_len {workload.seq_len} exceeds {name}'s block size {config.block_size}, which litgpt "
                          f"refuses (GPT.max_seq_length). HINT: pass --seq-len {config.block_size} or less")
    with _default_dtype(workload.precision.param_dtype), torch.device(device):
        model = module.GPT(config)
    with torch.device(device):
        # fit(), outside init_module: model.max_seq_length = min(longest sample, train.max_seq_length),
        # which rebuilds the RoPE cache at that length.
        model.max_seq_length = workload.seq_len
    if workload.quantize is not None:
        _quantize(model, workload)
    if lora is not None:
        litgpt.lora.mark_only_lora_as_trainable(model)
    model.train()
    return model


def _quantize(model: nn.Module, workload: Workload) -> None:
    """Lightning's ``BitsandbytesPrecision`` (2.4, ``fabric/plugins/precision/bitsandbytes.py``):
    inside ``init_module`` every ``torch.nn.Linear`` is made its ``_Linear4bit``
    (``_ClassReplacementContextManager``), the LoRA layers' ``linear`` and the head included;
    ``quantize`` casts each weight to fp16 before ``quantize_4bit``; ``convert_module`` sets
    ``compute_dtype`` to the precision's dtype. The bitsandbytes stand-in
    (:class:`llmem_plugin.techniques.quant.Linear4bitStandIn`) replays that layer's matmul for the
    workload's bitsandbytes version."""
    from llmem_plugin.techniques.quant import Linear4bitStandIn, quant_spec

    spec = quant_spec(workload)
    for name, m in [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]:
        model.set_submodule(name, Linear4bitStandIn.from_linear(m, spec))
    for p in model.parameters():  # mark_only_lora_as_trainable (LoRA) or the recipe freezes the rest
        if p.dtype == torch.uint8:
            p.requires_grad_(False)


def _config(config_class, name: str, kwargs: dict[str, Any]):
    """litgpt's ``Config`` for a config-table name, or for a checkpoint
    directory's ``model_config.yaml`` (``Config.from_file``, what litgpt's
    scripts read from ``checkpoint_dir``)."""
    path = Path(name).expanduser()
    if name.endswith((".yaml", ".yml")) or path.is_dir():
        file = path / "model_config.yaml" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"litgpt model config {str(file)!r} does not exist. HINT: pass litgpt:DIR with DIR a "
                              "litgpt checkpoint directory (it holds model_config.yaml), or litgpt:NAME")
        try:
            return config_class.from_file(file, **kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"litgpt model config {str(file)!r} cannot be read: {str(e).splitlines()[0]}. "
                              "HINT: pass the model_config.yaml litgpt wrote for the checkpoint") from None
    try:
        return config_class.from_name(name, **kwargs)
    except ValueError:
        raise ConfigError(f"{name!r} is not a litgpt config name. HINT: pass litgpt:NAME with a name from "
                          "litgpt's config table (litgpt.config.name_to_config), e.g. litgpt:Llama-2-7b-hf, or "
                          "litgpt:DIR for a checkpoint directory") from None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``fabric.init_module()`` under a ``*-true`` precision: the default dtype
    (Lightning ``_DtypeContextManager``) is the precision's while the model is made."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def vocab_size(model: nn.Module) -> int:
    """Token ids are drawn below the tokenizer's vocabulary (the embedding
    has ``padded_vocab_size`` rows)."""
    return int(model.config.vocab_size)


def forward_with_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                      drop_previous=None) -> dict[str, Any]:
    """One micro-step's forward and loss, as litgpt 0.4.13's ``fit()`` runs them
    under Fabric; returns what the loop binds (``logits``, ``loss``).
    ``drop_previous``: releases the last micro-step's ``logits`` and ``loss``
    where ``fit()`` rebinds ``logits``: once Fabric's wrapper has returned the
    cast output."""
    from litgpt.utils import chunked_cross_entropy

    from llmem_plugin.techniques.loss import fabric_cast

    lora = hasattr(model.config, "lora_r")
    if lora:
        logits = model(input_ids, lm_head_chunk_size=LM_HEAD_CHUNK)
    else:
        logits = model(input_ids)
    # `logits = model(...)` through Fabric: _FabricModule.forward casts the output before it returns,
    # and only then does the name let go of the last micro-step's logits.
    logits = fabric_cast(logits)
    if drop_previous is not None:
        drop_previous()
    if lora:
        # finetune/lora.py: shift the targets such that output n predicts token n+1
        logits[-1] = logits[-1][..., :-1, :]
        loss = chunked_cross_entropy(logits, labels[..., 1:])
    else:
        loss = chunked_cross_entropy(logits[..., :-1, :], labels[..., 1:])
    return {"logits": logits, "loss": loss}


def loss_path(workload: Workload) -> str:
    """The traced loss, in words (the report's "loss path")."""
    if workload.lora is not None:
        how = (f"litgpt's chunked_cross_entropy on the {LM_HEAD_CHUNK}-token head chunks "
               "(finetune/lora.py, lm_head_chunk_size)")
    else:
        how = f"litgpt's chunked_cross_entropy over {LM_HEAD_CHUNK}-row chunks of the full logits (finetune/full.py)"
    kept = ("; fit() keeps the last step's logits and loss into the next" if workload.runner is Runner.PLAIN_LOOP
            else "; its logits live through backward, nothing into the next step (pass --runner plain-loop for "
                 "fit()'s loop, which keeps its logits and loss)")
    return f"{how}, on Lightning Fabric's fp32 copies of the logits{kept}"
