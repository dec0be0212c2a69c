"""``gemini``, ``lowlevel-zero1``, ``lowlevel-zero2``: ColossalAI's plugins per rank.

ColossalAI (0.5.0, the release read for every rule below) needs a GPU for
these plugins, so their buffers are *modelled*, as :mod:`.zero` models
DeepSpeed: the model's real forward and backward run under the tracker in the
16-bit dtype the plugin casts the model to (no autocast), hooks placed where
ColossalAI places its own allocate its buffers as fake tensors in program
order, and the event stream goes through the caching-allocator replay
(:func:`llmem_plugin.methods.base.rank_memory`). Rules, file and function
named beside each (``colossalai/`` prefix left out):

* ``gemini`` (booster/plugin/gemini_plugin.py ``GeminiPlugin``, defaults:
  ``placement_policy="static"``, ``shard_param_frac=1.0``,
  ``offload_optim_frac=0.0``, ``master_weights=True``,
  ``enable_gradient_accumulation=False``, ``search_range_m=32``,
  ``min_chunk_size_m=32``, ``hidden_dim=None``):
    - Chunk size (zero/gemini/chunk/search_utils.py
      ``search_chunk_configuration``, called by chunk/utils.py
      ``init_chunk_manager`` with ``search_interval = hidden_dim or 1024``):
      :func:`search_chunk_config`. A model under ``min_chunk_size_m * 2**20``
      elements gets one chunk of its own size, kept gathered (DDP-like).
    - Chunks (chunk/manager.py ``ChunkManager.register_tensor``): parameters
      in ``model.parameters()`` order fill chunks of that size; one larger
      than the chunk gets a chunk of its own, rounded up to ``dp``. The fp32
      master copies fill a second chunk group of the same sizes
      (gemini_ddp.py ``_init_chunks``). :func:`plan_chunks`.
    - Each chunk keeps a ``chunk_size / dp`` shard (chunk/chunk.py
      ``Chunk.__scatter``); an op on a parameter gathers its whole 16-bit
      chunk (``__gather``: the global chunk is allocated, the shard freed),
      and the static policy releases every other releasable chunk at the
      next op (placement_policy.py ``StaticPlacementPolicy.evict_tensors``
      with ``keep_gathered_chunk_mem = 0``). Gradients are copied into the
      gathered 16-bit chunk itself ("fp16 params and grads share chunks",
      ``reuse_fp16_chunk``; gemini_ddp.py ``grad_handle``), and once all of
      a chunk's gradients are in it is reduce-scattered into a new shard
      (``Chunk.reduce``). HybridAdam keeps fp32 m and v for the part of each
      parameter inside the rank's fp32 shard (gemini_optimizer.py
      ``__init__optimizer`` ``get_range_pair``) and updates the fp32 shard
      from the 16-bit gradient shard in place; ``optim_update`` copies it back.
    - ``enable_async_reduce=True`` turns ``pin_memory`` on: every sharded
      chunk keeps a pinned host copy of its shard (``Chunk.close_chunk``),
      reported as host bytes.
* ``lowlevel-zero1`` / ``lowlevel-zero2`` (booster/plugin/low_level_zero_plugin.py
  ``LowLevelZeroPlugin``, defaults: ``reduce_bucket_size_in_m=12``,
  ``overlap_communication=True``, ``cpu_offload=False``,
  ``master_weights=True``, ``overlap_allgather=False``; zero/low_level/
  low_level_optim.py ``LowLevelZeroOptimizer``):
    - Every trainable parameter is padded to a multiple of ``dp`` (a new
      padded 16-bit tensor that the parameter views) and its
      ``ceil(numel / dp)`` slice cloned to fp32 (``_create_master_param_current_rank``).
    - Gradients stay in ``param.grad`` until the bucket (``reduce_bucket_size``
      elements incl. padding) is full (``_add_to_bucket``); the bucket is
      flattened (bookkeeping/bucket_store.py ``get_flatten_grad``) and
      all-reduced (stage 1: the flat buffer is kept, every rank's slices view
      it) or reduce-scattered into a ``1/dp`` buffer (stage 2) (``_run_reduction``).
      Later micro-batches add into the first one's buffers (``_add_grad``).
    - The step casts each gradient slice to fp32, takes its norm in float64
      (``_compute_grad_norm``), steps the torch optimizer on the fp32 slices,
      then casts each slice to 16 bits and all-gathers it through a
      ``reduce_bucket_size`` TensorBucket (bookkeeping/tensor_bucket.py
      ``all_gather``) into the padded parameters.

Known limitations:
    * LowLevelZero stage 2's reduce-scatter outputs are made on its
      communication stream and replayed in that stream's pools
      (:mod:`._streams`); the flat bucket's ``record_stream`` (freed once the
      communication stream's event completes) is taken as freed at once.
    * Gathering and releasing are placed at module granularity (a module's own
      parameters), where ColossalAI hooks each op (``GeminiZeROHook``); the
      modules of a Llama-family decoder use their parameters in one op each.
    * fp16 is traced in bf16 (same element size); the loss scaler's scalars,
      overflow flags and norms are left out; chunk build transients
      (``chunk_temp``) at setup are not modelled.
    * LowLevelZero: one optimizer parameter group (``HybridAdam(model.parameters())``,
      ColossalAI's examples); buffers stay in the module's dtype (the plugin
      casts them too); gradient accumulation reduces every micro-batch (what
      stage 2 requires; stage 1's ``no_sync`` is not modelled).
    * ``hybrid`` (HybridParallelPlugin) is not modelled here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.device.gpus import GPU
from llmem_plugin.methods._colossal_buffers import ChunkPlan, Gemini, LowLevelZero
from llmem_plugin.methods.base import MethodEstimate, ModelStateBytes, rank_memory
from llmem_plugin.methods.layout import Layout
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, TraceResult
from llmem_plugin.workload import OptimizerKind, Precision, Workload

__all__ = [
    "PRESETS",
    "ChunkConfig",
    "ColossalModelStates",
    "bucket_elems",
    "estimate",
    "model_states",
    "plan_chunks",
    "search_chunk_config",
    "unique_params",
]

PRESETS: dict[str, dict[str, Any]] = {
    "gemini": {"plugin": "gemini"},
    "lowlevel-zero1": {"plugin": "lowlevel", "stage": 1},
    "lowlevel-zero2": {"plugin": "lowlevel", "stage": 2},
}

# GeminiPlugin.__init__ defaults (booster/plugin/gemini_plugin.py). The chunk
# search options are taken as given; the others are refused unless default.
_GEMINI_DEFAULTS: dict[str, Any] = {
    "placement_policy": "static", "shard_param_frac": 1.0, "offload_optim_frac": 0.0, "offload_param_frac": 0.0,
    "master_weights": True, "enable_gradient_accumulation": False, "max_prefetch": 0, "strict_ddp_mode": False,
    "tp_size": 1, "extra_dp_size": 1, "use_fp8": False, "fp8_communication": False, "chunk_config_dict": None,
}
# LowLevelZeroPlugin.__init__ defaults (booster/plugin/low_level_zero_plugin.py).
_LOWLEVEL_DEFAULTS: dict[str, Any] = {
    "cpu_offload": False, "master_weights": True, "overlap_allgather": False, "communication_dtype": None,
    "extra_dp_size": 1, "use_fp8": False, "fp8_communication": False,
}
# search_utils.py: sizes are "divided by 2^20" (elements, not bytes).
_MEGA = 1024 ** 2
# chunk/utils.py init_chunk_manager: "search_interval = 1024  # defaults to 1024".
_DEFAULT_SEARCH_INTERVAL = 1024
# Adam m + v, fp32 (HybridAdam / torch AdamW); SGD momentum; Adafactor's flat second moment.
_STATE_BYTES = {OptimizerKind.ADAMW: 8, OptimizerKind.ADAMW_FUSED: 8, OptimizerKind.SGD: 4,
                OptimizerKind.ADAFACTOR: 4}


# ------------------------------------------------------------ gemini chunks
@dataclass(frozen=True, kw_only=True)
class ChunkConfig:
    """``search_chunk_configuration``'s answer for the one dp group.

    Attributes:
        chunk_size: Elements per chunk.
        keep_gathered: The whole model is under ``min_chunk_size_m``: one
            chunk, never sharded.
        total_numel: Elements of all parameters searched.
        waste: Unused elements at the chosen size (their ``min_chunk_waste``).
    """

    chunk_size: int
    keep_gathered: bool
    total_numel: int
    waste: float


def _unused(sizes: list[int], chunk_size: int) -> int:
    """search_utils.py ``_get_unused_byte``, verbatim."""
    acc = left = 0
    for s in sizes:
        if s > left:
            acc += left
            left = chunk_size
        left -= s
    return left + acc


def search_chunk_config(param_numels: list[int], *, dp: int, search_range_m: float = 32,
                        hidden_dim: int | None = None, min_chunk_size_m: float = 32,
                        filter_exlarge_params: bool = True) -> ChunkConfig:
    """Gemini's chunk size for parameters of ``param_numels`` (model order).

    search_utils.py ``search_chunk_configuration``: under ``min_chunk_size``
    elements, one kept-gathered chunk; else params above mean + 3 std are
    filtered out (``_filter_exlarge_params``), and sizes from
    ``ceil(max(min_chunk_size, largest) / interval) * interval`` up to
    ``search_range`` more, in ``interval`` steps, are tried for the least
    unused space; the winner is rounded up to a multiple of ``dp``.

    Raises:
        ConfigError: A negative search range or no parameters.
    """
    if search_range_m < 0:
        raise ConfigError(f"search_range_m must be >= 0, got {search_range_m}")
    if not param_numels:
        raise ConfigError("the model has no parameters to put in chunks")
    interval = hidden_dim or _DEFAULT_SEARCH_INTERVAL
    search_range, min_chunk = round(search_range_m * _MEGA), round(min_chunk_size_m * _MEGA)
    total = sum(param_numels)
    if total < min_chunk:  # "let small parameters keep gathered in CUDA all the time"
        return ChunkConfig(chunk_size=total, keep_gathered=True, total_numel=total, waste=0)
    sizes = list(param_numels)
    if filter_exlarge_params:
        arr = np.array(sizes)
        upper = np.mean(arr) + 3 * np.std(arr)
        sizes = [s for s in sizes if s <= upper]
    start = int(math.ceil(max([min_chunk, *sizes]) / interval) * interval)
    best, best_waste = start, float("inf")
    for size in range(start, start + search_range + 1, interval):
        waste = _unused(sizes, size)
        if waste < best_waste:
            best, best_waste = size, waste
    best += -best % dp  # "the chunk size needs to be divided by each groups sizes" (lcm of one dp)
    return ChunkConfig(chunk_size=best, keep_gathered=False, total_numel=total, waste=best_waste)


def plan_chunks(param_numels: list[int], config: ChunkConfig, *, dp: int) -> list[ChunkPlan]:
    """ChunkManager.register_tensor: fill chunks in order; a new chunk when
    the last is full, sized ``numel`` rounded up to ``dp`` when one param is
    larger than the configured size."""
    chunks: list[list[Any]] = []  # [size, [(idx, off, end)], used]
    for i, n in enumerate(param_numels):
        if chunks and chunks[-1][2] + n <= chunks[-1][0]:
            c = chunks[-1]
        else:
            size = config.chunk_size
            if n > size:
                size = n + (-n % dp)
            c = [size, [], 0]
            chunks.append(c)
        c[1].append((i, c[2], c[2] + n))
        c[2] += n
    return [ChunkPlan(chunk_size=s, keep_gathered=config.keep_gathered, members=tuple(m)) for s, m, _ in chunks]


# ------------------------------------------------------------- model states
# The plugins' per-rank model states: params_bytes are the 16-bit parameters
# at rest (Gemini: chunk shards, which hold the reduced gradients between
# backward and step), grads_bytes the 16-bit gradients kept to the step
# (LowLevelZero), fp32_grads_bytes LowLevelZero's fp32 copies at the step,
# host_bytes Gemini's pinned shard copies.
ColossalModelStates = ModelStateBytes


def unique_params(model: nn.Module) -> list[nn.Parameter]:
    seen: set[int] = set()
    return [p for p in model.parameters() if not (id(p) in seen or seen.add(id(p)))]


def _gemini_states(chunks: list[ChunkPlan], *, dp: int, rank: int, es: int, pinned: bool) -> ColossalModelStates:
    shard = sum(c.shard_size(dp) for c in chunks)
    valid = sum(c.valid(dp, rank) for c in chunks)
    host = (es + 4) * sum(c.shard_size(dp) for c in chunks if not c.keep_gathered) if pinned else 0
    return ColossalModelStates(params_bytes=es * shard, grads_bytes=0, master_bytes=4 * shard,
                               optimizer_state_bytes=8 * valid, fp32_grads_bytes=0, host_bytes=host)


def _lowlevel_states(params: list[nn.Parameter], *, stage: int, dp: int, es: int,
                     optimizer: OptimizerKind) -> ColossalModelStates:
    trainable = [p for p in params if p.requires_grad]
    padded = sum(p.numel() + (-p.numel() % dp) for p in trainable)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    part = padded // dp
    return ColossalModelStates(
        params_bytes=es * (padded + frozen), grads_bytes=es * (padded if stage == 1 else part),
        master_bytes=4 * part, optimizer_state_bytes=_STATE_BYTES[optimizer] * part,
        fp32_grads_bytes=4 * part if es != 4 else 0, host_bytes=0)


# ----------------------------------------------------------------- settings
def _dtype(workload: Workload, plugin: str) -> torch.dtype:
    """The plugin's ``precision``: fp16 / bf16 (Gemini: SUPPORTED_PRECISION
    in gemini_plugin.py), plus fp32 for LowLevelZero (low_level_zero_plugin.py)."""
    dtype = {Precision.BF16_MIXED: torch.bfloat16, Precision.BF16: torch.bfloat16,
             Precision.FP16_MIXED: torch.float16, Precision.FP32: torch.float32}[workload.precision]
    if dtype == torch.float32 and plugin == "gemini":
        raise ConfigError("GeminiPlugin trains in fp16 or bf16 only (SUPPORTED_PRECISION), got --precision fp32. "
                          "HINT: pass --precision bf16-mixed or fp16-mixed")
    return dtype


def _check_options(plugin: str, options: dict[str, Any]) -> dict[str, Any]:
    defaults = _GEMINI_DEFAULTS if plugin == "gemini" else _LOWLEVEL_DEFAULTS
    known = set(defaults) | ({"search_range_m", "hidden_dim", "min_chunk_size_m"} if plugin == "gemini"
                             else {"reduce_bucket_size_in_m", "overlap_communication"})
    for name, value in options.items():
        if name not in known:
            raise ConfigError(f"unknown {plugin} option '{name}'; valid: {', '.join(sorted(known))}")
        if name in defaults and value != defaults[name]:
            raise UnsupportedError(f"{plugin} option {name}={value!r} is not modelled (only the default "
                                   f"{defaults[name]!r}). HINT: drop it to estimate the plugin's default")
    return options


def _setup(model: Any, workload: Workload, layout: Layout, plugin: str,
           options: dict[str, Any]) -> tuple[nn.Module, torch.dtype, OptimizerKind]:
    from llmem_plugin.methods.zero import build_training_model

    name = "GeminiPlugin" if plugin == "gemini" else "LowLevelZeroPlugin"
    if layout.tp != 1:
        raise ConfigError(f"{name} here is pure data parallel; got --tp {layout.tp}. "
                          "HINT: drop --tp (tp must be 1) or pick a tensor-parallel --method")
    _check_options(plugin, options)
    if plugin == "gemini":
        if workload.lora is not None:
            raise UnsupportedError("GeminiPlugin does not support LoRA (GeminiPlugin.support_lora() is False; "
                                   "Booster.enable_lora refuses it). HINT: use lowlevel-zero1/2 for LoRA")
        if workload.grad_accum_steps > 1:
            raise UnsupportedError(
                "gemini with gradient accumulation is not modelled: by default (enable_gradient_accumulation="
                "False) the 16-bit chunks hold the gradients in place of the parameters (reuse_fp16_chunk), so "
                "ColossalAI cannot accumulate; with it on, separate gradient chunks (init_grad_chunk) are used. "
                "HINT: pass --grad-accum 1")
        if workload.optimizer not in (OptimizerKind.ADAMW, OptimizerKind.ADAMW_FUSED):
            raise UnsupportedError(f"GeminiOptimizer accepts only FusedAdam, CPUAdam or HybridAdam "
                                   f"(_AVAIL_OPTIM_LIST), not --optimizer {workload.optimizer.value}. HINT: use adamw")
    dtype = _dtype(workload, plugin)
    meta = build_training_model(model, workload, dtype)
    if not any(p.requires_grad for p in meta.parameters()):
        raise ConfigError("the model has no trainable parameters. HINT: check the LoRA targets")
    kind = OptimizerKind.ADAMW_FUSED if plugin == "gemini" else workload.optimizer
    return meta, dtype, kind


def _gemini_chunks(meta: nn.Module, dp: int, options: dict[str, Any]) -> list[ChunkPlan]:
    numels = [p.numel() for p in unique_params(meta)]
    config = search_chunk_config(numels, dp=dp, search_range_m=options.get("search_range_m", 32),
                                 hidden_dim=options.get("hidden_dim"),
                                 min_chunk_size_m=options.get("min_chunk_size_m", 32))
    return plan_chunks(numels, config, dp=dp)


def bucket_elems(options: dict[str, Any]) -> int:
    # low_level_zero_plugin.py: reduce_bucket_size=reduce_bucket_size_in_m * 1024 * 1024 (elements).
    return int(options.get("reduce_bucket_size_in_m", 12) * _MEGA)


def model_states(model: Any, workload: Workload, *, layout: Layout, plugin: str = "gemini", stage: int = 2,
                 rank: int = 0, **options: Any) -> ColossalModelStates:
    """Model-state bytes of ``rank`` from the plugin's rules alone (no trace).

    Raises:
        ConfigError: tp != 1, fp32 with Gemini, an unknown option.
        UnsupportedError: LoRA or accumulation with Gemini, a non-default option.
    """
    meta, dtype, kind = _setup(model, workload, layout, plugin, options)
    es = torch.empty((), dtype=dtype).element_size()
    if plugin == "gemini":
        return _gemini_states(_gemini_chunks(meta, layout.dp, options), dp=layout.dp, rank=rank, es=es, pinned=True)
    return _lowlevel_states(unique_params(meta), stage=stage, dp=layout.dp, es=es, optimizer=kind)


# ------------------------------------------------------------------ tracing
def _trace_rank(model: nn.Module, workload: Workload, *, make_emulator: Any, dtype: torch.dtype, gpu: GPU,
                capacity: int) -> tuple[TraceResult, Any, Any]:
    """Two steps of the (meta) model under the tracker with the plugin's
    buffers, as :func:`llmem_plugin.methods.zero._trace_rank` runs them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem_plugin.models import modelbuild
    from llmem_plugin.methods._zero_buffers import Buffers
    from llmem_plugin.trace.step import NUM_ITERATIONS, StepHooks, trace_step

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    vocab = int(model.get_input_embeddings().num_embeddings)
    modelbuild.fakeify(model, fake_mode)
    params = unique_params(model)
    from llmem_plugin.methods._rank_tracker import StreamTracker

    tracker = StreamTracker()  # LowLevelZero's stage 2 reduces into buffers on its comm stream
    tracker.watch_modules(model)
    trace_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    buf = Buffers(tracker, SimpleNamespace(dtype=trace_dtype, es=trace_dtype.itemsize), capacity=capacity)
    emu = make_emulator(buf, model, params)

    class Hooks(StepHooks):
        def register_parameters(self, tracker: MemoryTracker, _params: list[torch.Tensor]) -> None:
            # The model's own parameters stand for views into the plugin's
            # buffers (modelled below): HOST, never counted.
            tracker.register(params, MemoryCategory.HOST)

        def setup(self) -> None:
            emu.setup()

        def begin_micro(self, iteration: int, micro: int) -> None:
            buf.counting = iteration == NUM_ITERATIONS - 1
            emu.begin_micro(micro)

        def end_backward(self, iteration: int, micro: int) -> None:
            emu.end_backward()

        def step(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
            emu.step()
            return getattr(emu, "optimizer", None)

    try:
        trace = trace_step(model, workload, vocab_size=vocab, fake_mode=fake_mode, tracker=tracker,
                           compute_capability=gpu.compute_capability, num_sms=gpu.num_sms, autocast=False,
                           hooks=Hooks())
    finally:
        for h in emu.hooks:
            h.remove()
    return trace, buf, emu


# --------------------------------------------------------------- interface
def estimate(
    model: Any, workload: Workload, *, layout: Layout, gpu: GPU, alloc_conf: Any = None,
    torch_version: str | None = None, preset: str = "gemini", plugin: str = "gemini", stage: int = 2,
    **options: Any,
) -> MethodEstimate:
    """Per-rank memory and communication of a ColossalAI plugin.

    Args:
        model: Any model source :func:`llmem_plugin.models.modelbuild.build_model` takes.
        workload: The per-rank workload (micro batch, accumulation, LoRA, ...).
        layout: World size and nodes; ``tp`` must be 1.
        gpu: The GPU of every rank.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` (string or parsed).
        torch_version: Torch of the job, for the overheads.
        preset: Registry name, reported as the method.
        plugin, stage: From the preset (``gemini``; ``lowlevel`` stage 1/2).
        options: Plugin arguments. Gemini: ``search_range_m``, ``hidden_dim``,
            ``min_chunk_size_m`` (modelled); LowLevelZero:
            ``reduce_bucket_size_in_m``, ``overlap_communication`` (modelled);
            the other plugin arguments only at their defaults.

    Returns:
        Rank 0 (Gemini fills shards from rank 0, so it holds the most
        optimizer state; LowLevelZero pads every parameter, so ranks are alike).

    Raises:
        ConfigError: tp != 1, fp32 with Gemini, an unknown option or preset.
        UnsupportedError: LoRA, accumulation or a non-Adam optimizer with
            Gemini; a plugin argument that is not modelled.
    """
    from llmem_plugin.device.allocator_config import AllocatorConfig
    from llmem_plugin.estimate import uses_cublaslt
    from llmem_plugin.methods._zero_buffers import breakdown
    from llmem_plugin.methods.zero import split_comm
    from llmem_plugin.device.overheads import device_overheads

    if plugin not in ("gemini", "lowlevel") or (plugin == "lowlevel" and stage not in (1, 2)):
        raise ConfigError(f"unknown ColossalAI plugin {plugin!r} stage {stage!r}; valid: {', '.join(PRESETS)}")
    meta, dtype, kind = _setup(model, workload, layout, plugin, options)
    es = torch.empty((), dtype=dtype).element_size()
    dp = layout.dp
    conf = (alloc_conf if isinstance(alloc_conf, AllocatorConfig)
            else AllocatorConfig.from_env(alloc_conf)).for_torch(torch_version)
    overheads = device_overheads(gpu.compute_capability, torch_version=torch_version,
                                 uses_cublaslt=uses_cublaslt(meta), nccl_world_sizes=(layout.num_gpus,))
    capacity = gpu.capacity_bytes - overheads.outside_allocator_bytes
    if plugin == "gemini":
        chunks = _gemini_chunks(meta, dp, options)
        states = _gemini_states(chunks, dp=dp, rank=0, es=es, pinned=True)

        def make(buf, m, params):
            return Gemini(buf, m, params, chunks=chunks, dp=dp, rank=0)
        c0 = chunks[0]
        notes = [
            (f"GeminiPlugin (static placement, shard_param_frac=1.0, offload_optim_frac=0.0) modelled from "
             f"ColossalAI 0.5.0 chunk rules over a traced step in {dtype}"),
            f"{len(chunks)} chunk(s) of {c0.chunk_size} elements"
            + (" kept gathered (model under min_chunk_size_m): DDP-like, no sharding" if c0.keep_gathered else
               f", {c0.chunk_size // dp} per rank"),
            "optimizer: HybridAdam (fused, in place on the fp32 shard)",
        ]
    else:
        bucket = bucket_elems(options)
        overlap = options.get("overlap_communication", True)
        states = _lowlevel_states(unique_params(meta), stage=stage, dp=dp, es=es, optimizer=kind)

        def make(buf, m, params):
            return LowLevelZero(buf, m, params, stage=stage, dp=dp, bucket=bucket, overlap=overlap,
                                optimizer=kind, grad_accum_steps=workload.grad_accum_steps)
        notes = [
            (f"LowLevelZeroPlugin stage {stage} modelled from ColossalAI 0.5.0 low_level_optim.py rules over a "
             f"traced step in {dtype}"),
            f"reduce_bucket_size={bucket} elements overlap_communication={overlap}",
            f"optimizer: {kind.value} on the fp32 slices",
        ]
        if workload.grad_accum_steps > 1:
            notes.append("gradient accumulation: every micro-batch is reduced and added (no no_sync)")
    trace, buf, _ = _trace_rank(meta, workload, make_emulator=make, dtype=dtype, gpu=gpu, capacity=capacity)
    rounding = 0
    if states.host_bytes:
        from llmem_plugin.device.host import pinned_bytes

        # Each pinned shard copy is its own pinned allocation (Chunk.close_chunk:
        # torch.empty(shard_size, pin_memory=True)), rounded by the caching host allocator.
        sizes = [b * c.shard_size(dp) for c in chunks if not c.keep_gathered for b in (es, 4)]
        rounding = sum(pinned_bytes(n) - n for n in sizes)
    rank = rank_memory(breakdown(trace, buf), rank=0, gpu=gpu, overheads=overheads, alloc_conf=conf,
                       streams=buf.tracker.stream_of, emptied_cache_bound=plugin == "lowlevel",
                       host_bytes=states.host_bytes, host_pinned_rounding_bytes=rounding)
    intra, inter = split_comm(buf.sent_bytes, layout)
    if dtype == torch.float16:
        notes.append("fp16 traced in bf16 (same element size)")
    if states.host_bytes:
        notes.append(f"host memory: {states.host_bytes} B pinned per rank (enable_async_reduce sets pin_memory)")
    return MethodEstimate(method=preset, layout=layout, ranks=[rank], comm_intra_node_bytes=intra,
                          comm_inter_node_bytes=inter, notes=notes)
