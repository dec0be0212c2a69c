"""Cut Cross-Entropy (llmem_plugin.techniques.cce): against the package's source and real CPU runs."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import llmem_plugin
from llmem_plugin.techniques.cce import IGNORE_INDEX, cce_loss
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker
from llmem_plugin.trace.tracker import round_allocation as r
from llmem_plugin.workload import LoraSpec, Workload

from tests.cli._run import run
from .test_loss import any_config, fake_trace, real_trace


@pytest.mark.parametrize("arch, lora", [("llama", None), ("llama", LoraSpec(rank=4)), ("gemma2", None)])
def test_fake_equals_a_real_cpu_run(arch, lora):
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16", loss="cce", lora=lora)
    cfg = any_config(arch)
    fake, real = fake_trace(cfg, wl), real_trace(cfg, wl)
    assert fake.peak_bytes == real.peak_bytes and fake.phase_peaks == real.phase_peaks
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def test_the_loss_and_its_gradients_are_cross_entropy_of_the_shifted_labels():
    torch.manual_seed(0)
    b, s, d, v = 2, 7, 16, 40
    hidden = torch.randn(b, s, d, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, d, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (b, s))
    labels[0, 3] = IGNORE_INDEX
    loss = cce_loss(hidden, weight, labels, softcap=None)
    loss.backward()
    h, w = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = torch.nn.functional.cross_entropy((h @ w.t())[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1),
                                            ignore_index=IGNORE_INDEX)
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-4)
    assert torch.allclose(hidden.grad.float(), h.grad, atol=1e-2) and torch.allclose(weight.grad.float(), w.grad,
                                                                                       atol=1e-2)


@pytest.mark.parametrize("c_dtype", [torch.bfloat16, torch.float32])
def test_allocations_follow_the_package_source(c_dtype):
    # cut-cross-entropy 25.1.1, shift=True, reduction "mean", filter_eps "high", no ignored labels:
    # N = b*(s-1) positions, BT = b*s rows, V x D classifier.
    b, s, d, v = 2, 300, 96, 1000
    n, bt, nd = b * (s - 1), b * s, -(-d // 64)
    with FakeTensorMode():
        hidden = torch.empty(b, s, d, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(v, d, dtype=c_dtype, requires_grad=True)
        labels = torch.zeros(b, s, dtype=torch.int64)
        with MemoryTracker() as tracker:
            tracker.register([hidden, weight, labels], MemoryCategory.INPUT)
            loss = cce_loss(hidden, weight, labels, softcap=None)
            loss.backward()
    allocs = [e[2] for e in tracker.result().events if e[0] > 0][3:]  # after the three inputs
    forward = [
        n * 1,  # targets[..., 1:] != ignore_index (bool)
        n * 2 * 8,  # .nonzero(): int64 [N, 2]
        n * 2 * 4,  # .to(torch.int32)
        n * 8,  # .sum(1): int64 flat positions
        n * 4,  # lse
        -(-n // 128) * 4,  # locks (uint32)
        v * 4,  # logit_avg
        n * 4,  # indexed_neg_dot out
        4,  # nll.mean()
    ]
    backward = [
        4,  # the engine's grad of the scalar loss (ones_like)
        v * 4, v * 8, v * 4,  # sort values, indices, .to(int32)
        bt * d * 2,  # de = zeros_like(e)
        v * d * 2,  # dc = zeros_like(c, dtype=e.dtype)
        -(-n // nd) * nd * 4, -(-v // nd) * nd * 4,  # de_locks, dc_locks
    ] + ([v * d * 4] if c_dtype == torch.float32 else [])  # dc.to(c.dtype)
    assert allocs == [r(x) for x in forward + backward]


def test_refusals_and_the_report(capsys):
    with pytest.raises(llmem_plugin.ConfigError, match="bf16 or fp16 hidden states"):
        llmem_plugin.estimate(any_config("llama"), Workload(seq_len=32, precision="bf16-mixed", loss="cce"))
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "64", "--precision", "bf16",
                       "--loss", "cce")
    assert code == 0 and "loss path: Cut Cross-Entropy" in out
