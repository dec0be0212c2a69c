"""The steps of one pipeline rank's run (llmem_plugin.methods.pp.stage.run_rank): building torch's stages and
schedule, and the optimizer step that ends an iteration, against closed forms."""

from __future__ import annotations

import math

import torch
import transformers
from torch import nn

from llmem_plugin.methods._fakepg import fake_process_group
from llmem_plugin.methods.pp.stage import StageSpec, _optimizer_step, _pipeline_schedule, stage_modules
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, Phase
from tests.conftest import tiny_config


def test_pipeline_schedule_wraps_each_stage_in_torchs_schedule_with_the_models_loss():
    """Rank 1 of an interleaved pipeline of 2 ranks x 2 stages holds global stages 1 and 3; the schedule's
    loss is the model's own: on uniform logits, the cross-entropy of a uniform guess over the vocabulary,
    ln(512)."""
    model = transformers.LlamaForCausalLM(tiny_config("llama"))
    specs = [StageSpec(1, 4, 0, 1), StageSpec(3, 4, 1, 2)]
    modules = stage_modules(model, specs)
    with fake_process_group(world_size=2, rank=1):
        stages, sched = _pipeline_schedule(model, specs, modules, schedule="interleaved-1f1b", microbatches=4,
                                           micro_batch_size=2, seq_len=16, vocab=512, group=None,
                                           activation_dtype=None)
    assert type(sched).__name__ == "ScheduleInterleaved1F1B" and sched._n_microbatches == 4
    assert [(s.stage_index, s.num_stages) for s in stages] == [(1, 4), (3, 4)]
    assert all(s.submod is m for s, m in zip(stages, modules))
    loss = sched._loss_fn(torch.zeros(2, 16, 512), torch.randint(0, 512, (2, 16)))
    assert math.isclose(float(loss), math.log(512), rel_tol=1e-6)


def test_optimizer_step_labels_adamws_states_and_drops_the_gradients():
    """AdamW over 1024 fp32 elements: its two moments are 2 x 4096 bytes of optimizer state, labelled as such
    at the optimizer phase's peak beside the 4096-byte gradient; the gradient is dropped afterwards."""
    tracker = MemoryTracker()
    param = nn.Parameter(torch.zeros(1024))
    opt = torch.optim.AdamW([param])
    calls = []
    with tracker:
        tracker.register([param], MemoryCategory.PARAMETER)
        param.grad = torch.ones(1024)
        _optimizer_step(tracker, opt, [param], iteration=3, step=None, on_action=lambda *a: calls.append(a))
        result = tracker.result()
    assert calls == [("optimizer", -1, 3)]
    assert param.grad is None
    at_peak = result.phase_breakdowns[Phase.OPTIMIZER]
    assert at_peak[MemoryCategory.OPTIMIZER_STATE] == 2 * 1024 * 4
    assert at_peak[MemoryCategory.GRADIENT] == 1024 * 4


def test_optimizer_step_labels_the_optimizer_a_custom_step_returns():
    """A ``step`` that runs another optimizer (the local-shard step's twin): its states are the ones labelled."""
    tracker = MemoryTracker()
    param, other = nn.Parameter(torch.zeros(1024)), nn.Parameter(torch.zeros(256))
    opt, twin = torch.optim.AdamW([param]), torch.optim.AdamW([other])

    def step(optimizer):
        other.grad = torch.ones(256)
        twin.step()
        return twin

    with tracker:
        tracker.register([param, other], MemoryCategory.PARAMETER)
        param.grad = torch.ones(1024)
        _optimizer_step(tracker, opt, [param], iteration=0, step=step, on_action=None)
        result = tracker.result()
    assert result.phase_breakdowns[Phase.OPTIMIZER][MemoryCategory.OPTIMIZER_STATE] == 2 * 256 * 4
    assert not opt.state
