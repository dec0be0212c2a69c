"""The caching-allocator replay of a rank whose wrapper allocates on side streams.

PyTorch's CUDA caching allocator serves a request only from blocks of the
stream it is made on (c10/cuda/CUDACachingAllocator.cpp: ``BlockPool``
compares ``stream`` first, and ``get_free_block`` looks up
``(stream, size)``), and a block goes back to its own stream's free list when
freed (without ``record_stream`` FSDP2 keeps cross-stream tensors alive by
reference instead). Every stream thus grows its own segments, and the
device's allocated and reserved bytes are the sums over streams.

FSDP2 makes its all-gather inputs and outputs on an all-gather copy-in
stream and its reduce-scatter outputs on a reduce-scatter stream
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
``foreach_all_gather`` and ``foreach_reduce``); LowLevelZero's
``overlap_communication`` reduces on a stream of its own. On the CPU the
same code switches ``torch.cpu``'s current stream (torch/cpu/__init__.py
``StreamContext``), so :class:`~._rank_tracker.RankTracker` records each
allocation's stream as it happens; this module replays each stream through
its own :class:`~llmem_plugin.device.allocator.CachingAllocator` and sums them event
by event.

Known limitations:
    * Under a capacity, an allocator frees the cached blocks of every stream
      before it fails (``release_cached_blocks``); the per-stream replay does
      not, so a rank that needs that retry is replayed on one stream for its
      ``fits`` verdict (:func:`simulate_streams`).
"""

from __future__ import annotations

from collections.abc import Mapping

from llmem_plugin.device.allocator import AllocatorResult, CachingAllocator
from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.device.overheads import DeviceOverheads
from llmem_plugin.trace.tracker import TraceResult

__all__ = ["replay_streams", "simulate_streams"]


def replay_streams(events: list[tuple[int, int, int]], stream_of: Mapping[int, int], config: AllocatorConfig,
                   *, labels: list[str] | None = None, empty_cache_at: int | None = None) -> AllocatorResult:
    """Replay ``events`` with one allocator per stream.

    Args:
        events: ``(+1 | -1, key, nbytes)`` in program order.
        stream_of: Key -> stream number for allocations made off the default
            stream (0); frees follow their allocation's stream.
        config: The allocator settings.
        labels: A label per event (phases): per-label peaks as :func:`replay`.
        empty_cache_at: Before this event, ``torch.cuda.empty_cache()`` then
            ``torch.cuda.reset_peak_memory_stats()``: every stream's unsplit
            cached segments are released (``release_cached_blocks`` walks all
            pools) and the peaks restart from what is left.

    Returns:
        Peaks of the summed allocated and reserved bytes; ``num_segments`` and
        ``fragmentation`` over all streams.
    """
    allocators: dict[int, CachingAllocator] = {}
    handles: dict[int, tuple[int, int]] = {}
    allocated = reserved = 0
    peak_allocated = peak_reserved = 0
    allocated_at_peak_reserved = 0
    ph_alloc: dict[str, int] = {}
    ph_res: dict[str, int] = {}
    for i, (sign, key, nbytes) in enumerate(events):
        if i == empty_cache_at:
            for alloc in allocators.values():
                alloc.empty_cache()
            reserved = sum(a.stats.reserved for a in allocators.values())
            peak_allocated, peak_reserved, allocated_at_peak_reserved = allocated, reserved, allocated
        if sign > 0:
            if nbytes <= 0:
                continue
            stream = stream_of.get(key, 0)
            alloc = allocators.get(stream)
            if alloc is None:
                alloc = allocators[stream] = CachingAllocator(config)
            st = alloc.stats
            before = st.allocated, st.reserved
            handles[key] = (stream, alloc.malloc(nbytes))
        else:
            held = handles.pop(key, None)
            if held is None:
                continue
            alloc = allocators[held[0]]
            st = alloc.stats
            before = st.allocated, st.reserved
            alloc.free(held[1])
        allocated += st.allocated - before[0]
        reserved += st.reserved - before[1]
        peak_allocated = max(peak_allocated, allocated)
        if reserved > peak_reserved:
            peak_reserved, allocated_at_peak_reserved = reserved, allocated
        if labels is not None:
            lab = labels[i]
            ph_alloc[lab] = max(ph_alloc.get(lab, -1), allocated)
            ph_res[lab] = peak_reserved
    results = [a.result() for a in allocators.values()]
    return AllocatorResult(
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        peak_requested_bytes=sum(r.peak_requested_bytes for r in results),  # an upper bound across streams
        reserved_at_end_bytes=reserved,
        fragmentation=1.0 - allocated_at_peak_reserved / peak_reserved if peak_reserved else 0.0,
        num_segments=sum(r.num_segments for r in results),
        num_alloc_retries=0,
        phase_allocated_bytes=ph_alloc,
        phase_reserved_bytes=ph_res,
    )


def simulate_streams(trace: TraceResult, stream_of: Mapping[int, int], config: AllocatorConfig,
                     overheads: DeviceOverheads, capacity: int | None) -> tuple[AllocatorResult, bool]:
    """:func:`llmem_plugin.estimate.simulate_trace` with side streams.

    The cuBLAS workspaces go to the default stream (the forward thread's and
    the autograd thread's current stream is the default one). When the
    summed reserved bytes exceed ``capacity``, the single-stream capped
    replay decides ``fits`` (see Known limitations).
    """
    from llmem_plugin.estimate import allocator_events, simulate_trace

    events, phases = allocator_events(trace, overheads)
    result = replay_streams(events, stream_of, config, labels=phases)
    if capacity is None or result.peak_reserved_bytes + overheads.outside_allocator_bytes <= capacity:
        return result, True
    capped, fits = simulate_trace(trace, config, overheads, capacity)
    return (capped if fits else result), fits
