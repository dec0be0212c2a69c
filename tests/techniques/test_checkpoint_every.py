"""Checkpointing every k-th layer (torchtitan's layer-level selective AC), traced for real."""

from __future__ import annotations

import pytest

import llmem_plugin
from llmem_plugin.trace.tracker import Phase
from llmem_plugin.workload import Workload

from tests.cli._run import run
from tests.conftest import tiny_config
from tests.trace.test_fake_equals_real import fake_and_real


def wl(k: int | None) -> Workload:
    if k is None:
        return Workload(seq_len=64, micro_batch_size=2)
    return Workload(seq_len=64, micro_batch_size=2, grad_checkpointing=True, checkpoint_every=k)


@pytest.mark.parametrize("k", [2, 3])
def test_fake_equals_a_real_cpu_run(k):
    fake, real = fake_and_real(tiny_config("llama", num_hidden_layers=6), wl(k))
    assert fake.peak_bytes == real.peak_bytes and fake.phase_peaks == real.phase_peaks
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def test_fewer_checkpointed_layers_hold_more_activations():
    cfg = tiny_config("llama", num_hidden_layers=12)
    forward = {k: llmem_plugin.estimate(cfg, wl(k)).phase_peaks[Phase.FORWARD] for k in (None, 1, 2, 3)}
    assert forward[1] < forward[2] < forward[3] < forward[None]
    # Half the layers checkpointed (k=2) save half of what checkpointing every layer saves, within a
    # layer's worth (which layer the forward peak falls in differs).
    saved_all, saved_half = forward[None] - forward[1], forward[None] - forward[2]
    assert abs(saved_half - saved_all / 2) <= saved_all / 12


@pytest.mark.parametrize("k", [2, 3])
def test_fast_mode_equals_the_full_trace(k):
    cfg = tiny_config("llama", num_hidden_layers=12)
    full, fast = (llmem_plugin.estimate(cfg, wl(k), fast=f) for f in (False, True))
    assert fast.fast and not fast.notes
    assert (fast.peak_allocated_bytes, fast.peak_reserved_bytes) == (full.peak_allocated_bytes,
                                                                     full.peak_reserved_bytes)


def test_bad_values_are_one_line_errors(capsys):
    with pytest.raises(llmem_plugin.ConfigError, match="add --grad-checkpointing"):
        Workload(checkpoint_every=2)
    with pytest.raises(llmem_plugin.ConfigError, match="checkpoint_every must be a positive integer"):
        Workload(grad_checkpointing=True, checkpoint_every=0)
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "16", "--checkpoint-every", "2")
    assert code == 2 and "--grad-checkpointing" in err
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "16", "--grad-checkpointing",
                         "--checkpoint-every", "2")
    assert code == 0 and "grad checkpointing every 2 layers" in out
