"""At a capacity below the uncapped reserved peak, the allocator frees its cache and retries, and the report says so."""

from __future__ import annotations

import llmem_plugin

from tests.conftest import tiny_config


def test_capped_replay_reports_its_retries():
    cfg = tiny_config("llama", num_hidden_layers=8)
    kw = dict(seq_len=512, batch_size=4)
    roomy = llmem_plugin.estimate(cfg, **kw)
    assert roomy.alloc_retries == 0
    outside = roomy.device_total_bytes - roomy.peak_reserved_bytes
    # 2 MiB below the uncapped need: torch's allocator, on a failed cudaMalloc,
    # frees its cached blocks and retries (CUDACachingAllocator.cpp, alloc_block
    # then release_cached_blocks); the step fits with less reserved.
    cap = roomy.device_total_bytes - 2**21
    tight = llmem_plugin.estimate(cfg, gpu_memory=cap, **kw)
    assert tight.fits and tight.alloc_retries > 0
    assert tight.peak_reserved_bytes + outside <= cap < roomy.device_total_bytes
    assert tight.peak_allocated_bytes == roomy.peak_allocated_bytes
    assert "frees its cached blocks and retries" in str(tight)
    assert "retries" not in str(roomy) and tight.to_dict()["alloc_retries"] == tight.alloc_retries
