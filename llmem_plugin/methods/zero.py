"""``zero1``, ``zero2``, ``zero3`` (+ ``-offload``): DeepSpeed ZeRO per rank.

DeepSpeed cannot run under fake tensors, so its buffers are *modelled*: the
model's real forward and backward run under the tracker (in the 16-bit dtype
DeepSpeed casts the parameters to, without autocast), and hooks placed where
DeepSpeed places its own allocate DeepSpeed's buffers as fake tensors in
program order. The event stream therefore holds the model's activations and
temporaries as traced and DeepSpeed's buffers as modelled, and goes through
the caching-allocator replay (:func:`llmem_plugin.methods.base.rank_memory`);
all three numbers come from that replay. Rules, read in DeepSpeed 0.19.8
(``deepspeed/runtime/zero/``; file and function named beside each):

* ZeRO-1/2 (``stage_1_and_2.py``, ``DeepSpeedZeroOptimizer.__init__``): each
  optimizer param group (HF Trainer: decay / no-decay, trainable only) is
  flattened into one 16-bit buffer padded to ``2 * dp`` elements
  (``nccl_start_alignment_factor``), split into ``dp`` equal partitions; the
  rank's partition is cloned into fp32 master weights; Adam's m and v follow
  at the first step. Gradients: a ``reduce_bucket_size`` bucket (two with
  ``overlap_comm``; ``setup_buckets``) per backward, each bucket flattened and
  all-reduced (``allreduce_bucket``), and the rank's own gradients copied into
  ``grads_in_partition`` (all params touching the partition, whole). Stage 1
  keeps every full 16-bit gradient until the accumulation boundary
  (``reduce_gradients``); stage 2 reduces in the backward hooks and, with
  gradient accumulation, keeps the first micro-step's partition buffer and
  adds later ones into it (``independent_gradient_partition_epilogue``). The
  step flattens the partition gradients and casts them to fp32 per group; the
  updated params are all-gathered in place (runtime/utils.py
  ``all_gather_dp_groups`` uses ``all_gather_into_tensor``), so
  ``allgather_bucket_size`` allocates nothing.
* ZeRO-3 (``stage3.py``, ``partition_parameters.py``,
  ``partitioned_param_coordinator.py``): every parameter keeps a
  ``ceil(numel / dp)`` partition; those of trainable params are defragmented
  into one buffer, and params of at most ``stage3_param_persistence_threshold``
  elements stay whole. Each module with parameters gathers them before its
  forward and backward and releases them after, with DeepSpeed's trace
  rules: the first forward records the module order, later ones prefetch up
  to ``stage3_prefetch_bucket_size`` (bounded by ``stage3_max_live_parameters``)
  and keep params reused within ``stage3_max_reuse_distance``. Gradients go
  through one persistent bucket into a persistent partition buffer
  (``_setup_for_real_optimizer``); the step casts each sub group to fp32.
* Offload (``offload_optimizer`` / ``offload_param`` device ``cpu``): master
  weights, fp32 gradients and optimizer states (and with ZeRO-3 the 16-bit
  gradient partitions, plus the parameter partitions with ``offload_param``)
  live in host memory; they are counted in ``host_bytes``, not on the GPU.

DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs``,
``estimate_zero3_model_states_mem_needs``) count ``2P + 18P/n`` (ZeRO-2) and
``4 * largest_layer + 18P/n`` (ZeRO-3) bytes; :func:`model_states` agrees
where the rules coincide and differs where their formulas simplify:

* ZeRO-2 16-bit gradients: they count ``2P/n``; DeepSpeed's buffer holds the
  whole of every parameter touching the partition, so ours is larger by the
  params straddling partition boundaries.
* ZeRO-3: their ``18P/n`` holds one 16-bit term; DeepSpeed 0.19.8 keeps both
  the 16-bit parameter partitions and a 16-bit gradient partition buffer,
  so ours is ``2P/n`` larger; persistent params add their full size. Their
  ``4 * largest_layer`` stands for gathered params and gradients, which the
  trace holds as they happen (with DeepSpeed's reuse and prefetch rules).
* Padding: they divide exactly; DeepSpeed pads (above).
* Neither estimator holds activations, temporaries, buckets or the fp32
  gradient cast at the step; the trace does.

Known limitations:
    * One stream: DeepSpeed's side streams (``overlap_comm``) delay frees
      (``record_stream``); frees here happen at once.
    * Fetch granularity follows DeepSpeed's default
      (``stage3_module_granularity_threshold`` 0); gathers of parameters used
      outside their module (``ds_external`` params) and the recompute
      attribution of frozen params are not modelled.
    * Small scratch tensors (norms, zero pads, overflow flags) are left out.
    * fp16 is traced in bf16 (same element size); NVMe offload, quantized
      weights or gradients, hpZ, ZenFlow and other listed options are refused.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.device.gpus import GPU
from llmem_plugin.methods._zero_buffers import Buffers, Zero3, Zero12, _Group, _Plan, breakdown
from llmem_plugin.methods.base import MethodEstimate, ModelStateBytes, new_tracker, rank_memory
from llmem_plugin.methods.layout import Layout
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, TraceResult
from llmem_plugin.workload import OptimizerKind, Precision, Workload

__all__ = [
    "PRESETS",
    "ZeroConfig",
    "ZeroModelStates",
    "build_training_model",
    "estimate",
    "model_states",
    "split_comm",
]

PRESETS: dict[str, dict[str, Any]] = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2-offload": {"stage": 2, "offload_optimizer": True},
    "zero3-offload": {"stage": 3, "offload_optimizer": True, "offload_param": True},
}

# stage_1_and_2.py: nccl_start_alignment_factor = 2 ("4-byte alignment /
# sizeof(fp16)"); each group's flat buffer is padded to a multiple of it * dp.
_NCCL_START_ALIGNMENT = 2
# Optimizer state bytes per fp32 master element: Adam m + v (fp32); SGD's
# momentum; torch Adafactor keeps one full second moment for a 1-D (flat)
# parameter (torch/optim/_adafactor.py, "row_var" only for ndim >= 2).
_STATE_BYTES = {OptimizerKind.ADAMW: 8, OptimizerKind.ADAMW_FUSED: 8, OptimizerKind.SGD: 4,
                OptimizerKind.ADAFACTOR: 4}
# zero_optimization keys that change buffers this module does not model.
_REFUSED_TRUE = ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
                 "round_robin_gradients", "parameter_alignment", "stage3_use_all_reduce_for_fetch_params",
                 "use_all_reduce_for_fetch_params", "zenflow", "cpu_offload", "cpu_offload_param")


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The ``zero_optimization`` settings that size buffers.

    Defaults are ``DeepSpeedZeroConfig``'s (deepspeed/runtime/zero/config.py,
    0.19.8); ``overlap_comm`` defaults to ``stage == 3`` (its validator).
    """

    stage: int
    offload_optimizer: bool = False
    offload_param: bool = False
    reduce_bucket_size: int = 500_000_000
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None
    use_multi_rank_bucket_allreduce: bool = True
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = sys.maxsize
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    allgather_sequential: bool = False

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ConfigError(f"ZeRO stage must be 1, 2 or 3, got {self.stage!r}. HINT: pick zero1, zero2 or zero3")
        if self.offload_param and self.stage != 3:
            raise ConfigError(f"offload_param needs ZeRO stage 3, got stage {self.stage} "
                              "(DeepSpeed config docs: 'Valid only with stage 3'). HINT: use zero3-offload")
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)

    @classmethod
    def from_deepspeed(cls, config: dict[str, Any] | None, *, stage: int, offload_optimizer: bool,
                       offload_param: bool, hidden_size: int | None) -> ZeroConfig:
        """Settings from a DeepSpeed config dict; ``"auto"`` values are filled
        as HF Trainer fills them (transformers integrations/deepspeed.py,
        ``trainer_config_finalize``): ``reduce_bucket_size = hidden**2``,
        ``stage3_prefetch_bucket_size = int(0.9 * hidden**2)``,
        ``stage3_param_persistence_threshold = 10 * hidden``.

        Raises:
            ConfigError: A stage that contradicts the method, an unknown "auto".
            UnsupportedError: NVMe offload or an option that is not modelled.
        """
        zero = dict((config or {}).get("zero_optimization") or {})
        if "stage" in zero and int(zero["stage"]) != stage:
            raise ConfigError(f"the DeepSpeed config says zero_optimization.stage {zero['stage']} but the method is "
                              f"ZeRO-{stage}. HINT: pick --method zero{zero['stage']} or fix the config")
        for name in _REFUSED_TRUE:
            if zero.get(name):
                raise UnsupportedError(f"zero_optimization.{name} is not modelled. HINT: drop it to estimate")
        if int(zero.get("zero_hpz_partition_size", 1)) > 1:
            raise UnsupportedError("zero_hpz_partition_size > 1 (hpZ) is not modelled. HINT: drop it to estimate")
        if str(zero.get("stage3_module_granularity_threshold", 0)) not in ("0", "auto"):
            raise UnsupportedError("stage3_module_granularity_threshold is not modelled. HINT: drop it")
        grad_accum = ((config or {}).get("data_types") or {}).get("grad_accum_dtype")
        if grad_accum not in (None, "auto"):
            raise UnsupportedError(f"data_types.grad_accum_dtype {grad_accum!r} is not modelled; the default "
                                   "accumulates in the model dtype (engine.get_data_types). HINT: drop it")
        hidden = {"reduce_bucket_size": None if hidden_size is None else hidden_size ** 2,
                  "prefetch_bucket_size": None if hidden_size is None else int(0.9 * hidden_size ** 2),
                  "param_persistence_threshold": None if hidden_size is None else 10 * hidden_size}
        kwargs: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if field.name in ("stage", "offload_optimizer", "offload_param"):
                continue
            value = zero.get(field.name, zero.get(f"stage3_{field.name}"))
            if value is None:
                continue
            if value == "auto":
                if hidden.get(field.name) is None:
                    raise ConfigError(f"zero_optimization.{field.name} is 'auto', which HF Trainer does not fill. "
                                      "HINT: give a number")
                value = hidden[field.name]
            kwargs[field.name] = bool(value) if str(field.type).startswith("bool") else int(float(value))
        opt_dev = _offload_device(zero.get("offload_optimizer"), offload_optimizer, "offload_optimizer")
        par_dev = _offload_device(zero.get("offload_param"), offload_param, "offload_param")
        return cls(stage=stage, offload_optimizer=opt_dev, offload_param=par_dev, **kwargs)


def read_deepspeed_config(source: str | dict[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config: a dict, inline JSON text, or the path of a JSON file.

    Raises:
        ConfigError: The file is missing or not a JSON object.
    """
    if isinstance(source, dict):
        return source
    if not isinstance(source, str):
        raise ConfigError(f"the DeepSpeed config {source!r} is neither a path nor a mapping. HINT: pass a JSON "
                          "file or a dict")
    import json

    text = source.strip()
    try:
        if text.startswith("{"):
            ds = json.loads(text)
        else:
            with open(source, encoding="utf-8") as f:
                ds = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the DeepSpeed config {source!r}: {' '.join(str(e).split())}. HINT: pass a "
                          "JSON file or a dict") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"the DeepSpeed config {source!r} is not a JSON object. HINT: pass a ZeRO config")
    return ds


def deepspeed_method(ds: dict[str, Any]) -> tuple[str, bool, bool]:
    """(method, offload_optimizer, offload_param) a DeepSpeed config asks for.

    Raises:
        UnsupportedError: ZeRO stage 0 (DeepSpeed's own data parallelism) or an unknown stage.
        ConfigError: An offload device that is not cpu, nvme or none.
    """
    zero = ds.get("zero_optimization", {}) or {}
    if not isinstance(zero, dict):
        raise ConfigError(f"zero_optimization {zero!r} is not a mapping. HINT: write it as {{\"stage\": 3, ...}}")
    for section in ("offload_optimizer", "offload_param"):
        if zero.get(section) is not None and not isinstance(zero[section], dict):
            raise ConfigError(f"zero_optimization.{section} {zero[section]!r} is not a mapping. HINT: write it as "
                              "{\"device\": \"cpu\"}")
    try:
        stage = int(zero.get("stage", 0))
    except (TypeError, ValueError):
        raise ConfigError(f"zero_optimization.stage {zero.get('stage')!r} is not 0-3. HINT: set 1, 2 or 3") from None
    if stage not in (1, 2, 3):
        raise UnsupportedError(f"DeepSpeed ZeRO stage {stage} is not modelled. HINT: use stage 1, 2 or 3")
    return (f"zero{stage}", _offload_device(zero.get("offload_optimizer"), False, "offload_optimizer"),
            _offload_device(zero.get("offload_param"), False, "offload_param"))


def _offload_device(section: Any, default: bool, name: str) -> bool:
    if section is None:
        return default
    device = str((section or {}).get("device", "none")).lower()
    if device == "nvme":
        raise UnsupportedError(f"{name} to NVMe is not modelled. HINT: use device 'cpu'")
    if device not in ("cpu", "none"):
        raise ConfigError(f"{name}.device {device!r} is not one of cpu, nvme, none")
    return device == "cpu"


@dataclass(frozen=True, kw_only=True)
class ZeroModelStates(ModelStateBytes):
    """Model-state bytes of one rank, from DeepSpeed's partitioning rules.

    Attributes:
        params_bytes: 16-bit parameters on the GPU (full for ZeRO-1/2,
            partitions plus persistent params for ZeRO-3).
        grads_bytes: 16-bit gradients kept between backward and step (ZeRO-1/2
            ``grads_in_partition``; ZeRO-3 partition buffer).
        master_bytes: fp32 master weights on the GPU.
        optimizer_state_bytes: Optimizer states on the GPU.
        fp32_grads_bytes: fp32 gradient partitions cast at the step (all
            groups; DeepSpeed holds one group at a time).
        host_bytes: Host memory for offloaded states, per rank.
        padded_trainable: Trainable elements per rank incl. padding.
    """

    padded_trainable: int


# ----------------------------------------------------------------- planning
def _decay_groups(model: nn.Module, trainable: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """HF Trainer's two groups (trainer.py ``create_optimizer``): decay, then no-decay."""
    import transformers

    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    keep = {id(p) for p in trainable}
    seen: set[int] = set()
    named = [(n, p) for n, p in model.named_parameters() if id(p) in keep and not (id(p) in seen or seen.add(id(p)))]
    groups = [[p for n, p in named if n in decay], [p for n, p in named if n not in decay]]
    return [g for g in groups if g]


def _partition_info(params: list[nn.Parameter], partition: int, rank: int) -> list[nn.Parameter]:
    """stage_1_and_2.py ``get_partition_info``: params with an element in the rank's range."""
    start, end, cur, out = partition * rank, partition * (rank + 1), 0, []
    for p in params:
        if start <= cur < end or cur < start < cur + p.numel():
            out.append(p)
        cur += p.numel()
    return out


def _plan(model: nn.Module, *, cfg: ZeroConfig, dp: int, rank: int, dtype: torch.dtype,
          optimizer: OptimizerKind) -> _Plan:
    seen: set[int] = set()
    params = [p for p in model.parameters() if not (id(p) in seen or seen.add(id(p)))]
    trainable = [p for p in params if p.requires_grad]
    groups = []
    if cfg.stage < 3:
        for ps in _decay_groups(model, trainable):
            align = _NCCL_START_ALIGNMENT * dp
            aligned = -(-sum(p.numel() for p in ps) // align) * align
            groups.append(_Group(ps, aligned, aligned // dp, _partition_info(ps, aligned // dp, rank)))
    # parameter_offload.py mark_persistent_parameters (named_parameters order).
    persistent, total = set(), 0
    if cfg.stage == 3:
        for p in params:
            if p.numel() + total > cfg.model_persistence_threshold:
                continue
            if p.numel() <= cfg.param_persistence_threshold:
                persistent.add(id(p))
                total += p.numel()
    # stage3.py _create_fp16_sub_groups: split a group once its partitions reach sub_group_size.
    sub_groups: list[list[nn.Parameter]] = []
    decay_groups = _decay_groups(model, trainable) if cfg.stage == 3 else []
    for ps in decay_groups:
        cur: list[nn.Parameter] = []
        size = 0
        for p in ps:
            cur.append(p)
            size += -(-p.numel() // dp)
            if size >= cfg.sub_group_size or p is ps[-1]:
                sub_groups.append(cur)
                cur, size = [], 0
    return _Plan(cfg.stage, dp, rank, dtype, cfg, optimizer, params, trainable, groups, persistent, sub_groups,
                 decay_groups)


def _states(plan: _Plan, grad_accum_steps: int = 1) -> ZeroModelStates:
    es, stage, cfg = plan.es, plan.stage, plan.cfg
    state_b = _STATE_BYTES[plan.optimizer]
    if stage < 3:
        frozen = sum(p.numel() for p in plan.params if not p.requires_grad)
        part = sum(g.partition for g in plan.groups)
        params_b = es * (sum(g.aligned for g in plan.groups) + frozen)
        grads_b = 0 if cfg.offload_optimizer else es * plan.in_numel()
        # Host: fp32 master, fp32 grads, states and the 16-bit copy-back buffer
        # (param_buffer_of_bit16_for_cpu_offload_groups).
        # + temp_grad_buffer_for_cpu_offload: the largest trainable param, 16-bit, pinned (__init__).
        host = part * (4 + 4 + state_b + es) + es * max((p.numel() for p in plan.trainable), default=0)
        if grad_accum_steps > 1:  # accumulated_grads_in_cpu: whole in-partition params, 16-bit
            host += es * plan.in_numel()
    else:
        part = sum(plan.part(p) for p in plan.trainable)
        frozen_part = sum(plan.part(p) for p in plan.params if not p.requires_grad)
        persist_full = sum(p.numel() for p in plan.params if id(p) in plan.persistent)
        on_gpu_part = (part + frozen_part) if not cfg.offload_param else sum(
            plan.part(p) for p in plan.params if id(p) in plan.persistent)
        params_b = es * (on_gpu_part + persist_full)
        grads_b = 0 if cfg.offload_optimizer else es * part
        host = part * (4 + 4 + state_b + es)  # + grad_partitions_flat_buffer on the host
        if cfg.offload_param:
            host += es * sum(plan.part(p) for p in plan.params if id(p) not in plan.persistent)
    device = not cfg.offload_optimizer
    return ZeroModelStates(
        params_bytes=params_b, grads_bytes=grads_b, master_bytes=4 * part if device else 0,
        optimizer_state_bytes=state_b * part if device else 0, fp32_grads_bytes=4 * part if device else 0,
        host_bytes=0 if device else host, padded_trainable=part,
    )


def _pinned_rounding(plan: _Plan, grad_accum_steps: int = 1) -> int:
    """Bytes the caching host allocator adds to DeepSpeed's pinned offload
    buffers (:func:`llmem_plugin.device.host.pinned_bytes`), with
    ``offload_optimizer.pin_memory`` at its default, True
    (runtime/zero/offload_config.py); 0 without offload. DeepSpeed pins
    through ``get_accelerator().pin_memory`` = ``tensor.pin_memory()``
    (accelerator/abstract_accelerator.py, backend "torch" by default). The
    optimizer states (DeepSpeedCPUAdam's ``zeros_like``) and ZeRO-3's fp32
    partitions (``.clone()`` of a host tensor) are pageable.

    * Stage 1/2 (stage_1_and_2.py ``__init__``): per group, the fp32
      partition, the 16-bit copy-back buffer and the fp32 gradient
      partition; ``temp_grad_buffer_for_cpu_offload``; with accumulation, one
      buffer per in-partition param (``buffer_to_accumulate_to_in_cpu``).
    * Stage 3 (stage3.py): ``grad_partitions_flat_buffer``, each sub group's
      fp32 gradient buffer, and with ``offload_param`` each trainable
      group's 16-bit flat buffer (``_create_param_groups_fp16_flat_cpu_memory``)
      and each frozen param's partition.
    """
    from llmem_plugin.device.host import pinned_bytes

    if not plan.cfg.offload_optimizer:
        return 0
    es = plan.es
    sizes: list[int] = []
    if plan.stage < 3:
        for g in plan.groups:
            sizes += [4 * g.partition, es * g.partition, 4 * g.partition]
        sizes.append(es * max((p.numel() for p in plan.trainable), default=0))
        if grad_accum_steps > 1:
            sizes += [es * p.numel() for g in plan.groups for p in g.in_partition]
    else:
        sizes.append(es * sum(plan.part(p) for p in plan.trainable))
        sizes += [4 * sum(plan.part(p) for p in sg) for sg in plan.sub_groups]
        if plan.cfg.offload_param:
            sizes += [es * sum(plan.part(p) for p in g) for g in plan.decay_groups]
            sizes += [es * plan.part(p) for p in plan.params
                      if not p.requires_grad and id(p) not in plan.persistent]
    return sum(pinned_bytes(b) - b for b in sizes)


# ------------------------------------------------------------------ tracing
def _training_dtype(workload: Workload, config: dict[str, Any] | None) -> torch.dtype:
    """The 16-bit (or fp32) dtype DeepSpeed casts params to (engine
    _configure_distributed_model): bf16/fp16 from the config, else the workload's."""
    want = {Precision.BF16_MIXED: torch.bfloat16, Precision.BF16: torch.bfloat16,
            Precision.FP16_MIXED: torch.float16, Precision.FP32: torch.float32}[workload.precision]
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        enabled = ((config or {}).get(key) or {}).get("enabled")
        if enabled is True and want != dtype:
            raise ConfigError(f"the DeepSpeed config enables {key} but --precision is {workload.precision.value}. "
                              f"HINT: pass a matching --precision or fix the config")
    return want


def build_training_model(model: Any, workload: Workload, dtype: torch.dtype) -> nn.Module:
    """The meta model in DeepSpeed's dtype: params cast, buffers kept
    ("Cast params only; preserve fp32 buffers", engine.py)."""
    from llmem_plugin.models import modelbuild

    # fp16 is traced in bf16: same element size, and CPU kernels favour bf16.
    precision = Precision.FP32 if dtype == torch.float32 else Precision.BF16
    m = modelbuild.build_model(model, dataclasses.replace(workload, precision=precision), device="meta")
    trace_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    for p in m.parameters():
        if p.dtype != trace_dtype:
            p.data = torch.empty_like(p, dtype=trace_dtype, device="meta")
    return m


def _optimizer_kind(workload: Workload, config: dict[str, Any] | None, cfg: ZeroConfig) -> OptimizerKind:
    """DeepSpeed's own Adam (a config "optimizer" section) is FusedAdam, one
    multi-tensor kernel without temporaries, like torch's fused AdamW; with
    offload it is DeepSpeedCPUAdam (zero_force_ds_cpu_optimizer)."""
    section = (config or {}).get("optimizer")
    if section:
        kind = str(section.get("type", "")).lower()
        params = section.get("params") or {}
        # engine.py: getattr(torch.optim, type) for types DeepSpeed does not
        # name itself; "torch_adam" builds torch.optim.AdamW(foreach=...)
        # (get_optimizer_configuration), foreach None being foreach on CUDA.
        if kind in ("sgd", "adafactor") and not cfg.offload_optimizer:
            return OptimizerKind.SGD if kind == "sgd" else OptimizerKind.ADAFACTOR
        if kind not in ("adam", "adamw"):
            raise UnsupportedError(f"DeepSpeed optimizer type {section.get('type')!r} is not modelled. "
                                   "HINT: use Adam/AdamW or leave the optimizer to the trainer")
        if params.get("torch_adam") and not cfg.offload_optimizer:
            return OptimizerKind.ADAMW_FORLOOP if params.get("foreach") is False else OptimizerKind.ADAMW
        return OptimizerKind.ADAMW_FUSED
    if cfg.offload_optimizer and workload.optimizer not in (OptimizerKind.ADAMW, OptimizerKind.ADAMW_FUSED):
        raise UnsupportedError(f"ZeRO-Offload runs DeepSpeedCPUAdam; --optimizer {workload.optimizer.value} is "
                               "refused by zero_force_ds_cpu_optimizer. HINT: use adamw")
    return workload.optimizer


def _trace_rank(model: nn.Module, workload: Workload, *, plan_args: dict[str, Any], gpu: GPU,
                capacity: int) -> tuple[TraceResult, Buffers, _Plan]:
    """Two steps of the (meta) model under the tracker with DeepSpeed's
    buffers, as step.trace_step runs them; ``plan_args`` go to :func:`_plan`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from llmem_plugin.models import modelbuild
    from llmem_plugin.trace.step import NUM_ITERATIONS, StepHooks, trace_step

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    vocab = int(model.get_input_embeddings().num_embeddings)
    modelbuild.fakeify(model, fake_mode)
    plan = _plan(model, **plan_args)  # after fakeify: it holds the parameters themselves
    tracker = new_tracker()
    tracker.watch_modules(model)
    buf = Buffers(tracker, plan, capacity=capacity)
    emu = (Zero3 if plan.stage == 3 else Zero12)(buf, model)
    ga = workload.grad_accum_steps

    class Hooks(StepHooks):
        def register_parameters(self, tracker: MemoryTracker, params: list[torch.Tensor]) -> None:
            # The model's own parameter tensors stand for DeepSpeed's views into
            # the buffers modelled below; registered as HOST they are never
            # counted (nor "found" later as outputs of view ops).
            tracker.register(plan.params, MemoryCategory.HOST)

        def setup(self) -> None:
            emu.setup()

        def begin_micro(self, iteration: int, micro: int) -> None:
            buf.counting = iteration == NUM_ITERATIONS - 1  # steady state: the trace is complete
            emu.begin_micro(micro == ga - 1)

        def end_backward(self, iteration: int, micro: int) -> None:
            emu.end_backward(micro == ga - 1)

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
    return trace, buf, plan


def split_comm(sent: int, layout: Layout) -> tuple[int, int]:
    """Intra- vs inter-node bytes of a ring collective over all ranks. NCCL
    builds node-major rings, one per NIC rail (NCCL docs, "NCCL_CROSS_NIC"):
    each ring crosses a node boundary once per node, so of a rank's sends a
    share ``num_nodes / num_gpus`` (= 1 / GPUs per node) goes between nodes."""
    if layout.num_nodes == 1:
        return sent, 0
    inter = sent * layout.num_nodes // layout.num_gpus
    return sent - inter, inter


# --------------------------------------------------------------- interface
def _setup(model: Any, workload: Workload, layout: Layout, stage: int, offload_optimizer: bool,
           offload_param: bool, config: dict[str, Any] | None) -> tuple[nn.Module, ZeroConfig, torch.dtype,
                                                                       OptimizerKind]:
    if layout.tp != 1:
        raise ConfigError(f"DeepSpeed ZeRO here is pure data parallel; got --tp {layout.tp}. "
                          "HINT: drop --tp (tp must be 1) or pick a tensor-parallel --method")
    dtype = _training_dtype(workload, config)
    meta = build_training_model(model, workload, dtype)
    hidden = getattr(getattr(meta, "config", None), "hidden_size", None)
    cfg = ZeroConfig.from_deepspeed(config, stage=stage, offload_optimizer=offload_optimizer,
                                    offload_param=offload_param, hidden_size=hidden)
    if not cfg.contiguous_gradients and not cfg.offload_optimizer:
        raise UnsupportedError("contiguous_gradients=false is not modelled. HINT: drop it (default true)")
    if not any(p.requires_grad for p in meta.parameters()):
        raise ConfigError("the model has no trainable parameters. HINT: check the LoRA targets")
    return meta, cfg, dtype, _optimizer_kind(workload, config, cfg)


def model_states(
    model: Any, workload: Workload, *, layout: Layout, stage: int, offload_optimizer: bool = False,
    offload_param: bool = False, config: dict[str, Any] | None = None, rank: int = 0,
) -> ZeroModelStates:
    """Model-state bytes of ``rank`` from DeepSpeed's partitioning rules alone (no trace).

    Raises:
        ConfigError: tp != 1, a bad config, nothing to train.
        UnsupportedError: An option that is not modelled.
    """
    meta, cfg, dtype, kind = _setup(model, workload, layout, stage, offload_optimizer, offload_param, config)
    return _states(_plan(meta, cfg=cfg, dp=layout.dp, rank=rank, dtype=dtype, optimizer=kind),
                   workload.grad_accum_steps)


def host_memory(model: Any, workload: Workload, *, layout: Layout, stage: int = 3, offload_optimizer: bool = False,
                offload_param: bool = False, config: dict[str, Any] | None = None, rank: int = 0,
                **_: Any) -> tuple[int, int]:
    """(host bytes, pinned rounding bytes) of ``rank`` at the model's full
    depth, from DeepSpeed's partitioning rules alone (no trace). The fast
    mode's depth extrapolation cannot give the rounding: it is a power of two
    of whole-model flat buffers, not affine in the layer count.
    """
    meta, cfg, dtype, kind = _setup(model, workload, layout, stage, offload_optimizer, offload_param, config)
    plan = _plan(meta, cfg=cfg, dp=layout.dp, rank=rank, dtype=dtype, optimizer=kind)
    return _states(plan, workload.grad_accum_steps).host_bytes, _pinned_rounding(plan, workload.grad_accum_steps)


def synthesis_blocker(model: Any, workload: Workload, *, layout: Layout, stage: int = 3,
                      offload_optimizer: bool = False, offload_param: bool = False,
                      config: dict[str, Any] | None = None, **_: Any) -> str | None:
    """Why a rank's full event stream cannot be built from shortened copies
    (:func:`llmem_plugin.methods.synthesized`), or None when it can. From
    DeepSpeed's partitioning and coordinator rules alone (no trace), at the
    model's full depth. The synthesis repeats one layer's events and grows
    the flat buffers outside the layers by a constant per layer; that is the
    full model's stream when no rule carries state further than one layer
    and every flat buffer is affine in depth:

    - ZeRO-3 only. ZeRO-1/2 pad each flattened group to a multiple of 2 x dp
      elements and flatten on the device only where it fits: not affine.
    - A ZeRO-3 partition is ``ceil(numel / dp)`` per parameter, so a flat
      buffer over parameters grows by a layer's partitions per layer.
      Sub-groups split a group once its partitions reach ``sub_group_size``
      (``_create_fp16_sub_groups``): with one sub-group per group at full
      depth (or their buffers on the host, under optimizer offload) each is
      affine; with several, their number changes with depth.
    - The coordinator's windows are counted in parameter elements across
      layers: the gradient bucket (``reduce_bucket_size``), the prefetch
      (``prefetch_bucket_size``, ``max_live_parameters``) and the release
      look-ahead (``max_reuse_distance``). Each must be at most the smallest
      decoder layer's parameters (the bucket: its trainable ones, so it
      empties in every layer), and ``model_persistence_threshold`` must not bind.
      The copies then see every state the full model's layers see; the
      synthesis's guard checks the rest.
    """
    if stage != 3:
        return (f"ZeRO-{stage} pads each flattened group to a multiple of 2 x dp elements and flattens it on the "
                "device only where it fits (not affine in depth)")
    from llmem_plugin.models.config import decoder_layers

    meta, cfg, dtype, kind = _setup(model, workload, layout, stage, offload_optimizer, offload_param, config)
    plan = _plan(meta, cfg=cfg, dp=layout.dp, rank=0, dtype=dtype, optimizer=kind)
    if not cfg.offload_optimizer and len(plan.sub_groups) != len([g for g in plan.decay_groups if g]):
        return (f"at full depth the parameter groups split into {len(plan.sub_groups)} sub-groups "
                f"(sub_group_size={cfg.sub_group_size}), a number that changes with depth")
    prefix = decoder_layers(meta)
    layers: dict[str, list[int]] = {}
    for name, p in meta.named_parameters():
        if prefix and name.startswith(prefix + "."):
            layer = layers.setdefault(name[len(prefix) + 1:].split(".", 1)[0], [0, 0])
            layer[0] += p.numel()
            layer[1] += p.numel() if p.requires_grad else 0
    if not layers:
        return "no decoder layer list was found"
    numel = min(n for n, _ in layers.values())
    trainable = min(t for _, t in layers.values())
    windows = [("reduce_bucket_size", cfg.reduce_bucket_size, trainable, "trainable "),
               ("prefetch_bucket_size", cfg.prefetch_bucket_size, numel, ""),
               ("max_live_parameters", cfg.max_live_parameters, numel, ""),
               ("max_reuse_distance", cfg.max_reuse_distance, numel, "")]
    for what, value, per_layer, kind_ in windows:
        if value > per_layer:
            return f"{what}={value} spans more than a layer's {per_layer} {kind_}parameters"
    persistent = sum(p.numel() for p in plan.params if id(p) in plan.persistent)
    if persistent + max(p.numel() for p in plan.params) > cfg.model_persistence_threshold:
        return f"model_persistence_threshold={cfg.model_persistence_threshold} binds"
    return None


def estimate(
    model: Any, workload: Workload, *, layout: Layout, gpu: GPU, alloc_conf: Any = None,
    torch_version: str | None = None, preset: str = "zero3", stage: int = 3, offload_optimizer: bool = False,
    offload_param: bool = False, config: dict[str, Any] | None = None, **_: Any,
) -> MethodEstimate:
    """Per-rank memory and communication of DeepSpeed ZeRO ``stage``.

    Args:
        model: Any model source :func:`llmem_plugin.models.modelbuild.build_model` takes.
        workload: The per-rank workload (micro batch, accumulation, LoRA, ...).
        layout: World size and nodes; ``tp`` must be 1.
        gpu: The GPU of every rank.
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` (string or parsed).
        torch_version: Torch of the job, for the overheads.
        preset: Registry name, reported as the method.
        stage, offload_optimizer, offload_param: From the preset.
        config: A DeepSpeed config dict (HF "auto" values are filled as HF does).

    Returns:
        Rank 0, plus the rank with the largest gradient partition where it differs.

    Raises:
        ConfigError: tp != 1, a config contradicting the method or precision.
        UnsupportedError: An option or optimizer that is not modelled.
    """
    from llmem_plugin.device.allocator_config import AllocatorConfig
    from llmem_plugin.estimate import uses_cublaslt
    from llmem_plugin.device.overheads import device_overheads

    meta, cfg, dtype, kind = _setup(model, workload, layout, stage, offload_optimizer, offload_param, config)
    conf = (alloc_conf if isinstance(alloc_conf, AllocatorConfig)
            else AllocatorConfig.from_env(alloc_conf)).for_torch(torch_version)
    overheads = device_overheads(gpu.compute_capability, torch_version=torch_version,
                                 uses_cublaslt=uses_cublaslt(meta), nccl_world_sizes=(layout.num_gpus,))
    capacity = gpu.capacity_bytes - overheads.outside_allocator_bytes
    plan_args = {"cfg": cfg, "dp": layout.dp, "dtype": dtype, "optimizer": kind}
    ranks_to_trace = [0]
    if stage < 3 and layout.dp > 1:  # ranks differ only in the params touching their partition
        sizes = [_plan(meta, rank=r, **plan_args).in_numel() for r in range(layout.dp)]
        worst = max(range(layout.dp), key=lambda r: (sizes[r], -r))
        if sizes[worst] > sizes[0]:
            ranks_to_trace.append(worst)
    ranks, sent = [], 0
    for i, rank in enumerate(ranks_to_trace):
        m = meta if i == 0 else build_training_model(model, workload, dtype)  # tracing fakeifies in place
        trace, buf, plan = _trace_rank(m, workload, plan_args={**plan_args, "rank": rank}, gpu=gpu,
                                       capacity=capacity)
        states = _states(plan, workload.grad_accum_steps)
        ranks.append(rank_memory(breakdown(trace, buf), rank=rank, gpu=gpu, overheads=overheads,
                                 alloc_conf=conf, host_bytes=states.host_bytes,
                                 host_pinned_rounding_bytes=_pinned_rounding(plan, workload.grad_accum_steps)))
        sent = max(sent, buf.sent_bytes)
    intra, inter = split_comm(sent, layout)
    notes = [
        (f"ZeRO-{stage} modelled from DeepSpeed 0.19.8 buffer rules over a traced step in {dtype}: "
         "activations and temporaries traced, DeepSpeed buffers modelled, allocator replayed"),
        f"reduce_bucket_size={cfg.reduce_bucket_size} overlap_comm={cfg.overlap_comm}"
        + (f" prefetch_bucket_size={cfg.prefetch_bucket_size} param_persistence_threshold="
           f"{cfg.param_persistence_threshold} max_live_parameters={cfg.max_live_parameters} "
           f"max_reuse_distance={cfg.max_reuse_distance}" if stage == 3 else ""),
        f"optimizer: {kind.value}" + (" on the host (DeepSpeedCPUAdam)" if cfg.offload_optimizer else ""),
    ]
    if dtype == torch.float16:
        notes.append("fp16 traced in bf16 (same element size)")
    if ranks[0].host_bytes:
        notes.append(f"host memory: {ranks[0].host_bytes} B of offloaded states and pinned buffers per rank "
                     f"(+{ranks[0].host_overheads.get('pinned_rounding', 0)} B of pinned-allocator rounding), "
                     f"{ranks[0].host_bytes * layout.gpus_per_node} B per node")
    return MethodEstimate(method=preset, layout=layout, ranks=ranks, comm_intra_node_bytes=intra,
                          comm_inter_node_bytes=inter, notes=notes)
