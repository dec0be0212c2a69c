"""Explain (llmem_plugin.planner.explain): when nothing fits, the changes it lists each re-plan to a fit,
and the won't-fit line carries the closest candidate's figures; what the search left out is listed."""

from __future__ import annotations

import dataclasses

import pytest

from llmem_plugin.errors import WontFitError
from llmem_plugin.planner.candidates import _Config, _Run
from llmem_plugin.planner.explain import explain, explain_skipped
from llmem_plugin.planner.search import plan
from llmem_plugin.workload import LoraSpec, OptimizerKind

from tests.conftest import tiny_config
from tests.planner.test_rank import candidate
from tests.planner.test_space import WL

GIB = 2**30
# Single-GPU training of the tiny Llama takes 875,364,352 B at micro-batch 1 (the CUDA context, mostly):
# a GPU whose limit (95%) is 875,000,000 B misses it by a hair.
GPU_MEMORY = 921_052_631
SAME = {"gpu": "h100-sxm", "gpu_memory": GPU_MEMORY, "global_batch": 8, "methods": ["single"],
        "grad_checkpointing": False}


@pytest.fixture(scope="module")
def refused():
    cache: dict = {}
    with pytest.raises(WontFitError) as e:
        plan(tiny_config("llama"), num_gpus=1, workload=WL, suggest=False, _profiles=cache, **SAME)
    return e.value.plan, cache


def test_without_a_search_for_changes_the_line_names_the_closest(refused):
    failed, cache = refused
    err = explain(failed, model=tiny_config("llama"), same=None, cache=cache, replan=plan, t0=0.0, t_end=0.0)
    c = failed.closest(1)[0]
    assert c.label() == "single mb1x8" and c.device_total_bytes > failed.limit_bytes
    assert str(err) == (f"no method fits LlamaConfig on 1 x h100-sxm at seq 32 within {failed.limit_bytes / GIB:.1f} "
                        f"GiB per GPU; closest: single mb1x8 needs {c.device_total_bytes / GIB:.1f} GiB "
                        f"(+{100 * (c.device_total_bytes / failed.limit_bytes - 1):.0f}%)")
    assert err.plan.suggestions == [] and "suggest" in err.plan.timings


def test_each_fix_replans_to_a_fit(refused):
    failed, cache = refused
    model = tiny_config("llama")
    err = explain(failed, model=model, same=SAME, cache=cache, replan=plan, t0=0.0, t_end=0.0)
    # One GPU of `single` cannot grow (single is one GPU) and the CPU-offload methods keep the context; a
    # smaller model state does it: LoRA's. 8-bit Adam states alone are not enough without checkpointing.
    assert [s.change for s in err.plan.suggestions] == ["LoRA (rank 16 on q/k/v/o)"]
    assert str(err).endswith("; to fit: LoRA (rank 16 on q/k/v/o)")
    fix = err.plan.suggestions[0].choice
    again = plan(model, num_gpus=1, workload=dataclasses.replace(WL, lora=LoraSpec(rank=16)), _profiles=cache,
                 **SAME).choice
    assert fix.fits and fix.verified and fix.device_total_bytes <= failed.limit_bytes
    assert (again.label(), again.device_total_bytes) == (fix.label(), fix.device_total_bytes)
    with pytest.raises(WontFitError):  # the change left out does not fit
        plan(model, num_gpus=1, workload=dataclasses.replace(WL, optimizer=OptimizerKind.ADAMW_8BIT),
             _profiles=cache, suggest=False, **SAME)


def test_failed_traces_and_untraced_units_are_listed_after_the_rest():
    unit = (_Config("zero3", 1), True)
    choice = candidate("fsdp")
    run = _Run(skipped=[("hsdp", "needs more than one node (it equals fsdp on one)")], pending=[unit],
               bound={unit: 4.5}, failed={"gemini": "model type not supported"}, candidates=[choice])
    explain_skipped(run, choice, [False, True])
    assert run.skipped == [
        ("hsdp", "needs more than one node (it equals fsdp on one)"),
        ("gemini", "model type not supported"),
        ("zero3 +ckpt", f"cannot beat {choice.step_time_s:.3g} s per step (at least 4.5 s under the model)"),
    ]
