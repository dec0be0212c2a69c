"""Pick the fastest fine-tuning method that fits, or refuse with a report.

The space: every method that runs on the cluster (``llmem_plugin.methods``),
each tensor-parallel degree that divides a node and the model, CPU offload,
gradient checkpointing on and off, and each micro-batch that divides the
per-rank share of the global batch (gradient accumulation fills the rest).

The cost of searching it is bounded by traces, not candidates
(docs/planner.md):

1. **Profile** (:func:`_profile_point`): the single-GPU step in fast mode at
   micro-batch 1 and 2, with checkpointing off and on: each phase's allocated
   peak (activations grow linearly with the micro-batch) and the FLOPs of a
   micro-step (:class:`llmem_plugin.planner.cost.StepFlopCounter`).
2. **Method bases** (:func:`_screen_all`): each (method, TP degree) in the
   methods' fast mode at micro-batch 1, with checkpointing off and on, plus
   one micro-batch-2 run per tensor-parallel plan and degree (the share of
   the activations and of their collectives a TP rank holds). Model states,
   buffers and communication are the method's own.
3. **Screen**: each candidate's allocated peak is its base's, phase by
   phase, plus the profile's growth of the forward-phase peak with the
   micro-batch (times the TP share); its step time comes from
   :mod:`llmem_plugin.planner.cost`.
4. **Verify**: the fastest candidate under the limit is traced in full with
   its exact micro-batch, accumulation and checkpointing (the estimate
   ``llmem estimate --method`` gives). If it does not fit, the next is
   tried. The choice is always a verified one.

Kept candidates: device total at most ``capacity * (1 - margin)``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmem_plugin.models import modelbuild
from llmem_plugin.planner.cost import (
    DEFAULT_EFFICIENCY,
    FlopCount,
    Network,
    Overlap,
    StepTime,
    StepWork,
    flops_of_step,
    pipeline_bubble_s,
    step_time,
)
from llmem_plugin.errors import ConfigError, LLMemError, UnsupportedError, WontFitError
from llmem_plugin.device.gpus import GPU
from llmem_plugin.device.host import HostCapacity, resolve_host_memory
from llmem_plugin.methods import Layout, MethodEstimate, estimate_method
from llmem_plugin.device.overheads import CUDA_CONTEXT_BYTES
from llmem_plugin.trace.tracker import MemoryCategory
from llmem_plugin.workload import (
    LoraSpec,
    LossImpl,
    OptimizerKind,
    Precision,
    Quantization,
    Workload,
)

__all__ = ["DEFAULT_MARGIN", "Candidate", "Plan", "Suggestion", "plan"]

DEFAULT_MARGIN = 0.05
# Without --global-batch: this many sequences per GPU per optimizer step.
DEFAULT_SEQUENCES_PER_GPU = 8
# Largest node the planner assumes when suggesting more GPUs (DGX/HGX: 8).
_MAX_GPUS_PER_NODE = 8
_GIB = 2**30

_FWD, _BWD = "forward", "backward"


@dataclass(frozen=True)
class _Traits:
    """How a method shards, communicates and overlaps (module docstring of
    :mod:`llmem_plugin.planner.cost` for the overlap sources).

    per_micro_comm: communicates every micro-step (gradient reduce-scatter or
        parameter gathers in each backward), rather than once per step
        (DDP under ``no_sync``, DeepSpeed stage 1, which reduces at the
        accumulation boundary).
    state_shard: optimizer states split over "none", "dp" (all data-parallel
        ranks) or "node" (HSDP's shard group).
    param_shard: parameters split the same way ("host" = offloaded).
    """

    tp_family: bool
    per_micro_comm: bool
    overlap: Overlap
    state_shard: str
    param_shard: str
    offload: str | None = None


_TRAITS: dict[str, _Traits] = {
    "single": _Traits(False, False, Overlap.NONE, "none", "none"),
    "ddp": _Traits(False, False, Overlap.BACKWARD, "none", "none"),
    "zero1": _Traits(False, False, Overlap.NONE, "dp", "none"),
    "zero2": _Traits(False, True, Overlap.NONE, "dp", "none"),
    "zero3": _Traits(False, True, Overlap.FORWARD_BACKWARD, "dp", "dp"),
    "zero2-offload": _Traits(False, True, Overlap.NONE, "dp", "none", "optimizer"),
    "zero3-offload": _Traits(False, True, Overlap.FORWARD_BACKWARD, "dp", "host", "params"),
    "fsdp": _Traits(False, True, Overlap.FORWARD_BACKWARD, "dp", "dp"),
    "fsdp-offload": _Traits(False, True, Overlap.FORWARD_BACKWARD, "dp", "host", "params"),
    "hsdp": _Traits(False, True, Overlap.FORWARD_BACKWARD, "node", "node"),
    "gemini": _Traits(False, True, Overlap.NONE, "dp", "dp"),
    # LowLevelZeroPlugin(overlap_communication=True) is ColossalAI's default.
    "lowlevel-zero1": _Traits(False, True, Overlap.BACKWARD, "dp", "none"),
    "lowlevel-zero2": _Traits(False, True, Overlap.BACKWARD, "dp", "none"),
    "tp": _Traits(True, True, Overlap.NONE, "none", "none"),
    "dp-tp": _Traits(True, True, Overlap.NONE, "none", "none"),
    "fsdp-tp": _Traits(True, True, Overlap.NONE, "dp", "dp"),
    "hybrid": _Traits(True, True, Overlap.NONE, "none", "none"),
    "hybrid-zero1": _Traits(True, True, Overlap.NONE, "dp", "none"),
    # torch pipelining, FSDP2 inside each stage over the rest (torchtitan): every GPU holds 1/num_gpus of
    # the parameters and states; FSDP2 gathers once per step and reduces once (reshard_after_forward=False,
    # no sync until the last microbatch), prefetched behind compute.
    "pp": _Traits(False, False, Overlap.FORWARD_BACKWARD, "dp", "dp"),
    # The same with torch's interleaved 1F1B: two stages per rank (torchtitan's default for it).
    "pp-interleaved": _Traits(False, False, Overlap.FORWARD_BACKWARD, "dp", "dp"),
}
# Pipeline methods: their schedule and stages per rank. Each candidate runs microbatches of one row
# (torchtitan's pipeline_parallel_microbatch_size default of 1 at 000204a; num_tokens_per_microbatch_per_dp_rank
# = seq_len at b5bcd76, whose default is 16384 tokens): for a given rank's share of the batch, one
# row per microbatch has the fewest microbatches in flight and the most microbatches (the smallest bubble);
# the receive buffers, m of one row each, hold the same bytes at any split.
# The planner searches 1F1B and interleaved 1F1B with two stages per rank, whose bubbles the cited model
# covers ((p - 1) / m and (p - 1) / (v m)); the zero-bubble and V schedules are estimated by
# ``llmem estimate --method`` only. A name's label in a plan: "pp4", "pp4 interleaved".
_PP = {"pp": ("1f1b", 1), "pp-interleaved": ("interleaved-1f1b", 2)}
# The schedule's step as torchtitan's trainer calls it: ``pp_schedule.step(..., return_outputs=False)``
# (torchtitan/trainer.py at b5bcd76, 2026-08), so the last stage keeps no microbatch's logits past its
# loss and every rank is composed from short runs (methods/pp_compose.py) at any microbatch count.
_PP_RETURN_OUTPUTS = False
# Planner names that run a registry method with options.
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fsdp-offload": ("fsdp", {"cpu_offload": True}),
    "hybrid-zero1": ("hybrid", {"zero_stage": 1}),
}


# TRL DPO with its fused head (--reference-model --loss trl-fused) needs whole chosen/rejected pairs per
# micro-batch; the search profiles 1 and 2 rows and extrapolates.
DPO_NOT_SEARCHED = ("llmem plan does not search TRL DPO's paired rows yet (its micro-batch profiles are 1 and 2 rows; "
                    "DPO needs whole chosen/rejected pairs). HINT: llmem estimate with --method and an even "
                    "--batch-size for each layout to compare")


# Searched only when named (methods=[...], --methods): interleaved 1F1B's stand-in pipelines run tens of
# microbatches each (pipeline 16, 64 microbatches: 9 distinct stand-ins of 15 to 45 microbatches, and 6 of
# the 16 ranks with none smaller, traced whole), where 1F1B's run 4 to 12 (6 stand-ins, none whole): several
# times a 1F1B configuration's minutes at Llama-3.1-405B's scale (benchmarks/results/pp-search-2026-11-28.json).
_NAMED_ONLY = ("pp-interleaved",)


def _pipeline_label(method: str, pp: int) -> str:
    return f"pp{pp}" + ("" if method == "pp" else " " + method.removeprefix("pp-"))


def planner_methods() -> list[str]:
    """Every method name the planner searches (registry names plus variants)."""
    return list(_TRAITS)


def default_methods() -> list[str]:
    """The methods a plan searches when none are named: all but :data:`_NAMED_ONLY`."""
    return [m for m in _TRAITS if m not in _NAMED_ONLY]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One configuration and its predicted memory and speed.

    Attributes:
        method: Planner method name (``fsdp``, ``zero3-offload``, ``hybrid-zero1``...).
        tp: Tensor-parallel degree.
        micro_batch: Sequences per micro-step per data-parallel rank.
        grad_accum: Micro-steps per optimizer step.
        grad_checkpointing: Gradient checkpointing on.
        offload: "optimizer", "params" or None.
        device_total_bytes: Per-GPU device total of the worst rank.
        peak_allocated_bytes: Its allocated peak.
        peak_reserved_bytes: Its reserved peak.
        limit_bytes: ``capacity * (1 - margin)``.
        fits: ``device_total_bytes <= limit_bytes``.
        verified: The numbers come from the method's full trace at exactly
            this configuration (otherwise from the screen).
        time: Predicted step time, by part.
        tokens_per_s: Tokens per second over the whole cluster.
        segments: Bytes at the peak by kind (for the plan picture).
        host_bytes_per_node: Host RAM a node needs: one process per GPU, each
            with its offloaded states, pinned buffers and own baseline
            (:attr:`MethodEstimate.host_total_bytes_per_node`).
        host_limit_bytes: The node's host RAM less the margin (0: not checked).
        host_fits: ``host_bytes_per_node <= host_limit_bytes``; ``fits``
            holds only when this does too.
        pp: Pipeline degree (pipeline methods; ``grad_accum`` is then the
            schedule's microbatch count and ``micro_batch`` a microbatch's rows).
        schedule_steps: Pipeline methods: schedule steps per optimizer step
            (torchtitan's gradient accumulation), each of ``grad_accum``
            microbatches.
    """

    method: str
    tp: int
    micro_batch: int
    grad_accum: int
    grad_checkpointing: bool
    offload: str | None
    device_total_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    limit_bytes: int
    fits: bool
    verified: bool
    time: StepTime
    tokens_per_s: float
    segments: dict[str, int] = field(default_factory=dict)
    host_bytes_per_node: int = 0
    host_limit_bytes: int = 0
    host_fits: bool = True
    pp: int = 1
    schedule_steps: int = 1

    @property
    def headroom_bytes(self) -> int:
        return self.limit_bytes - self.device_total_bytes

    @property
    def step_time_s(self) -> float:
        return self.time.total_s

    @property
    def key(self) -> tuple:
        return (self.method, self.tp, self.pp, self.micro_batch, self.grad_checkpointing,
                *((self.grad_accum, self.schedule_steps) if self.pp > 1 else ()))

    @property
    def method_label(self) -> str:
        """The method as the plan's table names it: with its pipeline degree and schedule for a pipeline
        (``pp4``, ``pp4 interleaved``)."""
        return _pipeline_label(self.method, self.pp) if self.pp > 1 else self.method

    def label(self) -> str:
        tp = f" tp{self.tp}" if self.tp > 1 else ""
        gc = " +ckpt" if self.grad_checkpointing else ""
        if self.pp > 1:  # grad_accum is the pipeline's microbatch count, per schedule step
            steps = f" x{self.schedule_steps} steps" if self.schedule_steps > 1 else ""
            return f"{_pipeline_label(self.method, self.pp)}{tp} mb{self.micro_batch}x{self.grad_accum}{steps}{gc}"
        return f"{self.method}{tp} mb{self.micro_batch}x{self.grad_accum}{gc}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "tp": self.tp,
            "pp": self.pp,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "schedule_steps": self.schedule_steps,
            "grad_checkpointing": self.grad_checkpointing,
            "offload": self.offload,
            "fits": self.fits,
            "verified": self.verified,
            "device_total_bytes": self.device_total_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "headroom_bytes": self.headroom_bytes,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "time": self.time.to_dict(),
            "segments": dict(self.segments),
            "host_bytes_per_node": self.host_bytes_per_node,
            "host_limit_bytes": self.host_limit_bytes,
            "host_fits": self.host_fits,
        }


@dataclass(frozen=True, kw_only=True)
class Suggestion:
    """A change that makes the job fit, with the plan it then gets."""

    change: str
    choice: Candidate

    def to_dict(self) -> dict[str, Any]:
        return {"change": self.change, "choice": self.choice.to_dict()}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The planner's answer.

    Attributes:
        model: What was planned for.
        gpu: Catalog GPU.
        layout: GPUs and nodes (tp of the layout is 1; candidates carry theirs).
        workload: The user's workload (its micro-batch, accumulation and
            checkpointing are the planner's to choose).
        global_batch: Sequences per optimizer step over the cluster.
        capacity_bytes: The GPU's capacity.
        margin: Fraction of the capacity kept free.
        candidates: Every screened candidate, fastest first.
        choice: The fastest verified candidate that fits, or None.
        runner_up: The fastest other fitting candidate of a different method
            or TP degree (None if there is none).
        why: One line on why the choice beats the runner-up.
        skipped: (method, reason) for methods that cannot run here.
        suggestions: When nothing fits, changes that make it fit.
        seconds: Wall time of the planning.
        timings: Seconds by stage: "screen" (the profile and the methods'
            fast-mode runs, over all cores), "verify" (full traces), and
            "suggest" when nothing fits.
        host_memory: Host RAM per node the plans are checked against, and
            where the figure comes from (``--host-memory`` or a default).
        host_refused_bytes: The least host RAM per node among the plans
            refused for host memory (0: none was).
    """

    model: str
    gpu: GPU
    layout: Layout
    workload: Workload
    global_batch: int
    capacity_bytes: int
    margin: float
    candidates: list[Candidate]
    choice: Candidate | None
    runner_up: Candidate | None
    why: str
    skipped: list[tuple[str, str]]
    suggestions: list[Suggestion] = field(default_factory=list)
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    host_memory: HostCapacity | None = None
    host_refused_bytes: int = 0

    @property
    def host_limit_bytes(self) -> int:
        """The node's host RAM less the margin (0 when not checked)."""
        return int(self.host_memory.node_bytes * (1 - self.margin)) if self.host_memory else 0

    @property
    def limit_bytes(self) -> int:
        return int(self.capacity_bytes * (1 - self.margin))

    def closest(self, n: int = 3) -> list[Candidate]:
        """The ``n`` non-fitting candidates that exceed the limit least."""
        over = [c for c in self.candidates if not c.fits]
        return sorted(over, key=lambda c: c.device_total_bytes)[:n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "gpu": self.gpu.name,
            "layout": {"num_gpus": self.layout.num_gpus, "num_nodes": self.layout.num_nodes},
            "workload": self.workload.to_dict(),
            "global_batch": self.global_batch,
            "capacity_bytes": self.capacity_bytes,
            "margin": self.margin,
            "limit_bytes": self.limit_bytes,
            "choice": self.choice.to_dict() if self.choice else None,
            "runner_up": self.runner_up.to_dict() if self.runner_up else None,
            "why": self.why,
            "candidates": [c.to_dict() for c in self.candidates],
            "skipped": [{"method": m, "reason": r} for m, r in self.skipped],
            "suggestions": [s.to_dict() for s in self.suggestions],
            "seconds": round(self.seconds, 3),
            "timings": {k: round(v, 3) for k, v in self.timings.items()},
            "host_memory": self.host_memory.to_dict() if self.host_memory else None,
            "host_limit_bytes": self.host_limit_bytes,
            "host_refused_bytes": self.host_refused_bytes,
        }


# ----------------------------------------------------------------------------- profile


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

    config = modelbuild.resolve_config(model)
    depth = modelbuild.num_layers(config)
    ext = extrapolated_trace(config, workload, depth=depth, trace=trace)
    if ext.result is None:  # layer kinds fast mode cannot tell apart: the full model
        ext = Extrapolation(trace(modelbuild.build_model(config, workload), workload))
    meta = modelbuild.build_model(modelbuild.set_num_layers(config, 1), workload, device="meta")
    overheads = device_overheads(gpu.compute_capability, uses_cublaslt=uses_cublaslt(meta))
    from llmem_plugin.device.allocator_config import AllocatorConfig

    cfg = alloc_conf if isinstance(alloc_conf, AllocatorConfig) else AllocatorConfig.from_env(alloc_conf)
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


# ----------------------------------------------------------------------------- screen


@dataclass(frozen=True)
class _Config:
    method: str
    tp: int
    pp: int = 1


@dataclass
class _Base:
    """A method's fast-mode estimates, the anchor of its candidates.

    one: micro-batch 1, no checkpointing (the checkpointed run when only
        checkpointing is searched).
    ckpt: micro-batch 1, checkpointing.
    tp_alloc_per_sample / tp_comm_per_sample: for TP methods, what one more
        sequence adds to the forward-phase allocated peak and to the
        (intra, inter)-node bytes per micro-step: the activation share a TP
        rank holds and their collectives, measured between micro-batch 1 and
        2 runs of the same TP plan and degree.
    """

    one: MethodEstimate
    ckpt: MethodEstimate | None = None
    tp_alloc_per_sample: float | None = None
    tp_comm_per_sample: tuple[float, float] | None = None


def _state_bytes_per_element(wl: Workload) -> int:
    """Least optimizer-state bytes per trainable element on any engine."""
    elem = 2 if wl.precision is Precision.BF16 else 4
    # bitsandbytes 8-bit AdamW: two uint8 states (more for tensors under its
    # min_8bit_size); paged states live outside the device fit (docs/techniques/optimizers.md).
    return {OptimizerKind.ADAMW: 2 * elem, OptimizerKind.ADAMW_FUSED: 2 * elem,
            OptimizerKind.ADAMW_FORLOOP: 2 * elem, OptimizerKind.SGD: elem, OptimizerKind.ADAFACTOR: 0,
            OptimizerKind.ADAMW_8BIT: 2, OptimizerKind.PAGED_ADAMW: 0, OptimizerKind.PAGED_ADAMW_8BIT: 0}[wl.optimizer]


def _shard(kind: str, layout: Layout, tp: int) -> int:
    dp = layout.num_gpus // tp
    return {"none": 1, "dp": dp, "node": min(layout.gpus_per_node // tp, dp)}[kind] * tp


def _lower_bound(cfg: _Config, layout: Layout, params: int, trainable: int, wl: Workload) -> int:
    """Bytes every engine of this kind must hold per GPU: its parameter shard
    in 16 bits (32 for fp32 training) and its optimizer-state shard. A screen
    that may skip a configuration only when even this exceeds the limit."""
    t = _TRAITS[cfg.method]
    p_bytes = _activation_bytes(wl)
    held = 0 if t.param_shard == "host" else params * p_bytes // _shard(t.param_shard, layout, cfg.tp)
    if cfg.pp > 1:
        # A pipeline rank's stage keeps its parameters whole and their gradients unreduced through the step:
        # FSDP2 inside it neither reshards after forward (torchtitan: not under pipelining) nor reduces
        # until the last microbatch (the schedule's requires_gradient_sync(False)); without FSDP2 the stage
        # holds them anyway. Its stage is at least 1/p of the parameters, and a TP rank's 1/tp of that.
        # Under mixed precision FSDP2 keeps them gathered in 16 bits and accumulates their gradients in its
        # fp32 reduce dtype between reductions (FSDPParam.to_accumulated_grad_if_needed: the 16-bit
        # gradient is upcast and dropped after each microbatch's backward).
        grad_bytes = 4 if wl.precision.autocast_dtype is not None else p_bytes
        held = params * (p_bytes + grad_bytes) // (cfg.pp * cfg.tp)
    states = 0 if t.offload else trainable * _state_bytes_per_element(wl) // _shard(t.state_shard, layout, cfg.tp)
    return held + states


def _activation_bytes(wl: Workload) -> int:
    """Bytes per element of the activations, and of the parameters as the step holds them: fp32 runs in
    fp32, every other precision in its 16-bit dtype (mixed precision's FSDP2 gathers and computes in it)."""
    return 4 if wl.precision is Precision.FP32 else 2


def _registry_call(cfg: _Config, model: Any, wl: Workload, layout: Layout, gpu: GPU, alloc_conf: Any,
                   fast: bool, split: tuple[int, int] | None = None, stand_ins: dict | None = None,
                   stream_synthesis: bool = False) -> MethodEstimate:
    """The method's estimate for ``cfg``; a pipeline's at ``split`` (microbatches per schedule step,
    schedule steps per optimizer step), sharing ``stand_ins`` (its composition's runs, of two schedule steps
    each: they serve every split) across splits. ``stream_synthesis``: as :func:`estimate_method` (the
    full trace's figures, built from shortened runs where the method's rules allow)."""
    lay = Layout(num_gpus=layout.num_gpus, num_nodes=layout.num_nodes, tp=cfg.tp)
    if cfg.pp > 1:
        m, k = split
        wl1 = dataclasses.replace(wl, grad_accum_steps=k)
        return estimate_method(cfg.method, model, wl1, layout=lay, gpu=gpu, alloc_conf=alloc_conf, fast=fast,
                               pipeline_degree=cfg.pp, microbatches=m, return_outputs=_PP_RETURN_OUTPUTS,
                               stand_ins=stand_ins, stand_in_steps=2 if stand_ins is not None else None)
    name, options = _VARIANTS.get(cfg.method, (cfg.method, {}))
    return estimate_method(name, model, wl, layout=lay, gpu=gpu, alloc_conf=alloc_conf, fast=fast,
                           stream_synthesis=stream_synthesis, **options)


def _comm_split(intra: float, inter: float, cfg: _Config, layout: Layout) -> tuple[float, float]:
    """(intra-only, cross-node) bytes. The methods report bytes by link with
    a ring's inter-node share taken as nodes/ring size; a ring that spans
    nodes runs every byte at the network's pace, so its full volume is
    ``inter * ranks per node of the ring``."""
    if layout.num_nodes == 1 or inter <= 0:
        return intra, 0.0
    per_node = 1 if cfg.method == "hsdp" else max(layout.gpus_per_node // cfg.tp, 1)
    cross = inter * per_node
    return max(intra + inter - cross, 0.0), cross


# Method-specific breakdown keys, by the plan picture's segment they belong to.
_SEGMENT_OF = {
    MemoryCategory.PARAMETER.value: "parameters",
    "gathered_parameters": "parameters",
    MemoryCategory.GRADIENT.value: "gradients",
    "fp32_gradients": "gradients",
    MemoryCategory.OPTIMIZER_STATE.value: "optimizer_states",
    "fp32_master_weights": "optimizer_states",
    MemoryCategory.ACTIVATION.value: "activations",
}


def _segments(est: MethodEstimate, allocated: int, reserved: int, activation_delta: float) -> dict[str, int]:
    """Bytes at the peak by the plan picture's segments: the method's tensor
    breakdown at its peak (activations moved by the candidate's difference
    from it), the rest of the allocated peak as temporaries (buffers,
    workspaces, transient tensors), then the allocator's slack and what lies
    outside it."""
    return rank_segments(est.worst, allocated, reserved, activation_delta)


def rank_segments(w: Any, allocated: int | None = None, reserved: int | None = None,
                  activation_delta: float = 0.0) -> dict[str, int]:
    """One rank's (:class:`~llmem_plugin.methods.base.RankMemory`) bytes by the plan picture's segments, as
    :func:`_segments` (allocated and reserved: the rank's own by default)."""
    allocated = w.peak_allocated_bytes if allocated is None else allocated
    reserved = w.peak_reserved_bytes if reserved is None else reserved
    seg = {"parameters": 0, "gradients": 0, "optimizer_states": 0, "activations": 0}
    for key, v in w.breakdown.items():
        if key in _SEGMENT_OF:
            seg[_SEGMENT_OF[key]] += v
    seg["activations"] = max(seg["activations"] + round(activation_delta), 0)
    known = sum(seg.values())
    seg["temporaries"] = max(allocated - known, 0)
    seg["allocator_slack"] = max(reserved - max(allocated, known), 0)
    seg["context_nccl"] = w.device_total_bytes - w.peak_reserved_bytes
    return seg


def _phase_peak(base: dict[str, int], deltas: dict[str, float]) -> int:
    return max((v + deltas.get(p, 0.0) for p, v in base.items()), default=0)


@dataclass(frozen=True, kw_only=True)
class _Context:
    model: Any
    config: Any
    workload: Workload
    layout: Layout
    gpu: GPU
    network: Network
    global_batch: int
    limit: int
    alloc_conf: Any
    efficiency: float
    params: int
    trainable: int
    host_limit: int = 0  # host RAM per node less the margin; 0: not checked


def _micro_batches(per_rank: int, pinned: int | None) -> list[int]:
    if pinned is not None:
        return [pinned] if per_rank % pinned == 0 else []
    out = [m for m in (2**k for k in range(16)) if m <= per_rank and per_rank % m == 0]
    return out + ([per_rank] if per_rank not in out else [])


def _candidate(ctx: _Context, cfg: _Config, base: _Base, profiles: _Profiles, mb: int, gc: bool,
               accum: int) -> Candidate:
    t = _TRAITS[cfg.method]
    one = base.one
    anchor = base.ckpt if gc else one
    assert anchor is not None
    w = anchor.worst
    phases = dict(w.phase_allocated) or {_FWD: w.peak_allocated_bytes}
    # Activations grow linearly with the micro-batch: the profile's slope of
    # its forward-phase peak (activations and temporaries alive at the end of
    # forward) at the same checkpointing, times the share a TP rank holds
    # (measured between the method's micro-batch 1 and 2 runs). The single-GPU
    # backward peak is no guide: with unsharded states it falls at the end of
    # backward, when every gradient is alive and most activations are gone.
    k = 1.0
    if t.tp_family and base.tp_alloc_per_sample is not None:
        d_single = profiles.phase(2, False, _FWD) - profiles.phase(1, False, _FWD)
        k = min(max(base.tp_alloc_per_sample / d_single, 1.0 / cfg.tp), 1.0) if d_single > 0 else 1.0 / cfg.tp
    d = k * (profiles.phase(mb, gc, _FWD) - profiles.phase(1, gc, _FWD))
    deltas = {_FWD: d, _BWD: d}
    if accum > 1:
        # From the second micro-step on, the accumulated gradients stay alive
        # through forward and backward (the base ran one micro-step, after
        # which the step frees them): add what the step held as gradients.
        held = w.phase_breakdowns.get("optimizer", {}).get(MemoryCategory.GRADIENT.value, 0)
        deltas = {p: v + held for p, v in deltas.items()}
    allocated = _phase_peak(phases, deltas)
    ratio = w.peak_reserved_bytes / max(w.peak_allocated_bytes, 1)
    reserved = max(round(allocated * ratio), allocated)
    outside = w.device_total_bytes - w.peak_reserved_bytes
    total = reserved + outside
    # Communication: per-sample (TP activations) and per-step parts; with
    # checkpointing, recomputation repeats the forward's TP collectives
    # (measured: the checkpointed base's volume over the plain one's).
    intra1, inter1 = anchor.comm_intra_node_bytes, anchor.comm_inter_node_bytes
    act_intra = act_inter = 0.0
    if t.tp_family and base.tp_comm_per_sample is not None:
        act_intra, act_inter = base.tp_comm_per_sample
        if gc:
            act_intra += anchor.comm_intra_node_bytes - one.comm_intra_node_bytes
            act_inter += anchor.comm_inter_node_bytes - one.comm_inter_node_bytes
    fixed_intra, fixed_inter = intra1 - act_intra, inter1 - act_inter
    reps = accum if t.per_micro_comm else 1
    intra = accum * mb * act_intra + reps * fixed_intra
    inter = accum * mb * act_inter + reps * fixed_inter
    intra_only, cross = _comm_split(intra, inter, cfg, ctx.layout)
    flops = profiles.flops(mb, gc).scaled(1.0 / cfg.tp)
    state_shard = _shard(t.state_shard, ctx.layout, cfg.tp)
    elems = ctx.trainable // state_shard
    es = _activation_bytes(ctx.workload)
    pcie = 0
    if t.offload:
        pcie = accum * es * elems + es * elems  # gradients down each micro-step, parameters up once
        if t.offload == "params":
            pcie += accum * 2 * es * ctx.params // _shard("dp", ctx.layout, cfg.tp)  # gathered in fwd and bwd
    work = StepWork(
        flops=flops, micro_steps=accum, intra_only_bytes=round(intra_only), cross_node_bytes=round(cross),
        overlap=t.overlap, optimizer_elements=0 if t.offload else elems,
        host_optimizer_elements=elems if t.offload else 0, pcie_bytes=pcie,
        gpus_per_node=ctx.layout.gpus_per_node,
    )
    st = step_time(work, gpu=ctx.gpu, precision=ctx.workload.precision, optimizer=ctx.workload.optimizer,
                   network=ctx.network, efficiency=ctx.efficiency)
    act_delta = deltas.get(_BWD, 0.0)
    host = anchor.host_total_bytes_per_node
    host_fits = not ctx.host_limit or host <= ctx.host_limit
    return Candidate(
        method=cfg.method, tp=cfg.tp, micro_batch=mb, grad_accum=accum, grad_checkpointing=gc, offload=t.offload,
        device_total_bytes=total, peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
        limit_bytes=ctx.limit, fits=total <= ctx.limit and host_fits, verified=False, time=st,
        tokens_per_s=ctx.global_batch * ctx.workload.seq_len / st.total_s,
        segments=_segments(anchor, allocated, reserved, act_delta),
        host_bytes_per_node=host, host_limit_bytes=ctx.host_limit, host_fits=host_fits,
    )


def _pp_work(ctx: _Context, cfg: _Config, profiles: _Profiles, gc: bool, fsdp_intra: float, fsdp_cross: float,
             split: tuple[int, int]) -> tuple[StepTime, int]:
    """A pipeline candidate's step time: each rank computes its stage for its data-parallel share (one-row
    microbatches), idles for the schedule's bubble (:func:`llmem_plugin.planner.cost.pipeline_bubble_s`), waits
    for each microbatch's activations and input gradients from its neighbours (P2P on the critical path:
    not hidden), and overlaps FSDP2's one gather and one reduction per step with compute. TP inside the
    stages splits each stage's compute tp ways and adds its collectives on the critical path (each layer's
    all-reduces wait for the matmul before them and gate the one after). ``split``: (microbatches per
    schedule step, schedule steps per optimizer step); each schedule step has its own bubble, (p - 1) / m
    of its compute, and its own FSDP2 gather and reduction (counted by the method)."""
    _, v = _PP[cfg.method]
    m, k = split
    p2p, tp_bytes = _pp_path_bytes(ctx, cfg, gc, split)
    work = StepWork(flops=profiles.flops(1, gc).scaled(m * k / (cfg.pp * cfg.tp)), micro_steps=1,
                    intra_only_bytes=round(fsdp_intra),
                    cross_node_bytes=round(fsdp_cross), overlap=Overlap.FORWARD_BACKWARD,
                    optimizer_elements=ctx.trainable // ctx.layout.num_gpus, gpus_per_node=ctx.layout.gpus_per_node)
    st = step_time(work, gpu=ctx.gpu, precision=ctx.workload.precision, optimizer=ctx.workload.optimizer,
                   network=ctx.network, efficiency=ctx.efficiency)
    from llmem_plugin.methods.pp.method import pipeline_across_nodes

    across = pipeline_across_nodes(ctx.layout)
    p2p_s = p2p / ((ctx.network.inter_node_gbps if across else ctx.network.intra_node_gbps) * 1e9)
    tp_s = tp_bytes / (ctx.network.intra_node_gbps * 1e9)  # the TP group stays inside a node
    bubble = pipeline_bubble_s(st.compute_s, degree=cfg.pp, microbatches=m, stages_per_rank=v)
    return dataclasses.replace(st, comm_s=st.comm_s + p2p_s + tp_s, exposed_comm_s=st.exposed_comm_s + p2p_s + tp_s,
                               bubble_s=bubble), p2p + tp_bytes


def _pp_path_bytes(ctx: _Context, cfg: _Config, gc: bool, split: tuple[int, int]) -> tuple[int, int]:
    """(P2P, TP) bytes a pipeline candidate's rank sends per step on the critical path: each microbatch's
    activations and input gradients per stage, and TP's collectives over the deepest rank's decoder layers
    under torchtitan's split, as the method counts them (:func:`llmem_plugin.methods.pp.method.tensor_parallel_bytes`)."""
    from llmem_plugin.methods.pp.method import rank_layers, stage_specs, tensor_parallel_bytes

    schedule, v = _PP[cfg.method]
    microbatches = split[0] * split[1]  # over all the optimizer step's schedule steps
    es = _activation_bytes(ctx.workload)
    p2p = 2 * microbatches * v * ctx.workload.seq_len * int(ctx.config.hidden_size) * es
    # The rank's stages run one after another: its TP collectives cover all of their layers.
    layers = rank_layers(schedule, cfg.pp, v, stage_specs(modelbuild.num_layers(ctx.config), cfg.pp * v))
    tp_bytes = tensor_parallel_bytes(micro_batch=1, seq_len=ctx.workload.seq_len, hidden=int(ctx.config.hidden_size),
                                     vocab=int(ctx.config.vocab_size), layers=layers, microbatches=microbatches,
                                     tp=cfg.tp, bytes_per=es, recompute=gc)
    return p2p, tp_bytes


def _pp_candidate(ctx: _Context, cfg: _Config, est: MethodEstimate, profiles: _Profiles, gc: bool,
                  split: tuple[int, int]) -> Candidate:
    """A pipeline candidate from its method's estimate at exactly its configuration (the microbatches
    composed; fast mode, the stages at 1 and 2 layers extrapolated, unless :func:`_screened_at_full_depth`:
    then the estimate is the one verification would make, and the candidate is verified)."""
    from llmem_plugin.methods.pp.method import pipeline_across_nodes

    m, k = split
    # The method reports its P2P volume and TP's (inside a node) with the FSDP2 ring's, the P2P on the link
    # pipeline neighbours share: what is left is FSDP2's, overlapped with compute.
    p2p, tp_bytes = _pp_path_bytes(ctx, cfg, gc, split)
    if pipeline_across_nodes(ctx.layout):
        fsdp_intra, fsdp_cross = max(est.comm_intra_node_bytes - tp_bytes, 0), max(est.comm_inter_node_bytes - p2p, 0)
    else:
        fsdp_intra, fsdp_cross = max(est.comm_intra_node_bytes - p2p - tp_bytes, 0), est.comm_inter_node_bytes
    st, _ = _pp_work(ctx, cfg, profiles, gc, fsdp_intra, fsdp_cross, split)
    w = est.worst
    host = est.host_total_bytes_per_node
    host_fits = not ctx.host_limit or host <= ctx.host_limit
    return Candidate(
        method=cfg.method, tp=cfg.tp, pp=cfg.pp, micro_batch=1, grad_accum=m, schedule_steps=k,
        grad_checkpointing=gc, offload=None,
        device_total_bytes=w.device_total_bytes, peak_allocated_bytes=w.peak_allocated_bytes,
        peak_reserved_bytes=w.peak_reserved_bytes, limit_bytes=ctx.limit,
        fits=w.device_total_bytes <= ctx.limit and w.fits and host_fits,
        verified=_screened_at_full_depth(ctx, cfg), time=st,
        tokens_per_s=ctx.global_batch * ctx.workload.seq_len / st.total_s,
        segments=_segments(est, w.peak_allocated_bytes, w.peak_reserved_bytes, 0.0),
        host_bytes_per_node=host, host_limit_bytes=ctx.host_limit, host_fits=host_fits,
    )


# Methods sharing a tensor-parallel plan: their TP activations and collectives
# are the same, so one micro-batch-2 run per (plan, degree) serves them all.
_TP_PLAN = {"tp": "torchtitan", "dp-tp": "torchtitan", "fsdp-tp": "torchtitan", "hybrid": "shardformer",
            "hybrid-zero1": "shardformer"}


class _BatchError(ConfigError):
    """The global batch does not split over a configuration's ranks (``hint``: the fix, when not the
    data-parallel split's)."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


def _pipeline_microbatches(ctx: _Context, cfg: _Config, pinned: int | None) -> int:
    """A pipeline configuration's microbatches per optimizer step: its data-parallel rank's share of the
    global batch, one row each (:data:`_PP`)."""
    schedule, _ = _PP[cfg.method]
    dp = ctx.layout.num_gpus // (cfg.pp * cfg.tp)
    if ctx.global_batch % dp:
        raise _BatchError(f"global batch {ctx.global_batch} is not a multiple of the {dp} data-parallel ranks")
    if pinned not in (None, 1):
        raise _BatchError(f"pipeline candidates run one-row microbatches, not --micro-batch {pinned}",
                          "leave --micro-batch out (or 1) to plan pipeline methods")
    m = ctx.global_batch // dp
    if m < cfg.pp:
        raise _BatchError(f"{m} microbatches per step are fewer than the {cfg.pp} pipeline stages",
                          f"pass a --global-batch of at least {cfg.pp * dp} ({cfg.pp} per data-parallel rank)")
    if schedule == "interleaved-1f1b" and m % cfg.pp:
        raise _BatchError(f"{m} microbatches per step are not a multiple of the {cfg.pp} pipeline ranks")
    return m


# Pipeline configurations the planner traces by default (plan(max_pipelines=...)): one costs about 50 s at
# 405B on a 2-core machine, the other methods' seconds each (benchmarks/results/plan-speed-2026-12-01.json:
# 103 s in all with one; -2026-11-28.json: 68 s with none).
DEFAULT_MAX_PIPELINES = 1
# Schedule steps per optimizer step searched for a pipeline: powers of two up to this many.
_MAX_SCHEDULE_STEPS = 64


def _pipeline_splits(ctx: _Context, cfg: _Config) -> list[tuple[int, int]]:
    """The (microbatches per schedule step, schedule steps per optimizer step) a pipeline configuration is
    planned at, all of its rank's share: the whole share in one schedule step, and torchtitan's gradient
    accumulation over 2, 4, ... steps (``num_tokens_per_train_step`` over a step's tokens x dp) while each step
    keeps at least two microbatches per stage (a shorter step is mostly bubble). Fewer microbatches per step
    hold fewer receive buffers; more have a smaller bubble and fewer FSDP2 gathers and reductions."""
    share = _pipeline_microbatches(ctx, cfg, None)
    out = [(share, 1)]
    k = 2
    while k <= _MAX_SCHEDULE_STEPS and share % k == 0 and share // k >= 2 * cfg.pp:
        out.append((share // k, k))
        k *= 2
    return out


def _micro_batch_plan(ctx: _Context, cfg: _Config, pinned: int | None) -> tuple[int, list[int]]:
    if cfg.pp > 1:
        return _pipeline_microbatches(ctx, cfg, pinned), [1]
    dp = ctx.layout.num_gpus // cfg.tp
    if ctx.global_batch % dp:
        raise _BatchError(f"global batch {ctx.global_batch} is not a multiple of the {dp} data-parallel ranks")
    per_rank = ctx.global_batch // dp
    mbs = _micro_batches(per_rank, pinned)
    if not mbs:
        raise _BatchError(f"micro-batch {pinned} does not divide the {per_rank} sequences per rank")
    return per_rank, mbs


def _screened_at_full_depth(ctx: _Context, cfg: _Config) -> bool:
    """Whether a pipeline configuration's fast-mode screen is its full-depth estimate: every stage has at
    most :data:`~llmem_plugin.methods.pp.method.FAST_FULL_DEPTH_LAYERS` layers, which fast mode traces whole. Its
    candidates are then verified by the screen (a second trace would repeat the same one)."""
    from llmem_plugin.methods.pp.method import FAST_FULL_DEPTH_LAYERS, stage_specs

    v = _PP[cfg.method][1]
    specs = stage_specs(modelbuild.num_layers(ctx.config), cfg.pp * v)
    return max(sp.stop - sp.start for sp in specs) <= FAST_FULL_DEPTH_LAYERS


def _run_task(task: tuple) -> Any:
    """One trace of the screen: a profile point or a method's fast-mode run.
    Errors come back as values (they cross a process boundary)."""
    kind = task[0]
    try:
        if kind == "profile":
            _, profiles, mb, gc = task
            return profiles.compute(mb, gc)
        if kind == "pipeline":  # every split of one configuration, their composition's runs shared
            _, ctx, cfg, wl, splits = task
            shared: dict = {}
            out = {}
            for split in splits:
                try:
                    out[split] = _registry_call(cfg, ctx.model, wl, ctx.layout, ctx.gpu, ctx.alloc_conf, fast=True,
                                                split=split, stand_ins=shared)
                except LLMemError as e:
                    out[split] = ConfigError(str(e))
            return out
        if kind == "verify":  # beside a pipeline's screen: the candidate and the seconds it took
            _, ctx, c = task
            t = time.perf_counter()
            try:
                return _verify(ctx, c), time.perf_counter() - t
            except LLMemError as e:
                return ConfigError(str(e)), time.perf_counter() - t
        _, ctx, cfg, wl = task
        return _registry_call(cfg, ctx.model, wl, ctx.layout, ctx.gpu, ctx.alloc_conf, fast=True)
    except LLMemError as e:
        return ConfigError(str(e))


def _map(tasks: list[tuple]) -> list[Any]:
    """Run the tasks over the machine's cores: each worker is a fork of this
    process (imported modules and built state come with it)."""
    workers = min(len(tasks), _cores())
    if workers <= 1:
        return [_run_task(t) for t in tasks]
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers, initializer=_quiet_worker) as pool:
        return pool.map(_run_task, tasks, chunksize=1)


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class _Search:
    """The traces behind the candidates, run on demand and kept.

    A unit is a (configuration, checkpointing) pair: its candidates need the
    method's fast-mode run at micro-batch 1 with that checkpointing (TP
    methods also the plain run, and one micro-batch-2 run per TP plan and
    degree). :meth:`expand` runs what a list of units still needs, over the
    machine's cores, and builds their candidates.
    """

    def __init__(self, ctx: _Context, profiles: _Profiles, gcs: list[bool], pinned: int | None) -> None:
        self.ctx, self.profiles, self.gcs, self.pinned = ctx, profiles, gcs, pinned
        self.results: dict[tuple, Any] = {}
        self.rep: dict[tuple[str, int], _Config] = {}
        wl1 = dataclasses.replace(ctx.workload, micro_batch_size=1, grad_accum_steps=1, grad_checkpointing=False)
        self._wl = {"one": wl1, "ckpt": dataclasses.replace(wl1, grad_checkpointing=True),
                    "two": dataclasses.replace(wl1, micro_batch_size=2)}

    def profile(self) -> None:
        """The single-GPU profile points, traced in parallel."""
        need = [(mb, g) for g in self.gcs for mb in (1, 2) if not self.profiles.has(mb, g)]
        for (mb, g), value in zip(need, _map([("profile", self.profiles, mb, g) for mb, g in need]), strict=True):
            if isinstance(value, LLMemError):
                raise value  # the model's own step cannot be traced: nothing to plan
            self.profiles.put(mb, g, value)

    def _needs(self, cfg: _Config, gc: bool) -> list[tuple[str, _Config]]:
        if cfg.pp > 1:
            return [("pp-ckpt" if gc else "pp-one", cfg)]
        t = _TRAITS[cfg.method]
        keys = []
        if not gc or t.tp_family:
            keys.append(("one", cfg))
        if gc:
            keys.append(("ckpt", cfg))
        if t.tp_family:
            r = self.rep.setdefault((_TP_PLAN[cfg.method], cfg.tp), cfg)
            keys += [("one", r), ("two", r)]
        return keys

    def expand(self, units: list[tuple[_Config, bool]], verify: Candidate | None = None
               ) -> tuple[list[tuple[tuple[_Config, bool], Any]], Any]:
        """Run what ``units`` still need and build their candidates; with ``verify``, that candidate's
        :func:`_verify` runs in the same pool after them (a (candidate or error, seconds) pair comes back,
        else None)."""
        todo = list(dict.fromkeys(k for u in units for k in self._needs(*u) if k not in self.results))
        # Slowest first: pipelines (every rank's stages under the schedule), then the TP methods (three runs).
        todo.sort(key=lambda k: (k[1].pp == 1, not _TRAITS[k[1].method].tp_family))
        tasks = [("pipeline", self.ctx, cfg, self._workload(kind, cfg), _pipeline_splits(self.ctx, cfg))
                 if cfg.pp > 1 else ("run", self.ctx, cfg, self._workload(kind, cfg)) for kind, cfg in todo]
        if verify is not None:
            tasks.append(("verify", self.ctx, verify))
        out = _map(tasks)
        self.results.update(zip(todo, out[:len(todo)], strict=True))
        return [(u, self._build(*u)) for u in units], (out[-1] if verify is not None else None)

    def _workload(self, kind: str, cfg: _Config) -> Workload:
        if kind.startswith("pp-"):  # one-row microbatches; the splits come with the task
            return dataclasses.replace(self._wl["one"], grad_checkpointing=kind == "pp-ckpt")
        return self._wl[kind]

    def _build(self, cfg: _Config, gc: bool) -> Any:
        t = _TRAITS[cfg.method]
        got = {k: self.results[(k, c)] for k, c in self._needs(cfg, gc)}
        err = next((v for v in got.values() if isinstance(v, LLMemError)), None)
        if err is not None:
            return err
        if cfg.pp > 1:
            runs = next(iter(got.values()))
            out = [_pp_candidate(self.ctx, cfg, est, self.profiles, gc, split) for split, est in runs.items()
                   if not isinstance(est, LLMemError)]
            if not out:
                return next(iter(runs.values()))  # no split could be estimated: the first one's reason
            return out
        one = self.results.get(("one", cfg))
        base = _Base(one if one is not None else self.results[("ckpt", cfg)], ckpt=self.results.get(("ckpt", cfg)))
        if t.tp_family:
            r = self.rep[(_TP_PLAN[cfg.method], cfg.tp)]
            r_one, r_two = self.results[("one", r)], self.results[("two", r)]
            base.tp_alloc_per_sample = (r_two.worst.phase_allocated.get(_FWD, 0)
                                        - r_one.worst.phase_allocated.get(_FWD, 0))
            base.tp_comm_per_sample = (r_two.comm_intra_node_bytes - r_one.comm_intra_node_bytes,
                                       r_two.comm_inter_node_bytes - r_one.comm_inter_node_bytes)
        per_rank, mbs = _micro_batch_plan(self.ctx, cfg, self.pinned)
        return [_candidate(self.ctx, cfg, base, self.profiles, mb, gc, per_rank // mb) for mb in mbs]


def _memory_bound(ctx: _Context, cfg: _Config, gc: bool, profiles: _Profiles) -> int:
    """Bytes every candidate of (cfg, gc) holds at least: the parameter and
    optimizer-state shards (:func:`_lower_bound`), the CUDA context, and the
    forward's saved tensors at micro-batch 1 (the single-GPU profile's,
    less the 16-bit weight copies autocast saves there, which engines that
    keep 16-bit parameters do not make; a TP rank holds at least 1/tp), and
    for a pipeline its receive buffers (:func:`_receive_buffers_bound`)."""
    acts = profiles.point(1, gc).activations
    if ctx.workload.precision.autocast_dtype is not None:
        acts -= 2 * ctx.params
    # A pipeline rank: at least its stage's share, and a TP rank's 1/tp of that.
    tp = cfg.tp if _TRAITS[cfg.method].tp_family else cfg.pp * cfg.tp
    bound = (_lower_bound(cfg, ctx.layout, ctx.params, ctx.trainable, ctx.workload) + CUDA_CONTEXT_BYTES
             + max(acts, 0) // tp)
    if cfg.pp > 1:
        bound += _receive_buffers_bound(ctx, cfg)
    return bound


def _receive_buffers_bound(ctx: _Context, cfg: _Config) -> int:
    """Bytes of receive buffers every pipeline rank holds through the step: torch's stage allocates one
    per microbatch at its first step and keeps them (``PipelineStage._prepare_forward_infra`` /
    ``_prepare_backward_infra``: ``args_recv_info`` on a non-first stage, ``grad_recv_info`` on a
    non-last one), each one microbatch's activations (one row of ``seq_len x hidden``, whole on every TP
    rank: the stages pass whole activations without sequence parallel) in the stages' dtype. Every rank
    of a pipeline of two or more holds at least one of the two kinds; the stage with the most parameters
    (:func:`_lower_bound`'s) holds them beside its own. At the configuration's fewest microbatches per
    schedule step (:func:`_pipeline_splits`)."""
    m = min(m for m, _ in _pipeline_splits(ctx, cfg))
    es = _activation_bytes(ctx.workload)
    return m * ctx.workload.seq_len * int(ctx.config.hidden_size) * es


def _time_bound(ctx: _Context, cfg: _Config, gc: bool, profiles: _Profiles) -> float:
    """A lower bound of the step time of every candidate of (cfg, gc) under
    the model, before tracing it: the compute (the same per GPU for every
    method: the global batch's FLOPs over the GPUs), the optimizer and
    offload terms (known from the model's size), and the gradient reduction
    every data-parallel rank must send (at least a reduce-scatter of its
    trainable shard in 16 bits) plus, for TP, the two all-reduces per
    block of Megatron-style TP in forward and again in backward, for
    methods that hide no communication."""
    t = _TRAITS[cfg.method]
    if cfg.pp > 1:  # compute, bubble and P2P; FSDP2's traffic counted as hidden; the smallest bubble
        return _pp_work(ctx, cfg, profiles, gc, 0.0, 0.0, max(_pipeline_splits(ctx, cfg)))[0].total_s
    dp = ctx.layout.num_gpus // cfg.tp
    per_rank = ctx.global_batch // dp
    flops = profiles.flops(1, gc).scaled(per_rank / cfg.tp)  # one micro-step of the whole share
    es = _activation_bytes(ctx.workload)
    elems = ctx.trainable // _shard(t.state_shard, ctx.layout, cfg.tp)
    pcie = 2 * es * elems if t.offload else 0
    if t.offload == "params":
        pcie += 2 * es * ctx.params // _shard("dp", ctx.layout, cfg.tp)
    comm_intra = comm_cross = 0.0
    if t.overlap is Overlap.NONE:
        grads = (dp - 1) / dp * 2 * ctx.trainable / cfg.tp
        if ctx.layout.num_nodes > 1:
            comm_cross = grads
        else:
            comm_intra = grads
        if t.tp_family:
            c = ctx.config
            layers = modelbuild.num_layers(c)
            tp_bytes = 4 * layers * per_rank * ctx.workload.seq_len * c.hidden_size * es
            comm_intra += (1.5 if gc else 1.0) * tp_bytes * 2 * (cfg.tp - 1) / cfg.tp
    work = StepWork(flops=flops, micro_steps=1, intra_only_bytes=round(comm_intra), cross_node_bytes=round(comm_cross),
                    overlap=Overlap.NONE, optimizer_elements=0 if t.offload else elems,
                    host_optimizer_elements=elems if t.offload else 0, pcie_bytes=pcie,
                    gpus_per_node=ctx.layout.gpus_per_node)
    return step_time(work, gpu=ctx.gpu, precision=ctx.workload.precision, optimizer=ctx.workload.optimizer,
                     network=ctx.network, efficiency=ctx.efficiency).total_s


def _quiet_worker() -> None:
    import torch

    torch.set_num_threads(1)


def _verify(ctx: _Context, c: Candidate) -> Candidate:
    """The candidate's memory from the method's full trace at exactly its
    configuration. The single-GPU step takes the whole accumulation window:
    its trace stops once a micro-step leaves the simulated allocator as it
    found it (``estimate._steady_trace``). The distributed methods trace
    every micro-step they are given and get at most 2: from the second on,
    every micro-step repeats the same allocations on the same live state
    (not checked against the allocator for them). Where a method's rules
    carry no state further than a layer (``synthesis_blocker``), its ranks'
    full event streams are built from two shortened runs and replayed: the
    full trace's figures, without tracing every layer (methods.synthesized)."""
    # A pipeline's microbatches are its schedule: all of them, in all its schedule steps (composed from
    # shorter runs, pp_compose).
    accum = c.grad_accum if c.method == "single" else min(c.grad_accum, 2)
    wl = dataclasses.replace(ctx.workload, micro_batch_size=c.micro_batch, grad_accum_steps=accum,
                             grad_checkpointing=c.grad_checkpointing)
    est = _registry_call(_Config(c.method, c.tp, c.pp), ctx.model, wl, ctx.layout, ctx.gpu, ctx.alloc_conf,
                         fast=False, split=(c.grad_accum, c.schedule_steps) if c.pp > 1 else None,
                         stream_synthesis=True)
    w = est.worst
    act_delta = 0.0
    host = est.host_total_bytes_per_node
    host_fits = not ctx.host_limit or host <= ctx.host_limit
    return dataclasses.replace(
        c, device_total_bytes=w.device_total_bytes, peak_allocated_bytes=w.peak_allocated_bytes,
        peak_reserved_bytes=w.peak_reserved_bytes, fits=w.device_total_bytes <= ctx.limit and w.fits and host_fits,
        verified=True, segments=_segments(est, w.peak_allocated_bytes, w.peak_reserved_bytes, act_delta),
        host_bytes_per_node=host, host_limit_bytes=ctx.host_limit, host_fits=host_fits,
    )


# ----------------------------------------------------------------------------- search


def _configs(ctx: _Context, methods: list[str] | None, tps: list[int] | None) -> tuple[list[_Config], list]:
    layout = ctx.layout
    skipped: list[tuple[str, str]] = []
    names = methods or default_methods()
    unknown = [m for m in names if m not in _TRAITS]
    if unknown:
        raise ConfigError(f"unknown method '{unknown[0]}'; valid: {', '.join(planner_methods())}. "
                          "HINT: pass --methods with names from this list")
    degrees = [d for d in range(2, layout.gpus_per_node + 1) if layout.gpus_per_node % d == 0]
    if tps is not None:
        degrees = [d for d in tps if d > 1]
    out: list[_Config] = []
    for name in names:
        t = _TRAITS[name]
        if name in _PP:
            out += _pp_configs(ctx, name, skipped, [1, *degrees] if tps is None else tps)
            continue
        if name == "single":
            if layout.num_gpus == 1:
                out.append(_Config(name, 1))
            continue
        if name == "hsdp" and layout.num_nodes == 1:
            skipped.append((name, "needs more than one node (it equals fsdp on one)"))
            continue
        if not t.tp_family:
            if layout.num_gpus == 1 and not t.offload:
                continue  # one GPU: `single` is the same step
            out.append(_Config(name, 1))
            continue
        for d in degrees:
            if name == "tp" and d != layout.num_gpus:
                continue
            if name != "tp" and d == layout.num_gpus:
                continue  # no data parallelism left: plain `tp` covers it
            try:
                Layout(num_gpus=layout.num_gpus, num_nodes=layout.num_nodes, tp=d).check_model(ctx.config)
            except ConfigError as e:
                skipped.append((f"{name} tp{d}", str(e).split(". HINT")[0]))
                continue
            out.append(_Config(name, d))
    return out, skipped


def _pp_configs(ctx: _Context, name: str, skipped: list[tuple[str, str]], tps: list[int]) -> list[_Config]:
    """Pipeline degrees for ``name``: every divisor of the GPU count from 2 whose stages each keep a decoder
    layer (``p * v`` stages over the model's layers), on a model the stages run; each with every degree of
    ``tps`` (1: none) that divides a node's GPUs and the model's heads and widths, and leaves ``p x tp``
    dividing the GPUs (FSDP2 over the rest)."""
    from llmem_plugin.methods.pp.stage import check_model

    try:
        check_model(ctx.config, ctx.workload.seq_len)
    except LLMemError as e:
        skipped.append((name, str(e).split(". HINT")[0]))
        return []
    _, v = _PP[name]
    layers = modelbuild.num_layers(ctx.config)
    layout = ctx.layout
    n = layout.num_gpus
    degrees = []
    for d in sorted(set(tps)):
        if d == 1:
            degrees.append(d)
            continue
        try:
            Layout(num_gpus=n, num_nodes=layout.num_nodes, tp=d).check_model(ctx.config)
        except ConfigError as e:
            skipped.append((f"{name} tp{d}", str(e).split(". HINT")[0]))
            continue
        degrees.append(d)
    return [_Config(name, d, p) for d in degrees for p in range(2, n // d + 1)
            if n % (p * d) == 0 and p * v <= layers]


def _why(choice: Candidate, runner: Candidate | None) -> str:
    if runner is None:
        return f"{choice.label()} is the only method that fits"
    a, b = choice.time, runner.time
    if b.total_s - a.total_s <= 1e-3 * a.total_s:
        return (f"{choice.label()} ties with {runner.label()} at {a.total_s:.3g} s per step (communication hidden "
                f"behind compute); it sends less ({a.comm_s:.3g} s vs {b.comm_s:.3g} s of link time)")
    parts = {"compute": (a.compute_s, b.compute_s), "exposed communication": (a.exposed_comm_s, b.exposed_comm_s),
             "optimizer step": (a.optimizer_s, b.optimizer_s), "offload": (a.offload_s, b.offload_s),
             "pipeline bubble": (a.bubble_s, b.bubble_s)}
    name, (x, y) = max(parts.items(), key=lambda kv: kv[1][1] - kv[1][0])
    return (f"{choice.label()} beats {runner.label()}: {a.total_s:.3g} s vs {b.total_s:.3g} s per step, "
            f"mostly {name} ({x:.3g} s vs {y:.3g} s)")


def plan(
    model: Any,
    *,
    gpu: GPU | str,
    num_gpus: int = 1,
    num_nodes: int = 1,
    workload: Workload | None = None,
    global_batch: int | None = None,
    margin: float = DEFAULT_MARGIN,
    methods: list[str] | None = None,
    tps: list[int] | None = None,
    micro_batch: int | None = None,
    grad_checkpointing: bool | None = None,
    gpu_memory: int | None = None,
    alloc_conf: Any = None,
    efficiency: float = DEFAULT_EFFICIENCY,
    inter_node_gbps: float | None = None,
    verify: bool = True,
    max_verify: int = 6,
    suggest: bool = True,
    prune: bool = True,
    host_memory: int | str | None = None,
    max_pipelines: int | None = DEFAULT_MAX_PIPELINES,
    progress: Callable[[str], None] | None = None,
    _profiles: dict | None = None,
) -> Plan:
    """Search the methods for ``model`` on ``num_gpus`` GPUs and pick the fastest that fits.

    Args:
        model: Catalog name, config path or ``PretrainedConfig``.
        gpu: Catalog GPU.
        num_gpus: GPUs over all nodes.
        num_nodes: Nodes.
        workload: Sequence length, precision, optimizer, LoRA (micro-batch,
            accumulation and checkpointing are searched unless pinned).
        global_batch: Sequences per optimizer step (default 8 per GPU).
        margin: Fraction of the capacity to keep free (default 5%).
        methods: Restrict to these planner methods (:func:`planner_methods`).
        tps: Restrict the tensor-parallel degrees.
        micro_batch: Pin the micro-batch.
        grad_checkpointing: Pin checkpointing (None: search both).
        gpu_memory: Override the GPU's capacity in bytes.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` to simulate.
        efficiency: Model FLOPs utilisation for the step-time model.
        inter_node_gbps: Network GB/s per GPU between nodes.
        verify: Trace the choice in full before returning it.
        max_verify: Candidates to trace in full before giving up.
        suggest: When nothing fits, search for changes that make it fit.
        prune: Skip tracing a (method, checkpointing) whose step-time lower
            bound cannot beat the fastest fitting candidate found so far;
            off, every candidate is screened (the full table).
        host_memory: Host RAM per node: bytes, a size string ("2TiB"),
            "local" (this machine's RAM), or None for the catalog's cloud
            instance with ``num_gpus / num_nodes`` of this GPU
            (:func:`llmem_plugin.device.host.resolve_host_memory`). A candidate
            whose host memory per node exceeds it less the margin does not fit.
        max_pipelines: Pipeline configurations (degrees) to trace at most, those with the best step-time
            bounds first; the rest are listed as skipped with that reason. A pipeline configuration's
            trace costs minutes on a large model (every rank's stages run under the schedule), the other
            methods' seconds. None (or ``prune=False``): all.
        progress: Called with one line (seconds since the start, then what the search traces next) before
            each batch of screening traces and each verification: a plan of a large model runs for minutes.

    Returns:
        The :class:`Plan`.

    Raises:
        WontFitError: Nothing fits; carries the plan (with suggestions).
        ConfigError: Bad input.
    """
    from llmem_plugin.estimate import _resolve_gpu

    t0 = time.perf_counter()

    def say(line: str) -> None:
        if progress is not None:
            progress(f"[{time.perf_counter() - t0:.0f} s] {line}")

    if not 0 <= margin < 1:
        raise ConfigError(f"margin must be in [0, 1), got {margin!r}. HINT: e.g. --margin 0.05 for 5%")
    if max_pipelines is not None and (isinstance(max_pipelines, bool) or not isinstance(max_pipelines, int)
                                      or max_pipelines < 0):
        raise ConfigError(f"max_pipelines must be a count of at least 0 (or None for all), got {max_pipelines!r}. "
                          "HINT: e.g. --max-pipelines 2")
    if efficiency <= 0 or efficiency > 1:
        raise ConfigError(f"efficiency must be in (0, 1], got {efficiency!r}. HINT: e.g. --efficiency 0.4")
    target = _resolve_gpu(gpu, gpu_memory)
    layout = Layout(num_gpus=num_gpus, num_nodes=num_nodes)
    wl = workload or Workload()
    if wl.reference_model and wl.loss is LossImpl.TRL_FUSED:
        raise UnsupportedError(DPO_NOT_SEARCHED)
    if global_batch is None:
        global_batch = DEFAULT_SEQUENCES_PER_GPU * num_gpus
    if global_batch <= 0:
        raise ConfigError(f"global batch must be a positive number of sequences, got {global_batch}")
    config = modelbuild.resolve_config(model)
    from llmem_plugin.models.tasks import require_causal_lm

    require_causal_lm(config, "llmem plan", wl.task)
    meta = modelbuild.build_model(config, wl, device="meta")
    params = sum(p.numel() for p in {id(p): p for p in meta.parameters()}.values())
    trainable = sum(p.numel() for p in {id(p): p for p in meta.parameters()}.values() if p.requires_grad)
    limit = int(target.capacity_bytes * (1 - margin))
    host_cap = resolve_host_memory(host_memory, gpu=target, gpus_per_node=layout.gpus_per_node)
    host_limit = int(host_cap.node_bytes * (1 - margin))
    ctx = _Context(model=model, config=config, workload=wl, layout=layout, gpu=target,
                   network=Network.for_gpu(target, inter_node_gbps=inter_node_gbps), global_batch=global_batch,
                   limit=limit, alloc_conf=alloc_conf, efficiency=efficiency, params=params, trainable=trainable,
                   host_limit=host_limit)
    cache = _profiles if _profiles is not None else {}
    pkey = (repr(config.to_dict()) if hasattr(config, "to_dict") else repr(config), wl, target.name)
    profiles = cache.setdefault(pkey, _Profiles(model, wl, target, alloc_conf))
    gcs = [grad_checkpointing] if grad_checkpointing is not None else [False, True]

    configs, skipped = _configs(ctx, methods, tps)
    if not configs:
        # Nothing to search: the reason is the layout, not the memory.
        raise ConfigError(_inapplicable_line(methods or default_methods(), layout, skipped))
    todo, host_needs = [], []
    for cfg in configs:
        lb = _lower_bound(cfg, layout, params, trainable, wl)
        host_lb = _host_lower_bound(cfg, layout, params, trainable, wl)
        if lb > limit:
            why = f"its parameter and optimizer-state shards alone take {lb / _GIB:.1f} GiB of the " \
                  f"{limit / _GIB:.1f} GiB limit"
            skipped.append((_cfg_label(cfg), why))
        elif host_lb > host_limit:
            skipped.append((_cfg_label(cfg), _host_why(host_lb, host_limit, host_cap)))
            host_needs.append(host_lb)
        else:
            todo.append(cfg)
    t_screen = time.perf_counter()
    search = _Search(ctx, profiles, gcs, micro_batch)
    if todo:  # nothing left to screen: the model's profile is not needed
        say("profiling the single-GPU step")
        search.profile()
    units, batch_errors = [], []
    for cfg in todo:
        try:
            _micro_batch_plan(ctx, cfg, micro_batch)
        except _BatchError as e:
            skipped.append((_cfg_label(cfg), str(e)))
            batch_errors.append(e)
            continue
        for g in gcs:
            need = _memory_bound(ctx, cfg, g, profiles)
            if need > limit:
                what = "states, context and the forward's saved tensors at micro-batch 1"
                if cfg.pp > 1:
                    fewest = min(m for m, _ in _pipeline_splits(ctx, cfg))
                    what = (f"states, context, the forward's saved tensors at micro-batch 1 and the receive "
                            f"buffers of {fewest} microbatches per schedule step")
                why = f"needs at least {need / _GIB:.1f} GiB ({what}) of the {limit / _GIB:.1f} GiB limit"
                skipped.append((_unit_label(cfg, g, gcs), why))
            else:
                units.append((cfg, g))
    if todo and len(batch_errors) == len(todo):
        first = batch_errors[0]
        raise ConfigError(f"{first}. HINT: " + (first.hint or "pass a --global-batch that is a multiple of the GPU "
                                                "count" + (" and a --micro-batch that divides it" if micro_batch
                                                           else "")))
    bound = {u: _time_bound(ctx, u[0], u[1], profiles) for u in units}
    units.sort(key=bound.__getitem__)
    pending = list(units)
    candidates: list[Candidate] = []
    rejected: set[int] = set()  # verified and found not to fit
    failed: dict[str, str] = {}

    def best_time() -> float:
        return min((c.step_time_s for c in candidates if c.fits and id(c) not in rejected), default=float("inf"))

    traced_pipelines: set[_Config] = set()
    done_beside: dict[tuple, tuple[Any, float]] = {}  # candidate key -> (verified candidate or error, seconds)

    def over_budget(u: tuple[_Config, bool]) -> bool:
        cfg = u[0]
        if cfg.pp == 1 or not prune or max_pipelines is None or cfg in traced_pipelines:
            return False
        return len(traced_pipelines) >= max_pipelines

    def screen() -> None:
        # Branch and bound: trace units in order of their time bound, while
        # one could still beat the fastest fitting candidate screened so far.
        while True:
            limit_s = best_time() if prune else float("inf")
            ready = [u for u in pending if bound[u] < limit_s * (1 - 1e-9)]
            for u in [u for u in ready if over_budget(u)]:
                pending.remove(u)
                ready.remove(u)
                skipped.append((_unit_label(u[0], u[1], gcs),
                                f"not traced: the plan traces the {max_pipelines} pipeline configuration(s) with the "
                                f"best step-time bounds (at least {bound[u]:.3g} s per step here)"))
            budget = max(max_pipelines - len(traced_pipelines), 0) if prune and max_pipelines is not None else None
            if budget is not None:  # a batch takes no more new pipeline configurations than the budget has left
                fresh = list(dict.fromkeys(u[0] for u in ready if u[0].pp > 1 and u[0] not in traced_pipelines))
                ready = [u for u in ready if u[0].pp == 1 or u[0] in traced_pipelines or u[0] in fresh[:budget]]
            if not ready:
                return
            batch = ready[: max(_cores(), 1)]
            beside = None
            if any(u[0].pp > 1 for u in batch) and _cores() > 1:
                # A pipeline configuration's screen runs for minutes at scale, the other units' for seconds:
                # the other cores take every ready unit meanwhile, then the verification of the fastest fitting
                # candidate screened so far (at full depth, the plan's other long trace), which the
                # verification below would otherwise run after the screen. Units that a candidate of this
                # batch would have pruned only add screened rows: the choice is the same.
                batch += [u for u in ready if u[0].pp == 1 and u not in batch]
                order()
                beside = next((c for c in candidates if c.fits and not c.verified and id(c) not in rejected
                               and c.key not in done_beside), None) if verify else None
            say("screening " + ", ".join(_unit_label(*u, gcs) for u in batch)
                + (" (a pipeline configuration: minutes on a large model)" if any(u[0].pp > 1 for u in batch) else "")
                + (f", and verifying {beside.label()} at full depth beside it" if beside is not None else ""))
            traced_pipelines.update(u[0] for u in batch if u[0].pp > 1)
            built, verified = search.expand(batch, beside)
            if beside is not None:
                done_beside[beside.key] = verified
            for u, out in built:
                pending.remove(u)
                if isinstance(out, LLMemError):
                    failed.setdefault(_cfg_label(u[0]), str(out).split(". HINT")[0])
                else:
                    candidates.extend(out)

    def order() -> None:
        # Fastest first; on a tie (the compute term dominates and the rest is
        # hidden), the one that communicates less, then the one with more headroom.
        candidates.sort(key=lambda c: (-round(c.tokens_per_s, 6), c.time.comm_s, c.device_total_bytes))

    screen()
    order()
    verify_s = beside_s = 0.0
    choice = None
    tried = 0
    while True:
        nxt = next((i for i, c in enumerate(candidates) if c.fits and id(c) not in rejected), None)
        if nxt is None:
            break
        c = candidates[nxt]
        if not verify or c.verified:  # a pipeline screened at full depth is verified by its screen
            choice = c
            break
        if tried >= max_verify:
            break
        tried += 1
        if c.key in done_beside:  # verified beside a pipeline's screen
            v, seconds = done_beside.pop(c.key)
            beside_s += seconds
        else:
            say(f"verifying {c.label()} at full depth")
            t = time.perf_counter()
            try:
                v = _verify(ctx, c)
            except LLMemError as e:
                v = e
            verify_s += time.perf_counter() - t
        if isinstance(v, LLMemError):
            failed.setdefault(c.label(), str(v).split(". HINT")[0])
            v = dataclasses.replace(c, fits=False, verified=True)
        candidates[nxt] = v
        if v.fits:
            choice = v
            break
        rejected.add(id(v))
        screen()  # units pruned against the rejected one may now be needed
        order()
    skipped += list(failed.items())
    if pending:
        floor = choice.step_time_s if choice is not None else best_time()
        for cfg, g in pending:
            skipped.append((_unit_label(cfg, g, gcs),
                            f"cannot beat {floor:.3g} s per step (at least {bound[(cfg, g)]:.3g} s under the model)"))
    runner = None
    if choice is not None:
        runner = next((c for c in candidates if c.fits and c is not choice
                       and (c.method, c.tp, c.pp) != (choice.method, choice.tp, choice.pp)), None)
    why = _why(choice, runner) if choice is not None else ""
    if choice is not None and pending:
        why += (f"; {len(pending)} other (method, checkpointing) pairs were not traced: under the model none can "
                f"beat it (their lower bounds start at {min(bound[u] for u in pending):.3g} s per step)")
    t_end = time.perf_counter()
    timings = {"screen": t_end - t_screen - verify_s, "verify": verify_s}
    if beside_s:  # worker seconds, inside the screen's wall time
        timings["verify_beside_screen"] = beside_s
    from llmem_plugin.estimate import _describe

    result = Plan(model=_describe(model), gpu=target, layout=layout, workload=wl, global_batch=global_batch,
                  capacity_bytes=target.capacity_bytes, margin=margin, candidates=candidates, choice=choice,
                  runner_up=runner, why=why, skipped=skipped, seconds=t_end - t0, timings=timings,
                  host_memory=host_cap,
                  host_refused_bytes=min([*host_needs, *(c.host_bytes_per_node for c in candidates
                                                          if not c.host_fits)], default=0))
    if choice is None:
        suggestions = []
        search_note = None
        if suggest:
            same = {"gpu": gpu, "gpu_memory": gpu_memory, "global_batch": global_batch, "margin": margin,
                    "methods": methods, "tps": tps, "micro_batch": micro_batch,
                    "grad_checkpointing": grad_checkpointing, "alloc_conf": alloc_conf, "efficiency": efficiency,
                    "inter_node_gbps": inter_node_gbps, "verify": verify, "max_verify": max_verify,
                    "host_memory": host_memory, "max_pipelines": max_pipelines}
            try:
                suggestions = _suggestions(model, result, same, cache)
            except Exception as e:  # noqa: BLE001 - the verdict stands without them (an adapter must still stop)
                first = (str(e).strip().splitlines() or [""])[0][:200]
                search_note = f"the search for changes that fit failed ({type(e).__name__}: {first})"
        result = dataclasses.replace(result, suggestions=suggestions, seconds=time.perf_counter() - t0,
                                     timings={**timings, "suggest": time.perf_counter() - t_end})
        raise WontFitError(_wont_fit_line(result, search_note) + _host_refusal(result), plan=result)
    return result


def _cfg_label(cfg: _Config) -> str:
    tp = f" tp{cfg.tp}" if cfg.tp > 1 else ""
    if cfg.pp > 1:
        return f"{_pipeline_label(cfg.method, cfg.pp)}{tp}"
    return f"{cfg.method}{tp}"


def _unit_label(cfg: _Config, gc: bool, gcs: list[bool]) -> str:
    """A (configuration, checkpointing) unit: with both searched, the
    checkpointing is named either way, so a skipped unit is never read as
    the whole method (which its other unit may win)."""
    if len(gcs) < 2:
        return _cfg_label(cfg)
    return _cfg_label(cfg) + (" +ckpt" if gc else " without ckpt")


# ----------------------------------------------------------------------------- host memory


def _host_lower_bound(cfg: _Config, layout: Layout, params: int, trainable: int, wl: Workload) -> int:
    """Host RAM a node needs at least for this kind of method: one process
    per GPU, each with its baseline (:func:`llmem_plugin.device.host.process_baseline_bytes`)
    and, for offload, its shard of the states every engine keeps on the
    host: 16-bit (fp32 when training in fp32) gradients and the least
    optimizer-state bytes (:func:`_state_bytes_per_element`), plus the
    parameter shard when parameters are offloaded too. The methods' own
    figures are larger (fp32 master weights, pinned rounding); this only
    screens out what cannot fit before tracing it."""
    from llmem_plugin.device.host import process_baseline_bytes

    t = _TRAITS[cfg.method]
    e = 4 if wl.precision is Precision.FP32 else 2
    per_rank = process_baseline_bytes()
    if t.offload:
        per_rank += trainable * (e + _state_bytes_per_element(wl)) // _shard(t.state_shard, layout, cfg.tp)
        if t.param_shard == "host":
            per_rank += params * e // _shard("dp", layout, cfg.tp)
    return per_rank * layout.gpus_per_node


def _host_why(need: int, host_limit: int, cap: HostCapacity) -> str:
    return (f"needs at least {need / _GIB:.1f} GiB of host RAM per node (offloaded states and one process per "
            f"GPU) of the {host_limit / _GIB:.1f} GiB host limit ({cap.node_bytes / _GIB:.0f} GiB: {cap.source})")


def _host_refusal(p: Plan) -> str:
    """The host-memory part of a won't-fit message: the smallest host need
    among the plans refused for it, the node's RAM, and the fixes."""
    if p.host_memory is None or not p.host_refused_bytes:
        return ""
    return (f"; host memory: the plans refused for it need at least {p.host_refused_bytes / _GIB:.1f} GiB of host RAM "
            f"per node, more than the {p.host_limit_bytes / _GIB:.1f} GiB limit ({p.host_memory.node_bytes / _GIB:.0f}"
            f" GiB per node: {p.host_memory.source}). HINT: give the node's RAM with --host-memory (e.g. "
            f"--host-memory 2TiB), spread the job over more nodes (--nodes), or use a method without offload")


def _wont_fit_line(p: Plan, search_note: str | None = None) -> str:
    head = (f"no method fits {p.model} on {p.layout.num_gpus} x {p.gpu.name} at seq {p.workload.seq_len} "
            f"within {p.limit_bytes / _GIB:.1f} GiB per GPU")
    close = p.closest(1)
    if close:
        c = close[0]
        head += (f"; closest: {c.label()} needs {c.device_total_bytes / _GIB:.1f} GiB "
                 f"(+{100 * (c.device_total_bytes / p.limit_bytes - 1):.0f}%)")
    unverified = sum(1 for c in p.candidates if c.fits and not c.verified)
    if unverified:
        traced = sum(1 for c in p.candidates if c.verified)
        head += (f"; {traced} candidates the screen put under the limit were traced and did not fit, "
                 f"{unverified} more were not traced (raise max_verify to try them)")
    if p.suggestions:
        head += "; to fit: " + "; ".join(s.change for s in p.suggestions)
    if search_note:
        head += f"; {search_note}"
    return head


def _inapplicable_line(names: list[str], layout: Layout, skipped: list[tuple[str, str]]) -> str:
    """Why none of ``names`` can run on ``layout`` (:func:`_configs` left none),
    one line with the values and the fix."""
    gpus = f"{layout.num_gpus} GPU{'s' if layout.num_gpus > 1 else ''}" + (
        f" on {layout.num_nodes} nodes" if layout.num_nodes > 1 else "")
    said = {label.split(" ")[0]: why for label, why in skipped}
    reasons = []
    for name in names:
        t = _TRAITS[name]
        if name in said:
            why = said[name]
        elif name == "single":
            why = f"runs on one GPU, not {layout.num_gpus}"
        elif name in _PP:
            why = (f"has no pipeline degree for {layout.num_gpus} GPU(s) (a divisor from 2 with at least one decoder "
                   "layer per stage)")
        elif layout.num_gpus == 1:
            why = ("needs at least 2 GPUs (on one GPU its step is the single-GPU step)" if not t.tp_family
                   else "needs at least 2 GPUs to split the layers over")
        else:
            why = (f"has no tensor-parallel degree for this layout (tp takes all {layout.num_gpus} GPUs within "
                   f"one node; dp-tp and fsdp-tp take a degree that divides a node's {layout.gpus_per_node} GPUs "
                   "and leaves data parallelism)")
        reasons.append(f"{name} {why}")
    offload = [m for m in planner_methods() if _TRAITS[m].offload]
    if layout.num_gpus == 1:
        hint = (f"pass --gpus 2 or more (num_gpus=), or --methods single (or an offload method: "
                f"{', '.join(offload)})")
    else:
        hint = "pass --methods with one that applies (e.g. ddp, fsdp), or --gpus 1 for single"
    return (f"no method of --methods {','.join(names)} applies to {gpus}: {'; '.join(reasons)}. HINT: {hint}")


def _suggestions(model: Any, failed: Plan, kw: dict[str, Any], cache: dict) -> list[Suggestion]:
    """Changes that make the job fit, each confirmed by re-planning with it."""
    out: list[Suggestion] = []
    wl, layout = failed.workload, failed.layout

    def attempt(change: str, **over: Any) -> bool:
        args = {**kw, **over}
        try:
            p = plan(model, num_gpus=args.pop("num_gpus", layout.num_gpus),
                     num_nodes=args.pop("num_nodes", layout.num_nodes), workload=args.pop("workload", wl),
                     suggest=False, _profiles=cache, **args)
        except WontFitError:
            return False
        except LLMemError:  # the change does not apply here (LoRA targets the model lacks, a method it refuses)
            return False
        except ImportError:  # a suggestion never needs an optional library: left out when it would
            return False
        out.append(Suggestion(change=change, choice=p.choice))
        return True

    # More GPUs, keeping the per-GPU batch: the smallest power-of-two multiple that fits.
    per_gpu = failed.global_batch / layout.num_gpus
    for factor in (2, 4, 8, 16, 32, 64):
        n = layout.num_gpus * factor
        if n > 4096:
            break
        per_node = min(max(layout.gpus_per_node, 1) * factor, _MAX_GPUS_PER_NODE) if layout.num_nodes == 1 \
            else layout.gpus_per_node
        nodes = max(n // per_node, 1)
        gb = max(int(per_gpu * n), n)
        if attempt(f"{n} GPUs ({nodes} node{'s' if nodes > 1 else ''})", num_gpus=n, num_nodes=nodes,
                   global_batch=gb):
            break
    if kw.get("methods"):
        offload = [m for m in planner_methods() if _TRAITS[m].offload]
        if not set(offload) & set(kw["methods"]):
            attempt("CPU offload (" + ", ".join(offload) + ")", methods=offload)
    if wl.lora is None:
        attempt("LoRA (rank 16 on q/k/v/o)", workload=dataclasses.replace(wl, lora=LoraSpec(rank=16)))
        if wl.optimizer in (OptimizerKind.ADAMW, OptimizerKind.ADAMW_FUSED, OptimizerKind.ADAMW_FORLOOP):
            attempt("8-bit AdamW (--optimizer adamw8bit)",
                    workload=dataclasses.replace(wl, optimizer=OptimizerKind.ADAMW_8BIT))
    elif wl.quantize is None:
        attempt("QLoRA (--quantize nf4 --double-quant)",
                workload=dataclasses.replace(wl, quantize=Quantization.NF4, double_quant=True))
    seq = wl.seq_len // 2
    while seq >= 128:
        if attempt(f"--seq-len {seq}", workload=dataclasses.replace(wl, seq_len=seq)):
            break
        seq //= 2
    if kw.get("micro_batch") not in (None, 1):
        attempt("--micro-batch 1", micro_batch=1)
    return out


def gpus_on_this_machine() -> tuple[str, int]:
    """(catalog GPU name, count) of the CUDA devices here.

    Raises:
        ConfigError: No CUDA device, or one the catalog does not know.
    """
    import torch

    from llmem_plugin.device.gpus import match_device_name

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ConfigError("no GPU found on this machine (torch.cuda.device_count() == 0). "
                          "HINT: pass --gpu NAME --gpus N to plan for the machine the job will run on")
    name = torch.cuda.get_device_name(0)
    gpu = match_device_name(name)
    if gpu is None:
        raise ConfigError(f"this machine's GPU '{name}' is not in the catalog. "
                          "HINT: pass --gpu with a similar one from `llmem gpus` and --gpu-memory")
    return gpu.name, n

