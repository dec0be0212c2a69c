"""The setup phase (llmem_plugin.trace.loading): weights arriving on the GPU before step 1."""

from __future__ import annotations

import pytest

import llmem_plugin
from llmem_plugin.trace.loading import LOADED_MARK
from llmem_plugin.trace.tracker import Phase
from llmem_plugin.trace.tracker import round_allocation as r
from llmem_plugin.workload import LoraSpec, Workload

from tests.cli._run import run
from tests.conftest import tiny_config
from tests.trace.test_fake_equals_real import fake_and_real

LORA = LoraSpec(rank=4)
CASES = {
    "fp32-cast": dict(load="fp32-cast"),
    "fp32-cast-lora": dict(load="fp32-cast", lora=LORA),
    "nf4": dict(quantize="nf4", lora=LORA),
    "nf4-dq": dict(quantize="nf4", double_quant=True, lora=LORA),
    "nf4-kbit-off": dict(quantize="nf4", lora=LORA, kbit_prepare="off"),
    "nf4-device-quantize": dict(quantize="nf4", double_quant=True, lora=LORA, load="device-quantize"),
}


def _setup(trace) -> list[tuple[int, int, int]]:
    return trace.events[: trace.marks[f"{LOADED_MARK}:{Phase.SETUP.value}"]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_fake_equals_a_real_cpu_run(name):
    wl = Workload(seq_len=32, micro_batch_size=2, precision="bf16", **CASES[name])
    fake, real = fake_and_real(tiny_config("llama"), wl)
    assert fake.peak_bytes == real.peak_bytes and fake.phase_peaks == real.phase_peaks
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def _peak(events) -> int:
    live = peak = 0
    for sign, _, n in events:
        live += sign * n
        peak = max(peak, live)
    return peak


def test_fp32_cast_holds_every_weight_in_fp32_and_the_first_cast_one():
    # nn.Module._apply: each parameter cast, then its fp32 tensor released; all fp32 at the start.
    cfg = tiny_config("llama")
    wl = Workload(seq_len=32, micro_batch_size=2, precision="bf16", load="fp32-cast")
    fake, _ = fake_and_real(cfg, wl)
    model = llmem_plugin.models.modelbuild.build_model(cfg, wl, device="meta")
    params = list(model.parameters())
    expected = sum(r(p.numel() * 4) for p in params) + r(params[0].numel() * 2)
    assert _peak(_setup(fake)) == expected
    direct, _ = fake_and_real(cfg, Workload(seq_len=32, micro_batch_size=2, precision="bf16"))
    assert _peak(_setup(direct)) == sum(r(p.numel() * 2) for p in params) + sum(
        r(b.numel() * b.element_size()) for b in model.buffers())


def test_qlora_loads_each_quantized_weight_16_bit_first():
    cfg = tiny_config("llama")
    wl = Workload(seq_len=32, micro_batch_size=2, precision="bf16", quantize="nf4", lora=LORA)
    fake, _ = fake_and_real(cfg, wl)
    setup = _setup(fake)
    from llmem_plugin.techniques.quant import Linear4bitStandIn

    model = llmem_plugin.models.modelbuild.build_model(cfg, wl, device="meta")
    layers = [m for m in model.modules() if isinstance(m, Linear4bitStandIn)]
    sizes = [n for sign, _, n in setup if sign > 0]
    for m in layers:  # the bf16 weight arrives before its packed 4-bit form
        assert r(m.out_features * m.in_features * 2) in sizes
    frees = [rec for sign, rec, _ in setup if sign < 0]
    assert len(frees) == len(layers) + sum(  # each 16-bit weight, each 16-bit copy of what k-bit prep upcast
        1 for p in model.parameters() if p.dtype.is_floating_point and p.element_size() == 4 and not p.requires_grad)
    live = sum(sign * n for sign, _, n in setup)
    assert live == sum(r(t.numel() * t.element_size()) for t in (*model.parameters(), *model.buffers()))


def test_device_quantize_holds_the_whole_16_bit_model_then_the_first_quantized_layer():
    # The 16-bit model made on the device (every weight in parameter order, the ones k-bit preparation
    # upcasts still 16-bit), then each layer quantized in module order: before the first release the
    # device holds the whole 16-bit model plus the first layer's 4-bit weight and buffers.
    cfg = tiny_config("llama")
    wl = Workload(seq_len=32, micro_batch_size=2, precision="bf16", quantize="nf4", lora=LORA,
                  load="device-quantize")
    fake, _ = fake_and_real(cfg, wl)
    from llmem_plugin.techniques.quant import Linear4bitStandIn

    model = llmem_plugin.models.modelbuild.build_model(cfg, wl, device="meta")
    layers = [m for m in model.modules() if isinstance(m, Linear4bitStandIn)]
    quantized = {id(m.weight) for m in layers}
    sixteen = sum(r(m.out_features * m.in_features * 2) for m in layers)
    others = sum(r(p.numel() * (2 if p.element_size() == 4 else p.element_size())) for p in model.parameters()
                 if id(p) not in quantized and "lora_" not in next(n for n, q in model.named_parameters() if q is p))
    first = r(layers[0].weight.numel() * layers[0].weight.element_size()) + sum(
        r(b.numel() * b.element_size()) for b in layers[0].buffers())
    setup = _setup(fake)
    first_free = next(i for i, (sign, _, _) in enumerate(setup) if sign < 0)
    assert _peak(setup[:first_free]) == sixteen + others + first
    assert setup[first_free][2] == r(layers[0].out_features * layers[0].in_features * 2)  # its 16-bit weight


def test_the_report_gives_the_setup_phase_and_bad_values_are_one_line(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "64", "--precision", "bf16",
                       "--load", "fp32-cast")
    assert code == 0 and "setup (weights materialised in fp32" in out
    est = llmem_plugin.estimate("gpt2", seq_len=64, precision="bf16", load="fp32-cast")
    assert est.setup_allocated_bytes <= est.peak_allocated_bytes
    assert est.setup_reserved_bytes <= est.peak_reserved_bytes
    for kw, match in ((dict(load="fp32-cast", precision="fp32"), "trains in fp32"),
                      (dict(load="fp32-cast", quantize="nf4", lora=LORA), "drop --load"),
                      (dict(load="device-quantize", lora=LORA), "device-quantize"),
                      (dict(load="mmap"), "unsupported load")):
        with pytest.raises(llmem_plugin.ConfigError, match=match):
            Workload(**kw)
