"""Host (CPU) RAM: the per-rank figures against DeepSpeed's own estimators and a
real CPU optimizer step, the process baseline, the node capacity and its
catalog defaults, and the planner's refusal of plans that do not fit the host."""

from __future__ import annotations

import gc
import importlib.util
import json
import re
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from llmem_plugin.errors import ConfigError, WontFitError
from llmem_plugin.device.gpus import get_gpu, gpu_names, host_memory_default
from llmem_plugin.device.host import (
    CUDA_CONTEXT_HOST_BYTES,
    FRAMEWORK_RSS_BYTES,
    parse_host_memory,
    pinned_bytes,
    process_baseline_bytes,
    resolve_host_memory,
)
from llmem_plugin.methods import Layout, estimate_method, zero
from llmem_plugin.workload import Workload

from tests.conftest import tiny_config

GIB = 2**30
WL = Workload(seq_len=16, micro_batch_size=1, precision="bf16-mixed")
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed not installed (pip install -e '.[deepspeed]')")

# Eight bias-free 4096-wide layers: 134M parameters, one HF decay group, no
# padding for 2 ranks; large enough that DeepSpeed's printed GB (2 decimals)
# resolve it to 0.2%.
NUM_LAYERS, WIDTH = 8, 4096
P = NUM_LAYERS * WIDTH * WIDTH


def _model(device: str = "meta") -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False, device=device) for _ in range(NUM_LAYERS)])


def _printed_cpu_gib(out: str, options: str) -> float:
    """The "per CPU" column of DeepSpeed's estimator table for an options row
    (its device names print as ``cpu`` or ``OffloadDeviceEnum.cpu`` by Python version)."""
    def norm(text: str) -> str:
        return re.sub(r"\s+", "", text.replace("OffloadDeviceEnum.", ""))

    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)GB \|\s*([\d.]+)GB \| (.*)$", line)
        if m and norm(m.group(3)) == norm(options):
            return float(m.group(1))
    raise AssertionError(f"no row {options!r} in:\n{out}")


# ----------------------------------------------------------------- closed forms
def test_pinned_allocations_round_to_a_power_of_two():
    # CachingHostAllocator.h: PowerOf2Ceil(size) below pinned_max_round_threshold (unbounded by default).
    assert [pinned_bytes(n) for n in (0, 1, 3, 4096, 4097, 3 * 2**30)] == [0, 1, 4, 4096, 8192, 4 * 2**30]


def test_process_baseline_is_the_measured_rss_plus_the_cited_cuda_context():
    rows = {r["stage"]: r for r in json.loads((RESULTS / "host-baseline-2026-11-25.json").read_text())["rows"]}
    assert FRAMEWORK_RSS_BYTES == rows["step"]["rss_bytes"]
    assert CUDA_CONTEXT_HOST_BYTES == 1_734_560 * 1024  # pytorch/pytorch#113326, in kB
    assert process_baseline_bytes() == FRAMEWORK_RSS_BYTES + CUDA_CONTEXT_HOST_BYTES


def test_host_memory_sizes_and_bad_values():
    assert parse_host_memory("2TiB") == 2 * 2**40
    assert parse_host_memory("1152GB") == 1152 * 10**9
    assert parse_host_memory(64 * GIB) == 64 * GIB
    for bad in ("lots", "-1GiB", 0, 512, True, 1.5, None):
        with pytest.raises(ConfigError, match="HINT"):
            parse_host_memory(bad)
    with pytest.raises(ConfigError, match="512GiB"):  # a bare small int is GiB meant
        parse_host_memory(512)


def test_catalog_defaults_name_their_instance():
    assert set(gpu_names()) == {n for n in gpu_names() if host_memory_default(n, 1)[0] > 0}
    # AWS g5.xlarge (1 x A10G, 16 GiB), g5.48xlarge (8 GPUs, 768 GiB); p5.48xlarge 2 TiB.
    assert host_memory_default("a10g", 1) == (16 * GIB, host_memory_default("a10g", 1)[1])
    assert "g5.xlarge" in host_memory_default("a10g", 1)[1]
    assert "aws.amazon.com/ec2/instance-types/g5" in host_memory_default("a10g", 1)[1]
    assert host_memory_default("a10g", 8)[0] == 768 * GIB
    assert host_memory_default("a10g", 2)[0] == 192 * GIB // 2  # half of g5.12xlarge (4 GPUs)
    assert host_memory_default("a10g", 16)[0] == 2 * 768 * GIB  # past the largest: its RAM per GPU
    assert host_memory_default("h100-sxm", 8)[0] == 2048 * GIB
    assert host_memory_default("a100-40gb", 8)[0] == 1152 * GIB  # p4d.24xlarge
    cap = resolve_host_memory(None, gpu=get_gpu("a10g"), gpus_per_node=1)
    assert cap.node_bytes == 16 * GIB and "catalog default" in cap.source
    assert resolve_host_memory("3TiB", gpu=get_gpu("a10g"), gpus_per_node=1).source == "--host-memory"
    assert resolve_host_memory("local", gpu=get_gpu("a10g"), gpus_per_node=1).node_bytes > GIB


# ------------------------------------------------------ against DeepSpeed's estimators
@needs_deepspeed
def test_zero3_offload_host_against_deepspeed_all_live_and_all_cold(capsys):
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs_all_cold,
        estimate_zero3_model_states_mem_needs_all_live,
    )

    estimate_zero3_model_states_mem_needs_all_live(_model("cpu"), num_gpus_per_node=2, additional_buffer_factor=1)
    live = capsys.readouterr().out
    estimate_zero3_model_states_mem_needs_all_cold(P, WIDTH * WIDTH, num_gpus_per_node=2, additional_buffer_factor=1)
    cold = capsys.readouterr().out
    opts = "offload_param=cpu , offload_optimizer=cpu , zero_init=1"
    theirs = _printed_cpu_gib(live, opts)
    assert theirs == _printed_cpu_gib(cold, opts)
    no_persist = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
    ours = zero.model_states(_model(), WL, layout=Layout(num_gpus=2), stage=3, offload_optimizer=True,
                             offload_param=True, config=no_persist)
    per_node = 2 * ours.host_bytes
    # Theirs (factor 1): 18 B/param per node (16-bit params, fp32 master,
    # fp32 grads, Adam's m and v). Ours adds the 16-bit gradient partitions
    # (stage3.py grad_partitions_flat_buffer, on the host with offload_optimizer).
    assert per_node - 2 * P == 18 * P
    assert abs((per_node - 2 * P) / GIB - theirs) <= 0.005


@needs_deepspeed
def test_zero2_offload_host_against_deepspeed_all_live(capsys):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live

    estimate_zero2_model_states_mem_needs_all_live(_model("cpu"), num_gpus_per_node=2, additional_buffer_factor=1)
    theirs = _printed_cpu_gib(capsys.readouterr().out, "offload_optimizer=cpu")
    ours = zero.model_states(_model(), WL, layout=Layout(num_gpus=2), stage=2, offload_optimizer=True)
    per_node = 2 * ours.host_bytes
    # Theirs: P * max(4 * gpus, 16) = 16 B/param (fp32 master, grads, m, v).
    # Ours adds per rank the 16-bit copy-back buffer (P/2 x 2 B) and the
    # pinned gradient staging buffer (the largest param, 16-bit).
    extra = 2 * P + 2 * 2 * WIDTH * WIDTH
    assert per_node - extra == 16 * P
    assert abs((per_node - extra) / GIB - theirs) <= 0.005


def test_method_ranks_add_pinned_rounding_and_the_process_baseline():
    est = estimate_method("zero3-offload", tiny_config("llama"), WL, layout=Layout(num_gpus=2), gpu=get_gpu("a10g"))
    w = est.worst
    assert w.host_overheads["process"] == process_baseline_bytes()
    assert w.host_overheads["pinned_rounding"] > 0
    assert w.host_total_bytes == w.host_bytes + w.host_overheads["process"] + w.host_overheads["pinned_rounding"]
    assert est.host_total_bytes_per_node == 2 * w.host_total_bytes
    # A method without offload still needs each process' baseline.
    ddp = estimate_method("ddp", tiny_config("llama"), WL, layout=Layout(num_gpus=2), gpu=get_gpu("a10g"))
    assert ddp.worst.host_bytes == 0
    assert ddp.host_total_bytes_per_node == 2 * process_baseline_bytes()


# ------------------------------------------------------ a real offloaded optimizer step
def _rss() -> int:
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss


def _trim() -> None:
    """Return freed heap memory to the system (glibc's malloc_trim; 64 MiB arrays are mmapped anyway)."""
    import ctypes
    import ctypes.util

    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        ctypes.CDLL(name).malloc_trim(0)


def test_offloaded_adamw_step_on_cpu_matches_the_host_states():
    """DeepSpeed's CPU offload keeps per partition element an fp32 master
    weight, an fp32 gradient and Adam's two fp32 states on the host, stepped
    there. Run that step for real on the CPU and measure the process' RSS."""
    pytest.importorskip("psutil")
    n = 2**24  # 16M elements: 256 MiB of host states, far above allocator noise
    master = torch.zeros(n, dtype=torch.float32, requires_grad=True)  # fp32 master partition
    master.grad = torch.ones(n, dtype=torch.float32)  # fp32 gradient partition
    opt = torch.optim.AdamW([master], lr=1e-3, foreach=False)
    opt.step()
    # What the states hold: the RSS they give back when freed. (Growth from before the step undercounts
    # where the step reuses pages the process already held, e.g. freed by earlier tests.)
    _trim()  # what the step's own temporaries left in the heap goes back first
    held = _rss()
    del opt, master
    _trim()
    measured = held - _rss()
    # Ours: ZeRO-2 offload host bytes per partition element, less the 16-bit
    # copy-back buffer and the staging buffer (measured apart: not part of the step).
    st = zero.model_states(tiny_config("llama"), WL, layout=Layout(num_gpus=1), stage=2, offload_optimizer=True)
    es = 2
    largest = max(p.numel() for p in zero.build_training_model(tiny_config("llama"), WL, torch.bfloat16).parameters())
    per_element = (st.host_bytes - es * st.padded_trainable - es * largest) / st.padded_trainable
    assert per_element == 16
    assert abs(measured - per_element * n) <= 0.03 * per_element * n, (measured, per_element * n)


# ----------------------------------------------------------------- planner verdicts
def test_70b_on_one_a10g_is_refused_for_host_memory():
    from llmem_plugin.planner.search import plan

    t = time.perf_counter()
    with pytest.raises(WontFitError, match="host memory") as info:
        plan("llama-3.1-70b", gpu="a10g", num_gpus=1, suggest=False)
    assert time.perf_counter() - t < 30  # refused before any trace
    p = info.value.plan
    assert p.host_memory.node_bytes == 16 * GIB and "g5.xlarge" in p.host_memory.source
    # zero3-offload's least host need: 16-bit grads + 2 x 4-byte Adam states + 16-bit params per parameter.
    assert p.host_refused_bytes > 12 * 70 * 10**9
    assert "--host-memory" in str(info.value)
    assert any(name == "zero3-offload" and "host RAM" in why for name, why in p.skipped)


def test_unit_labels_name_the_checkpointing():
    from llmem_plugin.planner.candidates import _Config, _unit_label

    assert _unit_label(_Config("zero3-offload", 1), False, [False, True]) == "zero3-offload without ckpt"
    assert _unit_label(_Config("zero3-offload", 1), True, [False, True]) == "zero3-offload +ckpt"
    assert _unit_label(_Config("fsdp", 1), False, [False]) == "fsdp"


def test_fast_mode_takes_zero_offload_host_at_full_depth():
    # DeepSpeed's pinned buffers are whole-model flat buffers: a power of two of
    # their size is not affine in depth, so the fast mode must not extrapolate it.
    # 9 layers: fast mode traces 3 and 4 (DeepSpeed's shortest) and extrapolates
    # (at 7 both copies together are the model's depth: it runs in full).
    cfg = tiny_config("llama", num_hidden_layers=9)
    kw = {"layout": Layout(num_gpus=2), "gpu": get_gpu("a10g")}
    fast = estimate_method("zero3-offload", cfg, WL, fast=True, **kw)
    full = estimate_method("zero3-offload", cfg, WL, **kw)
    assert "fast: extrapolated" in fast.notes[-1]
    assert fast.worst.host_bytes == full.worst.host_bytes
    assert fast.worst.host_overheads == full.worst.host_overheads
