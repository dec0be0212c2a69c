"""ColossalAI adapter: the plan's choice becomes the plugin it was estimated
as, ColossalAI accepts the kwargs, and TorchDDPPlugin trains on gloo."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys

import pytest
import torch
import transformers
from llmem_plugin.integrations import colossalai as adapter

from llmem_plugin.errors import ConfigError
from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.planner.candidates import planner_methods
from llmem_plugin.workload import Precision

from tests.conftest import tiny_config
from tests.methods._gloo import REPO, run_gloo

INSTALL = "pip install --no-deps colossalai==0.5.0 galore_torch==1.0 bitsandbytes==0.50.2"


def _colossalai_plugins():
    try:
        import colossalai.booster.plugin as plugins
    except ImportError as e:
        pytest.skip(f"ColossalAI is not installed ({e}); {INSTALL}")
    return plugins


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_config("llama"))


@pytest.fixture(scope="module")
def four_gpus(model):
    """Every ColossalAI method on 4 H100s, with HybridAdam's optimizer kind (optimizer=None)."""
    return adapter.choose_plugin(model, seq_len=64, gpu="h100-sxm", cluster=4, global_batch=8)


def test_the_methods_are_the_colossalai_ones_of_the_planner():
    assert set(adapter.PLUGINS) == {"ddp", "lowlevel-zero1", "lowlevel-zero2", "gemini", "hybrid", "hybrid-zero1",
                                    "fsdp"}
    assert set(adapter.PLUGINS) <= set(planner_methods())


def test_the_plugin_is_the_one_of_the_chosen_method(four_gpus):
    name, kwargs, plan = four_gpus
    c = plan.choice
    assert c.method in adapter.PLUGINS
    assert name == adapter.PLUGINS[c.method] or (c.method == "ddp" and name.startswith("torch_ddp"))
    # The choice is the fastest fitting candidate of the ColossalAI methods only.
    assert {x.method for x in plan.candidates} <= set(adapter.PLUGINS)
    assert c.step_time_s == min(x.step_time_s for x in plan.candidates if x.fits and x.verified)
    if name == "low_level_zero":
        assert kwargs["stage"] == {"lowlevel-zero1": 1, "lowlevel-zero2": 2}[c.method]
    assert kwargs.get("precision", "bf16") == "bf16"


@pytest.mark.parametrize("method", ["lowlevel-zero1", "lowlevel-zero2", "gemini", "hybrid-zero1"])
def test_the_kwargs_give_the_estimate_the_plan_verified(model, method):
    """Estimating with the plugin kwargs as options gives the plan's own
    verified number: the kwargs are what was estimated (a non-default one
    would be refused by the method module)."""
    name, kwargs, plan = adapter.choose_plugin(model, seq_len=64, gpu="h100-sxm", cluster=4, global_batch=8,
                                               methods=[method], micro_batch=2, grad_checkpointing=False)
    c = plan.choice
    assert c.method == method and c.verified
    options = {k: v for k, v in kwargs.items() if k not in ("precision", "stage", "tp_size")}
    wl = dataclasses.replace(plan.workload, micro_batch_size=c.micro_batch, grad_accum_steps=c.grad_accum)
    registry = "hybrid" if method == "hybrid-zero1" else method  # zero_stage=1 comes with the kwargs
    est = estimate_method(registry, tiny_config("llama"), wl, layout=Layout(num_gpus=4, tp=c.tp), gpu="h100-sxm",
                          **options)
    assert est.worst.device_total_bytes == c.device_total_bytes
    if name == "hybrid_parallel":
        assert (kwargs["tp_size"], kwargs["zero_stage"], kwargs["pp_size"]) == (c.tp, 1, 1)


def test_colossalai_takes_the_kwargs_and_they_are_its_defaults(model):
    """Each plugin's kwargs are parameters of its __init__, and every one the
    estimate assumes at the plugin's default equals ColossalAI's own default."""
    plugins = _colossalai_plugins()
    cases = {"ddp": 1, "lowlevel-zero1": 1, "lowlevel-zero2": 1, "gemini": 1, "hybrid": 2, "hybrid-zero1": 2}
    for method, tp in cases.items():
        name, kwargs = adapter._plugin(method, tp, Precision.BF16_MIXED, model)
        params = inspect.signature(getattr(plugins, adapter._CLASSES[name]).__init__).parameters
        assert set(kwargs) <= set(params), (method, set(kwargs) - set(params))
        for key, value in kwargs.items():
            if key in ("precision", "stage", "tp_size", "zero_stage", "pp_size"):
                continue
            assert params[key].default == value, (method, key)
    name, kwargs = adapter._plugin("fsdp", 1, Precision.BF16_MIXED, model)
    assert kwargs["auto_wrap_policy"] == ["LlamaDecoderLayer"]
    assert set(adapter._fsdp_objects(kwargs, model)) <= set(inspect.signature(plugins.TorchFSDPPlugin).parameters)


def test_precision_maps_to_the_workload_and_the_ddp_booster():
    assert adapter._workload_precision("bf16", torch.float32) is Precision.BF16_MIXED
    assert adapter._workload_precision("bf16", torch.bfloat16) is Precision.BF16
    assert adapter._workload_precision("fp16", torch.float32) is Precision.FP16_MIXED
    assert adapter._workload_precision("fp32", torch.float32) is Precision.FP32
    m = torch.nn.Linear(2, 2)
    assert adapter._plugin("ddp", 1, Precision.FP16_MIXED, m)[0] == "torch_ddp_fp16"
    assert adapter._plugin("ddp", 1, Precision.BF16_MIXED, m)[0] == "torch_ddp_bf16"
    assert adapter._plugin("ddp", 1, Precision.BF16, m)[0] == "torch_ddp"
    assert adapter._plugin("lowlevel-zero2", 1, Precision.FP32, m)[1]["precision"] == "fp32"


def test_one_gpu_is_one_rank_ddp_estimated_as_such(model):
    opt = torch.optim.AdamW(model.parameters())
    name, _, plan = adapter.choose_plugin(model, opt, seq_len=64, gpu="h100-sxm", cluster=1, global_batch=2)
    c = plan.choice
    assert name == "torch_ddp_bf16" and c.method == "ddp"
    wl = dataclasses.replace(plan.workload, micro_batch_size=c.micro_batch, grad_accum_steps=c.grad_accum,
                             grad_checkpointing=c.grad_checkpointing)
    est = estimate_method("ddp", model, wl, layout=Layout(num_gpus=1), gpu="h100-sxm")
    assert c.device_total_bytes == est.worst.device_total_bytes


def test_user_errors_name_the_value_and_the_fix(model):
    with pytest.raises(ConfigError, match="method 'zero3' has no ColossalAI plugin; valid: ddp"):
        adapter.choose_plugin(model, seq_len=64, gpu="h100-sxm", cluster=4, methods=["zero3"])
    with pytest.raises(ConfigError, match=r"torch's pipelining, not HybridParallelPlugin\(pp_size=...\)'s schedule"):
        adapter.choose_plugin(model, seq_len=64, gpu="h100-sxm", cluster=4, methods=["ddp", "pp"])
    with pytest.raises(ConfigError, match="unknown precision 'fp8'.*HINT"):
        adapter.choose_plugin(model, seq_len=64, gpu="h100-sxm", cluster=4, precision="fp8")
    with pytest.raises(ConfigError, match="cluster must be.*HINT"):
        adapter.choose_plugin(model, seq_len=64, gpu="h100-sxm", cluster="eight")
    with pytest.raises(ConfigError, match="optimizer RMSprop is not modelled"):
        adapter.choose_plugin(model, torch.optim.RMSprop(model.parameters()), seq_len=64, gpu="h100-sxm", cluster=4)
    with pytest.raises(ConfigError, match="no ColossalAI method is left"):
        adapter.choose_plugin(model, torch.optim.AdamW(model.parameters()), seq_len=64, gpu="h100-sxm", cluster=4,
                              methods=["gemini"])
    with pytest.raises(ConfigError, match="unknown ColossalAI plugin 'deepspeed'; valid: torch_ddp"):
        adapter.build_booster("deepspeed", {})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU restriction")
def test_without_cuda_the_booster_plans_ddp_only(model):
    _colossalai_plugins()
    with pytest.raises(ConfigError, match="without CUDA only TorchDDPPlugin runs"):
        adapter.auto_booster(model, seq_len=64, gpu="h100-sxm", cluster=4, methods=["gemini"])


_WORKER = """
import os, sys
sys.path.insert(0, os.environ["REPO"])
import torch, transformers
from colossalai.booster.plugin import TorchDDPPlugin
from llmem_plugin.integrations.colossalai import auto_booster
from tests.conftest import tiny_config

torch.manual_seed(0)
model = transformers.LlamaForCausalLM(tiny_config("llama"))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
booster, plan = auto_booster(model, opt, seq_len=32, gpu="h100-sxm", global_batch=4, precision="bf16",
                             return_plan=True)
import torch.distributed as dist
model, opt, *_ = booster.boost(model, opt)
c = plan.choice
batch = torch.randint(0, 512, (c.micro_batch, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
losses = []
for _ in range(4):
    for _ in range(c.grad_accum):
        out = model(input_ids=batch, labels=batch)
        booster.backward(out.loss / c.grad_accum, opt)
    opt.step()
    opt.zero_grad()
    losses.append(out.loss.item())
chain, m = [], model
while hasattr(m, "module"):
    chain.append(type(m).__name__)
    m = m.module
print("RESULT", type(booster.plugin) is TorchDDPPlugin, "/".join(chain), dist.get_world_size(),
      plan.layout.num_gpus, c.method, c.micro_batch * c.grad_accum, out.logits.dtype, *losses)
"""


def test_torch_ddp_plugin_trains_on_gloo(tmp_path):
    _colossalai_plugins()
    outs = run_gloo(tmp_path, _WORKER, world=2)
    for out in outs:
        line = next(x for x in out.splitlines() if x.startswith("RESULT")).split()
        # bf16 autocast around ColossalAI's DDP wrapper (Booster.boost: the plugin first, then mixed precision).
        assert line[1:7] == ["True", "BF16Autocast/TorchDDPModel/DistributedDataParallel", "2", "2", "ddp", "2"]
        assert line[7] == "torch.bfloat16"  # the forward ran under bf16 autocast, as bf16-mixed was estimated
        losses = [float(x) for x in line[8:]]
        assert len(losses) == 4 and losses[-1] < losses[0]


def test_the_example_trains_in_one_process():
    _colossalai_plugins()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    out = subprocess.run([sys.executable, os.path.join(REPO, "examples", "colossalai_booster.py"), "--gpu",
                          "h100-sxm", "--steps", "3"], env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("plugin: TorchDDPPlugin for ddp mb")
    losses = [float(x.split()[-1]) for x in lines if x.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
