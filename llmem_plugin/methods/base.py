"""What every distributed method returns, and the shared path from a traced
rank to its three numbers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.device.gpus import GPU
from llmem_plugin.methods.layout import Layout
from llmem_plugin.device.overheads import DeviceOverheads
from llmem_plugin.trace.tracker import MemoryTracker, TraceResult

__all__ = ["Capture", "MethodEstimate", "ModelStateBytes", "RankMemory", "capture", "host_overheads", "new_tracker",
           "rank_memory"]


@dataclass
class Capture:
    """The traces a method replays while a stream synthesis runs it on a
    shortened model (:func:`llmem_plugin.methods.synthesized`): per rank, the
    trace given to :func:`rank_memory` and that call's other arguments."""

    ranks: list[tuple[TraceResult, dict[str, Any]]] = field(default_factory=list)


_CAPTURE: ContextVar[Capture | None] = ContextVar("llmem_method_capture", default=None)


@contextlib.contextmanager
def capture() -> Iterator[Capture]:
    """Within the block, methods trace with layer tags and :func:`rank_memory`
    keeps every trace it replays."""
    cap = Capture()
    token = _CAPTURE.set(cap)
    try:
        yield cap
    finally:
        _CAPTURE.reset(token)


def new_tracker() -> MemoryTracker:
    """The tracker a method traces a rank with: a layer-tagging one inside
    :func:`capture` (the stream synthesis needs every event's layer)."""
    if _CAPTURE.get() is not None:
        from llmem_plugin.trace.layertags import LayerTaggingTracker

        return LayerTaggingTracker()
    return MemoryTracker()


@dataclass(frozen=True, kw_only=True)
class ModelStateBytes:
    """Model-state bytes of one rank by a method's partitioning rules (the
    closed form that modelled methods check their traces against).

    Attributes:
        params_bytes: 16-bit parameters on the GPU.
        grads_bytes: 16-bit gradients kept between backward and step.
        master_bytes: fp32 master weights on the GPU.
        optimizer_state_bytes: Optimizer states on the GPU.
        fp32_grads_bytes: fp32 gradient copies at the step.
        host_bytes: Host memory per rank (offloaded states, pinned copies).
    """

    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_state_bytes: int
    fp32_grads_bytes: int
    host_bytes: int

    @property
    def device_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.master_bytes + self.optimizer_state_bytes
                + self.fp32_grads_bytes)


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """One rank's peak memory.

    Attributes:
        rank: Global rank (ranks that differ are reported apart, e.g. rank 0
            or the last rank of an uneven shard).
        peak_tensor_bytes: Peak of live tensor storages.
        peak_allocated_bytes: ``torch.cuda.max_memory_allocated`` on that rank.
        peak_reserved_bytes: ``torch.cuda.max_memory_reserved`` on that rank.
        device_total_bytes: Reserved + CUDA context + NCCL buffers.
        fits: Whether the rank runs within the GPU's capacity.
        breakdown: Tensor bytes per category at the tensor peak (category
            values as keys; methods may add their own, e.g. "buckets").
        host_bytes: Host RAM of the method's copies on this rank (offloaded
            states, pinned buffers, offloaded activations), at their sizes.
        host_overheads: Host RAM this rank's process needs besides:
            "process" (framework RSS and the CUDA context's host side,
            :func:`llmem_plugin.device.host.process_baseline_bytes`) and
            "pinned_rounding" (the caching host allocator's power-of-two
            rounding of pinned buffers).
        phase_allocated: Allocator's allocated peak within each training
            phase (phase values as keys).
        phase_reserved: Reserved bytes held by the end of each phase.
        phase_breakdowns: Tensor bytes per category at each phase's peak.
    """

    rank: int
    peak_tensor_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    fits: bool
    breakdown: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    host_overheads: dict[str, int] = field(default_factory=dict)
    phase_allocated: dict[str, int] = field(default_factory=dict, repr=False)
    phase_reserved: dict[str, int] = field(default_factory=dict, repr=False)
    phase_breakdowns: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)

    @property
    def host_total_bytes(self) -> int:
        """Host RAM this rank's process needs: its copies and overheads."""
        return self.host_bytes + sum(self.host_overheads.values())

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("phase_")}
        out["host_total_bytes"] = self.host_total_bytes
        return out


@dataclass(frozen=True, kw_only=True)
class MethodEstimate:
    """A distributed method's memory per rank and communication per step.

    Attributes:
        method: Registry name (``ddp``, ``fsdp``, ``zero3``, ...).
        layout: The cluster layout.
        ranks: The distinct ranks (at least one).
        comm_intra_node_bytes: Bytes one rank sends per optimizer step over
            the intra-node link.
        comm_inter_node_bytes: Bytes one rank sends per step between nodes.
        notes: Uneven-shard padding, rank-specific extras, settings applied.
    """

    method: str
    layout: Layout
    ranks: list[RankMemory]
    comm_intra_node_bytes: int = 0
    comm_inter_node_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def host_bytes_per_node(self) -> int:
        """Host RAM a node needs for the ranks' host copies (offloaded states,
        pinned buffers): every GPU's rank holds its own share (the largest
        rank's, to be safe)."""
        return max(r.host_bytes for r in self.ranks) * self.layout.gpus_per_node

    @property
    def host_total_bytes_per_node(self) -> int:
        """Host RAM a node needs: one process per GPU, each with its copies,
        its pinned rounding and its own baseline (the largest rank's, to be safe)."""
        return max(r.host_total_bytes for r in self.ranks) * self.layout.gpus_per_node

    @property
    def worst(self) -> RankMemory:
        """The rank with the largest device total (the one that OOMs first)."""
        return max(self.ranks, key=lambda r: r.device_total_bytes)

    def to_dict(self) -> dict[str, Any]:
        w = self.worst
        return {
            "method": self.method,
            "tp": self.layout.tp,
            "layout": self.layout.to_dict(),
            "peak_allocated_bytes": w.peak_allocated_bytes,
            "peak_reserved_bytes": w.peak_reserved_bytes,
            "device_total_bytes": w.device_total_bytes,
            "fits": all(r.fits for r in self.ranks),
            "ranks": [r.to_dict() for r in self.ranks],
            "host_bytes_per_node": self.host_bytes_per_node,
            "host_total_bytes_per_node": self.host_total_bytes_per_node,
            "comm_intra_node_bytes": self.comm_intra_node_bytes,
            "comm_inter_node_bytes": self.comm_inter_node_bytes,
            "notes": list(self.notes),
        }


def host_overheads(pinned_rounding_bytes: int = 0) -> dict[str, int]:
    """A rank's host overheads (:attr:`RankMemory.host_overheads`)."""
    from llmem_plugin.device.host import process_baseline_bytes

    out = {"process": process_baseline_bytes()}
    if pinned_rounding_bytes:
        out["pinned_rounding"] = pinned_rounding_bytes
    return out


def rank_memory(
    trace: TraceResult,
    *,
    rank: int,
    gpu: GPU,
    overheads: DeviceOverheads,
    alloc_conf: AllocatorConfig | None = None,
    extra_breakdown: dict[str, int] | None = None,
    host_bytes: int = 0,
    host_pinned_rounding_bytes: int = 0,
    streams: Mapping[int, int] | None = None,
    emptied_cache_bound: bool = False,
) -> RankMemory:
    """The three numbers of one traced rank: its event stream replayed through
    the caching-allocator simulation (with the cuBLAS workspaces), plus the
    overheads outside the allocator (context, NCCL).

    Args:
        trace: The rank's trace (e.g. under a fake process group).
        rank: Its global rank.
        gpu: The GPU (capacity, architecture).
        overheads: From :func:`llmem_plugin.device.overheads.device_overheads`, with
            this rank's NCCL communicators.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` settings (defaults if None).
        extra_breakdown: Method-specific bytes at the peak to report.
        host_bytes: CPU RAM for offloaded states and pinned copies.
        host_pinned_rounding_bytes: What the caching host allocator adds to
            the pinned ones (:func:`llmem_plugin.device.host.pinned_bytes`).
        streams: Trace record index -> side-stream number of allocations a
            wrapper made off the default stream (``RankTracker.stream_of``):
            each stream is replayed with its own pools
            (:mod:`llmem_plugin.methods._streams`).
        emptied_cache_bound: Report the larger reserved peak of the cache as
            the setup left it and emptied after setup
            (:mod:`llmem_plugin.methods._setup_cache`); for wrappers whose
            setup frees are traced as the real setup makes them.
    """
    from llmem_plugin.estimate import simulate_trace
    from llmem_plugin.methods._setup_cache import reserved_if_emptied

    cap = _CAPTURE.get()
    if cap is not None:
        cap.ranks.append((trace, {"rank": rank, "gpu": gpu, "overheads": overheads, "alloc_conf": alloc_conf,
                                  "extra_breakdown": extra_breakdown, "host_bytes": host_bytes,
                                  "host_pinned_rounding_bytes": host_pinned_rounding_bytes, "streams": streams,
                                  "emptied_cache_bound": emptied_cache_bound}))
    if streams:
        from llmem_plugin.methods._streams import simulate_streams

        sim, fits = simulate_streams(trace, streams, alloc_conf or AllocatorConfig(), overheads, gpu.capacity_bytes)
    else:
        sim, fits = simulate_trace(trace, alloc_conf or AllocatorConfig(), overheads, gpu.capacity_bytes)
    reserved = sim.peak_reserved_bytes
    if emptied_cache_bound:
        # A script may empty the cache between the wrapper's setup and the first step, which can raise
        # the step's reserved peak (llmem_plugin.methods._setup_cache): report the larger of the two.
        emptied = reserved_if_emptied(trace, streams, alloc_conf or AllocatorConfig(), overheads,
                                      gpu.capacity_bytes)
        if emptied is not None and emptied > reserved:
            reserved = emptied
    breakdown = {c.value: v for c, v in trace.breakdown.items()}
    breakdown.update(extra_breakdown or {})
    return RankMemory(
        rank=rank,
        peak_tensor_bytes=trace.peak_bytes,
        peak_allocated_bytes=sim.peak_allocated_bytes,
        peak_reserved_bytes=reserved,
        device_total_bytes=reserved + overheads.outside_allocator_bytes,
        fits=fits,
        breakdown=breakdown,
        host_bytes=host_bytes,
        host_overheads=host_overheads(host_pinned_rounding_bytes),
        phase_allocated=dict(sim.phase_allocated_bytes),
        phase_reserved=dict(sim.phase_reserved_bytes),
        phase_breakdowns={p.value: {c.value: v for c, v in bd.items()} for p, bd in trace.phase_breakdowns.items()},
    )
