"""TRL 1.16's fused LM head (llmem_plugin.techniques.trl_head): against TRL's source, real CPU runs and TRL's own function."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker
from llmem_plugin.trace.tracker import round_allocation as r
from llmem_plugin.techniques.trl_head import TOKEN_CHUNK_SIZE, VOCAB_CHUNK_SIZE, fused_sft_loss
from llmem_plugin.workload import LoraSpec, Workload

from tests.recipes.conftest import run_probe
from .test_loss import any_config, fake_trace, real_trace


@pytest.mark.parametrize("arch, precision, lora", [("llama", "bf16-mixed", None), ("llama", "bf16", LoraSpec(rank=4)),
                                                   ("gemma2", "fp32", None)])
def test_fake_equals_a_real_cpu_run(arch, precision, lora):
    wl = Workload(seq_len=64, micro_batch_size=2, precision=precision, loss="trl-fused", lora=lora)
    cfg = any_config(arch)
    fake, real = fake_trace(cfg, wl), real_trace(cfg, wl)
    assert fake.peak_bytes == real.peak_bytes and fake.phase_peaks == real.phase_peaks
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def test_values_and_gradients_equal_trl_own_fused_head():
    """TRL 1.16.0's add_fused_lm_head on a tiny Llama (two vocabulary tiles) against fused_sft_loss."""
    out = run_probe("trl_fused_head.py")
    assert out["valid"] == 2 * 23 - 4 - 1  # labels[:, 1:]: four of row 0's five ignored positions, one of row 1
    assert out["our_loss"] == pytest.approx(out["trl_loss"], rel=1e-6)
    assert max(out["grad_rel_err"].values()) < 1e-5


def test_tiles_and_gradient_buffers_follow_trl_source():
    """fp32 weights under bf16 autocast (TRL's default: the model in fp32, bf16=True). N = b*(s-1) valid
    labels, a vocabulary of two tiles (32768 + 7232). Allocations of 1 MiB and more, in order."""
    b, s, h, v = 2, 1025, 512, 40000
    n = b * (s - 1)
    assert n <= TOKEN_CHUNK_SIZE and VOCAB_CHUNK_SIZE < v < 2 * VOCAB_CHUNK_SIZE
    with FakeTensorMode():
        hidden = torch.empty(b, s, h, requires_grad=True)
        weight = torch.empty(v, h, requires_grad=True)
        labels = torch.zeros(b, s, dtype=torch.int64)
        with MemoryTracker() as tracker:
            tracker.register([hidden, weight, labels], MemoryCategory.INPUT)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = fused_sft_loss(hidden, weight, labels)
            loss.backward()
    big = [e[2] for e in tracker.result().events if e[0] > 0 and e[2] >= 2**20][2:]  # after hidden and weight
    tile = n * VOCAB_CHUNK_SIZE * 2  # mm_buf [min(N, 4096), 32768] bf16
    chunks = [VOCAB_CHUNK_SIZE * h * 2, (v - VOCAB_CHUNK_SIZE) * h * 2]  # weight[v0:v1].to(bf16)
    forward = [n * h * 4, tile, n * h * 2, *chunks]  # hidden_states[mask] (fp32), mm_buf, hidden_chunk.to(bf16)
    backward = [n * h * 4, v * h * 4, tile, n * h * 2, *chunks]  # fp32 grad_hidden, grad_weight; mm_buf; copies
    backward += [b * (s - 1) * h * 4, b * s * h * 4]  # index_backward's zeros, the [:, :-1] slice's backward
    assert big == [r(x) for x in forward + backward]
