"""One pipeline rank's numbers: traced in full, composed from a stand-in's runs, or extrapolated from shorter stages.

:func:`trace_rank` runs a rank's stages under torch's schedule
(:func:`~llmem_plugin.methods.pp.stage.run_rank`) on fake tensors and the fake
process group, with tensor parallel and FSDP2 inside each stage as torchtitan
applies them. :func:`_composed_row` builds a rank's numbers from its stand-in's
two short runs (:mod:`llmem_plugin.methods.pp.compose`, their stages real or
synthesised by :mod:`llmem_plugin.methods.pp.synth`), and :func:`_extrapolated`
from two runs with every stage cut to one and to two decoder layers (fast mode).
:mod:`llmem_plugin.methods.pp.method` picks among them for each rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmem_plugin.models import modelbuild
from llmem_plugin.device.allocator_config import SMALL_BUFFER, AllocatorConfig
from llmem_plugin.errors import tracing
from llmem_plugin.device.gpus import GPU
from llmem_plugin.methods.base import RankMemory, rank_memory
from llmem_plugin.methods.pp.compose import (
    VirtualPipeline,
    compose_templates,
    cut,
    cut_templates,
    stand_in_stages,
    templates,
    traced_accumulation,
)
from llmem_plugin.methods.pp.schedule import SPLIT_BACKWARD
from llmem_plugin.methods.pp.stage import DecoderStage, StageSpec, action_segments, run_rank, stage_modules
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, TraceResult
from llmem_plugin.workload import Workload

__all__ = ["pipeline_mesh", "segment_peaks", "shard_stage", "stage_tp_plan", "trace_rank"]


def shard_stage(module: nn.Module, mesh: Any, param_dtype: torch.dtype | None) -> None:
    """``fully_shard`` one stage as torchtitan's ``apply_fsdp`` does under pipeline parallelism
    (torchtitan/models/llama3/infra/parallelize.py): the embedding, each decoder layer, then the norm and head
    as one group, then the stage root, all with ``reshard_after_forward=False`` (its "default" policy is
    ``not pp_enabled``: no all-gather per microbatch), gathering in ``param_dtype`` and reducing in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    if module.embed_tokens is not None:
        fully_shard(module.embed_tokens, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    for layer in module.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    if module.lm_head is not None:
        fully_shard([module.norm, module.lm_head], mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp)


def pipeline_mesh(pipeline_degree: int, dp_shard: int, tp: int = 1) -> Any:
    """torchtitan's mesh order (torchtitan/distributed/parallel_dims.py: pp, dp_shard, tp), pipeline outermost
    and tensor parallel innermost: global rank = (pipeline rank x dp_shard + shard rank) x tp + TP rank."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp == 1:
        return init_device_mesh("cpu", (pipeline_degree, dp_shard), mesh_dim_names=("pp", "dp_shard"))
    return init_device_mesh("cpu", (pipeline_degree, dp_shard, tp), mesh_dim_names=("pp", "dp_shard", "tp"))


def stage_tp_plan(module: nn.Module, config: Any) -> dict[str, Any]:
    """:func:`llmem_plugin.methods.tp.tp_plan` (torchtitan's ``apply_tp`` layout, no sequence parallel) named
    for one :class:`DecoderStage`, keeping the entries of the modules the stage holds: its decoder layers'
    projections, and the embedding or the norm and head on the first or last stage. The stage's input and
    output stay whole local tensors (the embedding's and the row-wise projections' outputs are all-reduced,
    the head's logits gathered), so the schedule passes every TP rank the same ``b x s x h`` activations."""
    from llmem_plugin.methods.tp import tp_plan

    plan = {}
    for key, style in tp_plan(config, sequence_parallel=False).items():
        name = key.removeprefix("model.")
        if getattr(module, name.split(".")[0], None) is not None:
            plan[name] = style
    return plan


def trace_rank(model: Any, workload: Workload, specs: list[StageSpec], *, rank: int, pipeline_degree: int,
               schedule: str, microbatches: int, gpu: GPU, fake: bool = True, group: Any = None,
               return_outputs: bool = True, dp_shard: int = 1, tp: int = 1, mesh: Any = None,
               prepare: Any = None, streams: dict[int, int] | None = None,
               segments: list[tuple[str, int]] | None = None, accumulation: int = 1) -> TraceResult:
    """Trace global ``rank``'s two training steps of its ``specs`` stages (each of ``accumulation``
    schedule steps, :func:`~llmem_plugin.methods.pp.stage.run_rank`): on fake tensors under the fake
    process group, or (``fake=False``, inside a real process group) on the real model ``model``, which the
    ground-truth runs use.

    Args:
        dp_shard: FSDP2 degree inside each stage (1: none).
        tp: Tensor-parallel degree inside each stage (:func:`stage_tp_plan`, applied before FSDP2 as
            torchtitan's ``parallelize_llama`` does); the pipeline rank is ``rank // (dp_shard * tp)``.
        group: The real run's pipeline group (``fake=False``, ``dp_shard`` and ``tp`` 1).
        mesh: The real run's :func:`pipeline_mesh` (``fake=False``, ``dp_shard`` or ``tp`` > 1).
        prepare: Called with the stage modules once sharded (the real run's gloo collectives).
        streams: Filled with the side stream of each allocation FSDP2 makes off the default stream (its
            all-gather and reduce-scatter streams), by trace record index, for :func:`rank_memory`.
        segments: Filled with (action, position in the trace's ``events`` where it starts): every compute
            action ("F:stage:microbatch:n", "B:...", "I:...", "W:...", n the schedule step's number) and
            what runs after it until the next one ("after-F:...": P2P, the loss, the end of the schedule's
            step), each schedule step's start ("step:n") and each optimizer step ("optimizer:iteration").
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem_plugin.methods._fakepg import fake_process_group

    options = dict(specs=specs, schedule=schedule, microbatches=microbatches, gpu=gpu, group=group,
                   return_outputs=return_outputs, dp_shard=dp_shard, tp=tp, prepare=prepare, streams=streams,
                   segments=segments, accumulation=accumulation)
    if not fake:
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        return _trace_stages(inner, workload, fake_mode=None, mesh=mesh, **options)
    distributed = dp_shard > 1 or tp > 1  # DTensor parameters
    with fake_process_group(world_size=pipeline_degree * dp_shard * tp, rank=rank):
        fake_mesh = pipeline_mesh(pipeline_degree, dp_shard, tp) if distributed else None
        built = modelbuild.build_model(model, workload, device="meta")
        fake_mode = FakeTensorMode()
        if not distributed:
            modelbuild.fakeify(built, fake_mode)
        inner = built.get_base_model() if hasattr(built, "get_base_model") else built
        with tracing(f"pipeline rank {rank} of {type(inner).__name__} ({schedule})"):
            return _trace_stages(inner, workload, fake_mode=fake_mode, mesh=fake_mesh, **options)


def _trace_stages(inner: nn.Module, workload: Workload, *, specs: list[StageSpec], fake_mode: Any, mesh: Any,
                  group: Any, schedule: str, microbatches: int, gpu: GPU, return_outputs: bool, dp_shard: int,
                  tp: int, prepare: Any, streams: dict[int, int] | None, segments: list[tuple[str, int]] | None,
                  accumulation: int) -> TraceResult:
    """:func:`trace_rank`'s run on the built model ``inner`` (fake tensors under ``fake_mode``, or real ones
    when None): its stages wrapped (:func:`_distributed_stages`), then run under a tracker and the CUDA
    emulation, with ``streams`` and ``segments`` filled as :func:`trace_rank` says."""
    from llmem_plugin.methods._rank_tracker import RankTracker
    from llmem_plugin.trace.emulation import cuda_emulation
    from llmem_plugin.trace.step import make_optimizer

    distributed = dp_shard > 1 or tp > 1  # DTensor parameters
    tracker = RankTracker(fake_mode) if distributed else MemoryTracker()
    contexts = [cuda_emulation(autocast_dtype=None, compute_capability=gpu.compute_capability,
                               num_sms=gpu.num_sms, mark=tracker.mark)]
    modules = None
    extra: dict[str, Any] = {}
    if distributed:
        modules, more, extra = _distributed_stages(inner, workload, specs, tracker, fake_mode=fake_mode, mesh=mesh,
                                                   dp_shard=dp_shard, tp=tp, prepare=prepare)
        contexts += more
    on_action, segments_of = action_segments(tracker)
    pp_group = mesh["pp"].get_group() if distributed else group
    result = run_rank(inner, specs, schedule=schedule, microbatches=microbatches,
                      micro_batch_size=workload.micro_batch_size, seq_len=workload.seq_len,
                      optimizer=lambda ps: make_optimizer(ps, workload.optimizer), tracker=tracker,
                      contexts=tuple(contexts), return_outputs=return_outputs, group=pp_group,
                      fake_mode=fake_mode, modules=modules, on_action=on_action, accumulation=accumulation,
                      **extra)
    if distributed and streams is not None:
        streams.update(tracker.stream_of)
    if segments is not None:
        segments.extend(segments_of(result))
    return result


def _distributed_stages(inner: nn.Module, workload: Workload, specs: list[StageSpec], tracker: Any, *,
                        fake_mode: Any, mesh: Any, dp_shard: int, tp: int, prepare: Any
                        ) -> tuple[list[DecoderStage], list[Any], dict[str, Any]]:
    """The rank's stages with DTensor parameters, as torchtitan's ``parallelize_llama`` applies them: tensor
    parallel (:func:`stage_tp_plan`) over ``mesh["tp"]``, then FSDP2 (:func:`shard_stage`) over
    ``mesh["dp_shard"]``; with the contexts their run needs and :func:`~llmem_plugin.methods.pp.stage.run_rank`'s
    extra arguments (the local-shard optimizer step on fake tensors, FSDP2's activation dtype)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from llmem_plugin.methods._fakepg import isolated_sharding_propagation
    from llmem_plugin.methods._local_step import LocalShardStep
    from llmem_plugin.methods.fsdp import _materialize, _param_dtype, fsdp_instrumented
    from llmem_plugin.methods.tp import _no_view_warnings, fakeify_sharded

    sharded = dp_shard > 1
    param_dtype = _param_dtype(workload, None) if sharded else None
    extra: dict[str, Any] = {}
    modules = stage_modules(inner, specs)
    if tp > 1:
        embed, head = inner.get_input_embeddings(), inner.get_output_embeddings()
        tied = head is not None and head.weight is embed.weight
        for m in modules:
            parallelize_module(m, mesh["tp"], stage_tp_plan(m, inner.config))
        firsts = [m.embed_tokens for m in modules if m.embed_tokens is not None]
        lasts = [m.lm_head for m in modules if m.lm_head is not None]
        if tied and firsts and lasts:
            # A V schedule's rank holds both ends: each style replaced its own module's weight, both
            # Shard(0) on the vocabulary, so one DTensor serves both again (as methods/tp.py ties).
            lasts[0].weight = firsts[0].weight
    if sharded:
        for m in modules:
            shard_stage(m, mesh["dp_shard"], param_dtype)
    if fake_mode is not None:
        if sharded:
            for m in modules:
                _materialize(m, fake_mode)
        else:  # one pass over the rank's stages: the rotary module they share stays one
            fakeify_sharded(nn.ModuleList(modules), fake_mode)
        extra["step"] = LocalShardStep()
    if sharded:
        for m in modules:
            m._get_fsdp_state()._lazy_init()  # as fsdp's trace: the root's re-padding is no step's
    if prepare is not None:
        prepare(modules)
    contexts = [isolated_sharding_propagation(), _no_view_warnings()]
    if sharded:
        contexts.append(fsdp_instrumented(tracker, cpu_offload=False))
        extra["activation_dtype"] = param_dtype
    return modules, contexts, extra


def _shortened(specs: list[StageSpec], depths: list[int]) -> list[StageSpec]:
    """The same stages cut to their first ``depths`` decoder layers."""
    return [StageSpec(sp.index, sp.num_stages, sp.start, sp.start + d) for sp, d in zip(specs, depths)]


def segment_peaks(trace: TraceResult, segments: list[tuple[str, int]]) -> dict[str, int]:
    """Highest tensor bytes live within each segment of ``trace`` (from its start to the next one's)."""
    bounds = [pos for _, pos in segments] + [len(trace.events)]
    live, out = 0, {}
    for sign, _, n in trace.events[:bounds[0]]:
        live += sign * n
    for k, (name, start) in enumerate(segments):
        peak = live
        for sign, _, n in trace.events[start:bounds[k + 1]]:
            live += sign * n
            peak = max(peak, live)
        out[name] = max(out.get(name, 0), peak)
    return out


def _whole(peaks: dict[str, int]) -> dict[str, int]:
    """Segment peaks merged back to whole actions."""
    out: dict[str, int] = {}
    for name, v in peaks.items():
        key = name.split("|")[0]
        out[key] = max(out.get(key, 0), v)
    return out


def _extrapolated(one: tuple[RankMemory, dict[str, int]], two: tuple[RankMemory, dict[str, int]], depth: int,
                  capacity_bytes: int) -> RankMemory | None:
    """A rank's numbers with its stages at ``depth`` decoder layers each, from traces with every stage at one
    layer and at two (each with its :func:`segment_peaks`): each quantity affine in the depth.

    The tensor peak is extrapolated segment by segment (each forward, each backward, what runs between
    them, the step start and the optimizer step) and the largest wins: which segment holds the peak moves
    with depth (a last stage's merged logits dominate shallow runs, its activations deep ones). The allocated peak adds the deeper
    run's allocator overhead over its tensor peak (workspaces, which do not depend on depth), and is never
    below the phase-by-phase extrapolation. The reserved peak is not affine in depth (which cached block a
    request reuses depends on the whole stream); it takes the larger reserved/allocated ratio of the two runs.
    None where the two runs' actions differ (then the rank is traced in full).
    """
    (r1, s1), (r2, s2) = one, two
    if s1.keys() != s2.keys():  # the parts ran in another order at two layers: compare whole actions
        s1, s2 = (_whole(s) for s in (s1, s2))
    if s1.keys() != s2.keys():
        return None

    def affine(a: int, b: int) -> int:
        return a + (b - a) * (depth - 1)

    tensor = max(affine(s1[k], s2[k]) for k in s1)
    phases = set(r1.phase_allocated) | set(r2.phase_allocated)
    phase_allocated = {ph: affine(r1.phase_allocated.get(ph, 0), r2.phase_allocated.get(ph, 0)) for ph in phases}
    allocated = max([tensor + r2.peak_allocated_bytes - r2.peak_tensor_bytes, *phase_allocated.values()])
    ratio = max(r.peak_reserved_bytes / max(r.peak_allocated_bytes, 1) for r in (r1, r2))
    reserved = max(round(allocated * ratio), allocated)
    outside = r1.device_total_bytes - r1.peak_reserved_bytes  # context, NCCL: independent of depth
    cats = set(r1.breakdown) | set(r2.breakdown)
    return RankMemory(
        rank=r1.rank,
        peak_tensor_bytes=tensor,
        peak_allocated_bytes=allocated,
        peak_reserved_bytes=reserved,
        device_total_bytes=reserved + outside,
        fits=reserved + outside <= capacity_bytes,
        breakdown={c: affine(r1.breakdown.get(c, 0), r2.breakdown.get(c, 0)) for c in cats},
        host_bytes=affine(r1.host_bytes, r2.host_bytes),
        host_overheads=dict(r1.host_overheads),
        phase_allocated=phase_allocated,
    )


def _composed_row(model: Any, wl: Workload, specs: list[StageSpec], virtual: VirtualPipeline, *, rank: int,
                  pipeline_degree: int, schedule: str, microbatches: int, stages_per_rank: int, dp: int, gpu: GPU,
                  return_outputs: bool, overheads: Any, alloc_conf: AllocatorConfig, cache: dict | None = None,
                  tp: int = 1, base: Any = None, accumulation: int = 1, stand_in_steps: int | None = None,
                  placeholders: bool = True) -> tuple[RankMemory, dict[str, int], bool] | None:
    """Global ``rank``'s numbers composed from its stand-in's two runs (``virtual``), with its segment peaks
    named as a full trace names them and whether the runs were synthesised; None where the composition does
    not apply (then trace in full).

    The stand-in's runs are synthesised (:mod:`llmem_plugin.methods.pp.synth`: placeholder stages through
    the stand-in's schedule, the real stages' compute from one small real run of the rank's kind) where
    that applies and ``placeholders``; else traced with the real stages.

    The tensor peak is the composition's. The allocated peak adds the real run's allocator overhead over
    its tensor peak (cuBLAS workspaces, rounding). The reserved peak is the real run's plus the segments
    the extra bytes need (an approximation: the allocator's replay of the composed stream is not run; the
    rank holding the last stage with ``return_outputs`` is not composed, see
    :func:`~llmem_plugin.methods.pp.method.estimate`)."""
    p, v, m = pipeline_degree, stages_per_rank, microbatches
    inner = dp * tp  # ranks per pipeline rank
    tokens = wl.micro_batch_size * wl.seq_len
    # One microbatch's bytes in the int64 ids and targets, and in the logits (2- or 4-byte elements: a multiple
    # of 512 at 2 bytes is one at 4).
    unit_bytes = (tokens * 8, tokens * int(base.config.vocab_size) * 2)
    traced = stand_in_steps if stand_in_steps is not None else traced_accumulation(accumulation)
    cache = cache if cache is not None else {}
    kw = dict(wl=wl, schedule=schedule, v=v, dp=dp, tp=tp, gpu=gpu, return_outputs=return_outputs, traced=traced,
              overheads=overheads, alloc_conf=alloc_conf, rank=rank, cache=cache)
    # The split-backward schedules' input and weight gradients hold other buffers between them in the real
    # stages than in placeholders (seen as their real runs' own templates differing from the placeholders'):
    # their stand-ins run the real stages.
    synthesise = placeholders and schedule not in SPLIT_BACKWARD
    got = _synthesised_runs(model, base, specs, virtual, p=p, m=m, **kw) if synthesise else None
    synthesised = got is not None
    runs, mem = got if synthesised else _stand_in_runs(model, specs, virtual, p=p, **kw)
    numbers = _composed_numbers(runs, mem, virtual, schedule, p, m, v, rank, inner, gpu, alloc_conf, overheads,
                                unit_bytes, return_outputs, accumulation, traced)
    return (*numbers, synthesised) if numbers is not None else None


def _layer_key(wl: Workload, specs: list[StageSpec]) -> tuple:
    """What of a rank's stages a run depends on besides their kinds: their depths, and their layers'
    positions where a checkpointing pattern goes by layer index."""
    return (tuple(sp.stop - sp.start for sp in specs),
            tuple((sp.start, sp.stop) for sp in specs) if wl.checkpoint_every != 1 else ())


def _stand_in_runs(model: Any, specs: list[StageSpec], virtual: VirtualPipeline, *, wl: Workload, schedule: str,
                   p: int, v: int, dp: int, tp: int, gpu: GPU, return_outputs: bool, traced: int, overheads: Any,
                   alloc_conf: AllocatorConfig, rank: int, cache: dict) -> tuple[list, RankMemory]:
    """The stand-in's two runs with the real stages, cut (:func:`~llmem_plugin.methods.pp.compose.cut_templates`),
    and the longer one's numbers; kept in ``cache`` for the ranks with the same stand-in."""
    inner = dp * tp
    to = stand_in_stages(schedule, p, rank // inner, v, virtual)
    vspecs = [StageSpec(to[sp.index], virtual.degree * v, sp.start, sp.stop) for sp in specs]
    # Ranks with one stand-in and stages of the same depths share its runs (decoder layers of one kind).
    key = ("stand-in", virtual, rank % inner, tuple(vs.index for vs in vspecs), _layer_key(wl, vspecs), traced)
    if key not in cache:
        traces, mem = [], None
        for mx in dict.fromkeys(virtual.microbatches):  # one run where the rank stands in for itself
            streams: dict[int, int] = {}
            segments: list[tuple[str, int]] = []
            trace = trace_rank(model, wl, vspecs, rank=virtual.rank * inner + rank % inner,
                               pipeline_degree=virtual.degree, schedule=schedule, microbatches=mx, gpu=gpu,
                               return_outputs=return_outputs, dp_shard=dp, tp=tp, streams=streams,
                               segments=segments, accumulation=traced)
            traces.append((trace.events, segments))
            mem = rank_memory(trace, rank=rank, gpu=gpu, overheads=overheads, alloc_conf=alloc_conf, streams=streams)
        cache[key] = (cut_templates(traces + traces[-1:] * (2 - len(traces)), virtual, schedule, v), mem)
    return cache[key]


def _synthesised_runs(model: Any, base: Any, specs: list[StageSpec], virtual: VirtualPipeline, *, wl: Workload,
                      schedule: str, p: int, m: int, v: int, dp: int, tp: int, gpu: GPU, return_outputs: bool,
                      traced: int, overheads: Any, alloc_conf: AllocatorConfig, rank: int, cache: dict
                      ) -> tuple[list, RankMemory] | None:
    """The stand-in's two runs synthesised (:func:`~llmem_plugin.methods.pp.synth.synthesise`) from its
    placeholder runs and the real run of the rank's kind (:func:`~llmem_plugin.methods.pp.synth.class_pipeline`),
    with the real run's numbers; None where that does not apply. Each run is kept in ``cache``: the
    placeholder runs serve every depth, the real run every rank of its kind."""
    from llmem_plugin.methods.fsdp import _param_dtype
    from llmem_plugin.methods.pp.compose import _mapped
    from llmem_plugin.methods.pp.synth import RealRun, class_pipeline, synthesise, trace_placeholder_rank

    inner = dp * tp
    pp_rank = rank // inner
    real_vp = class_pipeline(schedule, p, m, v, pp_rank)
    if real_vp is None:
        return None
    # What the stages pass each other (trace_rank): FSDP2's param_dtype under mixed precision, else the weights'.
    dtype = (_param_dtype(wl, None) if dp > 1 else None) or next(
        q for q in base.parameters() if q.is_floating_point()).dtype

    def placeholder(vp: VirtualPipeline, mx: int, vspecs: list[StageSpec]) -> dict | None:
        key = ("placeholder", vp.degree, vp.rank, mx, tuple(vs.index for vs in vspecs), traced, dtype)
        if key not in cache:
            events, segments = trace_placeholder_rank(
                base.config, base.loss_function, vspecs, rank=vp.rank, pipeline_degree=vp.degree, schedule=schedule,
                microbatches=mx, micro_batch_size=wl.micro_batch_size, seq_len=wl.seq_len, dtype=dtype, gpu=gpu,
                return_outputs=return_outputs, accumulation=traced)
            cache[key] = templates(cut(events, segments), schedule, vp.degree, mx, v, vp.rank)
        return cache[key]

    to_real = _mapped(schedule, p, pp_rank, v, real_vp.degree, real_vp.rank)
    rspecs = [StageSpec(to_real[sp.index], real_vp.degree * v, sp.start, sp.stop) for sp in specs]
    c = real_vp.microbatches[0]
    key = ("real", real_vp, rank % inner, _layer_key(wl, rspecs), traced)
    if key not in cache:
        streams: dict[int, int] = {}
        segments: list[tuple[str, int]] = []
        trace = trace_rank(model, wl, rspecs, rank=real_vp.rank * inner + rank % inner, pipeline_degree=real_vp.degree,
                           schedule=schedule, microbatches=c, gpu=gpu, return_outputs=return_outputs, dp_shard=dp,
                           tp=tp, streams=streams, segments=segments, accumulation=traced)
        run = cut(trace.events, segments)
        tpl = templates(run, schedule, real_vp.degree, c, v, real_vp.rank)
        twin = placeholder(real_vp, c, rspecs)
        mem = rank_memory(trace, rank=rank, gpu=gpu, overheads=overheads, alloc_conf=alloc_conf, streams=streams)
        positions = {s.index: i for i, s in enumerate(rspecs)}
        cache[key] = (RealRun(run.start, tpl, twin, positions) if tpl is not None and twin is not None else None, mem)
    real, mem = cache[key]
    if real is None:
        return None
    to = stand_in_stages(schedule, p, pp_rank, v, virtual)
    vspecs = [StageSpec(to[sp.index], virtual.degree * v, sp.start, sp.stop) for sp in specs]
    stand_ins = [placeholder(virtual, mx, vspecs) for mx in virtual.microbatches]
    if any(t is None for t in stand_ins):
        return None
    runs = synthesise(real, stand_ins, {vs.index: i for i, vs in enumerate(vspecs)})
    return (runs, mem) if runs is not None else None


def _composed_numbers(runs: list, longer: RankMemory, virtual: VirtualPipeline, schedule: str, p: int,
                      m: int, v: int, rank: int, inner: int, gpu: GPU, alloc_conf: AllocatorConfig, overheads: Any,
                      unit_bytes: tuple[int, int] = (0, 0), return_outputs: bool = True, accumulation: int = 1,
                      traced_steps: int | None = None) -> tuple[RankMemory, dict[str, int]] | None:
    comp = compose_templates(runs, virtual, schedule, p, m, v, rank // inner, input_bytes=unit_bytes[0],
                             output_bytes=unit_bytes[1], return_outputs=return_outputs, accumulation=accumulation,
                             traced_steps=traced_steps)
    if comp is None:
        return None
    overhead = longer.peak_allocated_bytes - longer.peak_tensor_bytes
    allocated = comp.peak + overhead
    # The bytes the longer run did not hold need new segments: as many whole large-pool segments as that
    # growth takes at the run's own reserved/allocated ratio, and one more in each pool that the allocator
    # may open and leave partly used (CUDACachingAllocator.cpp: requests up to 1 MiB from 2 MiB small
    # segments, kSmallBuffer; larger ones from 20 MiB segments, kLargeBuffer, or their own rounded to 2 MiB).
    growth = max(allocated - longer.peak_allocated_bytes, 0)
    reserved = longer.peak_reserved_bytes
    if growth:
        ratio = longer.peak_reserved_bytes / max(longer.peak_allocated_bytes, 1)
        large = alloc_conf.large_segment_bytes
        reserved += (math.ceil(growth * ratio / large) + 1) * large + SMALL_BUFFER
    outside = overheads.outside_allocator_bytes  # this rank's communicators, not the stand-in's
    breakdown = dict(longer.breakdown)
    # The composition adds microbatches in flight and per-microbatch buffers over the longer run's peak.
    breakdown[MemoryCategory.ACTIVATION.value] = breakdown.get(MemoryCategory.ACTIVATION.value, 0) + max(
        comp.peak - longer.peak_tensor_bytes, 0)
    return RankMemory(
        rank=rank, peak_tensor_bytes=comp.peak, peak_allocated_bytes=allocated, peak_reserved_bytes=reserved,
        device_total_bytes=reserved + outside, fits=reserved + outside <= gpu.capacity_bytes, breakdown=breakdown,
        host_bytes=longer.host_bytes, host_overheads=dict(longer.host_overheads),
        phase_allocated={ph: v_ + overhead for ph, v_ in comp.phase_peaks.items()},
    ), comp.segment_peaks
