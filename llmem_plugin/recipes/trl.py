"""TRL SFT and DPO configs (trl 1.16.0): ``trl sft|dpo --config FILE``, or an ``SFTConfig``/``DPOConfig`` saved as JSON.

The YAML is flat: ``TrlParser((ScriptArguments, SFTConfig, ModelConfig,
DatasetMixtureConfig))`` reads every key, and keys no dataclass takes go to
``accelerate launch`` (trl/scripts/sft.py, scripts/utils.py,
cli/commands/training.py). Paths below are in the 1.16.0 wheel. Memory rules
read from it:

- the loss is the fused LM head (``add_fused_lm_head``, sft_trainer.py):
  ``--loss trl-fused`` (:mod:`llmem_plugin.techniques.trl_head`), unless
  ``label_smoothing_factor`` or a custom loss needs the full logits;
- ``dtype`` defaults to float32 (trainer/model_config.py), ``bf16`` to true
  and ``gradient_checkpointing`` to true (trainer/base_config.py): fp32 weights
  under bf16 autocast by default, non-reentrant checkpointing unless
  ``gradient_checkpointing_kwargs`` says otherwise;
- LoRA (``use_peft``) defaults rank 16, alpha 32, dropout 0.05, peft's
  per-architecture targets; adapters are fp32 on a 16-bit model (peft's
  ``autocast_adapter_dtype``), bf16 on a quantized one (sft_trainer.py casts
  them), and no k-bit preparation runs;
- ``packing`` with the ``bfd`` strategies turns on the padding-free collator:
  one row of the micro-batch's documents with ``cu_seq_lens`` for flash
  attention's varlen kernel; ``wrapped`` cuts full rows with no boundaries;
- ``max_length`` (1024) bounds every row.

A DPO config is told from a key only ``DPOConfig`` has (``beta``,
``precompute_ref_log_probs``, ...; trl_keys.json ``dpo_defaults``) or a DPO
``loss_type``, or named with ``--config-format trl-dpo``; a key only another
trainer's config has (GRPO, RLOO, KTO, reward, distillation: ``other_keys``)
is refused. DPOTrainer (trainer/dpo_trainer.py) concatenates each pair's
chosen and rejected rows (``--batch-size`` is twice ``per_device_train_batch_size``),
scores them with the fused head, and scores them again with the reference under
no_grad: with ``use_peft`` the policy with its adapters disabled, otherwise a
copy loaded in the policy's dtype (``--reference-model``, :mod:`llmem_plugin.techniques.reference`).
``disable_dropout`` (default true) zeroes every dropout, LoRA's included.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from llmem_plugin.recipes import Reader, Recipe, _hf

__all__ = ["read"]

VERSION = "1.16.0"

_IGNORED = {
    "output_dir", "dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split",
    "dataset_streaming", "dataset_text_field", "dataset_num_proc", "datasets", "streaming", "learning_rate",
    "num_train_epochs", "max_steps", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_ratio", "warmup_steps",
    "weight_decay", "logging_steps", "logging_strategy", "logging_dir", "save_steps", "save_strategy",
    "save_total_limit", "eval_strategy", "eval_steps", "per_device_eval_batch_size", "report_to", "run_name",
    "push_to_hub", "hub_model_id", "hub_strategy", "seed", "data_seed", "max_grad_norm", "adam_beta1",
    "adam_beta2", "adam_epsilon", "trust_remote_code", "model_revision", "eos_token", "pad_token",
    "chat_template_path", "dataloader_num_workers", "dataloader_pin_memory", "dataloader_drop_last",
    "remove_unused_columns", "ignore_data_skip", "log_level", "disable_tqdm", "overwrite_output_dir",
    "do_train", "do_eval", "use_cpu", "ddp_timeout", "resume_from_checkpoint", "shuffle_dataset",
    "completion_only_loss", "assistant_only_loss", "dataset_kwargs", "use_rslora", "lora_task_type",
    "ignore_bias_buffers", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs", "env",
    "hub_token", "logging_first_step", "log_on_each_node", "logging_nan_inf_filter", "log_level_replica",
    "project", "eval_delay", "eval_do_concat_batches", "dataloader_in_order", "train_sampling_strategy",
    "length_column_name", "skip_memory_metrics", "local_rank", "accelerator_config", "save_on_each_node",
    "save_only_model", "include_num_input_tokens_seen", "average_tokens_across_devices", "trackio_space_id",
}
_REFUSED = {
    "use_liger_kernel": "TRL 1.16 raises on it (its fused head replaces liger's)",
    "label_smoothing_factor": "label smoothing runs a full-logits forward beside the fused head",
    "use_dora": "DoRA's per-forward weight norms are not modelled",
    "lora_modules_to_save": "full trainable copies of whole modules (modules_to_save) are not modelled",
    "lora_target_parameters": "LoRA on MoE expert parameters is not modelled",
    "torch_empty_cache_steps": "emptying the cache between steps is not modelled",
    "neftune_noise_alpha": "NEFTune's noisy embeddings are not modelled",
}
# DPOTrainer's loss types (trl/trainer/dpo_trainer.py _compute_loss)
_DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
               "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
# peft's default targets per model_type (peft/utils/constants.py TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
_PEFT_TARGETS = {"llama": "q_proj,v_proj", "mistral": "q_proj,v_proj", "qwen2": "q_proj,v_proj",
                 "qwen3": "q_proj,v_proj", "gemma": "q_proj,v_proj", "gemma2": "q_proj,v_proj",
                 "mixtral": "q_proj,v_proj", "phi3": "qkv_proj", "gpt2": "c_attn", "opt": "q_proj,v_proj"}
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "auto": None}
# trl/accelerate_configs/*.yaml: the preset's distributed type
_ACCELERATE = {"zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "fsdp2": "fsdp", "multi_gpu": "ddp",
               "single_gpu": None}


def _keys(table: str = "defaults") -> dict[str, Any]:
    """Every key of the four dataclasses, with its default, or DPOConfig's own (trl_keys.json, checked against
    the wheel)."""
    return json.loads(resources.files("llmem_plugin.recipes").joinpath("trl_keys.json").read_text())[table]


def _is_dpo(raw: dict[str, Any]) -> bool:
    losses = raw.get("loss_type")
    losses = losses if isinstance(losses, list) else [losses]
    return bool(_keys("dpo_defaults").keys() & raw.keys()) or any(t in _DPO_LOSSES for t in losses)


def read(raw: dict[str, Any], path: str, trainer: str | None = None) -> Recipe:
    """Map a TRL SFT or DPO config to ``llmem estimate`` options.

    Args:
        raw: The file's mapping.
        path: The file.
        trainer: ``"sft"`` or ``"dpo"`` (``--config-format trl-sft``/``trl-dpo``); None: told from the keys.

    Raises:
        ConfigError: A value TRL rejects (padding_free with a max_length, 4- and 8-bit together).
        UnsupportedError: A key whose memory is not modelled (see ``_REFUSED``), or another trainer's key.
    """
    other = _keys("other_keys")
    found = sorted(other.keys() & raw.keys())
    if found:
        from llmem_plugin.errors import UnsupportedError

        raise UnsupportedError(f"--config {path!r}: {found[0]} is a {other[found[0]]} key: that TRL trainer is not "
                               "modelled (generation, a teacher or another loss). HINT: estimate an SFT or DPO "
                               "config")
    dpo = trainer == "dpo" if trainer else _is_dpo(raw)
    name = "DPOTrainer" if dpo else "SFTTrainer"
    r = Reader(Recipe("trl", path, f"trl {VERSION} ({name})"), raw)
    r.refuse_set(_REFUSED)
    if trainer is None and not dpo:
        r.note("read as `trl sft` (no DPOConfig key): for a `trl dpo` file pass --config-format trl-dpo")
    if dpo:
        _dpo(r)
    elif r.get("loss_type", "nll") not in ("nll", "chunked_nll", "dft"):
        r.refuse("loss_type", r.get("loss_type"), "only nll (and its dft reweighting) is modelled", "use nll")
    model = r.get("model_name_or_path")
    if isinstance(model, str):
        r.set("model_name_or_path", model, "--model", model)
    else:  # an SFTConfig/TrainingArguments JSON holds no ModelConfig
        r.require("--model", "the file names no model_name_or_path (an SFTConfig holds none). HINT: pass --model")
    r.set("(trainer)", f"{name} (transformers Trainer)", "--runner", "hf-trainer")
    r.set("(loss)", "TRL's fused LM head (add_fused_lm_head)", "--loss", "trl-fused")
    init = _mapping(r, "model_init_kwargs")
    quantized = _quantization(r)
    weights = _precision(r, init, quantized)
    _batch(r, dpo)
    _peft(r, model, weights, quantized, no_dropout=dpo and r.get("disable_dropout", True))
    _checkpointing(r)
    _hf.optimizer(r, "optim", "adamw_torch_fused")  # transformers 5.24 default (torch >= 2.8)
    _hf.attention(r, "attn_implementation", init.get("attn_implementation", r.get("attn_implementation")))
    if r.get("activation_offloading", False):
        r.set("activation_offloading", True, "--offload-activations", "streamed")  # models/activation_offloading.py
    if r.get("completion_only_loss") or r.get("assistant_only_loss"):
        r.note("completion/assistant-only loss: the fused head scores only those tokens; every token is estimated "
               "(an upper bound)")
    if _mapping(r, "dataset_kwargs").get("skip_prepare_dataset"):
        r.note("dataset_kwargs.skip_prepare_dataset: TRL does not truncate to max_length; rows are taken at "
               "max_length")
    _distributed(r)
    r.ignore("model_init_kwargs")
    for key in init:
        if key not in ("dtype", "torch_dtype", "attn_implementation"):
            r.skip(f"model_init_kwargs.{key}", init[key], "not read by the estimate")
    schema = {**_keys(), **_keys("dpo_defaults")} if dpo else _keys()
    return r.finish(_IGNORED, schema=f"trl {VERSION} (trl {'dpo' if dpo else 'sft'} passes it to accelerate launch)",
                    schema_keys=schema)


def _precision(r: Reader, init: dict, quantized: bool) -> str:
    """The weights' dtype (ModelConfig.dtype, default float32; model_init_kwargs overrides) and autocast."""
    dtype = str(init.get("dtype", init.get("torch_dtype", r.get("dtype", "float32"))))
    if dtype not in _DTYPES or _DTYPES[dtype] is None:
        r.refuse("dtype", dtype, "the checkpoint's own dtype ('auto') is not read here", "set dtype: bfloat16 or "
                 "float32")
    weights = _DTYPES[dtype]
    fp16 = bool(r.get("fp16", False))
    bf16 = r.get("bf16")
    bf16 = (not fp16) if bf16 is None else bool(bf16)  # base_config.py: None means not fp16
    if quantized and weights != "bf16":
        r.refuse("dtype", dtype, "TRL casts a quantized model's adapters to bf16 over a compute dtype of "
                 f"{dtype} (trainer/utils.py get_quantization_config), a mix that is not modelled",
                 "set dtype: bfloat16 with load_in_4bit")
    _hf.precision(r, "dtype", dtype, bf16=bf16, fp16=fp16, weights=weights)
    r.ignore("bf16", "fp16")
    return weights


def _quantization(r: Reader) -> bool:
    four, eight = bool(r.get("load_in_4bit", False)), bool(r.get("load_in_8bit", False))
    if four and eight:
        r.bad("load_in_4bit", True, "TRL rejects 4- and 8-bit together (trainer/model_config.py)", "pick one")
    if not (four or eight):
        r.ignore("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")
        return False
    if not r.get("use_peft", False):
        r.bad("load_in_4bit" if four else "load_in_8bit", True, "quantized weights train through LoRA only",
              "set use_peft: true")
    if four:
        r.set("load_in_4bit", True, "--quantize", r.get("bnb_4bit_quant_type", "nf4"))
        nested = bool(r.get("use_bnb_nested_quant", False))
        r.set("use_bnb_nested_quant", nested, "--double-quant", nested)
        if r.get("bnb_4bit_quant_storage") not in (None, "uint8"):
            r.refuse("bnb_4bit_quant_storage", r.get("bnb_4bit_quant_storage"), "only uint8 storage is modelled",
                     "drop it")
    else:
        r.set("load_in_8bit", True, "--quantize", "int8")
    r.set("(k-bit preparation)", "not called by SFTTrainer", "--kbit-prepare", "off")
    return True


def _batch(r: Reader, dpo: bool = False) -> None:
    max_length = r.raw.get("max_length", 1024)  # sft_config.py, dpo_config.py; null (no truncation) is a value
    r.get("max_length", kind=int)
    batch = r.get("per_device_train_batch_size", 8, kind=int)  # TrainingArguments
    # DPO: DataCollatorForPreference stacks the chosen rows, then the rejected ones (dpo_trainer.py)
    r.set("per_device_train_batch_size", f"{batch} pairs" if dpo else batch, "--batch-size", 2 * batch if dpo else batch)
    accum = r.get("gradient_accumulation_steps", 1, kind=int)
    r.set("gradient_accumulation_steps", accum, "--grad-accum", accum)
    if dpo:
        if r.get("padding_free", False):
            r.set("padding_free", True, None)
            r.note("padding_free: DPOTrainer 1.16 turns it off (dpo_trainer.py) and pads each batch")
        if max_length is None:
            r.require("--seq-len", "max_length is null: rows are as long as the dataset's prompt and completion. "
                      "HINT: pass --seq-len, or set max_length")
        else:
            r.set("max_length", max_length, "--seq-len", max_length)
            r.note("each batch is padded to its longest prompt + completion, at most max_length: every batch is "
                   "taken at max_length, every completion token scored (an upper bound)")
        return
    packing = r.get("packing", False, kind=bool)
    strategy = r.get("packing_strategy", "bfd", kind=str)
    strategy = {"bfd-requeue": "bfd_split"}.get(strategy, strategy)  # sft_config.py: the old name
    if strategy not in ("bfd", "bfd_split", "wrapped"):
        r.bad("packing_strategy", strategy, "not one of bfd, bfd_split, wrapped", "pick one")
    padding_free = r.get("padding_free", False) or (packing and strategy in ("bfd", "bfd_split"))
    if r.get("padding_free", False) and not packing and max_length is not None:
        r.bad("padding_free", True, "TRL requires max_length: null for padding-free without packing "
              "(sft_trainer.py)", "set packing: true, or max_length: null")
    if max_length is None:
        r.require("--seq-len", "max_length is null: rows are as long as the dataset's samples. HINT: pass --seq-len "
                  "(the longest sample), or set max_length")
    else:
        r.set("max_length", max_length, "--seq-len", max_length)
    r.set("packing", packing, None)
    if padding_free:
        r.set("packing_strategy" if packing else "padding_free", strategy if packing else True,
              "--packed-boundaries", "collator")
        r.require("--packed-docs", "padding-free batches send the micro-batch's samples as one row, but how many "
                  "fit depends on the dataset. HINT: pass --packed-docs N (documents per micro-batch)")
        r.note("packing: every row is taken full (per_device_train_batch_size x max_length tokens: an upper bound)")
    elif packing:
        r.set("packing_strategy", strategy, None)
        r.note("packing_strategy: wrapped: full rows of max_length, attention across the samples")
    else:
        r.note("each batch is padded to its longest sample, at most max_length: every batch is taken at max_length "
               "(an upper bound; --seq-lens replays a dataset's lengths)")


def _dpo(r: Reader) -> None:
    """DPOConfig's own keys: the reference forward, and what the step does not model."""
    from llmem_plugin.techniques.trl_head import DPO_REFUSED

    for key, why in DPO_REFUSED.items():
        if r.get(key, False, kind=bool):
            r.refuse(key, True, why, f"set {key}: false")
    r.ignore("precompute_ref_batch_size", "precompute_ref_log_probs", "use_weighting")
    r.set("(reference)", "the policy with its adapters disabled (use_peft), else a frozen copy in its dtype",
          "--reference-model", True)
    losses = r.get("loss_type", ["sigmoid"])
    for t in losses if isinstance(losses, list) else [losses]:
        if t not in _DPO_LOSSES:
            r.bad("loss_type", t, "not a DPOTrainer loss", f"use one of {', '.join(_DPO_LOSSES)}")
    # Each loss type is arithmetic on [pairs] tensors (dpo_trainer.py _compute_loss): 512-byte blocks.
    r.ignore("loss_type", "loss_weights", "beta", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef",
             "label_smoothing", "discopop_tau", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
             "disable_dropout")


def _peft(r: Reader, model: str, weights: str, quantized: bool, no_dropout: bool = False) -> None:
    if not r.get("use_peft", False):
        r.ignore("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
        return
    rank, alpha = r.get("lora_r", 16, kind=int), r.get("lora_alpha", 32, kind=(int, float))
    dropout = r.get("lora_dropout", 0.05, kind=(int, float))
    r.set("use_peft", True, None)
    r.set("lora_r", rank, "--lora-rank", rank)
    r.set("lora_alpha", alpha, "--lora-alpha", alpha)
    if no_dropout:  # DPOConfig.disable_dropout: trl's disable_dropout_in_model sets every Dropout's p to 0
        r.set("lora_dropout", f"{dropout} (disable_dropout: 0)", None)
    else:
        r.set("lora_dropout", dropout, "--lora-dropout", dropout if dropout else None)
    targets = r.get("lora_target_modules", kind=(str, list))
    if targets is None:
        targets = _default_targets(r, model)
    elif isinstance(targets, list):
        if not all(isinstance(t, str) for t in targets):
            r.bad("lora_target_modules", targets, "must list module names", "e.g. [q_proj, v_proj]")
        targets = ",".join(targets)
    if targets in ("all-linear", "all_linear"):
        targets = "all-linear"
    if "lm_head" in str(targets).split(","):
        r.bad("lora_target_modules", targets, "SFTTrainer rejects a LoRA on lm_head (its fused head reads the "
              "weight)", "drop lm_head")
    r.set("lora_target_modules", r.get("lora_target_modules", "peft default"), "--lora-targets", targets)
    # sft_trainer.py: a quantized model's adapters go to bf16, the model's dtype here; a 16-bit one's are
    # upcast to fp32 by peft (autocast_adapter_dtype), except under ZeRO-3
    r.set("(adapter dtype)", "bf16 (quantized model)" if quantized else "peft's fp32 upcast",
          "--lora-adapter-dtype", "base" if quantized else "fp32")


def _default_targets(r: Reader, model: str | None) -> str:
    from llmem_plugin.models import catalog

    name = catalog.lookup(model) if model else None
    kind = catalog.config_dict(name).get("model_type") if name else None
    if kind not in _PEFT_TARGETS:
        r.refuse("lora_target_modules", "null", f"peft's default targets for model type {kind or 'unknown'} are not "
                 "mapped here", "list lora_target_modules")
    return _PEFT_TARGETS[kind]


def _checkpointing(r: Reader) -> None:
    gc = r.get("gradient_checkpointing", r.get("activation_checkpointing", True))  # base_config.py: True
    r.set("gradient_checkpointing", gc, "--grad-checkpointing", bool(gc))
    kwargs = r.get("gradient_checkpointing_kwargs") or r.get("activation_checkpointing_kwargs") or {}
    if isinstance(kwargs, str):  # TrainingArguments takes a JSON string too
        try:
            kwargs = json.loads(kwargs)
        except ValueError:
            kwargs = None
    if not isinstance(kwargs, dict):
        r.bad("gradient_checkpointing_kwargs", kwargs, "must be a mapping (or its JSON)", "e.g. {use_reentrant: "
              "false}")
    if gc and kwargs.get("use_reentrant"):
        r.set("gradient_checkpointing_kwargs.use_reentrant", True, "--checkpoint-reentrant", True)
    for key in kwargs:
        if key not in ("use_reentrant",):
            r.refuse(f"gradient_checkpointing_kwargs.{key}", kwargs[key], "this checkpointing option is not mapped",
                     "drop it")
    r.ignore("activation_checkpointing")


def _distributed(r: Reader) -> None:
    ds = r.get("deepspeed")
    if ds:
        method = _hf.deepspeed(r, "deepspeed", ds)
        _sharded(r, "deepspeed", method)
        return
    if _hf.trainer_fsdp(r):
        _sharded(r, "fsdp", "fsdp")
        return
    preset = r.get("accelerate_config", kind=str)
    if preset is not None:
        if preset not in _ACCELERATE:
            r.refuse("accelerate_config", preset, "only TRL's shipped presets are mapped",
                     f"use one of {', '.join(_ACCELERATE)}")
        if _ACCELERATE[preset]:
            _sharded(r, "accelerate_config", _ACCELERATE[preset])
            r.set("accelerate_config", preset, "--method", _ACCELERATE[preset])
        else:
            r.set("accelerate_config", preset, None)
    processes = r.get("num_processes", kind=int)
    if processes is not None:
        r.set("num_processes", processes, "--gpus", processes)
    elif preset not in (None, "single_gpu"):
        r.note(f"accelerate_config: {preset}: the world size is not in the file: pass --gpus N (the preset's "
               "num_processes is 8)")


def _sharded(r: Reader, key: str, method: str) -> None:
    """TRL's fused head under a method that shards lm_head (ZeRO-3, FSDP) is not modelled: refuse it here."""
    if method in ("zero3", "fsdp"):
        r.refuse(key, method, "TRL's fused head gathers the sharded lm_head itself (trainer/utils.py "
                 "maybe_gather_lm_head_ctx, full_tensor), which is not modelled", "estimate with ZeRO-1/2 or DDP")


def _mapping(r: Reader, key: str) -> dict:
    value = r.get(key, {})
    if isinstance(value, str):  # TrainingArguments takes dict arguments as JSON strings too
        try:
            value = json.loads(value)
        except ValueError:
            pass
    if not isinstance(value, dict):
        r.bad(key, value, "must be a mapping (or its JSON)", f"fix {key}")
    return value
