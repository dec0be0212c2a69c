"""LLaMA-Factory training YAMLs (llamafactory 0.9.5).

The parser is ``HfArgumentParser`` over ModelArguments, DataArguments,
Seq2SeqTrainingArguments, FinetuningArguments and GeneratingArguments
(hparams/parser.py), which rejects unknown keys. Paths below are in the 0.9.5
wheel. Memory rules read from it:

- weights load in the checkpoint's dtype (``torch_dtype="auto"``,
  model/loader.py); trainable parameters are then upcast to fp32 unless
  ``pure_bf16`` or ZeRO-3 without quantization (model/adapter.py
  ``init_adapter``): LoRA adapters fp32, a full fine-tune's weights fp32 (so
  bf16 training of a full fine-tune is mixed precision);
- gradient checkpointing is on unless ``disable_gradient_checkpointing``, and
  reentrant unless ``use_reentrant_gc: false`` (hparams/model_args.py;
  model/model_utils/checkpointing.py checkpoints the layers that train);
- QLoRA (``quantization_bit``) builds bitsandbytes' config with double
  quantization on and never calls peft's ``prepare_model_for_kbit_training``:
  the 16-bit parameters stay 16-bit (``--kbit-prepare off``), norms go to fp32
  only with ``upcast_layernorm``;
- SFT batches are padded to the longest sample, to a multiple of 8
  (train/sft/workflow.py ``pad_to_multiple_of=8``), at most ``cutoff_len``;
  pre-training packs blocks of ``cutoff_len`` (``packing`` defaults to true
  for ``stage: pt``, hparams/parser.py);
- the loss is the model's own (Seq2SeqTrainer, ForCausalLMLoss), or liger's
  fused one with ``enable_liger_kernel`` for pt/sft (model/model_utils/liger_kernel.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from importlib import resources
from typing import Any

from llmem_plugin.recipes import Reader, Recipe, _hf

__all__ = ["read"]

VERSION = "0.9.5"

_IGNORED = {
    "do_train", "do_eval", "do_predict", "dataset", "eval_dataset", "dataset_dir", "template", "max_samples",
    "overwrite_cache", "preprocessing_num_workers", "output_dir", "logging_steps", "save_steps", "plot_loss",
    "overwrite_output_dir", "save_only_model", "report_to", "learning_rate", "num_train_epochs",
    "lr_scheduler_type", "warmup_ratio", "warmup_steps", "ddp_timeout", "resume_from_checkpoint", "val_size",
    "per_device_eval_batch_size", "eval_strategy", "eval_steps", "trust_remote_code", "seed", "save_strategy",
    "logging_dir", "run_name", "weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2", "adam_epsilon",
    "save_total_limit", "push_to_hub", "hub_model_id", "tokenized_path", "streaming", "buffer_size",
    "mix_strategy", "interleave_probs", "dataloader_num_workers", "dataloader_pin_memory", "include_num_input_tokens_seen",
    "train_on_prompt", "mask_history", "image_max_pixels", "video_max_pixels", "cache_dir", "hf_hub_token",
    "ms_hub_token", "om_hub_token", "print_param_status", "use_rslora", "pissa_init", "pissa_iter",
    "pissa_convert",
}
_REFUSED = {
    "use_unsloth": "Unsloth's patched kernels are not modelled",
    "use_unsloth_gc": "Unsloth's offloaded checkpoints are not modelled",
    "use_galore": "GaLore's projected optimizer is not modelled",
    "use_apollo": "APOLLO is not modelled",
    "use_badam": "BAdam is not modelled",
    "use_adam_mini": "Adam-mini is not modelled",
    "use_muon": "Muon is not modelled",
    "use_llama_pro": "LLaMA Pro's expanded layers are not modelled",
    "shift_attn": "LongLoRA's shifted sparse attention is not modelled",
    "mixture_of_depths": "mixture of depths is not modelled",
    "neat_packing": "neat packing's block-diagonal 4D mask is not modelled",
    "additional_target": "full trainable copies of whole modules (modules_to_save) are not modelled",
    "use_dora": "DoRA's per-forward weight norms are not modelled",
    "resize_vocab": "resized embeddings are not modelled",
    "use_dft_loss": "the DFT loss is not modelled",
    "use_eaft_loss": "the EAFT loss is not modelled",
    "use_asft_loss": "ASFT's reference model is not modelled",
    "adapter_name_or_path": "resuming from adapters already trained is not modelled",
}
_ATTN = {"auto": None, "sdpa": "sdpa", "disabled": "eager", "fa2": "flash_attention_2"}  # model/model_utils/attention.py


def _keys() -> set[str]:
    import transformers

    own = json.loads(resources.files("llmem_plugin.recipes").joinpath("llamafactory_keys.json").read_text())["keys"]
    return set(own) | {f.name for f in dataclasses.fields(transformers.Seq2SeqTrainingArguments)}


def read(raw: dict[str, Any], path: str) -> Recipe:
    """Map a LLaMA-Factory training YAML to ``llmem estimate`` options.

    Raises:
        ConfigError: A value LLaMA-Factory rejects.
        UnsupportedError: A stage, method or option whose memory is not modelled (see ``_REFUSED``).
    """
    r = Reader(Recipe("llamafactory", path, f"llamafactory {VERSION}"), raw)
    r.refuse_set(_REFUSED)
    stage = r.get("stage", "sft")  # hparams/finetuning_args.py
    if stage not in ("sft", "pt"):
        r.refuse("stage", stage, "only the sft and pt stages are mapped (preference stages run a reference model "
                 "and paired batches)", "estimate stage: sft")
    r.set("stage", stage, None)
    model = r.get("model_name_or_path")
    if not isinstance(model, str):
        r.bad("model_name_or_path", model, "LLaMA-Factory needs the model", "set model_name_or_path")
    r.set("model_name_or_path", model, "--model", model)
    r.set("(trainer)", "Seq2SeqTrainer (CustomSeq2SeqTrainer)", "--runner", "hf-trainer")
    zero3 = _distributed(r)
    method = r.get("finetuning_type", "lora")  # hparams/finetuning_args.py: the default is lora
    if method not in ("lora", "full"):
        r.refuse("finetuning_type", method, "freeze tuning (fp32 trainable layers beside 16-bit frozen ones) and "
                 "OFT are not modelled", "use lora or full")
    quantized = r.get("quantization_bit") is not None
    upcast = not r.get("pure_bf16", False) and not (zero3 and not quantized)  # model/adapter.py init_adapter
    _precision(r, model, method, upcast)
    _batch(r, stage)
    if method == "lora":
        _lora(r, upcast)
    elif quantized:
        r.bad("quantization_bit", r.get("quantization_bit"), "LLaMA-Factory quantizes for lora only",
              "use finetuning_type: lora")
    if quantized:
        _quantization(r)
    _checkpointing(r)
    _hf.optimizer(r, "optim", "adamw_torch_fused")  # transformers 5.24 TrainingArguments default
    flash = r.get("flash_attn", "auto")
    if flash not in _ATTN:
        r.refuse("flash_attn", flash, "only auto, sdpa, disabled and fa2 are modelled", "use fa2 or sdpa")
    _hf.attention(r, "flash_attn", _ATTN[flash])
    if r.get("enable_liger_kernel", False):
        r.set("enable_liger_kernel", True, "--loss", "liger")
        r.note("enable_liger_kernel: liger's fused cross-entropy is modelled; its RMSNorm, RoPE and SwiGLU kernels "
               "are not (the layers run as transformers writes them)")
    if r.get("torch_compile", False):
        r.skip("torch_compile", True, "torch.compile is not modelled; the eager step is estimated")
    if r.get("upcast_lmhead_output", False):
        r.skip("upcast_lmhead_output", True, "the hook's fp32 logits are not modelled apart from the loss's own "
               "fp32 copy")
    return r.finish(_IGNORED, schema=f"llamafactory {VERSION} (its parser rejects it)", schema_keys=_keys())


def _checkpoint_dtype(model: str) -> str | None:
    """The checkpoint's dtype (config.json ``torch_dtype``/``dtype``), from the catalog or a local config."""
    from llmem_plugin.models import catalog

    name = catalog.lookup(model)
    if name is not None:
        cfg = catalog.config_dict(name)
    else:
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if not (os.path.isfile(path) and path.endswith(".json")):
            return None
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("torch_dtype")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(dtype))


def _precision(r: Reader, model: str, method: str, upcast: bool) -> None:
    bf16, fp16, pure = r.get("bf16", False), r.get("fp16", False), r.get("pure_bf16", False)
    weights = _checkpoint_dtype(model)
    if weights is None:
        mixed = "bf16-mixed" if method == "full" and upcast else "bf16"
        r.require("--precision", f"model_name_or_path={model}: its checkpoint dtype (which LLaMA-Factory loads, "
                  f"torch_dtype='auto') is not known here. HINT: pass --precision ({mixed} for a bf16 checkpoint "
                  f"{'and fp32 trainable weights' if mixed == 'bf16-mixed' else 'with bf16 training'})")
        return
    if pure:
        weights = "bf16"
    elif method == "full" and upcast:
        weights = "fp32"  # every trainable parameter upcast to fp32
    key = "pure_bf16" if pure else "bf16" if bf16 else "fp16" if fp16 else "bf16"
    _hf.precision(r, key, pure or bf16 or fp16, bf16=bool(bf16 or pure), fp16=bool(fp16), weights=weights)
    if not (bf16 or fp16 or pure) and weights == "bf16":
        r.note("no bf16/fp16 key: the Trainer runs without autocast over the bf16 checkpoint")


def _batch(r: Reader, stage: str) -> None:
    cutoff = r.get("cutoff_len", 2048, kind=int)  # hparams/data_args.py
    packing = r.get("packing", stage == "pt")  # hparams/parser.py: pt packs by default
    if stage == "pt":
        seq = cutoff  # blocks of cutoff_len (data/processor/pretrain.py)
        r.note("pt: rows are blocks of exactly cutoff_len tokens")
    else:
        if packing:
            cutoff -= 1  # hparams/data_args.py __post_init__: packing shortens cutoff_len by one
        seq = 8 * math.ceil(cutoff / 8)  # DataCollator pad_to_multiple_of=8 (train/sft/workflow.py)
        r.note("each batch is padded to its longest sample (a multiple of 8), at most cutoff_len: every batch is "
               "taken at that length (an upper bound; --seq-lens replays a dataset's lengths)")
    r.set("cutoff_len", r.get("cutoff_len", 2048), "--seq-len", seq)
    r.set("packing", packing, None)
    batch = r.get("per_device_train_batch_size", 8, kind=int)  # transformers TrainingArguments default
    r.set("per_device_train_batch_size", batch, "--batch-size", batch)
    accum = r.get("gradient_accumulation_steps", 1, kind=int)
    r.set("gradient_accumulation_steps", accum, "--grad-accum", accum)


def _lora(r: Reader, upcast: bool) -> None:
    rank = r.get("lora_rank", 8, kind=int)  # hparams/finetuning_args.py
    alpha = r.get("lora_alpha", kind=(int, float)) or 2 * rank  # __post_init__: lora_rank * 2
    r.set("lora_rank", rank, "--lora-rank", rank)
    r.set("lora_alpha", r.get("lora_alpha", f"2 x rank = {alpha}"), "--lora-alpha", alpha)
    dropout = r.get("lora_dropout", 0.0)
    r.set("lora_dropout", dropout, "--lora-dropout", dropout if dropout else None)
    target = r.get("lora_target", "all", kind=(str, list))  # a list, or comma-separated (split_arg)
    parts = target if isinstance(target, list) else str(target).split(",")
    targets = [str(t).strip() for t in parts if str(t).strip()]
    # "all": every Linear but the output head (model/model_utils/misc.py find_all_linear_modules)
    r.set("lora_target", target, "--lora-targets", "all-linear" if targets == ["all"] else ",".join(targets))
    r.set("(upcast)", "trainable parameters to fp32" if upcast else "adapters in the model's dtype",
          "--lora-adapter-dtype", "fp32" if upcast else "base")


def _quantization(r: Reader) -> None:
    bits = r.get("quantization_bit")
    method = r.get("quantization_method", "bnb")
    if method != "bnb":
        r.refuse("quantization_method", method, "only bitsandbytes quantization is modelled", "use bnb")
    if bits == 4:
        kind = r.get("quantization_type", "nf4")
        r.set("quantization_bit", bits, "--quantize", kind)
        double = r.get("double_quantization", True)
        r.set("double_quantization", double, "--double-quant", bool(double))
    elif bits == 8:
        r.set("quantization_bit", bits, "--quantize", "int8")
    else:
        r.bad("quantization_bit", bits, "bitsandbytes quantizes to 4 or 8 bits", "use 4 or 8")
    norms = r.get("upcast_layernorm", False)
    r.set("upcast_layernorm", norms, "--kbit-prepare", "norms-only" if norms else "off")


def _checkpointing(r: Reader) -> None:
    if r.get("disable_gradient_checkpointing", False):
        r.set("disable_gradient_checkpointing", True, None)
        r.ignore("use_reentrant_gc")
        return
    r.set("disable_gradient_checkpointing", False, "--grad-checkpointing", True)
    reentrant = r.get("use_reentrant_gc", True)
    if r.recipe.options.get("--method") == "fsdp":
        reentrant = False  # model/model_utils/checkpointing.py: forced off under FSDP2
    r.set("use_reentrant_gc", reentrant, "--checkpoint-reentrant", bool(reentrant))


def _distributed(r: Reader) -> bool:
    """DeepSpeed or FSDP from the trainer's keys; True under ZeRO-3."""
    ds = r.get("deepspeed")
    if ds is not None:
        return _hf.deepspeed(r, "deepspeed", ds) == "zero3"
    _hf.trainer_fsdp(r)
    return False
