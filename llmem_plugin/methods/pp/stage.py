"""One pipeline rank's training step, as torch's own pipelining runs it.

A rank holds one or more stages of a decoder-only causal LM
(:class:`DecoderStage`: the embedding on the first, a run of decoder layers,
the final norm and head on the last) and runs torch 2.13's
``torch.distributed.pipelining`` schedule over them: ``PipelineStage``'s
receive buffers, its forward cache and output chunks, its input gradients
accumulated on the receive buffers, the schedule's loss and gradient scaling
are all torch's own code. :func:`run_rank` drives it under a
:class:`~llmem_plugin.trace.tracker.MemoryTracker`, either on real tensors inside a
real process group (the ground truth: a multi-process gloo run on CPU) or on
fake tensors under the fake process group (the estimate).

What a fake run needs (torch 2.13):

* each stage gets static ``input_args``/``output_args`` (non-first inputs and
  all outputs requiring grad), so no shape inference runs a forward, and the
  warm-up vote (``_PipelineSchedule._warmup_p2p``) comes out
  ``InferenceMode.STATIC``. The vote reads its result with ``.item()``, which
  a fake tensor cannot answer; the tracker answers 1 (its placeholder for
  ``.item()``), the static vote, so the vote runs and allocates as it does;
* the fake process group's P2P works hold their tensors as real ones do
  (:func:`held_p2p_works`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmem_plugin.errors import UnsupportedError
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, Phase, TraceResult

__all__ = ["PIPELINE_MODEL_TYPES", "DecoderStage", "StageSpec", "action_segments", "check_model", "run_rank",
           "stage_modules"]


@dataclass(frozen=True)
class StageSpec:
    """A global pipeline stage: decoder layers ``[start, stop)`` of ``num_stages`` stages."""

    index: int
    num_stages: int
    start: int
    stop: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1


# Architectures whose decoder layers :class:`DecoderStage` calls as their model does: rotary embeddings
# from the model's rotary module, causal attention with no mask tensor, logits straight from the head.
# Checked for Llama against the model's own forward (tests/methods/pp/test_pp.py); the others share its
# decoder code in transformers (Qwen2/Qwen3 add biases or q/k norms inside the layer, Mistral a sliding
# window, refused below where it applies).
PIPELINE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def check_model(config: Any, seq_len: int) -> None:
    """Refuse what :class:`DecoderStage` would run differently from the model.

    Raises:
        UnsupportedError: Another architecture, a sliding window shorter than the sequence (the model
            builds a sliding mask the stage does not), or logit soft-capping (the model's extra ops on the
            logits).
    """
    model_type = getattr(config, "model_type", None)
    why = None
    if model_type not in PIPELINE_MODEL_TYPES:
        why = f"model type {model_type!r} is not one of {', '.join(PIPELINE_MODEL_TYPES)}"
    else:
        window = getattr(config, "sliding_window", None)
        on = getattr(config, "use_sliding_window", True) or "sliding_attention" in (
            getattr(config, "layer_types", None) or ())
        if window is not None and on and window < seq_len:
            why = f"its sliding window ({window}) is shorter than --seq-len {seq_len}"
        elif any(getattr(config, k, None) for k in ("final_logit_softcapping", "attn_logit_softcapping")):
            why = "it soft-caps its logits"
    if why:
        raise UnsupportedError(f"pipeline stages are not modelled for this model: {why}. HINT: estimate it with a "
                               "method without pipeline parallelism")


def _decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder, head) of a causal LM whose decoder has ``embed_tokens``, ``layers``, ``norm`` and
    ``rotary_emb``, as the Llama family's."""
    decoder = getattr(model, "model", None)
    head = getattr(model, "lm_head", None)
    if decoder is None or head is None or not all(
            hasattr(decoder, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise UnsupportedError(f"pipeline stages are modelled for Llama-family causal LMs (model.embed_tokens, "
                               f"layers, norm, rotary_emb and lm_head); {type(model).__name__} has another layout. "
                               "HINT: estimate it with a method without pipeline parallelism")
    return decoder, head


class DecoderStage(nn.Module):
    """One pipeline stage of a Llama-family causal LM, as torchtitan cuts its models: the first stage embeds
    token ids, every stage runs its decoder layers with rotary embeddings from its own copy of the rotary
    module, the last applies the final norm and the head and returns the logits. Causal attention is the
    kernels' own (no mask tensor), as for unpadded rows.

    A stage's modules are the full model's own, so its parameters are that model's.
    """

    def __init__(self, model: nn.Module, spec: StageSpec) -> None:
        super().__init__()
        decoder, head = _decoder_parts(model)
        self.spec = spec
        self.embed_tokens = decoder.embed_tokens if spec.first else None
        self.layers = nn.ModuleList(list(decoder.layers)[spec.start:spec.stop])
        self.rotary_emb = decoder.rotary_emb
        self.norm = decoder.norm if spec.last else None
        self.lm_head = head if spec.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            out = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
            h = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def stage_modules(model: nn.Module, specs: list[StageSpec]) -> list[DecoderStage]:
    """This rank's stages of ``model``; the rest of the model is dropped with it."""
    return [DecoderStage(model, s) for s in specs]


def _static_args(spec: StageSpec, micro_batch: int, seq_len: int, hidden: int, vocab: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``input_args``/``output_args`` of a stage's ``PipelineStage``: meta tensors of one microbatch's
    shapes (only their metadata is read)."""
    if spec.first:
        inp = torch.empty(micro_batch, seq_len, dtype=torch.long, device="meta")
    else:
        inp = torch.empty(micro_batch, seq_len, hidden, dtype=dtype, device="meta", requires_grad=True)
    width = vocab if spec.last else hidden
    out = torch.empty(micro_batch, seq_len, width, dtype=dtype, device="meta", requires_grad=True)
    return inp, out


class _HeldWork:
    """A fake process group's P2P work that keeps its tensor until it is dropped, as a real one does: gloo's
    send and receive works own their tensor (ProcessGroupGloo.cpp, ``SendWork``/``RecvWork``), so a sent
    activation outlives the stage's forward cache until the schedule lets go of the work. (NCCL's works
    release their stashed tensors at ``wait()``, which the schedule calls just before it drops them, so this
    is the later of the two, the safe side.)"""

    __slots__ = ("_work", "_tensor")

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self._work, self._tensor = work, tensor

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def held_p2p_works() -> Iterator[None]:
    """The fake process group's P2P works keep their tensors (:class:`_HeldWork`), within this context."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(p2p_ops, desc=None):
        works = original(p2p_ops, desc)
        if len(works) != len(p2p_ops):  # one coalesced work for a mixed batch: it holds every tensor
            return [_HeldWork(w, [op.tensor for op in p2p_ops]) for w in works]
        return [_HeldWork(w, op.tensor) for w, op in zip(works, p2p_ops)]

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


def _phased(stage: Any, tracker: MemoryTracker, on_action: Callable[[str, int, int], None] | None) -> None:
    """Announce each compute action of ``stage`` to the tracker: its phase, and a mark ``kind:stage:mb`` (kind
    F, B, I or W), whose first position the trace keeps."""
    for name, phase, kind in (("forward_one_chunk", Phase.FORWARD, "F"),
                              ("backward_one_chunk", Phase.BACKWARD, "B"),
                              ("backward_weight_one_chunk", Phase.BACKWARD, "W")):
        original = getattr(stage, name)

        def wrapped(chunk_id, *args, _original=original, _phase=phase, _kind=kind, **kwargs):
            if _kind == "B" and not kwargs.get("full_backward", True):
                _kind = "I"
            tracker.set_phase(_phase)
            tracker.mark(f"{_kind}:{stage.stage_index}:{chunk_id}")  # TraceResult.marks: "F:0:3:forward"
            if on_action is not None:
                on_action(_kind, stage.stage_index, chunk_id)
            out = _original(chunk_id, *args, **kwargs)
            if on_action is not None:
                on_action(f"after-{_kind}", stage.stage_index, chunk_id)
            return out

        setattr(stage, name, wrapped)


def _pipeline_schedule(model: nn.Module, specs: list[StageSpec], modules: list[nn.Module], *, schedule: str,
                       microbatches: int, micro_batch_size: int, seq_len: int, vocab: int, group: Any,
                       activation_dtype: torch.dtype | None) -> tuple[list[Any], Any]:
    """The rank's ``PipelineStage`` objects over ``modules`` (static shapes, :func:`_static_args`) and torch's
    schedule class for ``schedule`` over them, with the model's own loss function."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from llmem_plugin.methods.pp.schedule import SCHEDULES

    hidden = int(model.config.hidden_size)
    dtype = activation_dtype or next(p for p in model.parameters() if p.is_floating_point()).dtype
    device = torch.device("cpu")
    stages = []
    for spec, mod in zip(specs, modules):
        inp, out = _static_args(spec, micro_batch_size, seq_len, hidden, vocab, dtype)
        stages.append(PipelineStage(mod, spec.index, spec.num_stages, device, input_args=inp, output_args=out,
                                    group=group))
    loss_function = model.loss_function

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_function(logits, target, vocab)

    cls = get_schedule_class(SCHEDULES[schedule])
    sched = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, microbatches, loss_fn=loss_fn)
    return stages, sched


def _track_stages(tracker: MemoryTracker, stack: contextlib.ExitStack, specs: list[StageSpec],
                  modules: list[nn.Module], stages: list[Any], params: list[nn.Parameter], *, fake: bool,
                  contexts: tuple[contextlib.AbstractContextManager, ...],
                  on_action: Callable[[str, int, int], None] | None) -> None:
    """Inside ``tracker``: register the stages' parameters and buffers, enter ``contexts`` on ``stack`` (after
    the fake P2P works that hold their tensors, in a fake run), and name and phase each compute action."""
    if fake:
        stack.enter_context(held_p2p_works())
    tracker.register(params, MemoryCategory.PARAMETER)
    tracker.register([b for m in modules for b in m.buffers()], MemoryCategory.PARAMETER)
    for ctx in contexts:
        stack.enter_context(ctx)
    # Each allocation is attributed to the stage part running it ("s3.layers.0.mlp"), for segmenting.
    tracker.watch_modules(nn.ModuleDict({f"s{spec.index}": mod for spec, mod in zip(specs, modules)}))
    for stage in stages:
        _phased(stage, tracker, on_action)


def _optimizer_step(tracker: MemoryTracker, opt: torch.optim.Optimizer, trainable: list[nn.Parameter], *,
                    iteration: int, step: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None,
                    on_action: Callable[[str, int, int], None] | None) -> None:
    """The optimizer step that ends an iteration: label the gradients, step (``step`` or ``opt.step()``),
    label the states it holds, and drop the gradients."""
    from llmem_plugin.trace.step import host_resident_state, state_tensors

    tracker.label([p.grad for p in trainable if p.grad is not None], MemoryCategory.GRADIENT)
    tracker.set_phase(Phase.OPTIMIZER)
    if on_action is not None:
        on_action("optimizer", -1, iteration)
    if step is None:
        opt.step()
        stepped = opt
    else:
        stepped = step(opt)
    tracker.label(state_tensors(stepped), MemoryCategory.OPTIMIZER_STATE)
    tracker.label(host_resident_state(stepped), MemoryCategory.HOST)  # AdamW's step counters on CUDA
    opt.zero_grad(set_to_none=True)


def run_rank(
    model: nn.Module,
    specs: list[StageSpec],
    *,
    schedule: str,
    microbatches: int,
    micro_batch_size: int,
    seq_len: int,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    tracker: MemoryTracker,
    group: Any = None,
    fake_mode: Any = None,
    iterations: int = 2,
    accumulation: int = 1,
    vocab_size: int | None = None,
    contexts: tuple[contextlib.AbstractContextManager, ...] = (),
    on_action: Callable[[str, int, int], None] | None = None,
    return_outputs: bool = True,
    modules: list[nn.Module] | None = None,
    step: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None = None,
    activation_dtype: torch.dtype | None = None,
) -> TraceResult:
    """Run ``iterations`` training steps of this rank's ``specs`` stages under ``tracker``, each of
    ``accumulation`` schedule steps before its optimizer step.

    Args:
        model: The whole model (real or fake tensors); only this rank's stages are used.
        specs: This rank's global stages, in increasing index.
        schedule: A name of :data:`llmem_plugin.methods.pp.schedule.SCHEDULES`.
        microbatches: Microbatches per step; the step's batch is ``microbatches x micro_batch_size`` rows.
        accumulation: Schedule steps per optimizer step (torchtitan's gradient accumulation: one
            ``pp_schedule.step`` per accumulation step; each ends in FSDP2's reduction into the sharded
            gradients, which add up).
        optimizer: Builds the optimizer over the rank's trainable parameters.
        group: The pipeline process group (the default group if None).
        fake_mode: The fake mode the model's tensors belong to (None: a real run).
        contexts: Entered inside the tracker around the steps (e.g. the CUDA emulation).
        on_action: Called before every compute action with (kind, stage, microbatch) and after it with
            ("after-" + kind, stage, microbatch), and with ("step", -1, n) when the n-th schedule step starts
            (``iteration x accumulation + k``) and ("optimizer", -1, iteration) when an optimizer step starts.
        return_outputs: ``step(return_outputs=...)``: torch's default True keeps every microbatch's logits
            on the last stage and concatenates them when the step returns.
        modules: The stages' modules already built (and wrapped, e.g. by ``fully_shard``); None builds
            :func:`stage_modules`.
        step: Runs the optimizer step and returns the optimizer whose states to label (default
            ``optimizer.step()``).
        activation_dtype: The dtype stages pass each other (default: the parameters'; FSDP2's mixed
            precision computes in its ``param_dtype``).

    Returns:
        The trace of the steps, read before the stages and the optimizer are released.
    """
    modules = modules if modules is not None else stage_modules(model, specs)
    vocab = int(vocab_size or model.config.vocab_size)
    stages, sched = _pipeline_schedule(model, specs, modules, schedule=schedule, microbatches=microbatches,
                                       micro_batch_size=micro_batch_size, seq_len=seq_len, vocab=vocab, group=group,
                                       activation_dtype=activation_dtype)
    params = [p for m in modules for p in m.parameters()]
    unique = list({id(p): p for p in params}.values())
    trainable = [p for p in unique if p.requires_grad]
    opt = optimizer(trainable)
    holds_first = any(s.first for s in specs)
    holds_last = any(s.last for s in specs)
    mode_ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    rows = microbatches * micro_batch_size
    with mode_ctx, tracker, contextlib.ExitStack() as stack:
        _track_stages(tracker, stack, specs, modules, stages, unique, fake=fake_mode is not None, contexts=contexts,
                      on_action=on_action)
        for it in range(iterations):
            # One schedule step after another, inline: the step's ids and targets stay referenced by these
            # locals until the next step's replace them, one by one, which decides the allocator's reuse.
            for k in range(accumulation):
                tracker.set_phase(Phase.SETUP)
                if on_action is not None:
                    on_action("step", -1, it * accumulation + k)
                gen = torch.Generator().manual_seed(k) if fake_mode is None else None
                args, kwargs = (), {}
                batch = []
                if holds_first:
                    ids = torch.randint(0, vocab, (rows, seq_len), generator=gen)
                    args = (ids,)
                    batch.append(ids)
                if holds_last:
                    target = torch.randint(0, vocab, (rows, seq_len), generator=gen)
                    kwargs = {"target": target, "losses": []}
                    batch.append(target)
                tracker.register(batch, MemoryCategory.INPUT)
                sched.step(*args, return_outputs=return_outputs, **kwargs)
                del args, kwargs, batch
            _optimizer_step(tracker, opt, trainable, iteration=it, step=step, on_action=on_action)
        tracker.set_phase(Phase.SETUP)
        # Read while the stages, the schedule and the optimizer are alive: what they hold is freed when they
        # go, by reference counts or, for torch's cyclic stage structures, whenever the cyclic GC runs.
        return tracker.result()


def _part(module: str) -> str:
    """The stage part a module belongs to: "s3.layers.0.mlp" -> "layers"; "" outside the stages."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else pieces[0]


def _parts(starts: list[tuple[str, int]], result: TraceResult, records: list[Any]) -> list[tuple[str, int]]:
    """Each action segment cut where its allocations move to another stage part (embedding, decoder
    layers, norm, head, or none): "B:0:3:1|layers#1", "B:0:3:1|embed_tokens#1". Within one part the live
    bytes at its fullest moment are affine in depth; across parts they need not be (the first stage's
    backward is fullest at its first layer when deep, at the embedding's gradient when shallow)."""
    out = []
    ends = [pos for _, pos in starts[1:]] + [len(result.events)]
    for (name, start), end in zip(starts, ends):
        seen: dict[str, int] = {}
        current = None
        for i in range(start, end):
            sign, idx, _ = result.events[i]
            if sign < 0:
                continue
            part = _part(records[idx].module)
            if part != current:
                seen[part] = seen.get(part, 0) + 1
                out.append((f"{name}|{part}#{seen[part]}", start if current is None else i))
                current = part
        if current is None:
            out.append((name, start))
    return out


def action_segments(tracker: MemoryTracker) -> tuple[Callable[[str, int, int], None],
                                                      Callable[[TraceResult], list[tuple[str, int]]]]:
    """The ``on_action`` hook :func:`~llmem_plugin.methods.pp.stage.run_rank` calls, and a function that
    turns what it recorded into the trace's segments (:func:`trace_rank`'s ``segments``), for ``tracker``."""
    starts: list[tuple[str, int]] = []
    iteration = [0]

    def on_action(kind: str, stage: int, mb: int) -> None:
        if kind == "step":
            iteration[0] = mb
        name = f"{kind}:{mb}" if stage < 0 else f"{kind}:{stage}:{mb}:{iteration[0]}"
        starts.append((name, len(tracker._events)))

    def segments_of(result: TraceResult) -> list[tuple[str, int]]:
        # Positions among all recorded events -> among the device events the result keeps.
        device = [tracker._records[idx].category is not MemoryCategory.HOST for _, idx in tracker._events]
        before, k = [], 0
        for on_device in device + [False]:
            before.append(k)
            k += on_device
        return _parts([(name, before[pos]) for name, pos in starts], result, tracker._records)

    return on_action, segments_of
