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
from torch import nn

from llmem_plugin import modelbuild
from llmem_plugin.allocator_config import AllocatorConfig
from llmem_plugin.errors import ConfigError, UnsupportedError, tracing
from llmem_plugin.gpus import GPU, get_gpu
from llmem_plugin.methods.base import MethodEstimate, rank_memory
from llmem_plugin.methods.layout import Layout
from llmem_plugin.methods.pp_schedule import SCHEDULES, in_flight, stages_of_rank
from llmem_plugin.methods.pp_split import SPLITS, colossalai_split, torchtitan_split
from llmem_plugin.methods.pp_stage import StageSpec, run_rank, stage_modules
from llmem_plugin.tracker import MemoryTracker, TraceResult
from llmem_plugin.workload import LossImpl, OptimizerKind, Workload

__all__ = ["PRESETS", "estimate", "pipeline_mesh", "shard_stage", "stage_specs", "trace_rank"]

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


def pipeline_mesh(pipeline_degree: int, dp_shard: int) -> Any:
    """torchtitan's mesh order, pipeline outermost: global rank = pipeline rank x dp_shard + shard rank."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (pipeline_degree, dp_shard), mesh_dim_names=("pp", "dp_shard"))


def trace_rank(model: Any, workload: Workload, specs: list[StageSpec], *, rank: int, pipeline_degree: int,
               schedule: str, microbatches: int, gpu: GPU, fake: bool = True, group: Any = None,
               return_outputs: bool = True, dp_shard: int = 1, mesh: Any = None,
               prepare: Any = None, streams: dict[int, int] | None = None) -> TraceResult:
    """Trace global ``rank``'s two training steps of its ``specs`` stages: on fake tensors under the fake
    process group, or (``fake=False``, inside a real process group) on the real model ``model``, which the
    ground-truth runs use.

    Args:
        dp_shard: FSDP2 degree inside each stage (1: none); the pipeline rank is ``rank // dp_shard``.
        group: The real run's pipeline group (``fake=False``, ``dp_shard`` 1).
        mesh: The real run's :func:`pipeline_mesh` (``fake=False``, ``dp_shard`` > 1).
        prepare: Called with the stage modules once sharded (the real run's gloo collectives).
        streams: Filled with the side stream of each allocation FSDP2 makes off the default stream (its
            all-gather and reduce-scatter streams), by trace record index, for :func:`rank_memory`.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem_plugin.emulation import cuda_emulation
    from llmem_plugin.methods._fakepg import fake_process_group, isolated_sharding_propagation
    from llmem_plugin.methods._local_step import LocalShardStep
    from llmem_plugin.methods._rank_tracker import RankTracker
    from llmem_plugin.methods.fsdp import _materialize, _param_dtype, fsdp_instrumented
    from llmem_plugin.step import make_optimizer

    sharded = dp_shard > 1
    param_dtype = _param_dtype(workload, None) if sharded else None

    def run(inner: nn.Module, fake_mode: Any, pp_mesh: Any) -> TraceResult:
        tracker = RankTracker(fake_mode) if sharded else MemoryTracker()
        contexts = [cuda_emulation(autocast_dtype=None, compute_capability=gpu.compute_capability,
                                   num_sms=gpu.num_sms, mark=tracker.mark)]
        modules = None
        extra: dict[str, Any] = {}
        if sharded:
            modules = stage_modules(inner, specs)
            for m in modules:
                shard_stage(m, pp_mesh["dp_shard"], param_dtype)
            if fake_mode is not None:
                for m in modules:
                    _materialize(m, fake_mode)
                extra["step"] = LocalShardStep()
            for m in modules:
                m._get_fsdp_state()._lazy_init()  # as fsdp's trace: the root's re-padding is no step's
            if prepare is not None:
                prepare(modules)
            contexts += [isolated_sharding_propagation(), fsdp_instrumented(tracker, cpu_offload=False)]
            extra["activation_dtype"] = param_dtype
        pp_group = pp_mesh["pp"].get_group() if sharded else group
        run_rank(inner, specs, schedule=schedule, microbatches=microbatches,
                 micro_batch_size=workload.micro_batch_size, seq_len=workload.seq_len,
                 optimizer=lambda ps: make_optimizer(ps, workload.optimizer), tracker=tracker,
                 contexts=tuple(contexts), return_outputs=return_outputs, group=pp_group, fake_mode=fake_mode,
                 modules=modules, **extra)
        if sharded and streams is not None:
            streams.update(tracker.stream_of)
        return tracker.result()

    if not fake:
        return run(model.get_base_model() if hasattr(model, "get_base_model") else model, None, mesh)
    with fake_process_group(world_size=pipeline_degree * dp_shard, rank=rank):
        fake_mesh = pipeline_mesh(pipeline_degree, dp_shard) if sharded else None
        built = modelbuild.build_model(model, workload, device="meta")
        fake_mode = FakeTensorMode()
        if not sharded:
            modelbuild.fakeify(built, fake_mode)
        inner = built.get_base_model() if hasattr(built, "get_base_model") else built
        with tracing(f"pipeline rank {rank} of {type(inner).__name__} ({schedule})"):
            return run(inner, fake_mode, fake_mesh)


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
    **_: Any,
) -> MethodEstimate:
    """Per-rank memory of a pipeline-parallel training step on ``layout``.

    Args:
        model: Model source, as :func:`llmem_plugin.modelbuild.build_model` takes.
        workload: ``micro_batch_size`` is one pipeline microbatch's rows.
        schedule: One of :data:`~llmem_plugin.methods.pp_schedule.SCHEDULES`.
        pipeline_degree: Pipeline ranks (default: the world size). A smaller degree that divides it
            shards each stage with FSDP2 over the ``world / pipeline_degree`` ranks of its data-parallel
            group, as torchtitan composes them (:func:`shard_stage`).
        microbatches: Microbatches per step (default: the pipeline degree).
        stages_per_rank: Stages per rank (1 for gpipe/1f1b, 2 for the V schedules, default 2 for the
            interleaved ones).
        split: "torchtitan" (default), "colossalai", or decoder layers per global stage.
        ranks: Trace only these global ranks (default: every pipeline rank's first shard rank, and its last
            where FSDP2's shards are uneven).
        return_outputs: The schedule's ``step(return_outputs=...)``: torch's default True keeps the last
            stage's logits of every microbatch and concatenates them at the end of the step (torchtitan's
            ``forward_backward_step`` keeps the default, torchtitan/train.py at 000204a); False drops them.

    Raises:
        ConfigError: Bad degrees, microbatches or split.
        UnsupportedError: What the scope above leaves out.
    """
    from llmem_plugin.estimate import DEFAULT_GPU, uses_cublaslt
    from llmem_plugin.overheads import device_overheads

    wl = workload if workload is not None else Workload()
    if layout.tp != 1:
        raise UnsupportedError(f"--method {preset} with --tp {layout.tp}: pipeline stages with tensor parallelism "
                               "inside are not modelled yet. HINT: use --tp 1")
    p = layout.num_gpus if pipeline_degree is None else pipeline_degree
    if isinstance(p, bool) or not isinstance(p, int) or p < 2 or layout.num_gpus % p:
        raise ConfigError(f"--method {preset}: pipeline degree {p!r} must be at least 2 and divide the "
                          f"{layout.num_gpus} GPUs. HINT: pass --gpus N (and --pp K dividing N) with K >= 2")
    dp = layout.num_gpus // p
    if wl.precision.autocast_dtype is not None and dp == 1:
        raise UnsupportedError(f"--method {preset} with --precision {wl.precision.value} and no data parallelism: "
                               "autocast around a pipeline schedule is not modelled (torchtitan runs mixed "
                               "precision through FSDP). HINT: use --precision bf16 or fp32, or --pp below --gpus")
    if wl.grad_accum_steps != 1:
        raise ConfigError(f"--method {preset} accumulates over its microbatches; --grad-accum "
                          f"{wl.grad_accum_steps} is not used. HINT: pass --microbatches instead")
    refused = [(wl.packed_docs is not None, "--packed-docs", "drop --packed-docs"),
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
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}. HINT: pick one")
    v = stages_per_rank if stages_per_rank is not None else _DEFAULT_STAGES_PER_RANK[schedule]
    m = microbatches if microbatches is not None else p
    flight = in_flight(schedule, p, m, v)  # also the schedule's own checks (degrees, placement, microbatches)
    target = gpu if isinstance(gpu, GPU) else get_gpu(gpu or DEFAULT_GPU)
    config = alloc_conf if isinstance(alloc_conf, AllocatorConfig) else AllocatorConfig.from_env(alloc_conf)
    probe = modelbuild.build_model(model, wl, device="meta")
    base = probe.get_base_model() if hasattr(probe, "get_base_model") else probe
    num_layers = modelbuild.num_layers(base.config)
    specs = stage_specs(num_layers, p * v, split=split)

    def stages(pp_rank: int) -> list[StageSpec]:
        return [specs[s] for s in sorted(stages_of_rank(schedule, p, pp_rank, v))]

    if ranks is None:
        traced = []
        for pp_rank in range(p):
            traced.append(pp_rank * dp)
            params = [q for mod in stage_modules(base, stages(pp_rank)) for q in mod.parameters()]
            if dp > 1 and any(q.dim() and q.shape[0] % dp for q in params):
                traced.append(pp_rank * dp + dp - 1)  # FSDP2 pads the last shards: its rank differs
    else:
        traced = ranks
    overheads_of = {}
    rows = []
    for r in traced:
        if isinstance(r, bool) or not (isinstance(r, int) and 0 <= r < layout.num_gpus):
            raise ConfigError(f"rank {r!r} is not a rank of the {layout.num_gpus} GPUs. HINT: pass ranks 0 to "
                              f"{layout.num_gpus - 1}")
        mine = stages(r // dp)
        streams: dict[int, int] = {}
        trace = trace_rank(model, wl, mine, rank=r, pipeline_degree=p, schedule=schedule, microbatches=m,
                           gpu=target, return_outputs=return_outputs, dp_shard=dp, streams=streams)
        neighbours = len({s + d for spec in mine for s, d in ((spec.index, -1), (spec.index, 1))
                          if 0 <= s + d < p * v and (s + d) not in {x.index for x in mine}})
        # ProcessGroupNCCL: a P2P batch of one kind runs on a 2-rank communicator per peer, a mixed batch
        # on the pipeline group's (torch/distributed/pipelining/schedules.py, _warmup_p2p's note); FSDP2
        # gathers and reduces over the data-parallel group.
        sizes = (2,) * neighbours + (p,) + ((dp,) if dp > 1 else ())
        if sizes not in overheads_of:
            overheads_of[sizes] = device_overheads(target.compute_capability, torch_version=torch_version,
                                                   uses_cublaslt=uses_cublaslt(probe), nccl_world_sizes=sizes)
        rows.append(rank_memory(trace, rank=r, gpu=target, overheads=overheads_of[sizes], alloc_conf=config,
                                streams=streams))
    counts = [s.stop - s.start for s in specs]
    inside = f", each stage FSDP2-sharded over {dp} ranks (reshard_after_forward=False)" if dp > 1 else ""
    notes = [f"torch.distributed.pipelining {SCHEDULES[schedule]}: {p} pipeline ranks x {v} stage(s){inside}, {m} "
             f"microbatches of {wl.micro_batch_size} row(s); decoder layers per stage {counts} "
             f"({split if isinstance(split, str) else 'given'}); step(return_outputs={return_outputs})",
             "chunks in flight at each pipeline rank's peak: " + ", ".join(
                 f"rank {r}: {len(flight[r // dp])}" for r in traced)]
    hidden = int(base.config.hidden_size)
    act_dtype = wl.precision.autocast_dtype if dp > 1 and wl.precision.autocast_dtype else next(
        base.parameters()).dtype
    bytes_per = torch.empty((), dtype=act_dtype, device="meta").element_size()
    # A middle pipeline rank sends each microbatch's activations forward and its input gradients back.
    p2p = m * v * wl.micro_batch_size * wl.seq_len * hidden * bytes_per * 2
    # FSDP2 with reshard_after_forward=False gathers a stage's parameters once per step and reduce-scatters
    # its gradients once (no sync until the last microbatch): ring volumes (dp - 1) / dp of each.
    fsdp_bytes = 0
    if dp > 1:
        numel = max(sum(q.numel() for mod in stage_modules(base, stages(pr)) for q in mod.parameters())
                    for pr in range(p))
        gather = 2 if wl.precision.autocast_dtype is not None else bytes_per
        reduce = 4 if wl.precision.autocast_dtype is not None else bytes_per
        fsdp_bytes = numel * (gather + reduce) * (dp - 1) // dp
    # Data-parallel ranks are consecutive (torchtitan's mesh: pipeline outermost), so the FSDP2 group stays
    # inside a node when it fits one; pipeline neighbours are dp ranks apart.
    intra, inter = 0, 0
    if dp <= layout.gpus_per_node:
        intra += fsdp_bytes
    else:
        inter += fsdp_bytes
    if layout.num_nodes > 1:
        inter += p2p
    else:
        intra += p2p
    return MethodEstimate(method=preset, layout=layout, ranks=rows, comm_intra_node_bytes=intra,
                          comm_inter_node_bytes=inter, notes=notes)
