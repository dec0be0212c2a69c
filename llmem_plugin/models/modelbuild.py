"""Build the model to trace without ever holding its weights.

A model source is a config source (:func:`llmem_plugin.models.config.resolve_config`:
a catalog name, a path to a ``config.json`` or a folder holding one, a Hub id
already in the local cache, a ``PretrainedConfig``), a litgpt model
(``litgpt:NAME``), or a live ``nn.Module``. The model is built on the meta device, LoRA and gradient
checkpointing are applied there (peft and ``Module.to`` cannot operate on fake
parameters, see shared FACTS), and only then are parameters and buffers
swapped for fake tensors.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.models.config import (
    _MISSING,
    ModelSource,
    _quiet_transformers,
    _safe_getattr,
    decoder_layers,
    is_litgpt_source,
    resolve_config,
)
from llmem_plugin.workload import LoraSpec, Task, Workload

__all__ = ["adapters_to", "build_model", "check_positions", "default_precision", "fakeify", "majority_dtype",
           "position_limit"]


# The attribute names transformers gives a learned absolute position table: GPT-2 / GPT-Neo "wpe", BERT,
# DistilBERT, RoBERTa "position_embeddings", BART / OPT "embed_positions". A rotary or relative
# model has none of them and no hard limit on the sequence.
_POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions")


def _position_tables(model: nn.Module):
    """(name, module, usable rows) of each learned absolute position table (see :func:`check_positions`)."""
    for name, m in model.named_modules():
        if not isinstance(m, nn.Embedding) or name.rsplit(".", 1)[-1] not in _POSITION_TABLES:
            continue
        offset = getattr(m, "offset", None)
        if not isinstance(offset, int):
            offset = m.padding_idx + 1 if m.padding_idx is not None else 0
        yield name, m, m.num_embeddings - offset


def position_limit(model: nn.Module) -> int | None:
    """The longest sequence the model's learned position tables hold (None: no such table)."""
    return min((limit for _, _, limit in _position_tables(model)), default=None)


def check_positions(model: nn.Module, workload: Workload) -> None:
    """Refuse a sequence longer than a learned absolute position table holds: the model itself cannot run it
    (its position ids index past the table), so no estimate exists.

    The table's usable rows: ``num_embeddings`` less BART's and OPT's ``offset`` of 2
    (BartLearnedPositionalEmbedding, OPTLearnedPositionalEmbedding), or less ``padding_idx + 1`` where the
    position ids start after the padding index (RoBERTa's create_position_ids_from_input_ids).

    A packed row (``packed_docs``) restarts its position ids at every document: its longest document
    counts, not the row.

    Raises:
        ConfigError: ``seq_len`` (or ``target_len``, or a packed document) is longer, with the model's limit.
    """
    longest = max(workload.seq_len, workload.target_len or 0)
    if workload.packed_docs is not None:  # the position ids restart at every document (techniques.packing)
        from llmem_plugin.techniques.packing import doc_lengths

        longest = max(doc_lengths(workload.micro_batch_size * workload.seq_len, workload.packed_docs))
    for name, m, limit in _position_tables(model):
        if longest > limit:
            where = f"({name}: {m.num_embeddings} rows)"
            if workload.packed_docs is not None:
                raise ConfigError(f"a packed document of {longest} tokens is longer than the {limit} positions "
                                  f"{type(model).__name__} learns {where}. HINT: pack more documents per row "
                                  f"(--packed-docs), or shorten --seq-len")
            what = "target_len" if workload.target_len and workload.target_len > workload.seq_len else "seq_len"
            raise ConfigError(f"{what} {longest} is longer than the {limit} positions {type(model).__name__} learns "
                              f"{where}. HINT: use --{what.replace('_', '-')} {limit} or less, or a model with "
                              "rotary positions")


def build_model(source: ModelSource, workload: Workload, *, device: str = "meta") -> nn.Module:
    """Build the causal-LM to train, with the workload's transforms applied.

    Args:
        source: See :func:`llmem_plugin.models.config.resolve_config`, or ``litgpt:NAME``;
            a live ``nn.Module`` is copied as
            structure only (its parameters become meta tensors, its storage is
            never read).
        workload: Precision, LoRA, checkpointing and attention settings.
        device: ``"meta"`` (for fake tracing) or ``"cpu"`` (real weights).

    Raises:
        ConfigError: Bad source, LoRA targets that match nothing.
    """

    _quiet_transformers()
    from llmem_plugin.models import litgpt

    if is_litgpt_source(source):  # litgpt's own GPT class (llmem_plugin.models.litgpt)
        return litgpt.build(source, workload, device=device)
    from llmem_plugin.models.tasks import check_workload, model_task

    if isinstance(source, nn.Module):
        if litgpt.is_litgpt_model(source):
            raise UnsupportedError(f"a live litgpt {type(source).__name__} is not traced as a module (its loop and "
                                   "options are checked only for a named config). HINT: pass the model as "
                                   "litgpt:NAME or litgpt:DIR (the checkpoint directory) with the workload")
        task = model_task(source)
        if workload.task is not None and workload.task != task.value:
            raise ConfigError(f"task {workload.task!r} was given, but the module is a {type(source).__name__} "
                              f"({task.value}). HINT: drop the task, or pass the module the job trains")
        check_workload(task, workload)
        _refuse_live_quantized(source)
        model = _structure_copy(source, workload)
        from llmem_plugin.techniques.quant import Linear4bitStandIn, adopt_live_lora

        live_quantized = any(isinstance(m, Linear4bitStandIn) for m in model.modules())
        if live_quantized:  # its dtypes are what trains (k-bit preparation already ran)
            if workload.quantize is None:
                raise ConfigError(
                    f"the live {type(source).__name__} holds bitsandbytes 4-bit layers, but the workload sets no "
                    "quantization, so the methods and the loading that depend on it would not be checked. HINT: "
                    "pass Workload(**llmem_plugin.techniques.quant.live_quantization(model), lora=...) (the adapters do)")
            adopt_live_lora(model)
        elif workload.precision.param_dtype != torch.float32 and _runner_casts(model, workload):
            model.to(workload.precision.param_dtype)
    else:
        from llmem_plugin.models.tasks import auto_class, config_task

        config = copy.deepcopy(resolve_config(source))
        config.use_cache = False
        task = config_task(config, workload.task)
        check_workload(task, workload)
        if task is Task.MASKED_LM and _safe_getattr(config, "sparse_prediction") is True:
            # ModernBertForMaskedLM.forward: with sparse_prediction the head runs on the masked positions
            # only (boolean indexing): its size follows the masking, which the config does not give.
            raise UnsupportedError("sparse_prediction=True computes the masked-LM head on the masked tokens only, "
                                   "a data-dependent share that is not modelled. HINT: estimate with "
                                   "sparse_prediction false in the config (an upper bound: every token's logits)")
        if task is Task.SEQ_CLS and getattr(config, "pad_token_id", None) is None:
            # A decoder classifier scores the last non-padding token and refuses
            # batches above 1 without a pad id (LlamaForSequenceClassification.
            # forward); fine-tuning recipes set it (to the eos id). Which id it
            # is changes no shape.
            config.pad_token_id = 0
        if task is Task.SEQ2SEQ:
            # Shifting the labels right needs both ids (T5's _shift_right,
            # BART's shift_tokens_right); t5-base's config.json has 0 for both.
            # Which ids they are changes no shape.
            for key in ("pad_token_id", "decoder_start_token_id"):
                if _safe_getattr(config, key) in (None, _MISSING):
                    setattr(config, key, 0)
        with torch.device(device), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model = auto_class(task).from_config(
                    config,
                    attn_implementation=_attn_arg(workload),
                    dtype=workload.precision.param_dtype,
                )
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ConfigError(f"cannot build a {task.value} model from this config: {msg}") from None
    _check_moe_dtype(model, workload)
    check_positions(model, workload)
    if workload.attn_implementation.value == "flash_attention_2":
        from llmem_plugin.trace.emulation.flash import check_model

        check_model(model)
    if workload.freeze_vision:
        # The vision tower (MllamaModel.vision_model) takes no gradient.
        vision = getattr(getattr(model, "model", model), "vision_model", None)
        assert vision is not None, "check_workload allows freeze_vision for vision-language models only"
        vision.requires_grad_(False)
    if workload.quantize is not None and not any(type(m).__name__ == "Linear4bitStandIn" for m in model.modules()):
        from llmem_plugin.techniques.quant import quantize_model

        model = quantize_model(model, workload)
    model.train()
    if workload.grad_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(
                f"{type(model).__name__} does not support gradient checkpointing. HINT: drop --grad-checkpointing"
            )
        kwargs = {"use_reentrant": workload.checkpoint_reentrant}
        if workload.checkpoint_save_ops is not None:  # op-level SAC: torch.utils.checkpoint's context_fn
            from llmem_plugin.techniques.checkpointing import parse_save_ops

            kwargs["context_fn"] = parse_save_ops(workload.checkpoint_save_ops).context_fn()
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if workload.checkpoint_every > 1:
            _checkpoint_every(model, workload.checkpoint_every)
    if workload.lora is not None and not (isinstance(source, nn.Module) and hasattr(model, "peft_config")):
        # a live peft model holds its adapters already
        model = _apply_lora(model, workload.lora, dtype=workload.precision.param_dtype)
    return model


def _checkpoint_every(model: nn.Module, k: int) -> None:
    """Keep gradient checkpointing on every ``k``-th decoder layer only.

    torchtitan's layer-level selective AC (torchtitan/distributed/
    activation_checkpoint.py, ``_apply_layer_sac``) wraps the blocks whose
    1-based count is a multiple of ``k``: 0-based layers ``k-1, 2k-1, ...``.
    transformers checkpoints a layer when its ``gradient_checkpointing`` flag
    is set (modeling_layers.py, ``GradientCheckpointingLayer``), so the other
    layers' flags are cleared.

    Raises:
        UnsupportedError: No decoder layer list, or layers without the flag.
    """
    name = decoder_layers(model)
    layers = list(model.get_submodule(name)) if name else []
    if not layers or not all(hasattr(layer, "gradient_checkpointing") for layer in layers):
        raise UnsupportedError(f"--checkpoint-every needs per-layer checkpointing (transformers' "
                               f"GradientCheckpointingLayer), which {type(model).__name__}'s layers lack. "
                               "HINT: checkpoint every layer (drop --checkpoint-every)")
    for j, layer in enumerate(layers):
        layer.gradient_checkpointing = j % k == k - 1


def _attn_arg(workload: Workload) -> str | None:
    value = workload.attn_implementation.value
    if value == "flash_attention_2":
        # The flash-attn package cannot run here (CUDA only): an emulation
        # with its allocations is registered under its own name.
        from llmem_plugin.trace.emulation.flash import attn_implementation_name

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


def default_precision(source: ModelSource) -> tuple[str, str | None]:
    """The precision to use when the user names none, and why if it is not the usual one.

    The usual default is ``bf16-mixed``. A model whose experts run
    ``grouped_mm`` (transformers' default experts implementation for the MoE
    classes that support it, modeling_utils.get_correct_experts_implementation)
    takes bf16 weights only on CUDA (see :func:`_check_moe_dtype`), so it
    gets ``bf16``.

    Returns:
        ``(precision, reason)``; ``reason`` is None for the usual default.
    """
    if isinstance(source, nn.Module):
        return "bf16-mixed", None
    if is_litgpt_source(source):  # litgpt's finetune configs: precision bf16-true
        return "bf16", "litgpt's finetune configs train in bf16-true"
    config = resolve_config(source)
    if _runs_grouped_mm_experts(config):
        return "bf16", (f"{type(config).__name__.removesuffix('Config')} runs its experts with grouped_mm, "
                        "which takes bf16 weights only on CUDA")
    return "bf16-mixed", None


def _runs_grouped_mm_experts(config) -> bool:
    import transformers

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_experts = max((getattr(text, k, 0) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    if not isinstance(num_experts, int) or num_experts <= 0:
        return False
    if getattr(config, "_experts_implementation", None) not in (None, "grouped_mm"):
        return False
    model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    can_set = getattr(model_class, "_can_set_experts_implementation", None)
    return bool(can_set and can_set())


def _refuse_live_quantized(module: nn.Module) -> None:
    """A live model whose layers bitsandbytes quantized to 8 bits (``Int8Params``)
    is refused: LLM.int8 is not modelled (:mod:`llmem_plugin.techniques.quant`)."""
    quantized = next((name for name, p in module.named_parameters() if type(p).__name__ == "Int8Params"), None)
    if quantized is not None:
        raise UnsupportedError(
            f"the live model holds bitsandbytes 8-bit weights ({quantized}): LLM.int8's matmul splits out "
            "outlier columns whose number depends on the data. HINT: load it in 4 bits (QLoRA, nf4)")
    pending = next((name for name, p in module.named_parameters()
                    if type(p).__name__ == "Params4bit" and getattr(p, "quant_state", None) is None), None)
    if pending is not None:
        raise UnsupportedError(
            f"the live model's 4-bit weight {pending} is not quantized yet (bitsandbytes quantizes it when the "
            "model moves to the GPU), so its quant state cannot be read. HINT: check after model.cuda(), or "
            "estimate the recipe from its config with --quantize")


def _runner_casts(model: nn.Module, workload: Workload) -> bool:
    """Whether the job casts a live model to ``workload``'s parameter dtype before training.

    A model already in that dtype (most of its floating-point elements) trains as it is under HF Trainer
    and plain loops: peft's fp32 adapters on a 16-bit base (``autocast_adapter_dtype``, its default) stay
    fp32. Lightning's true-precision plugins cast the whole module (``module.to(dtype)`` in
    ``HalfPrecision.convert_module``), adapters included; a model in another dtype is cast in any case.
    DeepSpeed's bf16 engine also casts every parameter; its fp32 adapters are kept here, a small over-estimate.
    """
    from llmem_plugin.workload import Runner

    if workload.runner is Runner.LIGHTNING:
        return True
    return majority_dtype(model) != workload.precision.param_dtype


def majority_dtype(model: nn.Module) -> torch.dtype:
    """The dtype most of ``model``'s floating-point parameter elements are in (fp32 when it has none): peft's
    fp32 adapters can outnumber a 16-bit base model's tensors, never its elements."""
    elements: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            elements[p.dtype] = elements.get(p.dtype, 0) + p.numel()
    return max(elements, key=elements.get) if elements else torch.float32


def _structure_copy(module: nn.Module, workload: Workload | None = None) -> nn.Module:
    """Deep-copy ``module`` with every parameter and buffer replaced by a meta
    tensor; bitsandbytes 4-bit layers become their stand-ins
    (:func:`llmem_plugin.techniques.quant.live_standins`)."""
    memo: dict[int, Any] = {}
    if workload is not None:
        from llmem_plugin.techniques.quant import live_standins

        memo.update(live_standins(module, workload))
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in memo:
            continue
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    from llmem_plugin.techniques.trl_head import drop_fused_forwards

    model = copy.deepcopy(module, memo)
    drop_fused_forwards(model)
    return model


def adapters_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every peft LoRA adapter of ``model`` to ``dtype`` (``LoraSpec.adapter_dtype``
    "base"). peft's ``autocast_adapter_dtype=False`` leaves the adapters in the base
    weight's dtype, except over a bitsandbytes 4-bit weight, which has no float dtype
    (``_move_adapter_to_device_of_base_layer`` then keeps them as created, fp32); a
    recipe that creates them in the model's dtype (litgpt, torchtune) has them there.

    Args:
        model: A peft model.
        dtype: The model's parameter dtype (``Precision.param_dtype``).
    """
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("lora_A", "lora_B"):
            module.to(dtype)


def _apply_lora(model: nn.Module, spec: LoraSpec, *, dtype: torch.dtype) -> nn.Module:
    from llmem_plugin.models.tasks import model_task

    try:
        import peft
    except ImportError:
        raise ImportError("LoRA needs peft: pip install 'llmem_plugin[lora]'") from None
    targets: Any = "all-linear" if spec.target_modules == ("all-linear",) else list(spec.target_modules)
    if targets != "all-linear":
        _check_lora_targets(model, targets)
    cfg = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        # peft's task types: SEQ_CLS and TOKEN_CLS also train the new
        # classification head (their peft models add it to modules_to_save).
        # (peft has no masked-LM task type: the plain PeftModel.)
        task_type={Task.SEQ_CLS: "SEQ_CLS", Task.TOKEN_CLS: "TOKEN_CLS", Task.SEQ2SEQ: "SEQ_2_SEQ_LM",
                   Task.MASKED_LM: None}.get(model_task(model), "CAUSAL_LM"),
    )
    from llmem_plugin.techniques.quant import lora_custom_modules

    if custom := lora_custom_modules(model):  # 4-bit stand-ins take peft's 4-bit LoRA layer
        cfg._register_custom_module(custom)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = peft.get_peft_model(model, cfg, autocast_adapter_dtype=spec.adapter_dtype == "fp32")
        except (ValueError, TypeError) as e:  # peft's own refusal of a target
            first = " ".join(str(e).split())[:300]
            raise ConfigError(f"peft cannot apply LoRA to {','.join(spec.target_modules)}: {first}. "
                              "HINT: pass --lora-targets with linear module names, or all-linear") from None
    if spec.adapter_dtype == "base":
        adapters_to(model, dtype)
    return model


def _check_lora_targets(model: nn.Module, targets: list[str]) -> None:
    """Refuse targets that match nothing (ConfigError), or match modules other
    than linear layers (UnsupportedError).

    A target matches a module whose qualified name is the target or ends with
    ``"." + target`` (peft ``check_target_module_exists`` for a list). LoRA is
    modelled on ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2) only: peft's
    ``lora.Embedding`` hides the embedding's ``num_embeddings``, which the
    trace reads, and a container module is not a layer peft can adapt.
    """
    from transformers.pytorch_utils import Conv1D

    linear = (nn.Linear, Conv1D)
    modules = list(model.named_modules())
    names = sorted({n.rsplit(".", 1)[-1] for n, m in modules if isinstance(m, linear)})
    matched = {t: [m for n, m in modules if n == t or n.endswith("." + t)] for t in targets}
    missing = [t for t, ms in matched.items() if not ms]
    if len(missing) == len(targets):
        raise ConfigError(
            f"LoRA target modules {','.join(missing)} match no module of {type(model).__name__}; "
            f"linear modules are: {','.join(names)}. HINT: pass --lora-targets with some of them"
        )
    for t, ms in matched.items():
        other = next((m for m in ms if not isinstance(m, linear)), None)
        if other is not None:
            raise UnsupportedError(
                f"llmem does not model LoRA on {t}: it matches a module of type {type(other).__name__}, and LoRA is "
                f"modelled on linear layers only. HINT: pass --lora-targets with linear modules: {','.join(names)}"
            )


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
