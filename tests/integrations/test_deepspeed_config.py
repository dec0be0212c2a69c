"""`to_deepspeed_config(plan)`: DeepSpeed parses it into the settings the plan
estimated with, and the method estimated with it is the same estimate."""

from __future__ import annotations

import dataclasses

import pytest
from llmem_plugin.integrations.deepspeed import to_deepspeed_config

from llmem_plugin.errors import ConfigError
from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.planner import plan

from ..planner.test_planner import WL, small


@pytest.fixture(scope="module")
def zero_plan():
    return plan(small(), gpu="h100-sxm", num_gpus=4, workload=WL,
                methods=["zero2", "zero3", "zero3-offload"], global_batch=8, prune=False)


def test_deepspeed_parses_the_settings_the_plan_estimated_with(zero_plan):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for c in zero_plan.candidates:
        cfg = to_deepspeed_config(zero_plan, c)
        assert cfg["train_batch_size"] == zero_plan.global_batch
        assert cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * 4 == zero_plan.global_batch
        assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
        ds = DeepSpeedZeroConfig(**cfg["zero_optimization"])
        assert int(ds.stage) == {"zero2": 2, "zero3": 3, "zero3-offload": 3}[c.method]
        # DeepSpeed's own defaults are what the estimate assumed.
        default = DeepSpeedZeroConfig(stage=int(ds.stage))
        for name in ("reduce_bucket_size", "overlap_comm", "contiguous_gradients"):
            assert getattr(ds, name) == getattr(default, name), name
        if c.method == "zero3-offload":
            assert getattr(ds.offload_optimizer.device, "value", ds.offload_optimizer.device) == "cpu"
            assert getattr(ds.offload_param.device, "value", ds.offload_param.device) == "cpu"
        else:
            assert ds.offload_optimizer is None and ds.offload_param is None


def test_the_method_estimated_with_the_config_is_the_same_estimate(zero_plan):
    c = next(c for c in zero_plan.candidates if c.method == "zero3")
    cfg = to_deepspeed_config(zero_plan, c)
    wl = dataclasses.replace(WL, micro_batch_size=c.micro_batch, grad_accum_steps=min(c.grad_accum, 2))
    kw = {"layout": Layout(num_gpus=4), "gpu": "h100-sxm"}
    plain = estimate_method("zero3", small(), wl, **kw).worst
    configured = estimate_method("zero3", small(), wl, config=cfg, **kw).worst
    assert configured.device_total_bytes == plain.device_total_bytes
    assert configured.peak_allocated_bytes == plain.peak_allocated_bytes


def test_a_plan_without_a_deepspeed_choice_is_refused(zero_plan):
    other = dataclasses.replace(zero_plan.candidates[0], method="fsdp")
    with pytest.raises(ConfigError, match="not DeepSpeed ZeRO"):
        to_deepspeed_config(zero_plan, other)
    with pytest.raises(ConfigError, match="no choice"):
        to_deepspeed_config(dataclasses.replace(zero_plan, choice=None))
