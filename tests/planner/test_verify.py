"""Verify (llmem_plugin.planner.verify): a verified candidate is the method's full trace at exactly its
configuration; the walk down the ranking stops at the first that fits, re-screening after each rejection."""

from __future__ import annotations

import dataclasses

import pytest

from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.planner.candidates import _Options
from llmem_plugin.planner.rank import order
from llmem_plugin.planner.search import plan
from llmem_plugin.planner.verify import _verify, verify_choice

from tests.conftest import tiny_config
from tests.planner.test_screen import _screened
from tests.planner.test_space import WL, context

KW = dict(num_gpus=2, global_batch=4, methods=["ddp", "fsdp"])


@pytest.fixture(scope="module")
def screened():
    model = tiny_config("llama")
    run = _screened(model, gcs=[False], **KW)
    order(run.candidates)
    return model, run


def _opts(**over):
    return _Options(**{"gcs": [False], "micro_batch": None, "prune": False, "max_pipelines": None, "verify": True,
                       "max_verify": 6, **over})


@pytest.mark.parametrize("label", ["ddp mb1x2", "fsdp mb2x1"])
def test_a_verified_candidate_is_the_methods_full_trace(screened, label):
    model, run = screened
    ctx = context(model, num_gpus=2, global_batch=4)
    c = next(c for c in run.candidates if c.label() == label)
    v = _verify(ctx, c)
    wl = dataclasses.replace(WL, micro_batch_size=c.micro_batch, grad_accum_steps=c.grad_accum)
    full = estimate_method(c.method, model, wl, layout=Layout(num_gpus=2), gpu="h100-sxm").worst
    assert v.verified and (v.method, v.micro_batch, v.grad_accum) == (c.method, c.micro_batch, c.grad_accum)
    assert (v.device_total_bytes, v.peak_allocated_bytes, v.peak_reserved_bytes) == (
        full.device_total_bytes, full.peak_allocated_bytes, full.peak_reserved_bytes)
    assert v.fits == (full.device_total_bytes <= ctx.limit)
    assert v.time == c.time  # the step time stays the screen's


def test_the_choice_is_the_plans(screened):
    model, run = screened
    run = dataclasses.replace(run, candidates=list(run.candidates))
    ctx = context(model, num_gpus=2, global_batch=4)
    choice = verify_choice(ctx, _opts(), run, rescreen=lambda: None)
    p = plan(model, gpu="h100-sxm", workload=WL, grad_checkpointing=False, prune=False, **KW)
    assert choice.verified and choice.label() == p.choice.label()
    assert choice.device_total_bytes == p.choice.device_total_bytes
    assert run.verify_s > 0 and not run.rejected


def test_without_verification_the_choice_is_the_first_fitting_screened_row(screened):
    model, run = screened
    run = dataclasses.replace(run, candidates=list(run.candidates))
    choice = verify_choice(context(model, **{k: KW[k] for k in ("num_gpus", "global_batch")}), _opts(verify=False),
                           run, rescreen=lambda: None)
    assert choice is next(c for c in run.candidates if c.fits) and not choice.verified


def test_each_rejection_rescreens_and_tries_the_next(screened):
    """Under a limit every screened row meets but no full trace does, each verified candidate is rejected,
    the screen is asked again after each, and the walk stops at max_verify."""
    model, run = screened
    run = dataclasses.replace(run, candidates=list(run.candidates), rejected=set())
    ctx = context(model, num_gpus=2, global_batch=4)
    first, second = run.candidates[:2]
    assert first.fits and second.fits
    tight = dataclasses.replace(ctx, limit=1)  # no trace fits one byte
    calls = []
    choice = verify_choice(tight, _opts(max_verify=2), run, rescreen=lambda: calls.append(len(run.rejected)))
    assert choice is None and calls == [1, 2]
    traced = [c for c in run.candidates if c.verified]
    assert sorted(c.label() for c in traced) == sorted([first.label(), second.label()])
    assert all(not c.fits and id(c) in run.rejected for c in traced)
