"""The planner: its choice, its monotonicity, and its refusal.

A small Llama (45M parameters) on GPUs shrunk with ``gpu_memory`` keeps the
decisions real (replicated states do not fit, sharded ones do) and the
traces quick."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from llmem_plugin.errors import ConfigError, WontFitError
from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.planner.candidates import planner_methods
from llmem_plugin.planner.search import DEFAULT_MARGIN, plan
from llmem_plugin.workload import LoraSpec, OptimizerKind, Workload

from tests.conftest import room

GIB = 2**30
METHODS = ["ddp", "zero2", "zero3", "fsdp", "dp-tp"]


def small():
    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=4096,
    )


WL = Workload(seq_len=1024)


@pytest.fixture(scope="module")
def four_gpus():
    return plan(small(), gpu="h100-sxm", num_gpus=4, workload=WL, gpu_memory=room(1.258), methods=METHODS)


def test_the_choice_is_the_fastest_candidate_that_fits(four_gpus):
    p = four_gpus
    assert p.choice is not None and p.choice.fits and p.choice.verified
    assert p.choice.device_total_bytes <= p.limit_bytes == int(p.capacity_bytes * (1 - DEFAULT_MARGIN))
    # Under the model, nothing that fits is faster (screened or traced).
    for c in p.candidates:
        if c.fits:
            assert c.tokens_per_s <= p.choice.tokens_per_s * (1 + 1e-9), c.label()
    # The ones ranked above it were traced and found not to fit.
    above = p.candidates[: p.candidates.index(p.choice)]
    assert all(not c.fits for c in above)
    # Replicated states do not fit 1.23 GiB of allocator room: 45M params x 16 B.
    assert all(not c.fits for c in p.candidates if c.method == "ddp")
    # Every candidate's tokens/s is the global batch's tokens over its step time.
    for c in p.candidates:
        assert c.tokens_per_s == pytest.approx(p.global_batch * WL.seq_len / c.step_time_s)
        assert c.micro_batch * c.grad_accum * (4 // c.tp) == p.global_batch


def test_the_choice_carries_the_methods_own_full_estimate(four_gpus):
    c = four_gpus.choice
    wl = dataclasses.replace(WL, micro_batch_size=c.micro_batch, grad_accum_steps=min(c.grad_accum, 2),
                             grad_checkpointing=c.grad_checkpointing)
    est = estimate_method(c.method, small(), wl, layout=Layout(num_gpus=4, tp=c.tp), gpu="h100-sxm")
    assert c.device_total_bytes == est.worst.device_total_bytes
    assert c.peak_reserved_bytes == est.worst.peak_reserved_bytes


def test_accumulation_past_two_micro_steps_does_not_move_the_peak():
    """Why the verification traces at most 2 micro-steps."""
    est = {a: estimate_method("fsdp", small(), dataclasses.replace(WL, grad_accum_steps=a),
                              layout=Layout(num_gpus=2), gpu="h100-sxm").worst for a in (2, 3)}
    assert est[2].peak_allocated_bytes == est[3].peak_allocated_bytes
    assert est[2].peak_reserved_bytes == est[3].peak_reserved_bytes


def test_more_gpus_never_make_the_best_throughput_worse():
    best = []
    for n in (2, 4):
        # 1.73 GiB of room: FSDP2 on 2 GPUs needs about 1.33 GiB since its side-stream
        # pools are replayed apart (methods/_streams.py), so both sizes fit.
        p = plan(small(), gpu="h100-sxm", num_gpus=n, workload=WL, gpu_memory=room(1.758),
                 methods=["zero3", "fsdp"], global_batch=8)
        best.append(p.choice.tokens_per_s)
    assert best[1] >= best[0]


def test_more_memory_never_turns_a_fit_into_a_non_fit():
    kw = {"gpu": "h100-sxm", "num_gpus": 2, "workload": WL, "methods": ["ddp", "fsdp"], "global_batch": 4}
    tight = plan(small(), gpu_memory=room(1.458), **kw)
    roomy = plan(small(), gpu_memory=room(2.758), **kw)
    assert not all(c.fits for c in tight.candidates)
    fit_tight = {c.key for c in tight.candidates if c.fits}
    fit_roomy = {c.key for c in roomy.candidates if c.fits}
    assert fit_tight <= fit_roomy
    assert roomy.choice.tokens_per_s >= tight.choice.tokens_per_s


def medium():
    """Sharded states large enough (about 110M parameters) that more GPUs, not only less work, make FSDP fit
    beside the CUDA context every GPU holds."""
    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2752, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=8, max_position_embeddings=4096,
    )


def test_nothing_fits_raises_with_the_report_and_suggestions_that_fit():
    with pytest.raises(WontFitError) as info:
        plan(medium(), gpu="h100-sxm", num_gpus=2, workload=WL, gpu_memory=room(1.45),
             methods=["ddp", "fsdp"], global_batch=2)
    e = info.value
    p = e.plan
    assert p.choice is None and all(not c.fits for c in p.candidates)
    assert "\n" not in str(e) and "no method fits" in str(e)
    closest = p.closest(3)
    assert closest and closest[0].device_total_bytes == min(c.device_total_bytes for c in p.candidates)
    assert f"{closest[0].device_total_bytes / GIB:.1f} GiB" in str(e)
    assert p.suggestions, "more GPUs at least should make a sharded method fit"
    changes = [s.change for s in p.suggestions]
    assert any("GPUs" in c for c in changes)
    for s in p.suggestions:
        assert s.choice.fits and s.choice.verified and s.choice.device_total_bytes <= s.choice.limit_bytes
    # Applying a suggestion really fits: re-plan with it from scratch.
    more = next(s for s in p.suggestions if "GPUs" in s.change)
    n = int(more.change.split()[0])
    again = plan(medium(), gpu="h100-sxm", num_gpus=n, num_nodes=1, workload=WL, gpu_memory=room(1.45),
                 methods=["ddp", "fsdp"], global_batch=n)
    assert again.choice is not None
    if any(c.startswith("LoRA") for c in changes):
        lora = plan(medium(), gpu="h100-sxm", num_gpus=2, workload=dataclasses.replace(WL, lora=LoraSpec(rank=16)),
                    gpu_memory=room(1.45), methods=["ddp", "fsdp"], global_batch=2)
        assert lora.choice is not None


def test_single_gpu_plans_the_plain_step_and_offload():
    p = plan(small(), gpu="h100-sxm", num_gpus=1, workload=WL, global_batch=2, prune=False)
    assert {c.method for c in p.candidates} == {"single", "zero2-offload", "zero3-offload", "fsdp-offload"}
    assert p.choice.method == "single"  # no communication, no PCIe traffic
    # Pruned, the offload methods are not even traced: their PCIe time alone loses.
    quick = plan(small(), gpu="h100-sxm", num_gpus=1, workload=WL, global_batch=2)
    assert quick.choice.key == p.choice.key
    assert {c.method for c in quick.candidates} == {"single"}
    assert any(name.startswith("zero3-offload") and "cannot beat" in why for name, why in quick.skipped)


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"margin": 1.5}, "margin"),
    ({"methods": ["zero4"]}, "unknown method 'zero4'"),
    ({"global_batch": 0}, "global batch"),
    ({"efficiency": 0}, "efficiency"),
])
def test_bad_input_is_one_clear_line(kw, fragment):
    with pytest.raises(ConfigError) as info:
        plan(small(), gpu="h100-sxm", num_gpus=2, workload=WL, **kw)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_every_planner_method_maps_to_a_registered_one():
    from llmem_plugin.methods import method_names
    from llmem_plugin.planner.candidates import _VARIANTS

    for m in planner_methods():
        assert _VARIANTS.get(m, (m, {}))[0] in method_names()


def test_pruning_skips_only_what_cannot_win():
    """The time bound of a (method, checkpointing) is below every one of its
    candidates' step times, so pruning by it keeps the same choice."""
    kw = {"gpu": "h100-sxm", "num_gpus": 4, "workload": WL, "gpu_memory": room(1.258), "global_batch": 8,
          "methods": ["ddp", "zero2", "zero3", "fsdp", "dp-tp", "zero3-offload"]}
    full = plan(small(), prune=False, **kw)
    pruned = plan(small(), **kw)
    assert pruned.choice.step_time_s == pytest.approx(full.choice.step_time_s)
    assert pruned.choice.key == full.choice.key
    assert len(pruned.candidates) <= len(full.candidates)
    # Rebuild the planner's context to evaluate the bounds themselves.
    from llmem_plugin.planner import bounds as planner

    seen = []
    original = planner._time_bound

    def spy(ctx, cfg, gc, profiles):
        value = original(ctx, cfg, gc, profiles)
        seen.append((cfg.method, cfg.tp, gc, value))
        return value

    planner._time_bound = spy
    try:
        again = plan(small(), prune=False, **kw)
    finally:
        planner._time_bound = original
    assert seen
    for method, tp, gc, value in seen:
        times = [c.step_time_s for c in again.candidates
                 if (c.method, c.tp, c.grad_checkpointing) == (method, tp, gc)]
        assert all(t >= value * (1 - 1e-9) for t in times), (method, tp, gc)


def test_the_memory_bound_is_below_every_full_trace():
    """A unit skipped for memory must really not fit: its bound is at most
    the full trace of its smallest candidate (micro-batch 1, one micro-step)."""
    from llmem_plugin.planner import bounds as planner

    seen = []
    original = planner._memory_bound

    def spy(ctx, cfg, gc, profiles):
        value = original(ctx, cfg, gc, profiles)
        seen.append((cfg.method, cfg.tp, gc, value))
        return value

    planner._memory_bound = spy
    try:
        plan(small(), gpu="h100-sxm", num_gpus=4, workload=WL, global_batch=4, verify=False, prune=False,
             methods=["ddp", "fsdp", "zero3", "dp-tp"])
    finally:
        planner._memory_bound = original
    assert {(m, gc) for m, _, gc, _ in seen} == {(m, gc) for m in ("ddp", "fsdp", "zero3", "dp-tp")
                                                 for gc in (False, True)}
    for method, tp, gc, value in seen:
        wl = dataclasses.replace(WL, grad_checkpointing=gc)
        full = estimate_method(method, small(), wl, layout=Layout(num_gpus=4, tp=tp), gpu="h100-sxm").worst
        assert value <= full.device_total_bytes, (method, tp, gc)


@pytest.mark.parametrize("method", ["ddp", "fsdp", "zero3", "dp-tp"])
def test_method_fast_mode_extrapolates_the_allocated_peak(method):
    """estimate_method(fast=True) against the full trace of a 10-layer model:
    the allocated peak is affine in depth (1% here; the reserved peak is
    not, which is why the planner verifies its choice in full)."""
    cfg = small()
    cfg.num_hidden_layers = 10
    layout = Layout(num_gpus=4, tp=2 if method == "dp-tp" else 1)
    wl = dataclasses.replace(WL, seq_len=512)
    fast = estimate_method(method, cfg, wl, layout=layout, gpu="h100-sxm", fast=True)
    full = estimate_method(method, cfg, wl, layout=layout, gpu="h100-sxm")
    assert any("fast: extrapolated" in n for n in fast.notes)
    assert fast.worst.peak_allocated_bytes == pytest.approx(full.worst.peak_allocated_bytes, rel=0.01)
    assert fast.comm_intra_node_bytes == pytest.approx(full.comm_intra_node_bytes, rel=0.01)


@pytest.mark.parametrize("kind", list(OptimizerKind))
def test_every_optimizer_has_a_state_bound_and_a_step_cost(kind):
    from llmem_plugin.planner.cost import optimizer_bytes_per_element
    from llmem_plugin.planner.bounds import _state_bytes_per_element

    wl = Workload(optimizer=kind)
    # AdamW's two fp32 states (4 + 4 B per element) bound every kind from above:
    # 8-bit states take 1 B each, paged ones live outside the device fit.
    assert 0 <= _state_bytes_per_element(wl) <= 8
    assert 0 < optimizer_bytes_per_element(kind) <= 7 * 4
