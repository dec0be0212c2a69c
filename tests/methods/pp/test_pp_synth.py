"""Synthesised stand-in runs (llmem_plugin.methods.pp.synth) against full traces of the same ranks.

A full fake trace of a rank equals a real 4-process gloo run byte for byte (tests/methods/pp/test_pp.py), so a
synthesised composition whose tensor and allocated peaks equal the full trace's is checked against the real
run too.
"""

from __future__ import annotations

import dataclasses

import pytest

from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.methods.pp.compose import Template, _keys_of
from llmem_plugin.methods.pp.synth import _classes, _moved, class_pipeline
from llmem_plugin.workload import Workload
from tests.conftest import tiny_config

H100 = get_gpu("h100-sxm")
WL = Workload(seq_len=32, micro_batch_size=2, precision="fp32", optimizer="adamw")


def _peaks(est):
    return [(r.rank, r.peak_tensor_bytes, r.peak_allocated_bytes) for r in est.ranks]


@pytest.mark.parametrize("method,m,wl", [
    ("pp", 12, WL),
    ("pp-gpipe", 9, dataclasses.replace(WL, grad_checkpointing=True)),
    ("pp-interleaved", 28, WL),
])
def test_synthesised_ranks_equal_their_full_traces(method, m, wl):
    cfg = tiny_config("llama", num_hidden_layers=8)
    kw = dict(layout=Layout(num_gpus=4), gpu=H100, microbatches=m, return_outputs=False)
    synth = estimate_method(method, cfg, wl, **kw)
    full = estimate_method(method, cfg, wl, compose=False, **kw)
    assert any(n.startswith("synthesised: ranks [0, 1, 2, 3]") for n in synth.notes)
    assert _peaks(synth) == _peaks(full)
    # Reserved: the small real run's plus whole segments for the growth, never under the full replay.
    for a, b in zip(synth.ranks, full.ranks, strict=True):
        assert b.peak_reserved_bytes <= a.peak_reserved_bytes


def test_fsdp2_and_tensor_parallel_stages_synthesise_as_traced_in_full():
    """Pipeline 2 x FSDP2 2 x TP 2, bf16 mixed precision, 3 schedule steps per optimizer step: FSDP2's
    reduction runs in the step's tail, which the real stages shape (moved into the stand-in's tail); every
    rank's tensor and allocated peaks equal its full trace, up to the ids' rounding slack (never under)."""
    cfg = tiny_config("llama", num_hidden_layers=4, vocab_size=514)
    wl = dataclasses.replace(WL, precision="bf16-mixed", grad_accum_steps=3)
    kw = dict(layout=Layout(num_gpus=8, tp=2), gpu=H100, pipeline_degree=2, microbatches=8, return_outputs=False)
    synth = estimate_method("pp", cfg, wl, **kw)
    full = estimate_method("pp", cfg, wl, compose=False, **kw)
    assert any(n.startswith("synthesised: ranks [0, 2") for n in synth.notes)
    for a, b in zip(synth.ranks, full.ranks, strict=True):
        assert 0 <= a.peak_tensor_bytes - b.peak_tensor_bytes <= 1024
        assert a.peak_allocated_bytes - a.peak_tensor_bytes == b.peak_allocated_bytes - b.peak_tensor_bytes


def test_split_backward_schedules_keep_real_stand_ins():
    """ZB-V's input and weight gradients hold other buffers in real stages than in placeholders: its composed
    ranks' stand-ins run the real stages (their composition against full traces: test_pp_compose.py)."""
    cfg = tiny_config("llama", num_hidden_layers=8)
    zbv = estimate_method("pp-zbv", cfg, WL, layout=Layout(num_gpus=4), gpu=H100, microbatches=20,
                          return_outputs=False, ranks=[3])
    assert any(n.startswith("composed: ranks [3]") for n in zbv.notes)
    assert not any(n.startswith("synthesised") for n in zbv.notes)


def test_a_template_moves_only_by_a_free_at_its_end():
    real = Template((("layers#1", 900, 500), ("embed_tokens#1", 1000, 400)))
    was = Template((("s1#1", 100, 16),))
    # The placeholder frees 16 more at the action's end in the new context: the real template's end moves.
    assert _moved(real, was, Template((("s1#1", 100, 0),))) == Template(
        (("layers#1", 900, 500), ("embed_tokens#1", 1000, 384)))
    # Holding more at the end raises the last part's highest point where the end passes it.
    assert _moved(real, Template((("s1#1", 100, 0),)), Template((("s1#1", 100, 700),))).parts[-1] == (
        "embed_tokens#1", 1100, 1100)
    # Any other difference is not a move: None (the rank is composed from real stand-ins).
    assert _moved(real, was, Template((("s1#1", 120, 16),))) is None
    assert _moved(real, was, Template((("s1#1", 100, 16), ("", 0, 0)))) is None
    assert _moved(real, was, was) == real


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 16, 64, 1), ("gpipe", 8, 32, 1), ("interleaved-1f1b", 8, 32, 2)])
def test_the_real_run_of_each_kind_of_rank_is_small_and_shows_every_class(schedule, p, m, v):
    for rank in range(p):
        vp = class_pipeline(schedule, p, m, v, rank)
        assert vp is not None
        # First, middle and last stages' actions, each first, in between and last of its kind: three
        # pipeline ranks and a few microbatches suffice.
        assert vp.degree <= 3 and vp.microbatches[0] <= 2 * vp.degree
        need = _classes(schedule, p, m, v, rank)
        assert need <= _classes(schedule, vp.degree, vp.microbatches[0], v, vp.rank)
        assert len(need) <= len(set(_keys_of(schedule, p, m, v, rank)))
    # The first rank's warm-up and steady state give its actions many more contexts than classes.
    assert len(_classes(schedule, p, m, v, 0)) < len(set(_keys_of(schedule, p, m, v, 0)))
