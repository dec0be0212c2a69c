"""Bound: what every candidate of a configuration or unit needs at least, to skip what cannot fit or win.

Before any method is traced (docs/planner.md, "Memory: trace per method, not per candidate"):

* per configuration, its parameter and optimizer-state shards (:func:`_lower_bound`) plus what every
  candidate holds whatever its method (:func:`fixed_bytes`: the CUDA context, a cuBLAS workspace, NCCL's
  buffers) against the GPU limit, and the host RAM its offload needs (:func:`_host_lower_bound`) against the
  host limit;
* after the single-GPU profile, per unit (configuration, checkpointing), the memory bound (shards, the fixed
  bytes, the forward's saved tensors at micro-batch 1, a pipeline's receive buffers:
  :func:`_memory_bound`) against the GPU limit, and the step-time bound (:func:`_time_bound`) that orders
  the screen and prunes it.

A bound may skip a unit only when no candidate of it can fit (memory) or win (time): tests check each
against the traces.
"""

from __future__ import annotations

from llmem_plugin.device.gpus import GPU
from llmem_plugin.device.host import HostCapacity
from llmem_plugin.device.overheads import CUDA_CONTEXT_BYTES, cublas_workspace_bytes, nccl_buffer_bytes
from llmem_plugin.errors import ConfigError
from llmem_plugin.methods import Layout
from llmem_plugin.models.config import num_layers
from llmem_plugin.planner.candidates import (
    _GIB,
    _TRAITS,
    _activation_bytes,
    _cfg_label,
    _Config,
    _Context,
    _Options,
    _Run,
    _shard,
    _unit_label,
)
from llmem_plugin.planner.cost import Overlap, StepWork, step_time
from llmem_plugin.planner.profiles import _Profiles
from llmem_plugin.planner.screen import _pp_work, _Search
from llmem_plugin.planner.space import _BatchError, _micro_batch_plan, _pipeline_splits
from llmem_plugin.workload import OptimizerKind, Precision, Workload

__all__ = ["FIXED_WHAT", "bound_configs", "bound_units", "fixed_bytes"]


def bound_configs(ctx: _Context, configs: list[_Config], run: _Run, host_cap: HostCapacity) -> list[_Config]:
    """The configurations whose parameter and optimizer-state shards fit the GPU limit and whose least host
    need fits the host limit; the others go to ``run.skipped`` with their figure (host ones also to
    ``run.host_needs``)."""
    fixed = fixed_bytes(ctx.gpu, ctx.layout)
    if fixed > ctx.limit:  # no configuration can fit: one line says why
        run.skipped.append(("every method", f"{FIXED_WHAT} alone take {fixed / _GIB:.2f} GiB of the "
                                            f"{ctx.limit / _GIB:.2f} GiB limit"))
        return []
    todo = []
    for cfg in configs:
        lb = _lower_bound(cfg, ctx.layout, ctx.params, ctx.trainable, ctx.workload) + fixed
        host_lb = _host_lower_bound(cfg, ctx.layout, ctx.params, ctx.trainable, ctx.workload)
        if lb > ctx.limit:
            why = f"its parameter and optimizer-state shards and {FIXED_WHAT} take at least {lb / _GIB:.1f} GiB " \
                  f"of the {ctx.limit / _GIB:.1f} GiB limit"
            run.skipped.append((_cfg_label(cfg), why))
        elif host_lb > ctx.host_limit:
            run.skipped.append((_cfg_label(cfg), _host_why(host_lb, ctx.host_limit, host_cap)))
            run.host_needs.append(host_lb)
        else:
            todo.append(cfg)
    return todo


def bound_units(ctx: _Context, opts: _Options, todo: list[_Config], search: _Search, run: _Run) -> None:
    """Profile the single-GPU step (when anything is left to screen), then bound each unit of ``todo``:
    units over the GPU limit, and configurations whose batch does not split over their ranks, go to
    ``run.skipped``; the rest become ``run.pending``, in order of their step-time bound (``run.bound``).

    Raises:
        ConfigError: The global batch splits over none of the configurations.
    """
    if todo:  # nothing left to screen: the model's profile is not needed
        opts.say("profiling the single-GPU step")
        search.profile()
    units, batch_errors = [], []
    for cfg in todo:
        try:
            _micro_batch_plan(ctx, cfg, opts.micro_batch)
        except _BatchError as e:
            run.skipped.append((_cfg_label(cfg), str(e)))
            batch_errors.append(e)
            continue
        for g in opts.gcs:
            need = _memory_bound(ctx, cfg, g, search.profiles)
            if need > ctx.limit:
                run.skipped.append((_unit_label(cfg, g, opts.gcs), _memory_why(ctx, cfg, need)))
            else:
                units.append((cfg, g))
    if todo and len(batch_errors) == len(todo):
        first = batch_errors[0]
        raise ConfigError(f"{first}. HINT: " + (first.hint or "pass a --global-batch that is a multiple of the GPU "
                                                "count" + (" and a --micro-batch that divides it" if opts.micro_batch
                                                           else "")))
    run.bound = {u: _time_bound(ctx, u[0], u[1], search.profiles) for u in units}
    units.sort(key=run.bound.__getitem__)
    run.pending = list(units)


def _memory_why(ctx: _Context, cfg: _Config, need: int) -> str:
    """Why a unit over the limit is skipped: its memory bound and what it holds."""
    what = f"states, {FIXED_WHAT} and the forward's saved tensors at micro-batch 1"
    if cfg.pp > 1:
        fewest = min(m for m, _ in _pipeline_splits(ctx, cfg))
        what = (f"states, {FIXED_WHAT}, the forward's saved tensors at micro-batch 1 and the receive "
                f"buffers of {fewest} microbatches per schedule step")
    return f"needs at least {need / _GIB:.1f} GiB ({what}) of the {ctx.limit / _GIB:.1f} GiB limit"


# ----------------------------------------------------------------------------- memory

FIXED_WHAT = "the CUDA context, cuBLAS workspace and NCCL buffers"


def fixed_bytes(gpu: GPU, layout: Layout) -> int:
    """Device bytes every candidate holds whatever its method, as each method's estimate adds them
    (:func:`llmem_plugin.device.overheads.device_overheads`): the CUDA context; the cuBLAS workspace the
    forward's first matmul makes (:func:`~llmem_plugin.device.overheads.workspace_allocations`; the
    backward's second one is left out); on more than one GPU one NCCL communicator's buffers, since every
    rank joins at least one communicator of two or more ranks (data parallel's, tensor parallel's, or a
    pipeline's 2-rank P2P one) and :func:`~llmem_plugin.device.overheads.nccl_buffer_bytes` is the same
    for every size from 2."""
    nccl = nccl_buffer_bytes(2) if layout.num_gpus > 1 else 0
    return CUDA_CONTEXT_BYTES + cublas_workspace_bytes(tuple(gpu.compute_capability)) + nccl



def _state_bytes_per_element(wl: Workload) -> int:
    """Least optimizer-state bytes per trainable element on any engine."""
    elem = 2 if wl.precision is Precision.BF16 else 4
    # bitsandbytes 8-bit AdamW: two uint8 states (more for tensors under its
    # min_8bit_size); paged states live outside the device fit (docs/techniques/optimizers.md).
    return {OptimizerKind.ADAMW: 2 * elem, OptimizerKind.ADAMW_FUSED: 2 * elem,
            OptimizerKind.ADAMW_FORLOOP: 2 * elem, OptimizerKind.SGD: elem, OptimizerKind.ADAFACTOR: 0,
            OptimizerKind.ADAMW_8BIT: 2, OptimizerKind.PAGED_ADAMW: 0, OptimizerKind.PAGED_ADAMW_8BIT: 0}[wl.optimizer]


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


def _memory_bound(ctx: _Context, cfg: _Config, gc: bool, profiles: _Profiles) -> int:
    """Bytes every candidate of (cfg, gc) holds at least: the parameter and
    optimizer-state shards (:func:`_lower_bound`), the fixed bytes
    (:func:`fixed_bytes`), and the
    forward's saved tensors at micro-batch 1 (the single-GPU profile's,
    less the 16-bit weight copies autocast saves there, which engines that
    keep 16-bit parameters do not make; a TP rank holds at least 1/tp), and
    for a pipeline its receive buffers (:func:`_receive_buffers_bound`)."""
    acts = profiles.point(1, gc).activations
    if ctx.workload.precision.autocast_dtype is not None:
        acts -= 2 * ctx.params
    # A pipeline rank: at least its stage's share, and a TP rank's 1/tp of that.
    tp = cfg.tp if _TRAITS[cfg.method].tp_family else cfg.pp * cfg.tp
    bound = (_lower_bound(cfg, ctx.layout, ctx.params, ctx.trainable, ctx.workload) + fixed_bytes(ctx.gpu, ctx.layout)
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
    schedule step (:func:`~llmem_plugin.planner.space._pipeline_splits`)."""
    m = min(m for m, _ in _pipeline_splits(ctx, cfg))
    es = _activation_bytes(ctx.workload)
    return m * ctx.workload.seq_len * int(ctx.config.hidden_size) * es


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


# ----------------------------------------------------------------------------- step time


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
            layers = num_layers(c)
            tp_bytes = 4 * layers * per_rank * ctx.workload.seq_len * c.hidden_size * es
            comm_intra += (1.5 if gc else 1.0) * tp_bytes * 2 * (cfg.tp - 1) / cfg.tp
    work = StepWork(flops=flops, micro_steps=1, intra_only_bytes=round(comm_intra), cross_node_bytes=round(comm_cross),
                    overlap=Overlap.NONE, optimizer_elements=0 if t.offload else elems,
                    host_optimizer_elements=elems if t.offload else 0, pcie_bytes=pcie,
                    gpus_per_node=ctx.layout.gpus_per_node)
    return step_time(work, gpu=ctx.gpu, precision=ctx.workload.precision, optimizer=ctx.workload.optimizer,
                     network=ctx.network, efficiency=ctx.efficiency).total_s
