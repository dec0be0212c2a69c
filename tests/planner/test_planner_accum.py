"""The planner's verified single-GPU candidate takes its whole accumulation window."""

from __future__ import annotations

import llmem_plugin
from llmem_plugin.planner.search import plan
from llmem_plugin.workload import Workload

from tests.conftest import tiny_config


def test_verified_single_gpu_accumulation_equals_the_estimate():
    # The verification goes through estimate()'s accumulation (micro-steps
    # traced until the simulated allocator settles, tests/test_grad_accum.py),
    # so the planner's figure is the estimate's for the same window. (Tiny
    # GPT-2's allocator still changes at micro-step 2; no tiny config was found
    # whose peak differs between 2 and 6 micro-steps.)
    cfg = tiny_config("gpt2")
    wl = Workload(seq_len=32)
    p = plan(cfg, gpu="h100-sxm", workload=wl, methods=["single"], global_batch=6, micro_batch=1,
             grad_checkpointing=False, suggest=False)
    c = p.choice
    assert (c.method, c.micro_batch, c.grad_accum, c.verified) == ("single", 1, 6, True)
    est = llmem_plugin.estimate(cfg, seq_len=32, micro_batch_size=1, grad_accum_steps=6, gpu="h100-sxm")
    assert c.peak_allocated_bytes == est.peak_allocated_bytes
    assert c.peak_reserved_bytes == est.peak_reserved_bytes
