"""Bound (llmem_plugin.planner.bounds): the shards' closed form, and each unit's bounds under what the
traces give: the memory bound under the method's full trace, the time bound under every screened candidate's
step time."""

from __future__ import annotations

import pytest
import transformers

from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.device.overheads import CUDA_CONTEXT_BYTES
from llmem_plugin.planner.bounds import FIXED_WHAT, _lower_bound, _memory_bound, bound_configs, bound_units, fixed_bytes
from llmem_plugin.planner.candidates import _Config, _Options, _Run
from llmem_plugin.planner.screen import _Search, screen
from llmem_plugin.planner.search import _cached_profiles
from llmem_plugin.workload import Workload

from tests.conftest import tiny_config
from tests.planner.test_space import context, llama

GIB = 2**30


def test_the_shards_are_the_parameters_and_the_adam_states_over_the_sharding_ranks():
    model = llama()
    wl = Workload(seq_len=32, precision="bf16-mixed", optimizer="adamw")
    ctx = context(model, num_gpus=4, workload=wl)
    n = ctx.params
    assert n == ctx.trainable == sum(p.numel() for p in transformers.LlamaForCausalLM(model).parameters())
    # bf16-mixed: 16-bit parameters (2 B) and two fp32 Adam states (8 B) per element.
    assert _lower_bound(_Config("ddp", 1), ctx.layout, n, n, wl) == 2 * n + 8 * n
    assert _lower_bound(_Config("zero1", 1), ctx.layout, n, n, wl) == 2 * n + 8 * n // 4
    assert _lower_bound(_Config("fsdp", 1), ctx.layout, n, n, wl) == 2 * n // 4 + 8 * n // 4
    assert _lower_bound(_Config("dp-tp", 2), ctx.layout, n, n, wl) == 2 * n // 2 + 8 * n // 2
    # Offload: the states live on the host; ZeRO-3 offload's parameters too.
    assert _lower_bound(_Config("zero3-offload", 1), ctx.layout, n, n, wl) == 0


def test_configurations_whose_shards_exceed_the_limit_are_skipped_with_the_figure():
    model = llama()
    probe = context(model, num_gpus=4)
    n = probe.params
    fixed = fixed_bytes(probe.gpu, probe.layout)
    # fp32 + Adam: 4 B of parameters and 8 B of states per element. A limit between fsdp's shards (3 B per
    # element over 4 GPUs) and zero2's (4 B + 8 B / 4), beside what every candidate holds:
    limit = fixed + (3 * n + 6 * n) // 2
    ctx = context(model, num_gpus=4, gpu_memory=int(limit / 0.95) + 1)
    assert ctx.limit >= limit
    run = _Run()
    configs = [_Config(m, 1) for m in ("ddp", "zero2", "fsdp")]
    assert bound_configs(ctx, configs, run, None) == [_Config("fsdp", 1)]
    assert run.skipped == [
        (m, f"its parameter and optimizer-state shards and {FIXED_WHAT} take at least {(b + fixed) / GIB:.1f} GiB "
            f"of the {ctx.limit / GIB:.1f} GiB limit") for m, b in (("ddp", 12 * n), ("zero2", 4 * n + 8 * n // 4))]


def test_the_fixed_bytes_are_the_context_a_cublas_workspace_and_one_nccl_communicator():
    from llmem_plugin.device.gpus import get_gpu

    h100, v100 = get_gpu("h100-sxm"), get_gpu("v100-32gb")
    # overheads.py's figures: the measured context; parseChosenWorkspaceSize's ":4096:8" (32 MiB) on sm90
    # and ":4096:2:16:8" elsewhere; NCCL's three protocol buffers on each of 16 channels.
    nccl = 16 * ((4 << 20) + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8)
    assert fixed_bytes(h100, Layout(num_gpus=1)) == CUDA_CONTEXT_BYTES + (32 << 20)
    assert fixed_bytes(h100, Layout(num_gpus=8)) == CUDA_CONTEXT_BYTES + (32 << 20) + nccl
    assert fixed_bytes(v100, Layout(num_gpus=2)) == CUDA_CONTEXT_BYTES + 4096 * 1024 * 2 + 16 * 1024 * 8 + nccl


@pytest.mark.parametrize("method", ["ddp", "zero2", "zero3", "fsdp", "tp", "pp", "lowlevel-zero1", "gemini"])
def test_every_methods_estimate_holds_the_fixed_bytes(method):
    """What a plan may skip without a trace: every method's own estimate of a tiny model is above it."""
    wl = Workload(seq_len=32, precision="bf16" if method == "pp" else "bf16-mixed", optimizer="adamw")
    layout = Layout(num_gpus=2, tp=2 if method == "tp" else 1)
    options = {"pipeline_degree": 2, "microbatches": 2} if method == "pp" else {}
    est = estimate_method(method, tiny_config("llama"), wl, layout=layout, gpu="h100-sxm", fast=True, **options)
    fixed = fixed_bytes(get_gpu("h100-sxm"), layout)
    for r in est.ranks:
        assert r.device_total_bytes >= fixed, (method, r.rank)


def test_a_limit_under_the_fixed_bytes_refuses_without_a_trace(monkeypatch):
    """Nothing is traced and no change is searched: the one line says what alone is over the limit."""
    import llmem_plugin.methods as methods
    from llmem_plugin import WontFitError
    from llmem_plugin.planner.search import plan

    calls: list[str] = []
    monkeypatch.setattr(methods, "_estimate_method", lambda *a, **k: calls.append(a[2]))
    fixed = fixed_bytes(get_gpu("h100-sxm"), Layout(num_gpus=2))
    with pytest.raises(WontFitError, match="alone take .* no change of the job on 2 GPUs can fit") as e:
        plan(tiny_config("llama"), gpu="h100-sxm", gpu_memory=fixed, num_gpus=2, margin=0.05,
             workload=Workload(seq_len=32))
    p = e.value.plan
    assert calls == [] and p.candidates == [] and p.suggestions == [] and p.fixed_bytes == fixed
    assert p.skipped[-1][0] == "every method"


@pytest.fixture(scope="module")
def bounded():
    """Two GPUs, three methods, both checkpointing settings: the bounds, and the screen of every unit."""
    model = tiny_config("llama")
    ctx = context(model, num_gpus=2, global_batch=8)
    opts = _Options(gcs=[False, True], micro_batch=None, prune=False, max_pipelines=None, verify=False,
                    max_verify=6)
    run = _Run()
    search = _Search(ctx, _cached_profiles({}, ctx), opts.gcs, None)
    bound_units(ctx, opts, [_Config(m, 1) for m in ("ddp", "zero3", "fsdp")], search, run)
    bounds = dict(run.bound)
    pending = list(run.pending)
    screen(ctx, opts, run, search)
    return model, ctx, search, bounds, pending, run


def test_units_are_pending_in_order_of_their_time_bound(bounded):
    _, _, _, bounds, pending, _ = bounded
    assert len(pending) == 6 and set(pending) == set(bounds)
    assert [bounds[u] for u in pending] == sorted(bounds.values())


def test_the_time_bound_is_under_every_candidate_of_its_unit(bounded):
    _, _, _, bounds, _, run = bounded
    assert len(run.candidates) == 6 * 3  # micro-batches 1, 2 and 4 of each unit
    for c in run.candidates:
        assert bounds[(_Config(c.method, c.tp), c.grad_checkpointing)] <= c.step_time_s, c.label()


@pytest.mark.parametrize("method", ["ddp", "zero3", "fsdp"])
def test_the_memory_bound_is_under_the_methods_full_trace(bounded, method):
    model, ctx, search, _, _, _ = bounded
    for gc in (False, True):
        full = estimate_method(method, model, Workload(seq_len=32, precision="fp32", optimizer="adamw",
                                                       grad_checkpointing=gc),
                               layout=Layout(num_gpus=2), gpu="h100-sxm").worst
        bound = _memory_bound(ctx, _Config(method, 1), gc, search.profiles)
        assert 0 < bound <= full.device_total_bytes, (method, gc)

