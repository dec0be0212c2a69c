"""Fast mode (two shortened traces, extrapolated per layer) equals the full trace."""

from __future__ import annotations

import pytest
import transformers

import llmem_plugin
from llmem_plugin.fast import layer_period
from llmem_plugin.workload import LoraSpec, Workload

from ..conftest import tiny_config


def gemma2(layers: int):
    # Alternating sliding/global layers with a window shorter than the sequence,
    # so the two layer kinds really differ (period 2).
    return transformers.Gemma2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=16, max_position_embeddings=512,
    )


MATRIX = [
    ("llama", Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed")),
    ("llama", Workload(seq_len=64, micro_batch_size=2, precision="fp32", optimizer="sgd")),
    ("llama", Workload(seq_len=64, micro_batch_size=1, precision="bf16-mixed", grad_checkpointing=True)),
    ("llama", Workload(seq_len=64, micro_batch_size=1, precision="bf16", lora=LoraSpec(rank=4))),
    ("llama", Workload(seq_len=32, micro_batch_size=1, precision="bf16-mixed", grad_accum_steps=2,
                       optimizer="adamw-fused")),
    ("gpt2", Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed", attn_implementation="eager")),
    ("opt", Workload(seq_len=64, micro_batch_size=2, precision="fp16-mixed")),
    ("qwen2", Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed", optimizer="adafactor")),
    ("mixtral", Workload(seq_len=64, micro_batch_size=2, precision="bf16")),
]


@pytest.mark.parametrize("arch, wl", MATRIX, ids=[f"{a}-{i}" for i, (a, _) in enumerate(MATRIX)])
def test_fast_equals_full(arch, wl):
    cfg = tiny_config(arch, **{"n_layer" if arch == "gpt2" else "num_hidden_layers": 7})
    full = llmem_plugin.estimate(cfg, wl)
    fast = llmem_plugin.estimate(cfg, wl, fast=True)
    assert fast.fast and not full.fast
    assert abs(fast.peak_allocated_bytes - full.peak_allocated_bytes) <= 1e-3 * full.peak_allocated_bytes
    assert fast.peak_phase == full.peak_phase
    assert fast.params == full.params and fast.trainable_params == full.trainable_params


@pytest.mark.parametrize("gc", [False, True])
def test_fast_equals_full_with_alternating_layers(gc):
    cfg = gemma2(8)
    assert layer_period(cfg) == 2
    wl = Workload(seq_len=64, micro_batch_size=1, precision="bf16-mixed", grad_checkpointing=gc)
    full = llmem_plugin.estimate(cfg, wl)
    fast = llmem_plugin.estimate(cfg, wl, fast=True)
    assert abs(fast.peak_allocated_bytes - full.peak_allocated_bytes) <= 1e-3 * full.peak_allocated_bytes


def test_fast_leaves_a_close_verdict_to_the_full_trace():
    cfg = tiny_config("llama", num_hidden_layers=7)
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed")
    full = llmem_plugin.estimate(cfg, wl)
    near = int(full.device_total_bytes * 1.01)  # within FAST_VERDICT_BAND of the need
    est = llmem_plugin.estimate(cfg, wl, fast=True, gpu_memory=near)
    assert not est.fast and est.fits
    assert est.peak_reserved_bytes == full.peak_reserved_bytes
    roomy = llmem_plugin.estimate(cfg, wl, fast=True, gpu_memory=2 * full.device_total_bytes)
    assert roomy.fast and roomy.fits
