"""``pp``: pipeline parallelism with torch's ``torch.distributed.pipelining``, every rank traced.

Each rank runs its stages (:class:`~llmem_plugin.methods.pp.stage.DecoderStage`)
under torch 2.13's own ``PipelineStage`` and schedule, on fake tensors and the
fake process group (:func:`llmem_plugin.methods.pp.stage.run_rank`), for two
steps; the trace goes through the caching-allocator replay like every other
method's. So the schedule's order, the stage's forward cache, its receive
buffers (``m`` activation buffers on non-first stages, ``m`` gradient buffers
on non-last ones, kept across steps), the input gradients accumulated on the
receive buffers until the next step, the last stage's output chunks
(``return_outputs``), and sends held until the schedule drops their work are
what torch's code does; they are checked byte for byte against a real
4-process gloo run on CPU (tests/methods/pp/test_pp.py).

Ranks differ: the first stage holds the embedding, the last the norm, head and
loss, and each schedule keeps a different number of microbatches in flight
per rank (:mod:`llmem_plugin.methods.pp.schedule`). Every rank is reported,
and the worst one decides the verdict.

Inside each stage: tensor parallel (torchtitan's plan without sequence
parallel) over ``--tp`` ranks of a node, then FSDP2 over the remaining
``world / (pipeline degree x tp)`` ranks, as torchtitan composes them.

Scope (each refused in one line): pure precisions without FSDP2 (fp32, bf16,
fp16: torchtitan runs mixed precision through FSDP, and autocast around a
schedule is not modelled); Llama-family decoders; unpacked rows.

Gradient accumulation (``--grad-accum K``) runs K schedule steps per optimizer
step, as torchtitan's trainer does when its global batch exceeds one step's
rows: each schedule step ends in FSDP2's reduction into the sharded gradients
(``PipelineStage.perform_reduce_grad``), which add up until the optimizer step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmem_plugin.models import modelbuild
from llmem_plugin.device.allocator_config import SMALL_BUFFER, AllocatorConfig
from llmem_plugin.errors import ConfigError, UnsupportedError, tracing
from llmem_plugin.device.gpus import GPU, get_gpu
from llmem_plugin.methods.base import MethodEstimate, RankMemory, rank_memory
from llmem_plugin.methods.layout import Layout
from llmem_plugin.methods.pp.compose import (
    VirtualPipeline,
    compose_templates,
    cut,
    cut_templates,
    stand_in_stages,
    templates,
    traced_accumulation,
    virtual_pipeline,
)
from llmem_plugin.methods.pp.schedule import SCHEDULES, SINGLE_STAGE, V_SHAPED, in_flight, stages_of_rank
from llmem_plugin.methods.pp.split import SPLITS, colossalai_split, torchtitan_split
from llmem_plugin.methods.pp.stage import StageSpec, action_segments, check_model, run_rank, stage_modules
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, TraceResult
from llmem_plugin.workload import AttentionImpl, LossImpl, OptimizerKind, Runner, Workload

__all__ = ["PRESETS", "estimate", "pipeline_across_nodes", "pipeline_mesh", "segment_peaks", "shard_stage",
           "stage_specs", "stage_tp_plan", "tensor_parallel_bytes", "torchtitan_sections", "trace_rank"]

PRESETS: dict[str, dict[str, Any]] = {
    "pp": {"schedule": "1f1b"},
    "pp-gpipe": {"schedule": "gpipe"},
    "pp-interleaved": {"schedule": "interleaved-1f1b"},
    "pp-zbv": {"schedule": "zbv"},
    "pp-dualpipev": {"schedule": "dualpipev"},
    "pp-interleaved-zb": {"schedule": "interleaved-zb"},
}
# Schedules that split each backward into input and weight gradients (torch.autograd.grad over parts of
# the graph), or overlap forward and backward.
_SPLIT_BACKWARD = ("zbv", "dualpipev", "interleaved-zb")
# Fast mode traces a rank whose stages have at most this many decoder layers at full depth: its two runs
# (stages at 1 and at 2 layers) pay the run's fixed part (embedding or head, loss, optimizer, schedule, set-up)
# twice and 3 layers' work, so one run at 3 layers or fewer costs no more, and it is exact.
FAST_FULL_DEPTH_LAYERS = 3
# Stages per rank when not given: the V schedules place two; the interleaved ones take two as the default.
_DEFAULT_STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2,
                            "interleaved-zb": 2}


def stage_specs(num_layers: int, num_stages: int, *, split: str | list[int] = "torchtitan") -> list[StageSpec]:
    """The global stages: decoder layers per stage from ``split`` (a framework's default, or layers per
    stage).

    Raises:
        ConfigError: An unknown split, or a list that does not cover the layers once.
    """
    if isinstance(split, str):
        if split not in SPLITS or split == "deepspeed":
            raise ConfigError(f"pipeline split {split!r} is not one of torchtitan, colossalai (torch's pipelining "
                              "runs them), or a list of layers per stage. HINT: pass --pp-split torchtitan")
        counts = torchtitan_split(num_layers, num_stages) if split == "torchtitan" else colossalai_split(
            num_layers, num_stages)
    else:
        counts = list(split)
        if len(counts) != num_stages or sum(counts) != num_layers or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise ConfigError(f"layers per stage {counts} must be {num_stages} non-negative counts summing to the "
                              f"model's {num_layers} layers. HINT: give one count per stage")
        if any(c == 0 for c in counts[1:-1]):
            # Only the first and last stages hold other weights (embedding, head); an empty middle stage has
            # nothing to train (torchtitan refuses it too).
            raise ConfigError(f"layers per stage {counts}: a middle stage without decoder layers holds no "
                              "parameters. HINT: give every middle stage at least one layer")
    specs, start = [], 0
    for i, c in enumerate(counts):
        specs.append(StageSpec(i, num_stages, start, start + c))
        start += c
    return specs


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

    from llmem_plugin.trace.emulation import cuda_emulation
    from llmem_plugin.methods._fakepg import fake_process_group, isolated_sharding_propagation
    from llmem_plugin.methods._local_step import LocalShardStep
    from llmem_plugin.methods._rank_tracker import RankTracker
    from llmem_plugin.methods.fsdp import _materialize, _param_dtype, fsdp_instrumented
    from llmem_plugin.methods.tp import _no_view_warnings, fakeify_sharded
    from llmem_plugin.trace.step import make_optimizer

    sharded = dp_shard > 1
    distributed = sharded or tp > 1  # DTensor parameters
    param_dtype = _param_dtype(workload, None) if sharded else None

    def run(inner: nn.Module, fake_mode: Any, pp_mesh: Any) -> TraceResult:
        from torch.distributed.tensor.parallel import parallelize_module

        tracker = RankTracker(fake_mode) if distributed else MemoryTracker()
        contexts = [cuda_emulation(autocast_dtype=None, compute_capability=gpu.compute_capability,
                                   num_sms=gpu.num_sms, mark=tracker.mark)]
        modules = None
        extra: dict[str, Any] = {}
        if distributed:
            modules = stage_modules(inner, specs)
            if tp > 1:
                embed, head = inner.get_input_embeddings(), inner.get_output_embeddings()
                tied = head is not None and head.weight is embed.weight
                for m in modules:
                    parallelize_module(m, pp_mesh["tp"], stage_tp_plan(m, inner.config))
                firsts = [m.embed_tokens for m in modules if m.embed_tokens is not None]
                lasts = [m.lm_head for m in modules if m.lm_head is not None]
                if tied and firsts and lasts:
                    # A V schedule's rank holds both ends: each style replaced its own module's weight, both
                    # Shard(0) on the vocabulary, so one DTensor serves both again (as methods/tp.py ties).
                    lasts[0].weight = firsts[0].weight
            if sharded:
                for m in modules:
                    shard_stage(m, pp_mesh["dp_shard"], param_dtype)
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
            contexts += [isolated_sharding_propagation(), _no_view_warnings()]
            if sharded:
                contexts.append(fsdp_instrumented(tracker, cpu_offload=False))
                extra["activation_dtype"] = param_dtype
        on_action, segments_of = action_segments(tracker)
        pp_group = pp_mesh["pp"].get_group() if distributed else group
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

    if not fake:
        return run(model.get_base_model() if hasattr(model, "get_base_model") else model, None, mesh)
    with fake_process_group(world_size=pipeline_degree * dp_shard * tp, rank=rank):
        fake_mesh = pipeline_mesh(pipeline_degree, dp_shard, tp) if distributed else None
        built = modelbuild.build_model(model, workload, device="meta")
        fake_mode = FakeTensorMode()
        if not distributed:
            modelbuild.fakeify(built, fake_mode)
        inner = built.get_base_model() if hasattr(built, "get_base_model") else built
        with tracing(f"pipeline rank {rank} of {type(inner).__name__} ({schedule})"):
            return run(inner, fake_mode, fake_mesh)


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
    rank holding the last stage with ``return_outputs`` is not composed, see :func:`estimate`)."""
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
    synthesise = placeholders and schedule not in _SPLIT_BACKWARD
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


def pipeline_across_nodes(layout: Layout) -> bool:
    """Whether the P2P between pipeline neighbours runs at the network's pace: the pipeline is the mesh's
    outermost dimension (torchtitan), so on more than one node some neighbours straddle a node boundary,
    and every microbatch crosses it; the schedule advances at its slowest link."""
    return layout.num_nodes > 1


def rank_layers(schedule: str, p: int, v: int, specs: list[StageSpec]) -> int:
    """Decoder layers of the pipeline rank that holds the most: the sum over each rank's stages."""
    return max(sum(specs[s].stop - specs[s].start for s in stages_of_rank(schedule, p, pr, v)) for pr in range(p))


def tensor_parallel_bytes(*, micro_batch: int, seq_len: int, hidden: int, vocab: int, layers: int, microbatches: int,
                          tp: int, bytes_per: int, recompute: bool) -> int:
    """Bytes one TP rank sends per step inside a stage of ``layers`` decoder layers (the plan without
    sequence parallel, NCCL ring volumes: an all-reduce moves 2(t-1)/t of its buffer, an all-gather (t-1)/t
    of the whole): per microbatch and layer, the row-wise projections' outputs all-reduced forward (o_proj,
    down_proj) and the attention and MLP inputs' gradients backward, twice more where checkpointing
    recomputes the forward; the embedding's output and the head's input gradient all-reduced, the head's
    logits all-gathered (counted on one rank, an upper bound for the others)."""
    if tp <= 1:
        return 0
    act = micro_batch * seq_len * hidden * bytes_per
    reduces = layers * (6 if recompute else 4) + 2
    logits = micro_batch * seq_len * vocab * bytes_per
    return microbatches * (reduces * act * 2 * (tp - 1) // tp + logits * (tp - 1) // tp)


def torchtitan_sections(*, pipeline_degree: int, dp_shard: int, schedule: str, microbatches: int,
                        micro_batch_size: int, seq_len: int, tp: int = 1, accumulation: int = 1) -> str:
    """The job as torchtitan's config fields (torchtitan/config/configs.py at b5bcd76, also settable as
    command-line overrides named section.field): ``parallelism.pipeline_parallel_degree``, ``pipeline_parallel_schedule``
    (torch's schedule class name), ``num_pp_microbatches`` (per data-parallel rank and accumulation
    step), ``data_parallel_shard_degree``, ``tensor_parallel_degree`` with ``enable_sequence_parallel`` off
    (its default is on; estimated without it); ``training.num_tokens_per_microbatch_per_dp_rank`` (one
    microbatch: its rows' tokens, which torchtitan packs into one buffer), ``max_context_length`` (the
    sequence), and with gradient accumulation ``num_tokens_per_train_step``: torchtitan/trainer.py at
    b5bcd76 runs ``num_tokens_per_train_step // (tokens per microbatch x num_pp_microbatches x dp)``
    schedule steps per optimizer step. torchtitan's default split is the one estimated
    (``pipeline_parallel_first_stage_less_layers`` and ``..._last_stage_less_layers`` = 1)."""
    tokens = micro_batch_size * seq_len
    fields = [f"parallelism.pipeline_parallel_degree = {pipeline_degree}",
              f'parallelism.pipeline_parallel_schedule = "{SCHEDULES[schedule]}"',
              f"parallelism.num_pp_microbatches = {microbatches}",
              f"parallelism.data_parallel_shard_degree = {dp_shard}"]
    if tp > 1:
        fields += [f"parallelism.tensor_parallel_degree = {tp}", "parallelism.enable_sequence_parallel = false"]
    fields += [f"training.num_tokens_per_microbatch_per_dp_rank = {tokens}", f"training.max_context_length = {seq_len}"]
    if accumulation > 1:
        fields.append(f"training.num_tokens_per_train_step = {tokens * microbatches * dp_shard * accumulation}")
    return ", ".join(fields)


def estimate(
    model: Any,
    workload: Workload | None,
    *,
    layout: Layout,
    gpu: GPU | str | None,
    alloc_conf: AllocatorConfig | str | None = None,
    torch_version: str | None = None,
    preset: str = "pp",
    schedule: str = "1f1b",
    pipeline_degree: int | None = None,
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    split: str | list[int] = "torchtitan",
    ranks: list[int] | None = None,
    return_outputs: bool = True,
    fast: bool = False,
    compose: bool = True,
    stand_ins: dict | None = None,
    stand_in_steps: int | None = None,
    placeholders: bool = True,
    **_: Any,
) -> MethodEstimate:
    """Per-rank memory of a pipeline-parallel training step on ``layout``.

    Args:
        model: Model source, as :func:`llmem_plugin.models.modelbuild.build_model` takes.
        workload: ``micro_batch_size`` is one pipeline microbatch's rows; ``grad_accum_steps`` the schedule
            steps per optimizer step (torchtitan's gradient accumulation).
        schedule: One of :data:`~llmem_plugin.methods.pp.schedule.SCHEDULES`.
        pipeline_degree: Pipeline ranks (default: the world size over ``layout.tp``). With ``layout.tp`` > 1
            each stage is tensor parallel over ``tp`` ranks (:func:`stage_tp_plan`); a pipeline x TP size
            below the world size shards each stage with FSDP2 over the ``world / (pipeline_degree x tp)``
            ranks of its data-parallel group, as torchtitan composes them (:func:`shard_stage`).
        microbatches: Microbatches per schedule step (default: the pipeline degree).
        stages_per_rank: Stages per rank (1 for gpipe/1f1b, 2 for the V schedules, default 2 for the
            interleaved ones).
        split: "torchtitan" (default), "colossalai", or decoder layers per global stage.
        ranks: Trace only these global ranks (default: every pipeline rank's first shard rank, and its last
            where FSDP2's shards are uneven).
        return_outputs: The schedule's ``step(return_outputs=...)``: torch's default True keeps the last
            stage's logits of every microbatch and concatenates them at the end of the step (torchtitan's
            ``forward_backward_step`` kept the default up to torchtitan/train.py at 000204a); False drops
            them, as torchtitan's trainer now steps it (torchtitan/trainer.py at b5bcd76) and the planner
            does.
        fast: Trace each rank with its stages cut to one decoder layer and to two, and extrapolate every
            quantity affinely to its deepest stage's depth (the schedule, its microbatches and buffers stay
            whole); a rank whose stages all have at most :data:`FAST_FULL_DEPTH_LAYERS` layers is traced
            in full (no slower than the two shortened runs).
        compose: Compose each rank's step from a small pipeline's runs at two small microbatch counts
            (:mod:`llmem_plugin.methods.pp.compose`) where one shows every action context the rank's schedule
            has; False traces every microbatch.
        stand_ins: The composition's stand-in runs, kept across calls that differ only in ``microbatches``
            and the workload's ``grad_accum_steps`` (the planner's splits of one configuration); each call's
            own when None.
        stand_in_steps: Schedule steps the stand-in runs take (default ``min(grad_accum_steps, 2)``); 2
            lets one set of runs serve every accumulation, 1 included (the planner's splits share them).
        placeholders: Synthesise a composed rank's stand-in runs from placeholder stages and one small real
            run of its kind (:mod:`llmem_plugin.methods.pp.synth`) where that applies; False traces them with
            the real stages.

    Raises:
        ConfigError: Bad degrees, microbatches or split.
        UnsupportedError: What the scope above leaves out.
    """
    from llmem_plugin.estimate import DEFAULT_GPU, uses_cublaslt
    from llmem_plugin.device.overheads import device_overheads

    wl = workload if workload is not None else Workload()
    tp = layout.tp
    p = layout.num_gpus // tp if pipeline_degree is None else pipeline_degree
    if isinstance(p, bool) or not isinstance(p, int) or p < 2 or layout.num_gpus % (p * tp):
        n = layout.num_gpus
        if tp > 1:
            raise ConfigError(f"--method {preset}: pipeline degree {p!r} x --tp {tp} must divide the {n} GPUs, with "
                              f"a pipeline degree of at least 2. HINT: pass --pp K with K >= 2 and K x {tp} dividing "
                              f"{n}, or another --tp")
        raise ConfigError(f"--method {preset}: pipeline degree {p!r} must be at least 2 and divide the {n} GPUs. "
                          "HINT: pass --gpus N (and --pp K dividing N) with K >= 2")
    inner = layout.num_gpus // p  # the ranks of one pipeline rank: FSDP2 shards x TP ranks
    dp = inner // tp
    if wl.precision.autocast_dtype is not None and dp == 1:
        raise UnsupportedError(f"--method {preset} with --precision {wl.precision.value} and no data parallelism: "
                               "autocast around a pipeline schedule is not modelled (torchtitan runs mixed "
                               "precision through FSDP). HINT: use --precision bf16 or fp32, or --pp x --tp below --gpus")
    accum = wl.grad_accum_steps  # schedule steps per optimizer step (torchtitan's gradient accumulation)
    if stand_in_steps not in (None, 2) and not (stand_in_steps == 1 and accum == 1):
        raise ConfigError(f"stand_in_steps must be 2 (or 1 without accumulation), got {stand_in_steps!r}. HINT: "
                          "leave it out")
    refused = [(wl.runner is not Runner.TORCH, f"--runner {wl.runner.value}",
                "pass --runner torch: the pipeline schedule is the loop"),
               (wl.attn_implementation not in (AttentionImpl.AUTO, AttentionImpl.SDPA),
                f"--attn {wl.attn_implementation.value}", "use --attn sdpa: the stages run causal attention "
                "with no mask tensor, which only the SDPA kernels take as causal"),
               (wl.logits_to_keep != 0, "--logits-to-keep", "drop it"),
               (wl.outputs_to_fp32, "outputs cast to fp32", "drop it"),
               (wl.load != "direct", f"--load {wl.load}", "drop it"),
               (fast and wl.checkpoint_every != 1, "--fast and --checkpoint-every",
                "drop --fast (which layers are checkpointed depends on their index in the model)"),
               (wl.grad_checkpointing and wl.checkpoint_reentrant and schedule in _SPLIT_BACKWARD,
                "reentrant checkpointing", "use non-reentrant checkpointing: zero-bubble schedules split the "
                "backward, which reentrant checkpointing cannot"),
               (wl.packed_docs is not None, "--packed-docs", "drop --packed-docs"),
               (wl.lora is not None, "LoRA", "estimate full fine-tuning, or LoRA with another method"),
               (wl.quantize is not None, "quantized base weights", "use another method for QLoRA"),
               (wl.loss is not LossImpl.HF, f"--loss {wl.loss.value}", "use the default loss"),
               (wl.reference_model, "--reference-model", "drop it"),
               (wl.offload_activations is not None, "activation offload", "drop it"),
               (wl.images is not None, "images", "use a text-only model")]
    for hit, what, hint in refused:
        if hit:
            # The stages run the model's decoder layers and its own loss function; these change what a stage
            # runs in ways not yet checked against a real pipeline run.
            raise UnsupportedError(f"--method {preset} with {what} is not modelled (not checked against a real "
                                   f"pipeline run yet). HINT: {hint}")
    if dp > 1 and wl.optimizer is OptimizerKind.ADAFACTOR:
        raise UnsupportedError(f"torch.optim.Adafactor cannot step FSDP2's sharded parameters, so --method "
                               f"{preset} over {dp} data-parallel ranks cannot run it. HINT: use --optimizer adamw")
    if tp > 1 and wl.optimizer is OptimizerKind.ADAFACTOR:
        # Its factored row and column statistics over TP-sharded DTensors are not checked against a real run.
        raise UnsupportedError(f"--method {preset} with --tp {tp} and --optimizer adafactor is not modelled (not "
                               "checked against a real run). HINT: use --optimizer adamw")
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}. HINT: pick one")
    v = stages_per_rank if stages_per_rank is not None else _DEFAULT_STAGES_PER_RANK[schedule]
    m = microbatches if microbatches is not None else p
    if stages_per_rank is not None and schedule in SINGLE_STAGE and v != 1:
        raise ConfigError(f"--method {preset} runs one stage per rank, got --stages-per-rank {v}. HINT: use --method "
                          "pp-interleaved or pp-interleaved-zb for several")
    if stages_per_rank is not None and schedule in V_SHAPED and v != 2:
        raise ConfigError(f"--method {preset} runs two stages per rank (a V), got --stages-per-rank {v}. HINT: pass "
                          "--stages-per-rank 2 or leave it out")
    if schedule == "1f1b" and isinstance(m, int) and 0 < m < p:
        # torch's Schedule1F1B.__init__: "Number of microbatches must be greater than or equal to the number
        # of stages".
        raise ConfigError(f"--method {preset} needs at least as many microbatches as pipeline stages ({p}), got "
                          f"--microbatches {m}. HINT: pass --microbatches {p} or more")
    from llmem_plugin.trace.step import MAX_TRACED_MICRO_STEPS

    if isinstance(m, int) and m * accum > MAX_TRACED_MICRO_STEPS and not compose:
        raise UnsupportedError(f"--method {preset} traces every microbatch, and --microbatches {m} x --grad-accum "
                               f"{accum} is above {MAX_TRACED_MICRO_STEPS}. HINT: estimate "
                               f"{MAX_TRACED_MICRO_STEPS} or fewer per optimizer step")
    flight = in_flight(schedule, p, m, v)  # also the schedule's own checks (degrees, placement, microbatches)
    target = gpu if isinstance(gpu, GPU) else get_gpu(gpu or DEFAULT_GPU)
    config = alloc_conf if isinstance(alloc_conf, AllocatorConfig) else AllocatorConfig.from_env(alloc_conf)
    probe = modelbuild.build_model(model, wl, device="meta")
    base = probe.get_base_model() if hasattr(probe, "get_base_model") else probe
    check_model(base.config, wl.seq_len)
    layout.check_model(base.config)  # TP divides the heads, kv heads and widths
    num_layers = modelbuild.num_layers(base.config)
    specs = stage_specs(num_layers, p * v, split=split)

    def stages(pp_rank: int) -> list[StageSpec]:
        return [specs[s] for s in sorted(stages_of_rank(schedule, p, pp_rank, v))]

    if ranks is None:
        traced = []
        for pp_rank in range(p):
            traced.append(pp_rank * inner)  # TP ranks are alike (rank 0 holds the larger vocabulary shard)
            params = [q for mod in stage_modules(base, stages(pp_rank)) for q in mod.parameters()]
            # FSDP2 shards dim 0 of the TP-local tensor: the whole one (row-wise, replicated) or its 1/tp
            # (column-wise, the vocabulary); either uneven pads the last shards, whose rank differs.
            if dp > 1 and any(q.dim() and (q.shape[0] % dp or -(-q.shape[0] // tp) % dp) for q in params):
                traced.append(pp_rank * inner + (dp - 1) * tp)
    else:
        traced = ranks
    overheads_of = {}
    rows = []
    composed_ranks: list[int] = []
    synthesised_ranks: list[int] = []
    extrapolated_ranks: list[int] = []
    stand_in_runs: dict = stand_ins if stand_ins is not None else {}
    for r in traced:
        if isinstance(r, bool) or not (isinstance(r, int) and 0 <= r < layout.num_gpus):
            raise ConfigError(f"rank {r!r} is not a rank of the {layout.num_gpus} GPUs. HINT: pass ranks 0 to "
                              f"{layout.num_gpus - 1}")
        mine = stages(r // inner)
        stage_rank = {st: pr for pr in range(p) for st in stages_of_rank(schedule, p, pr, v)}
        neighbours = len({stage_rank[sp.index + d] for sp in mine for d in (-1, 1)
                          if 0 <= sp.index + d < p * v} - {r // inner})
        # ProcessGroupNCCL: a P2P batch of one kind runs on a 2-rank communicator per peer rank, a mixed batch
        # on the pipeline group's (torch/distributed/pipelining/schedules.py, _warmup_p2p's note); FSDP2
        # gathers and reduces over the data-parallel group, TP over its own.
        sizes = (2,) * neighbours + (p,) + ((dp,) if dp > 1 else ()) + ((tp,) if tp > 1 else ())
        if sizes not in overheads_of:
            overheads_of[sizes] = device_overheads(target.compute_capability, torch_version=torch_version,
                                                   uses_cublaslt=uses_cublaslt(probe), nccl_world_sizes=sizes)

        # The rank holding the last stage keeps every microbatch's logits until the step concatenates them
        # (return_outputs): the allocator's cache fragments in proportion to m there, which the composition's
        # reserved bound misses (measured: Llama-3.1-8B, 4 ranks, 32 microbatches, 12% under on that rank;
        # benchmarks/results/pp-compose-2026-11-28.jsonl). It is traced in full.
        holds_logits = return_outputs and any(sp.last for sp in mine)
        virtual = virtual_pipeline(schedule, p, m, v, r // inner) if compose and not holds_logits else None
        if virtual is None and compose and not holds_logits and accum > traced_accumulation(accum):
            # Too few microbatches for a smaller pipeline to save any, but schedule steps to save: the rank
            # stands in for itself, run for two schedule steps and composed over all of them.
            virtual = VirtualPipeline(p, r // inner, (m, m))

        def too_many(r: int = r) -> UnsupportedError:
            why = ("holds the last stage's logits of every microbatch (return_outputs), which is not composed"
                   if holds_logits else "cannot be composed from shorter runs")
            fix = ("--no-return-outputs (return_outputs=False, as torchtitan's trainer steps the schedule), or "
                   if holds_logits else "")
            return UnsupportedError(f"--method {preset}: pipeline rank {r // inner} {why}, and tracing all {m * accum} "
                                    f"microbatches of an optimizer step is refused above {MAX_TRACED_MICRO_STEPS}. "
                                    f"HINT: pass {fix}--microbatches x --grad-accum of {MAX_TRACED_MICRO_STEPS} or "
                                    "fewer")

        if virtual is None and m * accum > MAX_TRACED_MICRO_STEPS:
            raise too_many()

        def row(specs_: list[StageSpec], r: int = r, sizes: tuple[int, ...] = sizes, virtual: Any = virtual
                ) -> tuple[RankMemory, dict[str, int]]:
            if virtual is not None:
                got = _composed_row(model, wl, specs_, virtual, rank=r, pipeline_degree=p, schedule=schedule,
                                    microbatches=m, stages_per_rank=v, dp=dp, tp=tp, gpu=target,
                                    base=base, placeholders=placeholders,
                                    return_outputs=return_outputs, overheads=overheads_of[sizes], alloc_conf=config,
                                    cache=stand_in_runs, accumulation=accum, stand_in_steps=stand_in_steps)
                if got is not None:
                    composed_ranks.append(r)
                    if got[2]:
                        synthesised_ranks.append(r)
                    return got[:2]
                if m * accum > MAX_TRACED_MICRO_STEPS:
                    raise too_many()
            streams: dict[int, int] = {}
            segments: list[tuple[str, int]] = []
            trace = trace_rank(model, wl, specs_, rank=r, pipeline_degree=p, schedule=schedule, microbatches=m,
                               gpu=target, return_outputs=return_outputs, dp_shard=dp, tp=tp, streams=streams,
                               segments=segments, accumulation=accum)
            return (rank_memory(trace, rank=r, gpu=target, overheads=overheads_of[sizes], alloc_conf=config,
                                streams=streams), segment_peaks(trace, segments))

        depths = [sp.stop - sp.start for sp in mine]
        if fast and max(depths) > FAST_FULL_DEPTH_LAYERS and min(depths) >= 1:
            # All of a rank's stages deepen together, to its deepest stage's count: a shallower stage is
            # taken one layer deeper than it is (the safe side). Deepening one stage at a time and adding
            # the deltas double-counts where the stages' peaks fall at different moments.
            one, two = (row(_shortened(mine, [d] * len(mine))) for d in (1, 2))
            extrapolated = _extrapolated(one, two, max(depths), target.capacity_bytes)
            rows.append(extrapolated if extrapolated is not None else row(mine)[0])
            if extrapolated is not None:
                extrapolated_ranks.append(r)
        else:
            rows.append(row(mine)[0])
    counts = [s.stop - s.start for s in specs]
    inside = f", each stage FSDP2-sharded over {dp} ranks (reshard_after_forward=False)" if dp > 1 else ""
    if tp > 1:
        inside += (f", tensor parallel {tp}-way inside each stage (torchtitan's plan without sequence parallel: "
                   "stages pass whole activations)")
    notes = [f"torch.distributed.pipelining {SCHEDULES[schedule]}: {p} pipeline ranks x {v} stage(s){inside}, {m} "
             f"microbatches of {wl.micro_batch_size} row(s)"
             + (f" per schedule step, {accum} schedule steps per optimizer step (gradient accumulation)"
                if accum > 1 else "") + f"; decoder layers per stage {counts} "
             f"({split if isinstance(split, str) else 'given'}); step(return_outputs={return_outputs})",
             "chunks in flight at each pipeline rank's peak: " + ", ".join(
                 f"rank {r}: {len(flight[r // inner])}" for r in traced)]
    # The interleaved schedules' stages per rank follow torchtitan's pipeline_parallel_layers_per_stage,
    # which this section does not set: only the one-stage and V schedules are written out.
    if split == "torchtitan" and (v == 1 or schedule in V_SHAPED):
        notes.append("torchtitan (b5bcd76): " + torchtitan_sections(
            pipeline_degree=p, dp_shard=dp, tp=tp, schedule=schedule, microbatches=m,
            micro_batch_size=wl.micro_batch_size, seq_len=wl.seq_len, accumulation=accum))
    if composed_ranks:
        steps = f" in each of {accum} schedule steps (two run)" if accum > 1 else ""
        notes.append(f"composed: ranks {sorted(set(composed_ranks))} from short runs (a smaller pipeline's at two "
                     f"small microbatch counts, or the rank's own) (llmem_plugin.methods.pp.compose), replayed over "
                     f"the real schedule's {m} microbatches{steps}; reserved: the longer run's plus whole segments "
                     "for the extra bytes")
    if synthesised_ranks:
        notes.append(f"synthesised: ranks {sorted(set(synthesised_ranks))}' stand-in runs from placeholder stages "
                     "through the stand-in's schedule and one small real run of each kind of rank "
                     "(llmem_plugin.methods.pp.synth), checked on that run's own actions; their reserved starts from "
                     "that real run's")
    if extrapolated_ranks:
        notes.append(f"fast: ranks {extrapolated_ranks} traced with their stages at 1 and 2 decoder layers, "
                     "extrapolated to their deepest stage's depth; reserved approximate (the larger reserved/allocated "
                     "ratio of the two runs: measured 8-37% over the full-depth estimate)")
    elif fast:
        notes.append(f"fast: every rank traced at full depth (stages of at most {FAST_FULL_DEPTH_LAYERS} layers "
                     "cost no more than the two shortened runs)")
    hidden = int(base.config.hidden_size)
    act_dtype = wl.precision.autocast_dtype if dp > 1 and wl.precision.autocast_dtype else next(
        base.parameters()).dtype
    bytes_per = torch.empty((), dtype=act_dtype, device="meta").element_size()
    # A middle pipeline rank sends each microbatch's activations forward and its input gradients back.
    p2p = accum * m * v * wl.micro_batch_size * wl.seq_len * hidden * bytes_per * 2
    # FSDP2 with reshard_after_forward=False gathers a stage's parameters once per schedule step and
    # reduce-scatters its gradients once (no sync until its last microbatch; the stage's perform_reduce_grad
    # reshards after it): ring volumes (dp - 1) / dp of each, per schedule step.
    fsdp_bytes = 0
    if dp > 1:
        def local(name: str, q: torch.Tensor) -> int:  # the TP plan keeps the norms replicated
            return q.numel() if "norm" in name else -(-q.numel() // tp)

        numel = max(sum(local(n, q) for mod in stage_modules(base, stages(pr)) for n, q in mod.named_parameters())
                    for pr in range(p))
        gather = 2 if wl.precision.autocast_dtype is not None else bytes_per
        reduce = 4 if wl.precision.autocast_dtype is not None else bytes_per
        fsdp_bytes = accum * numel * (gather + reduce) * (dp - 1) // dp  # each TP rank's local shards
    tp_bytes = tensor_parallel_bytes(micro_batch=wl.micro_batch_size, seq_len=wl.seq_len, hidden=hidden,
                                     vocab=int(base.config.vocab_size), layers=rank_layers(schedule, p, v, specs),
                                     microbatches=m * accum, tp=tp,
                                     bytes_per=bytes_per, recompute=wl.grad_checkpointing)
    # A pipeline rank's dp x tp ranks are consecutive (torchtitan's mesh: pipeline outermost, TP innermost),
    # so its FSDP2 group stays inside a node when those blocks tile the nodes; TP does (Layout keeps it in a
    # node); pipeline neighbours are dp x tp ranks apart.
    intra, inter = tp_bytes, 0
    if layout.gpus_per_node % inner == 0:
        intra += fsdp_bytes
    else:
        inter += fsdp_bytes
    if pipeline_across_nodes(layout):
        inter += p2p
    else:
        intra += p2p
    return MethodEstimate(method=preset, layout=layout, ranks=rows, comm_intra_node_bytes=intra,
                          comm_inter_node_bytes=inter, notes=notes)
