"""What every adapter shares, with no framework imported.

* :func:`resolve_target`: the GPU to estimate for (given, or this process's CUDA device).
* :func:`live_model`: the model a framework holds, unwrapped (DDP, DeepSpeed,
  FSDP, Lightning), with its config, LoRA settings and parameter dtype.
* :func:`batch_dims`: (batch, sequence length) of a training batch.
* :func:`check`: estimate a fixed method on the live model, against a margin.
* :func:`choose`: plan over the methods the framework can run.
* :func:`report_text`: the memory report as text, for exceptions and logs.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmem_plugin.errors import ConfigError, LLMemError, WontFitError
from llmem_plugin.device.gpus import GPU, get_gpu, match_device_name, size_bytes
from llmem_plugin.verify.meter import Prediction
from llmem_plugin.workload import LoraSpec, Precision, Workload

__all__ = ["FIRST_STEADY_STEP", "Check", "LiveModel", "batch_dims", "check", "choose", "compare_step", "largest_batch", "live_model",
           "not_checked_line", "precision_of", "report_text", "resolve_target", "validate_target"]


# The estimate is the steady state: optimizer states are created by the first
# optimizer step and are alive through the second step's forward and backward
# (llmem_plugin/trace/step.py traces NUM_ITERATIONS = 2 steps for that). A measured
# peak is compared with it only once that step has run: step 1 alone lacks the
# states during its forward (+39.8% on a tiny Llama, tests/integrations/test_hf.py).
FIRST_STEADY_STEP = 2


def compare_step(compare_after_steps: int) -> int:
    """The optimizer step after which an adapter compares: the one asked, but
    not before :data:`FIRST_STEADY_STEP`."""
    return max(compare_after_steps, FIRST_STEADY_STEP)


def validate_target(gpu: GPU | str | None, gpu_memory: int | str | None) -> None:
    """Check an adapter's ``gpu``/``gpu_memory`` arguments when it is built, so
    that a bad value stops the job at once and a fit-time failure of
    :func:`resolve_target` is always the machine's (no CUDA, a device the
    catalog lacks), which the adapters treat as "not checked".

    Raises:
        ConfigError: An unknown GPU name or a capacity that is not a size
            (an int below 1 MiB included: almost surely GiB meant).
    """
    if gpu is not None and not isinstance(gpu, GPU):
        get_gpu(gpu)
    if gpu_memory is not None:
        size_bytes(gpu_memory, name="gpu_memory", what="GPU memory", example="80GiB")


def not_checked_line(adapter: str, reason: Any, how: str | None = None) -> str:
    """The one line an adapter warns with when it cannot check the job and
    trains on: the reason (an exception or text) and what to pass (``how``;
    None keeps the reason's own HINT)."""
    text = str(reason) if not isinstance(reason, Exception) or isinstance(reason, LLMemError) \
        else f"{type(reason).__name__}: {reason}"
    text = " ".join(text.split())  # one line
    if how is not None:
        text = f"{text.split(' HINT:')[0].rstrip('. ')}. HINT: {how}"
    return f"{adapter}: the job is not checked, training goes on: {text} (strict=True stops the job instead)"


def resolve_target(gpu: GPU | str | None, gpu_memory: int | str | None) -> tuple[GPU, int | None]:
    """The GPU to estimate for and its capacity override.

    Args:
        gpu: A catalog GPU or name; None: this process's CUDA device, matched
            to the catalog by its name, with the capacity the driver reports.
        gpu_memory: Capacity in bytes or as text (``"75GiB"``); overrides the
            catalog's.

    Raises:
        ConfigError: No GPU given and no CUDA device, or a device that is not
            in the catalog.
    """
    memory = None if gpu_memory is None else size_bytes(gpu_memory, name="gpu_memory", what="GPU memory",
                                                        example="80GiB")
    if gpu is not None:
        return (gpu if isinstance(gpu, GPU) else get_gpu(gpu)), memory
    if not torch.cuda.is_available():
        raise ConfigError("no CUDA device in this process and no gpu given. HINT: pass gpu='h100-sxm' "
                          "(any name `llmem gpus` lists) to estimate for that GPU")
    index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    found = match_device_name(name)
    if found is None:
        raise ConfigError(f"GPU '{name}' is not in the catalog. HINT: pass gpu= with the closest entry of "
                          "`llmem gpus`, and gpu_memory= with its capacity")
    if memory is None:
        memory = int(torch.cuda.mem_get_info(index)[1])  # what this device really has
    return found, memory


@dataclass(frozen=True)
class LiveModel:
    """A framework's model, seen by the estimator.

    Attributes:
        module: The trainable module, unwrapped from DDP/FSDP/DeepSpeed (a
            peft model stays a peft model: its adapters are part of it).
        config: Its transformers config, or None for a plain module.
        lora: LoRA settings when ``module`` is a peft LoRA model.
        param_dtype: Dtype of its floating-point parameters.
        quant: The Workload fields its bitsandbytes 4-bit layers imply
            (:func:`llmem_plugin.techniques.quant.live_quantization`), or None.
        name: A short description for reports and rows.
    """

    module: nn.Module
    config: Any
    lora: LoraSpec | None
    param_dtype: torch.dtype
    name: str
    quant: dict[str, Any] | None = None

    def config_dict(self) -> dict[str, Any] | None:
        return None if self.config is None else self.config.to_dict()

    def plan_source(self) -> Any:
        """The source the planner builds from (it varies depth and layout, so it
        needs a config rather than one live module)."""
        if self.config is None:
            raise ConfigError(f"{self.name} has no transformers config, so it cannot be planned over methods. "
                              "HINT: pin the method (estimate the fixed configuration) or use a transformers model")
        return self.config


_WRAPPERS = ("module", "_forward_module", "model")


def _inner(model: nn.Module) -> nn.Module:
    """Strip DDP/DeepSpeed/FSDP1/Lightning wrappers (each keeps the wrapped module as ``.module``)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        cls = type(model).__name__
        if cls in ("DistributedDataParallel", "DeepSpeedEngine", "FullyShardedDataParallel", "DataParallel",
                   "_LightningModuleWrapperBase", "_FabricModule") and isinstance(getattr(model, "module", None),
                                                                                     nn.Module):
            model = model.module
        else:
            break
    return model


def live_model(model: nn.Module) -> LiveModel:
    """Describe ``model`` for the estimator (its storage is never read or copied).

    A LightningModule or any plain module holding one transformers model is
    searched for it; the module itself is used when it holds none.
    """
    module = _inner(model)
    hf = module
    if getattr(module, "config", None) is None or not hasattr(module.config, "to_dict"):
        found = [m for m in module.modules() if m is not module and hasattr(getattr(m, "config", None), "to_dict")
                 and hasattr(m, "get_input_embeddings")]
        hf = found[0] if found else module
    config = getattr(hf, "config", None)
    config = config if hasattr(config, "to_dict") else None
    lora = None
    peft_config = getattr(hf, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        pc = next(iter(peft_config.values()))
        if type(pc).__name__ == "LoraConfig":
            targets = pc.target_modules
            targets = ("all-linear",) if targets == "all-linear" else tuple(sorted(targets or ()))
            lora = LoraSpec(rank=int(pc.r), alpha=float(pc.lora_alpha), dropout=float(pc.lora_dropout),
                            target_modules=targets or LoraSpec().target_modules)
        config = getattr(hf.get_base_model(), "config", config) if hasattr(hf, "get_base_model") else config
    from llmem_plugin.models.modelbuild import majority_dtype

    dtype = majority_dtype(hf)
    if lora is not None:
        # Adapters in the model's own 16-bit dtype: made without peft's fp32 autocast
        # (autocast_adapter_dtype=False), or cast there by the recipe.
        adapter = next((p for n, p in hf.named_parameters() if "lora_A" in n), None)
        if adapter is not None and adapter.dtype == dtype and dtype != torch.float32:
            lora = dataclasses.replace(lora, adapter_dtype="base")
    name = getattr(config, "name_or_path", "") or ""
    name = name or (f"{getattr(config, 'model_type', '')}" if config is not None else type(hf).__name__)
    from llmem_plugin.techniques.quant import live_quantization

    return LiveModel(module=hf, config=config, lora=lora, param_dtype=dtype, name=name or type(hf).__name__,
                     quant=live_quantization(hf))


def batch_dims(batch: Any) -> tuple[int, int] | None:
    """(batch, sequence length) of a training batch: ``input_ids`` (or
    ``inputs_embeds``/``labels``) of a mapping, the first 2-D tensor of a
    sequence, or a 2-D tensor. None when the batch has no such tensor."""
    if isinstance(batch, torch.Tensor):
        return (int(batch.shape[0]), int(batch.shape[1])) if batch.dim() >= 2 else None
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        for key in ("input_ids", "inputs_embeds", "labels"):
            t = batch.get(key) if hasattr(batch, "get") else None
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                return int(t.shape[0]), int(t.shape[1])
        return None
    if isinstance(batch, (list, tuple)):
        for item in batch:
            dims = batch_dims(item)
            if dims is not None:
                return dims
    return None


def packing_of(batch: Any) -> tuple[int, str] | None:
    """(documents, where their boundaries come from) of a padding-free packed
    batch (``llmem_plugin.techniques.packing``), None for a padded one.

    A packed batch is one row: with ``cu_seq_lens_q`` among the inputs (TRL's
    padding-free collator) the boundaries come from the collator; a row with
    ``position_ids`` that restart and no ``attention_mask``
    (``DataCollatorWithFlattening``) has the model find them from the
    positions. Reads the positions' values once (the first batch only).
    """
    if not (isinstance(batch, dict) or hasattr(batch, "keys")) or not hasattr(batch, "get"):
        return None
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        return None
    cu = batch.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 2:
        return int(cu.numel()) - 1, "collator"
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() == 2 and batch.get("attention_mask") is None:
        docs = int((pos[0] == pos[0].min()).sum())
        if docs > 1:
            return docs, "positions"
    return None


def _task_dim(live: "LiveModel", batch: Any, task: Any, key: str, ndim: int) -> int | None:
    """``batch[key].shape[1]`` when ``live`` is a ``task`` model and that
    tensor has ``ndim`` dimensions; None otherwise."""
    from llmem_plugin.models.tasks import model_task

    try:
        if model_task(live.module) is not task:
            return None
    except Exception:  # noqa: BLE001 - a class that is not modelled: the check says so
        return None
    t = batch.get(key) if hasattr(batch, "get") else None
    return int(t.shape[1]) if isinstance(t, torch.Tensor) and t.dim() == ndim else None


def target_len(live: "LiveModel", batch: Any) -> int | None:
    """The target length of a seq2seq model's batch (its ``labels``' second
    dimension); None for other models, or a batch without 2-D labels."""
    from llmem_plugin.workload import Task

    return _task_dim(live, batch, Task.SEQ2SEQ, "labels", 2)


def images_per_sample(live: "LiveModel", batch: Any) -> int | None:
    """Images per sample of a vision-language model's batch (``pixel_values``
    ``[batch, images, tiles, 3, H, W]``, Mllama's processor); None for other
    models or a batch without images."""
    from llmem_plugin.workload import Task

    return _task_dim(live, batch, Task.IMAGE_TEXT, "pixel_values", 6)


def precision_of(param_dtype: torch.dtype, *, bf16: bool, fp16: bool) -> Precision:
    """The workload precision of parameters in ``param_dtype`` under a trainer's
    bf16/fp16 switches (autocast over fp32 weights is mixed; bf16 weights are
    pure bf16 with or without autocast).

    Raises:
        ConfigError: Half-precision weights trained in fp16, which the
            estimator does not model (GradScaler refuses fp16 gradients).
    """
    if param_dtype == torch.bfloat16:
        return Precision.BF16
    if param_dtype == torch.float16:
        raise ConfigError("the model's parameters are float16; fp16 training needs fp32 master weights "
                          "(torch.amp.GradScaler refuses fp16 gradients). HINT: load the model in float32 "
                          "and train with fp16=True, or load it in bfloat16")
    if bf16:
        return Precision.BF16_MIXED
    if fp16:
        return Precision.FP16_MIXED
    return Precision.FP32


@dataclass(frozen=True)
class Check:
    """A fixed configuration's estimate against the GPU.

    Attributes:
        fits: Device total within the capacity less the margin (and the
            allocator replay under the capacity did not run out).
        limit_bytes: ``capacity * (1 - margin)``.
        capacity_bytes: The GPU's capacity.
        prediction: Per-GPU numbers, to compare with the run.
        estimate: The :class:`~llmem_plugin.estimate.Estimate` or
            :class:`~llmem_plugin.methods.base.MethodEstimate`.
        report: The memory report, as text.
    """

    fits: bool
    limit_bytes: int
    capacity_bytes: int
    prediction: Prediction
    estimate: Any
    report: str
    # The process' host RAM within this machine's (Estimate.host_fits); a job
    # whose host memory does not fit is stopped like a GPU misfit.
    host_fits: bool = True
    # A distributed check made with keep_trace: the arguments of its method's estimate, which
    # predicted_snapshot runs again for the ranks' histories (method_snapshots).
    method_call: dict[str, Any] | None = None

    def message(self) -> str:
        """One line: what was estimated against what the GPU holds."""
        p = self.prediction
        where = "single GPU" if p.method == "single" else f"{p.method} on {p.num_gpus} GPUs"
        gpu_fits = self.fits or not self.host_fits and self.estimate.device_total_bytes <= self.limit_bytes
        verdict = "fits" if gpu_fits else "does not fit"
        line = (f"{where}: {p.device_total_bytes / 2**30:.2f} GiB per GPU at the peak {verdict} "
                f"{p.gpu} ({self.limit_bytes / 2**30:.2f} GiB usable of {self.capacity_bytes / 2**30:.2f} GiB)")
        if not self.host_fits:
            est = self.estimate
            line += (f"; host memory does not fit: {est.host_bytes / 2**30:.2f} GiB of RAM needed, "
                     f"{est.host_capacity_bytes / 2**30:.2f} GiB on this machine ({est.host_memory_source})")
        return line


def check(live: LiveModel, workload: Workload, *, method: str = "single", num_gpus: int = 1, num_nodes: int = 1,
          tp: int = 1, gpu: GPU, gpu_memory: int | None = None, margin: float = 0.05,
          options: dict[str, Any] | None = None, keep_trace: bool = False) -> Check:
    """Estimate ``live`` run with ``method`` and compare with ``gpu``.

    The live module is traced (a structure copy on the meta device), so
    adapters, custom heads and the model's own settings are what is
    estimated; ``workload.lora`` must be None when ``live`` already holds
    its LoRA adapters. ``keep_trace``: a single-GPU estimate keeps its trace
    (``Estimate.trace``), a distributed one the arguments to trace its ranks
    again (``Check.method_call``), for the predicted snapshot.
    """
    from llmem_plugin.estimate import estimate
    from llmem_plugin.methods import estimate_method
    from llmem_plugin.methods.layout import Layout

    if not 0 <= margin < 1:
        raise ConfigError(f"margin must be in [0, 1), got {margin!r}. HINT: e.g. margin=0.05 keeps 5% free")
    workload = _live_adapters(live, workload)
    capacity = gpu_memory if gpu_memory is not None else gpu.capacity_bytes
    target = dataclasses.replace(gpu, memory_bytes=capacity, driver_memory_bytes=None) if gpu_memory else gpu
    limit = int(capacity * (1 - margin))
    if method == "single" and num_gpus == 1:
        est = estimate(live.module, workload, gpu=target, host_memory="local",  # the job runs on this machine
                       keep_trace=keep_trace)
        pred = Prediction.of(est, workload=workload, model=live.name, config=live.config_dict())
        host_fits = bool(est.host_fits)
        fits = bool(est.fits) and est.device_total_bytes <= limit and host_fits
    else:
        host_fits = True  # per-method host verdicts are the planner's (llmem_plugin.device.host)
        layout = Layout(num_gpus=num_gpus, num_nodes=num_nodes, tp=tp)
        est = estimate_method(method, live.module, workload, layout=layout, gpu=target, **(options or {}))
        pred = dataclasses.replace(Prediction.of(est, workload=workload, model=live.name,
                                                 config=live.config_dict()), gpu=gpu.name)
        fits = all(r.fits for r in est.ranks) and est.worst.device_total_bytes <= limit
        if keep_trace:
            call = {"method": method, "model": live.module, "workload": workload, "layout": layout, "gpu": target,
                    **(options or {})}
            return Check(fits=fits, limit_bytes=limit, capacity_bytes=capacity, prediction=pred, estimate=est,
                         report=report_text(est, gpu=target), host_fits=host_fits, method_call=call)
    return Check(fits=fits, limit_bytes=limit, capacity_bytes=capacity, prediction=pred, estimate=est,
                 report=report_text(est, gpu=target), host_fits=host_fits)


def predicted_snapshots(check: Check | None, *, rank: int | None = None) -> dict[int, dict[str, Any]] | None:
    """The predicted snapshots of a check made with ``keep_trace`` (None otherwise), by rank, their
    histories from the loaded weights on, as the adapters record the real ones: ``{0: ...}`` for one GPU.

    A distributed check's method is traced again for its ranks' histories
    (:func:`llmem_plugin.snapshot.predict.method_snapshots`, whose ``rank`` keeps one rank's: its own, or
    the one traced rank's where the method traces one for all, or none).
    """
    if check is None:
        return None
    if getattr(check.estimate, "trace", None) is not None:
        from llmem_plugin.snapshot.predict import snapshot_of

        return {0: snapshot_of(check.estimate, after_load=True)}
    if check.method_call is None:
        return None
    from llmem_plugin.methods._fakepg import real_process_groups_set_aside
    from llmem_plugin.snapshot.predict import method_snapshots

    call = dict(check.method_call)
    with real_process_groups_set_aside():  # the job's groups, hidden while the fake one traces
        return method_snapshots(call.pop("method"), call.pop("model"), call.pop("workload"), after_load=True,
                                rank=rank, **call)


def snapshot_for_rank(snapshots: dict[int, dict[str, Any]] | None, rank: int) -> dict[str, Any] | None:
    """``rank``'s snapshot among :func:`predicted_snapshots`' (all ranks'): its own, or the only one where
    the method traces one rank for all; else None."""
    if not snapshots:
        return None
    if rank in snapshots:
        return snapshots[rank]
    return next(iter(snapshots.values())) if len(snapshots) == 1 else None


def predicted_snapshot(check: Check | None, *, rank: int = 0) -> dict[str, Any] | None:
    """``rank``'s predicted snapshot of a check made with ``keep_trace`` (:func:`predicted_snapshots`), or
    None: no trace kept, or the method traces several distinct ranks and not this one."""
    return snapshot_for_rank(predicted_snapshots(check, rank=rank), rank)


def _live_adapters(live: LiveModel, workload: Workload) -> Workload:
    """``workload`` without its LoRA where the live module already holds the adapters (the structure copy
    traces them); QLoRA keeps it: it validates the quantization."""
    if live.lora is not None and workload.lora is not None and live.quant is None:
        return dataclasses.replace(workload, lora=None)
    return workload


def largest_batch(live: LiveModel, workload: Workload, *, method: str = "single", num_gpus: int = 1,
                  num_nodes: int = 1, gpu: GPU, gpu_memory: int | None = None, headroom: float | int | str,
                  options: dict[str, Any] | None = None, limit: int | None = None) -> Any:
    """The largest micro-batch of ``live`` that fits (:func:`llmem_plugin.planner.largest.max_batch_size`),
    searched from ``workload.micro_batch_size``; the :class:`~llmem_plugin.planner.largest.MaxResult`.
    Where not even one row fits under the headroom but one fits the whole GPU, the result is that one row
    with no headroom (``headroom_bytes`` 0): the job may run, the adapters say so and train on.

    Raises:
        WontFitError: Not even one row fits the whole GPU: the first step would run out of memory.
    """
    from llmem_plugin.methods.layout import Layout
    from llmem_plugin.planner.largest import max_batch_size

    workload = _live_adapters(live, workload)
    kw = {"gpu": gpu, "gpu_memory": gpu_memory, "method": method,
          "layout": Layout(num_gpus=num_gpus, num_nodes=num_nodes), "options": options}
    try:
        return max_batch_size(live.module, workload, headroom=headroom, limit=limit, **kw)
    except WontFitError:
        return max_batch_size(live.module, dataclasses.replace(workload, micro_batch_size=1), headroom=0.0,
                              limit=1, **kw)


def choose(live: LiveModel, workload: Workload, *, gpu: GPU, gpu_memory: int | None, num_gpus: int,
           num_nodes: int = 1, margin: float = 0.05, methods: list[str] | None = None,
           global_batch: int | None = None, micro_batch: int | None = None,
           grad_checkpointing: bool | None = None, tps: list[int] | None = None) -> Any:
    """Plan ``live`` over ``methods``; the :class:`~llmem_plugin.planner.candidates.Plan`.

    Raises:
        WontFitError: Nothing fits (carries the plan and its suggestions).
    """
    from llmem_plugin.planner.search import plan

    if live.lora is not None:
        workload = dataclasses.replace(workload, lora=live.lora)
    return plan(live.plan_source(), gpu=gpu, gpu_memory=gpu_memory, num_gpus=num_gpus, num_nodes=num_nodes,
                workload=workload, global_batch=global_batch, margin=margin, methods=methods, tps=tps,
                micro_batch=micro_batch, grad_checkpointing=grad_checkpointing,
                host_memory="local")  # the job runs on this machine: its RAM is the node's


def report_text(obj: Any, *, gpu: GPU | None = None, width: int = 110) -> str:
    """The memory report of an estimate, method estimate or plan, as plain text."""
    from rich.console import Console

    from llmem_plugin.cli import report
    from llmem_plugin.summary import render_estimate

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, highlight=False)
    if hasattr(obj, "candidates"):
        report.render_plan(obj, console)
    elif hasattr(obj, "ranks"):
        report.render_methods([obj], [], gpu, console)
    else:
        render_estimate(obj, console)
    return buf.getvalue().rstrip()
