"""The pipeline method's steps (llmem_plugin.methods.pp.method): each against a closed form, or, for the
steps that trace, against the whole estimate's rank."""

from __future__ import annotations

import dataclasses

import pytest

from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.methods.pp.compose import VirtualPipeline
from llmem_plugin.methods.pp.method import (
    _comm_bytes,
    _communicator_sizes,
    _default_ranks,
    _how_notes,
    _rank_numbers,
    _rank_outcomes,
    _rank_stages,
    _RankOutcome,
    _resolve_job,
    _split_stages,
    _stand_in,
    _too_many,
)
from llmem_plugin.methods.pp.rank import trace_rank
from llmem_plugin.workload import Workload
from tests.conftest import tiny_config

H100 = get_gpu("h100-sxm")
WL = Workload(seq_len=16, micro_batch_size=2, precision="fp32", optimizer="adamw")
MIXED = dataclasses.replace(WL, precision="bf16-mixed")

# The tiny Llama's parameters (tests/conftest.py: vocabulary 512, hidden 64, MLP 160, 4 heads of 16, 2 KV
# heads): q and o 64 x 64, k and v 64 x 32, gate, up and down 64 x 160, two norms of 64.
LAYER_NUMEL = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160 + 2 * 64
EMBED_NUMEL = 512 * 64  # the head is as large (untied)


def _config(layers: int = 8):
    return tiny_config("llama", num_hidden_layers=layers)


def _job(layout: Layout, workload: Workload = WL, **kwargs):
    args = dict(gpu=H100, alloc_conf=None, preset="pp", schedule="1f1b", pipeline_degree=None, microbatches=None,
                stages_per_rank=None, split="torchtitan", return_outputs=True, fast=False, compose=True,
                stand_in_steps=None, placeholders=True)
    return _resolve_job(workload, layout=layout, **{**args, **kwargs})


def test_resolve_job_takes_the_degrees_from_the_layout():
    job = _job(Layout(num_gpus=4))
    assert (job.degree, job.dp, job.tp, job.inner, job.microbatches, job.stages_per_rank) == (4, 1, 1, 1, 4, 1)
    # 8 GPUs, TP 2, pipeline 2: the other factor 2 shards each stage with FSDP2.
    job = _job(Layout(num_gpus=8, tp=2), MIXED, pipeline_degree=2, microbatches=6)
    assert (job.degree, job.dp, job.tp, job.inner, job.microbatches) == (2, 2, 2, 4, 6)
    assert _job(Layout(num_gpus=2), schedule="interleaved-1f1b").stages_per_rank == 2
    assert _job(Layout(num_gpus=2), schedule="zbv").stages_per_rank == 2


def test_resolve_job_keeps_the_chunks_in_flight_of_torchs_loops():
    # Schedule1F1B: stage s runs min(m, p - s) warm-up forwards; GPipe runs every forward first.
    job = _job(Layout(num_gpus=4), microbatches=8)
    assert [len(chunks) for chunks in job.flight] == [min(8, 4 - s) for s in range(4)]
    job = _job(Layout(num_gpus=4), microbatches=8, schedule="gpipe")
    assert [len(chunks) for chunks in job.flight] == [8] * 4


def test_resolve_job_refuses_in_the_order_the_user_meets_it():
    # A bad degree comes before the precision it would also refuse.
    with pytest.raises(ConfigError, match="pipeline degree 3"):
        _job(Layout(num_gpus=4), MIXED, pipeline_degree=3)
    with pytest.raises(UnsupportedError, match="autocast around a pipeline schedule"):
        _job(Layout(num_gpus=4), MIXED)
    with pytest.raises(ConfigError, match="at least as many microbatches as pipeline stages"):
        _job(Layout(num_gpus=4), microbatches=2)
    with pytest.raises(UnsupportedError, match="traces every microbatch"):
        _job(Layout(num_gpus=2), microbatches=4096, compose=False)
    with pytest.raises(UnsupportedError, match="--attn eager"):
        _job(Layout(num_gpus=2), dataclasses.replace(WL, attn_implementation="eager"), schedule="nope")


@pytest.mark.parametrize("layers,stages,counts", [
    # torchtitan's split counts the embedding and the head as one layer each: L + 2 = S x k layers give the
    # end stages k - 1 decoder layers and the middle ones k.
    (6, 4, [1, 2, 2, 1]),
    (10, 4, [2, 3, 3, 2]),
    (8, 2, [4, 4]),
])
def test_split_stages_gives_torchtitans_layer_counts(layers, stages, counts):
    job = _job(Layout(num_gpus=stages))
    _, base, specs = _split_stages(_config(layers), job)
    assert [s.stop - s.start for s in specs] == counts
    assert [s.start for s in specs] == [sum(counts[:i]) for i in range(stages)]
    assert base.config.num_hidden_layers == layers


def test_split_stages_places_v_stages_per_rank():
    job = _job(Layout(num_gpus=2), schedule="zbv")
    _, _, specs = _split_stages(_config(6), job)
    assert [s.stop - s.start for s in specs] == [1, 2, 2, 1]
    # The V: rank 0 holds the first and the last stage, rank 1 the two middle ones.
    assert [s.index for s in _rank_stages(job, specs, 0)] == [0, 3]
    assert [s.index for s in _rank_stages(job, specs, 1)] == [1, 2]


def test_default_ranks_adds_the_last_shard_where_fsdp2_pads():
    # Pipeline 2 over 4 GPUs: FSDP2 over 2, which divides every dim 0 of the tiny model: one rank each.
    job = _job(Layout(num_gpus=4), MIXED, pipeline_degree=2)
    _, base, specs = _split_stages(_config(), job)
    assert _default_ranks(job, base, specs) == [0, 2]
    # Over 3 the vocabulary (512) is uneven: the last shard rank of each pipeline rank too.
    job = _job(Layout(num_gpus=6), MIXED, pipeline_degree=2)
    _, base, specs = _split_stages(_config(), job)
    assert _default_ranks(job, base, specs) == [0, 2, 3, 5]


def test_communicator_sizes_count_the_pipeline_peers():
    job = _job(Layout(num_gpus=4))
    _, _, specs = _split_stages(_config(), job)
    # 1F1B: the end ranks have one peer, the middle ones two; then the pipeline group of 4.
    assert [_communicator_sizes(job, specs, r) for r in range(4)] == [(2, 4), (2, 2, 4), (2, 2, 4), (2, 4)]
    job = _job(Layout(num_gpus=4), schedule="interleaved-1f1b")
    _, _, specs = _split_stages(_config(), job)
    assert {_communicator_sizes(job, specs, r) for r in range(4)} == {(2, 2, 4)}
    # With FSDP2 over 2 and TP 2: one peer, the pipeline group of 2, the FSDP2 group, the TP group.
    job = _job(Layout(num_gpus=8, tp=2), MIXED, pipeline_degree=2)
    _, _, specs = _split_stages(_config(), job)
    assert _communicator_sizes(job, specs, 4) == (2, 2, 2, 2)


def test_stand_in_is_none_where_the_rank_is_traced_whole():
    job = _job(Layout(num_gpus=2), dataclasses.replace(WL, grad_accum_steps=4), microbatches=2)
    _, _, specs = _split_stages(_config(), job)
    # Two microbatches leave no smaller pipeline, but 4 schedule steps: rank 0 stands in for itself.
    assert _stand_in(job, _rank_stages(job, specs, 0), 0) == VirtualPipeline(2, 0, (2, 2))
    # The last stage's logits (return_outputs) and compose=False trace in full.
    assert _stand_in(job, _rank_stages(job, specs, 1), 1) is None
    off = dataclasses.replace(job, compose=False)
    assert _stand_in(off, _rank_stages(off, specs, 0), 0) is None


def test_too_many_names_the_pipeline_rank_and_the_fix():
    job = _job(Layout(num_gpus=4, tp=2), pipeline_degree=2, microbatches=40)
    err = _too_many(job, 3, holds_logits=True)
    assert "pipeline rank 1 holds the last stage's logits" in str(err)
    assert "tracing all 40 microbatches" in str(err) and "--no-return-outputs" in str(err)
    assert "--no-return-outputs" not in str(_too_many(job, 0, holds_logits=False))


def test_how_notes_list_each_rank_once_where_sorted():
    job = _job(Layout(num_gpus=4), fast=True)
    outcomes = [_RankOutcome(None, composed=True, synthesised=False, extrapolated=True),
                _RankOutcome(None, composed=False, synthesised=True, extrapolated=False),
                _RankOutcome(None, composed=True, synthesised=False, extrapolated=True)]
    notes = _how_notes(job, [3, 0, 3], outcomes)
    assert notes[0].startswith("composed: ranks [3] from short runs")
    assert notes[1].startswith("synthesised: ranks [0]' stand-in runs")
    assert notes[2].startswith("fast: ranks [3, 3] traced with their stages at 1 and 2")
    assert _how_notes(job, [0], [_RankOutcome(None, False, False, False)]) == [
        "fast: every rank traced at full depth (stages of at most 3 layers cost no more than the two shortened "
        "runs)"]


def test_comm_bytes_are_the_p2p_and_fsdp2_ring_volumes():
    # Pipeline 2 x FSDP2 2 in bf16-mixed: activations pass in bf16 (2 bytes). P2P: each of m = 2 microbatches'
    # 2 x 16 x 64 activations forward and gradients back. FSDP2: the larger stage (4 layers, norm and head)
    # gathered in bf16 and reduced in fp32 once per schedule step, (dp - 1) / dp of each.
    job = _job(Layout(num_gpus=4), MIXED, pipeline_degree=2)
    _, base, specs = _split_stages(_config(), job)
    p2p = 2 * 2 * 16 * 64 * 2 * 2
    fsdp = (4 * LAYER_NUMEL + 64 + EMBED_NUMEL) * (2 + 4) // 2
    assert _comm_bytes(job, base, specs) == (fsdp + p2p, 0)
    # Two nodes of 2: the FSDP2 groups stay inside a node, the pipeline's neighbours cross.
    job = _job(Layout(num_gpus=4, num_nodes=2), MIXED, pipeline_degree=2)
    assert _comm_bytes(job, base, specs) == (fsdp, p2p)


def test_rank_outcomes_are_the_whole_estimates_ranks():
    """The per-rank step on its own gives the estimate's numbers, and its tensor peak is the rank's trace's."""
    config = _config(2)
    est = estimate_method("pp", config, WL, layout=Layout(num_gpus=2), gpu=H100, microbatches=2)
    job = _job(Layout(num_gpus=2), microbatches=2)
    probe, base, specs = _split_stages(config, job)
    outcomes = _rank_outcomes(config, job, probe, base, specs, [1, 0], torch_version=None, stand_ins=None)
    assert [o.memory for o in outcomes] == [est.ranks[1], est.ranks[0]]
    assert not any(o.composed or o.extrapolated for o in outcomes)
    trace = trace_rank(config, WL, [specs[1]], rank=1, pipeline_degree=2, schedule="1f1b", microbatches=2, gpu=H100)
    assert outcomes[0].memory.peak_tensor_bytes == trace.peak_bytes
    with pytest.raises(ConfigError, match="rank 2 is not a rank of the 2 GPUs"):
        _rank_outcomes(config, job, probe, base, specs, [2], torch_version=None, stand_ins=None)


def test_rank_numbers_extrapolates_deep_stages_in_fast_mode():
    """Stages of 4 layers, over the full-depth threshold of 3: the step on its own extrapolates from the two
    shortened runs, to the whole fast estimate's numbers for that rank."""
    from llmem_plugin.device.overheads import device_overheads
    from llmem_plugin.estimate import uses_cublaslt

    config = _config(8)
    est = estimate_method("pp", config, WL, layout=Layout(num_gpus=2), gpu=H100, microbatches=2, fast=True)
    job = _job(Layout(num_gpus=2), microbatches=2, fast=True)
    probe, base, specs = _split_stages(config, job)
    overheads = device_overheads(H100.compute_capability, torch_version=None, uses_cublaslt=uses_cublaslt(probe),
                                 nccl_world_sizes=_communicator_sizes(job, specs, 0))
    got = _rank_numbers(config, job, base, _rank_stages(job, specs, 0), rank=0, overheads=overheads, cache={})
    assert got.extrapolated and not got.composed
    assert got.memory == est.ranks[0]
    assert any(n.startswith("fast: ranks [0, 1] traced with their stages at 1 and 2") for n in est.notes)
