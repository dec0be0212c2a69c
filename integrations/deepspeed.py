"""DeepSpeed config from a plan: ``to_deepspeed_config(plan)``.

The config carries exactly the ZeRO settings the plan's memory was estimated
with (:class:`llmem_plugin.methods.zero.ZeroConfig`, DeepSpeed's own
defaults), so that the job runs what was predicted, plus the batch
arithmetic of the chosen candidate and the precision of the workload.
DeepSpeed itself is not imported.
"""

from __future__ import annotations

from typing import Any

from llmem_plugin.errors import ConfigError
from llmem_plugin.workload import Precision

__all__ = ["to_deepspeed_config"]

# Planner method -> (stage, offload_optimizer, offload_param), as
# llmem_plugin.methods.zero.PRESETS defines them.
_ZERO = {"zero1": (1, False, False), "zero2": (2, False, False), "zero3": (3, False, False),
         "zero2-offload": (2, True, False), "zero3-offload": (3, True, True)}


def to_deepspeed_config(plan: Any, candidate: Any = None) -> dict[str, Any]:
    """The DeepSpeed config dict of a plan's choice (or of ``candidate``).

    Args:
        plan: A :class:`llmem_plugin.planner.Plan`.
        candidate: One of ``plan.candidates``; the plan's choice if None.

    Returns:
        ``train_batch_size``, ``train_micro_batch_size_per_gpu``,
        ``gradient_accumulation_steps``, ``bf16``/``fp16`` and
        ``zero_optimization`` (stage, offload sections with pinned host
        memory, bucket sizes and stage-3 thresholds as estimated).

    Raises:
        ConfigError: No choice, or a candidate that is not a DeepSpeed method.
    """
    from llmem_plugin.methods.zero import ZeroConfig

    c = candidate if candidate is not None else plan.choice
    if c is None:
        raise ConfigError("the plan has no choice (nothing fits). HINT: apply one of plan.suggestions and re-plan")
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
    precision = plan.workload.precision
    dp = plan.layout.num_gpus // c.tp
    return {
        "train_batch_size": c.micro_batch * c.grad_accum * dp,
        "train_micro_batch_size_per_gpu": c.micro_batch,
        "gradient_accumulation_steps": c.grad_accum,
        "bf16": {"enabled": precision in (Precision.BF16_MIXED, Precision.BF16)},
        "fp16": {"enabled": precision is Precision.FP16_MIXED},
        "zero_optimization": zero,
    }
