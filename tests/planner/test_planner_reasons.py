"""The planner says why nothing can be planned, and plans where a user calls it.

* A method that cannot run on the layout (zero1 on one GPU) is a ConfigError
  naming the method, the layout and the fix, not "no method fits ... GiB".
* The won't-fit path (its suggestion search tries bitsandbytes' 8-bit AdamW)
  needs no optional library: with ``import bitsandbytes`` failing, nothing
  fits is still a WontFitError with its suggestions.
* After ``torch.distributed.init_process_group`` (a real job's process), the
  DDP/FSDP estimates trace under their fake group and leave the job's real
  group as it was.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from llmem_plugin.errors import ConfigError, WontFitError
from llmem_plugin.planner.search import plan

from tests.conftest import tiny_config

# vocab 32000 x hidden 64: two 2.05M-element matrices, so AdamW's fp32 states
# (8 B per element) and 8-bit AdamW's (2 B + absmax) differ by about 24 MiB.
CFG = {"vocab_size": 32000}


def test_a_method_that_needs_two_gpus_on_one_gpu_is_a_config_error_naming_why():
    with pytest.raises(ConfigError) as e:
        plan(tiny_config("llama"), gpu="h100-sxm", num_gpus=1, methods=["zero1"])
    msg = str(e.value)
    assert "zero1 needs at least 2 GPUs" in msg and "1 GPU" in msg
    assert "HINT: pass --gpus 2 or more" in msg and "no method fits" not in msg and "\n" not in msg


def test_single_on_two_gpus_is_a_config_error_naming_why():
    with pytest.raises(ConfigError, match=r"single runs on one GPU, not 2\. HINT: .*--gpus 1"):
        plan(tiny_config("llama"), gpu="h100-sxm", num_gpus=2, methods=["single"])


def test_nothing_fits_without_bitsandbytes_is_a_wont_fit_with_the_8bit_suggestion(no_bitsandbytes):
    cfg = tiny_config("llama", **CFG)
    kw = {"gpu": "h100-sxm", "num_gpus": 1, "methods": ["single", "ddp"], "global_batch": 1,
          "micro_batch": 1, "grad_checkpointing": False}
    from llmem_plugin.workload import Workload

    wl = Workload(seq_len=64, precision="fp32")
    adamw = plan(cfg, workload=wl, **kw).choice.device_total_bytes
    eight = plan(cfg, workload=Workload(seq_len=64, precision="fp32", optimizer="adamw8bit"), **kw)
    eight = eight.choice.device_total_bytes
    assert adamw - eight > 16 * 2**20  # the states differ by about 24 MiB (CFG)
    # a capacity whose 95% lies between the two: AdamW does not fit, 8-bit AdamW does
    capacity = int((adamw + eight) / 2 / 0.95)
    with pytest.raises(WontFitError) as e:
        plan(cfg, workload=wl, gpu_memory=capacity, **kw)
    changes = [s.change for s in e.value.plan.suggestions]
    assert "8-bit AdamW (--optimizer adamw8bit)" in changes, changes
    assert "to fit:" in str(e.value) and "8-bit AdamW" in str(e.value)


def test_plan_after_init_process_group_leaves_the_real_group_working(tmp_path):
    cfg = tiny_config("llama")
    kw = {"gpu": "h100-sxm", "num_gpus": 2, "methods": ["ddp", "fsdp"], "global_batch": 2, "micro_batch": 1,
          "grad_checkpointing": False}
    alone = plan(cfg, **kw)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        inside = plan(cfg, **kw)
        assert dist.is_initialized() and dist.get_backend() == "gloo" and dist.get_world_size() == 1
        t = torch.ones(3)
        dist.all_reduce(t)  # the default group still runs collectives
        dist.all_reduce(t, group=group)  # and so does a subgroup made before the plan
        assert t.tolist() == [1.0, 1.0, 1.0]
        # the ColossalAI adapter plans after launch_from_torch, on the group's world size
        from llmem_plugin.integrations.colossalai import _cluster

        assert _cluster(None) == (1, 1)
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()
    assert (inside.choice.method, inside.choice.device_total_bytes) == (alone.choice.method,
                                                                         alone.choice.device_total_bytes)
    assert [(c.method, c.device_total_bytes) for c in inside.candidates] == [
        (c.method, c.device_total_bytes) for c in alone.candidates]


def test_a_failing_suggestion_search_keeps_the_wont_fit_verdict(monkeypatch):
    """An adapter stops a job on WontFitError: whatever goes wrong while
    searching for changes that would fit, the verdict is still raised."""
    from llmem_plugin.planner import explain as planner

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods import Layout
    from llmem_plugin.planner.bounds import fixed_bytes

    monkeypatch.setattr(planner, "_suggestions", broken)
    # A limit 1 MiB above what every candidate holds (below it, no change is searched at all).
    memory = int((fixed_bytes(get_gpu("h100-sxm"), Layout(num_gpus=1)) + 2**20) / 0.95) + 1
    with pytest.raises(WontFitError) as e:
        plan(tiny_config("llama"), gpu="h100-sxm", gpu_memory=memory, num_gpus=1, methods=["single"])
    msg = str(e.value)
    assert "no method fits" in msg and "the search for changes that fit failed (RuntimeError: boom)" in msg
    assert e.value.plan.suggestions == []
