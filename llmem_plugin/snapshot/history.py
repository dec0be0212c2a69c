"""Reading a memory snapshot's history: its allocations, and the allocated and reserved bytes over it.

A snapshot (``torch.cuda.memory._snapshot()``, or
:func:`llmem_plugin.snapshot.predict.predicted_snapshot`) holds the end state
(segments and their blocks) and the history that led there. The history may
start after the job started (recording turned on late, or a ring buffer of
``max_entries`` that dropped its oldest entries), so the bytes live before its
first entry are what the end state holds less what the history added.
"""

from __future__ import annotations

import gzip
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmem_plugin.device.allocator_config import MIN_BLOCK_SIZE
from llmem_plugin.errors import ConfigError

__all__ = ["Allocation", "History", "block_bytes", "load_snapshot", "read_history"]


@dataclass(slots=True)
class Allocation:
    """One allocation of the history: made at entry ``start``, freed at ``end`` (None: live at the end)."""

    start: int
    end: int | None
    size: int  # the block's bytes (the request rounded as the allocator rounds it)
    requested: int
    frames: list[dict[str, Any]] = field(repr=False)
    category: str | None = None


@dataclass(frozen=True, kw_only=True)
class History:
    """The alloc/free history of one device, with the bytes allocated and reserved after every entry.

    Attributes:
        entries: The device trace's entries, as the snapshot holds them.
        allocations: Every allocation the history made, in order.
        allocated: Block bytes allocated after each entry (``memory_allocated()``).
        reserved: Segment bytes held after each entry (``memory_reserved()``).
        allocated_before: Block bytes allocated before the first entry.
        reserved_before: Segment bytes held before the first entry.
    """

    entries: list[dict[str, Any]] = field(repr=False)
    allocations: list[Allocation] = field(repr=False)
    allocated: list[int] = field(repr=False)
    reserved: list[int] = field(repr=False)
    allocated_before: int
    reserved_before: int
    oom_entry: int = -1  # the entry of the first out-of-memory error (-1: none)

    @property
    def oom_bytes(self) -> int:
        """What the failing request asked for (0 without an out-of-memory error)."""
        return self.entries[self.oom_entry]["size"] if self.oom_entry >= 0 else 0

    @property
    def peak_allocated_bytes(self) -> int:
        """The most allocated over the history, its starting state included (as ``max_memory_allocated``
        reads after ``reset_peak_memory_stats`` where the recording started)."""
        return max(self.allocated_before, *self.allocated)

    @property
    def peak_reserved_bytes(self) -> int:
        """The most reserved over the history, its starting state included."""
        return max(self.reserved_before, *self.reserved)

    @property
    def peak_entry(self) -> int:
        """The first entry at which the allocated bytes peak (-1: the state before the history)."""
        peak = self.peak_allocated_bytes
        return self.allocated.index(peak) if peak in self.allocated else -1

    def live_at(self, entry: int) -> list[Allocation]:
        """The allocations of the history live right after ``entry``."""
        return [a for a in self.allocations if a.start <= entry and (a.end is None or a.end > entry)]


def block_bytes(requested: int) -> int:
    """round_size(): at least kMinBlockSize, a multiple of it (CUDACachingAllocator.cpp). A large block
    that is not split keeps its whole size, which a trace entry does not say: predicted snapshots write it
    as ``block_size``; a real snapshot's blocks live at the end give theirs (``segments``)."""
    return max(MIN_BLOCK_SIZE, -(-requested // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE)


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """A snapshot file as ``_dump_snapshot`` writes it (a pickle), or as JSON; either may be gzipped.

    Raises:
        ConfigError: The file is missing or holds no snapshot (the message names it).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read snapshot {str(path)!r}: {e.strerror}. HINT: pass the file "
                          "torch.cuda.memory._dump_snapshot() or `llmem estimate --snapshot` wrote") from None
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    try:
        data = json.loads(raw) if raw.lstrip()[:1] in (b"{", b"[") else pickle.loads(raw)  # noqa: S301 - the user's own file
    except Exception as e:  # noqa: BLE001 - any decoding failure is the same user error
        raise ConfigError(f"{str(path)!r} is not a memory snapshot ({type(e).__name__}). HINT: pass the file "
                          "torch.cuda.memory._dump_snapshot() or `llmem estimate --snapshot` wrote") from None
    if isinstance(data, list):  # the oldest format: segments only
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        raise ConfigError(f"{str(path)!r} is not a memory snapshot (no 'segments'). HINT: pass the file "
                          "torch.cuda.memory._dump_snapshot() or `llmem estimate --snapshot` wrote")
    return data


def read_history(snapshot: dict[str, Any], device: int | None = None) -> History:
    """The history of ``device`` in ``snapshot`` (default: the one device with a history), with the
    bytes live after every entry.

    The allocated bytes are ``memory_allocated()``'s for a predicted snapshot (its entries carry the
    blocks kept whole). For a real one they are exact for blocks split to the request and for those live
    at the end; a block kept whole and freed within the history counts as its rounded request, a little
    under (at most 1 MiB per such block: the allocator splits a block when more than that is left).

    Raises:
        ConfigError: The snapshot recorded no history for ``device`` (``_record_memory_history`` was off).
    """
    traces = snapshot.get("device_traces") or []
    if device is None:  # the one device with a history (a rank's dump holds its own device's, at its index)
        used = [d for d, t in enumerate(traces) if t]
        device = used[0] if len(used) == 1 else 0
    entries = traces[device] if device < len(traces) else []
    if not entries:
        raise ConfigError(f"the snapshot holds no allocator history for device {device}. HINT: call "
                          "torch.cuda.memory._record_memory_history() before the steps, then _dump_snapshot()")
    segs = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    # Blocks live at the end: their own sizes, for allocations whose block was kept whole.
    live_size = {b.get("address"): b["size"] for s in segs for b in s["blocks"] if b["state"].startswith("active")}
    allocated_end = sum(b["size"] for s in segs for b in s["blocks"] if b["state"].startswith("active"))
    reserved_end = sum(s["total_size"] for s in segs)
    allocs: list[Allocation] = []
    open_at: dict[int, Allocation] = {}
    deltas_a, deltas_r = [], []
    for n, e in enumerate(entries):
        action, da, dr = e["action"], 0, 0
        if action == "alloc":
            size = e.get("block_size") or block_bytes(e["size"])
            a = Allocation(n, None, size, e["size"], e.get("frames") or [], e.get("category"))
            allocs.append(a)
            open_at[e["addr"]] = a
            da = a.size
        elif action == "free_completed":
            a = open_at.pop(e["addr"], None)
            if a is not None:
                a.end = n
            da = -(a.size if a is not None else block_bytes(e["size"]))
        elif action in ("segment_alloc", "segment_map"):
            dr = e["size"]
        elif action in ("segment_free", "segment_unmap"):
            dr = -e["size"]
        deltas_a.append(da)
        deltas_r.append(dr)
    for addr, a in open_at.items():  # live at the end: the end state knows its block's size
        real = live_size.get(addr)
        if real is not None and real != a.size:
            deltas_a[a.start] += real - a.size
            a.size = real
    allocated_before, reserved_before = allocated_end - sum(deltas_a), reserved_end - sum(deltas_r)
    allocated, reserved = [], []
    cur_a, cur_r = allocated_before, reserved_before
    for da, dr in zip(deltas_a, deltas_r):
        cur_a += da
        cur_r += dr
        allocated.append(cur_a)
        reserved.append(cur_r)
    oom = next((n for n, e in enumerate(entries) if e["action"] == "oom"), -1)
    return History(entries=entries, allocations=allocs, allocated=allocated, reserved=reserved,
                   allocated_before=allocated_before, reserved_before=reserved_before, oom_entry=oom)
