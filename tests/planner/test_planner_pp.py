"""Pipeline candidates in the planner: their memory is the pipeline method's own estimate at exactly their
configuration, their step time adds Megatron's bubble to the compute."""

from __future__ import annotations

import dataclasses

import pytest

from llmem_plugin.planner.cost import pipeline_bubble_s
from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.planner.search import plan
from llmem_plugin.workload import Workload
from tests.conftest import tiny_config

# One worker builds this module's module-scoped fixtures once (pyproject.toml: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("planner-pp")

WL = Workload(seq_len=32, precision="fp32", optimizer="adamw")


def test_pipeline_bubble_is_megatrons():
    """Narayanan et al., SC'21: bubble time over ideal time (p - 1) / m, and (p - 1) / (v m) interleaved."""
    assert pipeline_bubble_s(8.0, degree=4, microbatches=8) == pytest.approx(8.0 * 3 / 8)
    assert pipeline_bubble_s(8.0, degree=4, microbatches=8, stages_per_rank=2) == pytest.approx(8.0 * 3 / 16)
    assert pipeline_bubble_s(8.0, degree=1, microbatches=8) == 0


@pytest.fixture(scope="module")
def pp_plan():
    return plan(tiny_config("llama", num_hidden_layers=8), gpu="h100-sxm", num_gpus=4, workload=WL, methods=["pp"],
                global_batch=8, grad_checkpointing=False, prune=False)


def test_pipeline_candidates_are_one_row_microbatches_of_each_ranks_share(pp_plan):
    # 8 layers: pipeline degrees 2 (FSDP2 over 2 inside each stage, or TP over 2) and 4; TP 4 does not divide
    # the tiny model's 2 kv heads. Each data-parallel rank's share of the 8 sequences is its microbatches per
    # optimizer step: in one schedule step, or in two of 4 (torchtitan's gradient accumulation) where each
    # keeps two microbatches per stage.
    got = sorted((c.pp, c.tp, c.micro_batch, c.grad_accum, c.schedule_steps) for c in pp_plan.candidates)
    assert got == [(2, 1, 1, 4, 1), (2, 2, 1, 4, 2), (2, 2, 1, 8, 1), (4, 1, 1, 8, 1)]
    assert any(name == "pp tp4" for name, _ in pp_plan.skipped)
    for c in pp_plan.candidates:
        assert c.time.bubble_s == pytest.approx(pipeline_bubble_s(c.time.compute_s, degree=c.pp,
                                                                  microbatches=c.grad_accum))
        assert c.time.bubble_s > 0
        assert c.label().startswith(f"pp{c.pp} " + (f"tp{c.tp} " if c.tp > 1 else ""))
        assert (" x2 steps" in c.label()) == (c.schedule_steps == 2)
    # Two schedule steps of 4 against one of 8: twice the bubble ((p - 1) / m of the same compute).
    one, two = (next(c for c in pp_plan.candidates if (c.pp, c.tp, c.schedule_steps) == (2, 2, k)) for k in (1, 2))
    assert two.time.compute_s == pytest.approx(one.time.compute_s)
    assert two.time.bubble_s == pytest.approx(2 * one.time.bubble_s)


def test_the_pipeline_choice_is_the_methods_own_estimate(pp_plan):
    c = pp_plan.choice
    assert c is not None and c.verified and c.pp in (2, 4)
    wl = dataclasses.replace(WL, micro_batch_size=1, grad_checkpointing=c.grad_checkpointing,
                             grad_accum_steps=c.schedule_steps)
    # As torchtitan's trainer steps the schedule: no outputs returned.
    est = estimate_method("pp", tiny_config("llama", num_hidden_layers=8), wl, layout=Layout(num_gpus=4, tp=c.tp),
                          gpu="h100-sxm", pipeline_degree=c.pp, microbatches=c.grad_accum, return_outputs=False)
    assert c.device_total_bytes == est.worst.device_total_bytes
    assert c.peak_allocated_bytes == est.worst.peak_allocated_bytes
    # The others are the method's own estimates at their configurations: in fast mode where a stage is deeper
    # than fast mode traces whole (pipeline 2: stages of 4 layers), at full depth otherwise (pipeline 4: at most
    # 3), which verifies them.
    for other in (x for x in pp_plan.candidates if x is not c):
        assert other.verified == (other.pp == 4)
        assert other.device_total_bytes == _method_estimate(other, 8, fast=not other.verified).worst.device_total_bytes


def _method_estimate(c, layers: int, *, fast: bool):
    wl = dataclasses.replace(WL, micro_batch_size=1, grad_checkpointing=c.grad_checkpointing,
                             grad_accum_steps=c.schedule_steps)
    return estimate_method("pp", tiny_config("llama", num_hidden_layers=layers), wl,
                           layout=Layout(num_gpus=4, tp=c.tp), gpu="h100-sxm", pipeline_degree=c.pp,
                           microbatches=c.grad_accum, fast=fast, return_outputs=False)


def test_shallow_stages_are_screened_at_full_depth_and_need_no_verification(monkeypatch):
    """Stages of at most pp.FAST_FULL_DEPTH_LAYERS layers: fast mode traces them whole, so every pipeline
    candidate is the method's full-depth estimate at its configuration and the choice is not traced again."""
    import llmem_plugin.planner.verify as planner

    def refuse(*_):
        raise AssertionError("a pipeline screened at full depth was traced again")

    monkeypatch.setattr(planner, "_verify", refuse)
    p = plan(tiny_config("llama", num_hidden_layers=4), gpu="h100-sxm", num_gpus=4, workload=WL, methods=["pp"],
             global_batch=8, grad_checkpointing=False, prune=False)
    assert p.choice is not None and p.choice.verified and p.candidates
    for c in p.candidates:
        assert c.verified
        assert c.device_total_bytes == _method_estimate(c, 4, fast=False).worst.device_total_bytes


@pytest.mark.parametrize("kwargs,match", [
    ({"micro_batch": 2}, r"one-row microbatches, not --micro-batch 2\. HINT: leave --micro-batch out"),
    # Without TP: pipeline 2 x TP 2 would leave one data-parallel rank, whose share of 2 is enough.
    ({"global_batch": 2, "tps": [1]},
     r"fewer than the 2 pipeline stages\. HINT: pass a --global-batch of at least 4"),
])
def test_pipeline_batch_errors_name_their_own_fix(kwargs, match):
    from llmem_plugin.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as e:
        plan(tiny_config("llama", num_hidden_layers=8), gpu="h100-sxm", num_gpus=4, workload=WL, methods=["pp"],
             **kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("tp,precision", [(1, "fp32"), (2, "fp32"), (1, "bf16-mixed")])
def test_the_receive_buffer_bound_is_under_every_ranks_estimate(tp, precision):
    """The screen's pipeline floor (the largest stage's parameters and gradients, an even share of the
    optimizer states, and one kind of receive buffer for every microbatch of the configuration's shortest
    schedule step) is under every rank's tensor peak in the method's own estimate at that split (pipeline 2
    over 4 GPUs: FSDP2 over 2, or TP over 2): the bound may skip a configuration only when no rank of any
    of its splits can fit. Under mixed precision the floor holds
    the stage's parameters gathered in bf16 and their gradients accumulated in FSDP2's fp32 reduce dtype."""
    from llmem_plugin.models import modelbuild
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.planner.bounds import _lower_bound, _receive_buffers_bound
    from llmem_plugin.planner.candidates import _Config, _Context
    from llmem_plugin.planner.space import _pipeline_splits

    model = tiny_config("llama")
    wl = dataclasses.replace(WL, micro_batch_size=1, precision=precision)
    n = sum(q.numel() for q in modelbuild.build_model(model, wl, device="meta").parameters())
    layout = Layout(num_gpus=4, tp=tp)
    ctx = _Context(model=model, config=model, workload=wl, layout=layout, gpu=get_gpu("h100-sxm"), network=None,
                   global_batch=256, limit=0, alloc_conf=None, efficiency=1.0, params=n, trainable=n)
    cfg = _Config("pp", tp, 2)
    buffers = _receive_buffers_bound(ctx, cfg)
    # Each data-parallel rank's share of the 256 rows, one per microbatch, over schedule steps of at least 4.
    share = 256 // (4 // (2 * tp))
    m, k = min(_pipeline_splits(ctx, cfg))
    assert (m, k) == (4, share // 4)
    assert buffers == m * 32 * 64 * (4 if precision == "fp32" else 2)  # a row of 32 x 64 activations each
    floor = _lower_bound(cfg, layout, n, n, wl) + buffers
    est = estimate_method("pp", model, dataclasses.replace(wl, grad_accum_steps=k), layout=layout, gpu="h100-sxm",
                          pipeline_degree=2, microbatches=m, return_outputs=False)
    for r in est.ranks:
        assert floor <= r.peak_tensor_bytes


def test_the_plan_traces_at_most_its_pipeline_budget():
    """max_pipelines=1: one pipeline configuration is traced, every other is listed as skipped (here each
    bound is above the traced one's step time); max_pipelines=0: none is traced, each skipped with the
    budget as its reason, and nothing fits."""
    from llmem_plugin.errors import WontFitError

    kw = dict(gpu="h100-sxm", num_gpus=4, workload=WL, methods=["pp"], global_batch=8, grad_checkpointing=False)
    names = {"pp2", "pp2 tp2", "pp4"}
    one = plan(tiny_config("llama", num_hidden_layers=8), max_pipelines=1, **kw)
    traced = {f"pp{c.pp}" + (f" tp{c.tp}" if c.tp > 1 else "") for c in one.candidates}
    assert len(traced) == 1
    assert names - traced <= set(dict(one.skipped))
    with pytest.raises(WontFitError) as e:
        plan(tiny_config("llama", num_hidden_layers=8), max_pipelines=0, suggest=False, **kw)
    reasons = dict(e.value.plan.skipped)
    assert not e.value.plan.candidates
    assert all(reasons[n].startswith("not traced: the plan traces the 0 pipeline configuration(s)") for n in names)


def test_interleaved_pipelines_are_planned_with_their_smaller_bubble():
    """pp-interleaved: torch's interleaved 1F1B with two stages per rank, the bubble (p - 1) / (v m) of the
    compute (Narayanan et al., SC'21, §2.2.2), half of 1F1B's at the same split; its memory the method's own
    estimate at exactly the candidate's configuration."""
    p = plan(tiny_config("llama", num_hidden_layers=8), gpu="h100-sxm", num_gpus=4, workload=WL,
             methods=["pp-interleaved"], tps=[1], global_batch=8, grad_checkpointing=False, prune=False)
    assert sorted((c.pp, c.grad_accum, c.schedule_steps) for c in p.candidates) == [(2, 4, 1), (4, 8, 1)]
    for c in p.candidates:
        assert c.label().startswith(f"pp{c.pp} interleaved mb1x{c.grad_accum}")
        assert c.time.bubble_s == pytest.approx(c.time.compute_s * (c.pp - 1) / (2 * c.grad_accum))
        wl = dataclasses.replace(WL, micro_batch_size=1, grad_accum_steps=c.schedule_steps)
        est = estimate_method("pp-interleaved", tiny_config("llama", num_hidden_layers=8), wl,
                              layout=Layout(num_gpus=4), gpu="h100-sxm", pipeline_degree=c.pp,
                              microbatches=c.grad_accum, return_outputs=False)
        assert c.device_total_bytes == est.worst.device_total_bytes


@pytest.mark.parametrize("method", ["pp", "pp-interleaved"])
def test_the_critical_path_bytes_are_the_methods_own_count(method):
    """Pipeline 2 x TP 2 on 4 GPUs leaves no FSDP2 inside the stages, so the method's whole traffic is its
    P2P and TP bytes: the planner's critical-path bytes (each rank's TP collectives over all of its stages'
    layers: two stages per rank interleaved) must equal them."""
    from llmem_plugin.models import modelbuild
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.planner.candidates import _Config, _Context
    from llmem_plugin.planner.screen import _pp_path_bytes

    model = tiny_config("llama", num_hidden_layers=8)
    wl = dataclasses.replace(WL, micro_batch_size=1)
    n = sum(q.numel() for q in modelbuild.build_model(model, wl, device="meta").parameters())
    layout = Layout(num_gpus=4, tp=2)
    ctx = _Context(model=model, config=model, workload=wl, layout=layout, gpu=get_gpu("h100-sxm"), network=None,
                   global_batch=8, limit=0, alloc_conf=None, efficiency=1.0, params=n, trainable=n)
    p2p, tp_bytes = _pp_path_bytes(ctx, _Config(method, 2, 2), False, (8, 1))
    est = estimate_method(method, model, wl, layout=layout, gpu="h100-sxm", pipeline_degree=2, microbatches=8,
                          return_outputs=False, ranks=[0])
    assert p2p + tp_bytes == est.comm_intra_node_bytes + est.comm_inter_node_bytes


def test_progress_names_each_trace_before_it_runs():
    """plan(progress=...) is told, before each batch of screening traces and each verification, what runs
    next: the profile, the pipeline configurations with their checkpointing, the verification of the choice."""
    lines: list[str] = []
    p = plan(tiny_config("llama", num_hidden_layers=8), gpu="h100-sxm", num_gpus=4, workload=WL, methods=["pp"],
             tps=[1], global_batch=8, grad_checkpointing=False, prune=False, progress=lines.append)
    assert lines[0].endswith("profiling the single-GPU step")
    assert any("screening pp2" in line and "minutes on a large model" in line for line in lines)
    verified = [line for line in lines if "verifying" in line]
    assert verified == [] if p.choice.pp == 4 else verified[-1].endswith(f"verifying {p.choice.label()} at full depth")
    assert all(line.startswith("[") and " s] " in line for line in lines)


def test_a_pipeline_screen_takes_the_other_units_and_a_verification_beside_it(monkeypatch):
    """On two or more cores a batch that screens a pipeline configuration also screens every other ready unit
    and verifies the fastest fitting candidate screened so far beside it; the plan is the same as one that
    screens and verifies one after the other (one core): the same choice, with the same traced numbers."""
    import llmem_plugin.planner.screen as planner

    kw = dict(gpu="h100-sxm", num_gpus=4, workload=WL, methods=["fsdp", "zero3", "pp"], tps=[1], global_batch=8,
              grad_checkpointing=False, prune=False)
    model = tiny_config("llama", num_hidden_layers=8)
    monkeypatch.setattr(planner, "_cores", lambda: 2)
    lines: list[str] = []
    p = plan(model, progress=lines.append, **kw)
    beside = [line for line in lines if "beside it" in line]
    assert beside, lines
    monkeypatch.setattr(planner, "_cores", lambda: 1)
    q = plan(model, **kw)
    assert p.choice.label() == q.choice.label() and p.choice.verified and q.choice.verified
    assert (p.choice.device_total_bytes, p.choice.peak_allocated_bytes) == (q.choice.device_total_bytes,
                                                                             q.choice.peak_allocated_bytes)
