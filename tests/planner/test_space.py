"""Enumerate (llmem_plugin.planner.space): the configurations a plan searches, against the closed form of
the space in docs/planner.md, and the micro-batches and pipeline splits of each."""

from __future__ import annotations

import pytest
import transformers

from llmem_plugin.errors import ConfigError
from llmem_plugin.planner.candidates import _Config
from llmem_plugin.planner.search import _context
from llmem_plugin.planner.space import (
    _micro_batch_plan,
    _micro_batches,
    _pipeline_splits,
    enumerate_configs,
)
from llmem_plugin.workload import Workload

WL = Workload(seq_len=32, precision="fp32", optimizer="adamw")
# The methods without tensor or pipeline parallelism that run on one node of several GPUs (hsdp needs two).
PLAIN = ["ddp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "fsdp", "fsdp-offload", "gemini",
         "lowlevel-zero1", "lowlevel-zero2"]
# Tensor-parallel methods that keep data parallelism beside TP.
DP_TP = ["dp-tp", "fsdp-tp", "hybrid", "hybrid-zero1"]


def llama(*, heads: int = 8, kv_heads: int = 4, intermediate: int = 256, layers: int = 4):
    return transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=intermediate,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                    max_position_embeddings=512)


def context(model, *, num_gpus: int, num_nodes: int = 1, global_batch: int | None = None, workload: Workload = WL,
            gpu_memory: int | None = None):
    """The plan's context, as plan() builds it (5% margin, the catalog's host)."""
    ctx, _ = _context(model, gpu="h100-sxm", gpu_memory=gpu_memory, num_gpus=num_gpus, num_nodes=num_nodes,
                      workload=workload, global_batch=global_batch, margin=0.05, alloc_conf=None, efficiency=0.4,
                      inter_node_gbps=None, host_memory=None)
    return ctx


def closed_form(*, n: int, per_node: int, heads: int, kv_heads: int, intermediate: int, layers: int,
                methods: list[str]) -> set[tuple[str, int, int]]:
    """(method, tp, pp) of the space as docs/planner.md states it: TP degrees divide a node's GPUs and the
    model's heads, KV heads and MLP width; `tp` takes the whole cluster, the others leave data parallelism;
    pipelines p >= 2 with p x v stages over the layers and p x tp dividing the GPUs."""
    def splits(d):
        return heads % d == 0 and kv_heads % d == 0 and intermediate % d == 0

    degrees = [d for d in range(2, per_node + 1) if per_node % d == 0 and splits(d)]
    out = set()
    for m in methods:
        if m in PLAIN or (m == "hsdp" and n > per_node):
            out.add((m, 1, 1))
        elif m == "tp":
            out |= {(m, n, 1)} if n in degrees else set()
        elif m in DP_TP:
            out |= {(m, d, 1) for d in degrees if d < n}
        elif m in ("pp", "pp-interleaved"):
            v = 2 if m == "pp-interleaved" else 1
            out |= {(m, d, p) for d in [1, *degrees] for p in range(2, n // d + 1) if n % (p * d) == 0
                    and p * v <= layers}
    return out


@pytest.mark.parametrize("n,nodes", [(8, 1), (16, 2)])
def test_the_default_space_is_the_closed_form(n, nodes):
    model = llama()
    configs, skipped = enumerate_configs(context(model, num_gpus=n, num_nodes=nodes), None, None)
    got = [(c.method, c.tp, c.pp) for c in configs]
    expected = closed_form(n=n, per_node=8, heads=8, kv_heads=4, intermediate=256, layers=4,
                           methods=[*PLAIN, "hsdp", "tp", *DP_TP, "pp"])
    assert len(got) == len(set(got)) and set(got) == expected
    if n == 8:
        # 8 GPUs: 11 plain methods, 4 x TP 2 and 4, pipelines 2 and 4 (TP 1 and 2) and 2 (TP 4).
        assert len(got) == 11 + 4 * 2 + 5
        # TP 8 does not divide 4 KV heads: `tp` (the whole node) and the pipelines' TP 8 are listed with why.
        assert {label for label, _ in skipped} == {"hsdp", "tp tp8", "pp tp8"}
    else:
        # Two nodes: hsdp joins; `tp` would span them, so no configuration takes it.
        assert ("hsdp", 1, 1) in got and not any(m == "tp" for m, _, _ in got)


def test_named_interleaved_pipelines_need_two_layers_per_rank():
    configs, _ = enumerate_configs(context(llama(), num_gpus=8), ["pp-interleaved"], [1])
    # Two stages per rank over 4 layers: only pipeline 2 has a layer per stage.
    assert [(c.method, c.tp, c.pp) for c in configs] == [("pp-interleaved", 1, 2)]


def test_one_gpu_runs_single_and_the_offload_methods():
    configs, _ = enumerate_configs(context(llama(), num_gpus=1), None, None)
    assert [c.method for c in configs] == ["single", "zero2-offload", "zero3-offload", "fsdp-offload"]


def test_a_layout_no_method_runs_on_is_one_line_naming_each_method():
    with pytest.raises(ConfigError) as e:
        enumerate_configs(context(llama(), num_gpus=1), ["zero1", "tp"], None)
    assert str(e.value).startswith("no method of --methods zero1,tp applies to 1 GPU: zero1 needs at least 2 GPUs")
    assert "tp needs at least 2 GPUs to split the layers over" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown method 'zero4'"):
        enumerate_configs(context(llama(), num_gpus=2), ["zero4"], None)


@pytest.mark.parametrize("per_rank,pinned,expected", [
    (12, None, [1, 2, 4, 12]),  # powers of two that divide the share, and the share itself
    (16, None, [1, 2, 4, 8, 16]),
    (6, 3, [3]),
    (6, 4, []),
])
def test_micro_batches_divide_the_per_rank_share(per_rank, pinned, expected):
    assert _micro_batches(per_rank, pinned) == expected


def test_each_micro_batch_times_its_accumulation_is_the_share():
    ctx = context(llama(), num_gpus=8, global_batch=96)
    per_rank, mbs = _micro_batch_plan(ctx, _Config("dp-tp", 2), None)
    assert (per_rank, mbs) == (96 // 4, [1, 2, 4, 8, 24])


def test_pipeline_splits_halve_while_two_microbatches_per_stage_remain():
    ctx = context(llama(), num_gpus=8, global_batch=64)
    # Pipeline 2 over 8 GPUs: 4 data-parallel ranks, 16 one-row microbatches each; halved while >= 2 x 2 remain.
    assert _pipeline_splits(ctx, _Config("pp", 1, 2)) == [(16, 1), (8, 2), (4, 4)]
    # Pipeline 4 x TP 2: one data-parallel rank with all 64; halved while >= 8 remain.
    assert _pipeline_splits(ctx, _Config("pp", 2, 4)) == [(64, 1), (32, 2), (16, 4), (8, 8)]
