"""The predicted allocator history of a traced step, in PyTorch's memory-snapshot format.

``torch.cuda.memory._record_memory_history()`` makes the caching allocator
log every action (``alloc``, ``free_requested``, ``free_completed``,
``segment_alloc``, ``segment_free``, ``segment_map``, ``segment_unmap``,
``oom``), and ``torch.cuda.memory._dump_snapshot(path)`` pickles them with the
end state of every segment and block (``torch/cuda/memory.py``, ``_snapshot``'s
docstring; ``torch/csrc/cuda/Module.cpp``). :func:`predicted_snapshot` replays
the traced step through the simulated allocator
(:mod:`llmem_plugin.device.allocator`) with its history on and writes the same
structure, so PyTorch's own tools (``python -m torch.cuda._memory_viz``, the
MemoryViz page) read a prediction as they read a real run.

What differs from a real snapshot, by design:
    * Addresses are the simulation's: segments are placed in order with a
      1 GiB gap, where cudaMalloc returns the driver's addresses. Sizes,
      order, streams and the blocks' layout inside each segment are the
      allocator's rules, and equal to a real run's where the trace is.
    * ``time_us`` is the entry's position in the history (no clock runs).
    * Frames name what made each allocation: the module path, the ATen op,
      the training phase and the memory category (``category`` on entries
      and blocks too). A real snapshot's frames are Python stack frames.
"""

from __future__ import annotations

import contextlib
import gc
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmem_plugin.device.allocator import CachingAllocator, SimulatedOOM
from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.device.overheads import DeviceOverheads
from llmem_plugin.errors import ConfigError
from llmem_plugin.snapshot.history import block_bytes, read_history
from llmem_plugin.errors import UnsupportedError
from llmem_plugin.estimate import Estimate, allocator_events, trace_positions
from llmem_plugin.trace.tracker import Phase, TraceResult

__all__ = ["PICKLE_PROTOCOL", "UNKNOWN", "method_snapshots", "predicted_snapshot", "replay_history",
           "replay_stream_history", "snapshot_of", "write_snapshot"]

# MemoryViz.js reads pickles with its own decoder, which knows protocols 2 to 4
# (torch/utils/viz/MemoryViz.js, the `unpickle` function); torch's own
# _dump_snapshot uses pickle's default, 4 on Python 3.8-3.13 but 5 from 3.14.
PICKLE_PROTOCOL = 4
# MemoryViz colours allocations by `category` once any entry has one, and
# looks the missing ones up as 'unknown', which must then be one of them
# (annotate_snapshot). Allocations that are no tensor (cuBLAS workspaces) take it.
UNKNOWN = "unknown"
_POOL_ID = (0, 0)  # the default pool; CUDA graph pools are not modelled


@dataclass(frozen=True, slots=True)
class _Origin:
    """Which event of the replayed stream an entry came from."""

    event: int
    key: int
    phase: str


class _Frames:
    """Frames and category for every key, made once each (pickle then stores each dict once)."""

    def __init__(self, trace: TraceResult) -> None:
        self.records = trace.records
        self._cache: dict[Any, tuple[list[dict], str]] = {}  # by key (a record's frames name its own phase)

    def of(self, key: int, phase: str) -> tuple[list[dict], str]:
        cache_key = key if key >= 0 and self.records is not None and key < len(self.records) else (key, phase)
        got = self._cache.get(cache_key)
        if got is None:
            got = self._cache[cache_key] = self._make(key, phase)
        return got

    def _make(self, key: int, phase: str) -> tuple[list[dict], str]:
        recs = self.records
        if key < 0:  # allocator_events' workspaces: negative keys
            return [{"filename": "cuBLAS", "line": 0, "name": "workspace"},
                    {"filename": f"category:{UNKNOWN}", "line": 0, "name": phase}], UNKNOWN
        if recs is None or key >= len(recs):
            return [{"filename": f"category:{UNKNOWN}", "line": 0, "name": phase}], UNKNOWN
        category = recs.category[key]
        op = recs.op[key] or "registered"
        return [{"filename": recs.module[key] or "<step>", "line": 0, "name": op},
                {"filename": f"category:{category}", "line": 0, "name": recs.phase[key]}], category


def replay_history(events: Sequence[tuple[int, int, int]], requested: Sequence[int], config: AllocatorConfig, *,
                   capacity_bytes: int | None = None, device_memory_bytes: int | None = None,
                   start: int | None = None) -> tuple[CachingAllocator, list[tuple[str, int, int, int]], list[int],
                                                      dict[int, int]]:
    """Replay ``events`` on one stream with the allocator's history on (:func:`replay_stream_history`).

    Returns:
        The allocator at the end, its history (``(action, address, bytes, block bytes)``,
        :attr:`CachingAllocator.history`), the event each entry came from, and the key of every
        block live at the end, by address.
    """
    allocators, history, owner, live = replay_stream_history(
        events, requested, config, capacity_bytes=capacity_bytes, device_memory_bytes=device_memory_bytes,
        start=start)
    return allocators[0], [entry[1:] for entry in history], owner, live


def replay_stream_history(events: Sequence[tuple[int, int, int]], requested: Sequence[int], config: AllocatorConfig,
                          *, stream_of: dict[int, int] | None = None, capacity_bytes: int | None = None,
                          device_memory_bytes: int | None = None, start: int | None = None
                          ) -> tuple[dict[int, CachingAllocator], list[tuple[int, str, int, int, int]], list[int],
                                     dict[int, int]]:
    """Replay ``events`` with the allocators' history on.

    Args:
        events: ``(sign, key, bytes)``, as :func:`llmem_plugin.device.allocator.replay` takes them.
        requested: Per event, the bytes the tensor asked for (the entry's size, as torch records it).
        config: The allocator settings.
        stream_of: Key -> side stream, for a rank that allocates on side streams: one allocator per
            stream (:mod:`llmem_plugin.methods._streams`: each stream's pool serves only its own
            requests), each in its own range of addresses; a free goes to its allocation's stream.
        capacity_bytes: What cudaMalloc can hand out; None = unlimited. One stream only: the per-stream
            replay has no capacity (:func:`method_snapshots` refuses a rank that needs one).
        device_memory_bytes: The device's memory (sizes expandable segments).
        start: Before this event, ``torch.cuda.empty_cache()`` and then the
            history starts (what a job records after loading); None: from the first event.

    Returns:
        The allocators by stream, the merged history as ``(stream, action, address, bytes, block
        bytes)`` (out of memory: an ``oom`` entry ends it, the only one where that comes before
        ``start``), the event each entry came from, and the key of every block live at the end, by address.
    """
    assert not (stream_of and capacity_bytes is not None), "a capacity is replayed on one stream only"
    stream_of = stream_of or {}
    allocators: dict[int, CachingAllocator] = {}
    history: list[tuple[int, str, int, int, int]] = []
    owner: list[int] = []
    handles: dict[int, tuple[int, int]] = {}
    recording = start is None

    def allocator(stream: int) -> CachingAllocator:
        alloc = allocators.get(stream)
        if alloc is None:
            alloc = allocators[stream] = CachingAllocator(config, capacity_bytes=capacity_bytes,
                                                          device_memory_bytes=device_memory_bytes,
                                                          address_space=stream)
            alloc.history = [] if recording else None
        return alloc

    def record(stream: int, alloc: CachingAllocator, i: int) -> None:
        history.extend((stream, *entry) for entry in alloc.history)
        owner.extend([i] * len(alloc.history))
        alloc.history.clear()

    allocator(0)
    for i, (sign, key, nbytes) in enumerate(events):
        if i == start:
            recording = True
            for alloc in allocators.values():
                alloc.empty_cache()
                alloc.history = []
        if sign > 0:
            if nbytes <= 0:  # zero-byte tensors get a null pointer, no block
                continue
            stream = stream_of.get(key, 0)
            alloc = allocator(stream)
            try:
                handles[key] = (stream, alloc.malloc(requested[i]))
            except SimulatedOOM:
                if not recording:  # out of memory before the history starts: it holds the oom alone
                    size = alloc.round_size(requested[i])
                    alloc.history = [("oom", 0, size, size)]
                record(stream, alloc, i)
                break
        else:
            held = handles.pop(key, None)
            if held is None:
                continue
            stream, alloc = held[0], allocators[held[0]]
            alloc.free(held[1])
        if recording:
            record(stream, alloc, i)
    return allocators, history, owner, {addr: key for key, (_, addr) in handles.items()}


def predicted_snapshot(trace: TraceResult, config: AllocatorConfig, overheads: DeviceOverheads, *,
                       capacity_bytes: int | None = None, device_memory_bytes: int | None = None,
                       start: int | None = None, metadata: dict[str, Any] | None = None,
                       stream_of: dict[int, int] | None = None) -> dict[str, Any]:
    """The predicted snapshot of ``trace``'s step, as ``torch.cuda.memory._snapshot()`` returns one.

    Args:
        trace: The traced step (its ``records`` name what each event is).
        config: The allocator settings simulated.
        overheads: The device overheads (the cuBLAS workspaces are inserted
            as :func:`llmem_plugin.estimate.allocator_events` inserts them).
        capacity_bytes: What the allocator may reserve (the device's memory
            less what lies outside the allocator); None = unlimited.
        device_memory_bytes: See :func:`replay_history`.
        start: Trace event before which the cache is emptied and the history
            starts (see :func:`replay_history`); None: the whole history.
        metadata: Added under the snapshot's ``llmem`` key (what was predicted, for whom).
        stream_of: Trace record -> side stream of allocations made off the default stream (0), for a
            rank whose wrapper allocates on side streams (:func:`replay_stream_history`; no capacity).

    Returns:
        ``{"segments", "device_traces", "allocator_settings", "external_annotations", "llmem"}``.
    """
    events, phases = allocator_events(trace, overheads)
    recs = trace.records
    requested = [(recs.requested[key] if recs is not None and 0 <= key < len(recs) else nbytes) if sign > 0 else 0
                 for sign, key, nbytes in events]
    begin = None if start is None else trace_positions(events)[start]  # workspaces inserted before it
    allocators, history, owner, live = replay_stream_history(
        events, requested, config, stream_of=stream_of, capacity_bytes=capacity_bytes,
        device_memory_bytes=device_memory_bytes, start=begin)
    frames = _Frames(trace)
    entries = []
    of, tensor_actions = frames.of, ("alloc", "free_requested", "free_completed", "oom")
    for n, ((stream, action, addr, size, block), i) in enumerate(zip(history, owner, strict=True)):
        # torch's entries also carry compile_context and user_metadata (torch.compile's and the user's
        # annotations); none is made here, and readers treat them as optional.
        entry = {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": n, "pool_id": _POOL_ID,
                 "frames": []}
        if action in tensor_actions:
            entry["frames"], entry["category"] = of(events[i][1], phases[i])
            if action == "alloc" and block != block_bytes(size):
                entry["block_size"] = block  # a block kept whole (not split): more than the rounded request
        if action == "oom":  # TraceEntry::OOM holds the device's free bytes instead of an address
            del entry["addr"]
            reserved = allocators[stream].stats.reserved
            entry["device_free"] = (capacity_bytes - reserved) if capacity_bytes is not None else 0
        entries.append(entry)
    if entries and not any(e.get("category") == UNKNOWN for e in entries):
        # MemoryViz needs 'unknown' among the categories once there are any; torch logs a
        # 'snapshot' entry whenever a snapshot is taken while recording.
        entries.append({"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "time_us": len(entries),
                        "frames": [], "category": UNKNOWN})
    return {
        "segments": [seg for stream, alloc in sorted(allocators.items())
                     for seg in _segments(alloc, live, frames, phases[-1] if phases else "setup", stream)],
        "device_traces": [entries],
        "allocator_settings": _settings(config),
        "external_annotations": _phase_annotations(phases, owner),
        "llmem": {"predicted": True, "addresses": "simulated", "time_us": "entry index", **(metadata or {})},
    }


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a history's tens of thousands of entries are built: they
    hold no cycles, and in a process that holds a trace a full collection takes about 0.3 s; a due one
    runs later, if at all (benchmarks/results/snapshot-cost-2026-12-07.md)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def snapshot_of(est: Estimate, *, after_load: bool = False) -> dict[str, Any]:
    """The predicted snapshot of an estimate made with ``keep_trace=True``.

    The replay is the one the verdict comes from (:func:`llmem_plugin.estimate.simulate_trace`'s rule):
    without a cap where the step fits so, else capped at the capacity left outside the CUDA context
    and workspaces, where the allocator frees its cache and retries, and where an ``oom`` entry ends
    a step that does not fit.

    Args:
        est: The estimate.
        after_load: Start the history once the weights are loaded, after ``torch.cuda.empty_cache()``
            (as a job that starts recording there); default: from the first allocation.

    Raises:
        UnsupportedError: ``est`` was made without ``keep_trace``.
    """
    if est.trace is None or est.alloc_config is None:
        raise UnsupportedError("this estimate kept no trace to replay. HINT: estimate(..., keep_trace=True)")
    from llmem_plugin.trace.loading import LOADED_MARK

    start = est.trace.marks.get(f"{LOADED_MARK}:{Phase.SETUP.value}") if after_load else None
    meta = {"model": est.model, "gpu": est.gpu, "workload": est.workload.to_dict(),
            "peak_allocated_bytes": est.peak_allocated_bytes, "peak_reserved_bytes": est.peak_reserved_bytes,
            "device_total_bytes": est.device_total_bytes, "capacity_bytes": est.capacity_bytes, "fits": est.fits,
            "outside_allocator_bytes": est.overheads.outside_allocator_bytes}
    with _collector_paused():
        return _verdict_snapshot(est.trace, est.alloc_config, est.overheads, est.capacity_bytes, start=start,
                                 metadata=meta)


def _verdict_snapshot(trace: TraceResult, config: AllocatorConfig, overheads: DeviceOverheads, capacity: int, *,
                      start: int | None, metadata: dict[str, Any]) -> dict[str, Any]:
    """The snapshot of the replay the verdict comes from: uncapped where it fits so, else capped at what
    the device leaves the allocator (``llmem_plugin.estimate.simulate_trace``'s rule)."""
    snap = predicted_snapshot(trace, config, overheads, start=start, metadata=metadata)
    outside = overheads.outside_allocator_bytes
    if _peak_reserved(snap) + outside > capacity:
        snap = predicted_snapshot(trace, config, overheads, start=start, metadata=metadata,
                                  capacity_bytes=max(capacity - outside, 0))
    return snap


def method_snapshots(method: str, model: Any, workload: Any, *, layout: Any, gpu: Any, after_load: bool = False,
                     rank: int | None = None, **options: Any) -> dict[int, dict[str, Any]]:
    """The predicted snapshot of every rank a distributed method's estimate traces (its full trace, run
    again here), by rank; ranks the method reports as alike to a traced one have none of their own.
    ``after_load``: as for :func:`snapshot_of` (from the model's placement and wrapping on).
    ``rank``: only that rank's, ``{rank: snapshot}``: its own where it was traced, the one traced rank's
    where the method traces one for all (its ranks are alike), else ``{}`` (several distinct ranks are
    traced and not this one: which one it is alike to is not reported).

    A rank whose wrapper allocates on side streams (FSDP2's all-gather and reduce-scatter streams,
    LowLevelZero's communication stream) gets one device trace whose entries and segments carry their
    stream (1, 2, ... in the order the wrapper first used them), each stream's pool replayed by its own
    allocator as the estimate replays it.

    Raises:
        UnsupportedError: A rank with side streams whose streams together reserve more than the GPU
            holds: where the allocator frees every stream's cache and retries is not replayed per stream.
        ConfigError, UnsupportedError: As :func:`llmem_plugin.methods.estimate_method`.
    """
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods import estimate_method
    from llmem_plugin.methods.base import capture
    from llmem_plugin.trace.loading import LOADED_MARK

    with capture() as cap:
        estimate_method(method, model, workload, layout=layout, gpu=gpu, **options)
    ranks = cap.ranks
    if rank is not None:
        own = [(trace, kw) for trace, kw in ranks if kw["rank"] == rank]
        ranks = own or (ranks if len(ranks) == 1 else [])
    out = {}
    for trace, kw in ranks:
        target = kw["gpu"] if not isinstance(kw["gpu"], str) else get_gpu(kw["gpu"])
        meta = {"method": method, "rank": kw["rank"], "num_gpus": layout.num_gpus, "gpu": target.name,
                "workload": workload.to_dict() if hasattr(workload, "to_dict") else dict(workload),
                "capacity_bytes": target.capacity_bytes,
                "outside_allocator_bytes": kw["overheads"].outside_allocator_bytes}
        start = trace.marks.get(f"{LOADED_MARK}:{Phase.SETUP.value}") if after_load else None
        with _collector_paused():
            out[kw["rank"] if rank is None else rank] = _rank_snapshot(method, trace, kw, target, start=start,
                                                                       metadata=meta)
    return out


def _rank_snapshot(method: str, trace: TraceResult, kw: dict[str, Any], target: Any, *, start: int | None,
                   metadata: dict[str, Any]) -> dict[str, Any]:
    """One traced rank's snapshot (:func:`method_snapshots`): the verdict's replay, or per stream."""
    config = kw["alloc_conf"] or AllocatorConfig()
    if not kw["streams"]:
        return _verdict_snapshot(trace, config, kw["overheads"], target.capacity_bytes, start=start,
                                 metadata=metadata)
    snap = predicted_snapshot(trace, config, kw["overheads"], start=start, metadata=metadata,
                              stream_of=dict(kw["streams"]))
    if _peak_reserved(snap) + kw["overheads"].outside_allocator_bytes > target.capacity_bytes:
        raise UnsupportedError(
            f"--snapshot with --method {method}: rank {kw['rank']}'s streams together reserve more than "
            f"{target.name} holds, where the allocator frees every stream's cache and retries (and may then "
            "run out); that is not replayed per stream. HINT: write the snapshot of a layout with room "
            "(more GPUs, a smaller micro-batch), or use ddp, zero1/2/3 or tp")
    return snap


def _peak_reserved(snap: dict[str, Any]) -> int:
    """The most bytes the history's segments held at once (its end state where it has no history)."""
    if not snap["device_traces"][0]:
        return sum(s["total_size"] for s in snap["segments"])
    return read_history(snap).peak_reserved_bytes


def _settings(config: AllocatorConfig) -> dict[str, Any]:
    """The settings torch's snapshot reports (Module.cpp, ``allocator_settings``), from the simulated ones."""
    return {
        "PYTORCH_CUDA_ALLOC_CONF": config.to_env(),
        "max_split_size": config.max_split_size_bytes or -1,
        "garbage_collection_threshold": config.garbage_collection_threshold,
        "expandable_segments": config.expandable_segments,
    }


def _phase_annotations(phases: list[str], owner: list[int]) -> list[dict[str, Any]]:
    """START/END pairs around each training phase, in entry positions (as ``record_function`` ranges appear)."""
    out: list[dict[str, Any]] = []
    current, begun = None, 0
    for n, i in enumerate(owner):
        if phases[i] != current:
            if current is not None:
                out.append({"stage": "END", "name": current, "device": 0, "time_us": n})
            current, begun = phases[i], n
            out.append({"stage": "START", "name": current, "device": 0, "time_us": begun})
    if current is not None:
        out.append({"stage": "END", "name": current, "device": 0, "time_us": len(owner)})
    return out


def _segments(alloc: CachingAllocator, live: dict[int, int], frames: _Frames, phase: str,
              stream: int = 0) -> list[dict[str, Any]]:
    """Every segment held at the end, its blocks in address order (the end state MemoryViz replays back from).

    An expandable segment is reported as each run of mapped pages, as torch's snapshot does."""
    out = []
    for seg in alloc.segment_blocks():
        run: list[Any] = []
        for b in seg:
            if b.mapped:
                run.append(b)
            elif run:
                out.append(_segment(run, live, frames, phase, stream))
                run = []
        if run:
            out.append(_segment(run, live, frames, phase, stream))
    return out


def _segment(blocks: list[Any], live: dict[int, int], frames: _Frames, phase: str, stream: int) -> dict[str, Any]:
    out_blocks = []
    for b in blocks:
        block: dict[str, Any] = {"address": b.addr, "size": b.size, "requested_size": b.requested,
                                 "state": "active_allocated" if b.allocated else "inactive", "frames": []}
        if b.allocated:
            block["frames"], block["category"] = frames.of(live.get(b.addr, -1), phase)
        out_blocks.append(block)
    active = [b for b in blocks if b.allocated]
    first = blocks[0]
    return {
        "device": 0, "address": first.addr, "total_size": sum(b.size for b in blocks),
        "allocated_size": sum(b.size for b in active), "active_size": sum(b.size for b in active),
        "requested_size": sum(b.requested for b in active), "stream": stream,
        "segment_type": "small" if first.small else "large", "segment_pool_id": _POOL_ID,
        "is_expandable": first.segment.expandable, "frames": [], "blocks": out_blocks,
    }


def write_snapshot(snapshot: dict[str, Any], path: str | Path) -> Path:
    """Write ``snapshot`` as ``_dump_snapshot`` does (a pickle, protocol :data:`PICKLE_PROTOCOL`), or as JSON
    where ``path`` ends in ``.json`` (newer MemoryViz copies read both).

    Raises:
        ConfigError: The file cannot be written (the message names it).
    """
    path = Path(path)
    try:
        if path.suffix == ".json":
            import json

            path.write_text(json.dumps(snapshot), encoding="utf-8")
        else:
            with open(path, "wb") as f:
                pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL)
    except OSError as e:
        raise ConfigError(f"cannot write the snapshot to {str(path)!r}: {e.strerror}. "
                          "HINT: pass a path in a folder that exists and is writable") from None
    return path
