"""llmem_plugin.device.allocator against torch's real CUDA caching allocator, event by event.

A subset of benchmarks/stub_allocator.py's matrix (the full run and its
result file are described in docs/allocator.md): seeded random streams and
the estimator's streams of two small models, under the default settings,
expandable segments, max_split_size with power-of-two rounding, a memory
fraction with garbage collection, and a capacity cap that forces the
free-and-retry path and an OOM. Every case must agree on the OOM event, both
peaks, and the allocated and reserved bytes after every event.
"""

from benchmarks.stub_allocator import BIG_STREAM, Case, big_stream, estimator_stream, random_stream, run_cases

GiB = 1 << 30


def test_simulation_matches_the_real_allocator(stub):
    streams = {
        "random-0": random_stream(0, live_target_bytes=2 * GiB),
        "random-3": random_stream(3, live_target_bytes=5 * GiB),
        "gpt2": estimator_stream("gpt2", seq_len=128),
        "opt-125m": estimator_stream("opt-125m", seq_len=128),
    }
    randoms = ["random-0", "random-3"]
    cases = [Case(stream=s, conf=c) for s in streams for c in ("", "expandable_segments:True")]
    cases += [Case(stream=s, conf="max_split_size_mb:128,roundup_power2_divisions:4") for s in streams]
    cases += [Case(stream=s, conf="roundup_power2_divisions:[64:8,256:4,512:2,>:1]") for s in randoms]
    cases += [Case(stream=s, memory_fraction=f) for s in randoms for f in (0.05, 1.0)]
    cases += [Case(stream=s, conf="expandable_segments:True", memory_fraction=0.05) for s in randoms]
    cases += [Case(stream=s, conf="garbage_collection_threshold:0.6", memory_fraction=0.06) for s in randoms]
    cases += [Case(stream=s, capacity_bytes=3 * GiB) for s in streams]
    # Past the device memory: a fraction of 1.0 is no limit; an expandable
    # segment (1 1/8 of the device memory) fills and a second one opens.
    streams[BIG_STREAM] = big_stream()
    cases += [Case(stream=BIG_STREAM, capacity_bytes=200 * GiB, memory_fraction=1.0),
              Case(stream=BIG_STREAM, conf="expandable_segments:True", capacity_bytes=200 * GiB)]
    rows = run_cases(cases, streams)
    differing = [{k: r.get(k) for k in ("name", "first_differing_event", "real_at_first", "sim_at_first", "oom_event",
                                        "sim")} for r in rows if not r["identical"]]
    assert not differing, differing
    # The matrix exercises what it claims: OOMs under the cap and the small
    # fraction, a run to completion elsewhere.
    assert any(r["oom_event"] >= 0 for r in rows if r["capacity_bytes"])
    assert any(r["oom_event"] < 0 for r in rows)
