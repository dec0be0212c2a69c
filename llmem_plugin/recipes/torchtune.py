"""torchtune recipe configs (torchtune 0.6.1, its newest release).

A torchtune YAML names its model, loss and optimizer as ``_component_``
dotpaths; every other key of those blocks is a keyword of the callable, whose
Python defaults apply when the YAML leaves one out (config/_instantiate.py).
The recipe reads the top-level keys with ``cfg.get(key, default)``. Sources,
all at torchtune v0.6.1 (a6290a5):

- recipes/lora_finetune_single_device.py: ``dtype`` (pure, no autocast:
  training/precision.py), ``batch_size``, ``gradient_accumulation_steps``,
  ``enable_activation_checkpointing`` (every TransformerSelfAttentionLayer,
  non-reentrant: training/memory.py), ``enable_activation_offloading``
  (OffloadActivations: 5 in flight, 1 KiB minimum, the output head excluded),
  ``model.set_num_output_chunks`` only for CEWithChunkedOutputLoss (else
  ``self.output(h).float()``: modules/transformer.py);
- recipes/full_finetune_distributed.py: ``fsdp_cpu_offload``,
  ``fsdp_reshard_after_forward``, ``custom_sharded_layers``, ``ac_mode`` /
  ``ac_option`` (every ``ac_option``-th layer: training/activations.py),
  ``tensor_parallel_dim``, ``optimizer_in_bwd``;
- models/<family>/_model_builders.py: the LoRA builders' defaults (rank 8,
  alpha 16, dropout 0, MLP and output off) and ``qlora_* = partial(...,
  quantize_base=True)``; LoRALinear builds its adapters in the recipe's dtype
  (modules/peft/lora.py under ``set_default_dtype``).

torchtune's own TransformerDecoder is estimated with transformers' class of the
same shapes (stated in the report; docs/recipes.md gives the measured gap).
"""

from __future__ import annotations

from typing import Any

from llmem_plugin.recipes import Reader, Recipe

__all__ = ["read"]

VERSION = "0.6.1"

# torchtune builder (after lora_/qlora_) -> catalog model with the same shapes
# (models/<family>/_model_builders.py and _component_builders.py give the dims).
_MODELS = {
    "llama2_7b": "llama-2-7b", "llama2_13b": "llama-2-13b", "llama2_70b": "llama-2-70b",
    "llama3_1_8b": "llama-3.1-8b", "llama3_1_70b": "llama-3.1-70b",
    "llama3_2_1b": "llama-3.2-1b", "llama3_2_3b": "llama-3.2-3b",
    "mistral_7b": "mistral-7b",
    "qwen2_5_0_5b": "qwen2.5-0.5b", "qwen2_5_7b_base": "qwen2.5-7b", "qwen2_5_7b_instruct": "qwen2.5-7b",
    "qwen2_5_72b_base": "qwen2.5-72b", "qwen2_5_72b_instruct": "qwen2.5-72b",
}
# torchtune's LoRA module names -> transformers' (modules/peft/lora.py LORA_ATTN_MODULES;
# the MLP's w1/w2/w3 are gate/down/up: models/llama3/_component_builders.py lora_llama3_mlp).
_ATTN = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
_MLP = ("gate_proj", "down_proj", "up_proj")

_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}  # training/precision.py
_OPTIMIZERS = {
    "torch.optim.AdamW": None,  # adamw, or adamw-fused with fused: True
    "torch.optim.Adam": None,
    "torch.optim.SGD": "sgd",
    "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw8bit",
    "bitsandbytes.optim.PagedAdamW": "paged-adamw",
    "bitsandbytes.optim.AdamW8bit": "adamw8bit",
}
_CHUNKED = "torchtune.modules.loss.CEWithChunkedOutputLoss"
_PLAIN_CE = ("torch.nn.CrossEntropyLoss",)

# Top-level keys the 0.6.1 recipes read that do not change GPU memory of the step.
_IGNORED = {
    "output_dir", "checkpointer", "resume_from_checkpoint", "save_adapter_weights_only", "seed", "shuffle",
    "lr_scheduler", "epochs", "max_steps_per_epoch", "metric_logger", "log_every_n_steps", "log_peak_memory_stats",
    "log_level", "device", "profiler", "cudnn_deterministic_mode", "enable_async_checkpointing",
    "run_val_every_n_steps", "dataset_val", "batch_size_val", "save_last_epoch_only", "tokenizer", "dataset",
}


def read(raw: dict[str, Any], path: str) -> Recipe:
    """Map a torchtune recipe config to ``llmem estimate`` options.

    Raises:
        ConfigError: A value torchtune itself rejects (fp16, a missing model component).
        UnsupportedError: A model, loss, optimizer or option that cannot be bounded (packed datasets, DoRA,
            tensor parallelism, reshard_after_forward False).
    """
    r = Reader(Recipe("torchtune", path, f"torchtune {VERSION}"), raw)
    _model(r)
    _batch(r)
    _numerics(r)
    _memory(r)
    _distributed(r)
    r.note("torchtune's own TransformerDecoder is estimated with transformers' model of the same shapes "
           "(docs/recipes.md)")
    return r.finish(_IGNORED, schema=f"torchtune {VERSION}'s recipes (they never read it)")


def _model(r: Reader) -> None:
    comp = r.get("model._component_")
    if not isinstance(comp, str) or not comp.startswith("torchtune.models."):
        r.bad("model._component_", comp, "not a torchtune model builder",
              "name one, e.g. torchtune.models.llama3_2.lora_llama3_2_1b")
    name = comp.rsplit(".", 1)[1]
    base, lora, qlora = name, False, False
    for prefix in ("qlora_", "lora_"):
        if name.startswith(prefix):
            base, lora, qlora = name[len(prefix):], True, prefix == "qlora_"
    if base not in _MODELS:
        r.refuse("model._component_", comp, "this builder is not mapped to a catalog model",
                 f"mapped builders: {', '.join(sorted(_MODELS))}; or estimate transformers' model with --model")
    r.set("model._component_", comp, "--model", _MODELS[base])
    block = r.raw.get("model") or {}
    for key in block:
        r.seen.add(f"model.{key}")
    if not lora:
        extra = sorted(set(block) - {"_component_"})
        if extra:
            r.bad(f"model.{extra[0]}", block[extra[0]], f"{base} takes no arguments", "drop it")
        return
    rank = r.get("model.lora_rank", 8, kind=int)  # the builders' defaults
    alpha = r.get("model.lora_alpha", 16, kind=(int, float))
    dropout = r.get("model.lora_dropout", 0.0, kind=(int, float))
    attn = r.get("model.lora_attn_modules")
    if not isinstance(attn, list) or not attn or any(not isinstance(a, str) or a not in _ATTN for a in attn):
        r.bad("model.lora_attn_modules", attn, f"must list some of {', '.join(_ATTN)} (required by the builder)",
              "e.g. ['q_proj', 'v_proj', 'output_proj']")
    targets = [_ATTN[a] for a in attn]
    if r.get("model.apply_lora_to_mlp", False):
        targets += _MLP
    if r.get("model.apply_lora_to_output", False):
        targets.append("lm_head")
    if r.get("model.use_dora", False):
        r.refuse("model.use_dora", True, "DoRA's per-forward weight norms are not modelled", "set use_dora: False")
    r.set("model.lora_rank", rank, "--lora-rank", rank)
    r.set("model.lora_alpha", alpha, "--lora-alpha", alpha)
    r.set("model.lora_dropout", dropout, "--lora-dropout", dropout if dropout else None)
    r.set("model.lora_attn_modules", attn, "--lora-targets", ",".join(targets))
    r.ignore("model.apply_lora_to_mlp", "model.apply_lora_to_output")
    # LoRALinear is built under the recipe's set_default_dtype: adapters in the model's dtype.
    r.recipe.options["--lora-adapter-dtype"] = "base"
    if qlora:
        r.set("model._component_", comp, "--quantize", "nf4-torchao")


def _batch(r: Reader) -> None:
    r.set("batch_size", r.get("batch_size"), "--batch-size", _positive(r, "batch_size"))
    r.get("tokenizer.max_seq_len", kind=int)
    r.set("gradient_accumulation_steps", r.get("gradient_accumulation_steps"), "--grad-accum",
          _positive(r, "gradient_accumulation_steps"))
    seq = r.get("tokenizer.max_seq_len")
    if seq is None:
        r.require("--seq-len", "tokenizer.max_seq_len is null: torchtune pads each batch to its longest sample, "
                  "which the file does not bound. HINT: pass --seq-len (the longest sample), or set max_seq_len")
    else:
        r.set("tokenizer.max_seq_len", seq, "--seq-len", seq)
        if not _packed(r):
            r.note("an unpacked batch is padded to its longest sample, at most tokenizer.max_seq_len: the "
                   "estimate takes every batch at max_seq_len (an upper bound; --seq-lens replays a dataset's "
                   "lengths)")
    if _packed(r):
        r.refuse("dataset.packed", True, "torchtune's packed batches run flex attention with a document BlockMask, "
                 "which is not modelled", "set packed: False, or estimate --seq-len max_seq_len as a padded batch")
    collate = r.get("collate_fn", "torchtune.data.padded_collate_sft")
    if collate != "torchtune.data.padded_collate_sft":
        r.refuse("collate_fn", collate, "only padded_collate_sft's batches are modelled", "drop collate_fn")


def _numerics(r: Reader) -> None:
    dtype = r.get("dtype", kind=str)
    if dtype not in _DTYPES:
        if dtype in ("fp16", "float16"):
            r.bad("dtype", dtype, "torchtune's recipes reject fp16 (lora_finetune_single_device.py)", "use bf16")
        r.bad("dtype", dtype, "not a torchtune dtype", "use bf16 or fp32")
    r.set("dtype", dtype, "--precision", _DTYPES[dtype])  # pure dtype, no autocast
    comp = r.get("optimizer._component_")
    if not isinstance(comp, str) or comp not in _OPTIMIZERS:
        r.refuse("optimizer._component_", comp, "this optimizer is not modelled",
                 f"use one of {', '.join(_OPTIMIZERS)}")
    kind = _OPTIMIZERS[comp]
    if kind is None:
        kind = "adamw-fused" if r.get("optimizer.fused", False) else "adamw"
        if r.get("optimizer.foreach") is False and kind == "adamw":
            kind = "adamw-forloop"
    for key in (r.raw.get("optimizer") or {}):
        r.seen.add(f"optimizer.{key}")
    r.set("optimizer._component_", comp, "--optimizer", kind)
    loss = r.get("loss._component_")
    if loss == _CHUNKED:
        chunks = r.get("loss.num_output_chunks", 8)  # ce_chunked_output_loss.py default
        r.set("loss._component_", loss, "--loss", "chunked")
        r.set("loss.num_output_chunks", chunks, "--loss-chunks", chunks)
    elif loss in _PLAIN_CE:
        r.set("loss._component_", loss, "--loss", "hf")  # self.output(h).float(), then cross-entropy
    else:
        r.refuse("loss._component_", loss, "this loss is not modelled",
                 f"use {_CHUNKED} or torch.nn.CrossEntropyLoss")
    if r.get("compile", False):
        r.skip("compile", True, "torch.compile is not modelled; the eager step is estimated")
    if r.get("clip_grad_norm") is not None:
        r.skip("clip_grad_norm", r.get("clip_grad_norm"), "the norm's per-parameter temporaries are not counted")


def _memory(r: Reader) -> None:
    ac = r.get("enable_activation_checkpointing", False, kind=bool)
    mode = r.get("ac_mode", kind=str)
    if mode is not None and not ac:  # full_finetune_distributed.py: ac_mode only when the flag is off
        option = r.get("ac_option")
        if mode != "selective" or isinstance(option, bool) or not isinstance(option, int) or option < 0:
            r.refuse("ac_option", option, "only selective layer checkpointing (an integer ac_option) is modelled; "
                     "torchtune 0.6.1 raises on 'op'", "set ac_option to an integer")
        r.set("ac_mode", mode, "--grad-checkpointing", True)
        r.set("ac_option", option, "--checkpoint-every", option if option > 1 else None)
    elif mode is not None:
        # full_finetune_distributed.py applies selective AC only with the flag off and full AC only with ac_mode
        # unset: both set, no layer is checkpointed
        r.set("enable_activation_checkpointing", ac, None)
        r.set("ac_mode", mode, None)
        r.note("enable_activation_checkpointing and ac_mode together: the distributed recipe checkpoints no layer "
               "(estimated so)")
        r.ignore("ac_option")
    else:
        r.set("enable_activation_checkpointing", ac, "--grad-checkpointing", ac)
        r.ignore("ac_option")
    if r.get("enable_activation_offloading", False):
        if not ac:
            r.bad("enable_activation_offloading", True, "torchtune requires enable_activation_checkpointing with it",
                  "set enable_activation_checkpointing: True")
        r.set("enable_activation_offloading", True, "--offload-activations", "streamed")
    else:
        r.set("enable_activation_offloading", False)
    if r.get("optimizer_in_bwd", False):
        r.skip("optimizer_in_bwd", True, "each gradient is freed as its optimizer steps in the backward; the "
               "estimate keeps all gradients to the step (an upper bound)")
    if r.get("low_cpu_ram", False):
        r.skip("low_cpu_ram", True, "host memory only")


def _distributed(r: Reader) -> None:
    if r.get("tensor_parallel_dim", 1) not in (1, None):
        r.refuse("tensor_parallel_dim", r.get("tensor_parallel_dim"), "torchtune's tensor-parallel plans are not "
                 "mapped", "estimate with --method fsdp-tp --tp N on the command line, without --config")
    r.ignore("tensor_parallel_plan")
    keys = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers")
    if not any(k in r.raw for k in keys):
        r.note("the file does not say single-device or distributed (tune run's recipe does): one GPU is "
               "estimated; for full_finetune_distributed or lora_finetune_distributed add --method fsdp --gpus N")
        return
    r.set(keys[0], r.get(keys[0], False), "--method", "fsdp")  # FSDP2 fully_shard per layer, then the root
    if r.get("fsdp_cpu_offload", False):
        r.set("fsdp_cpu_offload", True, "--offload", "params")  # CPUOffloadPolicy: params, grads and states
    if r.get("fsdp_reshard_after_forward", True) is False:
        r.refuse("fsdp_reshard_after_forward", False, "unsharded parameters kept from forward to backward are not "
                 "modelled", "drop it (torchtune's default is True)")
    r.ignore("fsdp_reshard_after_forward")
    if r.get("custom_sharded_layers"):
        r.skip("custom_sharded_layers", r.get("custom_sharded_layers"), "their extra FSDP units are not modelled; "
               "the root unit gathers them together (an upper bound)")
    r.note("the world size is not in the file: pass --gpus N (default 1)")


def _positive(r: Reader, key: str) -> int:
    value = r.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        r.bad(key, value, "must be a positive integer (the recipe requires it)", f"set {key}: 1 or more")
    return value


def _packed(r: Reader) -> bool:
    """``dataset.packed``, for one dataset or a list of them (the recipe concatenates a list)."""
    dataset = r.raw.get("dataset")
    datasets = dataset if isinstance(dataset, list) else [dataset]
    r.ignore("dataset.packed")
    return any(isinstance(d, dict) and d.get("packed") for d in datasets)
