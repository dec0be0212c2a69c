"""``pp``: pipeline parallelism with torch's ``torch.distributed.pipelining``, every rank traced.

Each rank runs its stages (:class:`~llmem_plugin.methods.pp_stage.DecoderStage`)
under torch 2.13's own ``PipelineStage`` and schedule, on fake tensors and the
fake process group (:func:`llmem_plugin.methods.pp_stage.run_rank`), for two
steps; the trace goes through the caching-allocator replay like every other
method's. So the schedule's order, the stage's forward cache, its receive
buffers (``m`` activation buffers on non-first stages, ``m`` gradient buffers
on non-last ones, kept across steps), the input gradients accumulated on the
receive buffers until the next step, the last stage's output chunks
(``return_outputs``), and sends held until the schedule drops their work are
what torch's code does; they are checked byte for byte against a real
4-process gloo run on CPU (tests/methods/test_pp.py).

Ranks differ: the first stage holds the embedding, the last the norm, head and
loss, and each schedule keeps a different number of microbatches in flight
per rank (:mod:`llmem_plugin.methods.pp_schedule`). Every rank is reported,
and the worst one decides the verdict.

Scope (each refused in one line): pipeline only (data and tensor parallel
degree 1: the world size is the pipeline degree); pure precisions (fp32,
bf16, fp16: torchtitan runs mixed precision through FSDP, and autocast around
a schedule is not modelled); Llama-family decoders; no gradient accumulation
outside the schedule (its microbatches are the accumulation); unpacked rows.
"""

from __future__ import annotations

from typing import Any

import torch

from llmem_plugin import modelbuild
from llmem_plugin.allocator_config import AllocatorConfig
from llmem_plugin.errors import ConfigError, UnsupportedError, tracing
from llmem_plugin.gpus import GPU, get_gpu
from llmem_plugin.methods.base import MethodEstimate, rank_memory
from llmem_plugin.methods.layout import Layout
from llmem_plugin.methods.pp_schedule import SCHEDULES, in_flight, stages_of_rank
from llmem_plugin.methods.pp_split import SPLITS, colossalai_split, torchtitan_split
from llmem_plugin.methods.pp_stage import StageSpec, run_rank
from llmem_plugin.tracker import MemoryTracker, TraceResult
from llmem_plugin.workload import Workload

__all__ = ["PRESETS", "estimate", "stage_specs", "trace_rank"]

PRESETS: dict[str, dict[str, Any]] = {
    "pp": {"schedule": "1f1b"},
    "pp-gpipe": {"schedule": "gpipe"},
    "pp-interleaved": {"schedule": "interleaved-1f1b"},
    "pp-zbv": {"schedule": "zbv"},
    "pp-dualpipev": {"schedule": "dualpipev"},
    "pp-interleaved-zb": {"schedule": "interleaved-zb"},
}
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
    specs, start = [], 0
    for i, c in enumerate(counts):
        specs.append(StageSpec(i, num_stages, start, start + c))
        start += c
    return specs


def trace_rank(model: Any, workload: Workload, specs: list[StageSpec], *, rank: int, pipeline_degree: int,
               schedule: str, microbatches: int, gpu: GPU, fake: bool = True, group: Any = None) -> TraceResult:
    """Trace ``rank``'s two training steps of its ``specs`` stages: on fake tensors under the fake process
    group, or (``fake=False``, inside a real process group ``group``) on the real model ``model``, which the
    ground-truth runs use."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem_plugin.emulation import cuda_emulation
    from llmem_plugin.methods._fakepg import fake_process_group
    from llmem_plugin.step import make_optimizer

    tracker = MemoryTracker()
    emulation = cuda_emulation(autocast_dtype=None, compute_capability=gpu.compute_capability, num_sms=gpu.num_sms,
                               mark=tracker.mark)
    options = dict(schedule=schedule, microbatches=microbatches, micro_batch_size=workload.micro_batch_size,
                   seq_len=workload.seq_len, optimizer=lambda ps: make_optimizer(ps, workload.optimizer),
                   tracker=tracker, contexts=(emulation,))
    if not fake:
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        run_rank(inner, specs, group=group, **options)
        return tracker.result()
    with fake_process_group(world_size=pipeline_degree, rank=rank):
        built = modelbuild.build_model(model, workload, device="meta")
        fake_mode = FakeTensorMode()
        modelbuild.fakeify(built, fake_mode)
        inner = built.get_base_model() if hasattr(built, "get_base_model") else built
        with tracing(f"pipeline rank {rank} of {type(inner).__name__} ({schedule})"):
            run_rank(inner, specs, fake_mode=fake_mode, **options)
    return tracker.result()


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
    microbatches: int | None = None,
    stages_per_rank: int | None = None,
    split: str | list[int] = "torchtitan",
    ranks: list[int] | None = None,
    **_: Any,
) -> MethodEstimate:
    """Per-rank memory of a pipeline-parallel training step on ``layout`` (pipeline degree = world size).

    Args:
        model: Model source, as :func:`llmem_plugin.modelbuild.build_model` takes.
        workload: ``micro_batch_size`` is one pipeline microbatch's rows.
        schedule: One of :data:`~llmem_plugin.methods.pp_schedule.SCHEDULES`.
        microbatches: Microbatches per step (default: the pipeline degree).
        stages_per_rank: Stages per rank (1 for gpipe/1f1b, 2 for the V schedules, default 2 for the
            interleaved ones).
        split: "torchtitan" (default), "colossalai", or decoder layers per global stage.
        ranks: Trace only these ranks (default: all).

    Raises:
        ConfigError: Bad degrees, microbatches or split.
        UnsupportedError: What the scope above leaves out.
    """
    from llmem_plugin.estimate import DEFAULT_GPU, uses_cublaslt
    from llmem_plugin.overheads import device_overheads

    wl = workload if workload is not None else Workload()
    p = layout.num_gpus
    if layout.tp != 1:
        raise UnsupportedError(f"--method {preset} with --tp {layout.tp}: pipeline stages with tensor parallelism "
                               "inside are not modelled yet. HINT: use --tp 1 (the world size is the pipeline "
                               "degree)")
    if p < 2:
        raise ConfigError(f"--method {preset} needs at least 2 GPUs (the pipeline degree is the world size), got "
                          f"{p}. HINT: pass --gpus N with N >= 2")
    if wl.precision.autocast_dtype is not None:
        raise UnsupportedError(f"--method {preset} with --precision {wl.precision.value}: autocast around a "
                               "pipeline schedule is not modelled (torchtitan runs mixed precision through "
                               "FSDP). HINT: use --precision bf16 or fp32")
    if wl.grad_accum_steps != 1:
        raise ConfigError(f"--method {preset} accumulates over its microbatches; --grad-accum "
                          f"{wl.grad_accum_steps} is not used. HINT: pass --microbatches instead")
    if wl.packed_docs is not None:
        raise UnsupportedError(f"--method {preset} with --packed-docs is not modelled. HINT: drop --packed-docs")
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}. HINT: pick one")
    v = stages_per_rank if stages_per_rank is not None else _DEFAULT_STAGES_PER_RANK[schedule]
    m = microbatches if microbatches is not None else p
    in_flight(schedule, p, m, v)  # the schedule's own checks (degrees, placement, microbatches)
    target = gpu if isinstance(gpu, GPU) else get_gpu(gpu or DEFAULT_GPU)
    config = alloc_conf if isinstance(alloc_conf, AllocatorConfig) else AllocatorConfig.from_env(alloc_conf)
    probe = modelbuild.build_model(model, wl, device="meta")
    base = probe.get_base_model() if hasattr(probe, "get_base_model") else probe
    num_layers = modelbuild.num_layers(base.config)
    specs = stage_specs(num_layers, p * v, split=split)
    overheads_of = {}
    rows = []
    traced = ranks if ranks is not None else list(range(p))
    for r in traced:
        if not (isinstance(r, int) and 0 <= r < p):
            raise ConfigError(f"rank {r!r} is not a rank of the {p}-stage pipeline. HINT: pass ranks 0 to {p - 1}")
        mine = [specs[s] for s in sorted(stages_of_rank(schedule, p, r, v))]
        trace = trace_rank(model, wl, mine, rank=r, pipeline_degree=p, schedule=schedule, microbatches=m,
                           gpu=target)
        neighbours = len({s + d for spec in mine for s, d in ((spec.index, -1), (spec.index, 1))
                          if 0 <= s + d < p * v and (s + d) not in {x.index for x in mine}})
        # ProcessGroupNCCL: a P2P batch of one kind runs on a 2-rank communicator per peer, a mixed batch
        # on the pipeline group's (torch/distributed/pipelining/schedules.py, _warmup_p2p's note).
        sizes = (2,) * neighbours + (p,)
        if sizes not in overheads_of:
            overheads_of[sizes] = device_overheads(target.compute_capability, torch_version=torch_version,
                                                   uses_cublaslt=uses_cublaslt(probe), nccl_world_sizes=sizes)
        rows.append(rank_memory(trace, rank=r, gpu=target, overheads=overheads_of[sizes], alloc_conf=config))
    counts = [s.stop - s.start for s in specs]
    flight = in_flight(schedule, p, m, v)
    notes = [f"torch.distributed.pipelining {SCHEDULES[schedule]}: {p} ranks x {v} stage(s), {m} microbatches of "
             f"{wl.micro_batch_size} row(s); decoder layers per stage {counts} ({split if isinstance(split, str) else 'given'})",
             "chunks in flight at each rank's peak: " + ", ".join(f"rank {r}: {len(flight[r])}" for r in traced)]
    hidden = int(base.config.hidden_size)
    bytes_per = torch.empty((), dtype=next(base.parameters()).dtype, device="meta").element_size()
    # A middle rank sends each microbatch's activations forward and its input gradients back; with stages
    # placed in rank order over the nodes, a node's edge ranks send between nodes.
    p2p = m * v * wl.micro_batch_size * wl.seq_len * hidden * bytes_per * 2
    across = layout.num_nodes > 1
    return MethodEstimate(method=preset, layout=layout, ranks=rows, comm_intra_node_bytes=0 if across else p2p,
                          comm_inter_node_bytes=p2p if across else 0, notes=notes)
