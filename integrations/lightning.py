"""Lightning adapter: ``Trainer(strategy="llmem-auto")`` picks the fastest method that fits.

``import llmem_plugin`` registers ``"llmem-auto"`` in the StrategyRegistry of
``lightning.pytorch`` and of ``pytorch_lightning`` (Lightning has no entry
point for strategies, so the import must come before the Trainer is built).
Lightning is not imported for that: a registry whose package is already
loaded is filled at once, one that is not gets filled right after its
package finishes loading (:func:`install_import_hook`).

At ``fit``, :class:`LLMemAutoStrategy` (a DDPStrategy until then) reads the
first training batch, plans the LightningModule over the methods the
accelerator can run, replaces itself with the real Lightning strategy of the
choice (DDP, FSDP, DeepSpeed ZeRO, ModelParallel) and lets Lightning pick
that strategy's precision plugin. After the first steps it compares the
predicted peak with the measured one (:mod:`llmem_plugin.verify.meter`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from llmem_plugin.errors import ConfigError, LLMemError, UnsupportedError, WontFitError

__all__ = [
    "STRATEGY_NAME",
    "LLMemAutoStrategy",  # noqa: F822 - built on first access (module __getattr__), Lightning loads then
    "LLMemBatchSizeFinder",  # noqa: F822 - as LLMemAutoStrategy
    "install_import_hook",
    "lightning_strategy",
    "finder_class",
    "methods_for",
    "register",
    "strategy_class",
]

log = logging.getLogger(__name__)

STRATEGY_NAME = "llmem-auto"
# Defaults of the registered name, which takes no arguments: Trainer(strategy="llmem-auto").
ENV_GPU, ENV_GPU_MEMORY, ENV_MARGIN, ENV_STRICT = "LLMEM_GPU", "LLMEM_GPU_MEMORY", "LLMEM_MARGIN", "LLMEM_STRICT"
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
_ON_WONT_FIT = ("abort", "warn")
_ZERO = ("zero1", "zero2", "zero3", "zero2-offload", "zero3-offload")
_FSDP = ("fsdp", "fsdp-offload")
_TP = ("tp", "dp-tp", "fsdp-tp")
# Planner names that are a registry method with options (llmem_plugin.planner.candidates._VARIANTS).
_CHECK_AS = {"fsdp-offload": ("fsdp", {"cpu_offload": True})}
# torch.optim classes by the workload's optimizer (llmem_plugin.workload.OptimizerKind).
_OPTIMIZERS = {"AdamW": "adamw", "SGD": "sgd", "Adafactor": "adafactor"}


# ----------------------------------------------------------------------------- registration


def register() -> list[str]:
    """Register ``"llmem-auto"`` in every loaded Lightning package's registry.

    Returns:
        The packages registered (``lightning.pytorch``, ``pytorch_lightning``).
    """
    done = []
    for name in _PACKAGES:
        strategies = sys.modules.get(f"{name}.strategies")
        if strategies is None or not hasattr(strategies, "StrategyRegistry"):
            continue
        if STRATEGY_NAME not in strategies.StrategyRegistry:
            strategies.StrategyRegistry.register(
                STRATEGY_NAME, strategy_class(name),
                description="llmem: the fastest of DDP/FSDP/DeepSpeed/ModelParallel that fits the GPU")
        done.append(name)
    return done


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs :func:`register` once ``lightning.pytorch``/``pytorch_lightning``
    has executed (its ``strategies`` subpackage fills the registry on import:
    lightning/pytorch/strategies/__init__.py, ``_register_classes``)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _PACKAGES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                self._loaders = getattr(self, "_loaders", {})
                self._loaders[fullname] = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec: Any) -> Any:
        return self._loaders[spec.name].create_module(spec)

    def exec_module(self, module: Any) -> None:
        loader = self._loaders.pop(module.__name__)
        module.__loader__ = module.__spec__.loader = loader  # inspect/linecache read the source through it
        loader.exec_module(module)
        register()


def _installed(top: str) -> bool:
    try:
        return importlib.util.find_spec(top) is not None  # locates, does not import
    except (ImportError, ValueError):
        return False


def install_import_hook() -> None:
    """Register now in the loaded Lightning packages and after the import of
    the others; imports no Lightning package."""
    register()
    pending = [n for n in _PACKAGES if n not in sys.modules and _installed(n.split(".")[0])]
    if pending and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


# ----------------------------------------------------------------------------- methods -> strategies


def methods_for(accelerator: str, *, world_size: int, tensor_parallel: bool, deepspeed: bool) -> list[str]:
    """The planner methods Lightning can run on ``accelerator``.

    Lightning's FSDPStrategy, DeepSpeedStrategy and ModelParallelStrategy need
    CUDA (lightning/pytorch/trainer/connectors/accelerator_connector.py,
    ``_check_strategy_and_fallback``; DeepSpeedStrategy.setup_environment), so
    on the CPU (and any non-CUDA accelerator) only DDP runs.
    """
    if world_size == 1 and accelerator != "cuda":
        return ["single"]
    if accelerator != "cuda":
        return ["ddp"]
    out = (["single"] if world_size == 1 else ["ddp"]) + list(_FSDP)
    if deepspeed:
        out += list(_ZERO)
    if tensor_parallel and world_size > 1:
        out += list(_TP)
    return out


def _wrap_classes(module: Any) -> set[type]:
    """The decoder-layer classes of a transformers model (``_no_split_modules``),
    which the FSDP estimate shards one by one (llmem_plugin/methods/fsdp.py)."""
    names: set[str] = set()
    for m in module.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return {type(m) for m in module.modules() if type(m).__name__ in names}


def lightning_strategy(plan: Any, candidate: Any = None, *, module: Any = None,
                       package: str = "lightning.pytorch", ddp_kwargs: dict[str, Any] | None = None) -> Any:
    """The Lightning strategy object that runs a plan's choice (or ``candidate``).

    Args:
        plan: A :class:`llmem_plugin.planner.candidates.Plan`.
        candidate: One of ``plan.candidates``; the plan's choice if None.
        module: The model, for FSDP's wrap policy (its decoder-layer classes).
        package: ``lightning.pytorch`` or ``pytorch_lightning``.
        ddp_kwargs: Extra DDPStrategy arguments (``find_unused_parameters``...).

    Returns:
        SingleDeviceStrategy (devices filled in by the Trainer), DDPStrategy,
        FSDPStrategy(FULL_SHARD, per-layer wrap, ``cpu_offload`` for
        fsdp-offload), DeepSpeedStrategy(config=to_deepspeed_config(...)) or
        ModelParallelStrategy(data_parallel_size, tensor_parallel_size).

    Raises:
        ConfigError: No choice, or a method Lightning has no strategy for.
    """
    c = candidate if candidate is not None else plan.choice
    if c is None:
        raise ConfigError("the plan has no choice (nothing fits). HINT: apply one of plan.suggestions and re-plan")
    return _strategy_of(c.method, c.tp, num_gpus=plan.layout.num_gpus, module=module, package=package,
                        ddp_kwargs=ddp_kwargs, deepspeed_config=(lambda: _ds_config(plan, c)))


def _ds_config(plan: Any, candidate: Any) -> dict[str, Any]:
    from llmem_plugin.integrations.deepspeed import to_deepspeed_config

    return to_deepspeed_config(plan, candidate, optimizer=False)  # configure_optimizers builds it


def _strategy_of(method: str, tp: int, *, num_gpus: int, module: Any, package: str,
                 ddp_kwargs: dict[str, Any] | None, deepspeed_config: Any, device: Any = None) -> Any:
    s = importlib.import_module(f"{package}.strategies")
    if method == "single":
        return s.SingleDeviceStrategy(device=device if device is not None else "cpu")
    if method == "ddp":
        return s.DDPStrategy(**(ddp_kwargs or {}))
    if method in _FSDP:
        # Lightning's FSDPStrategy is FSDP1 (FullyShardedDataParallel); the
        # estimate is FSDP2 (fully_shard per decoder layer). Wrapping the same
        # layers is the closest FSDP1 setup (docs/lightning.md, Limitations).
        wrap = _wrap_classes(module) if module is not None else set()
        return s.FSDPStrategy(sharding_strategy="FULL_SHARD", cpu_offload=method == "fsdp-offload",
                              auto_wrap_policy=wrap or None)
    if method in _ZERO:
        return s.DeepSpeedStrategy(config=deepspeed_config())
    if method in _TP:
        return s.ModelParallelStrategy(data_parallel_size=num_gpus // tp, tensor_parallel_size=tp)
    valid = ", ".join(("single", "ddp") + _FSDP + _ZERO + _TP)
    if method.startswith("pp"):
        raise ConfigError(f"method '{method}': pipeline parallelism does not run in Lightning's Trainer (no strategy "
                          f"runs a pipeline schedule); valid: {valid}. HINT: plan with methods= from this list, or "
                          "run the pipeline with torchtitan")
    raise ConfigError(f"method '{method}' has no Lightning strategy; valid: {valid}. HINT: plan with "
                      "methods= from this list")


# ----------------------------------------------------------------------------- the decision


@dataclass
class _Decision:
    """What rank 0 decided, broadcast to every rank (picklable)."""

    method: str
    tp: int = 1
    run_id: str = ""
    error: str | None = None  # "config", "strict" or "wont-fit": every rank raises
    message: str = ""
    report: str = ""
    plan: Any = None
    candidate: Any = None
    prediction: Any = None
    notes: list[str] = field(default_factory=list)
    # The predicted snapshots (snapshot_dir), by traced rank: each rank takes its own
    # (_common.snapshot_for_rank), as rank 0 decides for all.
    snapshots: dict[int, dict[str, Any]] | None = None
    breakdown: dict[str, int] = field(default_factory=dict)  # predicted bytes per category at the peak


def _optimizer_kind(optimizer: Any) -> str | None:
    """The workload optimizer of a torch optimizer, or None when not modelled."""
    kind = _OPTIMIZERS.get(type(optimizer).__name__)
    if kind is None or type(optimizer).__module__.split(".")[0] != "torch":
        return None
    if kind == "adamw" and optimizer.defaults.get("fused"):
        return "adamw-fused"
    return kind


def _first_optimizer(pl_module: Any) -> Any:
    """The optimizer ``configure_optimizers`` returns (Lightning's accepted
    shapes: lightning/pytorch/core/optimizer.py, ``_configure_optimizers``)."""
    out = pl_module.configure_optimizers()
    while True:
        if isinstance(out, dict):
            out = out.get("optimizer")
        elif isinstance(out, (list, tuple)) and out:
            out = out[0]
        else:
            return out


def _first_batch(trainer: Any) -> Any:
    """The first batch of the train source, read without touching
    the RNG streams training will draw from (a shuffling sampler seeds itself
    from torch's default generator: torch/utils/data/sampler.py, RandomSampler)."""
    import torch

    source = trainer.fit_loop._data_source  # lightning/pytorch/loops/fit_loop.py, _DataLoaderSource
    inst = source.instance
    loader = getattr(inst, source.name)() if hasattr(inst, "trainer") and hasattr(inst, source.name) else inst
    if isinstance(loader, dict):
        loader = next(iter(loader.values()))
    elif isinstance(loader, (list, tuple)):
        loader = loader[0]
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        it = iter(loader)
        batch = next(it)
        del it
    random.setstate(state)
    return batch


def _precision(trainer: Any, param_dtype: Any) -> Any:
    import torch
    from llmem_plugin.integrations import _common

    flag = str(trainer._accelerator_connector._precision_flag)
    if flag not in ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true"):
        raise LLMemError(f"precision '{flag}' is not modelled (32-true, bf16-mixed, 16-mixed, bf16-true are)")
    dtype = torch.bfloat16 if flag == "bf16-true" else param_dtype
    return _common.precision_of(dtype, bf16=flag == "bf16-mixed", fp16=flag == "16-mixed")


def _workload(trainer: Any, live: Any, *, seq_len: int, micro_batch: int, optimizer: str) -> Any:
    """The Workload of the Trainer's job on ``live``: its accumulation, precision, checkpointing, attention
    and quantized adapters; the sequence, micro-batch and optimizer as given."""
    from llmem_plugin.workload import Workload

    attn = getattr(live.config, "_attn_implementation", None)
    return Workload(seq_len=seq_len, micro_batch_size=micro_batch,
                    grad_accum_steps=int(trainer.accumulate_grad_batches),
                    precision=_precision(trainer, live.param_dtype), optimizer=optimizer,
                    grad_checkpointing=bool(getattr(live.module, "is_gradient_checkpointing", False)),
                    attn_implementation=attn if attn in ("sdpa", "eager") else "auto", runner="lightning",
                    **({"lora": live.lora, **live.quant} if live.quant else {}))


class _AutoStrategyMixin:
    """The behaviour of :class:`LLMemAutoStrategy`, shared by both Lightning packages."""

    _package = "lightning.pytorch"

    def __init__(self, *, margin: float | None = None, seq_len: int | None = None, gpu: Any = None,
                 gpu_memory: int | str | None = None, on_wont_fit: str = "abort", compare_after_steps: int = 3,
                 tolerance_pct: float | None = None, strict: bool | None = None,
                 snapshot_dir: str | os.PathLike | None = None, **ddp_kwargs: Any) -> None:
        from llmem_plugin.integrations import _common
        from llmem_plugin.verify.meter import DEFAULT_TOLERANCE_PCT

        margin = float(os.environ.get(ENV_MARGIN, "0.05")) if margin is None else margin
        if not 0 <= margin < 1:
            raise ConfigError(f"margin must be in [0, 1), got {margin!r}. HINT: e.g. margin=0.05 keeps 5% free")
        if on_wont_fit not in _ON_WONT_FIT:
            raise ConfigError(f"on_wont_fit must be one of {', '.join(_ON_WONT_FIT)}, got {on_wont_fit!r}. "
                              "HINT: on_wont_fit='warn' trains anyway")
        if seq_len is not None and (not isinstance(seq_len, int) or seq_len <= 0):
            raise ConfigError(f"seq_len must be a positive integer, got {seq_len!r}. HINT: e.g. seq_len=2048")
        if not isinstance(compare_after_steps, int) or compare_after_steps < 0:
            raise ConfigError(f"compare_after_steps must be an integer >= 0, got {compare_after_steps!r}. "
                              "HINT: 0 turns the comparison off")
        if strict is None:
            flag = os.environ.get(ENV_STRICT, "0").strip().lower()
            if flag not in ("0", "1", "true", "false", ""):
                raise ConfigError(f"{ENV_STRICT}={os.environ[ENV_STRICT]!r} is not a switch. HINT: set it to 1 "
                                  "(stop a job that cannot be checked) or 0")
            strict = flag in ("1", "true")
        if not isinstance(strict, bool):
            raise ConfigError(f"strict must be True or False, got {strict!r}. HINT: strict=True stops a job that "
                              "cannot be checked")
        gpu = gpu if gpu is not None else os.environ.get(ENV_GPU) or None
        gpu_memory = gpu_memory if gpu_memory is not None else os.environ.get(ENV_GPU_MEMORY) or None
        _common.validate_target(gpu, gpu_memory)  # a bad value stops at once, not at fit
        super().__init__(**ddp_kwargs)
        self.strict = strict
        self.margin = margin
        self.seq_len = seq_len
        self.gpu = gpu
        self.gpu_memory = gpu_memory
        self.on_wont_fit = on_wont_fit
        self.compare_after_steps = compare_after_steps
        self.tolerance_pct = DEFAULT_TOLERANCE_PCT if tolerance_pct is None else tolerance_pct
        self.decision: _Decision | None = None
        self.snapshot_dir = snapshot_dir
        self._user_ddp_kwargs = dict(ddp_kwargs)

    def _configure_launcher(self) -> None:
        # One process: no launcher, as Lightning's SingleDeviceStrategy. DDP's
        # would export LOCAL_RANK/WORLD_SIZE into this process's environment
        # (launchers/subprocess_script.py, _call_children_scripts), which every
        # later Lightning run it starts would take for an external launch.
        if self.num_processes * self.num_nodes > 1:
            super()._configure_launcher()
        else:
            self._launcher = None

    # Lightning calls setup_environment once per process, after the launch and
    # before the setup/configure_model hooks (lightning/pytorch/trainer/trainer.py,
    # Trainer._run). Everything after it goes through trainer.strategy, which is
    # read from the accelerator connector, so replacing that is the switch.
    def setup_environment(self) -> None:
        pl = importlib.import_module(self._package)
        trainer = self.lightning_module.trainer
        world = self.num_processes * self.num_nodes
        pl.strategies.Strategy.setup_environment(self)  # the device
        # Rank 0 plans before any process group exists (the estimator runs the
        # methods under a fake one: llmem_plugin/methods/_fakepg.py); the other
        # ranks wait in the rendezvous of DDPStrategy.setup_distributed, then
        # all take rank 0's decision, so that every rank builds the same strategy.
        decision = self._decide(trainer, world) if self.global_rank == 0 else None
        if world > 1:
            import torch.distributed as dist

            self.setup_distributed()  # the process group the real strategy reuses (_init_dist_connection)
            box = [decision]
            dist.broadcast_object_list(box, src=0)
            decision = box[0]
        self.decision = decision
        if decision.error == "config":
            raise ConfigError(decision.message)
        if decision.error == "strict":
            raise UnsupportedError(decision.message)
        if decision.error == "wont-fit":
            raise WontFitError(decision.message, plan=decision.plan)
        real = _strategy_of(decision.method, decision.tp, num_gpus=world, module=self.lightning_module,
                            package=self._package, ddp_kwargs=self._user_ddp_kwargs, device=self.root_device,
                            deepspeed_config=lambda: _ds_config(decision.plan, decision.candidate))
        self._swap(trainer, real)
        if decision.prediction is not None and self.compare_after_steps > 0:
            trainer.callbacks.append(_meter_callback(self._package)(decision, self.compare_after_steps,
                                                                    self.tolerance_pct))
        if self.snapshot_dir is not None:
            trainer.callbacks.append(_snapshot_callback(self._package)(decision, self.snapshot_dir,
                                                                       self.compare_after_steps, self.global_rank))
        real.setup_environment()

    def _swap(self, trainer: Any, real: Any) -> None:
        """Make ``real`` the trainer's strategy, set up as the connector sets up
        the one it builds (accelerator_connector.py: ``_check_and_init_precision``
        picks the precision plugin by strategy type, ``_lazy_init_strategy``
        hands over accelerator, devices, cluster environment and launcher)."""
        connector = trainer._accelerator_connector
        real.connect(self.lightning_module)
        connector.strategy = real
        connector.precision_plugin = connector._check_and_init_precision()
        connector._lazy_init_strategy()
        if type(getattr(real, "_launcher", None)) is type(self._launcher):
            real._launcher = self._launcher  # it holds the child processes to kill on an error
        log.debug("llmem-auto: training with %s and %s", type(real).__name__, type(real.precision_plugin).__name__)

    def _decide(self, trainer: Any, world: int) -> _Decision:
        from lightning_utilities.core.rank_zero import rank_zero_info
        from llmem_plugin.integrations import _common

        default = "ddp" if world > 1 else "single"
        run_id = f"lightning-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"

        def not_checked(e: Exception, how: str | None = None) -> _Decision:
            # The job cannot be checked: train with the default, warned once, unless strict.
            if self.strict:
                if isinstance(e, ConfigError):
                    return _Decision(default, run_id=run_id, error="config", message=str(e))
                what = str(e) if isinstance(e, LLMemError) else f"{type(e).__name__}: {e}"
                return _Decision(default, run_id=run_id, error="strict",
                                 message=f"llmem-auto: the job cannot be checked (strict=True): {what}")
            line = _common.not_checked_line(f"llmem-auto (training with {default})", e, how)
            warnings.warn(line, stacklevel=3)
            return _Decision(default, run_id=run_id, notes=[line])

        try:
            inputs = self._inputs(trainer, world)
        except _NoTarget as e:
            return not_checked(e.__cause__ or e, f"set {ENV_GPU}=h100-sxm or pass LLMemAutoStrategy(gpu='h100-sxm') "
                                                 "(any name `llmem gpus` lists) to check the job for that GPU")
        except Exception as e:  # noqa: BLE001 - an estimator limitation never stops training
            return not_checked(e)
        try:
            decision = self._plan(inputs, world, default)
        except WontFitError as e:
            report = _report(e.plan)
            if self.on_wont_fit == "abort":
                return _Decision(default, run_id=run_id, error="wont-fit", plan=e.plan, report=report,
                                 message=f"{e}\n{report}")
            closest = e.plan.closest(1) if e.plan is not None else []
            method = closest[0].method if closest else default
            warnings.warn(f"llmem-auto: {e}; training anyway with {method} (on_wont_fit='warn')\n{report}",
                          stacklevel=2)
            decision = _Decision(method, tp=closest[0].tp if closest else 1, run_id=run_id, plan=e.plan,
                                 candidate=closest[0] if closest else None, report=report)
            if self.snapshot_dir is not None and world == 1 and method == "single":
                self._predict_snapshot(decision, inputs)  # what the prediction says it will run out on
            return decision
        except Exception as e:  # noqa: BLE001 - an estimator limitation never stops training
            return not_checked(e)
        decision.run_id = run_id
        text = f"llmem-auto: {decision.message}"
        log.info("%s\n%s", text, decision.report)
        rank_zero_info(f"{text}\n{decision.report}")
        return decision

    @staticmethod
    def _snapshots_of(checked: Any) -> dict[int, dict[str, Any]] | None:
        """The check's predicted snapshots, by traced rank; a failure only warns (the decision stands)."""
        from llmem_plugin.integrations import _common

        try:
            return _common.predicted_snapshots(checked)
        except Exception as e:  # noqa: BLE001 - the snapshot is extra; the job goes on
            warnings.warn(f"llmem-auto: no predicted snapshot ({type(e).__name__}: {e})", stacklevel=3)
            return None

    def _predict_snapshot(self, decision: _Decision, inputs: dict[str, Any]) -> None:
        """The single-GPU predicted snapshot and breakdown onto ``decision``; a failure only warns."""
        from llmem_plugin.integrations import _common

        try:
            checked = _common.check(inputs["live"], inputs["workload"], gpu=inputs["gpu"], gpu_memory=inputs["memory"],
                                    margin=self.margin, keep_trace=True)
            decision.snapshots = _common.predicted_snapshots(checked)
            decision.breakdown = {c.value: v for c, v in checked.estimate.breakdown.items()}
        except Exception as e:  # noqa: BLE001 - the snapshot is extra; the job goes on
            warnings.warn(f"llmem-auto: no predicted snapshot ({type(e).__name__}: {e})", stacklevel=3)

    def _inputs(self, trainer: Any, world: int) -> dict[str, Any]:
        """GPU, live model, workload and methods; LLMemError where the estimate cannot run."""
        from lightning_utilities.core.imports import module_available
        from llmem_plugin.integrations import _common

        try:
            gpu, memory = _common.resolve_target(self.gpu, self.gpu_memory)
        except ConfigError as e:  # the machine's: no CUDA and no gpu, a device the catalog lacks
            raise _NoTarget(str(e)) from e
        pl_module = self.lightning_module
        live = _common.live_model(pl_module)
        try:
            batch = _first_batch(trainer)
        except Exception as e:
            raise LLMemError(f"the first training batch could not be read before setup(): {type(e).__name__}: "
                             f"{e}. HINT: build the dataset before fit, or pass seq_len= and a DataLoader") from e
        dims = _common.batch_dims(batch)
        if dims is None:
            raise LLMemError("the training batch has no input_ids/labels or 2-D tensor to read its shape from")
        micro_batch, seq_len = dims
        try:
            optimizer = _first_optimizer(pl_module)
        except Exception as e:
            raise LLMemError(f"configure_optimizers() failed before setup: {type(e).__name__}: {e}") from e
        kind = _optimizer_kind(optimizer)
        if kind is None:
            raise LLMemError(f"optimizer {type(optimizer).__name__} is not modelled (torch.optim AdamW, SGD and "
                             "Adafactor are)")
        workload = _workload(trainer, live, seq_len=self.seq_len or seq_len, micro_batch=micro_batch,
                             optimizer=kind)
        accelerator = "cuda" if type(trainer.accelerator).__name__ == "CUDAAccelerator" else "cpu"
        tensor_parallel = _overrides_configure_model(pl_module)
        methods = methods_for(accelerator, world_size=world, tensor_parallel=tensor_parallel,
                              deepspeed=module_available("deepspeed"))
        notes = []
        if accelerator == "cuda" and world > 1 and not tensor_parallel:
            notes.append("tensor-parallel methods left out: the LightningModule does not override "
                         "configure_model, where ModelParallelStrategy expects the parallelization")
        return {"gpu": gpu, "memory": memory, "live": live, "workload": workload, "methods": methods,
                "notes": notes}

    def _plan(self, inputs: dict[str, Any], world: int, default: str) -> _Decision:
        from llmem_plugin.integrations import _common

        live, wl, gpu, memory = inputs["live"], inputs["workload"], inputs["gpu"], inputs["memory"]
        num_nodes = self.num_nodes
        plan = None
        if live.config is None:  # a plain module: estimate the default method on it
            method, tp = default, 1
        else:
            plan = _common.choose(live, wl, gpu=gpu, gpu_memory=memory, num_gpus=world, num_nodes=num_nodes,
                                  margin=self.margin, methods=inputs["methods"],
                                  global_batch=wl.micro_batch_size * wl.grad_accum_steps * world,
                                  micro_batch=wl.micro_batch_size, grad_checkpointing=wl.grad_checkpointing)
            method, tp = plan.choice.method, plan.choice.tp
        name, options = _CHECK_AS.get(method, (method, None))
        keep = self.snapshot_dir is not None
        checked = _common.check(live, wl, method=name, num_gpus=world, num_nodes=num_nodes, tp=tp, gpu=gpu,
                                gpu_memory=memory, margin=self.margin, options=options, keep_trace=keep)
        if plan is None and not checked.fits:
            raise WontFitError(checked.message(), plan=None)
        why = plan.why if plan is not None else "the model has no transformers config, so only it was estimated"
        report = _report(plan) if plan is not None else checked.report
        breakdown = getattr(getattr(checked.estimate, "worst", checked.estimate), "breakdown", {})
        return _Decision(method, tp=tp, plan=plan, candidate=plan.choice if plan else None, prediction=checked.prediction, report=report,
                         snapshots=self._snapshots_of(checked) if keep else None,
                         breakdown={getattr(k, "value", k): v for k, v in breakdown.items()},
                         message=f"{why}; {checked.message()}" + "".join(f"; {n}" for n in inputs["notes"]),
                         notes=inputs["notes"])


class _NoTarget(LLMemError):
    """No GPU to estimate for (no CUDA device and no ``gpu``, or a device the catalog lacks)."""


def _report(plan: Any) -> str:
    if plan is None:
        return ""
    from llmem_plugin.integrations import _common

    return _common.report_text(plan)


def _overrides_configure_model(pl_module: Any) -> bool:
    for klass in type(pl_module).__mro__:
        if "configure_model" in vars(klass):
            return klass.__module__.split(".")[0] not in ("lightning", "pytorch_lightning")
    return False


# ----------------------------------------------------------------------------- predicted vs actual


def _first_steady(steps: int) -> int:
    """The step to compare after: the one asked, not before the first steady-state step."""
    from llmem_plugin.integrations import _common

    return _common.compare_step(steps)


class _MeterMixin:
    """Measures the first steps and compares them with the prediction."""

    def __init__(self, decision: _Decision, steps: int, tolerance_pct: float) -> None:
        self.decision = decision
        self.steps = steps
        self.tolerance_pct = tolerance_pct
        self.meter: Any = None
        self.comparison: Any = None
        self._last = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.meter is not None or self.comparison is not None:
            return
        import torch

        from llmem_plugin.verify.meter import PeakMeter

        wl = self.decision.prediction.workload
        autocast = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(wl["precision"])
        gpu = self.decision.plan.gpu if self.decision.plan is not None else None
        device = trainer.strategy.root_device
        self.meter = PeakMeter(device, autocast_dtype=autocast,
                               compute_capability=tuple(gpu.compute_capability) if gpu is not None else None)
        live: list[Any] = []
        if device.type == "cpu":
            live = list(pl_module.parameters()) + list(pl_module.buffers())
        self.meter.start(live=live, optimizer=trainer.optimizers[0] if trainer.optimizers else None)
        self._last = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.meter is None or not self.meter.running or trainer.global_step == self._last:
            return
        self._last = trainer.global_step
        self.meter.step_end(trainer.global_step)
        if trainer.global_step >= _first_steady(self.steps):
            self._finish(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.meter is not None and self.meter.running:
            self.meter.abandon()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    def _finish(self, trainer: Any, pl_module: Any) -> None:
        from lightning_utilities.core.rank_zero import rank_zero_info

        from llmem_plugin.verify.meter import append_row, compare

        comparison = compare(self.decision.prediction, self.meter.stop())
        self.comparison = comparison
        metrics = comparison.metrics()
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, logger=False)
        for logger in trainer.loggers:  # now: Lightning flushes step metrics only every log_every_n_steps
            logger.log_metrics(metrics, step=trainer.global_step)
        rank = trainer.global_rank
        append_row(os.path.join(trainer.default_root_dir, "llmem-verify.jsonl"),
                   comparison.to_row(run_id=self.decision.run_id, runner="lightning", rank=rank))
        text = f"llmem-auto: rank {rank} after {trainer.global_step} steps: {comparison.summary()}"
        log.info(text)
        rank_zero_info(text)
        outside = comparison.outside(self.tolerance_pct)
        if outside:
            warnings.warn(f"{text}; outside ±{self.tolerance_pct:g}%: "
                          + ", ".join(f"{k} {v:+.1f}%" for k, v in outside.items()), stacklevel=2)


class _SnapshotMixin:
    """``snapshot_dir``: the real history from the first batch to the compared step, the predicted snapshot
    and their comparison; on an out-of-memory error, the same, written before Lightning raises it on."""

    def __init__(self, decision: _Decision, folder: Any, steps: int, rank: int) -> None:
        from llmem_plugin.integrations._common import snapshot_for_rank
        from llmem_plugin.integrations._snapshots import SnapshotRecorder

        self.steps = steps
        self.recorder = SnapshotRecorder(folder, rank=rank,
                                         predicted=lambda: snapshot_for_rank(decision.snapshots, rank),
                                         breakdown=decision.breakdown)
        self._started = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._started:
            self._started = True
            self.recorder.start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.recorder.recording and trainer.global_step >= _first_steady(self.steps or 1):
            self.recorder.finish()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder.recording:
            self.recorder.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        import torch

        if isinstance(exception, torch.OutOfMemoryError):
            self.recorder.on_oom(exception)  # Lightning raises it on after its callbacks' on_exception


# ----------------------------------------------------------------------------- classes per package

_CLASSES: dict[tuple[str, str], type] = {}


def strategy_class(package: str = "lightning.pytorch") -> type:
    """:class:`LLMemAutoStrategy` for ``package`` (``lightning.pytorch`` or
    ``pytorch_lightning``: the same code, two class hierarchies)."""
    key = (package, "strategy")
    if key not in _CLASSES:
        s = importlib.import_module(f"{package}.strategies")
        _CLASSES[key] = type("LLMemAutoStrategy", (_AutoStrategyMixin, s.DDPStrategy), {
            "__module__": __name__, "_package": package, "strategy_name": STRATEGY_NAME,
            "__doc__": _STRATEGY_DOC})
    return _CLASSES[key]


def _callback_class(package: str, name: str, mixin: type) -> type:
    """``mixin`` as a Callback of ``package`` (made once per package)."""
    key = (package, name)
    if key not in _CLASSES:
        pl = importlib.import_module(package)
        _CLASSES[key] = type(name, (mixin, pl.Callback), {"__module__": __name__})
    return _CLASSES[key]


def _meter_callback(package: str) -> type:
    return _callback_class(package, "LLMemVerify", _MeterMixin)


def _snapshot_callback(package: str) -> type:
    return _callback_class(package, "LLMemSnapshots", _SnapshotMixin)


# ----------------------------------------------------------------------------- the batch size finder

# Lightning's strategies by class name -> the estimator's method (one GPU: single). FSDP is not searched:
# FSDPStrategy has sharded the module by on_fit_start (Trainer._run: strategy.setup, then on_fit_start).
_FINDER_METHODS = {"DDPStrategy": "ddp", "SingleDeviceStrategy": "single"}


class _FinderMixin:
    """The behaviour of :class:`LLMemBatchSizeFinder`, shared by both Lightning packages."""

    _package = "lightning.pytorch"

    def __init__(self, mode: str = "power", steps_per_trial: int = 3, init_val: int = 2, max_trials: int = 25,
                 batch_arg_name: str = "batch_size", margin: float = 0.05, max_val: int = 8192, *,
                 headroom: float | int | str | None = None, seq_len: int | None = None, gpu: Any = None,
                 gpu_memory: int | str | None = None, strict: bool = False) -> None:
        from llmem_plugin.integrations import _common
        from llmem_plugin.planner.largest import DEFAULT_HEADROOM, headroom_bytes

        if str(mode).lower() not in ("power", "binsearch"):
            raise ValueError("`mode` should be either of ('power', 'binsearch')")  # BatchSizeFinder's check
        if not 0.0 <= margin < 1.0:
            raise ConfigError(f"margin must be in [0, 1), got {margin!r}: the fraction the found size is reduced "
                              "by, as BatchSizeFinder's")
        for name, value in (("init_val", init_val), ("max_val", max_val)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
            raise ConfigError(f"seq_len must be a positive integer, got {seq_len!r}")
        self.headroom = DEFAULT_HEADROOM if headroom is None else headroom
        headroom_bytes(self.headroom, 2**50)  # a bad spelling stops here, not at fit
        _common.validate_target(gpu, gpu_memory)
        super().__init__()
        self.optimal_batch_size: int | None = init_val
        self.result: Any = None
        self._mode, self._steps_per_trial, self._max_trials = str(mode).lower(), steps_per_trial, max_trials
        self._init_val, self._batch_arg_name, self._margin, self._max_val = init_val, batch_arg_name, margin, max_val
        self.seq_len, self.gpu, self.gpu_memory, self.strict = seq_len, gpu, gpu_memory, strict

    def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        parsing = importlib.import_module(f"{self._package}.utilities.parsing")
        if not trainer.fit_loop._data_source.is_module():
            raise ConfigError("LLMemBatchSizeFinder sets the batch size the LightningModule or LightningDataModule "
                              "builds its DataLoader with; dataloaders passed to fit() cannot change. HINT: build "
                              "the DataLoader in train_dataloader() from self.batch_size")
        if not parsing.lightning_hasattr(pl_module, self._batch_arg_name):
            raise ConfigError(f"Field {self._batch_arg_name} not found in `model`, `datamodule`, nor their `hparams` "
                              "attributes. HINT: pass batch_arg_name= with the attribute your DataLoader reads")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Before the fit loop builds its DataLoader: estimate, set the batch size; never a trial step."""
        parsing = importlib.import_module(f"{self._package}.utilities.parsing")
        try:
            result = self._largest(trainer, pl_module)
        except WontFitError:
            raise  # not even one row fits the whole GPU: the first step would run out of memory
        except Exception as e:  # noqa: BLE001 - an estimator limitation never stops training
            if self.strict:
                raise
            from llmem_plugin.integrations import _common

            line = _common.not_checked_line("LLMemBatchSizeFinder", e, "the batch size is left as it is")
            warnings.warn(line, stacklevel=2)
            log.info(line)
            return
        found = min(result.value, self._max_val)
        # BatchSizeFinder applies its margin in binsearch mode only (lightning/pytorch/tuner/batch_size_scaling.py).
        size = max(1, int(found * (1 - self._margin))) if self._mode == "binsearch" else found
        parsing.lightning_setattr(pl_module, self._batch_arg_name, size)
        self.optimal_batch_size, self.result = size, result
        above = f"{result.next_value} does not" if result.next_value is not None else f"capped: {result.capped_by}"
        text = (f"LLMemBatchSizeFinder: {self._batch_arg_name}={size} (the largest that fits is {result.value}, "
                f"{above}; {result.gpu} limit {result.limit_bytes / 2**30:.2f} GiB after "
                f"{result.headroom_bytes / 2**30:.2f} GiB headroom), from {len(result.points)} estimates, no trial "
                "step")
        if result.headroom_bytes == 0 and self.headroom not in (0, 0.0, "0"):
            warnings.warn(f"{text}: one row fits the GPU only within the headroom", stacklevel=2)
        log.info(text)
        importlib.import_module(f"{self._package}.utilities").rank_zero_info(text)

    def _largest(self, trainer: Any, pl_module: Any) -> Any:
        from llmem_plugin.integrations import _common

        gpu, memory = _common.resolve_target(self.gpu, self.gpu_memory)
        live = _common.live_model(pl_module)
        seq_len = self.seq_len
        if seq_len is None:
            dims = _common.batch_dims(_first_batch(trainer))
            if dims is None:
                raise LLMemError("the training batch has no input_ids to read its length from. HINT: pass "
                                 "LLMemBatchSizeFinder(seq_len=...)")
            seq_len = dims[1]
        kind = _optimizer_kind(_first_optimizer(pl_module))
        if kind is None:
            raise LLMemError("the optimizer is not modelled (torch.optim AdamW, SGD and Adafactor are)")
        world = int(trainer.world_size)
        method = _FINDER_METHODS.get(type(trainer.strategy).__name__)
        if method is None or (method == "single") != (world == 1):
            raise LLMemError(f"strategy {type(trainer.strategy).__name__} on {world} device(s) is not searched "
                             "(single device and DDP are)")
        wl = _workload(trainer, live, seq_len=seq_len, micro_batch=self._init_val, optimizer=kind)
        return _common.largest_batch(live, wl, method=method, num_gpus=world, num_nodes=int(trainer.num_nodes),
                                     gpu=gpu, gpu_memory=memory, headroom=self.headroom, limit=self._max_val + 1)


def finder_class(package: str = "lightning.pytorch") -> type:
    """:class:`LLMemBatchSizeFinder` for ``package`` (a Lightning Callback)."""
    key = (package, "finder")
    if key not in _CLASSES:
        pl = importlib.import_module(package)
        _CLASSES[key] = type("LLMemBatchSizeFinder", (_FinderMixin, pl.Callback), {
            "__module__": __name__, "_package": package, "__doc__": _FINDER_DOC})
    return _CLASSES[key]


_FINDER_DOC = """Lightning's ``BatchSizeFinder`` without out-of-memory trials: the largest batch that fits, estimated.

Takes BatchSizeFinder's arguments and attribute rules: ``batch_arg_name`` is
found on the LightningModule, its ``hparams``, the datamodule or its
``hparams`` (``lightning_hasattr``) and set there with ``lightning_setattr``
at ``on_fit_start``, before the fit loop builds its DataLoader; the found size
is capped at ``max_val`` and, in ``binsearch`` mode, reduced by ``margin``, as
BatchSizeFinder does.
``mode``, ``steps_per_trial`` and ``max_trials`` have nothing to do: no step
runs to find the size. ``init_val`` is where the search starts.

Args:
    headroom: GPU memory kept free (fraction or size; default
        :data:`llmem_plugin.planner.largest.DEFAULT_HEADROOM`).
    seq_len: Tokens per sequence; default the first training batch's.
    gpu, gpu_memory: The GPU to size for; default this process's CUDA device.
    strict: Raise when the estimate cannot run; by default warn once and
        leave the batch size as it is.

Attributes:
    optimal_batch_size: The size set.
    result: The :class:`~llmem_plugin.planner.largest.MaxResult`.

Known limitations:
    Single device and DDP: FSDPStrategy has sharded the module by
    ``on_fit_start``, so the live module cannot be read (warned, the batch
    size is left as it is). Raises WontFitError when not even one row fits
    the whole GPU; one row that fits only within the headroom is set, with a
    warning.
"""


_STRATEGY_DOC = """Plan at ``fit`` and train with the real Lightning strategy of the choice.

Args:
    margin: Fraction of the GPU kept free (default 0.05, or ``$LLMEM_MARGIN``).
    seq_len: Sequence length to estimate; the first batch's when None.
    gpu: Catalog GPU name (``llmem gpus``); this process's CUDA device when
        None, or ``$LLMEM_GPU``. Required on the CPU.
    gpu_memory: Capacity override (``"75GiB"``, bytes, or ``$LLMEM_GPU_MEMORY``).
    on_wont_fit: ``"abort"`` raises WontFitError with the report; ``"warn"``
        trains anyway with the closest candidate's method.
    compare_after_steps: Optimizer steps after which predicted and measured
        peaks are compared and logged (0: off); not before step 2, the first
        steady-state step, which the estimate predicts.
    tolerance_pct: Warn when the error exceeds it (default: the README target).
    snapshot_dir: Record the real allocator history of the first steps (until
        the comparison, at least step 2) and write it there with the predicted
        snapshot (this rank's) and their comparison; on a CUDA out-of-memory
        error, write them and print the predicted breakdown, and Lightning
        raises the error on (:mod:`llmem_plugin.integrations._snapshots`). Off
        by default: recording slows every allocation.
    strict: Stop the job when it cannot be checked (no GPU to estimate for, an
        unmodelled setting, a failed estimate); default ``$LLMEM_STRICT`` or
        False: warn once and train with DDP (one device: single).
    **ddp_kwargs: Passed to DDPStrategy when DDP is chosen.

Known limitations:
    The batch (the DataLoader's), accumulation and gradient checkpointing are
    the job's, not chosen. Lightning's FSDPStrategy is FSDP1; the estimate is
    FSDP2 per decoder layer. Tensor parallelism only when the LightningModule
    overrides ``configure_model``. The plan runs on rank 0 and is broadcast.
"""


def __getattr__(name: str) -> Any:
    if name == "LLMemAutoStrategy":  # the lightning.pytorch class, built on first use
        return strategy_class("lightning.pytorch" if importlib.util.find_spec("lightning") else "pytorch_lightning")
    if name == "LLMemBatchSizeFinder":
        return finder_class("lightning.pytorch" if importlib.util.find_spec("lightning") else "pytorch_lightning")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
