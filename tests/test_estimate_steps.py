"""The steps of ``llmem_plugin.estimate.estimate`` on their own: run in order on
a tiny config they give the whole estimate byte for byte, and each step's own
figures agree with an independent source (the transformers model's parameter
count, the LoRA closed form, a direct replay of the trace, the overheads' sum)."""

from __future__ import annotations

import importlib

import pytest
import transformers
from torch import nn

import llmem_plugin
from llmem_plugin.device.allocator import AllocatorResult, replay
from llmem_plugin.device.host import process_baseline_bytes
from llmem_plugin.errors import ConfigError
from llmem_plugin.techniques.optim import PAGED_MIN_NUMEL
from llmem_plugin.trace.step import STEADY_MICRO_STEPS

from tests.conftest import tiny_config

steps = importlib.import_module("llmem_plugin.estimate")  # the package's `estimate` is the function
GIB = 2**30


def _run_steps(model, fields, *, fast=False, full=False, seconds=0.0, **options):
    """Each step of estimate() in its order; the Estimate and every step's result."""
    inputs = steps._resolve_inputs(model, None, fields, gpu=options.get("gpu"), gpu_memory=options.get("gpu_memory"),
                                   alloc_conf=options.get("alloc_conf"), host_memory=options.get("host_memory"))
    built = steps._build(model, inputs, torch_version=None)
    traced = steps._trace_model(model, inputs, built, mode="fast" if fast else "full" if full else "auto")
    replayed = steps._replay(traced, inputs, built)
    est = steps._assemble(model, inputs, built, traced, replayed, seconds=seconds)
    return est, inputs, built, traced, replayed


@pytest.mark.parametrize("fields, options", [
    ({"seq_len": 32, "batch_size": 2}, {"gpu": "a100-40gb"}),
    ({"seq_len": 32, "lora_rank": 4, "grad_checkpointing": True}, {}),
    ({"seq_len": 16, "grad_accum_steps": 6}, {}),  # the shortened window and its note
    ({"seq_len": 64, "batch_size": 2}, {"gpu_memory": 40 * 2**20}),  # over the capacity: the capped replay
    ({"seq_len": 32}, {"fast": True}),
], ids=["plain", "lora-checkpointing", "accumulation", "over-capacity", "fast"])
def test_the_steps_in_order_give_the_whole_estimate(fields, options):
    cfg = tiny_config("llama", num_hidden_layers=6)
    whole = llmem_plugin.estimate(cfg, **fields, **options)
    fast = options.pop("fast", False)
    est = _run_steps(cfg, dict(fields), fast=fast, seconds=whole.seconds, **options)[0]
    assert est.to_dict() == whole.to_dict()
    assert str(est) == str(whole)


def test_resolve_inputs_applies_each_override():
    inputs = steps._resolve_inputs(tiny_config("llama"), None, {"seq_len": 32, "batch_size": 2, "lora_rank": 4},
                                   gpu="a100-40gb", gpu_memory="30GiB", alloc_conf="expandable_segments:True",
                                   host_memory="64GiB")
    assert inputs.gpu.name == "a100-40gb" and inputs.gpu.capacity_bytes == 30 * GIB
    assert inputs.alloc_config.to_env() == "expandable_segments:True"
    assert inputs.host.node_bytes == 64 * GIB
    wl = inputs.workload
    assert (wl.seq_len, wl.micro_batch_size, wl.lora.rank) == (32, 2, 4)
    with pytest.raises(ConfigError, match="either workload= or workload fields"):
        steps._resolve_inputs(tiny_config("llama"), wl, {"seq_len": 8}, gpu=None, gpu_memory=None, alloc_conf=None,
                              host_memory=None)


def test_build_counts_parameters_as_transformers_and_peft_do():
    cfg = tiny_config("llama")
    rank = 4
    inputs = steps._resolve_inputs(cfg, None, {"seq_len": 32, "lora_rank": rank}, gpu=None, gpu_memory=None,
                                   alloc_conf=None, host_memory=None)
    built = steps._build(cfg, inputs, torch_version=None)
    base = transformers.AutoModelForCausalLM.from_config(cfg)
    targets = inputs.workload.lora.target_modules
    # peft's LoRA: A is rank x in, B is out x rank, on every targeted Linear.
    lora = sum(rank * (m.in_features + m.out_features) for name, m in base.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)
    assert built.params == base.num_parameters() + lora
    assert built.trainable_params == lora
    assert built.num_layers == cfg.num_hidden_layers
    assert built.paged_bytes == 0  # AdamW keeps its states in device memory


@pytest.mark.parametrize("arch, workspace", [("gpt2", True), ("llama", False)])
def test_build_gives_a_model_with_biases_the_cublaslt_workspace(arch, workspace):
    # torch 2.10 and 2.11 keep a separate cuBLASLt workspace for addmm with a bias (llmem_plugin.device.overheads).
    inputs = steps._resolve_inputs(tiny_config(arch), None, {"seq_len": 32}, gpu=None, gpu_memory=None,
                                   alloc_conf=None, host_memory=None)
    built = steps._build(tiny_config(arch), inputs, torch_version="2.10.0")
    assert (built.overheads.cublaslt_workspace_bytes > 0) == workspace


def test_build_pages_a_paged_optimizers_states():
    cfg = tiny_config("llama", vocab_size=2048)  # embedding and head above bitsandbytes' paging threshold
    inputs = steps._resolve_inputs(cfg, None, {"seq_len": 32, "optimizer": "paged-adamw"}, gpu=None,
                                   gpu_memory=None, alloc_conf=None, host_memory=None)
    built = steps._build(cfg, inputs, torch_version=None)
    # PagedAdamW: fp32 exp_avg and exp_avg_sq in managed memory for every parameter bitsandbytes pages.
    paged = [p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters()
             if p.numel() >= PAGED_MIN_NUMEL]
    assert paged and built.paged_bytes == 2 * 4 * sum(paged)


def test_trace_model_shortens_a_long_window_and_says_so():
    accum = 6
    _, _, _, traced, _ = _run_steps(tiny_config("llama"), {"seq_len": 16, "grad_accum_steps": accum})
    last = STEADY_MICRO_STEPS - 1  # the last middle micro-step traced; the window's last one too
    assert traced.notes == (f"gradient accumulation: micro-steps 1-{last} and {accum} of {accum} traced; "
                            f"micro-steps {last + 1}-{accum - 1} repeat micro-step {last} exactly (the simulated "
                            "allocator's state is the same before and after it)",)
    assert not traced.fast and traced.extrapolated is None


def test_fast_trace_builds_the_full_traces_stream():
    cfg = tiny_config("llama", num_hidden_layers=6)
    _, _, _, full, _ = _run_steps(cfg, {"seq_len": 32}, full=True)
    _, _, _, fast, _ = _run_steps(cfg, {"seq_len": 32}, fast=True)
    assert fast.fast and not full.fast and fast.extrapolated is None
    assert fast.result.peak_bytes == full.result.peak_bytes
    assert fast.result.breakdown == full.result.breakdown
    assert fast.host_peak_bytes == full.host_peak_bytes


def test_replay_is_the_allocator_replay_of_the_trace_with_the_workspaces():
    est, inputs, built, traced, replayed = _run_steps(tiny_config("llama"), {"seq_len": 32, "batch_size": 2})
    events, phases = steps.allocator_events(traced.result, built.overheads)
    direct = replay(events, inputs.alloc_config, labels=phases)
    assert replayed.fits and direct.peak_reserved_bytes + built.overheads.outside_allocator_bytes \
        <= inputs.gpu.capacity_bytes
    assert (replayed.sim.peak_allocated_bytes, replayed.sim.peak_reserved_bytes) == \
        (direct.peak_allocated_bytes, direct.peak_reserved_bytes)
    # The setup phase ends before the step's peak: its figures are below the whole replay's.
    assert 0 < replayed.setup[0] <= direct.peak_allocated_bytes and replayed.setup[1] <= direct.peak_reserved_bytes
    assert max(v for _, _, v in replayed.timeline) == traced.result.peak_bytes  # the thinned timeline keeps the peak


def test_replay_takes_fast_modes_extrapolated_peaks_as_they_are():
    _, inputs, built, traced, _ = _run_steps(tiny_config("llama"), {"seq_len": 32})
    sim = AllocatorResult(peak_allocated_bytes=3 * 2**20, peak_reserved_bytes=4 * 2**20, peak_requested_bytes=3 * 2**20,
                          reserved_at_end_bytes=4 * 2**20, fragmentation=0.25, num_segments=2, num_alloc_retries=0)
    out = steps._replay(steps._Traced(result=traced.result, fast=True, host_peak_bytes=0, extrapolated=(sim, False)),
                        inputs, built)
    assert (out.sim, out.fits, out.timeline, out.memory_timeline, out.setup) == (sim, False, [], [], None)


def test_assemble_adds_what_lies_outside_the_allocator():
    est, inputs, built, traced, replayed = _run_steps(tiny_config("llama", vocab_size=2048),
                                                      {"seq_len": 32, "optimizer": "paged-adamw"})
    ov = built.overheads
    assert built.paged_bytes > 0  # in the device total, outside the allocator
    assert est.device_total_bytes == replayed.sim.peak_reserved_bytes + ov.cuda_context_bytes + ov.nccl_bytes \
        + built.paged_bytes
    assert est.host_bytes == traced.host_peak_bytes + process_baseline_bytes()
    assert est.capacity_bytes == inputs.gpu.capacity_bytes and est.fits == replayed.fits
    assert (est.params, est.trainable_params, est.num_layers) == (built.params, built.trainable_params, 2)
