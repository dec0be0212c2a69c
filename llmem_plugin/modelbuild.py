"""Build the model to trace without ever holding its weights.

A model source is a catalog name, a path to a ``config.json`` (or a folder
holding one), a Hub id already in the local cache, a ``PretrainedConfig``, or a
live ``nn.Module``. The model is built on the meta device, LoRA and gradient
checkpointing are applied there (peft and ``Module.to`` cannot operate on fake
parameters, see shared FACTS), and only then are parameters and buffers
swapped for fake tensors.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from typing import Any

import torch
from torch import nn

from llmem_plugin import catalog
from llmem_plugin.errors import ConfigError
from llmem_plugin.workload import LoraSpec, Workload

__all__ = ["ModelSource", "resolve_config", "build_model", "fakeify", "num_layers", "set_num_layers"]

ModelSource = Any  # str | os.PathLike | PretrainedConfig | nn.Module


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def resolve_config(source: ModelSource):
    """Return the ``PretrainedConfig`` named by ``source``.

    Args:
        source: Catalog name or alias, path to a config.json or its folder, a
            Hub id present in the local cache, or a ``PretrainedConfig``.

    Raises:
        ConfigError: Unknown name, unreadable or malformed config.
    """
    import transformers

    _quiet_transformers()
    if isinstance(source, transformers.PretrainedConfig):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            f"model source of type {type(source).__name__} is not supported. "
            "HINT: pass a catalog name, a config.json path, a PretrainedConfig or an nn.Module"
        )
    text = os.fspath(source)
    name = catalog.lookup(text)
    if name is not None:
        return catalog.load_config(name)
    path = text
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        return _config_from_file(path)
    if "/" in text and not text.startswith((".", "/")) and text.count("/") == 1:
        try:
            return transformers.AutoConfig.from_pretrained(text, local_files_only=True)
        except (OSError, ValueError):
            pass
    # Raises the catalog's "unknown model ... did you mean" error.
    catalog.entry(text)
    raise AssertionError("catalog.entry must raise for an unknown name")


def _config_from_file(path: str):
    import transformers

    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"malformed config {path}: {e}. HINT: pass a valid HF config.json") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ConfigError(
            f"malformed config {path}: no 'model_type' field. HINT: a transformers config.json names its model_type"
        )
    model_type = fields.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"malformed config {path}: {msg}. HINT: check model_type and field values") from None


def build_model(source: ModelSource, workload: Workload, *, device: str = "meta") -> nn.Module:
    """Build the causal-LM to train, with the workload's transforms applied.

    Args:
        source: See :func:`resolve_config`; a live ``nn.Module`` is copied as
            structure only (its parameters become meta tensors, its storage is
            never read).
        workload: Precision, LoRA, checkpointing and attention settings.
        device: ``"meta"`` (for fake tracing) or ``"cpu"`` (real weights).

    Raises:
        ConfigError: Bad source, LoRA targets that match nothing.
    """
    import transformers

    _quiet_transformers()
    if isinstance(source, nn.Module):
        model = _structure_copy(source)
        if workload.precision.param_dtype != torch.float32:
            model.to(workload.precision.param_dtype)
    else:
        config = copy.deepcopy(resolve_config(source))
        config.use_cache = False
        with torch.device(device), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model = transformers.AutoModelForCausalLM.from_config(
                    config,
                    attn_implementation=_attn_arg(workload),
                    dtype=workload.precision.param_dtype,
                )
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ConfigError(f"cannot build a causal LM from this config: {msg}") from None
    _check_moe_dtype(model, workload)
    if workload.attn_implementation.value == "flash_attention_2":
        from llmem_plugin.emulation.flash import check_model

        check_model(model)
    if workload.quantize is not None:
        from llmem_plugin.quant import quantize_model

        model = quantize_model(model, workload)
    model.train()
    if workload.grad_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(
                f"{type(model).__name__} does not support gradient checkpointing. HINT: drop --grad-checkpointing"
            )
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if workload.lora is not None:
        model = _apply_lora(model, workload.lora)
    return model


def _attn_arg(workload: Workload) -> str | None:
    value = workload.attn_implementation.value
    if value == "flash_attention_2":
        # The flash-attn package cannot run here (CUDA only): an emulation
        # with its allocations is registered under its own name.
        from llmem_plugin.emulation.flash import attn_implementation_name

        return attn_implementation_name()
    return None if value == "auto" else value


def _check_moe_dtype(model: nn.Module, workload: Workload) -> None:
    """Refuse MoE experts that a CUDA run would reject.

    transformers (integrations/moe.py) runs experts through
    ``torch.nn.functional.grouped_mm`` on CUDA, cast to the expert weights'
    dtype, and the CUDA kernel accepts bf16 only (torch/_meta_registrations.py
    mirrors the checks of ``_grouped_mm_cuda`` in aten/src/ATen/native/cuda/Blas.cpp).
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_experts_implementation", None)
    has_experts = any(type(m).__name__.endswith("Experts") for m in model.modules())
    if has_experts and impl == "grouped_mm" and workload.precision.param_dtype != torch.bfloat16:
        raise ConfigError(
            f"{type(model).__name__} runs its experts with grouped_mm, which on CUDA takes bf16 weights only, "
            f"not {workload.precision.value}. HINT: pass --precision bf16"
        )


def _structure_copy(module: nn.Module) -> nn.Module:
    """Deep-copy ``module`` with every parameter and buffer replaced by a meta tensor."""
    memo: dict[int, Any] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in memo:
            continue
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA needs peft: pip install 'llmem_plugin[lora]'") from None
    targets: Any = "all-linear" if spec.target_modules == ("all-linear",) else list(spec.target_modules)
    if targets != "all-linear":
        names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        missing = [t for t in targets if t not in names and not any(n.endswith(t) for n, _ in model.named_modules())]
        if len(missing) == len(targets):
            raise ConfigError(
                f"LoRA target modules {','.join(missing)} match no module of {type(model).__name__}; "
                f"linear modules are: {','.join(sorted(names))}. HINT: pass --lora-targets with some of them"
            )
    cfg = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    from llmem_plugin.quant import lora_custom_modules

    if custom := lora_custom_modules(model):  # 4-bit stand-ins take peft's 4-bit LoRA layer
        cfg._register_custom_module(custom)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, cfg)


def fakeify(model: nn.Module, fake_mode) -> None:
    """Swap every parameter and buffer of ``model`` for a fake CPU tensor, in place.

    Tied parameters stay tied. Must run outside ``fake_mode``'s context.
    """
    done: dict[int, torch.Tensor] = {}

    def fake_like(t: torch.Tensor) -> torch.Tensor:
        with fake_mode:
            return torch.empty(t.shape, dtype=t.dtype, device="cpu")

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(fake_like(p), requires_grad=p.requires_grad)
            mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if id(b) not in done:
                done[id(b)] = fake_like(b)
            mod._buffers[name] = done[id(b)]


def num_layers(config) -> int:
    """Number of transformer layers in ``config``."""
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    raise ConfigError(f"config of type {type(config).__name__} names no layer count")


def set_num_layers(config, n: int):
    """A copy of ``config`` with ``n`` layers (and per-layer lists cut to match)."""
    cfg = copy.deepcopy(config)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if getattr(cfg, key, None):
            setattr(cfg, key, n)
            break
    layer_types = getattr(cfg, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) >= n:
        cfg.layer_types = list(layer_types[:n])
    return cfg
