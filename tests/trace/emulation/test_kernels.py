"""The CUDA kernels' own allocations (llmem_plugin.trace.emulation.kernels, .reduce).

The byte counts are those the stub CUDA device (torch 2.13's CUDA build and
caching allocator, H100 properties: 132 SMs, 2048 threads per SM) recorded
for the same ops in whole training steps
(benchmarks/results/stub-wholestep-2026-11-25.md); tests/stub/test_wholestep.py
checks whole steps end to end.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin.trace.emulation.kernels import cuda_kernels
from llmem_plugin.trace.emulation.reduce import global_reduce_bytes
from llmem_plugin.trace.tracker import MemoryTracker

H100 = {"acc_bytes": 4, "num_sms": 132, "max_threads_per_sm": 2048}


def test_global_reduce_scratch_of_bias_gradients():
    # OPT-125m at 16 x 512 tokens: fc2 (768 outputs) and fc1 (3072 outputs) bias gradients.
    assert global_reduce_bytes(torch.empty(16, 512, 768, dtype=torch.bfloat16), [0, 1], **H100) == (50_331_648, 24)
    assert global_reduce_bytes(torch.empty(8192, 3072, dtype=torch.bfloat16), [0], **H100) == (138_412_032, 96)
    # Many outputs (a row-wise mean): one block per output row, no global reduce.
    assert global_reduce_bytes(torch.empty(8192, 2048), [-1], **H100) == (0, 0)
    # A full reduction splits too, with a small buffer.
    assert global_reduce_bytes(torch.empty(8192, 768), None, **H100) == (2112, 4)


def _trace(fn):
    tracker = MemoryTracker()
    with FakeTensorMode() as fake:
        x = fake.from_tensor(torch.empty(8192, 768, dtype=torch.bfloat16))
        w = fake.from_tensor(torch.empty(768, 768, dtype=torch.bfloat16))
    with fake, tracker, cuda_kernels(compute_capability=(9, 0), num_sms=132, mark=tracker.mark):
        fn(x, w)
    return tracker.result()


def test_sum_allocates_and_frees_the_scratch_after_its_output():
    trace = _trace(lambda x, w: x.sum(0))
    sizes = [(sign, n) for sign, _, n in trace.events]
    assert sizes == [(1, 1536), (1, 50_331_648), (1, 512), (-1, 512), (-1, 50_331_648), (-1, 1536)]


def test_first_cublas_call_of_a_phase_is_marked_after_its_output():
    def step(x, w):
        y = x.sum(1)  # no cuBLAS
        z = x @ w
        z2 = x @ w
        del y, z, z2

    trace = _trace(step)
    # Events: sum out (+), mm out (+) -> mark, then the rest.
    assert trace.marks == {"cublas:setup": 2}
    assert trace.events[1][0] == 1 and trace.events[1][2] == 8192 * 768 * 2


def test_gradient_fan_in_accumulates_in_place():
    def step(x, w):
        w.requires_grad_(True)
        y = x @ w
        loss = (y.sin() + y.cos()).sum()  # y's gradient arrives twice
        loss.backward()

    trace = _trace(step)
    grads = sum(1 for sign, _, n in trace.events if sign > 0 and n == 8192 * 768 * 2)
    # Forward: y, sin, cos outputs; backward: cos', sin' gradient terms (each mul
    # needs a sin/cos recompute: 2 more) -- and no third tensor for their sum.
    without = _trace_without_accumulation(step)
    assert grads == without - 1


def _trace_without_accumulation(fn):
    from llmem_plugin.trace.emulation import kernels

    original = kernels._accumulates_in_place
    kernels._accumulates_in_place = lambda args, kwargs: False
    try:
        trace = _trace(fn)
    finally:
        kernels._accumulates_in_place = original
    return sum(1 for sign, _, n in trace.events if sign > 0 and n == 8192 * 768 * 2)
