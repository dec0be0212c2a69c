"""ColossalAI: a ``Booster`` with the plugin the plan chose, configured as estimated.

* :func:`choose_plugin`: plan the live model over the methods ColossalAI
  runs; the plugin name (the ``--plugin`` names of ColossalAI's examples,
  examples/language/bert/finetune.py), its keyword arguments and the plan.
  Pure: ColossalAI is not imported, so it also runs where ColossalAI
  cannot be installed (docs/colossalai.md).
* :func:`build_booster`: the ``Booster`` of a (name, kwargs) pair, with
  ColossalAI imported then.
* :func:`auto_booster`: both, for the job's own world size.

The kwargs are what the estimate assumed, from the estimating modules
themselves: LowLevelZero and Gemini defaults from
:mod:`llmem_plugin.methods.colossal`, HybridParallelPlugin's from
:mod:`llmem_plugin.methods.colossal_hybrid`, DDP's bucket settings from
:mod:`llmem_plugin.methods.ddp`, FSDP's wrapping and mixed precision as
:mod:`llmem_plugin.methods.fsdp` traces them. ``precision`` is the plugins'
own ("bf16", "fp16", "fp32"); it maps to the workload's precision as each
method module does (:data:`_PRECISIONS`).

Known limitations:
    * ``fsdp`` is estimated as FSDP2 (``fully_shard`` per decoder layer, then
      the root); ColossalAI 0.5.0's ``TorchFSDPPlugin`` wraps FSDP1
      (booster/plugin/torch_fsdp_plugin.py ``TorchFSDPModel``), configured
      here the same way (``FULL_SHARD``, the decoder-layer classes as wrap
      units, ``MixedPrecision(param_dtype, reduce_dtype=float32)``). FSDP1
      keeps flat parameters; the two are alike, not identical.
    * One process (``num_gpus == 1``): the planner plans ``single`` (it
      equals one-rank DDP there), and the chosen configuration is then
      estimated again as one-rank ``ddp`` (DDP keeps its gradient buckets
      even alone) before TorchDDPPlugin is returned.
    * Without CUDA only TorchDDPPlugin can run (gloo): :func:`auto_booster`
      plans ``ddp`` alone there.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
from torch import nn

from llmem_plugin.errors import ConfigError, WontFitError
from llmem_plugin.device.gpus import GPU
from llmem_plugin.workload import OptimizerKind, Precision, Workload

__all__ = ["PLUGINS", "auto_booster", "build_booster", "choose_plugin"]

log = logging.getLogger(__name__)

# Planner method -> ColossalAI plugin name: the --plugin choices of ColossalAI's
# examples (examples/language/bert/finetune.py: "torch_ddp", "torch_ddp_fp16",
# "gemini", "low_level_zero", "hybrid_parallel"); TorchFSDPPlugin, which those
# do not list, is "torch_fsdp" after its class, like "torch_ddp".
PLUGINS: dict[str, str] = {
    "ddp": "torch_ddp",
    "lowlevel-zero1": "low_level_zero",
    "lowlevel-zero2": "low_level_zero",
    "gemini": "gemini",
    "hybrid": "hybrid_parallel",
    "hybrid-zero1": "hybrid_parallel",
    "fsdp": "torch_fsdp",
}
# Plugin name -> class in colossalai.booster.plugin. "torch_ddp_fp16" is
# TorchDDPPlugin under Booster(mixed_precision="fp16") (finetune.py); its bf16
# twin autocasts in bfloat16 (see _bf16_autocast).
_CLASSES = {"torch_ddp": "TorchDDPPlugin", "torch_ddp_fp16": "TorchDDPPlugin", "torch_ddp_bf16": "TorchDDPPlugin",
            "low_level_zero": "LowLevelZeroPlugin", "gemini": "GeminiPlugin",
            "hybrid_parallel": "HybridParallelPlugin", "torch_fsdp": "TorchFSDPPlugin"}
# ColossalAI's plugin precision -> the workload's (with fp32 parameters; bf16
# parameters train in pure bf16, _common.precision_of). The plugins cast the
# model to it and keep fp32 masters, as llmem_plugin.methods.colossal._dtype
# and colossal_hybrid._dtype map bf16-mixed / fp16-mixed.
_PRECISIONS = {"bf16": Precision.BF16_MIXED, "fp16": Precision.FP16_MIXED, "fp32": Precision.FP32}
# GeminiOptimizer accepts only these (zero/gemini/gemini_optimizer.py _AVAIL_OPTIM_LIST).
_GEMINI_OPTIMIZERS = ("FusedAdam", "CPUAdam", "HybridAdam")
_INSTALL = ("pip install --no-deps colossalai==0.5.0 galore_torch==1.0 bitsandbytes==0.50.2 "
            "(docs/colossalai.md)")


# ----------------------------------------------------------------- inputs
def _workload_precision(precision: str | Precision, param_dtype: torch.dtype) -> Precision:
    from llmem_plugin.integrations._common import precision_of

    if isinstance(precision, Precision):
        return precision
    key = str(precision).strip().lower()
    if key not in _PRECISIONS:
        if key in {p.value for p in Precision}:
            return Precision(key)
        raise ConfigError(f"unknown precision '{precision}'; valid: {', '.join(_PRECISIONS)} (ColossalAI's plugin "
                          "precision). HINT: pass precision='bf16'")
    return precision_of(param_dtype, bf16=key == "bf16", fp16=key == "fp16") if key != "fp32" else (
        Precision.BF16 if param_dtype == torch.bfloat16 else Precision.FP32)


def _optimizer_kind(optimizer: Any) -> OptimizerKind:
    """The workload optimizer of the job's optimizer (HybridAdam & co. keep
    fp32 m and v like a fused AdamW: nn/optimizer/hybrid_adam.py)."""
    if optimizer is None:
        return OptimizerKind.ADAMW
    inner = getattr(optimizer, "optim", optimizer)  # colossalai.interface.OptimizerWrapper
    name = type(inner).__name__
    if name in _GEMINI_OPTIMIZERS:
        return OptimizerKind.ADAMW_FUSED
    if isinstance(inner, (torch.optim.AdamW, torch.optim.Adam)):
        return OptimizerKind.ADAMW_FUSED if inner.defaults.get("fused") else OptimizerKind.ADAMW
    if isinstance(inner, torch.optim.SGD):
        return OptimizerKind.SGD
    if name == "Adafactor" and type(inner).__module__.startswith("torch"):
        return OptimizerKind.ADAFACTOR
    raise ConfigError(f"optimizer {name} is not modelled; valid: torch AdamW/Adam/SGD/Adafactor, HybridAdam, "
                      "FusedAdam, CPUAdam. HINT: use torch.optim.AdamW or colossalai.nn.optimizer.HybridAdam")


def _cluster(cluster: Any) -> tuple[int, int]:
    """(num_gpus, num_nodes): given, or the world size of the process group
    already initialized (the estimate sets it aside while it traces), or
    torchrun's WORLD_SIZE; nodes from LOCAL_WORLD_SIZE (one GPU without them)."""
    from llmem_plugin.methods.layout import Layout

    if isinstance(cluster, Layout):
        return cluster.num_gpus, cluster.num_nodes
    if isinstance(cluster, dict):
        layout = Layout(num_gpus=int(cluster.get("num_gpus", 1)), num_nodes=int(cluster.get("num_nodes", 1)))
        return layout.num_gpus, layout.num_nodes
    if isinstance(cluster, int) and not isinstance(cluster, bool):
        return Layout(num_gpus=cluster).num_gpus, 1
    if cluster is not None:
        raise ConfigError(f"cluster must be a Layout, a dict with num_gpus/num_nodes or a GPU count, got "
                          f"{cluster!r}. HINT: cluster={{'num_gpus': 8, 'num_nodes': 1}}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    else:
        world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return world, (world // local if local and world % local == 0 else 1)


def _methods(methods: list[str] | None) -> list[str]:
    if methods is None:
        return list(PLUGINS)
    unknown = [m for m in methods if m not in PLUGINS]
    if any(m.startswith("pp") for m in unknown):
        # ColossalAI's own schedules (OneForwardOneBackwardSchedule under HybridParallelPlugin(pp_size=...))
        # keep other buffers than torch's pipelining, which the planner's pipeline candidates trace.
        raise ConfigError(f"methods {methods!r}: the planner's pipelines are torch's pipelining, not "
                          "HybridParallelPlugin(pp_size=...)'s schedule, which is not estimated; valid: "
                          f"{', '.join(PLUGINS)}. HINT: drop the pipeline methods here, or plan with `llmem plan` and "
                          "run the pipeline with torchtitan")
    if unknown:
        raise ConfigError(f"method '{unknown[0]}' has no ColossalAI plugin; valid: {', '.join(PLUGINS)}. "
                          "HINT: pass methods= with names from this list")
    return list(methods)


# ----------------------------------------------------------------- mapping
def _fsdp_wrap_classes(module: nn.Module) -> list[str]:
    """The decoder-layer classes FSDP wraps (``_no_split_modules``, as
    llmem_plugin.methods.fsdp._decoder_layers picks them)."""
    names = set()
    for m in module.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    present = sorted({type(m).__name__ for m in module.modules()} & names)
    if not present:
        raise ConfigError(f"{type(module).__name__} names no decoder-layer class (_no_split_modules) to wrap "
                          "with FSDP. HINT: pass methods= without 'fsdp'")
    return present


def _plugin(method: str, tp: int, precision: Precision, module: nn.Module) -> tuple[str, dict[str, Any]]:
    """(plugin name, plugin kwargs) that run ``method`` as it was estimated."""
    from llmem_plugin.methods import colossal, colossal_hybrid, ddp

    half = {Precision.BF16_MIXED: "bf16", Precision.BF16: "bf16", Precision.FP16_MIXED: "fp16",
            Precision.FP32: "fp32"}[precision]
    if method == "ddp":
        name = {Precision.FP16_MIXED: "torch_ddp_fp16", Precision.BF16_MIXED: "torch_ddp_bf16"}.get(
            precision, "torch_ddp")
        return name, dict(ddp.PRESETS["ddp"])  # bucket_cap_mb=25, gradient_as_bucket_view=False
    if method in ("lowlevel-zero1", "lowlevel-zero2"):
        # colossal.estimate's option defaults: reduce_bucket_size_in_m=12, overlap_communication=True.
        kwargs = {"stage": colossal.PRESETS[method]["stage"], "precision": half, **colossal._LOWLEVEL_DEFAULTS,
                  "reduce_bucket_size_in_m": 12, "overlap_communication": True}
        return "low_level_zero", kwargs
    if method == "gemini":
        # colossal._gemini_chunks' defaults for the chunk search.
        return "gemini", {"precision": half, **colossal._GEMINI_DEFAULTS, "search_range_m": 32, "hidden_dim": None,
                          "min_chunk_size_m": 32}
    if method in ("hybrid", "hybrid-zero1"):
        zero_stage = 1 if method == "hybrid-zero1" else colossal_hybrid.PRESETS["hybrid"]["zero_stage"]
        return "hybrid_parallel", {"tp_size": tp, "zero_stage": zero_stage, "precision": half,
                                   **colossal_hybrid._DEFAULTS, **colossal_hybrid._FREE}
    if method == "fsdp":
        # fsdp._param_dtype: a -mixed precision gathers in the half type and reduces in fp32.
        mixed = {Precision.BF16_MIXED: "bfloat16", Precision.FP16_MIXED: "float16"}.get(precision)
        return "torch_fsdp", {"sharding_strategy": "FULL_SHARD", "auto_wrap_policy": _fsdp_wrap_classes(module),
                              "mixed_precision": None if mixed is None else {"param_dtype": mixed,
                                                                             "reduce_dtype": "float32"}}
    raise ConfigError(f"method '{method}' has no ColossalAI plugin; valid: {', '.join(PLUGINS)}")


def choose_plugin(
    model: nn.Module, optimizer: Any = None, *, seq_len: int, global_batch: int | None = None,
    micro_batch: int | None = None, grad_checkpointing: bool | None = None, precision: str | Precision = "bf16",
    gpu: GPU | str | None = None, gpu_memory: int | str | None = None, cluster: Any = None, margin: float = 0.05,
    methods: list[str] | None = None, tps: list[int] | None = None,
) -> tuple[str, dict[str, Any], Any]:
    """The fastest ColossalAI plugin that fits, without importing ColossalAI.

    Args:
        model: The model to train (a transformers model, or a peft one).
        optimizer: Its optimizer, for the optimizer states (None: AdamW).
        seq_len: Tokens per sequence.
        global_batch: Sequences per optimizer step (default 8 per GPU).
        micro_batch: Pin the micro-batch (else the planner picks it).
        grad_checkpointing: Pin checkpointing (None: the planner decides).
        precision: The plugins' precision, "bf16", "fp16" or "fp32".
        gpu: Catalog GPU; None: this process's CUDA device.
        gpu_memory: Capacity override, bytes or text ("75GiB").
        cluster: A Layout, ``{"num_gpus", "num_nodes"}`` or a GPU count;
            None: torchrun's ``WORLD_SIZE`` (one node per ``LOCAL_WORLD_SIZE``),
            or one GPU. Plan before any process group exists: the
            estimator traces under a fake one.
        margin: Fraction of the capacity kept free.
        methods: Restrict to these planner methods (keys of :data:`PLUGINS`).
        tps: Restrict the tensor-parallel degrees.

    Returns:
        (plugin name, plugin kwargs, plan). The kwargs are JSON-friendly
        (``torch_fsdp``'s are turned into FSDP objects by
        :func:`build_booster`); the plan's choice carries the micro-batch,
        accumulation and checkpointing to train with.

    Raises:
        ConfigError: A bad value (named, with the fix), or a process group
            already initialized with ``cluster=None``.
        WontFitError: Nothing fits; carries the plan.
    """
    from llmem_plugin.integrations._common import (
        check,
        choose,
        live_model,
        report_text,
        resolve_target,
    )

    target, memory = resolve_target(gpu, gpu_memory)
    live = live_model(model)
    names = _methods(methods)
    kind = _optimizer_kind(optimizer)
    if "gemini" in names and optimizer is not None and type(getattr(optimizer, "optim", optimizer)).__name__ \
            not in _GEMINI_OPTIMIZERS:
        log.warning("gemini left out: GeminiPlugin needs one of %s (gemini_optimizer.py _AVAIL_OPTIM_LIST), "
                    "got %s", ", ".join(_GEMINI_OPTIMIZERS), type(optimizer).__name__)
        names.remove("gemini")
    if "fsdp" in names and live.lora is not None:
        log.warning("fsdp left out: TorchFSDPPlugin does not support LoRA (support_lora() is False)")
        names.remove("fsdp")
    if not names:
        raise ConfigError(f"no ColossalAI method is left to plan from methods={methods!r}. HINT: add 'ddp' or "
                          "'lowlevel-zero2'")
    num_gpus, num_nodes = _cluster(cluster)
    workload = Workload(seq_len=seq_len, micro_batch_size=micro_batch or 1,
                        precision=_workload_precision(precision, live.param_dtype), optimizer=kind)
    single = num_gpus == 1
    plan = choose(live, workload, gpu=target, gpu_memory=memory, num_gpus=num_gpus, num_nodes=num_nodes,
                  margin=margin, methods=["single"] if single else names, global_batch=global_batch,
                  micro_batch=micro_batch, grad_checkpointing=grad_checkpointing, tps=tps)
    c = plan.choice
    if single:
        if "ddp" not in names:
            raise ConfigError(f"one GPU runs only TorchDDPPlugin here; methods={methods!r} leaves it out. "
                              "HINT: add 'ddp' to methods, or plan for more GPUs with cluster=")
        # One rank: the planner's `single`; DDP alone still allocates its buckets, so re-estimate.
        wl = dataclasses.replace(plan.workload, micro_batch_size=c.micro_batch, grad_accum_steps=c.grad_accum,
                                 grad_checkpointing=c.grad_checkpointing)
        ddp_check = check(live, wl, method="ddp", num_gpus=1, gpu=target, gpu_memory=memory, margin=margin)
        log.info("one-rank DDP: %s", ddp_check.message())
        if not ddp_check.fits:
            raise WontFitError(f"one-rank DDP does not fit: {ddp_check.message()}. HINT: plan with more GPUs "
                               "(cluster=) or a smaller micro_batch", plan=plan)
        c = dataclasses.replace(c, method="ddp", device_total_bytes=ddp_check.prediction.device_total_bytes)
        plan = dataclasses.replace(plan, choice=c)
    name, kwargs = _plugin(c.method, c.tp, plan.workload.precision, live.module)
    log.info("ColossalAI plugin %s %s for %s\n%s", name, kwargs, c.label(), report_text(plan))
    return name, kwargs, plan


# ----------------------------------------------------------------- building
def _import_colossalai() -> Any:
    try:
        import colossalai.booster.plugin as plugins
    except ImportError as e:
        raise ImportError(f"ColossalAI is needed to build the booster ({e}). HINT: {_INSTALL}") from e
    return plugins


def _bf16_autocast() -> Any:
    """Booster mixed precision that runs the forward under bf16 autocast, what
    the ``bf16-mixed`` estimate traces. ColossalAI's own ``BF16MixedPrecision``
    (booster/mixed_precision/bf16.py) is an empty abstract class, so
    ``Booster(mixed_precision="bf16")`` cannot be built."""
    from colossalai.booster.mixed_precision import MixedPrecision
    from colossalai.interface import ModelWrapper

    device = "cuda" if torch.cuda.is_available() else "cpu"

    class BF16Autocast(ModelWrapper):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                return self.module(*args, **kwargs)

    class BF16AutocastPrecision(MixedPrecision):
        def configure(self, model: nn.Module, optimizer: Any = None, criterion: Any = None) -> tuple:
            return BF16Autocast(model), optimizer, criterion

    return BF16AutocastPrecision()


def _fsdp_objects(kwargs: dict[str, Any], model: nn.Module | None) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if model is None:
        raise ConfigError("torch_fsdp needs the model to find its decoder-layer classes. HINT: pass model=")
    classes = {type(m) for m in model.modules() if type(m).__name__ in set(kwargs["auto_wrap_policy"])}
    mp = kwargs.get("mixed_precision")
    return {"sharding_strategy": ShardingStrategy[kwargs["sharding_strategy"]],
            "auto_wrap_policy": ModuleWrapPolicy(classes),
            "mixed_precision": None if mp is None else MixedPrecision(
                param_dtype=getattr(torch, mp["param_dtype"]), reduce_dtype=getattr(torch, mp["reduce_dtype"]))}


def build_booster(name: str, plugin_kwargs: dict[str, Any], model: nn.Module | None = None) -> Any:
    """The ColossalAI ``Booster`` of :func:`choose_plugin`'s name and kwargs.

    Call after ``colossalai.launch_from_torch()`` (the plugins build their
    process groups from it).

    Raises:
        ConfigError: An unknown plugin name.
        ImportError: ColossalAI is not installed (names what to install).
    """
    if name not in _CLASSES:
        raise ConfigError(f"unknown ColossalAI plugin '{name}'; valid: {', '.join(_CLASSES)}. "
                          "HINT: pass a name choose_plugin returned")
    plugins = _import_colossalai()
    from colossalai.booster import Booster

    kwargs = _fsdp_objects(plugin_kwargs, model) if name == "torch_fsdp" else dict(plugin_kwargs)
    plugin = getattr(plugins, _CLASSES[name])(**kwargs)
    # finetune.py: torch_ddp_fp16 is Booster(mixed_precision="fp16") (torch AMP + GradScaler).
    mixed = {"torch_ddp_fp16": "fp16", "torch_ddp_bf16": _bf16_autocast()}.get(name)
    return Booster(plugin=plugin, mixed_precision=mixed)


def auto_booster(
    model: nn.Module, optimizer: Any = None, *, seq_len: int, global_batch: int | None = None,
    micro_batch: int | None = None, grad_checkpointing: bool | None = None, precision: str | Precision = "bf16",
    gpu: GPU | str | None = None, gpu_memory: int | str | None = None, cluster: Any = None, margin: float = 0.05,
    methods: list[str] | None = None, tps: list[int] | None = None, seed: int = 1024, return_plan: bool = False,
) -> Any:
    """A ColossalAI ``Booster`` with the fastest plugin that fits this job.

    Call it in every rank in place of ``colossalai.launch_from_torch``: each
    rank plans (the same, deterministic plan) before any process group
    exists, then ``colossalai.launch_from_torch(seed=seed)`` is called and
    the plugin built. Other arguments as :func:`choose_plugin`; ``cluster``
    defaults to torchrun's world. Without CUDA only ``ddp`` is
    planned (the other plugins need a GPU). When the choice checkpoints,
    ``model.gradient_checkpointing_enable`` (non-reentrant, what was
    estimated) is called on ``model``. Train with ``plan.choice.micro_batch``
    sequences per rank and ``plan.choice.grad_accum`` micro-steps per step.

    Returns:
        The Booster, or ``(booster, plan)`` with ``return_plan``.

    Raises:
        ConfigError, WontFitError: As :func:`choose_plugin`.
        ImportError: ColossalAI is not installed.
    """
    _import_colossalai()
    if not torch.cuda.is_available():
        if methods is not None and "ddp" not in methods:
            raise ConfigError(f"without CUDA only TorchDDPPlugin runs (gloo); methods={methods!r} leaves 'ddp' "
                              "out. HINT: add 'ddp', or use choose_plugin(gpu=...) to plan for GPUs")
        if methods != ["ddp"]:
            log.warning("no CUDA device: planning 'ddp' only (the other ColossalAI plugins need CUDA)")
        methods = ["ddp"]
    name, kwargs, plan = choose_plugin(
        model, optimizer, seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch,
        grad_checkpointing=grad_checkpointing, precision=precision, gpu=gpu, gpu_memory=gpu_memory,
        cluster=cluster, margin=margin, methods=methods, tps=tps)
    if plan.choice.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        log.info("gradient checkpointing enabled (non-reentrant), as planned")
    if not torch.distributed.is_initialized():
        import colossalai

        colossalai.launch_from_torch(seed=seed, verbose=False)  # initialize.py: gloo on a CPU accelerator
    booster = build_booster(name, kwargs, model)
    return (booster, plan) if return_plan else booster
