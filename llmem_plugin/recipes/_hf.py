"""Keys the HF-Trainer-based frameworks share: optimizer and attention names, DeepSpeed and FSDP.

Axolotl, LLaMA-Factory and TRL hand these to ``transformers.TrainingArguments``
(or to ``from_pretrained``) as the user wrote them, so one table serves all
three. Sources: transformers 5.24 ``training_args.py`` ``OptimizerNames`` and
``trainer.py`` ``get_optimizer_cls_and_kwargs`` (``adamw_bnb_8bit`` and
``adamw_8bit`` are bitsandbytes' AdamW with 8-bit states, ``paged_adamw_32bit``
its paged 32-bit AdamW); ``integrations/deepspeed.py`` for the DeepSpeed file.
"""

from __future__ import annotations

import os
from typing import Any

from llmem_plugin.recipes import Reader

__all__ = ["attention", "deepspeed", "fsdp", "optimizer", "precision", "trainer_fsdp"]

# transformers `optim` -> llmem --optimizer
HF_OPTIMIZERS = {
    "adamw_torch_fused": "adamw-fused",
    "adamw_torch": "adamw",  # torch.optim.AdamW, foreach on CUDA
    "adamw_bnb_8bit": "adamw8bit",
    "adamw_8bit": "adamw8bit",
    "paged_adamw_8bit": "paged-adamw8bit",
    "paged_adamw_32bit": "paged-adamw",
    "paged_adamw": "paged-adamw",
    "sgd": "sgd",
}
# transformers attn_implementation values this project models
ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash_attention_2"}


def optimizer(r: Reader, key: str, default: str) -> None:
    name = r.get(key, default, kind=str)
    if name not in HF_OPTIMIZERS:
        r.refuse(key, name, "this optimizer is not modelled", f"use one of {', '.join(HF_OPTIMIZERS)}")
    r.set(key, name, "--optimizer", HF_OPTIMIZERS[name])


def attention(r: Reader, key: str, value: str | None) -> None:
    """``value`` None: transformers' default (sdpa where the model has it)."""
    if value is None:
        r.set(key, "default", None)
        return
    if not isinstance(value, str) or value not in ATTENTION:
        r.refuse(key, value, "this attention implementation is not modelled",
                 f"use one of {', '.join(ATTENTION)}")
    r.set(key, value, "--attn", ATTENTION[value])


def precision(r: Reader, key: str, value: Any, *, bf16: bool, fp16: bool, weights: str) -> None:
    """The trainer's bf16/fp16 switches over weights loaded in ``weights`` ("bf16", "fp16" or "fp32").

    bf16 weights train as pure bf16 whether or not autocast runs over them (the HF adapter's rule,
    integrations/_common.py ``precision_of``); fp32 weights under bf16/fp16 are mixed precision.
    """
    if weights == "fp16":
        r.refuse(key, value, "fp16 weights are trained with fp16 gradients, which torch.amp.GradScaler refuses; "
                 "not modelled", "use bf16 on a GPU that has it, or fp32 weights with fp16 mixed precision")
    if weights == "bf16":
        r.set(key, value, "--precision", "bf16")
    elif bf16:
        r.set(key, value, "--precision", "bf16-mixed")
    elif fp16:
        r.set(key, value, "--precision", "fp16-mixed")
    else:
        r.set(key, value, "--precision", "fp32")
    if weights == "bf16" or bf16:
        r.recipe.bf16_key = f"{key}={value}"


def deepspeed(r: Reader, key: str, value: Any) -> str:
    """A DeepSpeed config (a path, relative to the working directory as the trainer reads it, or a dict);
    returns its method (zero1, zero2, zero3)."""
    import json

    from llmem_plugin.methods.zero import deepspeed_method, read_deepspeed_config

    if isinstance(value, str) and not os.path.isfile(value):
        beside = os.path.join(os.path.dirname(os.path.abspath(r.recipe.path)), value)
        if not os.path.isfile(beside):
            r.bad(key, value, "no such DeepSpeed config file", "pass the path as the trainer would open it, or "
                  "run llmem from the directory the job runs in")
        value = beside
    ds = read_deepspeed_config(value)
    method, _, _ = deepspeed_method(ds)
    r.set(key, value if isinstance(value, str) else "{...}", "--deepspeed-config",
          value if isinstance(value, str) else json.dumps(ds))
    r.note(f"{key}: {method} over --gpus N (the world size is not in the file; default 1)")
    return method


def trainer_fsdp(r: Reader) -> bool:
    """TrainingArguments' ``fsdp`` (a string or list of options) and ``fsdp_config``; True when FSDP is on."""
    fsdp = r.get("fsdp")
    if not fsdp:
        r.ignore("fsdp_config")
        return False
    if not isinstance(fsdp, (str, list)):
        r.bad("fsdp", fsdp, "TrainingArguments takes a string or list of FSDP options", "e.g. fsdp: full_shard")
    options = fsdp.split() if isinstance(fsdp, str) else [str(o) for o in fsdp]
    cfg = r.get("fsdp_config", {}, kind=dict)
    version = cfg.get("version", cfg.get("fsdp_version", 1)) or 1
    if not isinstance(version, int):
        r.bad("fsdp_config.version", version, "must be 1 or 2", "set version: 2")
    fsdp(r, "fsdp", version=version, offload="offload" in options, reshard="shard_grad_op" not in options,
         checkpointing=cfg.get("activation_checkpointing"))
    return True


def fsdp(r: Reader, key: str, *, version: int, offload: bool, reshard: bool, checkpointing: bool | None) -> None:
    if version != 2:
        r.refuse(key, f"fsdp_version={version}", "FSDP1's flat parameters are not modelled (FSDP2 is)",
                 "set fsdp_version: 2")
    if not reshard:
        r.refuse(key, "reshard_after_forward=false", "unsharded parameters kept from forward to backward are not "
                 "modelled", "drop reshard_after_forward")
    r.set(key, "fsdp2", "--method", "fsdp")
    if offload:
        r.set(f"{key}.offload_params", True, "--offload", "params")
    if checkpointing:
        r.set(f"{key}.activation_checkpointing", True, "--grad-checkpointing", True)
    r.note(f"{key}: FSDP2 over --gpus N (the world size is not in the file; default 1)")
