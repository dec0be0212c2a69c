"""The predicted snapshot: PyTorch's format, the allocator's documented actions, and PyTorch's own reader."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import pytest
import torch.cuda._memory_viz as memory_viz

from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.estimate import estimate
from llmem_plugin.snapshot.history import load_snapshot, read_history
from llmem_plugin.snapshot.predict import UNKNOWN, replay_history, snapshot_of, write_snapshot

TINY = str(Path(__file__).resolve().parents[2] / "benchmarks" / "tiny-llama-2l.json")
MiB = 1 << 20


@pytest.fixture(scope="module")
def est():
    return estimate(TINY, seq_len=64, micro_batch_size=2, precision="bf16-mixed", keep_trace=True)


@pytest.fixture(scope="module")
def snap(est):
    return snapshot_of(est)


def test_the_history_follows_the_allocators_documented_rules():
    # c10/cuda/CUDACachingAllocator.cpp: a request of at most 1 MiB (kSmallSize) takes a 2 MiB segment
    # (kSmallBuffer); one below 10 MiB (kMinLargeAlloc) a 20 MiB one (kLargeBuffer); a larger one its size
    # rounded to 2 MiB (kRoundLarge). Blocks are 512-B multiples, split off the low end of a free block.
    # TraceEntry ALLOC carries the size asked for; free() logs FREE_REQUESTED, then FREE_COMPLETED.
    events = [(1, 0, 4096), (1, 1, 12_000_256), (1, 2, 1536), (1, 3, 5 * MiB), (-1, 0, 4096)]
    requested = [4000, 12_000_000, 1200, 5 * MiB, 0]
    alloc, history, owner, live = replay_history(events, requested, AllocatorConfig())
    base_small, base_big = history[0][1], history[2][1]
    assert [(a, s) for a, _, s, _ in history] == [
        ("segment_alloc", 2 * MiB), ("alloc", 4000),
        ("segment_alloc", 12 * MiB), ("alloc", 12_000_000),
        ("alloc", 1200),
        ("segment_alloc", 20 * MiB), ("alloc", 5 * MiB),
        ("free_requested", 4000), ("free_completed", 4000)]
    assert history[4][1] == base_small + 4096  # the second small block follows the first
    assert history[3][1] == base_big
    assert owner == [0, 0, 1, 1, 2, 3, 3, 4, 4]
    assert set(live.values()) == {1, 2, 3}


def test_the_snapshot_holds_what_memoryviz_requires(snap, tmp_path):
    entries = snap["device_traces"][0]
    assert {e["action"] for e in entries} >= {"segment_alloc", "alloc", "free_requested", "free_completed"}
    # MemoryViz replays the history backwards from the end state: blocks tile their segment exactly.
    for seg in snap["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    # Once any entry has a category, 'unknown' must be one (annotate_snapshot).
    assert UNKNOWN in {e.get("category") for e in entries}
    path = write_snapshot(snap, tmp_path / "pred.pickle")
    assert path.read_bytes()[:2] == b"\x80\x04"  # pickle protocol 4: what MemoryViz's unpickler reads


def test_the_history_read_back_has_the_estimates_peaks(est, snap):
    h = read_history(snap)
    assert h.peak_allocated_bytes == est.peak_allocated_bytes
    assert h.peak_reserved_bytes == est.peak_reserved_bytes
    assert h.allocated_before == 0 and h.reserved_before == 0  # the whole history: from the first allocation


def test_frames_name_the_module_the_op_and_the_category(snap):
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    cats = {e["category"] for e in allocs}
    assert {"parameters", "gradients", "optimizer_states", "activations", "temporaries"} <= cats
    mm = [e for e in allocs if e["frames"][0]["name"] == "aten.mm.default"]
    assert mm and all(e["frames"][0]["filename"].startswith("model.layers.") for e in mm
                      if e["frames"][1]["name"] == "forward" and "lm_head" not in e["frames"][0]["filename"])
    assert all(e["frames"][1]["filename"] == f"category:{e['category']}" for e in allocs)


def test_torchs_memory_viz_reads_it(snap, tmp_path):
    path = write_snapshot(snap, tmp_path / "pred.pickle")
    data = pickle.loads(path.read_bytes())
    summary = memory_viz.segsum(data)  # raises if free + allocated != reserved
    reserved = sum(s["total_size"] for s in data["segments"])
    assert f"segments: {len(data['segments'])}" in summary
    assert reserved == read_history(data).reserved[-1]
    assert "add_local_files" in memory_viz.trace_plot(data)
    assert "TOTAL MEM" in memory_viz.trace(data)


def test_a_synthesized_stream_names_what_the_full_trace_names():
    """The default path builds a 16-layer model's stream from two shortened copies; its records are moved
    layer by layer, so the snapshot equals the full trace's, frames included."""
    kw = dict(seq_len=64, micro_batch_size=1, precision="bf16-mixed", keep_trace=True)
    synth, full = estimate("llama-3.2-1b", **kw), estimate("llama-3.2-1b", full=True, **kw)
    assert synth.trace_path == "synthesized" and full.trace_path == "full"

    def view(s):
        return [(e["action"], e["size"], e.get("category"), tuple((f["filename"], f["name"]) for f in e["frames"]))
                for e in s["device_traces"][0]]

    a, b = view(snapshot_of(synth)), view(snapshot_of(full))
    assert a == b
    assert any("model.layers.15." in f for *_, frames in a for f, _ in frames)


def test_json_and_gzip_load_as_the_pickle(snap, tmp_path):
    write_snapshot(snap, tmp_path / "p.json")
    (tmp_path / "p.pickle.gz").write_bytes(gzip.compress(pickle.dumps(snap)))
    a, b = load_snapshot(tmp_path / "p.json"), load_snapshot(tmp_path / "p.pickle.gz")
    assert read_history(a).allocated == read_history(b).allocated == read_history(snap).allocated


def test_an_estimate_without_its_trace_is_refused_in_one_line(est):
    import dataclasses

    from llmem_plugin.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="keep_trace=True"):
        snapshot_of(dataclasses.replace(est, trace=None))


def test_a_ddp_ranks_snapshot_has_the_ranks_peaks():
    from llmem_plugin.methods import Layout, estimate_method
    from llmem_plugin.snapshot.predict import method_snapshots
    from llmem_plugin.workload import Workload

    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed")
    snaps = method_snapshots("ddp", TINY, wl, layout=Layout(num_gpus=2), gpu="h100-sxm")
    (rank,) = estimate_method("ddp", TINY, wl, layout=Layout(num_gpus=2), gpu="h100-sxm").ranks
    h = read_history(snaps[rank.rank])
    assert (h.peak_allocated_bytes, h.peak_reserved_bytes) == (rank.peak_allocated_bytes, rank.peak_reserved_bytes)
    cats = {e.get("category") for e in snaps[rank.rank]["device_traces"][0]}
    assert "comm_buffers" in cats  # DDP's gradient buckets, named as such
    assert snaps[rank.rank]["llmem"]["method"] == "ddp"


def test_an_fsdp2_ranks_snapshot_has_a_trace_entry_per_stream_and_the_ranks_peaks():
    """FSDP2 allocates its all-gather and reduce-scatter buffers on side streams; the rank's one device
    trace carries each entry's stream, each stream's segments lie apart, and the history's peaks are the
    estimate's (which sums the streams' pools event by event, methods/_streams.py)."""
    import torch.cuda._memory_viz as memory_viz

    from llmem_plugin.methods import Layout, estimate_method
    from llmem_plugin.snapshot.predict import method_snapshots
    from llmem_plugin.workload import Workload

    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed")
    snaps = method_snapshots("fsdp", TINY, wl, layout=Layout(num_gpus=2), gpu="h100-sxm")
    (rank,) = estimate_method("fsdp", TINY, wl, layout=Layout(num_gpus=2), gpu="h100-sxm").ranks
    snap = snaps[rank.rank]
    h = read_history(snap)
    assert (h.peak_allocated_bytes, h.peak_reserved_bytes) == (rank.peak_allocated_bytes, rank.peak_reserved_bytes)
    entries = snap["device_traces"][0]
    streams = {e["stream"] for e in entries}
    assert streams == {0, 1, 2} and {s["stream"] for s in snap["segments"]} <= streams
    # A segment's blocks belong to its stream's allocations only.
    stream_at = {e["addr"]: e["stream"] for e in entries if e["action"] == "alloc"}
    for seg in snap["segments"]:
        assert all(stream_at.get(b["address"], seg["stream"]) == seg["stream"] for b in seg["blocks"])
    memory_viz.segsum(snap)  # torch's own reader: free + allocated == reserved


def test_blocks_kept_whole_count_at_their_size():
    """Qwen2.5-0.5B at 512 tokens makes large requests that leave less than 1 MiB of their block, which the
    allocator then does not split (should_split: more than kSmallSize left), so memory_allocated() counts the
    whole block. The entries say so (block_size), and the history's peak is the replay's."""
    est = estimate("qwen2.5-0.5b", seq_len=512, micro_batch_size=2, precision="bf16-mixed", keep_trace=True)
    snap = snapshot_of(est)
    whole = [e for e in snap["device_traces"][0] if "block_size" in e]
    assert whole and all(0 < e["block_size"] - e["size"] <= MiB for e in whole)
    h = read_history(snap)
    assert (h.peak_allocated_bytes, h.allocated_before) == (est.peak_allocated_bytes, 0)
