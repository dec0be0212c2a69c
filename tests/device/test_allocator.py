"""The allocator simulation on hand-made event streams.

Each expected number follows from a rule of c10/cuda/CUDACachingAllocator.cpp,
named in the test: segment sizes (get_allocation_size), rounding (round_size),
splitting (should_split), best fit (get_free_block), coalescing (free_block),
no release to the driver, free-and-retry (release_cached_blocks), and
expandable segments (map_block in 20 MiB pages).
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmem_plugin.device.allocator import (
    AllocatorConfig,
    CachingAllocator,
    SimulatedOOM,
    replay,
)
from llmem_plugin.errors import ConfigError

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def test_small_requests_share_a_2mib_segment():
    a = CachingAllocator()
    a.malloc(1)  # rounded to kMinBlockSize
    assert (a.stats.allocated, a.stats.reserved) == (512, 2 * MiB)
    a.malloc(1 * MiB)  # <= kSmallSize: still the small pool, same segment
    assert a.stats.reserved == 2 * MiB
    a.malloc(1 * MiB)  # 2 MiB - 512 B left is not enough: a second small segment
    assert a.stats.reserved == 4 * MiB
    assert a.stats.allocated == 512 + 2 * MiB


def test_mid_size_requests_take_a_20mib_segment():
    a = CachingAllocator()
    a.malloc(1 * MiB + 1)  # > kSmallSize and < kMinLargeAlloc: kLargeBuffer
    assert a.stats.reserved == 20 * MiB
    assert a.stats.allocated == 1 * MiB + 512
    for _ in range(3):
        a.malloc(5 * MiB)  # 1 MiB + 512 + 15 MiB = 16 MiB + 512 B fit in the same segment
    assert a.stats.reserved == 20 * MiB
    a.malloc(5 * MiB)  # 20 MiB - (16 MiB + 512 B) < 5 MiB: a new 20 MiB segment
    assert a.stats.reserved == 40 * MiB


def test_large_requests_round_to_2mib_and_split_only_past_1mib():
    a = CachingAllocator()
    a.malloc(10 * MiB)  # >= kMinLargeAlloc: its own segment, rounded to 2 MiB
    assert (a.stats.allocated, a.stats.reserved) == (10 * MiB, 10 * MiB)
    a.malloc(11 * MiB)  # 12 MiB segment; the 1 MiB rest is not > kSmallSize: no split
    assert a.stats.reserved == 22 * MiB
    assert a.stats.allocated == 22 * MiB  # the whole 12 MiB block counts as allocated
    a.malloc(10 * MiB + 512 * KiB)  # 12 MiB segment; the 1.5 MiB rest is split off
    assert a.stats.reserved == 34 * MiB
    assert a.stats.allocated == 32 * MiB + 512 * KiB
    assert a.segments()[-1] == [(10 * MiB + 512 * KiB, True), (1 * MiB + 512 * KiB, False)]


def test_freed_blocks_are_reused_and_never_released():
    a = CachingAllocator()
    h = a.malloc(8 * MiB)
    a.free(h)
    assert (a.stats.allocated, a.stats.reserved) == (0, 20 * MiB)  # cached, not cudaFree'd
    a.malloc(4 * MiB)
    assert a.stats.reserved == 20 * MiB


def test_best_fit_takes_the_smallest_block_that_fits():
    a = CachingAllocator()
    x, y = a.malloc(30 * MiB), a.malloc(12 * MiB)  # one segment each
    a.free(x)
    a.free(y)
    a.malloc(11 * MiB + 512 * KiB)  # fits both; best fit takes the 12 MiB one
    assert a.stats.reserved == 42 * MiB
    assert a.segments() == [[(30 * MiB, False)], [(12 * MiB, True)]]  # rest 512 KiB: not split
    a.malloc(11 * MiB)  # only the 30 MiB block is left: used and split (rest 19 MiB > 1 MiB)
    assert a.segments()[0] == [(11 * MiB, True), (19 * MiB, False)]
    assert a.stats.reserved == 42 * MiB


def test_free_neighbours_coalesce():
    a = CachingAllocator()
    x, y = a.malloc(5 * MiB), a.malloc(5 * MiB)
    a.free(x)
    a.free(y)
    assert a.segments() == [[(20 * MiB, False)]]  # one free block again
    a.malloc(18 * MiB)  # fits only in the merged 20 MiB block
    assert a.stats.reserved == 20 * MiB
    assert a.segments() == [[(18 * MiB, True), (2 * MiB, False)]]


def test_failed_cudamalloc_frees_the_cache_and_retries():
    a = CachingAllocator(capacity_bytes=24 * MiB)
    a.free(a.malloc(12 * MiB))
    a.malloc(14 * MiB)  # 12 + 14 > 24: release_cached_blocks, then retry succeeds
    assert a.stats.reserved == 14 * MiB
    assert a.stats.num_alloc_retries == 1
    assert a.stats.peak_reserved == 14 * MiB


def test_out_of_memory_when_live_blocks_do_not_leave_room():
    a = CachingAllocator(capacity_bytes=24 * MiB)
    a.malloc(12 * MiB)
    with pytest.raises(SimulatedOOM):
        a.malloc(14 * MiB)
    res = replay([(1, 0, 12 * MiB), (1, 1, 14 * MiB)], capacity_bytes=24 * MiB)
    assert res.oom and res.oom_event == 1


def test_split_blocks_are_not_released_before_oom():
    # release_cached_blocks only frees segments with no live block in them.
    a = CachingAllocator(capacity_bytes=40 * MiB)
    live = a.malloc(2 * MiB)
    a.free(a.malloc(2 * MiB))  # same 20 MiB segment, freed: segment stays split
    a.malloc(19 * MiB)  # 20 MiB segment: 40 total, fits exactly
    with pytest.raises(SimulatedOOM):
        a.malloc(19 * MiB)
    del live


def test_unconstrained_replay_matches_segment_arithmetic():
    events = [(1, 0, 3 * MiB), (1, 1, 30 * MiB), (-1, 0, 3 * MiB), (1, 2, 100), (-1, 1, 30 * MiB), (1, 3, 30 * MiB)]
    res = replay(events)
    assert res.peak_reserved_bytes == 20 * MiB + 30 * MiB + 2 * MiB
    assert res.peak_allocated_bytes == 3 * MiB + 30 * MiB
    assert res.reserved_at_end_bytes == res.peak_reserved_bytes
    assert not res.oom


def test_max_split_size_keeps_oversize_blocks_whole():
    cfg = AllocatorConfig.from_env("max_split_size_mb:100")
    a = CachingAllocator(cfg)
    a.free(a.malloc(200 * MiB))
    a.malloc(60 * MiB)  # small request may not take an oversize block: new segment
    assert a.stats.reserved == 260 * MiB
    a.malloc(150 * MiB)  # 200 >= 150 + 20 (max_non_split_rounding): not used either
    assert a.stats.reserved == 410 * MiB
    a.malloc(190 * MiB)  # 200 < 190 + 20: the cached block is used, unsplit
    assert a.stats.reserved == 410 * MiB
    assert a.stats.allocated == 60 * MiB + 150 * MiB + 200 * MiB


def test_max_split_size_frees_one_oversize_block_before_all():
    cfg = AllocatorConfig.from_env("max_split_size_mb:100")
    a = CachingAllocator(cfg, capacity_bytes=400 * MiB)
    a.free(a.malloc(200 * MiB))
    a.free(a.malloc(120 * MiB))
    a.malloc(70 * MiB)  # 320 + 70 <= 400: new segment, cache untouched
    a.malloc(100 * MiB)  # 390 + 100 > 400: release_available_cached_blocks frees the 120 MiB block
    assert a.stats.reserved == 200 * MiB + 70 * MiB + 100 * MiB
    assert a.stats.num_alloc_retries == 0  # no full release was needed


def test_roundup_power2_divisions():
    a = CachingAllocator(AllocatorConfig.from_env("roundup_power2_divisions:4"))
    # 1200 MiB lies in [1024, 2048) MiB, whose quarters are 256 MiB: rounds to 1280 MiB.
    assert a.round_size(1200 * MiB) == 1280 * MiB
    assert a.round_size(1024 * MiB) == 1024 * MiB  # powers of two stay
    assert a.round_size(1000) == 1024  # [512, 1024) quarters are 128 B: 1000 -> 1024
    assert CachingAllocator().round_size(1200 * MiB) == 1200 * MiB
    a.malloc(1200 * MiB)
    assert a.stats.allocated == a.stats.reserved == 1280 * MiB


def test_roundup_list_form_follows_the_source():
    cfg = AllocatorConfig.from_env("roundup_power2_divisions:[256:1,512:2,>:4]")
    # First entry fills all intervals below it; '>' fills those above the last
    # named one (AcceleratorAllocatorConfig::parseRoundUpPower2Divisions, torch
    # 2.13: std::fill from last_index + 1), so [512 MiB, 1 GiB) keeps its 2.
    assert cfg.divisions_for(3 * MiB) == 1
    assert cfg.divisions_for(300 * MiB) == 1
    assert cfg.divisions_for(600 * MiB) == 2
    assert cfg.divisions_for(1500 * MiB) == 4
    assert cfg.divisions_for(40 * GiB) == 4


def test_expandable_segments_keep_reserved_near_allocated():
    sizes = (12, 14, 16, 18)  # each larger than any cached block so far
    plain = CachingAllocator()
    grow = CachingAllocator(AllocatorConfig.from_env("expandable_segments:True"))
    for a in (plain, grow):
        for s in sizes:
            a.free(a.malloc(s * MiB))
    assert plain.stats.peak_reserved == sum(sizes) * MiB  # one segment per request
    assert grow.stats.peak_reserved == 20 * MiB  # one 20 MiB page, reused in place


def test_expandable_segments_map_in_20mib_pages_and_split_to_512():
    a = CachingAllocator(AllocatorConfig.from_env("expandable_segments:True"))
    a.malloc(30 * MiB)
    assert a.stats.reserved == 40 * MiB
    a.malloc(30 * MiB)  # 10 MiB mapped and free + 20 MiB newly mapped
    assert a.stats.reserved == 60 * MiB
    a.malloc(11 * MiB)  # would not split in a plain large segment; here it splits
    assert a.stats.allocated == 71 * MiB
    assert a.stats.reserved == 80 * MiB
    a.malloc(4 * KiB)  # small pool: its own expandable segment, 2 MiB pages
    assert a.stats.reserved == 82 * MiB


def test_expandable_segments_unmap_free_pages_before_oom():
    cfg = AllocatorConfig.from_env("expandable_segments:True")
    for capacity, reserved, retries in ((None, 120 * MiB, 0), (100 * MiB, 80 * MiB, 1)):
        a = CachingAllocator(cfg, capacity_bytes=capacity)
        x = a.malloc(40 * MiB)
        a.malloc(20 * MiB)
        a.free(x)  # pages [0, 40) MiB free but mapped; [40, 60) live
        a.malloc(50 * MiB)  # the free 40 MiB are too few: map 60 MiB more at the end
        # Under a 100 MiB cap, 60 + 60 fails; the two free pages are unmapped and the retry fits.
        assert (a.stats.reserved, a.stats.num_alloc_retries) == (reserved, retries)
        assert a.stats.allocated == 70 * MiB


def test_expandable_segments_can_still_fragment():
    a = CachingAllocator(AllocatorConfig.from_env("expandable_segments:True"), capacity_bytes=100 * MiB)
    x = a.malloc(60 * MiB)
    a.malloc(20 * MiB)
    a.free(x)
    a.malloc(50 * MiB)  # reuses [0, 50); [50, 60) free, but page [40, 60) is partly live
    with pytest.raises(SimulatedOOM):
        a.malloc(30 * MiB)  # 70 live + 30 = 100, yet no whole free page can be unmapped


def test_garbage_collection_needs_a_memory_fraction_below_one():
    # setMemoryFraction() sets allowed_memory_maximum only below 1.0, and GC
    # runs only with it set: a fraction of 1.0 is no limit and no GC.
    cfg = AllocatorConfig.from_env("garbage_collection_threshold:0.5")
    no_fraction = CachingAllocator(cfg)
    fraction_one = CachingAllocator(cfg, memory_fraction=1.0, device_memory_bytes=100 * MiB)
    with_fraction = CachingAllocator(cfg, memory_fraction=0.99, device_memory_bytes=100 * MiB)
    for a in (no_fraction, fraction_one, with_fraction):
        a.free(a.malloc(30 * MiB))
        a.free(a.malloc(32 * MiB))
        a.malloc(34 * MiB)  # reserved 62 > 49.5: GC frees cached segments first
    assert no_fraction.stats.reserved == fraction_one.stats.reserved == 96 * MiB
    assert with_fraction.stats.reserved < 96 * MiB


def test_garbage_collection_runs_only_when_no_cached_block_fits():
    # DeviceCachingAllocator::malloc calls garbage_collect_cached_blocks inside
    # `if (!block_found)`: a request served from the cache frees nothing.
    cfg = AllocatorConfig.from_env("garbage_collection_threshold:0.5")
    a = CachingAllocator(cfg, memory_fraction=0.99, device_memory_bytes=100 * MiB)
    a.free(a.malloc(30 * MiB))
    a.free(a.malloc(32 * MiB))  # reserved 62 MiB, above the 49.5 MiB threshold
    a.malloc(30 * MiB)  # fits the cached 30 MiB block: no collection
    assert a.stats.reserved == 62 * MiB


@pytest.mark.parametrize("text", ["max_split_size_mb:10", "max_non_split_rounding_mb:8", "foo:1", "expandable_segments:yes",
                                  "garbage_collection_threshold:1.5", "roundup_power2_divisions:3", "nonsense"])
def test_bad_alloc_conf_is_a_config_error(text):
    with pytest.raises(ConfigError, match="HINT"):
        AllocatorConfig.from_env(text)


def test_cuda_malloc_async_is_refused():
    with pytest.raises(ConfigError, match="not modelled"):
        CachingAllocator(AllocatorConfig.from_env("backend:cudaMallocAsync"))


def test_alloc_conf_round_trips():
    text = "max_split_size_mb:128,roundup_power2_divisions:4,expandable_segments:True"
    assert AllocatorConfig.from_env(AllocatorConfig.from_env(text).to_env()) == AllocatorConfig.from_env(text)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 64 * MiB)), min_size=1, max_size=60), st.booleans())
def test_invariants_on_random_streams(ops, expandable):
    cfg = AllocatorConfig(expandable_segments=expandable)
    a = CachingAllocator(cfg)
    live: list[int] = []
    for do_free, n in ops:
        if do_free and live:
            a.free(live.pop(n % len(live)))
        else:
            live.append(a.malloc(n))
        segs = a.segments()
        held = sum(s for seg in segs for s, _ in seg)
        assert held == a.stats.reserved  # blocks tile the mapped segments exactly
        assert sum(s for seg in segs for s, used in seg if used) == a.stats.allocated
        assert a.stats.allocated <= a.stats.reserved
        for seg in segs:  # no two free neighbours left unmerged
            assert not any(not u1 and not u2 for (_, u1), (_, u2) in itertools.pairwise(seg))


def test_large_segment_size_option():
    a = CachingAllocator(AllocatorConfig.from_env("large_segment_size_mb:32"))
    a.malloc(5 * MiB)  # 1 MiB < request < 10 MiB: a large_segment_size segment (torch 2.11+)
    assert a.stats.reserved == 32 * MiB
    g = CachingAllocator(AllocatorConfig.from_env("large_segment_size_mb:32,expandable_segments:True"))
    g.malloc(33 * MiB)  # expandable large pages are that size too
    assert g.stats.reserved == 64 * MiB


def test_timeline_follows_the_allocator_rules():
    events = [
        (1, 0, 1 * MiB),  # <= kSmallSize: a 2 MiB small segment
        (1, 1, 5 * MiB),  # < kMinLargeAlloc: a 20 MiB segment, 15 MiB of it left free
        (1, 2, 16 * MiB),  # more than the free 15 MiB: its own 16 MiB segment
        (-1, 1, 5 * MiB),  # cached and merged with the free 15 MiB; reserved stays
        (1, 3, 0),  # zero bytes: no block
        (-1, 2, 16 * MiB),
        (1, 4, 15 * MiB),  # best fit is the cached 16 MiB block; its 1 MiB rest is not split off
        (-1, 0, 1 * MiB),
    ]
    labels = ["forward"] * 3 + ["backward"] * 4 + ["optimizer"]
    expected = [  # (allocated, reserved) in MiB after each event
        (1, 2), (6, 22), (22, 38), (17, 38), (17, 38), (1, 38), (17, 38), (16, 38),
    ]
    res = replay(events, labels=labels, timeline_points=100)
    assert [(i, lab) for i, lab, _, _ in res.timeline] == list(enumerate(labels))
    assert [(a // MiB, r // MiB) for _, _, a, r in res.timeline] == expected
    assert all(a % MiB == 0 and r % MiB == 0 for _, _, a, r in res.timeline)
    assert max(a for _, _, a, _ in res.timeline) == res.peak_allocated_bytes == 22 * MiB
    assert max(r for _, _, _, r in res.timeline) == res.peak_reserved_bytes == 38 * MiB
    assert replay(events, labels=labels).timeline == []  # off by default
    # Without labels the label is "", and the replay's other results do not change.
    plain = replay(events, timeline_points=100)
    assert {lab for _, lab, _, _ in plain.timeline} == {""}
    assert plain.peak_allocated_bytes == res.peak_allocated_bytes
    assert replay(events, labels=labels).phase_allocated_bytes == res.phase_allocated_bytes


def test_timeline_under_a_cap_shows_the_release_and_stops_at_oom():
    # 12 + 14 > 24: release_cached_blocks frees the cached 12 MiB segment, then the retry fits.
    res = replay([(1, 0, 12 * MiB), (-1, 0, 12 * MiB), (1, 1, 14 * MiB)], capacity_bytes=24 * MiB,
                 timeline_points=10)
    assert [(a // MiB, r // MiB) for _, _, a, r in res.timeline] == [(12, 12), (0, 12), (14, 14)]
    oom = replay([(1, 0, 12 * MiB), (1, 1, 14 * MiB)], capacity_bytes=24 * MiB, timeline_points=10)
    assert oom.oom and [i for i, *_ in oom.timeline] == [0]  # the failing event has no point


def test_thinned_timeline_keeps_both_peaks_and_the_phase_starts():
    rng = random.Random(0)
    events, labels, live = [], [], []
    for i in range(3000):
        if live and rng.random() < 0.45:
            key, n = live.pop(rng.randrange(len(live)))
            events.append((-1, key, n))
        else:
            n = rng.choice([512, 300 * KiB, 3 * MiB, rng.randrange(1, 64 * MiB)])
            events.append((1, i, n))
            live.append((i, n))
        labels.append(("forward", "backward", "optimizer")[i * 3 // 3000])
    full = replay(events, labels=labels, timeline_points=len(events))
    thin = replay(events, labels=labels, timeline_points=64)
    assert len(full.timeline) == len(events)
    assert len(thin.timeline) <= 64 + 6
    by_index = {p[0]: p for p in full.timeline}
    assert all(by_index[p[0]] == p for p in thin.timeline)  # a subset, not a resampling
    assert [p[0] for p in thin.timeline] == sorted({p[0] for p in thin.timeline})
    assert max(p[2] for p in thin.timeline) == thin.peak_allocated_bytes == full.peak_allocated_bytes
    assert max(p[3] for p in thin.timeline) == thin.peak_reserved_bytes == full.peak_reserved_bytes
    kept = {p[0] for p in thin.timeline}
    assert {0, 1000, 2000, 2999} <= kept  # first, each phase's first event, last


def test_empty_cache_at_releases_unsplit_segments_and_restarts_the_peaks():
    """torch.cuda.empty_cache() releases every cached segment with no live block
    (release_cached_blocks -> release_block only for a block with no prev/next), and
    reset_peak_memory_stats() restarts the peaks from the current values."""
    events = [
        (1, 1, 100 * MiB), (1, 2, 12 * MiB),  # a 100 MiB segment and a 12 MiB one
        (-1, 1, 100 * MiB),  # cached, unsplit: released at the reset
        (1, 3, 6 * MiB),  # after the reset: a 6 MiB request takes a new 20 MiB segment (kLargeBuffer)
    ]
    res = replay(events, empty_cache_at=3)
    assert res.peak_reserved_bytes == 12 * MiB + 20 * MiB
    assert res.peak_allocated_bytes == 12 * MiB + 6 * MiB
    whole = replay(events)  # without the reset: the 100 MiB segment stays cached and its peak counts
    assert whole.peak_reserved_bytes == 112 * MiB
    assert whole.peak_allocated_bytes == 112 * MiB
