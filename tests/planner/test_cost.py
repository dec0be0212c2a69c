"""The step-time model: FLOPs counted on the traced step against closed
forms from the config, and the time formula against hand computation."""

from __future__ import annotations

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin.models import modelbuild
from llmem_plugin.planner.cost import (
    DEFAULT_INTER_NODE_GBPS,
    FlopCount,
    Network,
    Overlap,
    StepFlopCounter,
    StepWork,
    flops_of_step,
    pcie_gbps,
    peak_flops,
    step_time,
)
from llmem_plugin.estimate import vocab_size_of
from llmem_plugin.device.gpus import get_gpu, gpu_names
from llmem_plugin.trace.step import NUM_ITERATIONS, trace_step
from llmem_plugin.trace.tracker import MemoryTracker
from llmem_plugin.workload import OptimizerKind, Precision, Workload

from tests.conftest import tiny_config


def _count(cfg, wl: Workload) -> FlopCount:
    model = modelbuild.build_model(cfg, wl)
    fake = FakeTensorMode()
    modelbuild.fakeify(model, fake)
    tracker = MemoryTracker()
    counter = StepFlopCounter(tracker)
    trace_step(model, wl, vocab_size=vocab_size_of(model), fake_mode=fake, tracker=tracker, contexts=[counter])
    return flops_of_step(counter.by_phase, NUM_ITERATIONS, wl.grad_accum_steps)


def _closed_form_forward(cfg, b: int, s: int) -> float:
    """2 FLOPs per multiply-add of every Linear (q, k, v, o, gate, up, down,
    lm_head) over b*s tokens, plus causal attention: QK^T and PV are
    2*b*h*s*s*d each, of which the kernel does the lower half."""
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    hd = d // h
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * cfg.intermediate_size
    linear = 2 * b * s * (cfg.num_hidden_layers * per_layer + d * cfg.vocab_size)
    attention = cfg.num_hidden_layers * 2 * (2 * b * h * s * s * hd) / 2
    return linear + attention


@pytest.mark.parametrize(("attn", "precision"), [("sdpa", "bf16-mixed"), ("sdpa", "fp32"), ("eager", "bf16-mixed")])
def test_forward_flops_equal_the_closed_form(attn, precision):
    cfg = tiny_config("llama", num_hidden_layers=3)
    b, s = 2, 128
    f = _count(cfg, Workload(seq_len=s, micro_batch_size=b, precision=precision, attn_implementation=attn))
    expected = _closed_form_forward(cfg, b, s)
    if attn == "eager" or precision == "fp32":
        # Eager attention, and SDPA's math fallback (fp32 GQA: no fused
        # kernel takes it in torch 2.13), multiply the full s x s scores and
        # mask afterwards; only the fused kernels skip the masked tiles.
        h, hd = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        expected += cfg.num_hidden_layers * 2 * (2 * b * h * s * s * hd) / 2
    assert f.forward == pytest.approx(expected, rel=1e-9)
    # Backward: two matmuls per forward matmul (input and weight gradients;
    # the embedding lookup has none); flash backward: 5 s*s matmuls for 2.
    assert f.backward > 1.9 * f.forward


def test_flops_scale_with_the_micro_batch_and_checkpointing_recomputes():
    cfg = tiny_config("llama", num_hidden_layers=3)
    one = _count(cfg, Workload(seq_len=128, micro_batch_size=1))
    two = _count(cfg, Workload(seq_len=128, micro_batch_size=2))
    assert two.forward == pytest.approx(2 * one.forward, rel=1e-9)
    assert two.backward == pytest.approx(2 * one.backward, rel=1e-9)
    ckpt = _count(cfg, Workload(seq_len=128, micro_batch_size=1, grad_checkpointing=True))
    assert ckpt.forward == pytest.approx(one.forward, rel=1e-9)
    # Recomputation runs (at most) each checkpointed layer's forward again;
    # the LM head is outside the layers and is not recomputed.
    extra = ckpt.backward - one.backward
    head = 2 * 128 * cfg.hidden_size * cfg.vocab_size
    assert 0 < extra <= one.forward - head + 1


def test_step_time_is_the_documented_formula():
    gpu = get_gpu("h100-sxm")
    net = Network(intra_node_gbps=450.0, inter_node_gbps=50.0, pcie_gbps=63.0, host_memory_gbps=614.0)
    work = StepWork(flops=FlopCount(forward=1e15, backward=2e15), micro_steps=4, intra_only_bytes=9 * 10**10,
                    cross_node_bytes=10**11, overlap=Overlap.BACKWARD, optimizer_elements=10**9,
                    host_optimizer_elements=0, pcie_bytes=0, gpus_per_node=8)
    st = step_time(work, gpu=gpu, precision=Precision.BF16_MIXED, optimizer=OptimizerKind.ADAMW, network=net,
                   efficiency=0.5)
    rate = 989.4e12 * 0.5
    assert st.compute_s == pytest.approx(4 * 3e15 / rate)
    assert st.comm_s == pytest.approx(9e10 / 450e9 + 1e11 / 50e9)
    backward = 4 * 2e15 / rate
    assert st.exposed_comm_s == pytest.approx(max(0.0, st.comm_s - backward))
    assert st.optimizer_s == pytest.approx(1e9 * 28 / 3.35e12, rel=0.01)  # H100 SXM HBM3 3.35 TB/s
    assert st.total_s == pytest.approx(st.compute_s + st.exposed_comm_s + st.optimizer_s)
    # No overlap: all of it is exposed.
    flat = step_time(StepWork(flops=work.flops, micro_steps=4, cross_node_bytes=10**11),
                     gpu=gpu, precision=Precision.BF16_MIXED, optimizer=OptimizerKind.ADAMW, network=net)
    assert flat.exposed_comm_s == pytest.approx(flat.comm_s) == pytest.approx(2.0)


def test_offload_time_is_pcie_plus_the_host_update_over_shared_memory_bandwidth():
    gpu = get_gpu("a100-80gb")
    net = Network.for_gpu(gpu)
    assert net.pcie_gbps == 31.5 and net.intra_node_gbps == 300.0 and net.inter_node_gbps == DEFAULT_INTER_NODE_GBPS
    work = StepWork(flops=FlopCount(forward=0, backward=0), micro_steps=1, pcie_bytes=63 * 10**9,
                    host_optimizer_elements=10**9, gpus_per_node=8)
    st = step_time(work, gpu=gpu, precision=Precision.BF16_MIXED, optimizer=OptimizerKind.ADAMW, network=net)
    assert st.offload_s == pytest.approx(63e9 / 31.5e9 + 1e9 * 28 / (614e9 / 8))


def test_peak_flops_follow_the_precision_and_pcie_the_catalog():
    h100 = get_gpu("h100-sxm")
    assert peak_flops(h100, Precision.BF16_MIXED) == peak_flops(h100, Precision.BF16) == 989.4e12
    assert peak_flops(h100, Precision.FP32) == 67.0e12  # TF32 off by default
    v100 = get_gpu("v100-32gb")
    assert peak_flops(v100, Precision.FP16_MIXED) == 125e12
    assert peak_flops(v100, Precision.BF16_MIXED) == v100.fp32_tflops * 1e12  # no bf16 tensor cores
    by_gen = {"pcie3": 15.75, "pcie4": 31.5, "pcie5": 63.0}
    for name in gpu_names():
        g = get_gpu(name)
        assert pcie_gbps(g) == by_gen[g.pcie.split()[0]]
