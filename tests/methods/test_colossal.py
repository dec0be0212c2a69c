"""ColossalAI plugins modelled over a traced step (llmem_plugin.methods.colossal).

Checked against:

* Gemini's chunk search (zero/gemini/chunk/search_utils.py
  ``search_chunk_configuration``) worked by hand on a small size list, and,
  where ``colossalai`` imports, against ColossalAI's own function on a small
  module under a fake process group;
* closed forms of the partitioning: Gemini's fp32 master = 4 B x padded
  chunk elements / dp, Adam m + v = 8 B per real element of the rank's shard,
  16-bit chunk shards; LowLevelZero's ``ceil(numel / dp)`` slices per param
  (stage 2 keeps 2 B per slice of gradients, stage 1 the whole flat buffers);
* the buffers the trace allocates (the same labels :func:`breakdown` uses)
  at their highest live bytes, against those closed forms;
* ring volumes for the per-step communication.
"""

from __future__ import annotations

import importlib
from collections import defaultdict

import pytest

from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.methods import colossal
from llmem_plugin.methods.layout import Layout
from llmem_plugin.methods._zero_buffers import ZeroCategory
from llmem_plugin.trace.tracker import MemoryCategory as C
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config

H100 = get_gpu("h100-sxm")
WL = Workload(seq_len=16, micro_batch_size=1, precision="bf16-mixed")
MEGA = 1024 ** 2
# Small chunks for the tiny model (150k parameters): several sharded chunks.
SMALL_CHUNKS = {"min_chunk_size_m": 4096 / MEGA, "search_range_m": 8192 / MEGA, "hidden_dim": 64}


def _search_utils():
    try:
        return importlib.import_module("colossalai.zero.gemini.chunk.search_utils")
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        pytest.skip(f"colossalai not importable ({type(e).__name__}: {e}); for this comparison: "
                    "pip install --no-deps colossalai==0.5.0 galore-torch contexttimer bitsandbytes")


def _trace(preset: str, *, dp: int = 2, wl: Workload = WL, **options):
    """Trace rank 0; return the trace, the Buffers and the emulator."""
    from llmem_plugin.methods._colossal_buffers import Gemini, LowLevelZero

    settings = {**colossal.PRESETS[preset], **options}
    plugin, stage = settings.pop("plugin"), settings.pop("stage", 2)
    layout = Layout(num_gpus=dp)
    meta, dtype, kind = colossal._setup(tiny_config("llama"), wl, layout, plugin, settings)
    if plugin == "gemini":
        chunks = colossal._gemini_chunks(meta, dp, settings)

        def make(buf, m, params):
            return Gemini(buf, m, params, chunks=chunks, dp=dp, rank=0)
    else:
        def make(buf, m, params):
            return LowLevelZero(buf, m, params, stage=stage, dp=dp, bucket=colossal.bucket_elems(settings),
                                overlap=settings.get("overlap_communication", True), optimizer=kind,
                                grad_accum_steps=wl.grad_accum_steps)
    return colossal._trace_rank(meta, wl, make_emulator=make, dtype=dtype, gpu=H100, capacity=H100.capacity_bytes)


def _max_live(trace, buf) -> dict:
    cur, top = defaultdict(int), defaultdict(int)
    for sign, idx, nbytes in trace.events:
        if idx in buf.labels:
            cur[buf.labels[idx]] += sign * nbytes
            top[buf.labels[idx]] = max(top[buf.labels[idx]], cur[buf.labels[idx]])
    return top


def _params(model=None):
    meta = colossal._setup(model or tiny_config("llama"), WL, Layout(num_gpus=1), "lowlevel", {})[0]
    return colossal.unique_params(meta)


# ------------------------------------------------------------------ registry
def test_presets():
    assert colossal.PRESETS == {"gemini": {"plugin": "gemini"}, "lowlevel-zero1": {"plugin": "lowlevel", "stage": 1},
                                "lowlevel-zero2": {"plugin": "lowlevel", "stage": 2}}


@pytest.mark.parametrize("preset", list(colossal.PRESETS))
def test_tensor_parallel_degree_is_refused(preset):
    with pytest.raises(ConfigError, match="tp must be 1"):
        colossal.estimate(tiny_config("llama"), WL, layout=Layout(num_gpus=4, tp=2), gpu=H100, preset=preset,
                          **colossal.PRESETS[preset])


@pytest.mark.parametrize(("wl", "options", "error", "match"), [
    (Workload(seq_len=16, precision="bf16-mixed", lora=LoraSpec(rank=4)), {}, UnsupportedError, "support_lora"),
    (Workload(seq_len=16, precision="bf16-mixed", grad_accum_steps=2), {}, UnsupportedError, "reuse_fp16_chunk"),
    (Workload(seq_len=16, precision="fp32"), {}, ConfigError, "fp16 or bf16"),
    (Workload(seq_len=16, precision="bf16-mixed", optimizer="sgd"), {}, UnsupportedError, "HybridAdam"),
    (WL, {"placement_policy": "auto"}, UnsupportedError, "placement_policy"),
    (WL, {"offload_optim_frac": 0.5}, UnsupportedError, "offload_optim_frac"),
    (WL, {"chunk_size": 7}, ConfigError, "unknown gemini option"),
])
def test_gemini_refusals(wl, options, error, match):
    with pytest.raises(error, match=match):
        colossal.model_states(tiny_config("llama"), wl, layout=Layout(num_gpus=2), plugin="gemini", **options)


@pytest.mark.parametrize(("options", "match"), [({"cpu_offload": True}, "cpu_offload"),
                                                ({"overlap_allgather": True}, "overlap_allgather")])
def test_lowlevel_refusals(options, match):
    with pytest.raises(UnsupportedError, match=match):
        colossal.model_states(tiny_config("llama"), WL, layout=Layout(num_gpus=2), plugin="lowlevel", **options)


# --------------------------------------------------------------- chunk search
def test_chunk_search_by_hand():
    # min chunk 4, interval 2, range 4: candidates 6, 8, 10 (start = max size 6).
    # _get_unused_byte: 6 -> 4, 8 -> 12, 10 -> 0; 10 wins.
    kw = {"search_range_m": 4 / MEGA, "hidden_dim": 2, "min_chunk_size_m": 4 / MEGA}
    cfg = colossal.search_chunk_config([6, 4, 6, 4], dp=2, **kw)
    assert (cfg.chunk_size, cfg.keep_gathered, cfg.waste, cfg.total_numel) == (10, False, 0, 20)
    assert [c.members for c in colossal.plan_chunks([6, 4, 6, 4], cfg, dp=2)] == [
        ((0, 0, 6), (1, 6, 10)), ((2, 0, 6), (3, 6, 10))]
    # dp = 4 rounds 10 up to 12: 6 + 4 fit, the next 6 opens a chunk.
    cfg4 = colossal.search_chunk_config([6, 4, 6, 4], dp=4, **kw)
    chunks = colossal.plan_chunks([6, 4, 6, 4], cfg4, dp=4)
    assert cfg4.chunk_size == 12 and len(chunks) == 2
    assert [chunks[0].valid(4, r) for r in range(4)] == [3, 3, 3, 1]


def test_chunk_search_filters_large_params_into_their_own_chunk():
    # Mean + 3 std of [1]*20 + [1000] is ~683: 1000 is filtered out of the
    # search and gets a chunk of its own, rounded up to dp (register_tensor).
    sizes = [1] * 20 + [1001]
    cfg = colossal.search_chunk_config(sizes, dp=4, search_range_m=0, hidden_dim=8, min_chunk_size_m=8 / MEGA)
    assert cfg.chunk_size == 8
    chunks = colossal.plan_chunks(sizes, cfg, dp=4)
    assert [c.chunk_size for c in chunks] == [8, 8, 8, 1004]


def test_small_model_is_one_kept_gathered_chunk():
    numels = [p.numel() for p in _params()]
    cfg = colossal.search_chunk_config(numels, dp=2)  # defaults: min_chunk_size_m = 32
    assert cfg.keep_gathered and cfg.chunk_size == sum(numels)


def test_chunk_search_equals_colossalai():
    search_utils = _search_utils()
    from torch import nn

    from llmem_plugin.methods._fakepg import fake_process_group

    model = tiny_config("llama")
    from llmem_plugin.models import modelbuild

    meta = modelbuild.build_model(model, WL, device="meta")
    module = nn.Module()
    for i, p in enumerate(colossal.unique_params(meta)):
        module.register_parameter(f"p{i}", nn.Parameter(p.detach(), requires_grad=True))
    for dp, kw in [(2, SMALL_CHUNKS), (4, SMALL_CHUNKS), (2, {})]:
        with fake_process_group(world_size=dp):
            theirs, total, waste = search_utils.search_chunk_configuration(
                module, search_range_m=kw.get("search_range_m", 32), search_interval=kw.get("hidden_dim", 1024),
                min_chunk_size_m=kw.get("min_chunk_size_m", 32))
        ours = colossal.search_chunk_config([p.numel() for p in module.parameters()], dp=dp, **kw)
        assert theirs == {dp: {"chunk_size": ours.chunk_size, "keep_gathered": ours.keep_gathered}}
        assert (total, waste) == (ours.total_numel, ours.waste)


# --------------------------------------------------------------- closed forms
@pytest.mark.parametrize("dp", [2, 4])
def test_gemini_model_states_closed_form(dp):
    numels = [p.numel() for p in _params()]
    chunks = colossal.plan_chunks(numels, colossal.search_chunk_config(numels, dp=dp, **SMALL_CHUNKS), dp=dp)
    assert len(chunks) > 1 and not chunks[0].keep_gathered
    padded = sum(c.chunk_size for c in chunks)
    assert padded % dp == 0 and padded >= sum(numels)
    for rank in (0, dp - 1):
        st = colossal.model_states(tiny_config("llama"), WL, layout=Layout(num_gpus=dp), plugin="gemini", rank=rank,
                                   **SMALL_CHUNKS)
        assert st.master_bytes == 4 * padded // dp and st.params_bytes == 2 * padded // dp
        assert st.optimizer_state_bytes == 8 * sum(c.valid(dp, rank) for c in chunks)
        assert st.host_bytes == 6 * padded // dp  # pinned fp16 + fp32 shard copies
    # Shards fill from rank 0: rank 0 holds all of every real element it covers.
    assert sum(sum(c.valid(dp, r) for c in chunks) for r in range(dp)) == sum(numels)


@pytest.mark.parametrize("dp", [2, 3])
def test_lowlevel_model_states_closed_form(dp):
    params = _params()
    padded = sum(-(-p.numel() // dp) * dp for p in params)
    for stage in (1, 2):
        st = colossal.model_states(tiny_config("llama"), WL, layout=Layout(num_gpus=dp), plugin="lowlevel",
                                   stage=stage)
        assert (st.params_bytes, st.master_bytes, st.optimizer_state_bytes, st.fp32_grads_bytes) == (
            2 * padded, 4 * padded // dp, 8 * padded // dp, 4 * padded // dp)
        assert st.grads_bytes == (2 * padded if stage == 1 else 2 * padded // dp)


# ----------------------------------------------------------- traced buffers
def test_gemini_trace_buffers_match_the_plan():
    dp = 2
    trace, buf, emu = _trace("gemini", dp=dp, **SMALL_CHUNKS)
    top = _max_live(trace, buf)
    chunks = [c.plan for c in emu.chunks]
    padded = sum(c.chunk_size for c in chunks)
    tol = 512 * 2 * len(chunks)
    assert abs(top[ZeroCategory.MASTER_WEIGHTS] - 4 * padded // dp) < tol
    # Gathered 16-bit chunks: at least the largest, never all at once.
    assert 2 * max(c.chunk_size for c in chunks) <= top[ZeroCategory.GATHERED_PARAMS] < 2 * padded
    states = 8 * sum(c.valid(dp, 0) for c in chunks)
    assert abs(top[C.OPTIMIZER_STATE] - states) < 512 * 2 * sum(len(c.members) for c in chunks)
    assert trace.peak_bytes > 0


@pytest.mark.parametrize("stage", [1, 2])
def test_lowlevel_trace_gradients_match_the_plan(stage):
    dp = 2
    trace, buf, emu = _trace(f"lowlevel-zero{stage}", dp=dp, reduce_bucket_size_in_m=20000 / MEGA)
    top = _max_live(trace, buf)
    padded = sum(-(-p.numel() // dp) * dp for p in emu.trainable)
    expect = 2 * padded if stage == 1 else 2 * padded // dp
    assert abs(top[C.GRADIENT] - expect) < 512 * len(emu.trainable)
    assert abs(top[ZeroCategory.MASTER_WEIGHTS] - 4 * padded // dp) < 512 * len(emu.trainable)
    assert abs(top[ZeroCategory.FP32_GRADIENTS] - 4 * padded // dp) < 512 * len(emu.trainable)


# -------------------------------------------------------------- end to end
@pytest.mark.parametrize("preset", list(colossal.PRESETS))
def test_estimate_runs_and_reports(preset):
    est = colossal.estimate(tiny_config("llama"), WL, layout=Layout(num_gpus=4, num_nodes=2), gpu=H100,
                            preset=preset, **colossal.PRESETS[preset], **(SMALL_CHUNKS if preset == "gemini" else {}))
    r = est.ranks[0]
    assert est.method == preset and r.peak_reserved_bytes >= r.peak_allocated_bytes >= r.peak_tensor_bytes > 0
    assert r.device_total_bytes > r.peak_reserved_bytes  # context + NCCL
    # Two nodes of two: half of each ring's bytes cross nodes.
    assert est.comm_inter_node_bytes > 0 and est.comm_intra_node_bytes == est.comm_inter_node_bytes


def test_lowlevel_zero2_communication_is_reduce_scatter_plus_all_gather():
    dp = 2
    est = colossal.estimate(tiny_config("llama"), WL, layout=Layout(num_gpus=dp), gpu=H100, preset="lowlevel-zero2",
                            plugin="lowlevel", stage=2)
    padded = sum(-(-p.numel() // dp) * dp for p in _params())
    # reduce-scatter (dp-1)/dp x padded + all-gather (dp-1) x padded/dp, 2 B each.
    assert est.comm_intra_node_bytes == pytest.approx(2 * 2 * (dp - 1) / dp * padded, abs=4)


def test_gemini_kept_gathered_chunk_is_all_reduced():
    dp = 2
    est = colossal.estimate(tiny_config("llama"), WL, layout=Layout(num_gpus=dp), gpu=H100, preset="gemini")
    total = sum(p.numel() for p in _params())
    assert est.comm_intra_node_bytes == 2 * (dp - 1) / dp * total * 2
    assert est.ranks[0].host_bytes == 0  # a kept-gathered chunk has no pinned shard


def test_lowlevel_lora_and_accumulation_run():
    wl = Workload(seq_len=16, micro_batch_size=1, precision="bf16-mixed", lora=LoraSpec(rank=4), grad_accum_steps=2)
    st = colossal.model_states(tiny_config("llama"), wl, layout=Layout(num_gpus=2), plugin="lowlevel", stage=2)
    full = colossal.model_states(tiny_config("llama"), WL, layout=Layout(num_gpus=2), plugin="lowlevel", stage=2)
    assert st.master_bytes < full.master_bytes / 10 and st.params_bytes > full.params_bytes  # adapters on top
    est = colossal.estimate(tiny_config("llama"), wl, layout=Layout(num_gpus=2), gpu=H100, preset="lowlevel-zero2",
                            plugin="lowlevel", stage=2)
    assert est.ranks[0].peak_allocated_bytes > 0
