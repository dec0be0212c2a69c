"""The largest batch / sequence search (llmem_plugin.planner.largest): the search against closed-form needs,
and the answer against independent estimates of the value and the next one up."""

from __future__ import annotations

import dataclasses

import pytest

from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.errors import ConfigError, WontFitError
from llmem_plugin.estimate import estimate
from llmem_plugin.planner import largest
from llmem_plugin.planner.largest import MaxPoint, _Search
from llmem_plugin.workload import Workload

from ..conftest import room, tiny_config

_GIB = 2**30
_H100 = get_gpu("h100-sxm").capacity_bytes


def _search(need, *, limit: int, top: int = 1 << 16, step: int = 1) -> tuple[_Search, int, int | None]:
    calls = []

    def probe(v: int, exact: bool) -> MaxPoint:
        calls.append(v)
        n = need(v)
        return MaxPoint(value=v, device_total_bytes=n, peak_allocated_bytes=n, peak_reserved_bytes=n,
                        fits=n <= limit, exact=exact)

    s = _Search(probe, multiple_of=step, top=top, limit_bytes=limit)
    lo, hi = s.bracket(True, 1)
    return s, lo, hi


@pytest.mark.parametrize("a, b, c", [(10, 3, 0), (1000, 7, 0), (5, 1, 2), (100, 0, 1), (7, 13, 3)])
def test_the_search_finds_the_boundary_of_an_affine_or_quadratic_need(a, b, c):
    limit = 10**5
    need = lambda k: a + b * k + c * k * k  # noqa: E731
    s, lo, hi = _search(need, limit=limit)
    # The closed form: the largest k with need(k) <= limit.
    k = max(k for k in range(1, 40_000) if need(k) <= limit)
    assert (lo, hi) == (k, k + 1)
    assert len(s.points) <= 8  # far fewer than the ~k probes of a linear scan or ~20 of bisection from 1


def test_an_affine_need_is_found_in_four_estimates():
    # Two points give the line, the third lands on the answer, the fourth confirms the next value fails.
    s, lo, hi = _search(lambda k: 1000 + 37 * k, limit=1000 + 37 * 500 + 10)
    assert (lo, hi) == (500, 501)
    assert len(s.points) == 4


def test_a_staircase_need_is_settled_by_its_two_neighbours():
    # Reserved memory grows in 2 MiB segments: the boundary is where the stair crosses the limit.
    step = 2**21
    need = lambda k: (k * 300_000 + step - 1) // step * step  # noqa: E731
    limit = 100 * step
    s, lo, hi = _search(need, limit=limit)
    assert need(lo) <= limit < need(hi) and hi == lo + 1


def test_the_search_stops_at_its_top_when_the_top_fits():
    s, lo, hi = _search(lambda k: k, limit=10**9, top=300)
    assert (lo, hi) == (300, None)


def test_headroom_reads_a_fraction_or_a_size_and_refuses_one_that_leaves_nothing():
    cap = 80 * _GIB
    assert largest.headroom_bytes(0.05, cap) == int(0.05 * cap)
    assert largest.headroom_bytes("0.1", cap) == int(0.1 * cap)
    assert largest.headroom_bytes("2GiB", cap) == 2 * _GIB
    assert largest.headroom_bytes(3 * _GIB, cap) == 3 * _GIB
    assert largest.headroom_bytes("5e-2", cap) == int(0.05 * cap)
    assert largest.headroom_bytes(0, cap) == largest.headroom_bytes("0", cap) == 0
    for bad in (1.0, -0.1, "80GiB", "lots", "5", 1024, True):
        with pytest.raises(ConfigError, match="headroom"):
            largest.headroom_bytes(bad, cap)


def test_the_answer_fits_and_the_next_batch_does_not_as_estimate_says():
    cfg = tiny_config("llama")
    wl = {"seq_len": 128, "precision": "bf16-mixed"}
    r = largest.max_batch_size(cfg, gpu="h100-sxm", headroom=_H100 - room(1.0), **wl)
    assert r.next_value == r.value + 1 and r.value > 2
    # Independently: estimate() at the answer and one above, on a GPU of the limit's size.
    at = estimate(cfg, gpu="h100-sxm", gpu_memory=r.limit_bytes, micro_batch_size=r.value, **wl)
    above = estimate(cfg, gpu="h100-sxm", gpu_memory=r.limit_bytes, micro_batch_size=r.value + 1, **wl)
    assert at.fits and not above.fits
    assert r.answer.device_total_bytes == at.device_total_bytes
    assert all(p.exact for p in r.points)  # one GPU: every estimate is the full trace's figures


def test_a_job_that_does_not_fit_at_batch_one_raises_with_the_points():
    cfg = tiny_config("llama")
    with pytest.raises(WontFitError, match="even --batch-size 1 does not fit") as e:
        largest.max_batch_size(cfg, gpu="h100-sxm", headroom="79.5GiB", seq_len=128)
    assert e.value.report.value == 0 and [p.value for p in e.value.report.points] == [1]


def test_the_longest_sequence_stops_at_the_models_context_length():
    cfg = tiny_config("llama")  # max_position_embeddings=512
    r = largest.max_seq_len(cfg, gpu="h100-sxm", seq_len=64)
    assert (r.value, r.next_value) == (512, None)
    assert "max_position_embeddings=512" in r.capped_by


def test_a_learned_position_table_caps_the_length_at_its_rows():
    cfg = tiny_config("gpt2")  # n_positions=512: wpe holds 512 rows
    r = largest.max_seq_len(cfg, gpu="h100-sxm", seq_len=64, multiple_of=64)
    assert r.value == 512 and "learned position table" in r.capped_by


def test_a_method_brackets_with_fast_estimates_and_decides_with_exact_ones():
    from llmem_plugin.methods import Layout, estimate_method

    cfg = tiny_config("llama", num_hidden_layers=12)  # deep enough for fast mode to shorten
    r = largest.max_batch_size(cfg, gpu="h100-sxm", headroom=_H100 - room(1.0), method="ddp",
                               layout=Layout(num_gpus=2), seq_len=128, precision="bf16-mixed")
    assert any(not p.exact for p in r.points)  # the bracket came from fast estimates
    exact = {p.value: p for p in r.points if p.exact}
    assert exact[r.value].fits and not exact[r.next_value].fits
    # Independently: the method's full-trace estimate at the answer and one above.
    gpu = dataclasses.replace(get_gpu("h100-sxm"), memory_bytes=r.limit_bytes, driver_memory_bytes=None)
    fits = [all(x.fits for x in estimate_method("ddp", cfg, Workload(seq_len=128, micro_batch_size=b,
                                                                     precision="bf16-mixed"),
                                                layout=Layout(num_gpus=2), gpu=gpu).ranks)
            for b in (r.value, r.value + 1)]
    assert fits == [True, False]


def test_one_gpu_refuses_a_layout_or_options_it_would_ignore():
    from llmem_plugin.methods import Layout

    with pytest.raises(ConfigError, match="method 'single' is one GPU"):
        largest.max_batch_size(tiny_config("llama"), layout=Layout(num_gpus=4), seq_len=64)
