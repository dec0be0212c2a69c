"""Composed pipeline ranks (llmem_plugin.methods.pp.compose) against full traces of the same rank.

The full fake trace of a rank equals a real 4-process gloo run byte for byte (tests/methods/pp/test_pp.py), so
a composed rank whose live bytes equal the full trace's at every action is checked against the real run too.
"""

from __future__ import annotations

import dataclasses

import pytest

from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.methods.pp.method import stage_specs
from llmem_plugin.methods.pp.rank import trace_rank
from llmem_plugin.methods.pp.compose import compose_runs, virtual_pipeline
from llmem_plugin.methods.pp.schedule import stages_of_rank
from llmem_plugin.methods.pp.stage import StageSpec
from llmem_plugin.workload import Workload
from tests.conftest import tiny_config

H100 = get_gpu("h100-sxm")
# seq 32 x 2 rows: every per-microbatch tensor is a multiple of the allocator's 512-byte block, as at real
# sizes (what is affine in the microbatch count stays affine after rounding).
WL = Workload(seq_len=32, micro_batch_size=2, precision="fp32", optimizer="adamw")
V_OF = {"1f1b": 1, "gpipe": 1, "interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2, "interleaved-zb": 2}


def _config(layers: int = 8):
    return tiny_config("llama", num_hidden_layers=layers)


def _segments_peak(trace, segments):
    from llmem_plugin.methods.pp.rank import segment_peaks

    return segment_peaks(trace, segments)


# (schedule, p, m, pipeline rank): the first and the last rank and a middle one, at microbatch counts just
# above the smallest the composition applies to.
# Six-rank pipelines (12 layers) have smaller stand-ins: their stage indices are mapped.
CASES = [("1f1b", 4, 12, 0), ("1f1b", 4, 12, 1), ("1f1b", 4, 12, 3), ("gpipe", 4, 9, 0), ("gpipe", 4, 9, 2),
         ("interleaved-1f1b", 4, 32, 2), ("zbv", 4, 20, 0), ("zbv", 4, 20, 3), ("dualpipev", 4, 20, 1),
         ("interleaved-zb", 4, 20, 3), ("1f1b", 6, 16, 0), ("1f1b", 6, 16, 2), ("gpipe", 6, 8, 4)]


@pytest.mark.parametrize("schedule,p,m,rank", CASES)
def test_composed_rank_equals_its_full_trace_at_every_action(schedule, p, m, rank):
    v = V_OF[schedule]
    layers = 8 if p == 4 else 12
    specs = stage_specs(layers, p * v)
    mine = [specs[s] for s in sorted(stages_of_rank(schedule, p, rank, v))]
    virtual = virtual_pipeline(schedule, p, m, v, rank)
    assert virtual is not None and virtual.microbatches[1] < m
    if p == 6:
        assert virtual.degree < p
    to = dict(zip(sorted(stages_of_rank(schedule, p, rank, v)),
                  sorted(stages_of_rank(schedule, virtual.degree, virtual.rank, v))))
    vspecs = [StageSpec(to[sp.index], virtual.degree * v, sp.start, sp.stop) for sp in mine]
    runs = []
    for mx in virtual.microbatches:
        segments = []
        t = trace_rank(_config(layers), WL, vspecs, rank=virtual.rank, pipeline_degree=virtual.degree, schedule=schedule,
                       microbatches=mx, gpu=H100, segments=segments)
        runs.append((t.events, segments))
    composed = compose_runs(runs, virtual, schedule, p, m, v, rank)
    assert composed is not None
    segments = []
    full = trace_rank(_config(layers), WL, mine, rank=rank, pipeline_degree=p, schedule=schedule, microbatches=m,
                      gpu=H100, segments=segments)
    assert composed.peak == full.peak_bytes
    # Every action part's highest live bytes, named as the full trace names them.
    assert composed.segment_peaks == _segments_peak(full, segments)


def test_virtual_pipelines_are_small_for_long_schedules():
    # A 16-rank 1F1B at 64 microbatches: rank 0's warm-up holds 16 forwards, but every context its actions
    # have (two actions each side, first/last of a kind, its forward's context) shows up in a 5-rank
    # pipeline at 12 and 13 microbatches.
    vp = virtual_pipeline("1f1b", 16, 64, 1, 0)
    assert vp is not None and vp.degree <= 6 and vp.microbatches[1] <= 2 * vp.degree + 4
    last = virtual_pipeline("1f1b", 16, 64, 1, 15)
    assert last is not None and last.rank == last.degree - 1 and last.microbatches[1] <= 6
    # Too few microbatches to save anything: traced in full.
    assert virtual_pipeline("1f1b", 4, 5, 1, 0) is None
    assert virtual_pipeline("dualpipev", 4, 12, 2, 0) is None


def test_estimate_composes_and_reports_it():
    cfg = _config()
    wl = WL
    composed = estimate_method("pp", cfg, wl, layout=Layout(num_gpus=4), gpu=H100, microbatches=12)
    full = estimate_method("pp", cfg, wl, layout=Layout(num_gpus=4), gpu=H100, microbatches=12, compose=False)
    # The last rank holds every microbatch's logits (return_outputs): traced in full.
    assert any(n.startswith("composed: ranks [0, 1, 2] ") for n in composed.notes)
    assert not any(n.startswith("composed") for n in full.notes)
    for a, b in zip(composed.ranks, full.ranks):
        assert a.peak_tensor_bytes == b.peak_tensor_bytes
        # Allocated adds the longer run's workspaces and rounding over its tensors: equal to the full replay's.
        assert a.peak_allocated_bytes == b.peak_allocated_bytes
        # Reserved is a bound: never under the full replay, and over it by at most the segments the bound
        # adds beyond the growth (one 20 MiB large segment and one 2 MiB small one) plus the growth's own
        # rounding to a large segment. (At this tiny size that is tens of percent; at real sizes, tens of
        # MiB of tens of GiB.)
        assert b.peak_reserved_bytes <= a.peak_reserved_bytes <= b.peak_reserved_bytes + 2 * 20 * 2**20 + 2 * 2**20


def test_gradient_accumulation_composes_from_two_schedule_steps():
    """3 and 5 schedule steps per optimizer step (pipeline 2 x FSDP2 2, 8 microbatches each), composed from
    stand-in runs of two (the first allocates the sharded gradients, the second adds to them, the later
    ones repeat it): every rank's tensor and allocated peaks equal its full trace (the full trace itself
    checked against real gloo runs, tests/methods/pp/test_pp.py), up to the ids' rounding slack (seq 16 x 2
    rows: 256 bytes a microbatch, never under), and the same at 3 and 5 steps."""
    cfg = _config()
    peaks = {}
    for accum in (3, 5):
        wl = dataclasses.replace(WL, precision="bf16-mixed", grad_accum_steps=accum)
        kw = dict(layout=Layout(num_gpus=4), gpu=H100, pipeline_degree=2, microbatches=8, return_outputs=False)
        composed = estimate_method("pp", cfg, wl, **kw)
        assert any(n.startswith("composed: ranks [0, 2] ") for n in composed.notes)
        peaks[accum] = [r.peak_tensor_bytes for r in composed.ranks]
        if accum == 3:
            full = estimate_method("pp", cfg, wl, compose=False, **kw)
            for a, b in zip(composed.ranks, full.ranks, strict=True):
                assert 0 <= a.peak_tensor_bytes - b.peak_tensor_bytes <= 1024
                assert a.peak_allocated_bytes - a.peak_tensor_bytes == b.peak_allocated_bytes - b.peak_tensor_bytes
    assert peaks[3] == peaks[5]
    # One set of two-step stand-in runs serves a rank without accumulation too (the planner's splits share
    # them): its first steps replayed, equal to the one-step runs' composition.
    wl = dataclasses.replace(WL, precision="bf16-mixed")
    kw = dict(layout=Layout(num_gpus=4), gpu=H100, pipeline_degree=2, microbatches=8, return_outputs=False)
    plain = estimate_method("pp", cfg, wl, **kw)
    shared = estimate_method("pp", cfg, wl, stand_in_steps=2, **kw)
    for a, b in zip(shared.ranks, plain.ranks, strict=True):
        assert (a.peak_tensor_bytes, a.peak_allocated_bytes) == (b.peak_tensor_bytes, b.peak_allocated_bytes)


def test_a_rank_with_too_few_microbatches_for_a_stand_in_composes_its_own_steps():
    """4 microbatches over pipeline 2 leave no smaller pipeline to stand in, but 6 schedule steps do: the
    rank's own run of two steps, composed over six, equals its full trace of six."""
    cfg = _config()
    assert virtual_pipeline("1f1b", 2, 4, 1, 0) is None
    wl = dataclasses.replace(WL, grad_accum_steps=6)
    kw = dict(layout=Layout(num_gpus=2), gpu=H100, microbatches=4, return_outputs=False)
    composed = estimate_method("pp", cfg, wl, **kw)
    full = estimate_method("pp", cfg, wl, compose=False, **kw)
    assert any(n.startswith("composed: ranks [0, 1] ") for n in composed.notes)
    assert not any(n.startswith("composed") for n in full.notes)
    for a, b in zip(composed.ranks, full.ranks, strict=True):
        assert a.peak_tensor_bytes == b.peak_tensor_bytes
        assert a.peak_allocated_bytes == b.peak_allocated_bytes


def test_without_returned_outputs_the_last_rank_is_composed_too():
    """step(return_outputs=False), as torchtitan's trainer and the planner step it: the last rank keeps no
    logits past its loss, and its composition equals its full trace like the others'."""
    cfg = _config()
    composed = estimate_method("pp", cfg, WL, layout=Layout(num_gpus=4), gpu=H100, microbatches=12,
                               return_outputs=False)
    full = estimate_method("pp", cfg, WL, layout=Layout(num_gpus=4), gpu=H100, microbatches=12, compose=False,
                           return_outputs=False)
    assert any(n.startswith("composed: ranks [0, 1, 2, 3] ") for n in composed.notes)
    for a, b in zip(composed.ranks, full.ranks, strict=True):
        assert a.peak_tensor_bytes == b.peak_tensor_bytes
        assert a.peak_allocated_bytes == b.peak_allocated_bytes
        assert b.peak_reserved_bytes <= a.peak_reserved_bytes



def test_per_microbatch_inputs_that_round_unevenly_are_covered():
    """seq 16 x 2 rows: the step's int64 ids take 256 bytes per microbatch, and their 512-byte block is not
    affine in the microbatch count (9 and 10 microbatches both take 2560 bytes, 12 take 3072). The composed
    first rank is never under its full trace, and over it by at most the rounding slack of its ids
    (pp_compose.rounding_slack: 512 per extrapolated microbatch span, at each of the two steps)."""
    from llmem_plugin.methods.pp.compose import rounding_slack

    wl = Workload(seq_len=16, micro_batch_size=2, precision="fp32", optimizer="adamw")
    specs = stage_specs(8, 4)
    virtual = virtual_pipeline("1f1b", 4, 12, 1, 0)
    runs = []
    for mx in virtual.microbatches:
        segments = []
        t = trace_rank(_config(), wl, [specs[0]], rank=virtual.rank, pipeline_degree=virtual.degree,
                       schedule="1f1b", microbatches=mx, gpu=H100, segments=segments)
        runs.append((t.events, segments))
    unit = 2 * 16 * 8
    composed = compose_runs(runs, virtual, "1f1b", 4, 12, 1, 0, input_bytes=unit)
    full = trace_rank(_config(), wl, [specs[0]], rank=0, pipeline_degree=4, schedule="1f1b", microbatches=12,
                      gpu=H100)
    slack = rounding_slack(1, *virtual.microbatches, 12, unit_bytes=unit)
    assert slack > 0
    assert full.peak_bytes <= composed.peak <= full.peak_bytes + 2 * slack
    # Without the slack the line through the rounded sizes runs under the full trace.
    bare = compose_runs(runs, virtual, "1f1b", 4, 12, 1, 0, input_bytes=512)
    assert bare.peak < full.peak_bytes


def test_tensor_parallel_and_fsdp_stages_compose_as_traced_in_full():
    """Pipeline 2 x FSDP2 2 x TP 2 (8 GPUs), a vocabulary of 514 rows: TP's 257-row shards split unevenly over
    FSDP2's 2 ranks, so each pipeline rank's last shard rank ((dp - 1) x tp after it) is traced too. The
    composed ranks' tensor and allocated peaks equal full traces."""
    cfg = tiny_config("llama", num_hidden_layers=4, vocab_size=514)
    layout = Layout(num_gpus=8, tp=2)
    wl = Workload(seq_len=32, micro_batch_size=2, precision="bf16-mixed", optimizer="adamw")
    composed = estimate_method("pp", cfg, wl, layout=layout, gpu=H100, pipeline_degree=2, microbatches=8)
    full = estimate_method("pp", cfg, wl, layout=layout, gpu=H100, pipeline_degree=2, microbatches=8,
                           compose=False)
    assert [r.rank for r in composed.ranks] == [0, 2, 4, 6]
    assert any(n.startswith("composed: ranks [0, 2] ") for n in composed.notes)
    for a, b in zip(composed.ranks, full.ranks):
        assert (a.peak_tensor_bytes, a.peak_allocated_bytes) == (b.peak_tensor_bytes, b.peak_allocated_bytes)
        assert b.peak_reserved_bytes <= a.peak_reserved_bytes
