"""Gradient accumulation: micro-steps 1-3 and the last are traced, the rest
repeat micro-step 3 exactly. Checked against the trace of every micro-step,
to the byte, with several options; and the check that the left-out
micro-steps repeat catches a window that has not settled."""

from __future__ import annotations

import importlib
import time

import pytest

import llmem_plugin
from llmem_plugin.errors import UnsupportedError
from llmem_plugin.trace.step import STEADY_MICRO_STEPS, traced_micro_steps

from tests.conftest import tiny_config

_estimate = importlib.import_module("llmem_plugin.estimate")
ACCUM = 7
FIELDS = ("peak_tensor_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "fits",
          "breakdown", "phase_peaks", "host_peak_bytes", "peak_phase", "params", "trainable_params")


def _every_micro_step(monkeypatch, **kw):
    """The estimate with every micro-step of the window traced."""
    with monkeypatch.context() as m:
        m.setattr(_estimate, "STEADY_MICRO_STEPS", 10**9)
        return llmem_plugin.estimate(**kw)


def _same(short, full) -> None:
    for name in FIELDS:
        assert getattr(short, name) == getattr(full, name), name


def test_traced_micro_steps():
    assert traced_micro_steps(3, 4) == [0, 1, 2]
    assert traced_micro_steps(4, 4) == [0, 1, 2, 3]
    assert traced_micro_steps(32, 4) == [0, 1, 2, 31]
    assert traced_micro_steps(32) == list(range(32))


@pytest.mark.parametrize("options", [
    {},
    {"lora_rank": 4},
    {"grad_checkpointing": True},
    {"precision": "bf16", "optimizer": "sgd"},
    {"runner": "lightning"},  # zero_grad between the first micro-step's forward and backward
    {"runner": "hf-trainer"},  # fp32 logits, gradient clipping at the boundary
    {"offload_activations": "save-on-cpu"},
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_shortened_window_equals_every_micro_step_to_the_byte(monkeypatch, options):
    kw = {"model": tiny_config("llama"), "seq_len": 32, "grad_accum_steps": ACCUM, **options}
    short = llmem_plugin.estimate(**kw)
    assert any(n.startswith(f"gradient accumulation: micro-steps 1-3 and {ACCUM} of {ACCUM} traced")
               for n in short.notes), short.notes
    _same(short, _every_micro_step(monkeypatch, **kw))


@pytest.mark.parametrize("options", [
    {},
    {"lora_rank": 4, "quantize": "nf4", "bnb_version": "0.42.0", "precision": "bf16", "kbit_prepare": "off"},
], ids=["plain", "qlora-bnb-0.42"])
def test_plain_loop_window_is_traced_micro_step_by_micro_step(options):
    """The plain loop keeps each micro-step's outputs into the next: the
    allocator places each new copy past the last in the first iteration and
    does not return to a state it left, so no micro-step repeats another and
    every one is traced (with bitsandbytes 0.42 the kept graph holds the
    4-bit matmuls' inputs too)."""
    kw = {"model": tiny_config("llama"), "seq_len": 32, "grad_accum_steps": ACCUM, "runner": "plain-loop", **options}
    est = llmem_plugin.estimate(**kw)
    assert any(n.startswith("gradient accumulation: the simulated allocator did not settle") and
               f"so all {ACCUM} were traced" in n for n in est.notes), est.notes


def test_capped_replay_verdict_is_the_same(monkeypatch):
    """Capacity just under the uncapped reserved peak: the verdict comes from
    the replay where the allocator frees its cache and retries."""
    kw = {"model": tiny_config("llama"), "seq_len": 1024, "batch_size": 2, "grad_accum_steps": ACCUM}
    roomy = _every_micro_step(monkeypatch, **kw)
    tight = {**kw, "gpu_memory": roomy.device_total_bytes - 2 * 2**20}
    full = _every_micro_step(monkeypatch, **tight)
    short = llmem_plugin.estimate(**tight)
    # Segments freed and made again under the cap: the state repeats up to
    # their addresses (see estimate._allocator_state).
    assert short.notes[-1].startswith("gradient accumulation: micro-steps 1-3 and")
    # The capped replay decided: it fits, with less reserved than without the cap.
    assert full.fits and full.peak_reserved_bytes < roomy.peak_reserved_bytes
    _same(short, full)


def test_a_window_that_has_not_settled_is_traced_in_full(monkeypatch):
    """Tiny GPT-2's micro-step 2 still grows the allocator's segments: with
    only micro-steps 1-2 traced, the check finds it and every micro-step is
    traced instead (so the answer is still exact)."""
    kw = {"model": tiny_config("gpt2"), "seq_len": 32, "grad_accum_steps": 6}
    with monkeypatch.context() as m:
        m.setattr(_estimate, "STEADY_MICRO_STEPS", 3)
        fallback = llmem_plugin.estimate(**kw)
    assert fallback.notes[-1] == ("gradient accumulation: the simulated allocator did not settle within 3 "
                                  "micro-steps, so all 6 were traced")
    _same(fallback, _every_micro_step(monkeypatch, **kw))


def test_the_traced_step_does_not_grow_with_the_window():
    cfg = tiny_config("llama")
    t0 = time.perf_counter()
    huge = llmem_plugin.estimate(cfg, seq_len=32, grad_accum_steps=10**6)
    assert time.perf_counter() - t0 < 60
    small = llmem_plugin.estimate(cfg, seq_len=32, grad_accum_steps=STEADY_MICRO_STEPS + 1)
    assert len(huge.memory_timeline) == len(small.memory_timeline)
    for name in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_tensor_bytes"):
        assert getattr(huge, name) == getattr(small, name), name


def test_a_long_window_that_never_settles_is_refused(monkeypatch):
    monkeypatch.setattr(_estimate, "_micro_steps_repeat", lambda *a, **k: False)
    monkeypatch.setattr(_estimate, "_MAX_FULL_WINDOW", 10)
    with pytest.raises(UnsupportedError, match=r"grad_accum_steps 12: .* not settled after 32 micro-steps.*HINT"):
        llmem_plugin.estimate(tiny_config("llama"), seq_len=16, grad_accum_steps=12)


def test_methods_that_trace_every_micro_step_refuse_a_longer_window():
    from llmem_plugin.methods import Layout, estimate_method
    from llmem_plugin.trace.step import MAX_TRACED_MICRO_STEPS
    from llmem_plugin.workload import Workload

    wl = Workload(seq_len=16, grad_accum_steps=MAX_TRACED_MICRO_STEPS + 1)
    with pytest.raises(UnsupportedError, match="--method ddp traces every micro-step.*HINT.*--method single"):
        estimate_method("ddp", tiny_config("llama"), wl, layout=Layout(num_gpus=2), gpu="h100-sxm")


def test_fast_mode_shortens_both_traced_depths_exactly(monkeypatch):
    kw = {"model": tiny_config("llama", num_hidden_layers=8), "seq_len": 32, "grad_accum_steps": ACCUM,
          "fast": True}
    short = llmem_plugin.estimate(**kw)
    full = _every_micro_step(monkeypatch, **kw)
    assert short.fast and full.fast
    assert any("micro-steps 1-3 and" in n for n in short.notes), short.notes
    _same(short, full)
