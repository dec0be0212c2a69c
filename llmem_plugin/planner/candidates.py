"""The planner's types: the methods' traits, a configuration, a candidate, the plan, and the search's state.

Each step of :func:`llmem_plugin.planner.search.plan` takes and gives these. A configuration
(:class:`_Config`: a planner method, its tensor-parallel and pipeline degrees) with a checkpointing setting is
a *unit*: the traces of the screen are run per unit, and each unit gives its candidates (one per micro-batch,
or per pipeline split). :class:`_Context` is what every step reads (the model, the cluster, the limits);
:class:`_Options` how the search runs; :class:`_Run` what it has found so far.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmem_plugin.device.gpus import GPU
from llmem_plugin.device.host import HostCapacity
from llmem_plugin.methods import Layout, MethodEstimate, estimate_method
from llmem_plugin.planner.cost import Network, Overlap, StepTime
from llmem_plugin.trace.tracker import MemoryCategory
from llmem_plugin.workload import Precision, Workload

__all__ = ["Candidate", "Plan", "Suggestion", "default_methods", "planner_methods", "rank_segments"]

_GIB = 2**30


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
        fixed_bytes: Device bytes every candidate holds whatever its method
            (:func:`llmem_plugin.planner.bounds.fixed_bytes`: the CUDA context,
            a cuBLAS workspace, NCCL's buffers); over the limit, no change
            of the job can fit.
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
    fixed_bytes: int = 0

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
            "fixed_bytes": self.fixed_bytes,
        }


# ----------------------------------------------------------------------------- the steps' inputs and state


@dataclass(frozen=True)
class _Config:
    method: str
    tp: int
    pp: int = 1


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


@dataclass(frozen=True, kw_only=True)
class _Options:
    """How the search runs: the arguments of :func:`~llmem_plugin.planner.search.plan` that steer it.

    Attributes:
        gcs: The checkpointing settings searched (``[False, True]``, or the pinned one).
        micro_batch: The pinned micro-batch (None: searched).
        prune: Skip units whose step-time bound cannot beat the fastest fitting candidate so far.
        max_pipelines: Pipeline configurations traced at most (None: all).
        verify: Trace the choice in full before returning it.
        max_verify: Candidates traced in full before giving up.
        progress: Told what the search traces next (None: nothing is said).
        t0: When the plan started (``time.perf_counter()``), for the seconds in each progress line.
    """

    gcs: list[bool]
    micro_batch: int | None
    prune: bool
    max_pipelines: int | None
    verify: bool
    max_verify: int
    progress: Callable[[str], None] | None = None
    t0: float = 0.0

    def say(self, line: str) -> None:
        """Tell ``progress`` what runs next, after the seconds since the start."""
        if self.progress is not None:
            self.progress(f"[{time.perf_counter() - self.t0:.0f} s] {line}")


@dataclass(kw_only=True)
class _Run:
    """What the search has found so far; the bound, screen and verify steps add to it in place.

    Attributes:
        skipped: (label, reason) of each configuration or unit not searched or not traced, in the order found.
        host_needs: The least host RAM per node of each configuration refused for it before any trace.
        pending: Units (configuration, checkpointing) not screened yet, in order of their time bound.
        bound: Each unit's step-time lower bound.
        candidates: The screened candidates (verified ones replace theirs), fastest first once ordered.
        rejected: ``id`` of each candidate verified and found not to fit.
        failed: Label -> first line of the error of each unit or candidate whose trace failed.
        traced_pipelines: The pipeline configurations screened so far (against ``max_pipelines``).
        done_beside: Candidate key -> (verified candidate or error, worker seconds), for candidates verified
            beside a pipeline's screen.
        verify_s: Seconds of verification in this process.
        beside_s: Worker seconds of the verifications beside a pipeline's screen.
    """

    skipped: list[tuple[str, str]] = field(default_factory=list)
    host_needs: list[int] = field(default_factory=list)
    pending: list[tuple[_Config, bool]] = field(default_factory=list)
    bound: dict[tuple[_Config, bool], float] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)
    rejected: set[int] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)
    traced_pipelines: set[_Config] = field(default_factory=set)
    done_beside: dict[tuple, tuple[Any, float]] = field(default_factory=dict)
    verify_s: float = 0.0
    beside_s: float = 0.0


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


# ----------------------------------------------------------------------------- shards, dtypes, runs


def _shard(kind: str, layout: Layout, tp: int) -> int:
    dp = layout.num_gpus // tp
    return {"none": 1, "dp": dp, "node": min(layout.gpus_per_node // tp, dp)}[kind] * tp


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


# ----------------------------------------------------------------------------- the plan picture's segments


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
