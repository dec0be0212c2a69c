"""Run one complete training step under the tracker, on fake or real tensors.

The step is the plain PyTorch loop every trainer runs: for each micro-batch a
forward with labels (the model computes its own loss), ``backward``; then
``optimizer.step()`` and ``zero_grad(set_to_none=True)``. It runs twice:
optimizer states are created lazily by the first ``step()``, and the steady
state (states alive during forward and backward) shows in the second
(shared FACTS, "Two iterations").
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from llmem_plugin.errors import UnsupportedError
from llmem_plugin.models.litgpt import is_litgpt_model
from llmem_plugin.models.tasks import extra_inputs, make_labels, model_task
from llmem_plugin.techniques.packing import doc_lengths, packed_batch
from llmem_plugin.techniques.packing import tracing as packing_tracing
from llmem_plugin.trace import _pause
from llmem_plugin.trace.emulation import (
    DEFAULT_COMPUTE_CAPABILITY,
    autocast_region,
    cuda_emulation,
)
from llmem_plugin.trace.loading import LOADED_MARK, place_weights
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, Phase, TraceResult
from llmem_plugin.workload import LossImpl, OptimizerKind, Runner, Task, Workload

__all__ = ["MAX_TRACED_MICRO_STEPS", "NUM_ITERATIONS", "STEADY_MICRO_STEPS", "StepHooks", "host_resident_state", "make_optimizer",
           "micro_mark", "state_tensors", "trace_step", "traced_micro_steps"]

NUM_ITERATIONS = 2

# Gradient accumulation: the micro-steps traced per iteration when more
# accumulate. Micro-step 1 creates the gradients; from micro-step 2 on every
# micro-step runs the same ops on the same live tensors (the gradients are
# accumulated in place: AccumulateGrad, torch/csrc/autograd/functions/
# accumulate_grad.h), so its allocation sequence is the same. Micro-step 2 may
# still grow the caching allocator's segments (the gradients now occupy
# memory that micro-step 1 had free); once one micro-step leaves the
# allocator exactly as it found it, every later one repeats it byte for byte,
# peaks included. So 1, 2, 3 and the last (the accumulation boundary, where
# engines reduce) are traced, and the check that micro-step 3 left the
# allocator as it found it is made on the replay
# (llmem_plugin.estimate._micro_steps_repeat).
STEADY_MICRO_STEPS = 4
# The longest accumulation window traced micro-step by micro-step: the
# distributed methods trace every micro-step, and so does the single-GPU
# estimate where the allocator does not settle. Each is a full forward and
# backward (an 8B model's 2 x 32 micro-steps took over 6 minutes, issue 15),
# so a longer window is refused there rather than traced for hours.
MAX_TRACED_MICRO_STEPS = 256

# Learning rate and weight decay do not change memory; these are HF Trainer's
# defaults (TrainingArguments.learning_rate=5e-5), with AdamW's own decay.
_LR = 5e-5


# TrainingArguments.max_grad_norm default (transformers training_args.py).
_HF_MAX_GRAD_NORM = 1.0


def _outputs_to_fp32(out):
    """accelerate's ``convert_to_fp32`` on a model output: every fp16/bf16
    tensor becomes a new fp32 tensor (``tensor.float()``), in a new output of
    the same type; the half-precision originals are released with the old one."""
    converted = {k: v.float() if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) else v
                 for k, v in out.items()}
    return type(out)(**converted)


def _forward(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, workload: Workload,
             extra: dict[str, torch.Tensor] | None = None, drop_previous: Callable[[], None] | None = None):
    """The model's forward with its loss, as the workload computes it; returns
    a mapping with ``"loss"``. ``extra``: the task's other inputs (images).
    ``drop_previous``: releases what a plain loop still holds of the last
    micro-step; called where the loop rebinds its name for the outputs, when
    the model returns and before a loss the loop computes itself."""
    from llmem_plugin.models import litgpt

    if is_litgpt_model(model):  # litgpt's own loop and loss (llmem_plugin.models.litgpt)
        return litgpt.forward_with_loss(model, input_ids, labels, drop_previous)
    if workload.loss is LossImpl.HF and not workload.logits_to_keep:
        return model(input_ids=input_ids, labels=labels, use_cache=False, **(extra or {}))
    from llmem_plugin.techniques.loss import forward_with_loss

    return forward_with_loss(model, input_ids, labels, workload, drop_previous, extra)


def _activation_offload(workload: Workload, tracker: MemoryTracker) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context that offloads saved activations for one
    micro-batch (``workload.offload_activations``), or of a null context."""
    if workload.offload_activations is None:
        return contextlib.nullcontext
    from llmem_plugin.techniques.actoffload import offload_context

    return lambda: offload_context(workload.offload_activations, tracker)


def make_optimizer(params: Iterable[nn.Parameter], kind: OptimizerKind) -> torch.optim.Optimizer:
    """The optimizer a CUDA run builds for ``kind``, with its CUDA implementation.

    On CUDA, ``torch.optim._default_to_fused_or_foreach`` picks foreach for
    AdamW, SGD and Adafactor when every tensor is on CUDA; on CPU it would pick
    the per-tensor loop, which allocates differently, so foreach is explicit.
    """
    params = list(params)
    if kind is OptimizerKind.ADAMW:
        return torch.optim.AdamW(params, lr=_LR, foreach=True)
    if kind is OptimizerKind.ADAMW_FUSED:
        return torch.optim.AdamW(params, lr=_LR, fused=True)
    if kind is OptimizerKind.ADAMW_FORLOOP:
        return torch.optim.AdamW(params, lr=_LR, foreach=False)
    if kind.is_bitsandbytes:
        from llmem_plugin.techniques.optim import make_bnb_optimizer

        return make_bnb_optimizer(params, kind, lr=_LR)
    if kind is OptimizerKind.SGD:
        # momentum 0.9: the usual fine-tuning setting; momentum=0 keeps no state.
        return torch.optim.SGD(params, lr=_LR, momentum=0.9, foreach=True)
    if kind is OptimizerKind.ADAFACTOR:
        return torch.optim.Adafactor(params, lr=1e-2, foreach=True)
    raise AssertionError(kind)


def host_resident_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Optimizer state tensors that a CUDA run keeps on the host.

    torch/optim/adam.py (2.13, "special device hosting for step"): AdamW puts
    ``state['step']`` on the CPU unless ``fused`` or ``capturable``;
    torch/optim/_adafactor.py creates ``step`` with no device (so on the CPU).
    SGD keeps no step.
    """
    out = []
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and not on_device:
                out.append(step)
    return out


def _is_torch_optimizer(optimizer: object) -> bool:
    """One of torch.optim's optimizers the trace models (make_optimizer's), whose steps make host
    constants only (:meth:`llmem_plugin.trace.tracker.MemoryTracker.host_constants`)."""
    return type(optimizer) in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adafactor)


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def traced_micro_steps(grad_accum_steps: int, max_micro_steps: int | None = None) -> list[int]:
    """The micro-step indices (0-based) traced in each iteration.

    Args:
        grad_accum_steps: Micro-steps per optimizer step.
        max_micro_steps: At most this many (at least 2): the first
            ``max_micro_steps - 1`` and the last; None: all.
    """
    if max_micro_steps is None or grad_accum_steps <= max_micro_steps:
        return list(range(grad_accum_steps))
    assert max_micro_steps >= 2, max_micro_steps
    return [*range(max_micro_steps - 1), grad_accum_steps - 1]


def micro_mark(iteration: int, micro: int) -> str:
    """The trace mark at the start of a micro-step (``TraceResult.marks`` key)."""
    return f"micro:{iteration}:{micro}:{Phase.SETUP.value}"


class StepHooks:
    """Where an engine joins the traced step: the points at which a wrapper
    that cannot run under fake tensors (DeepSpeed, ColossalAI) allocates its
    own buffers, or where a traced one needs a switch flipped. The defaults
    are the plain loop's."""

    def register_parameters(self, tracker: MemoryTracker, params: list[torch.Tensor]) -> None:
        """Record the parameters at the start (an engine whose own buffers
        stand for them registers them as host memory instead)."""
        tracker.register(params, MemoryCategory.PARAMETER)

    def setup(self) -> None:
        """After registration, before the first micro-batch."""

    def begin_micro(self, iteration: int, micro: int) -> None:
        """After the micro-batch's inputs exist, before its forward."""

    def end_backward(self, iteration: int, micro: int) -> None:
        """After the micro-batch's backward and gradient labelling."""

    def step(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
        """The optimizer step; returns the optimizer whose states to label."""
        optimizer.step()
        return optimizer


def trace_step(
    model: nn.Module,
    workload: Workload,
    *,
    vocab_size: int,
    fake_mode=None,
    compute_capability: tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY,
    num_sms: int | None = None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    tracker: MemoryTracker | None = None,
    contexts: Sequence[contextlib.AbstractContextManager] = (),
    autocast: bool = True,
    offload: bool = False,
    hooks: StepHooks | None = None,
    reference: Callable[[torch.Tensor], object] | None = None,
    max_micro_steps: int | None = None,
) -> TraceResult:
    """Trace ``NUM_ITERATIONS`` training steps of ``model`` and replay them.

    Args:
        model: A model on fake CPU tensors (when ``fake_mode`` is given) or
            real CPU tensors, already in its workload precision.
        workload: The step to run.
        vocab_size: Token ids are drawn below this.
        fake_mode: The ``FakeTensorMode`` the model's tensors belong to, or
            None for a real run.
        compute_capability: GPU generation whose kernel choices to emulate.
        num_sms: The GPU's multiprocessor count (None: the default GPU of
            that generation).
        wrap: A distributed wrapper to apply once the parameters are
            registered (e.g. DDP); what it allocates is recorded as
            communication buffers, and the step runs the wrapped module.
        tracker: The tracker to record with (e.g. one that sees DTensors'
            local shards); a plain :class:`MemoryTracker` if None.
        contexts: Entered inside the tracker around the whole step (e.g.
            an engine's instrumentation).
        autocast: Run forward and loss under the workload's autocast; off
            when an engine casts parameters itself (FSDP2's mixed precision).
        offload: Model states live on the host (CPU offload): parameters,
            gradients and optimizer states count as host memory and the
            optimizer step, which runs on the host, is not traced.
        hooks: An engine's :class:`StepHooks` (the plain loop's if None).
        reference: A frozen reference model's forward (``workload.reference_model``):
            called with each micro-batch's input ids after the policy
            forward, before backward; what it returns is kept until the
            micro-batch ends.
        max_micro_steps: Trace only :func:`traced_micro_steps` of the
            accumulation window (hooks see each micro-step's own index); the
            caller checks that the untraced ones repeat the last middle one
            (see ``STEADY_MICRO_STEPS``). None: every micro-step.

    Returns:
        The replayed trace.
    """
    loop = _prepare_loop(model, workload, vocab_size=vocab_size, fake=fake_mode is not None, tracker=tracker,
                         autocast=autocast, offload=offload, wrap=wrap, hooks=hooks, reference=reference)
    mode_ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with mode_ctx, loop.tracker, contextlib.ExitStack() as stack:
        # A packed row's documents, for the attention emulation, within this trace only.
        stack.enter_context(packing_tracing(loop.documents))
        for ctx in contexts:
            stack.enter_context(ctx)
        model = _place_model(loop, model, wrap=wrap)
        with cuda_emulation(autocast_dtype=loop.autocast_dtype, compute_capability=compute_capability,
                            num_sms=num_sms, mark=loop.tracker.mark):
            loop.hooks.setup()
            micro_steps = traced_micro_steps(workload.grad_accum_steps, max_micro_steps)
            for it in range(NUM_ITERATIONS):
                for mb in micro_steps:
                    _micro_step(loop, model, it, mb)
                _optimizer_step(loop)
            loop.tracker.set_phase(Phase.SETUP)
            loop.drop_previous()  # the last outputs, released outside any phase's layers
        loop.tracker.set_phase(Phase.SETUP)
    return loop.tracker.result()


@dataclasses.dataclass(eq=False)
class _Loop:
    """The training loop around the traced step, made before the trace starts.

    It lives as long as the trace: ``params`` and ``labels_for`` keep the
    unwrapped model's parameters referenced throughout, as the job's own
    model does once a wrapper replaces them.

    Attributes:
        workload: The step to run.
        tracker: Records the step.
        hooks: The engine's :class:`StepHooks`.
        params: Every parameter of the unwrapped model, in order.
        trainable: The parameters that take gradients (the optimizer's).
        optimizer: From :func:`make_optimizer`.
        labels_for: The unwrapped model, whose task decides the labels.
        documents: The lengths of a packed row's documents, or None.
        vocab_size: Token ids are drawn below this.
        fake: The model's tensors are fake (no generator for the inputs).
        autocast_dtype: The forward's autocast dtype, or None.
        offload: Model states live on the host (see :func:`trace_step`).
        held: The category model states take (``HOST`` with ``offload``), or None for their own.
        hf: HF Trainer's additions (outputs cast to fp32, gradient clipping).
        lightning: Lightning's zero_grad between the first forward and its backward.
        plain: A hand-written loop, which keeps the last micro-step's outputs into the next.
        held_through_backward: The loop binds the outputs until backward returns.
        offload_ctx: A factory of the activation-offload context.
        reference: A frozen reference model's forward, or None.
        previous: The last micro-step's outputs a loop still holds.
    """

    workload: Workload
    tracker: MemoryTracker
    hooks: StepHooks
    params: list[torch.Tensor]
    trainable: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    labels_for: nn.Module
    documents: list[int] | None
    vocab_size: int
    fake: bool
    autocast_dtype: torch.dtype | None
    offload: bool
    held: MemoryCategory | None
    hf: bool
    lightning: bool
    plain: bool
    held_through_backward: bool
    offload_ctx: Callable[[], contextlib.AbstractContextManager]
    reference: Callable[[torch.Tensor], object] | None
    previous: list = dataclasses.field(default_factory=list)

    def drop_previous(self) -> None:
        """Release the last micro-step's outputs, where the loop rebinds its
        ``logits``/``outputs`` name: when the model returns, before a loss the
        loop computes itself."""
        self.previous.clear()


def _prepare_loop(model: nn.Module, workload: Workload, *, vocab_size: int, fake: bool,
                  tracker: MemoryTracker | None, autocast: bool, offload: bool,
                  wrap: Callable[[nn.Module], nn.Module] | None, hooks: StepHooks | None,
                  reference: Callable[[torch.Tensor], object] | None) -> _Loop:
    """Everything the loop needs before the trace starts: the tracker watching
    ``model``, the optimizer, the packed row's documents and what the runner
    changes; arguments as :func:`trace_step`'s.

    Raises:
        UnsupportedError: A litgpt model under an engine or offload, or a
            packed batch for a model that is not a causal LM.
    """
    if is_litgpt_model(model) and (wrap is not None or hooks is not None or offload):
        raise UnsupportedError("a litgpt model is modelled on one GPU only, in litgpt's own loop. HINT: estimate the "
                               "transformers model of the same architecture for distributed methods and offload")
    tracker = tracker if tracker is not None else MemoryTracker()
    tracker.watch_modules(model)
    b, s = workload.micro_batch_size, workload.seq_len
    params = [p for p in model.parameters()]
    documents = doc_lengths(b * s, workload.packed_docs) if workload.packed_docs is not None else None
    if workload.packed_docs is not None:
        if model_task(model) is not Task.CAUSAL_LM:  # the workload may not name the task; the model does
            raise UnsupportedError(f"--packed-docs with {type(model).__name__} ({model_task(model).value}) is not "
                                   "modelled: padding-free packing is for causal LMs. HINT: drop --packed-docs")
    trainable = [p for p in params if p.requires_grad]
    optimizer = make_optimizer(trainable, workload.optimizer)
    # A hand-written loop keeps the last micro-step's outputs (and the graph
    # its loss roots) until the next forward's outputs replace them.
    plain = workload.runner is Runner.PLAIN_LOOP
    return _Loop(
        workload=workload, tracker=tracker, hooks=hooks if hooks is not None else StepHooks(), params=params,
        trainable=trainable, optimizer=optimizer,
        labels_for=model,  # the task's labels, read before a wrapper hides the model's class
        documents=documents, vocab_size=vocab_size, fake=fake,
        autocast_dtype=workload.precision.autocast_dtype if autocast else None, offload=offload,
        held=MemoryCategory.HOST if offload else None,
        # HF Trainer's additions run where its own loop runs them: around the
        # plain and DDP steps (engines with their own step clip and cast themselves).
        hf=workload.runner is Runner.HF_TRAINER and hooks is None,
        lightning=workload.runner is Runner.LIGHTNING and hooks is None,
        plain=plain,
        # litgpt's fit() computes its loss from the `logits` it binds, so they live through backward
        # under any runner; the plain loop also keeps them into the next micro-step.
        held_through_backward=plain or is_litgpt_model(model),
        offload_ctx=_activation_offload(workload, tracker), reference=reference,
    )


def _place_model(loop: _Loop, model: nn.Module, *, wrap: Callable[[nn.Module], nn.Module] | None) -> nn.Module:
    """The setup phase, inside the tracker: the weights arrive (as the job
    loads them, in the plain loop), the buffers, the ``loaded`` mark; then the
    wrapper, whose allocations are communication buffers.

    Returns:
        The module the step runs (``wrap(model)``, or ``model``).
    """
    tracker, hooks = loop.tracker, loop.hooks
    if loop.offload:
        tracker.register(loop.params, MemoryCategory.HOST)
    elif type(hooks) is StepHooks:  # the plain loop: the weights arrive as the job loads them
        place_weights(tracker, model, loop.params, loop.workload, lambda ps: hooks.register_parameters(tracker, ps))
    else:
        hooks.register_parameters(tracker, loop.params)
    tracker.register(list(model.buffers()), MemoryCategory.PARAMETER)
    tracker.mark(LOADED_MARK)  # the end of the setup phase (TraceResult.marks["loaded:setup"])
    if wrap is not None:
        start = tracker.num_records
        model = wrap(model)
        tracker.label_live_since(start, MemoryCategory.TEMPORARY, MemoryCategory.COMM_BUFFER)
    return model


def _make_inputs(loop: _Loop, it: int, mb: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Micro-step ``mb`` of iteration ``it`` begins: its mark, and its batch
    (token ids, labels, the task's other inputs) registered as inputs.

    Returns:
        ``(input_ids, labels, extra)``.
    """
    tracker, workload = loop.tracker, loop.workload
    tracker.set_phase(Phase.SETUP)
    tracker.mark(f"micro:{it}:{mb}")  # its key in TraceResult.marks: micro_mark(it, mb)
    gen = torch.Generator().manual_seed(0) if not loop.fake else None
    if workload.packed_docs is not None:  # one padding-free row (llmem_plugin.techniques.packing)
        input_ids, labels, extra = packed_batch(loop.documents, loop.vocab_size, fake=loop.fake,
                                                boundaries=workload.packed_boundaries)
    else:
        input_ids = torch.randint(0, loop.vocab_size, (workload.micro_batch_size, workload.seq_len), generator=gen)
        labels = make_labels(loop.labels_for, input_ids, workload)
        extra = extra_inputs(loop.labels_for, input_ids, workload)
    tensors = [t for t in extra.values() if isinstance(t, torch.Tensor)]
    tracker.register([input_ids, labels, *tensors], MemoryCategory.INPUT)
    return input_ids, labels, extra


def _micro_step(loop: _Loop, model: nn.Module, it: int, mb: int) -> None:
    """One micro-batch: its inputs, the forward and loss, a reference model's
    forward, backward; then its gradients labelled."""
    tracker = loop.tracker
    input_ids, labels, extra = _make_inputs(loop, it, mb)
    loop.hooks.begin_micro(it, mb)
    tracker.set_phase(Phase.FORWARD)
    start = tracker.num_records
    # As HF Trainer's compute_loss: forward and loss inside
    # autocast, backward outside (the autocast weight-cast
    # cache is freed when the region exits).
    with loop.offload_ctx():
        loss = _forward_loss(loop, model, input_ids, labels, extra)
        # What the forward leaves alive is what backward needs.
        tracker.label_live_since(start, MemoryCategory.TEMPORARY, MemoryCategory.ACTIVATION)
        # TRL DPO: the frozen reference's no_grad forward runs after the policy's.
        ref_out = loop.reference(input_ids) if loop.reference is not None else None
        if loop.lightning and mb == 0:
            loop.optimizer.zero_grad(set_to_none=True)
        tracker.set_phase(Phase.BACKWARD)
        loss.backward()
        tracker.backward_returned()
    if not loop.plain:
        loop.drop_previous()  # a step that keeps nothing into the next (litgpt under --runner torch)
    del loss, input_ids, labels, extra
    del ref_out
    tracker.label([p.grad for p in loop.trainable if p.grad is not None], loop.held or MemoryCategory.GRADIENT)
    loop.hooks.end_backward(it, mb)


def _forward_loss(loop: _Loop, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                  extra: dict[str, torch.Tensor]) -> torch.Tensor:
    """The forward and the micro-batch's loss (divided by the accumulation
    steps), as the runner computes them; what the loop keeps of the outputs
    goes to ``loop.previous``."""
    workload = loop.workload
    if loop.hf:
        with autocast_region(loop.autocast_dtype):
            out = _forward(model, input_ids, labels, workload, extra)
        if loop.autocast_dtype is not None:
            out = _outputs_to_fp32(out)
        loss = out["loss"]
        del out
        return loss / workload.grad_accum_steps
    with autocast_region(loop.autocast_dtype):
        out = _forward(model, input_ids, labels, workload, extra, loop.drop_previous)
        if workload.runner is Runner.TORCH and not workload.outputs_to_fp32 and not loop.held_through_backward:
            # The plain loop's `loss = model(...).loss / n` inside its autocast block: the outputs (the logits) go
            # before the division allocates its result, the unscaled loss right after it, and the
            # autocast cast cache when the block exits.
            loss = out["loss"]
            del out
            scaled = loss / workload.grad_accum_steps
            del loss
            return scaled
    if workload.outputs_to_fp32:  # Fabric: after its forward_context, before the loss
        from llmem_plugin.techniques.loss import fabric_cast

        out = fabric_cast(out)
    loss = out["loss"] / workload.grad_accum_steps
    if loop.held_through_backward:
        loop.drop_previous()  # `outputs = model(...)`: the last step's outputs go by now
        loop.previous.append(out)
    del out
    return loss


def _optimizer_step(loop: _Loop) -> None:
    """The accumulation window's end: HF Trainer's gradient clipping, the
    optimizer step (untraced when it runs on the host), its states labelled,
    ``zero_grad``."""
    tracker = loop.tracker
    tracker.set_phase(Phase.OPTIMIZER)
    if loop.hf and not loop.offload:
        # Trainer: accelerator.clip_grad_norm_ -> torch.nn.utils.clip_grad_norm_
        # (foreach on CUDA) when max_grad_norm > 0, its default 1.0.
        torch.nn.utils.clip_grad_norm_(loop.trainable, _HF_MAX_GRAD_NORM, foreach=True)
    host = tracker.host_constants() if _is_torch_optimizer(loop.optimizer) else contextlib.nullcontext()
    with _pause.untracked() if loop.offload else host:
        stepped = loop.hooks.step(loop.optimizer)
    if stepped is not None:
        tracker.label(state_tensors(stepped), loop.held or MemoryCategory.OPTIMIZER_STATE)
        tracker.label(host_resident_state(stepped), MemoryCategory.HOST)
    if not loop.lightning:
        loop.optimizer.zero_grad(set_to_none=True)
