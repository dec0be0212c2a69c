"""DeepSpeed config from a plan: ``to_deepspeed_config(plan)``.

The config is complete and runnable as it is (``deepspeed.initialize(model=...,
model_parameters=..., config=cfg)`` builds the optimizer from it), and it runs
what the plan estimated:

* ``optimizer``: the optimizer the estimate traced
  (:func:`llmem_plugin.trace.step.make_optimizer`), with its hyperparameters as
  that optimizer holds them. DeepSpeed builds it in
  ``DeepSpeedEngine._configure_basic_optimizer`` (deepspeed/runtime/engine.py,
  0.19.8): type ``"AdamW"`` with ``"torch_adam": true`` is
  ``torch.optim.AdamW(..., foreach=...)`` (``get_optimizer_configuration``),
  without it FusedAdam (``adamw-fused``), and under ZeRO-Offload
  DeepSpeedCPUAdam (the only optimizer ``zero_force_ds_cpu_optimizer`` lets
  offload run); any other type is ``getattr(torch.optim, type)``
  (``SGD``, ``Adafactor``), which ZeRO runs only with
  ``zero_allow_untested_optimizer`` (``ZERO_SUPPORTED_OPTIMIZERS``,
  runtime/zero/utils.py).
* ``bf16`` / ``fp16``: the workload's precision.
* ``zero_optimization``: exactly the settings the memory was estimated with
  (:class:`llmem_plugin.methods.zero.ZeroConfig`, DeepSpeed's own defaults):
  stage, offload sections with pinned host memory, bucket sizes and the
  stage-3 thresholds.
* ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` and
  ``train_batch_size`` = micro x accumulation x data-parallel ranks, the
  identity ``DeepSpeedConfig._batch_assertion`` checks (runtime/config.py).

Gradient checkpointing is a property of the model, not of this config: when
the choice has it on, enable it on the model (``model.gradient_checkpointing_enable()``).
DeepSpeed itself is not imported.
"""

from __future__ import annotations

from typing import Any

from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.workload import OptimizerKind, Precision

__all__ = ["optimizer_section", "to_deepspeed_config"]

# Planner method -> (stage, offload_optimizer, offload_param), as
# llmem_plugin.methods.zero.PRESETS defines them.
_ZERO = {"zero1": (1, False, False), "zero2": (2, False, False), "zero3": (3, False, False),
         "zero2-offload": (2, True, False), "zero3-offload": (3, True, True)}
# DeepSpeedZeroConfig.allgather_bucket_size default (deepspeed/runtime/zero/config.py,
# 0.19.8); the estimate assumes it and the stage-1/2 all-gather allocates nothing
# (llmem_plugin.methods.zero).
_ALLGATHER_BUCKET_SIZE = 500_000_000


def optimizer_section(kind: OptimizerKind, *, offload: bool) -> dict[str, Any]:
    """The ``optimizer`` section that makes DeepSpeed build the optimizer the
    estimate traced, with that optimizer's hyperparameters.

    Args:
        kind: The workload's optimizer.
        offload: ZeRO-Offload: DeepSpeed then builds DeepSpeedCPUAdam.

    Raises:
        UnsupportedError: An optimizer DeepSpeed cannot build from its
            config (bitsandbytes'), or not Adam under offload.
    """
    import torch

    from llmem_plugin.trace.step import make_optimizer

    if kind.is_bitsandbytes:
        raise UnsupportedError(f"--optimizer {kind.value} is bitsandbytes', which a DeepSpeed config cannot name. "
                               "HINT: plan with --optimizer adamw, or pass the optimizer to deepspeed.initialize")
    if offload and kind not in (OptimizerKind.ADAMW, OptimizerKind.ADAMW_FUSED):
        raise UnsupportedError(f"ZeRO-Offload runs DeepSpeedCPUAdam, not --optimizer {kind.value} "
                               "(zero_force_ds_cpu_optimizer). HINT: plan with --optimizer adamw")
    # The hyperparameters of the optimizer the step traced, read off it.
    defaults = make_optimizer([torch.nn.Parameter(torch.zeros(1))], kind).defaults
    if kind in (OptimizerKind.ADAMW, OptimizerKind.ADAMW_FUSED, OptimizerKind.ADAMW_FORLOOP):
        params: dict[str, Any] = {"lr": defaults["lr"], "betas": list(defaults["betas"]), "eps": defaults["eps"],
                                  "weight_decay": defaults["weight_decay"]}
        if kind is not OptimizerKind.ADAMW_FUSED and not offload:
            params.update({"torch_adam": True, "foreach": kind is OptimizerKind.ADAMW})
        return {"type": "AdamW", "params": params}
    if kind is OptimizerKind.SGD:
        keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "foreach")
        return {"type": "SGD", "params": {k: defaults[k] for k in keys}}
    if kind is OptimizerKind.ADAFACTOR:
        keys = ("lr", "beta2_decay", "d", "weight_decay", "foreach")
        return {"type": "Adafactor", "params": {**{k: defaults[k] for k in keys}, "eps": list(defaults["eps"])}}
    raise AssertionError(kind)


def to_deepspeed_config(plan: Any, candidate: Any = None, *, optimizer: bool = True) -> dict[str, Any]:
    """The DeepSpeed config dict of a plan's choice (or of ``candidate``).

    Args:
        plan: A :class:`llmem_plugin.planner.candidates.Plan`.
        candidate: One of ``plan.candidates``; the plan's choice if None.
        optimizer: Include the ``optimizer`` section. A trainer that builds
            the optimizer itself (HF Trainer from its arguments, Lightning
            from ``configure_optimizers``) takes the config without it: a
            section there would replace the user's optimizer and learning rate.

    Returns:
        ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
        ``gradient_accumulation_steps``, ``optimizer``, ``bf16``/``fp16``,
        ``zero_optimization`` (stage, offload sections with pinned host
        memory, bucket sizes and stage-3 thresholds as estimated) and, for
        torch's SGD/Adafactor, ``zero_allow_untested_optimizer``.

    Raises:
        ConfigError: No choice, or a candidate that is not a DeepSpeed method.
        UnsupportedError: An optimizer a DeepSpeed config cannot build.
    """
    from llmem_plugin.methods.zero import ZeroConfig

    c = candidate if candidate is not None else plan.choice
    if c is None:
        raise ConfigError("the plan has no choice (nothing fits). HINT: apply one of plan.suggestions and re-plan")
    if c.pp > 1:
        # DeepSpeed's PipelineEngine is not torch's pipelining: it keeps num_pipe_buffers() =
        # max(2, min(stages - stage_id, micro_batches)) input/output buffers per stage and clones its inputs
        # (deepspeed/runtime/pipe/schedule.py, TrainSchedule), where torch's stage keeps one receive buffer per
        # microbatch; the plan's estimate is torch's.
        raise ConfigError(f"candidate '{c.label()}' runs torch's pipelining, whose memory is not DeepSpeed's "
                          "PipelineEngine's (other buffers), so no DeepSpeed config is written for it. HINT: run it "
                          "with torchtitan (the estimate's notes print its TOML), or plan with methods=['zero1', "
                          "'zero2', 'zero3', 'zero2-offload', 'zero3-offload'] for DeepSpeed")
    if c.method not in _ZERO:
        raise ConfigError(f"method '{c.method}' is not DeepSpeed ZeRO; valid: {', '.join(_ZERO)}. "
                          "HINT: plan with methods=['zero1', 'zero2', 'zero3', 'zero2-offload', 'zero3-offload']")
    stage, offload_optimizer, offload_param = _ZERO[c.method]
    z = ZeroConfig(stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param)
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": z.contiguous_gradients,
        "overlap_comm": z.overlap_comm,
        "reduce_bucket_size": z.reduce_bucket_size,
        "allgather_bucket_size": _ALLGATHER_BUCKET_SIZE,
        "use_multi_rank_bucket_allreduce": z.use_multi_rank_bucket_allreduce,
    }
    if stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": z.prefetch_bucket_size,
            "stage3_param_persistence_threshold": z.param_persistence_threshold,
            "stage3_max_live_parameters": z.max_live_parameters,
            "stage3_max_reuse_distance": z.max_reuse_distance,
            "sub_group_size": z.sub_group_size,
        })
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    wl = plan.workload
    precision = wl.precision
    dp = plan.layout.num_gpus // c.tp
    cfg: dict[str, Any] = {
        "train_batch_size": c.micro_batch * c.grad_accum * dp,
        "train_micro_batch_size_per_gpu": c.micro_batch,
        "gradient_accumulation_steps": c.grad_accum,
        "bf16": {"enabled": precision in (Precision.BF16_MIXED, Precision.BF16)},
        "fp16": {"enabled": precision is Precision.FP16_MIXED},
        "zero_optimization": zero,
    }
    if optimizer:
        section = optimizer_section(wl.optimizer, offload=offload_optimizer)
        cfg["optimizer"] = section
        if section["type"] not in ("AdamW", "Adam"):
            cfg["zero_allow_untested_optimizer"] = True  # torch.optim.SGD/Adafactor: not in ZERO_SUPPORTED_OPTIMIZERS
    return cfg
