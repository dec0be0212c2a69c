"""The single-GPU profile the bounds and the screen scale from.

The single-GPU step in fast mode at micro-batch 1 and 2, with checkpointing off and on: each phase's allocated
peak (activations grow linearly with the micro-batch), the tensors the forward leaves for backward, and the
FLOPs of a micro-step (:class:`llmem_plugin.planner.cost.StepFlopCounter`). The screen traces the points in
parallel (:meth:`llmem_plugin.planner.screen._Search.profile`); :class:`_Profiles` keeps them, and a plan's
suggestions re-use them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmem_plugin.device.gpus import GPU
from llmem_plugin.models import modelbuild
from llmem_plugin.models.config import num_layers, resolve_config, set_num_layers
from llmem_plugin.planner.cost import FlopCount, flops_of_step
from llmem_plugin.trace.tracker import MemoryCategory
from llmem_plugin.workload import Workload

__all__: list[str] = []


@dataclass(frozen=True)
class _Point:
    """The single-GPU step at one (micro-batch, checkpointing): each phase's
    allocated peak, the FLOPs of a micro-step, and the tensors the forward
    leaves for backward (the tracker's activations at the forward peak)."""

    phase_allocated: dict[str, int]
    flops: FlopCount
    activations: int = 0


def _profile_point(model: Any, workload: Workload, gpu: GPU, alloc_conf: Any) -> _Point:
    from llmem_plugin.planner.cost import StepFlopCounter
    from llmem_plugin.estimate import _trace, simulate_trace, uses_cublaslt
    from llmem_plugin.trace.fast import Extrapolation, extrapolated_trace
    from llmem_plugin.device.overheads import device_overheads
    from llmem_plugin.trace.step import NUM_ITERATIONS
    from llmem_plugin.trace.tracker import MemoryTracker

    flops: list[dict[str, float]] = []

    def trace(m, w):
        tracker = MemoryTracker()
        counter = StepFlopCounter(tracker)
        result = _trace(m, w, gpu, tracker=tracker, contexts=(counter,))
        flops.append(dict(counter.by_phase))
        return result

    config = resolve_config(model)
    depth = num_layers(config)
    ext = extrapolated_trace(config, workload, depth=depth, trace=trace)
    if ext.result is None:  # layer kinds fast mode cannot tell apart: the full model
        ext = Extrapolation(trace(modelbuild.build_model(config, workload), workload))
    meta = modelbuild.build_model(set_num_layers(config, 1), workload, device="meta")
    overheads = device_overheads(gpu.compute_capability, uses_cublaslt=uses_cublaslt(meta))
    from llmem_plugin.device.allocator_config import AllocatorConfig

    cfg = (alloc_conf if isinstance(alloc_conf, AllocatorConfig)

           else AllocatorConfig.from_env(alloc_conf)).for_torch(None)
    if ext.short is None:
        sim = simulate_trace(ext.result, cfg, overheads, None)[0]
        per_flops = flops_of_step(flops[0], NUM_ITERATIONS, workload.grad_accum_steps)
        return _Point(dict(sim.phase_allocated_bytes), per_flops, _forward_activations(ext.result))
    s1, s2 = (simulate_trace(r, cfg, overheads, None)[0] for r in (ext.short, ext.long))
    phases = {p: v + round(ext.scale * (s2.phase_allocated_bytes[p] - v))
              for p, v in s1.phase_allocated_bytes.items() if p in s2.phase_allocated_bytes}
    f1, f2 = (flops_of_step(f, NUM_ITERATIONS, workload.grad_accum_steps) for f in flops)
    return _Point(phases, FlopCount(forward=f1.forward + ext.scale * (f2.forward - f1.forward),
                                    backward=f1.backward + ext.scale * (f2.backward - f1.backward)),
                  _forward_activations(ext.result))


def _forward_activations(result: Any) -> int:
    from llmem_plugin.trace.tracker import Phase

    return result.phase_breakdowns.get(Phase.FORWARD, {}).get(MemoryCategory.ACTIVATION, 0)


class _Profiles:
    """Single-GPU profile points, traced on first use and cached."""

    def __init__(self, model: Any, workload: Workload, gpu: GPU, alloc_conf: Any) -> None:
        self._model, self._workload, self._gpu, self._alloc_conf = model, workload, gpu, alloc_conf
        self._points: dict[tuple[int, bool], _Point] = {}

    def compute(self, micro_batch: int, gc: bool) -> _Point:
        wl = dataclasses.replace(self._workload, micro_batch_size=micro_batch, grad_accum_steps=1,
                                 grad_checkpointing=gc)
        return _profile_point(self._model, wl, self._gpu, self._alloc_conf)

    def has(self, micro_batch: int, gc: bool) -> bool:
        return (micro_batch, gc) in self._points

    def put(self, micro_batch: int, gc: bool, point: _Point) -> None:
        self._points[(micro_batch, gc)] = point

    def point(self, micro_batch: int, gc: bool) -> _Point:
        if (micro_batch, gc) not in self._points:
            self._points[(micro_batch, gc)] = self.compute(micro_batch, gc)
        return self._points[(micro_batch, gc)]

    def phase(self, micro_batch: int, gc: bool, phase: str) -> float:
        """A phase's allocated peak at any micro-batch (affine in it)."""
        p1, p2 = self.point(1, gc), self.point(2, gc)
        v1, v2 = p1.phase_allocated.get(phase, 0), p2.phase_allocated.get(phase, 0)
        return v1 + (micro_batch - 1) * (v2 - v1)

    def flops(self, micro_batch: int, gc: bool) -> FlopCount:
        return self.point(1, gc).flops.scaled(micro_batch)
