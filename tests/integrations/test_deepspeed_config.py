"""`to_deepspeed_config(plan)`: a complete config that DeepSpeed parses into
the settings the plan estimated with (its batch assertion included), that
``deepspeed.initialize`` accepts and builds the traced optimizer from, and
whose method estimate is the same estimate."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from llmem_plugin.integrations.deepspeed import optimizer_section, to_deepspeed_config

from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.planner.search import plan
from llmem_plugin.trace.step import make_optimizer
from llmem_plugin.workload import OptimizerKind

from tests.planner.test_planner import WL, small

DP = 4


@pytest.fixture(scope="module")
def zero_plan():
    return plan(small(), gpu="h100-sxm", num_gpus=DP, workload=WL,
                methods=["zero2", "zero3", "zero3-offload"], global_batch=8, prune=False)


class _DataParallel:
    """The ``mpu`` DeepSpeedConfig reads the data-parallel world size from."""

    def get_data_parallel_world_size(self) -> int:
        return DP


def _deepspeed_config(cfg, monkeypatch):
    """DeepSpeed's own parse of ``cfg`` on a world of DP data-parallel ranks."""
    from deepspeed.runtime import config as ds_config

    # DeepSpeedConfig asks deepspeed.comm for the rank first and falls back to
    # a world of 1 without a process group; the mpu then gives DP ranks.
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    return ds_config.DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=_DataParallel())


def test_deepspeed_parses_the_settings_the_plan_estimated_with(zero_plan, monkeypatch):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for c in zero_plan.candidates:
        cfg = to_deepspeed_config(zero_plan, c)
        ds = _deepspeed_config(cfg, monkeypatch)  # runs DeepSpeed's _batch_assertion with world size DP
        assert ds.world_size == DP
        assert ds.train_batch_size == zero_plan.global_batch == c.micro_batch * c.grad_accum * DP
        assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (c.micro_batch, c.grad_accum)
        assert ds.bfloat16_config.enabled and not ds.float16_config.enabled
        z = ds.zero_config
        assert int(z.stage) == {"zero2": 2, "zero3": 3, "zero3-offload": 3}[c.method]
        # DeepSpeed's own defaults are what the estimate assumed.
        default = DeepSpeedZeroConfig(stage=int(z.stage))
        for name in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
                     "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters"):
            assert getattr(z, name) == getattr(default, name), name
        if c.method == "zero3-offload":
            assert getattr(z.offload_optimizer.device, "value", z.offload_optimizer.device) == "cpu"
            assert getattr(z.offload_param.device, "value", z.offload_param.device) == "cpu"
            assert z.offload_optimizer.pin_memory and z.offload_param.pin_memory
        else:
            assert z.offload_optimizer is None and z.offload_param is None
        # The optimizer section: AdamW with the traced optimizer's hyperparameters.
        traced = make_optimizer([torch.nn.Parameter(torch.zeros(1))], WL.optimizer).defaults
        assert ds.optimizer_name == "adamw"
        assert {k: ds.optimizer_params[k] for k in ("lr", "eps", "weight_decay")} == {
            k: traced[k] for k in ("lr", "eps", "weight_decay")}
        assert tuple(ds.optimizer_params["betas"]) == traced["betas"]
        # torch's foreach AdamW, as traced; under offload DeepSpeedCPUAdam.
        assert ds.optimizer_params.get("torch_adam", False) is (c.method != "zero3-offload")


def test_deepspeed_batch_assertion_catches_a_wrong_world(zero_plan, monkeypatch):
    """The check above is DeepSpeed's: a train batch for another world fails it."""
    cfg = to_deepspeed_config(zero_plan)
    cfg["train_batch_size"] = cfg["train_batch_size"] // DP
    with pytest.raises(AssertionError, match="Check batch related parameters"):
        _deepspeed_config(cfg, monkeypatch)


_INITIALIZE = textwrap.dedent("""
    import json, os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", DS_ACCELERATOR="cpu")
    import torch, transformers, deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    out = []
    for cfg in json.loads(sys.argv[1]):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        ids = torch.randint(0, 128, (cfg["train_micro_batch_size_per_gpu"], 16))
        for _ in range(cfg["gradient_accumulation_steps"]):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        opt = engine.basic_optimizer
        out.append({"class": type(opt).__module__ + "." + type(opt).__name__, "steps": engine.global_steps,
                    "defaults": {k: v for k, v in opt.defaults.items()
                                 if isinstance(v, (int, float, bool, list, tuple))},
                    "stage": engine.zero_optimization_stage(), "bf16": engine.bfloat16_enabled()})
    print("RESULT " + json.dumps(out))
""")


def test_deepspeed_initialize_accepts_it_and_builds_the_traced_optimizer(zero_plan):
    """DeepSpeed's CPU accelerator, one gloo rank: the config's train batch is
    that rank's share (the DP-rank identity is checked above). ZeRO-Offload's
    DeepSpeedCPUAdam needs a compiled op and is left to the parse test."""
    pytest.importorskip("deepspeed")
    cfgs = []
    for method in ("zero2", "zero3"):
        cfg = to_deepspeed_config(zero_plan, next(c for c in zero_plan.candidates if c.method == method))
        cfg["train_batch_size"] //= DP
        cfgs.append(cfg)
    sgd = dict(cfgs[0], optimizer=optimizer_section(OptimizerKind.SGD, offload=False),
               zero_allow_untested_optimizer=True)
    cfgs.append(sgd)
    port = str(29500 + os.getpid() % 1000)
    proc = subprocess.run([sys.executable, "-c", _INITIALIZE, json.dumps(cfgs), port], capture_output=True,
                          text=True, timeout=240)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-2000:]
    got = json.loads(line[len("RESULT "):])
    traced = make_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimizerKind.ADAMW)
    for cfg, r in zip(cfgs, got, strict=True):
        assert r["stage"] == cfg["zero_optimization"]["stage"] and r["bf16"] and r["steps"] == 1
    for r in got[:2]:
        assert r["class"] == "torch.optim.adamw.AdamW"
        assert r["defaults"]["foreach"] is True
        for k in ("lr", "eps", "weight_decay"):
            assert r["defaults"][k] == traced.defaults[k], k
    assert got[2]["class"] == "torch.optim.sgd.SGD" and got[2]["defaults"]["momentum"] == 0.9


def test_the_method_estimated_with_the_config_is_the_same_estimate(zero_plan):
    """The config's optimizer section (torch's foreach AdamW) is the optimizer
    the plan traced, so the method estimated from the config is the same."""
    c = next(c for c in zero_plan.candidates if c.method == "zero3")
    cfg = to_deepspeed_config(zero_plan, c)
    wl = dataclasses.replace(WL, micro_batch_size=c.micro_batch, grad_accum_steps=min(c.grad_accum, 2))
    kw = {"layout": Layout(num_gpus=DP), "gpu": "h100-sxm"}
    plain = estimate_method("zero3", small(), wl, **kw).worst
    configured = estimate_method("zero3", small(), wl, config=cfg, **kw).worst
    assert configured.device_total_bytes == plain.device_total_bytes
    assert configured.peak_allocated_bytes == plain.peak_allocated_bytes


@pytest.mark.parametrize("kind, expected", [
    (OptimizerKind.ADAMW, {"type": "AdamW", "torch_adam": True, "foreach": True}),
    (OptimizerKind.ADAMW_FORLOOP, {"type": "AdamW", "torch_adam": True, "foreach": False}),
    (OptimizerKind.ADAMW_FUSED, {"type": "AdamW"}),  # DeepSpeed's FusedAdam
    (OptimizerKind.SGD, {"type": "SGD", "momentum": 0.9, "foreach": True}),
    (OptimizerKind.ADAFACTOR, {"type": "Adafactor", "lr": 1e-2}),
])
def test_optimizer_section_names_the_traced_optimizer(kind, expected):
    section = optimizer_section(kind, offload=False)
    flat = {"type": section["type"], **section["params"]}
    assert {k: flat.get(k) for k in expected} == expected
    if kind is OptimizerKind.ADAMW_FUSED:
        assert "torch_adam" not in flat
    json.dumps(section)  # a DeepSpeed config is JSON


def test_optimizers_a_deepspeed_config_cannot_build_are_refused():
    with pytest.raises(UnsupportedError, match="bitsandbytes'"):
        optimizer_section(OptimizerKind.ADAMW_8BIT, offload=False)
    with pytest.raises(UnsupportedError, match="DeepSpeedCPUAdam"):
        optimizer_section(OptimizerKind.SGD, offload=True)
    assert "torch_adam" not in optimizer_section(OptimizerKind.ADAMW, offload=True)["params"]


def test_a_plan_without_a_deepspeed_choice_is_refused(zero_plan):
    other = dataclasses.replace(zero_plan.candidates[0], method="fsdp")
    with pytest.raises(ConfigError, match="not DeepSpeed ZeRO"):
        to_deepspeed_config(zero_plan, other)
    with pytest.raises(ConfigError, match="no choice"):
        to_deepspeed_config(dataclasses.replace(zero_plan, choice=None))
    # A pipeline candidate is torch's pipelining, whose buffers DeepSpeed's PipelineEngine does not keep.
    pipeline = dataclasses.replace(zero_plan.candidates[0], method="pp", pp=2, schedule_steps=1)
    with pytest.raises(ConfigError, match=r"^candidate 'pp2 .*' runs torch's pipelining.*HINT: run it with torchtitan"):
        to_deepspeed_config(zero_plan, pipeline)


def test_trainers_that_build_their_optimizer_get_no_optimizer_section(zero_plan):
    """HF Trainer and Lightning build the user's optimizer; a section would replace it."""
    full = to_deepspeed_config(zero_plan)
    bare = to_deepspeed_config(zero_plan, optimizer=False)
    assert "optimizer" not in bare and "optimizer" in full
    assert {k: v for k, v in full.items() if k != "optimizer"} == bare
