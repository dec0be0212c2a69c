"""The last traced step played again equals tracing more steps (the independent source: a longer trace)."""

from __future__ import annotations

import pytest

from llmem_plugin.device.allocator import AllocatorConfig, replay
from llmem_plugin.device.steady import repeat_last_iteration


def test_pairs_the_older_frees_with_what_the_step_leaves_live():
    # step 1 makes g1 (kept) and t1 (freed); step 2 frees g1, makes g2 (kept) and t2 (freed)
    events = [(1, 0, 4096), (1, 1, 512), (-1, 1, 512), (1, 2, 4096), (-1, 0, 4096), (1, 3, 512), (-1, 3, 512)]
    longer = repeat_last_iteration(events, 3, 2)
    assert longer is not None and len(longer) == len(events) + 2 * 4
    live: set[int] = set()
    for sign, key, _ in longer:
        if sign > 0:
            assert key not in live
            live.add(key)
        else:
            assert key in live  # every free names a live tensor
            live.discard(key)
    assert len(live) == 1  # one gradient, as after every step


def test_a_stream_that_does_not_repeat_is_refused():
    events = [(1, 0, 4096), (1, 2, 8192), (-1, 0, 4096)]  # frees 4 KiB, leaves 8 KiB live
    assert repeat_last_iteration(events, 1, 1) is None


@pytest.mark.parametrize("descend", [False, True])
def test_played_again_equals_traced_again(descend, monkeypatch):
    import llmem_plugin.trace.step as step
    from llmem_plugin.estimate import allocator_events, trace_positions
    from llmem_plugin.device.overheads import device_overheads
    from llmem_plugin.trace.step import micro_mark
    from llmem_plugin.workload import Workload
    from tests.conftest import tiny_config
    from llmem_plugin.estimate import _trace  # noqa: PLC2701 (the traced step, as estimate runs it)
    from llmem_plugin.models import modelbuild
    from llmem_plugin.device.gpus import get_gpu

    cfg, wl, gpu = tiny_config("llama"), Workload(seq_len=64, micro_batch_size=2, precision="fp32"), get_gpu("h100-sxm")
    over = device_overheads((9, 0))
    config = AllocatorConfig(large_segments_descend=descend)
    streams = {}
    for n in (2, 3):
        monkeypatch.setattr(step, "NUM_ITERATIONS", n)
        trace = _trace(modelbuild.build_model(cfg, wl), wl, gpu)
        streams[n] = (trace, allocator_events(trace, over)[0])
    trace2, ev2 = streams[2]
    start = trace_positions(ev2)[trace2.marks[micro_mark(1, 0)]]
    played = repeat_last_iteration(ev2, start, 1)
    assert played is not None
    assert [(s, n) for s, _, n in played] == [(s, n) for s, _, n in streams[3][1]]
    a, b = replay(played, config), replay(streams[3][1], config)
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (b.peak_allocated_bytes, b.peak_reserved_bytes)


@pytest.mark.parametrize("descend,takes", [(False, "older"), (True, "newer")])
def test_a_tie_between_equal_free_segments(descend, takes):
    """torch 2.11: (size, address) order, new large segments below the old on a GPU -> the newer;
    torch 2.13: the cudaMalloc counter (pytorch#183591) -> the older."""
    from llmem_plugin.device.allocator import CachingAllocator

    alloc = CachingAllocator(AllocatorConfig(large_segments_descend=descend))
    size = 30 << 20  # above 10 MiB: a segment of exactly this size each
    older, newer = alloc.malloc(size), alloc.malloc(size)
    alloc.free(older)
    alloc.free(newer)
    assert alloc.malloc(size) == {"older": older, "newer": newer}[takes]
    assert alloc.stats.reserved == 2 * size


@pytest.mark.parametrize("version,descend", [("2.11.0", True), ("2.12.1", True), ("2.13.0", False)])
def test_the_tie_break_follows_the_jobs_torch(version, descend):
    """BlockComparatorSize (address) up to 2.11, taken as such for the unmeasured 2.12; the cudaMalloc
    counter from 2.13 (pytorch#183591)."""
    assert AllocatorConfig().for_torch(version).large_segments_descend is descend
