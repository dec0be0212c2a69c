"""HybridParallelPlugin (llmem_plugin.methods.colossal_hybrid): per-rank closed forms.

Closed-form rules (not read from the trace), tiny Llama, tp = 2:
* local shards: q/k/v/gate/up ``out/tp x in``, o/down ``out x in/tp``, norms
  whole (Shardformer's Linear1D_Col / Linear1D_Row, as tp.tp_plan), and the
  vocab-parallel embedding and lm_head ``V_pad/tp x h`` with ``V_pad`` a
  multiple of 64 * tp (VocabParallelEmbedding1D), all in 16 bits;
* zero_stage 0: an fp32 master of each local shard (MixedPrecisionOptimizer),
  Adam m and v like it, an fp32 gradient per master at the step, one DDP
  bucket (the model is under the 1 MiB first bucket) of the 16-bit grads;
* zero_stage 1: each local shard padded to dp and ``ceil(numel / dp)`` of it
  in fp32 (LowLevelZero), m and v like it, the stage-1 flat buffer of all
  padded 16-bit gradients (one 12 M-element bucket);
* each storage is its own CUDA allocation rounded up to 512 B
  (c10/cuda/CUDACachingAllocator.cpp, kMinBlockSize);
* communication: NCCL ring volumes (all-reduce 2(n-1)/n of the buffer).
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from llmem_plugin.models import modelbuild
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.device.gpus import get_gpu
from llmem_plugin.methods import colossal_hybrid as hybrid
from llmem_plugin.methods.layout import Layout
from llmem_plugin.trace.tracker import MemoryCategory as C
from llmem_plugin.trace.tracker import round_allocation
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config

H100 = get_gpu("h100-sxm")
WL = Workload(seq_len=32, micro_batch_size=2, precision="bf16-mixed")


def run(cfg=None, wl=WL, *, num_gpus=4, num_nodes=1, tp=2, **options):
    return hybrid.estimate(cfg or tiny_config("llama"), wl, layout=Layout(num_gpus=num_gpus, num_nodes=num_nodes, tp=tp),
                           gpu=H100, **{**hybrid.PRESETS["hybrid"], **options})


def local_numels(cfg, t: int) -> list[int]:
    """Each parameter's local shard on one of ``t`` TP ranks, from the config alone."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    v_pad = -(-cfg.vocab_size // (64 * t)) * 64 * t
    out = [v_pad // t * h, v_pad // t * h, h]  # embedding, lm_head, final norm
    for _ in range(cfg.num_hidden_layers):
        out += [q // t * h, kv // t * h, kv // t * h, h * q // t, inter // t * h, inter // t * h, h * inter // t, h, h]
    return out


def rounded(numels, itemsize: int) -> int:
    return sum(round_allocation(n * itemsize) for n in numels)


def buffers_bytes(cfg) -> int:
    return sum(round_allocation(b.numel() * b.element_size())
               for b in modelbuild.build_model(cfg, WL, device="meta").buffers())


def test_presets():
    assert hybrid.PRESETS == {"hybrid": {"zero_stage": 0}}
    assert hybrid.padded_vocab(512, 2) == 512 and hybrid.padded_vocab(500, 2) == 512
    assert hybrid.padded_vocab(32000, 8) == 32256


@pytest.mark.parametrize("num_gpus", [2, 4])
def test_zero0_model_states_equal_closed_forms(num_gpus):
    cfg = tiny_config("llama")
    numels = local_numels(cfg, 2)
    bd = run(cfg, num_gpus=num_gpus).ranks[0].breakdown
    assert bd["parameters"] == rounded(numels, 2) + buffers_bytes(cfg)
    assert bd["fp32_master_weights"] == rounded(numels, 4)
    assert bd["optimizer_states"] == 2 * rounded(numels, 4)  # m, v (the step counters stay on the host)
    assert bd["fp32_gradients"] == rounded(numels, 4)
    assert bd["temporaries"] == rounded(numels, 4)  # foreach AdamW's _foreach_sqrt list
    assert bd["comm_buffers"] == round_allocation(2 * sum(numels))  # one DDP bucket, 16-bit


@pytest.mark.parametrize("num_gpus", [4, 8])
def test_zero1_partitions_the_local_shards_over_dp(num_gpus):
    cfg = tiny_config("llama")
    dp = num_gpus // 2
    numels = local_numels(cfg, 2)
    parts = [-(-n // dp) for n in numels]
    bd = run(cfg, num_gpus=num_gpus, zero_stage=1).ranks[0].breakdown
    assert bd["fp32_master_weights"] == rounded(parts, 4)
    assert bd["optimizer_states"] == 2 * rounded(parts, 4)
    top = _max_live(cfg, num_gpus=num_gpus, zero_stage=1)
    assert top[C.GRADIENT] == round_allocation(2 * sum(p * dp for p in parts))  # the stage-1 flat buffer
    # The 16-bit working params: each shard padded to dp (LowLevelZero's F.pad).
    assert top[C.PARAMETER] == rounded([p * dp for p in parts], 2)


def _max_live(cfg, *, num_gpus: int, zero_stage: int) -> dict:
    """Highest live bytes of each modelled buffer label over the traced steps."""
    import torch

    from llmem_plugin.methods.zero import build_training_model

    trace, buf, _, _ = hybrid._trace_rank(
        build_training_model(cfg, WL, torch.bfloat16), WL, layout=Layout(num_gpus=num_gpus, tp=2), zero_stage=zero_stage,
        dtype=torch.bfloat16, gpu=H100, capacity=H100.capacity_bytes, options={})
    cur, top = defaultdict(int), defaultdict(int)
    for sign, idx, nbytes in trace.events:
        if idx in buf.labels:
            cur[buf.labels[idx]] += sign * nbytes
            top[buf.labels[idx]] = max(top[buf.labels[idx]], cur[buf.labels[idx]])
    return top


def test_tp_and_dp_communication():
    cfg = tiny_config("llama")
    b, s, h, layers = WL.micro_batch_size, WL.seq_len, cfg.hidden_size, cfg.num_hidden_layers
    # Per micro-batch, bf16 all-reduces of b x s x h: the embedding's output,
    # per layer the attention and MLP outputs (forward) and input gradients
    # (backward), lm_head's input gradient; DistCrossEntropy all-reduces the
    # max and target logits (bf16) and the exp sums (fp32) of b x (s-1) tokens.
    tp_bytes = (2 + 4 * layers) * b * s * h * 2 + b * (s - 1) * (2 + 2 + 4)  # t = 2: 2(t-1)/t = 1
    tp_only = run(cfg, num_gpus=2)
    assert (tp_only.comm_intra_node_bytes, tp_only.comm_inter_node_bytes) == (tp_bytes, 0)
    grads = 2 * sum(local_numels(cfg, 2))
    one_node = run(cfg, num_gpus=4)  # dp = 2: all-reduce 2(d-1)/d = 1 x the local 16-bit grads
    assert (one_node.comm_intra_node_bytes, one_node.comm_inter_node_bytes) == (tp_bytes + grads, 0)
    two_nodes = run(cfg, num_gpus=4, num_nodes=2)  # the dp ring crosses both nodes: num_nodes / d = all of it
    assert (two_nodes.comm_intra_node_bytes, two_nodes.comm_inter_node_bytes) == (tp_bytes, grads)
    wl2 = Workload(seq_len=32, micro_batch_size=2, precision="bf16-mixed", grad_accum_steps=2)
    accum = run(cfg, wl2, num_gpus=8, num_nodes=2)  # dp = 4 over 2 nodes: 2/4 of 2 x 2(3/4) grads
    dp_sent = 2 * (2 * 3 * grads // 4)
    assert accum.comm_inter_node_bytes == dp_sent // 2
    assert accum.comm_intra_node_bytes == 2 * tp_bytes + dp_sent - dp_sent // 2


def test_qwen2_tied_embeddings_share_one_shard():
    cfg = tiny_config("qwen2")
    hd = cfg.hidden_size // cfg.num_attention_heads
    # lm_head is the embedding; Qwen2 adds q/k/v biases (column-sharded).
    biases = [cfg.num_attention_heads * hd // 2, cfg.num_key_value_heads * hd // 2,
              cfg.num_key_value_heads * hd // 2] * cfg.num_hidden_layers
    numels = local_numels(cfg, 2)[1:] + biases
    bd = run(cfg, num_gpus=2).ranks[0].breakdown
    assert bd["fp32_master_weights"] == rounded(numels, 4)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"tp": 1, "num_gpus": 2}, ConfigError, r"tp_size = --tp >= 2, got --tp 1"),
    ({"num_gpus": 2, "zero_stage": 1}, UnsupportedError, "dp = 1"),
    ({"zero_stage": 2}, UnsupportedError, "not 2"),
    ({"pp_size": 2}, UnsupportedError, "pp_size"),
    ({"enable_sequence_parallelism": True}, UnsupportedError, "enable_sequence_parallelism"),
    ({"chunk_size": 3}, ConfigError, "unknown hybrid option"),
])
def test_refusals(kwargs, error, match):
    with pytest.raises(error, match=match):
        run(**kwargs)


def test_tp_must_divide_heads():
    cfg = tiny_config("llama", num_attention_heads=6, num_key_value_heads=6, hidden_size=96)
    with pytest.raises(ConfigError, match=r"--tp 4 does not divide the model's num_attention_heads \(6\)"):
        run(cfg, num_gpus=4, tp=4)


@pytest.mark.parametrize(("wl", "cfg", "error", "match"), [
    (Workload(seq_len=32, lora=LoraSpec(rank=4)), "llama", UnsupportedError, "tp_size == 1"),
    (Workload(seq_len=32, precision="fp32"), "llama", ConfigError, "fp16' or 'bf16' when using ZeRO"),
    (WL, "gpt2", UnsupportedError, "not 'gpt2'"),
])
def test_workload_refusals(wl, cfg, error, match):
    with pytest.raises(error, match=match):
        run(tiny_config(cfg), wl, zero_stage=1)


def test_fp32_zero0_has_no_master_copies():
    cfg = tiny_config("llama")
    bd = run(cfg, Workload(seq_len=32, micro_batch_size=2, precision="fp32"), num_gpus=2).ranks[0].breakdown
    assert "fp32_master_weights" not in bd and "fp32_gradients" not in bd
    assert bd["optimizer_states"] == 2 * rounded(local_numels(cfg, 2), 4)
