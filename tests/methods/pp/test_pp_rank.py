"""The stage wrapping of llmem_plugin.methods.pp.rank: tensor parallel then FSDP2 inside a stage, as torchtitan
applies them, each parameter's local shard against the plan's closed form."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin.methods._fakepg import fake_process_group
from llmem_plugin.methods._rank_tracker import RankTracker
from llmem_plugin.methods.pp.method import stage_specs
from llmem_plugin.methods.pp.rank import _distributed_stages, pipeline_mesh
from llmem_plugin.models import modelbuild
from llmem_plugin.workload import Workload
from tests.conftest import tiny_config

WL = Workload(seq_len=16, micro_batch_size=2, precision="fp32", optimizer="adamw")
MIXED = dataclasses.replace(WL, precision="bf16-mixed")


@pytest.mark.parametrize("dp,tp,workload", [(1, 2, WL), (2, 1, MIXED), (2, 2, MIXED)])
def test_distributed_stages_shard_as_the_plan_says(dp, tp, workload):
    """The tiny Llama (vocabulary 512, hidden 64, 2 KV heads of 16): TP splits q_proj's rows and o_proj's
    columns and the embedding's vocabulary; FSDP2 then splits dim 0 of each TP-local tensor by ``dp``."""
    with fake_process_group(world_size=2 * dp * tp, rank=0):
        mesh = pipeline_mesh(2, dp, tp)
        built = modelbuild.build_model(tiny_config("llama"), workload, device="meta")
        fake_mode = FakeTensorMode()
        prepared = []
        modules, contexts, extra = _distributed_stages(built, workload, [stage_specs(2, 2)[0]], RankTracker(fake_mode),
                                                       fake_mode=fake_mode, mesh=mesh, dp_shard=dp, tp=tp,
                                                       prepare=prepared.append)
    stage = modules[0]

    def local(weight):
        return tuple(weight._local_tensor.shape)

    assert local(stage.layers[0].self_attn.q_proj.weight) == (64 // tp // dp, 64)
    assert local(stage.layers[0].self_attn.o_proj.weight) == (64 // dp, 64 // tp)
    assert local(stage.embed_tokens.weight) == (512 // tp // dp, 64)
    assert prepared == [modules]
    assert "step" in extra  # the local-shard optimizer step, on fake tensors
    # FSDP2 adds its instrumentation, and its mixed precision computes in bf16.
    assert len(contexts) == (3 if dp > 1 else 2)
    assert extra.get("activation_dtype") == (torch.bfloat16 if dp > 1 else None)
