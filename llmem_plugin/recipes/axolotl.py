"""Axolotl YAML configs (axolotl 0.19.0).

Keys and defaults are the pydantic schema's (``AxolotlInputConfig``,
utils/schemas/config.py, model.py, peft.py, training.py); what the loader does
with them is loaders/model.py and loaders/adapter.py. Paths below are in the
0.19.0 wheel. The schema silently drops keys it does not know, so the file's
keys are compared with the schema's field names (axolotl_keys.json, checked
against the wheel by tests/recipes/test_axolotl.py).

Memory rules read from the loader:

- weights load in ``torch_dtype``: bf16 when ``bf16`` is true or "auto" on a
  GPU with bf16, else fp32 (utils/config/__init__.py ``resolve_dtype``);
- 4-bit weights only for ``adapter: qlora`` with ``load_in_4bit``, 8-bit only
  for ``adapter: lora`` with ``load_in_8bit`` (loaders/model.py
  ``_set_quantization_config``): bitsandbytes nf4, double quantization on,
  storage bf16 unless ``bnb_config_kwargs`` says otherwise;
- k-bit preparation upcasts every 16-bit parameter to fp32, then the loader
  casts the norms, the embeddings and the head back to ``torch_dtype``
  (``_configure_embedding_dtypes``, ``needs_fa2_dtype`` for lora/qlora): for
  models whose only 16-bit parameters are those, nothing stays fp32, which is
  ``--kbit-prepare off``;
- LoRA adapters fp32 (peft's ``autocast_adapter_dtype``) unless
  ``peft_autocast_adapter_dtype: false``;
- ``sample_packing`` with flash attention feeds one row of ``micro_batch_size``
  bins of ``sequence_len`` tokens with per-document position ids and no
  attention mask (core/builders/causal.py, utils/collators/batching.py):
  transformers finds the documents from the position ids.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from llmem_plugin.recipes import Reader, Recipe, _hf

__all__ = ["read"]

VERSION = "0.19.0"

# Keys that change no GPU memory of the training step: data, logging, saving, evaluation, schedules.
_IGNORED = {
    "datasets", "test_datasets", "dataset_prepared_path", "val_set_size", "output_dir", "hub_model_id",
    "wandb_project", "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model", "num_epochs", "max_steps",
    "lr_scheduler", "learning_rate", "warmup_steps", "warmup_ratio", "weight_decay", "logging_steps",
    "evals_per_epoch", "saves_per_epoch", "save_steps", "eval_steps", "resume_from_checkpoint", "lora_model_dir",
    "eval_sample_packing", "eval_batch_size", "eval_sequence_len", "loss_watchdog_threshold",
    "loss_watchdog_patience", "tf32", "seed", "strict", "early_stopping_patience", "save_total_limit",
    "chat_template", "train_on_inputs", "group_by_length", "shuffle_merged_datasets", "dataset_processes",
    "tokenizer_type", "tokenizer_config", "save_safetensors", "adam_beta1", "adam_beta2", "adam_epsilon",
    "max_grad_norm", "lr_scheduler_kwargs", "cosine_min_lr_ratio", "special_tokens", "trust_remote_code",
    "save_first_step", "peft_use_rslora", "save_strategy", "eval_strategy", "evaluation_strategy", "report_to",
    "logging_dir", "push_to_hub", "hub_strategy", "num_processes", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_prefetch_factor", "ddp_timeout", "ddp_find_unused_parameters", "lora_fan_in_fan_out", "local_rank", "debug", "flash_attn_cross_entropy",
    "flash_attn_rms_norm", "flash_attn_fuse_mlp", "excess_length_strategy", "gradient_checkpointing_kwargs",
    "model_type", "type_of_model", "tokenizer_use_fast", "pad_to_sequence_len", "plugins", "load_in_8bit",
    "load_in_4bit", "adapter", "bnb_config_kwargs", "base_model", "micro_batch_size", "sequence_len",
}
# LoRA Triton kernels Axolotl turns on for lora/qlora on one GPU, DDP or FSDP2 when unset
# (AxolotlConfigWCapabilities.check_auto_enable_lora_kernels, utils/schemas/config.py).
_LORA_KERNELS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")
# Keys whose effect the estimate cannot bound: refused when truthy.
_REFUSED = {
    "rl": "Axolotl's preference trainers (TRL's DPO/KTO/ORPO/GRPO) are not mapped yet",
    "tokens": "new tokens resize the embeddings (and, with an adapter, train full copies of them)",
    "lora_modules_to_save": "full trainable copies of whole modules are not modelled",
    "peft_use_dora": "DoRA's per-forward weight norms are not modelled",
    "lora_target_parameters": "LoRA on MoE expert parameters is not modelled",
    "relora": "ReLoRA's merge-and-restart steps are not modelled",
    "layer_offloading": "layer parameters offloaded during the forward are not modelled",
    "lora_on_cpu": "adapters on the CPU are not modelled",
    "fp8": "fp8 training is not modelled",
    "qat": "quantization-aware training is not modelled",
    "tiled_mlp": "tiled MLP is not modelled",
    "tensor_parallel_size": "Axolotl's tensor parallelism is not mapped",
    "context_parallel_size": "context parallelism is not modelled",
    "gptq": "GPTQ weights are not modelled",
    "quantize_moe_experts": "quantized MoE experts are not modelled",
    "gpu_memory_limit": "device_map placement over several devices is not modelled",
    "max_memory": "device_map placement over several devices is not modelled",
    "unfrozen_parameters": "partial freezing by name is not modelled",
    "liger_cross_entropy": "liger's non-fused cross-entropy is not modelled",
    "float16": "pure fp16 weights and gradients are not modelled",
}
# Keys listed as not modelled, each with why the estimate still bounds the job from above.
_UPPER_BOUND = {
    "torch_compile": "torch.compile is not modelled; the eager step is estimated",
    "chunked_cross_entropy": "chunked cross-entropy over the full logits is not modelled; the whole-logits fp32 "
                             "loss is estimated (an upper bound)",
    "liger_rope": "liger's layer kernels are not modelled; the layers run as transformers writes them",
    "liger_rms_norm": "liger's layer kernels are not modelled; the layers run as transformers writes them",
    "liger_glu_activation": "liger's layer kernels are not modelled; the layers run as transformers writes them",
    "liger_swiglu": "liger's layer kernels are not modelled; the layers run as transformers writes them",
    "liger_layer_norm": "liger's layer kernels are not modelled; the layers run as transformers writes them",
}


def _schema_keys() -> set[str]:
    data = json.loads(resources.files("llmem_plugin.recipes").joinpath("axolotl_keys.json").read_text())
    return set(data["keys"])


def read(raw: dict[str, Any], path: str) -> Recipe:
    """Map an Axolotl config to ``llmem estimate`` options.

    Raises:
        ConfigError: A value Axolotl's own validation rejects.
        UnsupportedError: A key whose effect on memory cannot be bounded (see ``_REFUSED``).
    """
    r = Reader(Recipe("axolotl", path, f"axolotl {VERSION}"), raw)
    r.refuse_set(_REFUSED)
    model = r.get("base_model")
    if not isinstance(model, str):
        r.bad("base_model", model, "Axolotl requires the model (utils/schemas/model.py)", "set base_model")
    r.set("base_model", model, "--model", model)
    r.set("(trainer)", "transformers Trainer (AxolotlTrainer)", "--runner", "hf-trainer")
    weights = _precision(r)
    _batch(r)
    _adapter(r, weights)
    _checkpointing(r)
    _hf.optimizer(r, "optimizer", "adamw_torch_fused")  # utils/schemas/training.py default
    _attention(r)
    _loss(r)
    _distributed(r)
    _embedding_dtypes(r, weights)
    for key, why in _UPPER_BOUND.items():
        if raw.get(key):
            r.skip(key, raw[key], why)
    return r.finish(_IGNORED, schema=f"axolotl {VERSION} (Axolotl drops it)", schema_keys=_schema_keys())


def _embedding_dtypes(r: Reader, weights: str) -> None:
    """Refuse the mixed-dtype model Axolotl leaves for a 16-bit full fine-tune under sdpa/eager.

    loaders/model.py ``_configure_embedding_dtypes``: without FSDP the norms,
    embeddings and head go to fp32 first; only LoRA/QLoRA, an attention that
    needs the cast (flash, flex...) or Cut Cross-Entropy cast them back.
    DeepSpeed casts the whole module to bf16 itself (runtime/engine.py
    ``_configure_distributed_model``).
    """
    if weights == "fp32" or r.get("adapter") is not None or r.has("fsdp_config") or r.get("fsdp") \
            or r.has("deepspeed") or r.recipe.options.get("--loss") == "cce":
        return
    attn = _attn_name(r)
    if attn in (None, "sdpa", "eager"):
        r.refuse("attn_implementation", attn or "default", "a full fine-tune in bf16 under sdpa/eager keeps "
                 "Axolotl's norms, embeddings and head in fp32 beside bf16 weights, a mixed-dtype model that is not "
                 "modelled", "use flash_attention_2 (Axolotl casts them back), DeepSpeed or FSDP")


def _precision(r: Reader) -> str:
    """The weights' dtype, from bf16/fp16/bfloat16 (utils/config/__init__.py resolve_dtype)."""
    bf16, fp16 = r.get("bf16", "auto", kind=(bool, str)), r.get("fp16", False, kind=bool)
    if fp16 and bf16 == "auto":
        bf16 = False  # resolve_dtype: fp16 turns bf16 "auto" off
    if r.get("bfloat16", False):
        bf16 = True
    if bf16 in (True, "auto", "full"):
        key = "bfloat16" if r.raw.get("bfloat16") else "bf16"
        _hf.precision(r, key, bf16, bf16=True, fp16=False, weights="bf16")
        if bf16 == "auto":
            r.note("bf16: auto is bf16 on GPUs that have it (compute capability 8.0 and up); Axolotl trains older "
                   "GPUs in fp16, which is refused")
        r.ignore("fp16")
        return "bf16"
    weights = "fp16" if fp16 or r.get("load_in_8bit", False) else "fp32"
    _hf.precision(r, "fp16" if fp16 else "bf16", fp16 if fp16 else bf16, bf16=False, fp16=bool(fp16),
                  weights=weights)
    return weights


def _batch(r: Reader) -> None:
    seq = r.get("sequence_len", 512, kind=int)  # utils/schemas/config.py
    mbs = r.get("micro_batch_size", 1, kind=int)  # utils/schemas/training.py
    r.set("sequence_len", seq, "--seq-len", seq)
    r.set("micro_batch_size", mbs, "--batch-size", mbs)
    accum = r.get("gradient_accumulation_steps", 1, kind=int)
    r.set("gradient_accumulation_steps", accum, "--grad-accum", accum)
    if r.get("sample_packing", False):
        attn = _attn_name(r)
        if attn != "flash_attention_2":
            r.refuse("sample_packing", True, f"packed bins under {attn or 'sdpa'} (a document mask or sdpa's "
                     "varlen patch) are not modelled", "use attn_implementation: flash_attention_2")
        if r.get("multipack_real_batches", False):
            r.refuse("multipack_real_batches", True, "bins of one sequence_len each are not modelled",
                     "drop multipack_real_batches")
        r.set("sample_packing", True, "--packed-boundaries", "positions")
        r.require("--packed-docs", "sample_packing packs whole samples into one row of micro_batch_size x "
                  "sequence_len tokens, but how many fit depends on the dataset. HINT: pass --packed-docs N (the "
                  "documents per row; the memory grows slowly with N)")
        r.note("sample_packing: every bin is taken full (micro_batch_size x sequence_len tokens: an upper bound)")
    else:
        r.note("each batch is padded to its longest sample, at most sequence_len: every batch is taken at "
               "sequence_len (an upper bound; --seq-lens replays a dataset's lengths)")


def _adapter(r: Reader, weights: str) -> None:
    adapter = r.get("adapter")
    four, eight = bool(r.get("load_in_4bit", False)), bool(r.get("load_in_8bit", False))
    if adapter is None:
        if four or eight:
            r.bad("load_in_4bit" if four else "load_in_8bit", True, "Axolotl requires an adapter with quantized "
                  "weights (utils/schemas/peft.py)", "set adapter: qlora or lora")
        return
    if adapter not in ("lora", "qlora"):
        r.refuse("adapter", adapter, "only lora and qlora are modelled", "use adapter: lora or qlora")
    if adapter == "qlora" and not four:
        r.bad("adapter", adapter, "Axolotl's qlora requires load_in_4bit: true", "set load_in_4bit: true")
    rank = r.get("lora_r", kind=int)
    if rank is None or rank < 1:
        r.bad("lora_r", rank, "an adapter needs a positive integer rank", "set lora_r, e.g. 16")
    r.set("adapter", adapter, None)
    r.set("lora_r", rank, "--lora-rank", rank)
    alpha = r.get("lora_alpha", kind=(int, float))
    r.set("lora_alpha", alpha if alpha is not None else "peft default 8", "--lora-alpha",
          alpha if alpha is not None else 8)  # peft LoraConfig lora_alpha=8
    dropout = r.get("lora_dropout", 0.0, kind=(int, float))
    r.set("lora_dropout", dropout, "--lora-dropout", dropout if dropout else None)
    if r.get("lora_target_linear", False):
        r.set("lora_target_linear", True, "--lora-targets", "all-linear")  # every Linear but the output head
        r.ignore("lora_target_modules")
    else:
        targets = r.get("lora_target_modules", kind=(str, list))
        if isinstance(targets, str):
            targets = [targets]
        if targets and not all(isinstance(t, str) for t in targets):
            r.bad("lora_target_modules", targets, "must list module names", "e.g. [q_proj, v_proj]")
        if not targets:
            r.bad("lora_target_modules", targets, "no LoRA targets (peft needs them)",
                  "list modules, or set lora_target_linear: true")
        r.set("lora_target_modules", targets, "--lora-targets", ",".join(targets))
    if r.get("peft_autocast_adapter_dtype", True) is False:
        r.set("peft_autocast_adapter_dtype", False, "--lora-adapter-dtype", "base")
    else:
        r.set("peft_autocast_adapter_dtype", "peft default true", None)
    if adapter == "lora" and four:
        r.note("adapter: lora with load_in_4bit loads unquantized weights (Axolotl builds 4-bit weights for qlora "
               "only, loaders/model.py); estimated unquantized")
    quantized = (adapter == "qlora" and four) or (adapter == "lora" and eight)
    if quantized:
        _quantization(r, adapter, eight)
    kernels = [k for k in _LORA_KERNELS if r.get(k) is not False]
    for k in kernels:
        r.skip(k, r.get(k, "auto"), "Axolotl's fused LoRA Triton kernels (on by default for lora/qlora) are not "
               "modelled; peft's layers are estimated, which keep more activations (kernels/lora.py LoRA_MLP saves "
               "only X, gate and up); set it false for the exact path")
    r.ignore(*_LORA_KERNELS)


def _quantization(r: Reader, adapter: str, eight: bool) -> None:
    kwargs = dict(r.get("bnb_config_kwargs", {}, kind=dict))
    r.ignore("bnb_config_kwargs")
    if eight:
        r.set("load_in_8bit", True, "--quantize", "int8")
    else:
        kind = kwargs.pop("bnb_4bit_quant_type", "nf4")  # loaders/model.py defaults
        if kind not in ("nf4", "fp4"):
            r.bad("bnb_config_kwargs.bnb_4bit_quant_type", kind, "not a bitsandbytes 4-bit type", "use nf4 or fp4")
        r.set("load_in_4bit", True, "--quantize", kind)
        double = kwargs.pop("bnb_4bit_use_double_quant", True)
        r.set("bnb_config_kwargs.bnb_4bit_use_double_quant", double, "--double-quant", bool(double))
        storage = kwargs.pop("bnb_4bit_quant_storage", "bfloat16")
        if storage not in ("bfloat16", "uint8"):
            r.refuse("bnb_config_kwargs.bnb_4bit_quant_storage", storage, "only bf16 or uint8 storage is modelled",
                     "drop it")
    for k, v in kwargs.items():
        if k != "llm_int8_threshold":
            r.skip(f"bnb_config_kwargs.{k}", v, "not read by the estimate")
    # prepare_model_for_kbit_training upcasts, then _configure_embedding_dtypes casts norms, embeddings and the
    # head back: the net is the 16-bit model (loaders/model.py)
    r.set(f"adapter={adapter}", "k-bit preparation, then norms and embeddings back to torch_dtype",
          "--kbit-prepare", "off")


def _checkpointing(r: Reader) -> None:
    gc = r.get("gradient_checkpointing", False)  # utils/schemas/config.py
    offload = r.get("activation_offloading", False)
    if gc == "offload":
        gc, offload = True, True  # validation.py rewrites it
    if gc == "offload_disk" or offload in ("disk", "hidden_states"):
        r.refuse("activation_offloading", offload or gc, "offloading to disk or of hidden states only is not "
                 "modelled", "use activation_offloading: true, or drop it")
    kwargs = r.get("gradient_checkpointing_kwargs", {}, kind=dict)
    reentrant = bool(gc and kwargs.get("use_reentrant") is True)
    for key in kwargs:
        if key != "use_reentrant":
            r.skip(f"gradient_checkpointing_kwargs.{key}", kwargs[key], "not read by the estimate")
    if offload:
        if not gc:
            r.bad("activation_offloading", offload, "Axolotl requires gradient_checkpointing with it",
                  "set gradient_checkpointing: true")
        # core/builders/base.py: with an adapter, HF checkpointing is turned off and TRL's offloader runs alone;
        # a full fine-tune keeps the checkpoints (loaders/model.py re-wraps them).
        full = r.get("adapter") is None
        r.set("gradient_checkpointing", gc, "--grad-checkpointing", full)
        r.set("activation_offloading", offload, "--offload-activations", "streamed")
        reentrant = reentrant and full
    else:
        r.set("gradient_checkpointing", gc, "--grad-checkpointing", bool(gc))
        r.ignore("activation_offloading")
    if reentrant:
        r.set("gradient_checkpointing_kwargs.use_reentrant", True, "--checkpoint-reentrant", True)


def _attn_name(r: Reader) -> str | None:
    """attn_implementation, or the legacy switch it replaces (utils/schemas/config.py normalize_attn_implementation)."""
    value = r.get("attn_implementation")
    legacy = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "eager_attention": "eager",
              "flex_attention": "flex_attention", "xformers_attention": "xformers", "sage_attention": "sage"}
    for key, name in legacy.items():
        if r.get(key, False):
            if value is not None:
                r.bad(key, True, "Axolotl rejects a legacy attention switch beside attn_implementation",
                      f"drop {key}")
            value = name
    return value


def _attention(r: Reader) -> None:
    _hf.attention(r, "attn_implementation", _attn_name(r))


def _loss(r: Reader) -> None:
    plugins = r.get("plugins", [], kind=list)
    if not all(isinstance(p, str) for p in plugins):
        r.bad("plugins", plugins, "must list plugin class paths", "e.g. [axolotl.integrations.liger.LigerPlugin]")
    cce = any(p.endswith("CutCrossEntropyPlugin") for p in plugins) and r.get("cut_cross_entropy", True)
    liger = any(p.endswith("LigerPlugin") for p in plugins) and r.get("liger_fused_linear_cross_entropy", False)
    if cce and liger:
        r.bad("plugins", plugins, "Cut Cross-Entropy and liger's fused cross-entropy both replace the loss", "pick one")
    if cce:
        r.set("cut_cross_entropy", True, "--loss", "cce")
    elif liger:
        r.set("liger_fused_linear_cross_entropy", True, "--loss", "liger")
    else:
        r.set("loss", "transformers' ForCausalLMLoss (full logits)", None)
    for p in plugins:
        if not (p.endswith("CutCrossEntropyPlugin") or p.endswith("LigerPlugin")):
            r.refuse("plugins", p, "this plugin is not modelled", "drop it to estimate the rest")


def _distributed(r: Reader) -> None:
    ds = r.get("deepspeed")
    fsdp_cfg = r.get("fsdp_config")
    if ds is not None and fsdp_cfg is not None:
        r.bad("deepspeed", "...", "DeepSpeed and FSDP together", "pick one")
    if ds is not None:
        _hf.deepspeed(r, "deepspeed", ds)
    if fsdp_cfg is not None or r.get("fsdp"):
        if fsdp_cfg is not None and not isinstance(fsdp_cfg, dict):
            r.bad("fsdp_config", fsdp_cfg, "must be a mapping", "write fsdp_config's keys under it")
        cfg = {k.removeprefix("fsdp_"): v for k, v in (fsdp_cfg or {}).items()}  # validation.py strips the prefix
        version = r.get("fsdp_version", kind=int) or cfg.get("version") or 1  # validation.py: 1 when unset
        if not isinstance(version, int):
            r.bad("fsdp_config.fsdp_version", version, "must be 1 or 2", "set fsdp_version: 2")
        r.ignore("fsdp")
        _hf.fsdp(r, "fsdp_config", version=version, offload=bool(cfg.get("offload_params", False)),
                 reshard=cfg.get("reshard_after_forward", True) is not False,
                 checkpointing=cfg.get("activation_checkpointing"))
        read = {"version", "offload_params", "reshard_after_forward", "activation_checkpointing", "state_dict_type",
                "auto_wrap_policy", "transformer_layer_cls_to_wrap", "cpu_ram_efficient_loading"}
        for key, value in cfg.items():
            if key not in read:
                r.skip(f"fsdp_config.{key}", value, "not read by the estimate (FSDP2 per decoder layer, in the "
                       "training dtype)")
