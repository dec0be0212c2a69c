"""Screen (llmem_plugin.planner.screen): a screened candidate at the base's own configuration is the
method's fast-mode estimate, byte for byte; the steps run in order give plan()'s candidates; the pipeline
budget skips without tracing."""

from __future__ import annotations

from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.planner.bounds import bound_configs, bound_units
from llmem_plugin.planner.candidates import _Config, _Options, _Run
from llmem_plugin.planner.rank import order
from llmem_plugin.planner.screen import _ready, _Search, screen
from llmem_plugin.planner.search import _cached_profiles, plan
from llmem_plugin.planner.space import enumerate_configs

from tests.conftest import tiny_config
from tests.planner.test_space import WL, context

METHODS = ["ddp", "zero3", "fsdp", "dp-tp"]


def _screened(model, *, num_gpus, global_batch, methods, gcs, prune=False):
    ctx = context(model, num_gpus=num_gpus, global_batch=global_batch)
    opts = _Options(gcs=gcs, micro_batch=None, prune=prune, max_pipelines=None, verify=False, max_verify=6)
    configs, skipped = enumerate_configs(ctx, methods, None)
    run = _Run(skipped=skipped)
    todo = bound_configs(ctx, configs, run, None)
    search = _Search(ctx, _cached_profiles({}, ctx), gcs, None)
    bound_units(ctx, opts, todo, search, run)
    screen(ctx, opts, run, search)
    return run


def test_a_candidate_at_its_bases_configuration_is_the_fast_estimate():
    """One sequence per data-parallel rank and step: micro-batch 1, no accumulation, the base run itself."""
    model = tiny_config("llama")
    plain = _screened(model, num_gpus=4, global_batch=4, methods=["ddp", "zero3", "fsdp"], gcs=[False])
    tp = _screened(model, num_gpus=4, global_batch=2, methods=["dp-tp"], gcs=[False])
    got = sorted(plain.candidates, key=lambda c: c.method) + tp.candidates
    assert [(c.method, c.tp, c.micro_batch, c.grad_accum, c.verified) for c in got] == [
        ("ddp", 1, 1, 1, False), ("fsdp", 1, 1, 1, False), ("zero3", 1, 1, 1, False), ("dp-tp", 2, 1, 1, False)]
    for c in got:
        fast = estimate_method(c.method, model, WL, layout=Layout(num_gpus=4, tp=c.tp), gpu="h100-sxm",
                               fast=True).worst
        assert c.device_total_bytes == fast.device_total_bytes, c.method
        assert c.peak_allocated_bytes == fast.peak_allocated_bytes, c.method
        assert c.peak_reserved_bytes == fast.peak_reserved_bytes, c.method


def test_the_steps_in_order_give_the_plans_candidates():
    model = tiny_config("llama")
    kw = dict(num_gpus=4, global_batch=8, methods=METHODS)
    run = _screened(model, gcs=[False, True], **kw)
    order(run.candidates)
    p = plan(model, gpu="h100-sxm", workload=WL, verify=False, prune=False, **kw)
    assert [(c.label(), c.device_total_bytes, c.step_time_s) for c in run.candidates] == [
        (c.label(), c.device_total_bytes, c.step_time_s) for c in p.candidates]
    # Per checkpointing: micro-batches 1 and 2 of 8 sequences over 4 ranks for each of the 3 methods without
    # TP, and 1, 2 and 4 over dp-tp's 2 data-parallel ranks.
    assert len(run.candidates) == 2 * (3 * 2 + 3)


def test_past_the_pipeline_budget_a_unit_is_skipped_untraced():
    opts = _Options(gcs=[False], micro_batch=None, prune=True, max_pipelines=1, verify=True, max_verify=6)
    one, two = _Config("pp", 1, 2), _Config("pp", 1, 4)
    run = _Run(pending=[(one, False), (two, False), (_Config("fsdp", 1), False)],
               bound={(one, False): 1e-3, (two, False): 2e-3, (_Config("fsdp", 1), False): 3e-3})
    # The budget's one pipeline configuration is the best-bounded; the second waits in pending.
    assert _ready(opts, run) == [(one, False), (_Config("fsdp", 1), False)]
    assert run.skipped == []
    run.traced_pipelines.add(one)
    assert _ready(opts, run) == [(one, False), (_Config("fsdp", 1), False)]
    assert (two, False) not in run.pending
    assert run.skipped == [("pp4", "not traced: the plan traces the 1 pipeline configuration(s) with the best "
                                   "step-time bounds (at least 0.002 s per step here)")]


def test_pruning_leaves_only_units_that_cannot_beat_the_fastest_fit():
    model = tiny_config("llama")
    run = _screened(model, num_gpus=4, global_batch=8, methods=METHODS, gcs=[False], prune=True)
    best = min(c.step_time_s for c in run.candidates if c.fits)
    assert {(c.method, c.tp) for c in run.candidates} | {(cfg.method, cfg.tp) for cfg, _ in run.pending} == {
        ("ddp", 1), ("zero3", 1), ("fsdp", 1), ("dp-tp", 2)}
    for cfg, _ in run.pending:  # left untraced: each bound no faster than the fastest fitting candidate
        assert run.bound[(cfg, False)] >= best * (1 - 1e-9)
