"""Estimate the single-GPU peak of a few fine-tuning setups of Llama-3.1-8B, offline."""

import llmem_plugin

GIB = 2**30

for label, kw in [
    ("full fine-tune, bf16 autocast", {}),
    ("+ gradient checkpointing", {"grad_checkpointing": True}),
    ("pure bf16 + checkpointing", {"precision": "bf16", "grad_checkpointing": True}),
    ("LoRA r=16 on attention", {"lora_rank": 16}),
]:
    est = llmem_plugin.estimate("llama-3.1-8b", seq_len=2048, batch_size=1, fast=True, **kw)
    print(f"{label:34s} {est.peak_allocated_bytes / GIB:7.2f} GiB at {est.peak_phase.value}")
