"""Variable-length batches (llmem_plugin.techniques.varlen): lengths, derivation, replay.

The derivation is checked against real traces at lengths between the ones
it was fitted on; the replay of many steps is checked against the stub CUDA
device's real caching allocator in tests/stub/test_varlen.py.
"""

from __future__ import annotations

import json
import random

import pytest

import llmem_plugin
from llmem_plugin.techniques import varlen
from llmem_plugin.device.allocator import replay
from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.device.overheads import device_overheads
from llmem_plugin.workload import Workload

from tests.cli._run import run
from tests.conftest import tiny_config


def test_length_spellings_give_their_distributions(tmp_path):
    uni = varlen.parse_lengths("10:20")
    assert uni.values == tuple(range(10, 21)) and uni.mean == 15
    me = varlen.parse_lengths("64:2048:300")
    assert me.values[0] == 64 and me.values[-1] == 2048 and abs(me.mean - 300) < 0.5
    w = me.weights
    assert all(a >= b for a, b in zip(w, w[1:]))  # mean below the midpoint: a decreasing exponential
    hist = varlen.parse_lengths("100:3, 200:1")
    assert hist.values == (100, 200) and hist.mean == 125
    (tmp_path / "a.txt").write_text("5\n7\n\n7\n")
    (tmp_path / "b.json").write_text(json.dumps([5, 7, 7]))
    (tmp_path / "c.json").write_text(json.dumps({"5": 1, "7": 2}))
    (tmp_path / "d.jsonl").write_text('{"length": 5}\n{"input_ids": [1, 2, 3, 4, 5, 6, 7]}\n{"length": 7}\n')
    for name in ("a.txt", "b.json", "c.json", "d.jsonl"):
        d = varlen.parse_lengths(str(tmp_path / name))
        assert (d.values, d.weights) == ((5, 7), (1.0, 2.0)), name


@pytest.mark.parametrize("spec, match", [
    ("", "empty"), ("5:3", "exceeds MAX"), ("1:9:12", "strictly between"), ("0:9", "not positive"),
    ("100:x,5:1", "not a number"), ("abc", "not a file"), ("missing.txt", "no such file"),
])
def test_bad_lengths_are_one_line_errors(spec, match):
    with pytest.raises(llmem_plugin.ConfigError, match=match) as info:
        varlen.parse_lengths(spec)
    assert "\n" not in str(info.value) and "HINT" in str(info.value)


def test_each_micro_batch_is_padded_to_its_longest_sample_and_truncated():
    d = varlen.parse_lengths("1:1000")
    plan = varlen.step_lengths(d, micro_batch_size=4, grad_accum_steps=2, max_len=700, steps=50, seed=3)
    rng = random.Random(3)
    expected = [[min(max(d.draw(rng, 4)), 700) for _ in range(2)] for _ in range(50)]
    assert plan == expected and max(s for step in plan for s in step) == 700


def _ctx(cfg, micro=1):
    g = get_gpu("h100-sxm")
    return {"gpu": g, "overheads": device_overheads(g.compute_capability), "micro": micro, "depth": 2}


@pytest.mark.parametrize("needed", [
    [150, 222, 301, 333, 470],
    # Across 128 tokens: flash attention's softmax_lse is padded to 128 (constant below it), which one
    # quadratic through 32- and 128-token grid lengths together cannot bound; each side is fitted apart.
    [40, 49, 77, 101, 127, 128, 150, 301],
], ids=["above-128", "across-128"])
def test_derived_sizes_equal_real_traces_between_the_fitted_lengths(needed):
    cfg = tiny_config("llama", num_hidden_layers=2)
    wl = Workload(seq_len=512, micro_batch_size=2, precision="bf16-mixed", attn_implementation="sdpa")
    ctx = _ctx(cfg)
    traces = {}

    def trace(s):
        traces[s] = varlen._trace_at(cfg, wl, s, fast=False, ctx=ctx)
        return traces[s]

    model = varlen.piecewise(needed, trace)
    fitted = 0
    for s in needed:
        der = model.at(s)
        actual = traces[s] if s in traces else trace(s)
        assert (der.signs, der.keys) == ([e[0] for e in actual.events], [e[1] for e in actual.events])
        sizes = der.sizes(s)
        for i, e in enumerate(actual.events):
            if der.exact[i]:
                assert sizes[i] == e[2], (s, i)
            else:
                assert sizes[i] >= e[2], (s, i)  # padded inside a kernel: the grid round-up bounds it
        fitted += len(der.lengths) > 1
    assert fitted >= 3  # most lengths come from a fit, not from their own trace
    assert all(len(model.at(s).lengths) > 1 for s in needed if s < 128)  # short lengths fitted too


def test_one_repeated_length_replays_as_the_fixed_shape_trace():
    cfg = tiny_config("llama", num_hidden_layers=2)
    wl = Workload(seq_len=256, micro_batch_size=2, precision="bf16", attn_implementation="sdpa")
    t = varlen._trace_at(cfg, wl, 256, fast=False, ctx=_ctx(cfg))
    model = varlen.Piecewise([(256, 256, varlen.Derivation.traced(256, t))], 1)
    events, _ = varlen.compose(model, [[256], [256]])
    a, b = replay(t.events), replay(events)
    assert len(events) == len(t.events)
    assert (a.peak_allocated_bytes, a.peak_reserved_bytes) == (b.peak_allocated_bytes, b.peak_reserved_bytes)
    est = llmem_plugin.estimate(cfg, wl)
    assert b.peak_allocated_bytes == est.peak_allocated_bytes and b.peak_reserved_bytes == est.peak_reserved_bytes


def test_a_run_reports_its_steps_and_the_fixed_shape_beside_it():
    cfg = tiny_config("llama", num_hidden_layers=2)
    wl = Workload(seq_len=512, micro_batch_size=4, precision="bf16-mixed", attn_implementation="sdpa")
    v = varlen.estimate_variable_length(cfg, wl, "16:512:150", steps=40)
    assert v.steps == 40 and len(v.step_allocated_bytes) == 40 and v.fits
    assert v.peak_allocated_bytes == max(v.step_allocated_bytes)
    assert v.peak_reserved_bytes == v.step_reserved_bytes[-1] >= v.fixed_reserved_bytes
    assert v.step_allocated_bytes[v.worst_step] == v.peak_allocated_bytes
    assert len({s for step in v.step_lengths for s in step}) > 10
    d = v.to_dict()
    assert d["steps"] == 40 and d["derivation"]["lengths_traced"] == v.derivation.traces
    with pytest.raises(llmem_plugin.ConfigError, match="--steps"):
        varlen.estimate_variable_length(cfg, wl, "16:512", steps=0)


def test_cli(capsys, tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (20, 40, 60, 90, 120, 128)))
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "128", "--batch-size", "2",
                       "--seq-lens", str(lengths), "--steps", "20")
    assert code == 0 and "variable-length batches: 6 samples from lengths.txt" in out and "20 steps" in out
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "128", "--seq-lens", "16:128",
                       "--steps", "5", "--json")
    assert code == 0 and json.loads(out)["steps"] == 5
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--steps", "5")
    assert code == 2 and "--seq-lens" in err and err.count("\n") == 1
    code, _, err = run(capsys, "estimate", "--model", "gpt2", "--seq-lens", "9:3")
    assert code == 2 and "MIN 9 exceeds MAX 3" in err


def _synthetic(switch: int):
    """A step whose event structure changes at ``switch`` tokens (one more allocation from there), with
    sizes in 512-byte blocks: 4 bytes a token (a step function on a 32-token grid), 4096 bytes a token,
    and a buffer padded to 128 tokens (flash attention's softmax_lse)."""
    from llmem_plugin.trace.tracker import round_allocation

    def trace(s):
        sizes = [round_allocation(4 * s), round_allocation(4096 * s), round_allocation(256 * varlen._round_up(s, 128))]
        if s >= switch:
            sizes.append(round_allocation(64 * s))
        events = [(1, k, n) for k, n in enumerate(sizes)] + [(-1, k, 0) for k in range(len(sizes))]
        return varlen._Traced(events, ["forward"] * len(events), (2, 2, 2, 2))

    return trace


@pytest.mark.parametrize("switch,needed", [
    (100, list(range(33, 127))),   # a structure switch off the 32-token grid below 128
    (300, list(range(130, 600))),  # and above 128, leaving two 128-token grid lengths below it
    (40, list(range(33, 300))),    # a switch below 128 in a run that goes on past 128
])
def test_regime_ends_off_the_grid_are_derived_never_below_the_true_sizes(switch, needed):
    trace = _synthetic(switch)
    model = varlen.piecewise(needed, trace)
    for s in needed:
        der, true = model.at(s), trace(s)
        assert (der.signs, der.keys) == ([e[0] for e in true.events], [e[1] for e in true.events])
        sizes = der.sizes(s)
        for i, e in enumerate(true.events):
            assert sizes[i] == e[2] if der.exact[i] else sizes[i] >= e[2], (s, i)
    assert model.traces < len(needed) / 2  # derived, not traced length by length


# ----------------------------------------------------------------------------- the steps of piecewise


def test_grid_lengths_are_32_token_steps_below_128_then_128_token_steps():
    assert varlen._grid(40, 470) == [32, 64, 96, 128, 256, 384, 512]
    assert varlen._grid(150, 470) == [128, 256, 384, 512]
    assert varlen._grid(300, 300) == [128, 256, 384]  # at least three, for a quadratic
    assert varlen._grid(5, 20) == [32, 64, 96, 128]


@pytest.mark.parametrize("switch, low, high, runs, firsts", [
    (300, 130, 599, [(0, 1), (2, 4)], [128, 300]),  # grid 128..640: 128 and 256 before the switch
    (100, 33, 126, [(0, 2), (3, 3)], [32, 100]),  # grid 32..128: 32, 64 and 96 before it
    (10**6, 130, 599, [(0, 4)], [128]),  # no switch in the range
])
def test_runs_and_switch_lengths_find_where_the_structure_changes(switch, low, high, runs, firsts):
    traces = varlen._Traces(_synthetic(switch))
    grid = varlen._grid(low, high)
    assert varlen._runs(grid, traces.sig) == runs
    assert varlen._switch_lengths(grid, runs, traces.sig) == firsts


def test_a_run_of_one_structure_is_confirmed_at_its_ends_and_middle():
    traces = varlen._Traces(_synthetic(10**6))
    varlen._runs([128, 256, 384, 512, 640], traces.sig)
    assert sorted(traces.cache) == [128, 384, 640]


def test_exact_regimes_are_each_lengths_own_trace():
    trace = _synthetic(100)
    regimes = varlen._Regimes([40, 41, 45, 90], varlen._Traces(trace))
    regimes.exact(33, 50)
    assert [(lo, hi) for lo, hi, _ in regimes.regimes] == [(40, 40), (41, 41), (45, 45)]
    for s, _, der in regimes.regimes:
        assert der.sizes(s) == [e[2] for e in trace(s).events]
    many = varlen._Regimes(list(range(33, 33 + varlen._MAX_EXACT_TRACES + 1)), varlen._Traces(trace))
    with pytest.raises(llmem_plugin.UnsupportedError, match="too close together for a fit"):
        many.exact(33, 33 + varlen._MAX_EXACT_TRACES)


def test_fit_derives_a_regime_through_three_grid_lengths_and_an_off_grid_check():
    trace = _synthetic(10**6)
    traces = varlen._Traces(trace)
    regimes = varlen._Regimes(list(range(130, 600)), traces)
    regimes.fit(130, 599, [128, 256, 384, 512, 640], False, True)
    [(first, last, der)] = regimes.regimes
    assert (first, last) == (130, 599)
    assert der.lengths == (128, 384, 640, 128 + varlen.GRID // 2 + 1) and sorted(traces.cache) == [128, 193, 384, 640]
    # 4 and 4096 bytes a token are quadratics; the buffer padded to 128 tokens is bounded by the round-up.
    assert der.exact == [True, True, False] + [True] * 3  # then the three frees, of 0 bytes
    for s in range(130, 600):
        true = [e[2] for e in trace(s).events]
        assert der.sizes(s) == true, s  # the padded buffer at s rounded up to 128 is its true size
