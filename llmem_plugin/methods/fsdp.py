"""``fsdp`` and ``hsdp``: FSDP2 (``fully_shard``) per-rank memory, traced
under a fake process group.

Each traced rank runs, in this one process, what an FSDP2 job runs on it: a
device mesh over a fake process group of the layout's world size
(:mod:`._fakepg`), the model built on meta, ``fully_shard`` on every decoder
layer and then on the root, materialised as fake tensors, and the training
step under the tracker. The fake group's collectives allocate their outputs
and move no data, so the trace holds exactly this rank's storages: padded
parameter shards, all-gathered parameters, all-gather and reduce-scatter
buffers, sharded gradients, optimizer states, activations.

Known limitations:
    * Side streams are replayed with pools of their own
      (:mod:`._streams`): FSDP2 allocates its all-gather buffers on the
      copy-in stream and its reduce-scatter outputs on the reduce-scatter
      stream. A block freed there is reusable at once, as on a GPU: FSDP2
      keeps cross-stream buffers alive by reference (all_gather_state,
      reduce_scatter_states) instead of ``record_stream``, and those
      references run the same on CPU. Equal to the stub CUDA device byte for
      byte on 2 and 8 ranks (benchmarks/results/stub-distributed-2026-11-25.md).
    * The few hundred bytes of metadata CUDA's ``split_with_sizes_copy``
      (the all-gather copy-out) and ``_chunk_cat`` (the reduce-scatter
      copy-in) copy to the device are allocated where the kernels do
      (:mod:`llmem_plugin.trace.emulation.kernels`, and below).
    * ``cpu_offload``: the host-to-device copy of each shard before its
      all-gather and the device-to-host copy of each sharded gradient are
      emulated (a CPU trace has no second device); the optimizer step runs
      on the host and is not traced.
    * Collective bytes are the NCCL ring's, computed, not traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmem_plugin.models import modelbuild
from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.errors import ConfigError, UnsupportedError, tracing
from llmem_plugin.device.gpus import GPU, get_gpu
from llmem_plugin.methods._fakepg import (
    fake_process_group,
    isolated_sharding_propagation,
)
from llmem_plugin.methods._local_step import LocalShardStep
from llmem_plugin.methods._rank_tracker import RankTracker, local
from llmem_plugin.methods.base import MethodEstimate, rank_memory
from llmem_plugin.methods.layout import Layout
from llmem_plugin.device.overheads import device_overheads
from llmem_plugin.trace.step import StepHooks, state_tensors, trace_step
from llmem_plugin.trace.tracker import MemoryCategory, TraceResult
from llmem_plugin.workload import OptimizerKind, Precision, Workload

__all__ = ["PRESETS", "estimate", "fsdp_instrumented"]

# Lightning-style presets. "full": FULL_SHARD, one shard group of every rank.
# "hybrid": HYBRID_SHARD, shard within a node and replicate across nodes
# (FSDP2 HSDP: a 2-D mesh (replicate, shard), fully_shard docstring "mesh").
PRESETS: dict[str, dict[str, Any]] = {
    "fsdp": {"sharding": "full"},
    "hsdp": {"sharding": "hybrid"},
}

_MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None, "none": None}


def estimate(
    model: Any,
    workload: Workload | None,
    *,
    layout: Layout,
    gpu: GPU | str | None,
    alloc_conf: AllocatorConfig | str | None = None,
    torch_version: str | None = None,
    preset: str = "fsdp",
    sharding: str = "full",
    reshard_after_forward: bool = True,
    mixed_precision: str | None = None,
    cpu_offload: bool = False,
    **_: Any,
) -> MethodEstimate:
    """Per-rank memory and communication of FSDP2 training on ``layout``.

    Args:
        model: Model source, as :func:`llmem_plugin.models.modelbuild.build_model` takes.
        workload: The per-rank workload (micro-batch per GPU).
        layout: The cluster; ``tp`` must be 1.
        gpu: Catalog GPU (name or :class:`GPU`).
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` (string or parsed).
        torch_version: Torch the job runs, for version-dependent overheads.
        preset: Registry name reported.
        sharding: "full" (FULL_SHARD) or "hybrid" (HSDP), set by the preset.
        reshard_after_forward: ``fully_shard``'s flag for the decoder layers;
            the root is never resharded after forward (FSDP2's default).
        mixed_precision: FSDP2 ``MixedPrecisionPolicy`` compute dtype
            ("bf16", "fp16", "fp32"/"none"); None takes it from the workload:
            a "-mixed" precision keeps fp32 parameters and gathers them in the
            half type, with fp32 gradient reduction, instead of autocast (what
            torchtitan does under FSDP). "bf16" (pure) keeps bf16 parameters
            and no policy.
        cpu_offload: FSDP2 ``CPUOffloadPolicy``: sharded parameters,
            gradients and optimizer states live on the host.

    Returns:
        The :class:`MethodEstimate`: rank 0, plus the last rank when dim-0
        shards are uneven.

    Raises:
        ConfigError: ``tp`` other than 1, an unknown ``mixed_precision`` or
            ``sharding``, a bad model source.
        UnsupportedError: A model with no decoder layers to wrap; Adafactor,
            whose step fails on DTensor parameters.
    """
    from llmem_plugin.estimate import DEFAULT_GPU, uses_cublaslt

    wl = workload if workload is not None else Workload()
    if layout.tp != 1:
        raise ConfigError(
            f"--method {preset} shards parameters over data parallelism only; got --tp {layout.tp}. "
            "HINT: use --tp 1, or a method that combines FSDP with tensor parallelism"
        )
    if sharding not in ("full", "hybrid"):
        raise ConfigError(f"unknown FSDP sharding '{sharding}'; valid: full, hybrid. HINT: use --method fsdp or hsdp")
    if wl.optimizer is OptimizerKind.ADAFACTOR:
        # Measured on torch 2.13 (real and fake tensors alike): its step
        # multiplies in place by a row norm DTensor keeps as a partial sum.
        raise UnsupportedError(
            f"torch.optim.Adafactor cannot step FSDP2's sharded (DTensor) parameters, so --method {preset} "
            "cannot run it. HINT: use --optimizer adamw, adamw-fused or sgd"
        )
    if not isinstance(reshard_after_forward, bool):
        raise ConfigError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}")
    param_dtype = _param_dtype(wl, mixed_precision)
    target = gpu if isinstance(gpu, GPU) else get_gpu(gpu or DEFAULT_GPU)
    config = (alloc_conf if isinstance(alloc_conf, AllocatorConfig)
              else AllocatorConfig.from_env(alloc_conf)).for_torch(torch_version)
    probe = modelbuild.build_model(model, wl, device="meta")
    model_config = getattr(probe, "config", None)
    if model_config is not None:
        layout.check_model(model_config)
    shard_size = layout.num_gpus if sharding == "full" else layout.gpus_per_node
    settings = {"sharding": sharding, "reshard_after_forward": reshard_after_forward,
                "param_dtype": param_dtype, "cpu_offload": cpu_offload}
    uneven = any(p.dim() and p.shape[0] % shard_size for p in _unique_params(probe))
    ranks = [0, layout.num_gpus - 1] if uneven and layout.num_gpus > 1 else [0]
    communicators = (layout.num_gpus,) if sharding == "full" else (layout.gpus_per_node, layout.num_nodes)
    overheads = device_overheads(target.compute_capability, torch_version=torch_version,
                                 uses_cublaslt=uses_cublaslt(probe), nccl_world_sizes=communicators)
    rows, notes = [], []
    comm = (0, 0)
    for r in ranks:
        traced = _trace_rank(model, wl, layout=layout, rank=r, gpu=target, **settings)
        rows.append(rank_memory(traced.trace, rank=r, gpu=target, overheads=overheads, alloc_conf=config,
                                host_bytes=traced.host_bytes,
                                host_pinned_rounding_bytes=traced.host_pinned_rounding_bytes, streams=traced.streams))
        if traced.padding_bytes:
            notes.append(f"rank {r}: {traced.padding_bytes} B of dim-0 shard padding in parameters and gradients "
                         f"(FSDP2 pads every shard to ceil(dim0 / {shard_size}) rows)")
        if r == 0:
            comm = _comm_bytes(traced.groups, wl, layout, sharding=sharding,
                               reshard_after_forward=reshard_after_forward)
    gather = str(param_dtype).removeprefix("torch.")
    policy = "none" if param_dtype is None else f"MixedPrecisionPolicy(param_dtype={gather}, reduce_dtype=float32)"
    notes.append(f"fully_shard per decoder layer, then the root; reshard_after_forward={reshard_after_forward} "
                 f"(root: False); mixed precision: {policy}; cpu_offload={cpu_offload}")
    return MethodEstimate(method=preset, layout=layout, ranks=rows, comm_intra_node_bytes=comm[0],
                          comm_inter_node_bytes=comm[1], notes=notes)


def _param_dtype(workload: Workload, mixed_precision: str | None) -> torch.dtype | None:
    """The ``MixedPrecisionPolicy.param_dtype`` to run, or None for no policy."""
    if mixed_precision is None:
        return {Precision.BF16_MIXED: torch.bfloat16, Precision.FP16_MIXED: torch.float16}.get(workload.precision)
    key = str(mixed_precision).strip().lower()
    if key not in _MIXED_PRECISION:
        raise ConfigError(
            f"unknown FSDP mixed precision '{mixed_precision}'; valid: {', '.join(_MIXED_PRECISION)}. "
            "HINT: bf16 gathers fp32 parameters in bf16 and reduces gradients in fp32"
        )
    return _MIXED_PRECISION[key]


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())


def _device_mesh(layout: Layout, sharding: str, device_type: str = "cpu"):
    """The data-parallel mesh; build it outside FakeTensorMode (shared FACTS,
    "Distributed under a fake process group"). Dimension names as torchtitan's."""
    from torch.distributed.device_mesh import init_device_mesh

    if sharding == "full":
        return init_device_mesh(device_type, (layout.num_gpus,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(
        device_type, (layout.num_nodes, layout.gpus_per_node), mesh_dim_names=("dp_replicate", "dp_shard")
    )


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules to shard one by one: the classes transformers names in
    ``_no_split_modules``, the default ``transformer_cls_names_to_wrap`` of
    accelerate's FSDP plugin (accelerate/utils/dataclasses.py)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UnsupportedError(
            f"{type(base).__name__} names no decoder-layer class (_no_split_modules) to fully_shard. "
            "HINT: FSDP estimates need a transformers causal LM"
        )
    return layers


def _apply_fsdp(
    model: nn.Module, mesh, *, reshard_after_forward: bool, param_dtype: torch.dtype | None, cpu_offload: bool
) -> None:
    """``fully_shard`` every decoder layer, then the root (in place)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    # torchtitan's default: gather in param_dtype, reduce gradients in fp32.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    # Pinning changes host memory only, and a CPU-only torch cannot pin.
    offload = CPUOffloadPolicy(pin_memory=False) if cpu_offload else OffloadPolicy()
    # torchtitan (parallelize_llama.apply_fsdp) order: layers first, then the
    # root. fully_shard groups the parameters of its module that no nested
    # fully_shard claimed, so this leaves the root group with what lies
    # outside the layers (embeddings, final norm, head) and gathers and frees
    # each layer alone; the root first would make one group of everything.
    # Reversed module order shards nested matches before their parents.
    for layer in reversed(_decoder_layers(model)):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                    offload_policy=offload)
    # reshard_after_forward=None: FSDP2 keeps the root gathered after forward,
    # since backward would gather it again at once (fully_shard docstring).
    fully_shard(model, mesh=mesh, reshard_after_forward=None, mp_policy=mp, offload_policy=offload)


def _materialize(model: nn.Module, fake_mode) -> None:
    """Give the meta shards fake storage.

    Shared FACTS: build on meta, wrap there, then swap to fake. The swap of
    ``modelbuild.fakeify`` rebinds ``Module._parameters``, but FSDP2 keeps its
    own references to every shard (``FSDPParam.sharded_param`` and
    ``_sharded_param_data``) and would go on gathering the meta ones.
    ``Module.to_empty`` runs through ``FSDPModule._apply``, which re-pads the
    new local shards and re-saves those references
    (``FSDPParam.reset_sharded_param``): torchtitan's way from a meta model to
    real memory. ``empty_like`` reads the meta tensors' metadata, hence
    non-fake inputs are allowed for this call only.
    """
    fake_mode.allow_non_fake_inputs = True
    try:
        with fake_mode:
            model.to_empty(device="cpu")
    finally:
        fake_mode.allow_non_fake_inputs = False


# ----------------------------------------------------------------- tracking
# aten/src/ATen/native/cuda/TensorShape.cu: BYTES_PER_BLOCK = BYTES_PER_THREAD
# (16) * BLOCK_SIZE (128), the bytes one thread block of chunk_cat copies.
_CHUNK_CAT_BYTES_PER_BLOCK = 16 * 128


def _chunk_cat_metadata_numel(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> int:
    """int64 elements of the metadata CUDA's ``_chunk_cat`` (dim 0, ``out=``)
    copies to the device, or 0 where it takes the composite path.

    aten/src/ATen/native/cuda/TensorShape.cu ``_chunk_cat_out_cuda``: with
    contiguous inputs and output of one dtype, or bf16 into fp32 (FSDP2's
    reduce-scatter copy-in under ``reduce_dtype=float32``), it packs seven
    int64 vectors (``get_chunk_cat_metadata``: the sources, one entry per
    thread block, two of ``n + 1`` and three of ``n``) into one device tensor
    (``pack_vecs``) that lives until the kernel is launched. Each tensor's
    chunk of ``ceil(dim0 / num_chunks) * trailing * out_elem_size`` bytes
    takes ``ceil(chunk / BYTES_PER_BLOCK)`` blocks.
    """
    same = all(t.dtype == out.dtype for t in tensors)
    upcast = all(t.dtype == torch.bfloat16 for t in tensors) and out.dtype == torch.float32
    if not tensors or not (same or upcast):
        return 0
    if not (out.is_contiguous() and all(t.is_contiguous() for t in tensors)):
        return 0
    blocks = 0
    for t in tensors:
        rows = -(-t.shape[0] // num_chunks) * num_chunks
        chunk_bytes = rows * (t.numel() // max(t.shape[0], 1)) * out.element_size() // num_chunks
        blocks += -(-chunk_bytes // _CHUNK_CAT_BYTES_PER_BLOCK)
    return blocks + 6 * len(tensors) + 2


@contextlib.contextmanager
def fsdp_instrumented(tracker: RankTracker, *, cpu_offload: bool) -> Iterator[None]:
    """Report FSDP2's storage resizes and label its buffers (as
    torch/distributed/_tools/fsdp2_mem_tracker.py instruments FSDP2);
    with ``cpu_offload``, add the host/device copies a CUDA run makes.

    Names patched (torch 2.13, torch/distributed/fsdp/_fully_shard/):
    ``_fsdp_param.alloc_storage`` / ``free_storage`` (unsharded parameters),
    ``_fsdp_param_group.foreach_all_gather`` (its flat output),
    ``foreach_reduce`` (the reduce-scatter input, the HSDP all-reduce buffer)
    and ``_fsdp_collectives.foreach_reduce_scatter_copy_in`` (the metadata
    CUDA's ``_chunk_cat`` kernel allocates, :func:`_chunk_cat_metadata_numel`:
    8 B per 2 KiB of reduce-scatter input, 1 MiB on Llama-3.2-1B's root
    group over 8 ranks, where it raised the allocated peak on the stub CUDA
    device).
    """
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_collectives,
        _fsdp_param,
        _fsdp_param_group,
    )

    names = [(_fsdp_param, "alloc_storage"), (_fsdp_param, "free_storage"), (_fsdp_param, "ShardedState"),
             (_fsdp_param, "FSDPParam"), (_fsdp_param_group, "alloc_storage"),
             (_fsdp_param_group, "foreach_all_gather"), (_fsdp_param_group, "foreach_reduce"),
             (_fsdp_collectives, "foreach_reduce_scatter_copy_in")]
    missing = [f"{owner.__name__}.{name}" for owner, name in names if not hasattr(owner, name)]
    if missing:
        raise UnsupportedError(
            f"torch {torch.__version__} lacks the FSDP2 internals this estimate instruments ({', '.join(missing)}). "
            "HINT: it was written against torch 2.13"
        )
    comm = MemoryCategory.COMM_BUFFER
    fsdp_param_cls = _fsdp_param.FSDPParam
    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage
    gather, reduce = _fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce
    copy_in = _fsdp_collectives.foreach_reduce_scatter_copy_in
    inputs_property = fsdp_param_cls.all_gather_inputs

    def alloc_storage(tensor: torch.Tensor) -> None:
        alloc(tensor)
        tracker.resized([tensor], comm)

    def free_storage(tensor: torch.Tensor) -> None:
        free(tensor)
        tracker.resized([tensor], comm)

    def foreach_all_gather(*args: Any, **kwargs: Any):
        result = gather(*args, **kwargs)
        if result is not None:
            tracker.label([result.all_gather_output], comm)
        return result

    def foreach_reduce(fsdp_params, *args: Any, **kwargs: Any):
        fresh = [fp for fp in fsdp_params if fp.sharded_param.grad is None]
        out = reduce(fsdp_params, *args, **kwargs)
        reduce_scatter_input, all_reduce_input = out[0], out[4]  # held by FSDP past the call
        tracker.label([t for t in (reduce_scatter_input, all_reduce_input) if t is not None], comm)
        if cpu_offload:
            # CUDA: new_sharded_grad.to("cpu") copies each new sharded gradient
            # to the host and drops the device reduce-scatter output; on CPU
            # that call returns the device view itself.
            with torch.no_grad():
                for fp in fresh:
                    host = fp.to_sharded_dtensor(local(fp.sharded_param.grad).clone())
                    fp.sharded_param.grad = host
                    tracker.label([host], MemoryCategory.HOST)
        return out

    def reduce_scatter_copy_in(unsharded_grads, reduce_scatter_input, world_size):
        numel = _chunk_cat_metadata_numel(unsharded_grads, world_size, reduce_scatter_input)
        metadata = torch.empty(numel, dtype=torch.int64, device=reduce_scatter_input.device) if numel else None
        copy_in(unsharded_grads, reduce_scatter_input, world_size)
        del metadata  # freed when _chunk_cat_out_cuda_contiguous returns

    def all_gather_inputs(self):
        if not self.offload_to_cpu or self.sharded_state is not _fsdp_param.ShardedState.SHARDED:
            return inputs_property.fget(self)
        # CUDA: sharded_param_data.to(device) copies the host shard to the
        # device first (then casts it to param_dtype); on CPU it is a no-op.
        staged = self._sharded_param_data.clone()
        host = id(self._sharded_param_data.untyped_storage())
        return [staged if id(t.untyped_storage()) == host else t for t in inputs_property.fget(self)]

    patches = [(_fsdp_param, "alloc_storage", alloc_storage), (_fsdp_param, "free_storage", free_storage),
               (_fsdp_param_group, "alloc_storage", alloc_storage),
               (_fsdp_param_group, "foreach_all_gather", foreach_all_gather),
               (_fsdp_param_group, "foreach_reduce", foreach_reduce),
               (_fsdp_collectives, "foreach_reduce_scatter_copy_in", reduce_scatter_copy_in)]
    if cpu_offload:
        patches.append((fsdp_param_cls, "all_gather_inputs", property(all_gather_inputs)))
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, new in patches:
            setattr(owner, name, new)
        yield
    finally:
        for owner, name, old in saved:
            setattr(owner, name, old)


def _trace_fsdp_step(
    model: nn.Module,
    workload: Workload,
    *,
    vocab_size: int,
    fake_mode=None,
    compute_capability: tuple[int, int],
    num_sms: int | None = None,
    cpu_offload: bool = False,
    streams: dict[int, int] | None = None,
    pinned: dict[str, int] | None = None,
) -> tuple[TraceResult, int]:
    """Trace ``NUM_ITERATIONS`` steps of an FSDP2-wrapped model:
    :func:`llmem_plugin.trace.step.trace_step` with a :class:`RankTracker` (the
    plain tracker would count DTensors at their global size and miss FSDP2's
    in-place storage resizes) and FSDP2's instrumentation. Mixed precision is
    FSDP2's policy, so there is no autocast region.

    Args:
        streams: Filled with the side stream of each allocation FSDP2 made
            off the default stream (its all-gather copy-in and reduce-scatter
            streams), by trace record index.
        pinned: With ``cpu_offload``, filled with "rounding": what the
            caching host allocator adds to the pinned shards and gradients
            (:func:`_pinned_rounding`).

    Returns:
        The trace and the host bytes of offloaded states (0 without offload).
    """
    # FSDP2 initialises on the root's first forward: it picks the root and
    # re-pads every local shard (reset_sharded_param), which allocates on fake
    # storages (no data pointer to compare) and nothing on a real job's
    # padded shards. Run it before tracing, as that allocation is no step's.
    model._get_fsdp_state()._lazy_init()
    tracker = RankTracker(fake_mode)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    host = [0]
    local_step = LocalShardStep()  # the DTensor step's allocations, without its sharding propagation

    class Hooks(StepHooks):
        def step(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
            stepped = local_step(optimizer)
            if cpu_offload:
                host[0] = _host_bytes(params, trainable, state_tensors(stepped))
                if pinned is not None:
                    pinned["rounding"] = _pinned_rounding(params, trainable)
            return stepped

    trace = trace_step(
        model, workload, vocab_size=vocab_size, fake_mode=fake_mode, compute_capability=compute_capability,
        num_sms=num_sms, tracker=tracker, autocast=False, offload=cpu_offload, hooks=Hooks(),
        contexts=[isolated_sharding_propagation(), fsdp_instrumented(tracker, cpu_offload=cpu_offload)],
    )
    if streams is not None:
        streams.update(tracker.stream_of)
    return trace, host[0]


def _host_bytes(params: list[torch.Tensor], trainable: list[torch.Tensor], states: list[torch.Tensor]) -> int:
    """Host memory of offloaded shards: parameters (padded), gradients (as
    copied to the host, unpadded) and optimizer states."""
    shards = sum(local(p).untyped_storage().nbytes() for p in params)
    grads = sum(local(p.grad).numel() * p.grad.element_size() for p in trainable if p.grad is not None)
    return shards + grads + sum(local(t).untyped_storage().nbytes() for t in states)


def _pinned_rounding(params: list[torch.Tensor], trainable: list[torch.Tensor]) -> int:
    """Bytes the caching host allocator adds to FSDP2's pinned host tensors
    (:func:`llmem_plugin.device.host.pinned_bytes`). ``CPUOffloadPolicy(pin_memory=True)``
    (its default) pins each padded parameter shard
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``_init_sharded_param``:
    ``padded_sharded_param.pin_memory()``) and copies each sharded gradient to
    the host with ``non_blocking=True``, which allocates it pinned
    (_fsdp_collectives.py ``foreach_reduce``). Optimizer states
    (``zeros_like`` on the host) are pageable. The trace runs with
    ``pin_memory=False`` (a CPU-only torch cannot pin), so this is added."""
    from llmem_plugin.device.host import pinned_bytes

    sizes = [local(p).untyped_storage().nbytes() for p in params]
    sizes += [local(p.grad).numel() * p.grad.element_size() for p in trainable if p.grad is not None]
    return sum(pinned_bytes(b) - b for b in sizes)


# -------------------------------------------------------------- per rank
@dataclass(frozen=True, kw_only=True)
class _Group:
    """One FSDP parameter group, as its collectives see it.

    Attributes:
        root: Whether it is the root module's group (not resharded after forward).
        gather_bytes: All-gather output: padded unsharded parameters in the gather dtype.
        reduce_bytes: Reduce-scatter input: padded unsharded gradients of the
            trainable parameters, in the reduce dtype.
    """

    root: bool
    gather_bytes: int
    reduce_bytes: int


@dataclass(frozen=True, kw_only=True)
class _RankTrace:
    """One traced rank: its trace, host bytes (offload), dim-0 padding bytes,
    FSDP parameter groups and side streams (record index -> stream)."""

    trace: TraceResult
    host_bytes: int
    padding_bytes: int
    host_pinned_rounding_bytes: int = 0
    groups: list[_Group]
    streams: dict[int, int]


def _fsdp_groups(model: nn.Module) -> tuple[list[_Group], int]:
    """The FSDP parameter groups and this rank's dim-0 padding bytes (shards
    of parameters, and of gradients for trainable ones)."""
    from torch.distributed.fsdp import FSDPModule

    groups, padding = [], 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            gather = reduce = 0
            for fp in group.fsdp_params:
                world = fp.mesh_info.shard_mesh_size
                padded = fp.padded_sharded_param_size.numel()
                trainable = fp.sharded_param.requires_grad
                gather += padded * world * (fp.param_dtype or fp.orig_dtype).itemsize
                if trainable:
                    reduce += padded * world * (fp.reduce_dtype or fp.param_dtype or fp.orig_dtype).itemsize
                padding += (padded - fp.sharded_size.numel()) * fp.orig_dtype.itemsize * (1 + trainable)
            groups.append(_Group(root=module is model, gather_bytes=gather, reduce_bytes=reduce))
    return groups, padding


def _trace_rank(
    source: Any,
    workload: Workload,
    *,
    layout: Layout,
    rank: int,
    gpu: GPU,
    sharding: str,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
    cpu_offload: bool,
) -> _RankTrace:
    """Trace global rank ``rank`` of the FSDP2 job under a fake process group."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_process_group(world_size=layout.num_gpus, rank=rank):
        mesh = _device_mesh(layout, sharding)
        model = modelbuild.build_model(source, workload, device="meta")
        vocab = int(model.get_input_embeddings().num_embeddings)
        _apply_fsdp(model, mesh, reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
                    cpu_offload=cpu_offload)
        fake_mode = FakeTensorMode()
        _materialize(model, fake_mode)
        with tracing(f"the FSDP2 training step of {type(model).__name__}"):
            streams: dict[int, int] = {}
            pinned: dict[str, int] = {}
            trace, host_bytes = _trace_fsdp_step(
                model, workload, vocab_size=vocab, fake_mode=fake_mode,
                compute_capability=gpu.compute_capability, num_sms=gpu.num_sms, cpu_offload=cpu_offload,
                streams=streams, pinned=pinned,
            )
        groups, padding = _fsdp_groups(model)
    return _RankTrace(trace=trace, host_bytes=host_bytes, padding_bytes=padding, groups=groups, streams=streams,
                      host_pinned_rounding_bytes=pinned.get("rounding", 0))


def _comm_bytes(
    groups: list[_Group], workload: Workload, layout: Layout, *, sharding: str, reshard_after_forward: bool
) -> tuple[int, int]:
    """Bytes one rank sends per optimizer step: (intra-node, inter-node).

    NCCL's ring all-gather and reduce-scatter send (n-1)/n of the full
    message per rank, its all-reduce 2(n-1)/n (nccl-tests doc/PERFORMANCE.md,
    "bus bandwidth"). Per micro-batch FSDP2 all-gathers every group in
    forward, again in backward each group resharded after forward (not the
    root), and reduce-scatters the gradients (FSDP2 reduces every micro-batch
    unless ``set_requires_gradient_sync(False)``); HSDP then all-reduces the
    reduce-scatter output across the replicas.

    Split for ``full`` over several nodes: a ring laid out node by node
    crosses between nodes on one link per node, so a node sends (n-1)/n of
    each message out of the node; spread over its GPUs, that is a share
    ``num_nodes / n`` of each rank's bytes, and the rest stays intra-node.
    """
    gathers = sum(g.gather_bytes * (2 if reshard_after_forward and not g.root else 1) for g in groups)
    reduces = sum(g.reduce_bytes for g in groups)
    steps = workload.grad_accum_steps
    if sharding == "full":
        n = layout.num_gpus
        sent = (n - 1) / n * (gathers + reduces) * steps
        inter = sent * layout.num_nodes / n if layout.num_nodes > 1 else 0.0
        return round(sent - inter), round(inter)
    s, r = layout.gpus_per_node, layout.num_nodes
    intra = (s - 1) / s * (gathers + reduces) * steps
    # The all-reduce message is this rank's reduce-scatter output: 1/s of the input.
    inter = 2 * (r - 1) / r * reduces / s * steps
    return round(intra), round(inter)
