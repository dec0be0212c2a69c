"""The named steps of ``trace_step``, each run on its own on a tiny model.

Each step is run as ``trace_step`` runs it (the same loop, fake mode, tracker
and CUDA emulation) and stopped after it: what it records must be exactly
what the whole traced step records in that step's window (the same events,
bytes and record numbers), and its bytes must match a closed form.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin.errors import UnsupportedError
from llmem_plugin.models import modelbuild
from llmem_plugin.techniques.packing import tracing as packing_tracing
from llmem_plugin.trace.emulation import cuda_emulation
from llmem_plugin.trace.loading import LOADED_MARK
from llmem_plugin.trace.step import (
    _forward_loss,
    _make_inputs,
    _micro_step,
    _optimizer_step,
    _place_model,
    _prepare_loop,
    micro_mark,
    trace_step,
)
from llmem_plugin.trace.tracker import MemoryCategory, Phase, round_allocation
from llmem_plugin.workload import Workload

from tests.conftest import tiny_config

VOCAB = 512
_LOADED = f"{LOADED_MARK}:{Phase.SETUP.value}"
_SEQ_CLS = {"architectures": ["LlamaForSequenceClassification"]}


def _fake_model(cfg, wl: Workload):
    model = modelbuild.build_model(cfg, wl, device="meta")
    mode = FakeTensorMode()
    modelbuild.fakeify(model, mode)
    return model, mode


def _whole(cfg, wl: Workload):
    """The whole step, as the estimate traces it."""
    model, mode = _fake_model(cfg, wl)
    return trace_step(model, wl, vocab_size=VOCAB, fake_mode=mode)


@contextlib.contextmanager
def _placed(cfg, wl: Workload, *, emulate: bool = True):
    """The plain loop made and its weights placed as ``trace_step`` does, inside
    its fake mode and tracker (and, with ``emulate``, the CUDA emulation the
    micro-steps run in); yields the loop and the model the step runs."""
    model, mode = _fake_model(cfg, wl)
    loop = _prepare_loop(model, wl, vocab_size=VOCAB, fake=True, tracker=None, autocast=True, offload=False,
                         wrap=None, hooks=None, reference=None)
    with mode, loop.tracker, packing_tracing(loop.documents):
        placed = _place_model(loop, model, wrap=None)
        with cuda_emulation(autocast_dtype=loop.autocast_dtype, mark=loop.tracker.mark) if emulate \
                else contextlib.nullcontext():
            loop.hooks.setup()
            yield loop, placed


def _net(events) -> int:
    return sum(sign * nbytes for sign, _, nbytes in events)


@pytest.mark.parametrize("load", ["direct", "fp32-cast"])
def test_placing_the_model_records_the_setup_phase_of_the_whole_step(load):
    cfg, wl = tiny_config("llama"), Workload(seq_len=16, precision="bf16", load=load)
    with _placed(cfg, wl, emulate=False) as (loop, model):
        weights = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    setup = loop.tracker.result()
    whole = _whole(cfg, wl)
    assert setup.events == whole.events[: whole.marks[_LOADED]]
    assert setup.marks[_LOADED] == len(setup.events)
    # What stays is the weights and buffers, each once, as the caching allocator rounds them; the
    # fp32 copies of fp32-cast are released one by one (tests/trace/test_loading.py has their peak).
    assert _net(setup.events) == sum(round_allocation(t.numel() * t.element_size()) for t in weights)
    assert (load == "direct") == all(sign == 1 for sign, _, _ in setup.events)


@pytest.mark.parametrize(("overrides", "label_bytes"), [({}, 8 * 2 * 16), (_SEQ_CLS, 8 * 2)])
def test_the_inputs_are_the_batch_the_whole_step_registers(overrides, label_bytes):
    """Token ids ``[2, 16]`` int64, and the task's labels: the ids again for a
    causal LM, one class per sequence ``[2]`` for a sequence classifier."""
    cfg, wl = tiny_config("llama", **overrides), Workload(seq_len=16, micro_batch_size=2, precision="fp32")
    with _placed(cfg, wl) as (loop, _):
        input_ids, labels, extra = _make_inputs(loop, 0, 0)
        categories = {loop.tracker.category_of(t) for t in (input_ids, labels)}
    made = loop.tracker.result()
    start = made.marks[micro_mark(0, 0)]
    assert extra == {} and categories == {MemoryCategory.INPUT}
    assert [(sign, n) for sign, _, n in made.events[start:]] == [
        (1, round_allocation(8 * 2 * 16)), (1, round_allocation(label_bytes))]
    whole = _whole(cfg, wl)
    at = whole.marks[micro_mark(0, 0)]
    assert start == at and made.events[start:] == whole.events[at: at + 2]


@pytest.mark.parametrize("runner", ["torch", "hf-trainer", "plain-loop"])
def test_a_micro_step_records_what_the_whole_step_records_between_its_marks(runner):
    cfg = tiny_config("llama")
    wl = Workload(seq_len=16, micro_batch_size=2, precision="fp32", grad_accum_steps=2, runner=runner)
    with _placed(cfg, wl) as (loop, model):
        _micro_step(loop, model, 0, 0)
        trainable = loop.trainable
        held = list(loop.previous)
        grads = [p.grad for p in trainable]
        categories = {loop.tracker.category_of(g) for g in grads}
    one = loop.tracker.result()
    whole = _whole(cfg, wl)
    start, end = whole.marks[micro_mark(0, 0)], whole.marks[micro_mark(0, 1)]
    assert one.marks[micro_mark(0, 0)] == start and one.events[start:] == whole.events[start:end]
    # What the first micro-step leaves: one fp32 gradient per parameter, and, in a hand-written loop,
    # its outputs (the fp32 logits [2, 16, vocab] and the 0-dim loss) until the next forward.
    assert categories == {MemoryCategory.GRADIENT}
    outputs = round_allocation(4 * 2 * 16 * VOCAB) + round_allocation(4) if runner == "plain-loop" else 0
    assert (len(held) == 1) == (runner == "plain-loop")
    assert _net(one.events[start:]) == sum(round_allocation(4 * p.numel()) for p in trainable) + outputs


def test_the_optimizer_step_keeps_adamws_two_states_and_frees_the_gradients():
    """AdamW (foreach) makes ``exp_avg`` and ``exp_avg_sq`` in the parameter's
    dtype and a 0-dim fp32 ``step`` per parameter, which a CUDA run keeps on the
    host (not among the device events), as it does the increment's scalar; ``zero_grad(set_to_none=True)`` then
    frees the gradients."""
    cfg, wl = tiny_config("llama"), Workload(seq_len=16, micro_batch_size=2, precision="fp32")
    with _placed(cfg, wl) as (loop, model):
        _micro_step(loop, model, 0, 0)
        _optimizer_step(loop)
        trainable = loop.trainable
        states = [loop.optimizer.state[p] for p in trainable]
        moments = {loop.tracker.category_of(s[k]) for s in states for k in ("exp_avg", "exp_avg_sq")}
        steps = {loop.tracker.category_of(s["step"]) for s in states}
        no_grads = all(p.grad is None for p in trainable)
    stepped = loop.tracker.result()
    begin = next(i for i, (_, phase, _) in enumerate(stepped.timeline) if phase is Phase.OPTIMIZER)
    assert moments == {MemoryCategory.OPTIMIZER_STATE} and steps == {MemoryCategory.HOST} and no_grads
    assert _net(stepped.events[begin:]) == sum(
        2 * round_allocation(4 * p.numel()) - round_allocation(4 * p.numel()) for p in trainable)
    # The step counters, and while they live the host scalar their foreach increment adds
    # (torch/optim/adam.py _multi_tensor_adam: ``torch.tensor(1.0, device="cpu")``).
    assert stepped.host_peak_bytes == (len(trainable) + 1) * round_allocation(4)
    whole = _whole(cfg, wl)
    assert stepped.events[begin:] == whole.events[begin: whole.marks[micro_mark(1, 0)]]


def test_the_hf_trainer_loss_is_the_models_own_over_the_accumulation_steps():
    torch.manual_seed(0)
    wl = Workload(seq_len=16, micro_batch_size=2, precision="fp32", grad_accum_steps=4, runner="hf-trainer")
    model = modelbuild.build_model(tiny_config("llama"), wl, device="cpu")
    loop = _prepare_loop(model, wl, vocab_size=VOCAB, fake=False, tracker=None, autocast=True, offload=False,
                         wrap=None, hooks=None, reference=None)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = _forward_loss(loop, model, ids, ids.clone(), {})
    own = model(input_ids=ids, labels=ids.clone(), use_cache=False).loss
    assert loop.hf and torch.equal(loss, own / 4)


def test_a_packed_batch_for_a_classifier_is_refused_before_the_trace():
    wl = Workload(seq_len=16, micro_batch_size=2, precision="bf16", packed_docs=2)
    model, _ = _fake_model(tiny_config("llama", **_SEQ_CLS), wl)
    with pytest.raises(UnsupportedError, match="padding-free packing is for causal LMs"):
        _prepare_loop(model, wl, vocab_size=VOCAB, fake=True, tracker=None, autocast=True, offload=False,
                      wrap=None, hooks=None, reference=None)
