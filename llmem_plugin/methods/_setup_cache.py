"""The step's reserved peak when the cache is emptied between setup and the first step.

A wrapper's setup (LowLevelZero flattening the parameters into its buffers,
DDP's initial broadcast, FSDP2 sharding) frees what it copied. The caching
allocator keeps those blocks cached, and a segment whose blocks are all free
stays reserved until ``torch.cuda.empty_cache()`` releases it
(c10/cuda/CUDACachingAllocator.cpp: ``release_cached_blocks`` frees every
unsplit cached block of every pool). Whether a script calls it between
building and training changes where the step's tensors land, and the reserved
peak can go either way:

* kept (no call): measured on the stub device, LowLevelZero stage 1 / 2 at
  Llama-3.2-1B shapes reserve 11,916,017,664 / 11,163,140,096 B, the
  replay of the trace as it is;
* emptied (``benchmarks/groundtruth/cuda.py`` ``_Recorder.reset`` and the stub
  worker's ``_reset`` do it before they reset the peaks): the setup's free
  252 MiB and 16 MiB segments are gone, and five (stage 2: more) of the first
  step's 32 MiB fp32 gradient copies find no cached block and take segments
  of their own: 12,083,789,824 / 11,343,495,168 B (+160 / +172 MiB), which
  this module's replay gives byte for byte
  (``benchmarks/results/stub-distributed-2026-11-25.md``).

The estimator cannot know which the job does, so for LowLevelZero a rank's
reserved peak is the larger of the two (:func:`reserved_if_emptied`, asked for
by ``rank_memory(emptied_cache_bound=True)``): never under either. The
emptied replay is only as good as the traced setup's frees: DDP's traced setup
(the initial broadcast over parameters the trace registers, not builds) gives
an emptied replay 576 MiB above the stub at Llama-3.2-1B shapes, where the
stub reserves the same with and without the call, so DDP and the other
methods keep the plain replay
(``benchmarks/results/stub-setup-cache-2026-12-06.md``).

Known limitations:
    * The emptied replay runs without a capacity: near the GPU's memory the
      allocator would free its cache and retry instead, so the emptied
      figure is capped at what the GPU can hand out, and ``fits`` comes from
      the kept replay.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.device.overheads import DeviceOverheads
from llmem_plugin.trace.tracker import Phase, TraceResult

__all__ = ["reserved_if_emptied"]


def reserved_if_emptied(trace: TraceResult, stream_of: Mapping[int, int] | None, config: AllocatorConfig,
                        overheads: DeviceOverheads, capacity: int | None) -> int | None:
    """Peak reserved bytes of the steps when ``torch.cuda.empty_cache()`` runs after setup.

    Args:
        trace: The rank's trace; its setup phase comes first.
        stream_of: Trace record index -> side stream (see
            :func:`llmem_plugin.methods._streams.replay_streams`); None or
            empty for one stream.
        config: The allocator settings.
        overheads: Device overheads (the cuBLAS workspaces placed in the stream).
        capacity: Device bytes available (None = unlimited): the result is at
            most what the allocator can reserve under it.

    Returns:
        The peak from the first step on, or None when the setup frees nothing
        (nothing for ``empty_cache`` to release, so both replays agree).
    """
    from llmem_plugin.estimate import allocator_events
    from llmem_plugin.methods._streams import replay_streams

    events, phases = allocator_events(trace, overheads)
    setup = Phase.SETUP.value
    start = next((i for i, p in enumerate(phases) if p != setup), None)
    if not start or not any(sign < 0 for sign, _, _ in events[:start]):
        return None
    reserved = replay_streams(events, stream_of or {}, config, empty_cache_at=start).peak_reserved_bytes
    if capacity is not None:
        reserved = min(reserved, max(capacity - overheads.outside_allocator_bytes, 0))
    return reserved
