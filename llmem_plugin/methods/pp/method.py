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

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from llmem_plugin.models import modelbuild
from llmem_plugin.models.config import num_layers
from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.device.gpus import GPU, get_gpu
from llmem_plugin.methods.base import MethodEstimate, RankMemory, rank_memory
from llmem_plugin.methods.layout import Layout
from llmem_plugin.methods.pp.compose import VirtualPipeline, traced_accumulation, virtual_pipeline
from llmem_plugin.methods.pp.rank import _composed_row, _extrapolated, _shortened, segment_peaks, trace_rank
from llmem_plugin.methods.pp.schedule import (
    SCHEDULES,
    SINGLE_STAGE,
    SPLIT_BACKWARD,
    V_SHAPED,
    in_flight,
    stages_of_rank,
)
from llmem_plugin.methods.pp.split import SPLITS, colossalai_split, torchtitan_split
from llmem_plugin.methods.pp.stage import StageSpec, check_model, stage_modules
from llmem_plugin.workload import AttentionImpl, LossImpl, OptimizerKind, Runner, Workload

__all__ = ["FAST_FULL_DEPTH_LAYERS", "PRESETS", "estimate", "pipeline_across_nodes", "rank_layers", "stage_specs",
           "tensor_parallel_bytes", "torchtitan_sections"]

PRESETS: dict[str, dict[str, Any]] = {
    "pp": {"schedule": "1f1b"},
    "pp-gpipe": {"schedule": "gpipe"},
    "pp-interleaved": {"schedule": "interleaved-1f1b"},
    "pp-zbv": {"schedule": "zbv"},
    "pp-dualpipev": {"schedule": "dualpipev"},
    "pp-interleaved-zb": {"schedule": "interleaved-zb"},
}
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


@dataclass(frozen=True, kw_only=True)
class _Job:
    """A pipeline-parallel estimate's resolved layout and schedule (:func:`_resolve_job`), shared by its steps.

    Attributes:
        preset: The method's name, for messages.
        workload: The workload; its ``grad_accum_steps`` are the schedule steps per optimizer step.
        layout: The GPUs.
        schedule: A name of :data:`~llmem_plugin.methods.pp.schedule.SCHEDULES`.
        degree: Pipeline ranks.
        stages_per_rank: Stages each pipeline rank holds.
        microbatches: Microbatches per schedule step.
        dp: FSDP2 degree inside each stage (1: none).
        tp: Tensor-parallel degree inside each stage.
        split: The stage split :func:`stage_specs` takes.
        flight: The chunks in flight at each pipeline rank's peak
            (:func:`~llmem_plugin.methods.pp.schedule.in_flight`).
        gpu: The GPU.
        alloc_conf: The caching allocator's settings.
        return_outputs, fast, compose, stand_in_steps, placeholders: As :func:`estimate` takes them.
    """

    preset: str
    workload: Workload
    layout: Layout
    schedule: str
    degree: int
    stages_per_rank: int
    microbatches: int
    dp: int
    tp: int
    split: str | list[int]
    flight: list[list[tuple[int, int]]]
    gpu: GPU
    alloc_conf: AllocatorConfig
    return_outputs: bool
    fast: bool
    compose: bool
    stand_in_steps: int | None
    placeholders: bool

    @property
    def inner(self) -> int:
        """Global ranks per pipeline rank: FSDP2 shards x TP ranks."""
        return self.dp * self.tp

    @property
    def accumulation(self) -> int:
        """Schedule steps per optimizer step (torchtitan's gradient accumulation)."""
        return self.workload.grad_accum_steps


@dataclass(frozen=True)
class _Row:
    """One run's numbers for a rank: its memory, its segment peaks (:func:`segment_peaks`), and whether they
    were composed from a stand-in's runs and those runs synthesised."""

    memory: RankMemory
    peaks: dict[str, int]
    composed: bool = False
    synthesised: bool = False


@dataclass(frozen=True)
class _RankOutcome:
    """A traced rank's memory, and how it was reached: composed (in any of its runs), from synthesised runs,
    or extrapolated from shortened stages (fast mode)."""

    memory: RankMemory
    composed: bool
    synthesised: bool
    extrapolated: bool


def _pipeline_degree(layout: Layout, pipeline_degree: int | None, preset: str) -> int:
    """The pipeline degree (default: the world size over ``layout.tp``).

    Raises:
        ConfigError: Below 2, or its product with ``layout.tp`` does not divide the GPUs.
    """
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
    return p


def _check_scope(wl: Workload, *, preset: str, schedule: str, dp: int, tp: int, fast: bool,
                 stand_in_steps: int | None) -> None:
    """Refuse what the method does not model for ``wl`` (the module's scope), in the order the user meets it.

    Raises:
        ConfigError: A ``stand_in_steps`` other than 2 (or 1 without accumulation).
        UnsupportedError: Mixed precision without FSDP2, a technique the stages do not run as the model does,
            Adafactor over DTensor parameters.
    """
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
               (wl.grad_checkpointing and wl.checkpoint_reentrant and schedule in SPLIT_BACKWARD,
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


def _schedule_shape(schedule: str, p: int, *, microbatches: int | None, stages_per_rank: int | None, accum: int,
                    preset: str, compose: bool) -> tuple[int, int]:
    """(stages per rank, microbatches) for ``schedule`` over ``p`` pipeline ranks: the given ones, checked, or
    the defaults (:data:`_DEFAULT_STAGES_PER_RANK`, ``p`` microbatches).

    Raises:
        ConfigError: An unknown schedule, a stage count it does not place, fewer microbatches than 1F1B takes.
        UnsupportedError: More microbatches per optimizer step than are traced, with ``compose`` off.
    """
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
    return v, m


def _resolve_job(workload: Workload | None, *, layout: Layout, gpu: GPU | str | None,
                 alloc_conf: AllocatorConfig | str | None, preset: str, schedule: str, pipeline_degree: int | None,
                 microbatches: int | None, stages_per_rank: int | None, split: str | list[int],
                 return_outputs: bool, fast: bool, compose: bool, stand_in_steps: int | None,
                 placeholders: bool) -> _Job:
    """Step 1 of :func:`estimate`: the degrees, the schedule's shape, the GPU and allocator, every check that
    needs no model, in :func:`estimate`'s order.

    Raises:
        ConfigError, UnsupportedError: As :func:`estimate`.
    """
    from llmem_plugin.estimate import DEFAULT_GPU

    wl = workload if workload is not None else Workload()
    p = _pipeline_degree(layout, pipeline_degree, preset)
    inner = layout.num_gpus // p  # the ranks of one pipeline rank: FSDP2 shards x TP ranks
    dp = inner // layout.tp
    _check_scope(wl, preset=preset, schedule=schedule, dp=dp, tp=layout.tp, fast=fast, stand_in_steps=stand_in_steps)
    v, m = _schedule_shape(schedule, p, microbatches=microbatches, stages_per_rank=stages_per_rank,
                           accum=wl.grad_accum_steps, preset=preset, compose=compose)
    flight = in_flight(schedule, p, m, v)  # also the schedule's own checks (degrees, placement, microbatches)
    target = gpu if isinstance(gpu, GPU) else get_gpu(gpu or DEFAULT_GPU)
    config = alloc_conf if isinstance(alloc_conf, AllocatorConfig) else AllocatorConfig.from_env(alloc_conf)
    return _Job(preset=preset, workload=wl, layout=layout, schedule=schedule, degree=p, stages_per_rank=v,
                microbatches=m, dp=dp, tp=layout.tp, split=split, flight=flight, gpu=target, alloc_conf=config,
                return_outputs=return_outputs, fast=fast, compose=compose, stand_in_steps=stand_in_steps,
                placeholders=placeholders)


def _split_stages(model: Any, job: _Job) -> tuple[Any, Any, list[StageSpec]]:
    """Step 2 of :func:`estimate`: the model built on the meta device (``probe``), its decoder (``base``,
    without a PEFT wrapper), checked for the stages and the TP plan, and its global stages
    (:func:`stage_specs`)."""
    probe = modelbuild.build_model(model, job.workload, device="meta")
    base = probe.get_base_model() if hasattr(probe, "get_base_model") else probe
    check_model(base.config, job.workload.seq_len)
    job.layout.check_model(base.config)  # TP divides the heads, kv heads and widths
    return probe, base, stage_specs(num_layers(base.config), job.degree * job.stages_per_rank, split=job.split)


def _rank_stages(job: _Job, specs: list[StageSpec], pp_rank: int) -> list[StageSpec]:
    """The global stages pipeline rank ``pp_rank`` holds, in increasing index."""
    return [specs[s] for s in sorted(stages_of_rank(job.schedule, job.degree, pp_rank, job.stages_per_rank))]


def _default_ranks(job: _Job, base: Any, specs: list[StageSpec]) -> list[int]:
    """Step 3 of :func:`estimate`: the global ranks traced by default, every pipeline rank's first shard rank,
    and its last where FSDP2's shards of its parameters are uneven."""
    dp, tp, inner = job.dp, job.tp, job.inner
    traced = []
    for pp_rank in range(job.degree):
        traced.append(pp_rank * inner)  # TP ranks are alike (rank 0 holds the larger vocabulary shard)
        params = [q for mod in stage_modules(base, _rank_stages(job, specs, pp_rank)) for q in mod.parameters()]
        # FSDP2 shards dim 0 of the TP-local tensor: the whole one (row-wise, replicated) or its 1/tp
        # (column-wise, the vocabulary); either uneven pads the last shards, whose rank differs.
        if dp > 1 and any(q.dim() and (q.shape[0] % dp or -(-q.shape[0] // tp) % dp) for q in params):
            traced.append(pp_rank * inner + (dp - 1) * tp)
    return traced


def _communicator_sizes(job: _Job, specs: list[StageSpec], rank: int) -> tuple[int, ...]:
    """The sizes of the NCCL communicators global ``rank`` holds."""
    p, v = job.degree, job.stages_per_rank
    pp_rank = rank // job.inner
    stage_rank = {st: pr for pr in range(p) for st in stages_of_rank(job.schedule, p, pr, v)}
    neighbours = len({stage_rank[sp.index + d] for sp in _rank_stages(job, specs, pp_rank) for d in (-1, 1)
                      if 0 <= sp.index + d < p * v} - {pp_rank})
    # ProcessGroupNCCL: a P2P batch of one kind runs on a 2-rank communicator per peer rank, a mixed batch
    # on the pipeline group's (torch/distributed/pipelining/schedules.py, _warmup_p2p's note); FSDP2
    # gathers and reduces over the data-parallel group, TP over its own.
    return (2,) * neighbours + (p,) + ((job.dp,) if job.dp > 1 else ()) + ((job.tp,) if job.tp > 1 else ())


def _holds_logits(job: _Job, mine: list[StageSpec]) -> bool:
    """Whether the rank holding ``mine`` keeps every microbatch's logits until the step concatenates them."""
    return job.return_outputs and any(sp.last for sp in mine)


def _stand_in(job: _Job, mine: list[StageSpec], pp_rank: int) -> VirtualPipeline | None:
    """The stand-in pipeline whose short runs compose pipeline rank ``pp_rank``'s step
    (:func:`~llmem_plugin.methods.pp.compose.virtual_pipeline`), or None: traced in full."""
    # The rank holding the last stage keeps every microbatch's logits until the step concatenates them
    # (return_outputs): the allocator's cache fragments in proportion to m there, which the composition's
    # reserved bound misses (measured: Llama-3.1-8B, 4 ranks, 32 microbatches, 12% under on that rank;
    # benchmarks/results/pp-compose-2026-11-28.jsonl). It is traced in full.
    if not job.compose or _holds_logits(job, mine):
        return None
    m, accum = job.microbatches, job.accumulation
    virtual = virtual_pipeline(job.schedule, job.degree, m, job.stages_per_rank, pp_rank)
    if virtual is None and accum > traced_accumulation(accum):
        # Too few microbatches for a smaller pipeline to save any, but schedule steps to save: the rank
        # stands in for itself, run for two schedule steps and composed over all of them.
        virtual = VirtualPipeline(job.degree, pp_rank, (m, m))
    return virtual


def _too_many(job: _Job, rank: int, holds_logits: bool) -> UnsupportedError:
    """The refusal of a rank that would trace every microbatch of an optimizer step, above the limit."""
    from llmem_plugin.trace.step import MAX_TRACED_MICRO_STEPS

    why = ("holds the last stage's logits of every microbatch (return_outputs), which is not composed"
           if holds_logits else "cannot be composed from shorter runs")
    fix = ("--no-return-outputs (return_outputs=False, as torchtitan's trainer steps the schedule), or "
           if holds_logits else "")
    return UnsupportedError(f"--method {job.preset}: pipeline rank {rank // job.inner} {why}, and tracing all "
                            f"{job.microbatches * job.accumulation} microbatches of an optimizer step is refused "
                            f"above {MAX_TRACED_MICRO_STEPS}. HINT: pass {fix}--microbatches x --grad-accum of "
                            f"{MAX_TRACED_MICRO_STEPS} or fewer")


def _rank_row(model: Any, job: _Job, base: Any, specs: list[StageSpec], *, rank: int,
              virtual: VirtualPipeline | None, overheads: Any, cache: dict) -> _Row:
    """Global ``rank``'s numbers with its stages ``specs``: composed from ``virtual``'s runs where that
    applies (:func:`~llmem_plugin.methods.pp.rank._composed_row`), else traced in full.

    Raises:
        UnsupportedError: The composition does not apply and the full trace is above the limit.
    """
    from llmem_plugin.trace.step import MAX_TRACED_MICRO_STEPS

    wl, m = job.workload, job.microbatches
    if virtual is not None:
        got = _composed_row(model, wl, specs, virtual, rank=rank, pipeline_degree=job.degree, schedule=job.schedule,
                            microbatches=m, stages_per_rank=job.stages_per_rank, dp=job.dp, tp=job.tp, gpu=job.gpu,
                            base=base, placeholders=job.placeholders, return_outputs=job.return_outputs,
                            overheads=overheads, alloc_conf=job.alloc_conf, cache=cache,
                            accumulation=job.accumulation, stand_in_steps=job.stand_in_steps)
        if got is not None:
            return _Row(got[0], got[1], composed=True, synthesised=got[2])
        if m * job.accumulation > MAX_TRACED_MICRO_STEPS:
            raise _too_many(job, rank, _holds_logits(job, specs))
    streams: dict[int, int] = {}
    segments: list[tuple[str, int]] = []
    trace = trace_rank(model, wl, specs, rank=rank, pipeline_degree=job.degree, schedule=job.schedule,
                       microbatches=m, gpu=job.gpu, return_outputs=job.return_outputs, dp_shard=job.dp, tp=job.tp,
                       streams=streams, segments=segments, accumulation=job.accumulation)
    return _Row(rank_memory(trace, rank=rank, gpu=job.gpu, overheads=overheads, alloc_conf=job.alloc_conf,
                            streams=streams), segment_peaks(trace, segments))


def _rank_numbers(model: Any, job: _Job, base: Any, mine: list[StageSpec], *, rank: int, overheads: Any,
                  cache: dict) -> _RankOutcome:
    """Step 4 of :func:`estimate`, for one global ``rank`` holding the stages ``mine``: its numbers composed
    or traced (:func:`_rank_row`), or in fast mode extrapolated from its stages at one and two layers.

    Raises:
        UnsupportedError: The rank would trace more microbatches than the limit.
    """
    from llmem_plugin.trace.step import MAX_TRACED_MICRO_STEPS

    virtual = _stand_in(job, mine, rank // job.inner)
    if virtual is None and job.microbatches * job.accumulation > MAX_TRACED_MICRO_STEPS:
        raise _too_many(job, rank, _holds_logits(job, mine))
    depths = [sp.stop - sp.start for sp in mine]
    if not (job.fast and max(depths) > FAST_FULL_DEPTH_LAYERS and min(depths) >= 1):
        row = _rank_row(model, job, base, mine, rank=rank, virtual=virtual, overheads=overheads, cache=cache)
        return _RankOutcome(row.memory, row.composed, row.synthesised, extrapolated=False)
    # All of a rank's stages deepen together, to its deepest stage's count: a shallower stage is
    # taken one layer deeper than it is (the safe side). Deepening one stage at a time and adding
    # the deltas double-counts where the stages' peaks fall at different moments.
    rows = [_rank_row(model, job, base, _shortened(mine, [d] * len(mine)), rank=rank, virtual=virtual,
                      overheads=overheads, cache=cache) for d in (1, 2)]
    one, two = ((r.memory, r.peaks) for r in rows)
    extrapolated = _extrapolated(one, two, max(depths), job.gpu.capacity_bytes)
    if extrapolated is None:
        rows.append(_rank_row(model, job, base, mine, rank=rank, virtual=virtual, overheads=overheads, cache=cache))
    return _RankOutcome(extrapolated if extrapolated is not None else rows[-1].memory,
                        composed=any(r.composed for r in rows), synthesised=any(r.synthesised for r in rows),
                        extrapolated=extrapolated is not None)


def _rank_outcomes(model: Any, job: _Job, probe: Any, base: Any, specs: list[StageSpec], traced: list[int], *,
                   torch_version: str | None, stand_ins: dict | None) -> list[_RankOutcome]:
    """Step 4 of :func:`estimate`: each of the ``traced`` global ranks' numbers (:func:`_rank_numbers`), with
    the device overheads of the communicators it holds; the stand-in runs shared through ``stand_ins``.

    Raises:
        ConfigError: A rank that is not one of the layout's.
    """
    from llmem_plugin.device.overheads import device_overheads
    from llmem_plugin.estimate import uses_cublaslt

    overheads_of: dict[tuple[int, ...], Any] = {}
    cache: dict = stand_ins if stand_ins is not None else {}
    out = []
    for r in traced:
        if isinstance(r, bool) or not (isinstance(r, int) and 0 <= r < job.layout.num_gpus):
            raise ConfigError(f"rank {r!r} is not a rank of the {job.layout.num_gpus} GPUs. HINT: pass ranks 0 to "
                              f"{job.layout.num_gpus - 1}")
        sizes = _communicator_sizes(job, specs, r)
        if sizes not in overheads_of:
            overheads_of[sizes] = device_overheads(job.gpu.compute_capability, torch_version=torch_version,
                                                   uses_cublaslt=uses_cublaslt(probe), nccl_world_sizes=sizes)
        out.append(_rank_numbers(model, job, base, _rank_stages(job, specs, r // job.inner), rank=r,
                                 overheads=overheads_of[sizes], cache=cache))
    return out


def _notes(job: _Job, specs: list[StageSpec], traced: list[int], outcomes: list[_RankOutcome]) -> list[str]:
    """Step 5 of :func:`estimate`: the notes: the layout and schedule, the chunks in flight, torchtitan's
    config fields, and which ranks were composed, synthesised or extrapolated."""
    p, v, m, dp, tp, accum = job.degree, job.stages_per_rank, job.microbatches, job.dp, job.tp, job.accumulation
    wl, split = job.workload, job.split
    counts = [s.stop - s.start for s in specs]
    inside = f", each stage FSDP2-sharded over {dp} ranks (reshard_after_forward=False)" if dp > 1 else ""
    if tp > 1:
        inside += (f", tensor parallel {tp}-way inside each stage (torchtitan's plan without sequence parallel: "
                   "stages pass whole activations)")
    notes = [f"torch.distributed.pipelining {SCHEDULES[job.schedule]}: {p} pipeline ranks x {v} stage(s){inside}, "
             f"{m} microbatches of {wl.micro_batch_size} row(s)"
             + (f" per schedule step, {accum} schedule steps per optimizer step (gradient accumulation)"
                if accum > 1 else "") + f"; decoder layers per stage {counts} "
             f"({split if isinstance(split, str) else 'given'}); step(return_outputs={job.return_outputs})",
             "chunks in flight at each pipeline rank's peak: " + ", ".join(
                 f"rank {r}: {len(job.flight[r // job.inner])}" for r in traced)]
    # The interleaved schedules' stages per rank follow torchtitan's pipeline_parallel_layers_per_stage,
    # which this section does not set: only the one-stage and V schedules are written out.
    if split == "torchtitan" and (v == 1 or job.schedule in V_SHAPED):
        notes.append("torchtitan (b5bcd76): " + torchtitan_sections(
            pipeline_degree=p, dp_shard=dp, tp=tp, schedule=job.schedule, microbatches=m,
            micro_batch_size=wl.micro_batch_size, seq_len=wl.seq_len, accumulation=accum))
    return notes + _how_notes(job, traced, outcomes)


def _how_notes(job: _Job, traced: list[int], outcomes: list[_RankOutcome]) -> list[str]:
    """The notes on the ranks reached other than by one full trace: composed, synthesised, extrapolated."""
    composed = sorted({r for r, o in zip(traced, outcomes) if o.composed})
    synthesised = sorted({r for r, o in zip(traced, outcomes) if o.synthesised})
    extrapolated = [r for r, o in zip(traced, outcomes) if o.extrapolated]
    notes = []
    if composed:
        steps = f" in each of {job.accumulation} schedule steps (two run)" if job.accumulation > 1 else ""
        notes.append(f"composed: ranks {composed} from short runs (a smaller pipeline's at two "
                     f"small microbatch counts, or the rank's own) (llmem_plugin.methods.pp.compose), replayed over "
                     f"the real schedule's {job.microbatches} microbatches{steps}; reserved: the longer run's plus "
                     "whole segments for the extra bytes")
    if synthesised:
        notes.append(f"synthesised: ranks {synthesised}' stand-in runs from placeholder stages "
                     "through the stand-in's schedule and one small real run of each kind of rank "
                     "(llmem_plugin.methods.pp.synth), checked on that run's own actions; their reserved starts from "
                     "that real run's")
    if extrapolated:
        notes.append(f"fast: ranks {extrapolated} traced with their stages at 1 and 2 decoder layers, "
                     "extrapolated to their deepest stage's depth; reserved approximate (the larger reserved/allocated "
                     "ratio of the two runs: measured 8-37% over the full-depth estimate)")
    elif job.fast:
        notes.append(f"fast: every rank traced at full depth (stages of at most {FAST_FULL_DEPTH_LAYERS} layers "
                     "cost no more than the two shortened runs)")
    return notes


def _local_numel(name: str, q: torch.Tensor, tp: int) -> int:
    """Elements of parameter ``name`` on one TP rank: the TP plan keeps the norms replicated."""
    return q.numel() if "norm" in name else -(-q.numel() // tp)


def _comm_bytes(job: _Job, base: Any, specs: list[StageSpec]) -> tuple[int, int]:
    """Step 6 of :func:`estimate`: the bytes one rank sends per optimizer step inside a node and across
    nodes: pipeline P2P, FSDP2's gathers and reductions, tensor parallel's (:func:`tensor_parallel_bytes`)."""
    p, v, m, dp, tp, accum = job.degree, job.stages_per_rank, job.microbatches, job.dp, job.tp, job.accumulation
    wl = job.workload
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
        numel = max(sum(_local_numel(n, q, tp) for mod in stage_modules(base, _rank_stages(job, specs, pr))
                        for n, q in mod.named_parameters()) for pr in range(p))
        gather = 2 if wl.precision.autocast_dtype is not None else bytes_per
        reduce = 4 if wl.precision.autocast_dtype is not None else bytes_per
        fsdp_bytes = accum * numel * (gather + reduce) * (dp - 1) // dp  # each TP rank's local shards
    tp_bytes = tensor_parallel_bytes(micro_batch=wl.micro_batch_size, seq_len=wl.seq_len, hidden=hidden,
                                     vocab=int(base.config.vocab_size), layers=rank_layers(job.schedule, p, v, specs),
                                     microbatches=m * accum, tp=tp,
                                     bytes_per=bytes_per, recompute=wl.grad_checkpointing)
    # A pipeline rank's dp x tp ranks are consecutive (torchtitan's mesh: pipeline outermost, TP innermost),
    # so its FSDP2 group stays inside a node when those blocks tile the nodes; TP does (Layout keeps it in a
    # node); pipeline neighbours are dp x tp ranks apart.
    intra, inter = tp_bytes, 0
    if job.layout.gpus_per_node % job.inner == 0:
        intra += fsdp_bytes
    else:
        inter += fsdp_bytes
    if pipeline_across_nodes(job.layout):
        inter += p2p
    else:
        intra += p2p
    return intra, inter


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
    job = _resolve_job(workload, layout=layout, gpu=gpu, alloc_conf=alloc_conf, preset=preset, schedule=schedule,
                       pipeline_degree=pipeline_degree, microbatches=microbatches, stages_per_rank=stages_per_rank,
                       split=split, return_outputs=return_outputs, fast=fast, compose=compose,
                       stand_in_steps=stand_in_steps, placeholders=placeholders)
    job = dataclasses.replace(job, alloc_conf=job.alloc_conf.for_torch(torch_version))
    probe, base, specs = _split_stages(model, job)
    traced = ranks if ranks is not None else _default_ranks(job, base, specs)
    outcomes = _rank_outcomes(model, job, probe, base, specs, traced, torch_version=torch_version,
                              stand_ins=stand_ins)
    intra, inter = _comm_bytes(job, base, specs)
    return MethodEstimate(method=preset, layout=layout, ranks=[o.memory for o in outcomes],
                          comm_intra_node_bytes=intra, comm_inter_node_bytes=inter,
                          notes=_notes(job, specs, traced, outcomes))
