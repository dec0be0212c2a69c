"""Pipeline parallelism: each rank's fake trace against a real 4-process gloo run of torch's own pipelining
runtime on CPU (the same stages, schedule and emulation), byte for byte; and the refusals."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import textwrap

import pytest

from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.methods import Layout, estimate_method
from llmem_plugin.methods.pp.method import FAST_FULL_DEPTH_LAYERS, stage_specs
from llmem_plugin.methods.pp.rank import trace_rank
from llmem_plugin.methods.pp.schedule import in_flight, stages_of_rank
from llmem_plugin.workload import Workload
from tests.conftest import tiny_config

from tests.methods._gloo import run_gloo

# One worker builds this module's module-scoped fixtures once (pyproject.toml: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("pp-gloo")

H100 = get_gpu("h100-sxm")
P, M = 4, 8
WL = Workload(seq_len=16, micro_batch_size=2, precision="fp32", optimizer="adamw")
V_OF = {"1f1b": 1, "gpipe": 1, "interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2, "interleaved-zb": 2}


def _config():
    return tiny_config("llama", num_hidden_layers=8)


# The real runs: every schedule, and 1F1B with activation checkpointing (transformers' per-layer checkpoint).
CASES = [*V_OF, "1f1b+checkpointing"]


def _case(name: str):
    schedule, _, extra = name.partition("+")
    return schedule, dataclasses.replace(WL, grad_checkpointing=extra == "checkpointing")


def _digest(trace) -> str:
    return hashlib.sha256(json.dumps([(s, n) for s, _, n in trace.events]).encode()).hexdigest()


_WORKER = textwrap.dedent("""
    import hashlib, json, os, sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.environ["REPO"])
    from llmem_plugin.models import modelbuild
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods.pp.method import stage_specs
    from llmem_plugin.methods.pp.rank import trace_rank
    from llmem_plugin.methods.pp.schedule import stages_of_rank
    from tests.methods.pp.test_pp import P, M, V_OF, _case, _config

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    for case in os.environ["SCHEDULES"].split(","):
        schedule, wl = _case(case)
        v = V_OF[schedule]
        specs = stage_specs(8, P * v)
        mine = [specs[s] for s in sorted(stages_of_rank(schedule, P, rank, v))]
        torch.manual_seed(0)
        model = modelbuild.build_model(_config(), wl, device="cpu")
        t = trace_rank(model, wl, mine, rank=rank, pipeline_degree=P, schedule=schedule, microbatches=M,
                       gpu=get_gpu("h100-sxm"), fake=False)
        out[case] = {"peak": t.peak_bytes, "phase": t.peak_phase.value,
                         "events": hashlib.sha256(json.dumps([(s, n) for s, _, n in t.events]).encode()).hexdigest()}
        dist.barrier()
    print(json.dumps(out))
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    outs = run_gloo(tmp_path_factory.mktemp("pp"), _WORKER, world=P, timeout=900,
                    env={"SCHEDULES": ",".join(CASES)})
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


@pytest.mark.parametrize("case", CASES)
def test_every_rank_equals_a_real_gloo_run(gloo_runs, case):
    schedule, wl = _case(case)
    v = V_OF[schedule]
    specs = stage_specs(8, P * v)
    for rank in range(P):
        mine = [specs[s] for s in sorted(stages_of_rank(schedule, P, rank, v))]
        fake = trace_rank(_config(), wl, mine, rank=rank, pipeline_degree=P, schedule=schedule, microbatches=M,
                          gpu=H100)
        real = gloo_runs[rank][case]
        assert (fake.peak_bytes, fake.peak_phase.value) == (real["peak"], real["phase"]), (case, rank)
        assert _digest(fake) == real["events"], (case, rank)  # every allocation and free, in order


_FSDP_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.environ["REPO"])
    from llmem_plugin.models import modelbuild
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods.pp.method import stage_specs
    from llmem_plugin.methods.pp.rank import pipeline_mesh, trace_rank
    from llmem_plugin.methods.pp.schedule import stages_of_rank
    from tests.methods._gloo_fsdp import use_gloo_collectives
    from tests.methods.pp.test_pp import FSDP_WL, P, M, DP, _config

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = pipeline_mesh(P, DP)
    specs = stage_specs(8, P)
    torch.manual_seed(0)
    model = modelbuild.build_model(_config(), FSDP_WL, device="cpu")
    t = trace_rank(model, FSDP_WL, [specs[rank // DP]], rank=rank, pipeline_degree=P, schedule="1f1b",
                   microbatches=M, gpu=get_gpu("h100-sxm"), fake=False, dp_shard=DP, mesh=mesh,
                   prepare=lambda modules: use_gloo_collectives(*modules))
    with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:  # too long for a stdout pipe
        json.dump({"peak": t.peak_bytes, "events": [[s, n] for s, _, n in t.events]}, f)
""")
DP = 2
FSDP_WL = dataclasses.replace(WL, precision="bf16-mixed")


def test_fsdp_inside_stages_equals_a_real_gloo_run(tmp_path):
    """Pipeline 4 x FSDP2 2 (torchtitan's composition, mixed precision through FSDP2's policy) on 8 real
    gloo processes: every rank's stream equals its fake trace."""
    run_gloo(tmp_path, _FSDP_WORKER, world=P * DP, timeout=900, env={"OUT": str(tmp_path)})
    specs = stage_specs(8, P)
    for rank in range(P * DP):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())
        fake = trace_rank(_config(), FSDP_WL, [specs[rank // DP]], rank=rank, pipeline_degree=P, schedule="1f1b",
                          microbatches=M, gpu=H100, dp_shard=DP)
        events = [[s, n] for s, _, n in fake.events]
        assert fake.peak_bytes == real["peak"], rank
        assert real["events"] == events, rank


_ACCUM_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.environ["REPO"])
    from llmem_plugin.models import modelbuild
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods.pp.method import stage_specs
    from llmem_plugin.methods.pp.rank import pipeline_mesh, trace_rank
    from tests.methods._gloo_fsdp import use_gloo_collectives
    from tests.methods.pp.test_pp import ACCUM, ACCUM_WL, DP, _config

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = pipeline_mesh(2, DP)
    torch.manual_seed(0)
    model = modelbuild.build_model(_config(), ACCUM_WL, device="cpu")
    t = trace_rank(model, ACCUM_WL, [stage_specs(8, 2)[rank // DP]], rank=rank, pipeline_degree=2,
                   schedule="1f1b", microbatches=4, gpu=get_gpu("h100-sxm"), fake=False, dp_shard=DP, mesh=mesh,
                   prepare=lambda modules: use_gloo_collectives(*modules), accumulation=ACCUM)
    with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
        json.dump({"peak": t.peak_bytes, "events": [[s, n] for s, _, n in t.events]}, f)
""")
ACCUM = 3
ACCUM_WL = dataclasses.replace(FSDP_WL, grad_accum_steps=ACCUM)


def test_gradient_accumulation_equals_a_real_gloo_run(tmp_path):
    """torchtitan's gradient accumulation under pipelining: 3 schedule steps (4 microbatches each) per
    optimizer step, pipeline 2 x FSDP2 2 on 4 real gloo processes; each schedule step ends in FSDP2's
    reduction into the sharded gradients, which add up. Every rank's stream equals its fake trace."""
    run_gloo(tmp_path, _ACCUM_WORKER, world=2 * DP, timeout=900, env={"OUT": str(tmp_path)})
    specs = stage_specs(8, 2)
    fakes = []
    for rank in range(2 * DP):
        real = json.loads((tmp_path / f"rank{rank}.json").read_text())
        fake = trace_rank(_config(), ACCUM_WL, [specs[rank // DP]], rank=rank, pipeline_degree=2, schedule="1f1b",
                          microbatches=4, gpu=H100, dp_shard=DP, accumulation=ACCUM)
        assert fake.peak_bytes == real["peak"], rank
        assert real["events"] == [[s, n] for s, _, n in fake.events], rank
        fakes.append(fake)
    # One more schedule step adds its inputs' allocations and frees and nothing that stays.
    shorter = trace_rank(_config(), ACCUM_WL, [specs[0]], rank=0, pipeline_degree=2, schedule="1f1b", microbatches=4,
                         gpu=H100, dp_shard=DP, accumulation=ACCUM - 1)
    assert shorter.peak_bytes == fakes[0].peak_bytes


def _live_before_first_backward(schedule, m):
    """Tensor bytes live on rank 0 when its first backward starts (first step)."""
    specs = stage_specs(8, P)
    t = trace_rank(_config(), WL, [specs[0]], rank=0, pipeline_degree=P, schedule=schedule, microbatches=m,
                   gpu=H100)
    return sum(sign * n for sign, _, n in t.events[:t.marks["B:0:0:backward"]])


def test_gpipe_holds_every_microbatch_and_1f1b_its_warmup():
    """When rank 0's first backward starts, GPipe has run all M forwards and 1F1B its P warm-up ones
    (torch's loop: min(M, P - stage)). One more microbatch adds, to 1F1B there, one gradient receive buffer
    (PipelineStage makes one per microbatch) and a longer input batch; to GPipe also one more chunk. So the
    two differ by (M - P) chunks."""
    def rounded(n):  # the CUDA allocator's 512-byte blocks (round_allocation)
        return -(-n // 512) * 512

    assert len(in_flight("gpipe", P, M)[0]) == M and len(in_flight("1f1b", P, M)[0]) == P
    rows = WL.micro_batch_size
    grad_buffer = rounded(rows * WL.seq_len * _config().hidden_size * 4)  # fp32 [mbs, S, h]
    longer_input = rounded((M + 1) * rows * WL.seq_len * 8) - rounded(M * rows * WL.seq_len * 8)  # int64 ids
    one_f_one_b = _live_before_first_backward("1f1b", M)
    assert _live_before_first_backward("1f1b", M + 1) - one_f_one_b == grad_buffer + longer_input
    gpipe = _live_before_first_backward("gpipe", M)
    chunk = _live_before_first_backward("gpipe", M + 1) - gpipe - grad_buffer - longer_input
    assert chunk > 0
    assert gpipe - one_f_one_b == (M - P) * chunk


def test_estimate_reports_every_rank_with_its_communicators():
    """Every rank is reported. Outside the allocator each rank holds the CUDA context and NCCL's buffers of a
    2-rank communicator per peer rank plus the pipeline group's (overheads.nccl_buffer_bytes): the end ranks
    of 1F1B have one peer, the middle ones two; under interleaving every rank has two peers, even though
    rank 1's stages 1 and 5 border four stages."""
    from llmem_plugin.device.overheads import nccl_buffer_bytes

    est = estimate_method("pp", _config(), WL, layout=Layout(num_gpus=P), gpu=H100, microbatches=M)
    assert [r.rank for r in est.ranks] == list(range(P))
    assert "rank 0: 4" in est.notes[1] and "rank 3: 1" in est.notes[1]
    outside = [r.device_total_bytes - r.peak_reserved_bytes for r in est.ranks]
    assert outside[1] - outside[0] == nccl_buffer_bytes(2) and outside[0] == outside[3] and outside[1] == outside[2]
    looped = estimate_method("pp-interleaved", _config(), WL, layout=Layout(num_gpus=P), gpu=H100, microbatches=M)
    assert all(r.device_total_bytes - r.peak_reserved_bytes == outside[1] for r in looped.ranks)
    # torchtitan's config fields for the same job (torchtitan/config/configs.py at b5bcd76): a microbatch of
    # 2 rows of 16 tokens is one buffer of 32.
    assert est.notes[2] == ('torchtitan (b5bcd76): parallelism.pipeline_parallel_degree = 4, '
                            'parallelism.pipeline_parallel_schedule = "1F1B", parallelism.num_pp_microbatches = 8, '
                            'parallelism.data_parallel_shard_degree = 1, '
                            'training.num_tokens_per_microbatch_per_dp_rank = 32, training.max_context_length = 16')


def test_fsdp_inside_stages_is_reported_per_pipeline_rank():
    """8 GPUs, pipeline degree 4: FSDP2 over each stage's 2 ranks. The traced ranks are each pipeline rank's
    first shard rank (and its last where shards are uneven: the tiny vocabulary and widths divide by 2, so
    none here); the stage's gather and reduce volumes are FSDP2's ring over 2 ranks."""
    est = estimate_method("pp", _config(), FSDP_WL, layout=Layout(num_gpus=P * DP), gpu=H100, pipeline_degree=P,
                          microbatches=M)
    assert [r.rank for r in est.ranks] == [0, 2, 4, 6]
    assert "FSDP2-sharded over 2 ranks" in est.notes[0]
    rank2 = trace_rank(_config(), FSDP_WL, [stage_specs(8, P)[1]], rank=2, pipeline_degree=P, schedule="1f1b",
                       microbatches=M, gpu=H100, dp_shard=DP)
    assert est.ranks[1].peak_tensor_bytes == rank2.peak_bytes
    with pytest.raises(ConfigError, match="pipeline degree 3"):
        estimate_method("pp", _config(), FSDP_WL, layout=Layout(num_gpus=8), gpu=H100, pipeline_degree=3)


@pytest.mark.parametrize("kwargs,layout,error,match", [
    ({"microbatches": 3}, Layout(num_gpus=4), ConfigError, "at least as many microbatches as pipeline stages"),
    ({"microbatches": 300, "compose": False}, Layout(num_gpus=4), UnsupportedError, "above 256"),
    ({"split": [4, 0, 0, 4]}, Layout(num_gpus=4), ConfigError, "middle stage without decoder layers"),
    ({"stages_per_rank": 2}, Layout(num_gpus=4), ConfigError, "one stage per rank"),
    ({"pipeline_degree": 2}, Layout(num_gpus=8, tp=4), ConfigError, "--tp 4 does not divide"),
    ({"pipeline_degree": 3}, Layout(num_gpus=8, tp=2), ConfigError, "pipeline degree 3 x --tp 2"),
    ({}, Layout(num_gpus=1), ConfigError, "at least 2"),
    ({"microbatches": 0}, Layout(num_gpus=4), ConfigError, "microbatches"),
    ({"split": [1, 1, 1, 1]}, Layout(num_gpus=4), ConfigError, "summing to the model's 8 layers"),
    ({"split": "deepspeed"}, Layout(num_gpus=4), ConfigError, "torchtitan, colossalai"),
])
def test_refusals(kwargs, layout, error, match):
    with pytest.raises(error, match=match):
        estimate_method("pp", _config(), WL, layout=layout, gpu=H100, **kwargs)


@pytest.mark.parametrize("change,match", [({"precision": "bf16-mixed"}, "autocast"),
                                          ({"loss": "chunked"}, "--loss chunked"),
                                          ({"reference_model": True}, "--reference-model"),
                                          ({"runner": "hf-trainer"}, "--runner hf-trainer"),
                                          ({"attn_implementation": "eager"}, "--attn eager"),
                                          ({"logits_to_keep": 1}, "--logits-to-keep"),
                                          ({"outputs_to_fp32": True}, "outputs cast to fp32"),
                                          ({"optimizer": "adamw8bit"}, "adamw8bit")])
def test_workload_refusals(change, match):
    wl = dataclasses.replace(WL, **change)
    with pytest.raises((ConfigError, UnsupportedError), match=match):
        estimate_method("pp", _config(), wl, layout=Layout(num_gpus=4), gpu=H100)


@pytest.mark.parametrize("schedule,layers,split", [
    ("1f1b", 14, [4, 4, 3, 3]),
    ("interleaved-1f1b", 25, [3, 3, 3, 4, 3, 3, 3, 3]),  # rank 3 holds stages 3 (4 layers) and 7 (3)
])
def test_fast_extrapolates_each_rank_over_its_stage_depth(schedule, layers, split):
    """Fast mode traces each rank's stages at 1 and 2 layers and extrapolates: equal to the full trace where
    a rank's stages are equally deep (tensor bytes to a 512-byte block, the allocator's replay within 0.05%);
    where they
    differ, the shallower one is taken as deep as the other, so it is above, never below."""
    cfg = tiny_config("llama", num_hidden_layers=layers)
    wl = dataclasses.replace(WL, seq_len=32, precision="bf16")
    full, fast = (estimate_method(f"pp{'' if schedule == '1f1b' else '-interleaved'}", cfg, wl,
                                  layout=Layout(num_gpus=P), gpu=H100, microbatches=M, split=split, fast=f)
                  for f in (False, True))
    assert "fast:" in fast.notes[-1]
    deep = []
    for a, b in zip(full.ranks, fast.ranks):
        depths = {split[s] for s in stages_of_rank(schedule, P, a.rank, V_OF[schedule])}
        equal = len(depths) == 1
        if max(depths) <= FAST_FULL_DEPTH_LAYERS:  # traced whole: the same trace as the full estimate's
            assert (b.peak_tensor_bytes, b.peak_allocated_bytes, b.peak_reserved_bytes) == (
                a.peak_tensor_bytes, a.peak_allocated_bytes, a.peak_reserved_bytes), a.rank
            continue
        deep.append(a.rank)
        if equal:  # a 512-byte block of rounding may fall either way
            assert abs(b.peak_tensor_bytes - a.peak_tensor_bytes) <= 512, a.rank
            assert abs(b.peak_allocated_bytes / a.peak_allocated_bytes - 1) < 5e-4, a.rank
        else:
            assert b.peak_tensor_bytes > a.peak_tensor_bytes and b.peak_allocated_bytes > a.peak_allocated_bytes
    assert deep and fast.notes[-1].startswith(f"fast: ranks {deep} traced with their stages at 1 and 2")


def test_checkpoint_patterns_and_reentrant_zero_bubble_are_refused():
    wl = dataclasses.replace(WL, grad_checkpointing=True, checkpoint_every=2)
    with pytest.raises(UnsupportedError, match="--fast and --checkpoint-every"):
        estimate_method("pp", _config(), wl, layout=Layout(num_gpus=P), gpu=H100, fast=True)
    wl = dataclasses.replace(WL, grad_checkpointing=True, checkpoint_reentrant=True)
    with pytest.raises(UnsupportedError, match="reentrant checkpointing"):
        estimate_method("pp-zbv", _config(), wl, layout=Layout(num_gpus=P), gpu=H100)


@pytest.mark.parametrize("config,seq_len,match", [
    (tiny_config("gpt2"), 16, "model type 'gpt2'"),
    (tiny_config("mixtral"), 16, "model type 'mixtral'"),
    (tiny_config("qwen2", use_sliding_window=True, sliding_window=8), 16, "sliding window \\(8\\)"),
])
def test_other_architectures_are_refused(config, seq_len, match):
    with pytest.raises(UnsupportedError, match=match):
        estimate_method("pp", config, dataclasses.replace(WL, seq_len=seq_len, precision="bf16"),
                        layout=Layout(num_gpus=2), gpu=H100)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stages_compute_what_the_model_computes(arch):
    """The stages, run one after another on real tensors, give the model's own logits: DecoderStage calls the
    layers as the model's forward does (an independent check of the stage code the traces run)."""
    import torch

    from llmem_plugin.models import modelbuild
    from llmem_plugin.methods.pp.stage import stage_modules

    cfg = tiny_config(arch, num_hidden_layers=5)
    wl = dataclasses.replace(WL, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = modelbuild.build_model(cfg, wl, device="cpu").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    h = ids
    with torch.no_grad():
        for stage in stage_modules(model, stage_specs(5, 3, split=[1, 3, 1])):
            h = stage(h)
        want = model(input_ids=ids).logits
    torch.testing.assert_close(h, want)


def test_torchtitan_fields_give_its_trainer_the_same_accumulation():
    """torchtitan/trainer.py at b5bcd76: gradient_accumulation_steps = num_tokens_per_train_step //
    (num_tokens_per_microbatch_per_dp_rank x num_pp_microbatches x data-parallel degree)."""
    from llmem_plugin.methods.pp.method import torchtitan_sections

    text = torchtitan_sections(pipeline_degree=16, dp_shard=8, schedule="1f1b", microbatches=64, micro_batch_size=1,
                               seq_len=2048, tp=4, accumulation=8)
    fields = dict(f.split(" = ") for f in text.split(", "))
    tokens = int(fields["training.num_tokens_per_microbatch_per_dp_rank"])
    m, dp = int(fields["parallelism.num_pp_microbatches"]), int(fields["parallelism.data_parallel_shard_degree"])
    assert tokens == 2048 and int(fields["training.max_context_length"]) == 2048
    assert int(fields["training.num_tokens_per_train_step"]) // (tokens * m * dp) == 8
    assert fields["parallelism.enable_sequence_parallel"] == "false"  # torchtitan's default is on
