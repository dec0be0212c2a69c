"""HF Trainer: ``callbacks=[LLMemCallback()]`` and ``autoconfigure(model, args)``.

:class:`LLMemCallback` estimates the job the Trainer was configured for
(single GPU, DDP, DeepSpeed ZeRO or FSDP, read from ``TrainingArguments``)
on the live model just before its first forward, when the first batch's
shape is known. If the peak does not fit the GPU less the margin it raises
:class:`~llmem_plugin.errors.WontFitError` with the memory report (or
warns). After ``compare_after_steps`` optimizer steps it compares the
prediction with the measured peak (:mod:`llmem_plugin.verify.meter`), logs
``llmem/predicted_peak_gib``, ``llmem/actual_peak_gib`` and ``llmem/error_pct``
through ``Trainer.log`` (so every reporting integration gets them), and
appends a row to ``<output_dir>/llmem-verify.jsonl`` for ``llmem validate``.

:func:`autoconfigure` plans before the Trainer is built and returns
``TrainingArguments`` with the fastest method that fits: a DeepSpeed config
or FSDP settings, the micro-batch and accumulation that keep the global
batch, and gradient checkpointing.

A job that cannot be checked (no CUDA device and no ``gpu=``, an optimizer
or setting that is not modelled, an estimate that fails) is not stopped: the
callback warns once, saying what to pass, and the job runs unchecked, unless
``strict=True``. Only a job that does not fit stops (``on_wont_fit="abort"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import warnings
from typing import Any

import torch
from llmem_plugin.integrations import _common
from transformers import TrainerCallback

from llmem_plugin.techniques import checkpointing
from llmem_plugin.errors import ConfigError, LLMemError, UnsupportedError, WontFitError
from llmem_plugin.methods.zero import deepspeed_method, read_deepspeed_config
from llmem_plugin.verify.meter import DEFAULT_TOLERANCE_PCT, PeakMeter, append_row, compare
from llmem_plugin.workload import Precision, Workload

__all__ = ["LLMemCallback", "autoconfigure", "job_of", "largest_batch"]

log = logging.getLogger("llmem_plugin.hf")

# TrainingArguments.optim -> the estimator's optimizer (transformers
# training_args.OptimizerNames; the Trainer builds torch.optim.AdamW with
# fused=True for "adamw_torch_fused", its default from torch 2.8, and with
# foreach left to torch, which picks foreach on CUDA, for "adamw_torch").
_OPTIM = {"adamw_torch_fused": "adamw-fused", "adamw_torch": "adamw", "sgd": "sgd"}
# Methods the Trainer runs from its arguments alone (tensor parallelism
# comes from how the model is loaded, so autoconfigure does not pick it).
HF_METHODS = ["single", "ddp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "fsdp", "fsdp-offload"]


@dataclasses.dataclass(frozen=True)
class Job:
    """The distributed job ``TrainingArguments`` describe.

    Attributes:
        method: Registry method (``single``, ``ddp``, ``zero2``, ``fsdp``, ...).
        num_gpus: World size.
        num_nodes: Nodes (``WORLD_SIZE / LOCAL_WORLD_SIZE`` under torchrun).
        options: Method options (DeepSpeed config, FSDP offload/resharding).
        notes: Where the estimate approximates the configuration.
    """

    method: str
    num_gpus: int
    num_nodes: int
    options: dict[str, Any]
    notes: tuple[str, ...] = ()


def _deepspeed_config(args: Any) -> dict[str, Any] | None:
    hf = getattr(args, "hf_deepspeed_config", None)
    if hf is not None and isinstance(getattr(hf, "config", None), dict):
        return hf.config  # with the "auto" values the Trainer filled
    ds = getattr(args, "deepspeed", None)
    return read_deepspeed_config(ds) if ds else None


def job_of(args: Any) -> Job:
    """The method, world size and options of the Trainer's arguments.

    Raises:
        UnsupportedError: A configuration the estimator does not model.
    """
    world = int(getattr(args, "world_size", 1) or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    nodes = max(1, world // max(1, local))
    ds = _deepspeed_config(args)
    if ds is not None:
        method, off_opt, off_par = deepspeed_method(ds)
        return Job(method, world, nodes, {"config": ds, "offload_optimizer": off_opt, "offload_param": off_par})
    fsdp = getattr(args, "fsdp", None) or []
    if isinstance(fsdp, str):
        fsdp = fsdp.split()
    fsdp = [str(getattr(o, "value", o)) for o in fsdp]
    if fsdp:
        cfg = getattr(args, "fsdp_config", None) or {}
        version = int(cfg.get("version", cfg.get("fsdp_version", 1)) or 1)
        notes = () if version == 2 else ("FSDP1 (flat parameters) estimated as FSDP2 (per-parameter sharding)",)
        opts: dict[str, Any] = {"cpu_offload": "offload" in fsdp}
        if "shard_grad_op" in fsdp:
            opts["reshard_after_forward"] = False
        if "hybrid_shard" in fsdp or "hybrid_shard_zero2" in fsdp:
            return Job("hsdp", world, nodes, opts, notes)
        return Job("fsdp", world, nodes, opts, notes)
    return Job("ddp" if world > 1 else "single", world, nodes, {})


def _workload(args: Any, live: _common.LiveModel, batch: int, seq_len: int, target_len: int | None = None,
              images: int | None = None, packed: tuple[int, str] | None = None, trl: str | None = None) -> Workload:
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in _OPTIM:
        raise UnsupportedError(f"optimizer '{optim}' is not modelled; modelled: {', '.join(_OPTIM)}. "
                               "HINT: use optim='adamw_torch_fused' to have the job checked")
    precision = _common.precision_of(live.param_dtype, bf16=bool(args.bf16), fp16=bool(args.fp16))
    attn = getattr(live.config, "_attn_implementation", None) if live.config is not None else None
    gc = bool(args.gradient_checkpointing)
    # transformers 5 renamed the kwargs to activation_checkpointing_kwargs (the old name is an alias)
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs", None)
    save_ops = checkpointing.policy_of(kwargs) if gc else None
    # TRL's trainers score the tokens with their fused LM head (llmem_plugin.techniques.trl_head), not the model's loss.
    return Workload(loss="trl-fused" if trl else "hf", reference_model=trl == "dpo", seq_len=seq_len, micro_batch_size=batch, grad_accum_steps=int(args.gradient_accumulation_steps),
                    precision=precision, optimizer=_OPTIM[optim],
                    grad_checkpointing=gc, checkpoint_save_ops=save_ops,
                    attn_implementation=attn if attn in ("sdpa", "eager") else "auto", runner="hf-trainer",
                    target_len=target_len, images=images,
                    **({"packed_docs": packed[0], "packed_boundaries": packed[1]} if packed else {}),
                    **({"lora": live.lora, **live.quant} if live.quant else {}))


def _unpartitioned(live: _common.LiveModel, wl: Workload) -> tuple[_common.LiveModel, Workload]:
    """What to estimate when DeepSpeed ZeRO-3 has partitioned the live model.

    ZeRO-3 leaves each parameter an empty tensor (its shape in ``ds_shape``)
    and hooks every module to gather them (deepspeed/runtime/zero/
    partition_parameters.py, parameter_offload.py), so a structure copy of the
    live module would trace empty weights through DeepSpeed's hooks. The
    model is rebuilt from its config instead, with its LoRA settings.

    Raises:
        UnsupportedError: A partitioned model without a transformers config.
    """
    if not any(hasattr(p, "ds_id") for p in live.module.parameters()):
        return live, wl
    if live.config is None:
        raise UnsupportedError(f"{live.name} is partitioned by DeepSpeed ZeRO-3 and has no transformers config "
                               "to rebuild it from. HINT: estimate it before deepspeed.initialize")
    return dataclasses.replace(live, module=live.config, lora=None), dataclasses.replace(wl, lora=live.lora)


@contextlib.contextmanager
def _hf_zero3_init_off():
    """Build the estimator's models as plain modules even when the Trainer runs
    ZeRO-3: transformers builds every model under ``deepspeed.zero.Init`` while
    its DeepSpeed config is registered (transformers/integrations/deepspeed.py,
    ``is_deepspeed_zero3_enabled``), which would partition the estimator's
    meta model with the job's settings."""
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:
        yield
        return
    saved = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = saved


def _real_process_group_set_aside():
    """The job's own process groups hidden while the estimate runs (the DDP/
    FSDP/TP estimates trace under a fake default group):
    :func:`llmem_plugin.methods._fakepg.real_process_groups_set_aside`."""
    from llmem_plugin.methods._fakepg import real_process_groups_set_aside

    return real_process_groups_set_aside()


# TRL trainers whose training step the estimate runs (trl 1.16): SFTTrainer's compute_loss is the fused
# head's negative log-likelihood over the batch; DPOTrainer's _compute_loss scores [chosen; rejected] rows
# through the fused head and then the reference's (llmem_plugin.techniques.trl_head, llmem_plugin.techniques.reference).
_TRL_MODELLED = ("SFTTrainer", "DPOTrainer")


def _architecture(config: Any) -> dict[str, Any]:
    """A config without what does not shape the model: token ids (DPOTrainer sets the policy's pad token
    from the tokenizer, not the reference's), the checkpoint path, the library version and ``use_cache``
    (the Trainer turns it off on the policy; training forwards pass ``use_cache=False`` to both)."""
    return {k: v for k, v in config.to_dict().items()
            if not k.endswith(("token_id", "token_ids")) and k not in ("_name_or_path", "transformers_version", "use_cache")}


def _trl_step(trainer: Any, live: _common.LiveModel) -> str | None:
    """``"sft"`` or ``"dpo"`` for the TRL trainer running the job, None for a plain Trainer.

    Raises:
        UnsupportedError: A TRL trainer or setting whose step is not the one estimated: GRPO, RLOO and
            online trainers generate completions (a KV cache) before each step; KTO, reward and
            distillation trainers (GKD and GOLD are SFTTrainer subclasses with a teacher) run other losses
            and models; SFT's label smoothing or custom loss runs a full-logits forward beside the fused head;
            DPO's precomputed reference log-probs, WPO weighting, and a reference model other than the
            policy's architecture in its dtype change what each step holds.
    """
    from llmem_plugin.techniques.trl_head import DPO_REFUSED, has_fused_head

    trl_classes = [c for c in type(trainer).__mro__ if c.__module__.split(".")[0] == "trl"] if trainer else []
    if not trl_classes:
        if has_fused_head(live.module):
            raise UnsupportedError("the model carries TRL's fused LM head, but the trainer is not TRL's SFTTrainer "
                                   "or DPOTrainer, so its loss is unknown. HINT: train with one of those, or "
                                   "without add_fused_lm_head")
        return None
    name = trl_classes[0].__name__  # the most derived: GKD/GOLD subclass SFTTrainer with a teacher
    if name not in _TRL_MODELLED:
        raise UnsupportedError(f"TRL's {name} is not modelled (its step is not SFT's or DPO's: a preference or RL "
                               "loss, a teacher, or generation), so the job is not checked. HINT: run it without "
                               "LLMemCallback")
    if name == "SFTTrainer":
        if getattr(trainer, "label_smoother", None) is not None or getattr(trainer, "compute_loss_func", None):
            raise UnsupportedError("SFTTrainer with label_smoothing_factor or compute_loss_func is not modelled (the "
                                   "loss runs a full-logits forward beside the fused head). HINT: drop it to have "
                                   "the job checked")
        return "sft"
    for key, why in DPO_REFUSED.items():
        if getattr(trainer.args, key, False):
            raise UnsupportedError(f"DPOConfig {key}=True is not modelled ({why}). HINT: set {key}=False to have "
                                   "the job checked")
    ref, policy = getattr(trainer, "ref_model", None), trainer.model
    if ref is not None:
        if live.lora is not None:
            raise UnsupportedError("a separate ref_model beside a LoRA policy is not modelled (the estimate disables "
                                   "the adapters for the reference). HINT: pass ref_model=None; TRL then does the same")
        ref = getattr(ref, "module", ref)  # DeepSpeed's engine, DDP
        policy = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        same = type(ref) is type(policy) and _architecture(ref.config) == _architecture(policy.config)
        if not same or any(p.dtype != policy.dtype for p in ref.parameters() if p.is_floating_point()):
            raise UnsupportedError(f"the DPO reference model ({type(ref).__name__}) is not a copy of the policy in its "
                                   "dtype, which is what the estimate runs. HINT: pass ref_model=None (TRL then loads "
                                   "that copy, or disables a LoRA policy's adapters)")
    return "dpo"


def _find_trainer() -> Any:
    """The Trainer whose callback handler is calling us (callbacks receive no
    reference to it; ``Trainer.log`` is how metrics reach every reporter)."""
    from transformers import Trainer

    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None


class LLMemCallback(TrainerCallback):
    """Check the job's peak memory before its first step; compare after the first steps.

    Args:
        on_wont_fit: ``"abort"`` raises :class:`WontFitError` with the report
            before any step; ``"warn"`` logs it and trains on.
        margin: Fraction of the GPU to keep free (default 5%).
        compare_after_steps: Optimizer steps after which to compare the
            predicted peak with the measured one (0: never).
        seq_len: Tokens per sequence; default: the first batch's.
        gpu: Catalog GPU to estimate for; default: this process's CUDA device.
            Needed on the CPU, or to check the job for another GPU.
        gpu_memory: Capacity in bytes or as text (``"75GiB"``).
        tolerance_pct: Warn when a compared metric is off by more than this.
        record_file: JSONL file for the comparison row; default
            ``<output_dir>/llmem-verify.jsonl``; ``False`` writes none.
        strict: Stop the job (raise) when it cannot be checked; by default
            the callback warns once and training goes on unchecked.
        find_batch_size: Set ``per_device_train_batch_size`` to the largest
            that fits the GPU less ``headroom`` at the end of the Trainer's
            ``__init__`` (:func:`largest_batch`; needs ``seq_len``), before
            ``train()`` builds its DataLoader: the estimate's answer instead of
            ``auto_find_batch_size``'s out-of-memory trials.
        headroom: Memory kept free for ``find_batch_size`` (a fraction or a
            size; default :data:`llmem_plugin.planner.largest.DEFAULT_HEADROOM`).
        snapshot_dir: Record the real allocator history of the first steps
            (until the comparison) and write it there with the predicted
            snapshot and their comparison; on a CUDA out-of-memory error in
            a training step or the optimizer step, write them and print the
            predicted breakdown, then let the error through
            (:mod:`llmem_plugin.integrations._snapshots`). Not with
            ``auto_find_batch_size``, whose trials run out of memory on
            purpose. Off by default: recording slows every allocation.

    The comparison waits for the first steady-state step (step 2,
    :data:`~llmem_plugin.integrations._common.FIRST_STEADY_STEP`): the
    estimate is the steady state, and step 1 runs its forward without the
    optimizer states, which its ``step()`` creates.

    Attributes:
        check: The :class:`~llmem_plugin.integrations._common.Check` made
            before the first step (None until then, or when it was skipped).
        comparison: The :class:`~llmem_plugin.verify.meter.Comparison` (None until made).
        batch_size_result: With ``find_batch_size``: the
            :class:`~llmem_plugin.planner.largest.MaxResult` (None until made).
    """

    def __init__(self, on_wont_fit: str = "abort", margin: float = 0.05, compare_after_steps: int = 3,
                 seq_len: int | None = None, gpu: Any = None, gpu_memory: int | str | None = None, *,
                 tolerance_pct: float = DEFAULT_TOLERANCE_PCT, record_file: str | bool | None = None,
                 strict: bool = False, find_batch_size: bool = False,
                 headroom: float | int | str | None = None, snapshot_dir: str | os.PathLike | None = None) -> None:
        if on_wont_fit not in ("abort", "warn"):
            raise ConfigError(f"on_wont_fit must be 'abort' or 'warn', got {on_wont_fit!r}")
        if not 0 <= margin < 1:
            raise ConfigError(f"margin must be in [0, 1), got {margin!r}. HINT: e.g. margin=0.05 keeps 5% free")
        if isinstance(compare_after_steps, bool) or not isinstance(compare_after_steps, int) or compare_after_steps < 0:
            raise ConfigError(f"compare_after_steps must be an integer >= 0, got {compare_after_steps!r}")
        if seq_len is not None and (not isinstance(seq_len, int) or seq_len <= 0):
            raise ConfigError(f"seq_len must be a positive integer, got {seq_len!r}")
        if not isinstance(strict, bool):
            raise ConfigError(f"strict must be True or False, got {strict!r}. HINT: strict=True stops a job that "
                              "cannot be checked")
        _common.validate_target(gpu, gpu_memory)  # a bad value stops at once, not at the first step
        if find_batch_size and seq_len is None:
            raise ConfigError("find_batch_size=True sets the batch size before the DataLoader is built, before "
                              "any batch is seen. HINT: pass LLMemCallback(find_batch_size=True, seq_len=...)")
        from llmem_plugin.planner.largest import DEFAULT_HEADROOM, headroom_bytes

        self.headroom = DEFAULT_HEADROOM if headroom is None else headroom
        headroom_bytes(self.headroom, 2**50)  # a bad spelling stops here
        self.find_batch_size = find_batch_size
        self.snapshot_dir = snapshot_dir
        self.recorder: Any = None
        self.batch_size_result = None
        self.strict = strict
        self.on_wont_fit = on_wont_fit
        self.margin = margin
        self.compare_after_steps = compare_after_steps
        self.seq_len = seq_len
        self.gpu = gpu
        self.gpu_memory = gpu_memory
        self.tolerance_pct = tolerance_pct
        self.record_file = record_file
        self.check: _common.Check | None = None
        self.comparison = None
        self._hook: Any = None
        self._meter: PeakMeter | None = None
        self._steps = 0
        self._args: Any = None
        self._trainer: Any = None
        self._optimizer: Any = None
        self._warned = False

    # ----------------------------------------------------------- before training
    def on_init_end(self, args, state, control, model=None, **kwargs):
        """With ``find_batch_size``: set ``per_device_train_batch_size`` to the largest that fits, at the end of
        ``Trainer.__init__``, and the Trainer's ``_train_batch_size``, which ``__init__`` copied from
        ``args.train_batch_size`` just before this event and ``train()`` builds its DataLoader from
        (transformers trainer.py): no step runs at another size."""
        if not self.find_batch_size:
            return control
        trainer = _find_trainer()
        try:
            if trainer is None:
                raise UnsupportedError("the Trainer calling the callback was not found, so its batch size cannot "
                                       "be set before train()")
            target, memory = _common.resolve_target(self.gpu, self.gpu_memory)
            capacity = memory or target.capacity_bytes
            # The check before the first step keeps `margin` free: size the batch to keep at least as much.
            from llmem_plugin.planner.largest import headroom_bytes

            room = max(headroom_bytes(self.headroom, capacity), int(self.margin * capacity))
            self.batch_size_result = largest_batch(model, args, seq_len=self.seq_len, gpu=target, gpu_memory=memory,
                                                   headroom=room / capacity, trainer=trainer)
        except WontFitError as e:
            if self.on_wont_fit == "abort":
                raise
            warnings.warn(f"llmem: {e}", stacklevel=2)
            return control
        except Exception as e:  # noqa: BLE001 - an estimator limitation never stops training
            self._not_checked(e, "the batch size stays as given; pass LLMemCallback(gpu='h100-sxm') (any name "
                                 "`llmem gpus` lists) to size it for that GPU")
            return control
        r = self.batch_size_result
        args.per_device_train_batch_size = r.value
        # __init__ copied args.train_batch_size just before on_init_end; train() builds its DataLoader from it.
        trainer._train_batch_size = args.train_batch_size
        if getattr(trainer, "is_deepspeed_enabled", False):  # as Trainer._update_auto_batch_size does
            from transformers.integrations.deepspeed import propagate_args_to_deepspeed

            propagate_args_to_deepspeed(trainer.accelerator, args, auto_find_batch_size=True)
        if r.headroom_bytes == 0:
            warnings.warn(f"llmem: per_device_train_batch_size=1 fits the {r.gpu} only within the headroom; the check "
                          "before the first step says whether it fits the margin", stacklevel=2)
        log.info("llmem: per_device_train_batch_size=%d, the largest that fits (%s does not) on %s, limit %.2f GiB "
                 "after %.2f GiB headroom; from %d estimates, no trial step", r.value, r.next_value, r.gpu,
                 r.limit_bytes / 2**30, r.headroom_bytes / 2**30, len(r.points))
        return control

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.find_batch_size and self.batch_size_result is None and not self._warned:
            self._not_checked(UnsupportedError("find_batch_size=True had no effect: the batch size is set when the "
                                               "Trainer is built (its on_init_end event)"),
                              "pass the callback in Trainer(callbacks=[...]), not through add_callback()")
        self._args, self._optimizer, self._steps = args, optimizer, 0
        self.check, self.comparison = None, None
        self._trainer = _find_trainer()
        if self.snapshot_dir is not None:
            self._record_snapshots(args)
        try:
            target, memory = _common.resolve_target(self.gpu, self.gpu_memory)
            live = _common.live_model(model)
        except Exception as e:  # noqa: BLE001 - no CUDA device and no gpu=, a device the catalog lacks
            self._not_checked(e, "pass LLMemCallback(gpu='h100-sxm') (any name `llmem gpus` lists) to check the "
                                 "job for that GPU")
            return control
        self._hook = live.module.register_forward_pre_hook(
            lambda mod, a, kw: self._first_forward(live, target, memory, a, kw), with_kwargs=True)
        return control

    def _record_snapshots(self, args) -> None:
        """``snapshot_dir``: a recorder for the first steps, and out-of-memory errors of a training step
        caught on their way out (written down, then raised on unchanged)."""
        from llmem_plugin.integrations._snapshots import SnapshotRecorder

        rank = int(getattr(args, "process_index", 0))

        def predicted():
            with _hf_zero3_init_off():  # a distributed check traces its method again: plain modules
                return _common.predicted_snapshot(self.check, rank=rank)

        self.recorder = SnapshotRecorder(self.snapshot_dir, rank=rank, predicted=predicted)
        if getattr(args, "auto_find_batch_size", False):
            return  # its out-of-memory trials are the Trainer's to handle: no report per trial
        for owner, name in ((self._trainer, "training_step"), (self._optimizer, "step")):
            if owner is not None and not getattr(getattr(owner, name, None), "_llmem_wrapped", False):
                setattr(owner, name, self._reporting_oom(getattr(owner, name)))

    def _reporting_oom(self, fn):
        """``fn`` (the training step, the optimizer step) reporting a CUDA out-of-memory error through the
        current recorder, then raising it on unchanged."""
        import functools

        @functools.wraps(fn)
        def wrapped(*a, **kw):
            try:
                return fn(*a, **kw)
            except torch.OutOfMemoryError as e:
                if self.recorder is not None:
                    est = self.check.estimate if self.check is not None else None
                    self.recorder.breakdown = {getattr(c, "value", c): v
                                               for c, v in (getattr(est, "breakdown", None) or {}).items()}
                    self.recorder.on_oom(e)
                raise

        wrapped._llmem_wrapped = True
        return wrapped

    def _first_forward(self, live, target, memory, args_in, kwargs_in) -> None:
        self._hook.remove()
        self._hook = None
        if self.recorder is not None:
            self.recorder.start()
        dims = _common.batch_dims(kwargs_in) or _common.batch_dims(args_in)
        if dims is None and self.seq_len is None:
            self._not_checked(ConfigError("the first batch has no input_ids to read the sequence length from. "
                                          "HINT: pass LLMemCallback(seq_len=...)"))
            return
        batch = dims[0] if dims else int(self._args.per_device_train_batch_size)
        seq_len = self.seq_len or dims[1]
        try:
            step = _trl_step(self._trainer, live)
            job = job_of(self._args)
            wl = _workload(self._args, live, batch, seq_len, _common.target_len(live, kwargs_in),
                           _common.images_per_sample(live, kwargs_in), _common.packing_of(kwargs_in), trl=step)
            source, wl = _unpartitioned(live, wl)
            with _real_process_group_set_aside(), _hf_zero3_init_off():
                self.check = _common.check(source, wl, method=job.method, num_gpus=job.num_gpus,
                                           num_nodes=job.num_nodes, gpu=target, gpu_memory=memory,
                                           margin=self.margin, options=job.options,
                                           keep_trace=self.snapshot_dir is not None)
        except (UnsupportedError, ConfigError) as e:
            self._not_checked(e)
            return
        except Exception as e:  # noqa: BLE001 - a trace failure is the estimator's, not the job's
            self._not_checked(e, prefix="the estimate failed: ")
            return
        notes = "".join(f"\nnote: {n}" for n in job.notes)
        if not self.check.fits:
            message = f"llmem: {self.check.message()}{notes}\n{self.check.report}"
            if self.on_wont_fit == "abort":
                raise WontFitError(message)
            warnings.warn(message, stacklevel=2)
        else:
            log.info("llmem: %s%s", self.check.message(), notes)
        if self.compare_after_steps:
            self._start_meter(live, kwargs_in, args_in)

    def _not_checked(self, reason: Exception, how: str | None = None, *, prefix: str = "") -> None:
        """Warn once that the job runs unchecked, or raise under ``strict``."""
        if self.strict:
            if isinstance(reason, LLMemError):
                raise reason
            raise UnsupportedError(f"llmem: the job cannot be checked (strict=True): {prefix}"
                                   f"{type(reason).__name__}: {reason}") from reason
        line = _common.not_checked_line("llmem", reason, how)
        if prefix:
            line = line.replace("training goes on: ", f"training goes on: {prefix}", 1)
        if not self._warned:
            self._warned = True
            warnings.warn(line, stacklevel=3)
        log.info(line)

    def _start_meter(self, live, kwargs_in, args_in) -> None:
        precision = Precision(self.check.prediction.workload["precision"])
        from llmem_plugin.device.gpus import get_gpu

        cc = get_gpu(self.check.prediction.gpu).compute_capability
        self._meter = PeakMeter(autocast_dtype=precision.autocast_dtype, compute_capability=cc)
        live_tensors = list(live.module.parameters()) + list(live.module.buffers())
        ref = getattr(self._trainer, "ref_model", None)  # DPO's separate reference, on the device for the run
        if isinstance(ref, torch.nn.Module):
            live_tensors += list(ref.parameters()) + list(ref.buffers())
        live_tensors += [t for t in list(kwargs_in.values()) + list(args_in) if isinstance(t, torch.Tensor)]
        self._meter.start(live_tensors, optimizer=self._optimizer)

    # ------------------------------------------------------------ during training
    def on_step_end(self, args, state, control, **kwargs):
        if self.recorder is not None and self.recorder.recording and \
                state.global_step >= _common.compare_step(self.compare_after_steps or 1):
            self.recorder.finish()
        if self._meter is None or not self._meter.running:
            return control
        self._steps += 1
        self._meter.step_end(self._steps)
        if self._steps >= _common.compare_step(self.compare_after_steps):
            self._compare(state)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.recorder is not None and self.recorder.recording:
            self.recorder.finish()  # fewer steps than the comparison waits for
        if self._meter is not None and self._meter.running:
            if self._steps >= _common.FIRST_STEADY_STEP:
                self._compare(state)  # fewer steps than asked: compare what ran
            else:
                self._meter.abandon()
                log.info("llmem: training ended after %d optimizer step(s), before the first steady-state step "
                         "(step %d), which the estimate predicts: not compared", self._steps,
                         _common.FIRST_STEADY_STEP)
        return control

    def _compare(self, state) -> None:
        measurement = self._meter.stop()
        self.comparison = compare(self.check.prediction, measurement)
        metrics = self.comparison.metrics()
        if self._trainer is not None:
            self._trainer.log(dict(metrics))
        else:
            state.log_history.append({**metrics, "step": state.global_step})
        log.info("llmem: after %d steps: %s", self._steps, self.comparison.summary())
        outside = self.comparison.outside(self.tolerance_pct)
        if outside:
            warnings.warn(f"llmem: predicted vs actual differ by more than {self.tolerance_pct}%: "
                          f"{self.comparison.summary()}", stacklevel=2)
        path = self.record_file
        if path is None:
            path = os.path.join(self._args.output_dir, "llmem-verify.jsonl")
        if path:
            rank = int(getattr(self._args, "process_index", 0))
            run = os.path.basename(os.path.normpath(self._args.output_dir)) or "run"
            append_row(path, self.comparison.to_row(run_id=f"{run}-{self.check.prediction.method}",
                                                    runner="hf-trainer", rank=rank))


def largest_batch(model: Any, training_args: Any, *, seq_len: int, gpu: Any = None, gpu_memory: Any = None,
                  headroom: float | int | str | None = None, trainer: Any = None) -> Any:
    """The largest ``per_device_train_batch_size`` of the job ``training_args`` describe that fits the GPU
    (:func:`llmem_plugin.planner.largest.max_batch_size`, per rank for DDP, ZeRO and FSDP); nothing is changed.

    Args:
        model: The model the Trainer trains (real or meta).
        training_args: Its ``TrainingArguments``; the search starts at its ``per_device_train_batch_size``.
        seq_len: Tokens per sequence of the training data.
        gpu, gpu_memory: The GPU (catalog name) and an optional capacity; default this process's CUDA device.
        headroom: Memory kept free (fraction or size; default ``DEFAULT_HEADROOM``).
        trainer: The Trainer, where it is built: a TRL trainer's step (its reference model, its fused head)
            is then sized, as the callback's check estimates it.

    Returns:
        The :class:`~llmem_plugin.planner.largest.MaxResult`.

    Raises:
        WontFitError: Not even one row fits.
        ConfigError, UnsupportedError: As the callback's check.
    """
    from llmem_plugin.planner.largest import DEFAULT_HEADROOM

    gpu, memory = _common.resolve_target(gpu, gpu_memory)
    live = _common.live_model(model)
    config = live.config
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "vision_config", None) is not None:
        raise UnsupportedError(f"{live.name}: the batch of a seq2seq or vision model depends on its target length "
                               "and images, which are not known before the first batch; it is not sized. HINT: run "
                               "`llmem max batch-size` with --target-len / --images")
    job = job_of(training_args)
    step = _trl_step(trainer, live) if trainer is not None else None
    wl = _workload(training_args, live, int(training_args.per_device_train_batch_size), seq_len, trl=step)
    source, wl = _unpartitioned(live, wl)
    with _real_process_group_set_aside(), _hf_zero3_init_off():
        return _common.largest_batch(source, wl, method=job.method, num_gpus=job.num_gpus, num_nodes=job.num_nodes,
                                     gpu=gpu, gpu_memory=memory, options=job.options,
                                     headroom=DEFAULT_HEADROOM if headroom is None else headroom)


def autoconfigure(model: Any, training_args: Any, cluster: dict[str, Any] | None = None, *, seq_len: int,
                  margin: float = 0.05, methods: list[str] | None = None) -> Any:
    """Plan the job and return ``TrainingArguments`` that run the plan's choice.

    The global batch (per-device batch x accumulation x world size of
    ``training_args``) is kept; the planner picks the method, micro-batch,
    accumulation and checkpointing.

    Args:
        model: The model the Trainer will train (real or meta).
        training_args: The ``TrainingArguments`` to start from.
        cluster: ``{"num_gpus", "num_nodes", "gpu", "gpu_memory"}``; default:
            the world size of ``training_args`` on one node, this process's GPU.
        seq_len: Tokens per sequence of the training data.
        margin: Fraction of the GPU to keep free.
        methods: Planner methods to consider (default: those the Trainer runs
            from its arguments, :data:`HF_METHODS`).

    Returns:
        A copy of ``training_args`` with ``deepspeed`` or ``fsdp``/``fsdp_config``,
        ``per_device_train_batch_size``, ``gradient_accumulation_steps`` and
        ``gradient_checkpointing`` set. ``.llmem_plan`` on it holds the plan.

    Raises:
        WontFitError: Nothing fits; carries the plan and its suggestions.
    """
    from llmem_plugin.integrations.deepspeed import to_deepspeed_config

    cluster = dict(cluster or {})
    unknown = set(cluster) - {"num_gpus", "num_nodes", "gpu", "gpu_memory"}
    if unknown:
        raise ConfigError(f"unknown cluster keys {sorted(unknown)}; valid: num_gpus, num_nodes, gpu, gpu_memory")
    num_gpus = int(cluster.get("num_gpus", getattr(training_args, "world_size", 1) or 1))
    num_nodes = int(cluster.get("num_nodes", 1))
    target, memory = _common.resolve_target(cluster.get("gpu"), cluster.get("gpu_memory"))
    live = _common.live_model(model)
    bad = [m for m in (methods or []) if m not in HF_METHODS]
    if any(m.startswith("pp") for m in bad):
        # The Trainer has no pipeline schedule: a pipeline plan cannot run in it.
        raise ConfigError(f"methods {bad}: pipeline parallelism does not run in the Hugging Face Trainer (it has no "
                          f"pipeline schedule). HINT: drop them here (valid: {', '.join(HF_METHODS)}), or plan with "
                          "`llmem plan` and run the pipeline with torchtitan")
    if bad:
        raise ConfigError(f"methods {bad} do not run from TrainingArguments; valid: {', '.join(HF_METHODS)}")
    wl = _workload(training_args, live, 1, seq_len)
    global_batch = (int(training_args.per_device_train_batch_size) * int(training_args.gradient_accumulation_steps)
                    * num_gpus)
    plan = _common.choose(live, dataclasses.replace(wl, grad_checkpointing=False), gpu=target, gpu_memory=memory,
                          num_gpus=num_gpus, num_nodes=num_nodes, margin=margin, methods=methods or HF_METHODS,
                          global_batch=global_batch)
    c = plan.choice
    changes: dict[str, Any] = {"per_device_train_batch_size": c.micro_batch,
                               "gradient_accumulation_steps": c.grad_accum,
                               "gradient_checkpointing": c.grad_checkpointing,
                               "deepspeed": None, "fsdp": "", "fsdp_config": None}
    if c.method.startswith("zero"):
        ds = to_deepspeed_config(plan, optimizer=False)  # the Trainer builds it from its arguments
        changes["deepspeed"] = ds
    elif c.method in ("fsdp", "fsdp-offload"):
        changes["fsdp"] = "full_shard auto_wrap" + (" offload" if c.method == "fsdp-offload" else "")
        changes["fsdp_config"] = {"version": 2, "reshard_after_forward": True}
    if c.grad_checkpointing:
        changes["gradient_checkpointing_kwargs"] = {"use_reentrant": False}  # as estimated
    fields = {f.name for f in dataclasses.fields(training_args) if f.init}
    kwargs = {k: getattr(training_args, k) for k in fields}
    kwargs.update(changes)
    new = type(training_args)(**kwargs)
    new.llmem_plan = plan
    log.info("llmem: %s\n%s", plan.why, _common.report_text(plan))
    return new
