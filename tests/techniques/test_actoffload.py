"""Activation offload: what moves to the host, what stays on the device, and
that the fake trace equals a real CPU run.

The closed forms use a two-linear net whose saved tensors follow from
derivatives.yaml: ``mm(a, b)`` saves ``a`` for the grad of ``b`` and ``b`` for
the grad of ``a``; ``sin(h)`` saves ``h``; ``sum`` saves nothing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmem_plugin.techniques.actoffload import offload_context, unsupported
from llmem_plugin.cli.app import main
from llmem_plugin.errors import ConfigError

from tests.trace.test_fake_equals_real import fake_and_real
from llmem_plugin.techniques import check_supported
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, round_allocation
from llmem_plugin.workload import ActivationOffload, Workload

from tests.conftest import tiny_config

_B, _IN, _OUT = 8, 64, 32  # fp32 rows of 64: 2048 bytes, above TRL's 1024-byte floor


class _Net(nn.Module):
    """fc, then sin, then an output head named as HF names it (``lm_head``)."""

    def __init__(self, mid: int) -> None:
        super().__init__()
        self.fc = nn.Linear(_IN, mid, bias=False)
        self.lm_head = nn.Linear(mid, _OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.sin(self.fc(x))).sum()


def _forward_backward(mode: ActivationOffload | None, mid: int) -> tuple[int, int, int, list[torch.Tensor]]:
    """(host bytes, device bytes) live after the forward, the loss's device
    bytes, and the gradients, for one real step of a seeded ``_Net``."""
    torch.manual_seed(0)
    net = _Net(mid)
    x = torch.randn(_B, _IN, requires_grad=True)
    tracker = MemoryTracker()
    tracker.watch_modules(net)
    host = {}
    with tracker:
        tracker.register(list(net.parameters()), MemoryCategory.PARAMETER)
        tracker.register([x], MemoryCategory.INPUT)
        ctx = offload_context(mode, tracker) if mode is not None else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)
        with ctx:
            loss = net(x)
            host["device"] = tracker.live_bytes()
            host["host"] = tracker.result().host_peak_bytes
            loss.backward()
    grads = [x.grad, *(p.grad for p in net.parameters())]
    return host["host"], host["device"], round_allocation(loss.numel() * loss.element_size()), grads


def test_save_on_cpu_copies_every_saved_tensor_parameters_included():
    mid = _IN
    host, device, loss_bytes, grads = _forward_backward(ActivationOffload.SAVE_ON_CPU, mid)
    f32 = 4
    saved = [_B * _IN, _IN * mid, _B * mid, _B * mid, mid * _OUT]  # x, fc.weight.t(), h, sin(h), lm_head.weight.t()
    assert host == sum(round_allocation(n * f32) for n in saved)
    _, device_plain, _, grads_plain = _forward_backward(None, mid)
    # On the device nothing saved is held any more: h and sin(h) are gone,
    # parameters and the input stay because the caller holds them.
    assert device_plain - device == 2 * round_allocation(_B * mid * f32)
    params_and_input = round_allocation(_IN * mid * f32) + round_allocation(mid * _OUT * f32) + _B * _IN * f32
    assert device == params_and_input + loss_bytes
    for g, g_plain in zip(grads, grads_plain):
        torch.testing.assert_close(g, g_plain, rtol=0, atol=0)


@pytest.mark.parametrize("mid", [_IN, 8])
def test_streamed_keeps_parameters_small_tensors_and_the_head_on_the_device(mid):
    host, _, _, grads = _forward_backward(ActivationOffload.STREAMED, mid)
    _, _, _, grads_plain = _forward_backward(None, mid)
    f32 = 4
    # x goes (2048 B); fc.weight.t() is a parameter's storage; h goes only if
    # it reaches 1024 B (mid=64: 2048 B, mid=8: 256 B); sin(h) and
    # lm_head.weight.t() are saved inside lm_head, under the NoOpManager.
    expected = round_allocation(_B * _IN * f32)
    if _B * mid * f32 >= 1024:
        expected += round_allocation(_B * mid * f32)
    assert host == expected
    for g, g_plain in zip(grads, grads_plain):
        torch.testing.assert_close(g, g_plain, rtol=0, atol=0)


def _fake_and_real(wl: Workload):
    return fake_and_real(tiny_config("llama"), wl)


@pytest.mark.parametrize("gc", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("mode", ["save-on-cpu", "streamed"])
def test_fake_trace_equals_real_cpu_run(mode, gc):
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed", offload_activations=mode,
                  grad_checkpointing=gc)
    fake, real = _fake_and_real(wl)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.breakdown == real.breakdown
    assert fake.phase_peaks == real.phase_peaks
    assert fake.host_peak_bytes == real.host_peak_bytes > 0
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def test_offload_lowers_the_device_forward_peak_and_checkpointing_leaves_less_to_offload():
    base = Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed")
    plain, _ = _fake_and_real(base)
    for mode in ("save-on-cpu", "streamed"):
        off, _ = _fake_and_real(Workload(**{**base.__dict__, "offload_activations": mode}))
        assert off.phase_peaks[off.peak_phase] <= plain.peak_bytes
        assert off.breakdown.get(MemoryCategory.ACTIVATION, 0) < plain.breakdown.get(MemoryCategory.ACTIVATION, 0)
        gc, _ = _fake_and_real(Workload(**{**base.__dict__, "offload_activations": mode, "grad_checkpointing": True}))
        # Inside checkpointed layers the checkpoint's hooks are innermost:
        # only the layers' inputs and what runs outside layers reach ours.
        assert 0 < gc.host_peak_bytes < off.host_peak_bytes


def test_unsupported_names_the_method_and_hints():
    wl = Workload(offload_activations="save-on-cpu")
    assert unsupported("single", wl) is None and unsupported("ddp", wl) is None
    assert unsupported("fsdp", Workload()) is None
    reason = unsupported("fsdp", wl)
    assert "fsdp" in reason and "HINT:" in reason
    with pytest.raises(ConfigError, match="zero3"):
        check_supported("zero3", wl)


def test_cli_reports_pinned_host_memory(capsys):
    code = main(["estimate", "--model", "gpt2", "--offload-activations", "--fast", "--seq-len", "256"])
    out = capsys.readouterr().out
    assert code == 0
    assert "pinned host memory (streamed activation offload)" in out


def test_ddp_rank_needs_the_single_gpu_pinned_host_bytes():
    from llmem_plugin.estimate import estimate
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods import Layout, estimate_method

    wl = Workload(seq_len=32, micro_batch_size=2, offload_activations="save-on-cpu")
    cfg = tiny_config("llama")
    single = estimate(cfg, wl)
    ddp = estimate_method("ddp", cfg, wl, layout=Layout(num_gpus=2), gpu=get_gpu("h100-sxm"))
    # DDP's forward saves what the module saves; its buckets hold gradients, not saved tensors.
    assert ddp.ranks[0].host_bytes == single.host_peak_bytes > 0
