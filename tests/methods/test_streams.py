"""Per-stream replay (methods/_streams.py) and the kernel metadata FSDP2 allocates."""

from __future__ import annotations

import torch

from llmem_plugin.device.allocator import replay
from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.methods._streams import replay_streams
from llmem_plugin.methods.fsdp import _chunk_cat_metadata_numel

MiB = 2**20


def test_one_stream_is_the_plain_replay():
    events = [(1, 0, 3 * MiB), (1, 1, 5 * MiB), (-1, 0, 3 * MiB), (1, 2, 2 * MiB), (-1, 1, 5 * MiB), (-1, 2, 2 * MiB)]
    plain = replay(events, AllocatorConfig())
    streamed = replay_streams(events, {}, AllocatorConfig())
    assert (streamed.peak_allocated_bytes, streamed.peak_reserved_bytes) == (
        plain.peak_allocated_bytes, plain.peak_reserved_bytes)


def test_a_block_freed_on_a_side_stream_serves_only_that_stream():
    # 20 MiB made and freed on stream 1, then 20 MiB on the default stream:
    # one stream would reuse the cached segment; two pools hold two segments.
    events = [(1, 0, 20 * MiB), (-1, 0, 20 * MiB), (1, 1, 20 * MiB), (-1, 1, 20 * MiB)]
    one = replay_streams(events, {}, AllocatorConfig())
    two = replay_streams(events, {0: 1}, AllocatorConfig())
    assert one.peak_reserved_bytes == 20 * MiB
    assert two.peak_reserved_bytes == 40 * MiB
    assert one.peak_allocated_bytes == two.peak_allocated_bytes == 20 * MiB


def test_empty_cache_releases_every_streams_free_segments_and_restarts_the_peaks():
    # Setup: 100 MiB made and freed on the default stream, 30 MiB on stream 1; then a 12 MiB step tensor.
    events = [(1, 0, 100 * MiB), (1, 1, 30 * MiB), (-1, 0, 100 * MiB), (-1, 1, 30 * MiB), (1, 2, 12 * MiB)]
    kept = replay_streams(events, {1: 1}, AllocatorConfig())
    emptied = replay_streams(events, {1: 1}, AllocatorConfig(), empty_cache_at=4)
    assert kept.peak_reserved_bytes == 130 * MiB  # the 12 MiB split off the cached 100 MiB segment
    # torch.cuda.empty_cache(): both streams' unsplit segments go; reset_peak_memory_stats(): the peak
    # is the step's own 12 MiB segment.
    assert emptied.peak_reserved_bytes == 12 * MiB
    assert emptied.peak_allocated_bytes == 12 * MiB


def test_chunk_cat_metadata_of_a_root_group_over_8_ranks():
    """Llama-3.2-1B's untied root group (embedding, final norm, head), bf16
    gradients into the fp32 reduce-scatter input: one block per 2 KiB of each
    tensor's padded fp32 chunk, plus 6 entries per tensor and 2 (1,026,216 B
    measured on the stub CUDA device)."""
    grads = [torch.empty(128256, 2048, dtype=torch.bfloat16, device="meta"),
             torch.empty(2048, dtype=torch.bfloat16, device="meta"),
             torch.empty(128256, 2048, dtype=torch.bfloat16, device="meta")]
    out = torch.empty(8, (2 * 128256 * 2048 + 2048) // 8, dtype=torch.float32, device="meta")
    assert _chunk_cat_metadata_numel(grads, 8, out) * 8 == 1_026_216


def test_chunk_cat_takes_the_composite_path_for_other_casts():
    grads = [torch.empty(64, 4, dtype=torch.float16, device="meta")]
    out = torch.empty(2, 128, dtype=torch.float32, device="meta")
    assert _chunk_cat_metadata_numel(grads, 2, out) == 0
