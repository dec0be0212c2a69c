"""torchao NF4 (torchtune's QLoRA): the stand-in against torchao's own NF4Tensor
and linear_nf4 on the CPU (stored tensors, values, every allocation of a
forward and backward), its stored bytes against the layout's closed form,
the fake trace against a real CPU run, and the refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmem_plugin.techniques import nf4
from llmem_plugin.techniques import quant
from llmem_plugin.errors import ConfigError
from llmem_plugin.trace.tracker import MemoryTracker, round_allocation
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config
from tests.trace.test_fake_equals_real import fake_and_real

nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
to_nf4 = nf4_tensor.to_nf4
linear_nf4 = nf4_tensor.linear_nf4

# Element counts torchao takes: a multiple of 64 x 256.
SHAPES = [(128, 128), (256, 128), (96, 512)]


def _layer(shape, dtype=torch.bfloat16, seed=0):
    out_f, in_f = shape
    torch.manual_seed(seed)
    linear = nn.Linear(in_f, out_f, bias=False, dtype=dtype)
    return linear, nf4.NF4LinearStandIn.from_linear(linear)


@pytest.mark.parametrize("shape", SHAPES)
def test_stored_tensors_equal_torchao(shape):
    linear, layer = _layer(shape)
    real = to_nf4(linear.weight.detach())
    stored = {"weight": real.quantized_data, "quantized_scalers": real.quantized_scalers,
              "quantization_factor": real.quantization_factor, "scaler_mean": real.scaler_mean, "nf4": real.nf4}
    mine = dict(layer.named_parameters()) | dict(layer.named_buffers())
    assert set(mine) == set(stored)
    for name, t in stored.items():
        assert mine[name].shape == t.shape and mine[name].dtype == t.dtype, name
        assert torch.equal(mine[name], t), name
    # closed form ([A] from_tensor): n/2 packed bytes, one int8 scaler per 64 values, one factor per
    # 256 scalers and the mean in the weight's dtype, a 16-entry table
    n = shape[0] * shape[1]
    assert sum(t.numel() * t.element_size() for t in mine.values()) == n // 2 + n // 64 + 2 * (n // 16384 + 1 + 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_and_backward_values_equal_linear_nf4(dtype):
    linear, layer = _layer((256, 128), dtype=dtype)
    real = to_nf4(linear.weight.detach())
    x = torch.randn(3, 5, 128, dtype=dtype, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    out, ref = layer(x), linear_nf4(xr, real)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, xr.grad)


def _events(fn) -> list[tuple[int, int]]:
    tracker = MemoryTracker()
    with tracker:
        fn()
    return [(e[0], e[2]) for e in tracker.result().events]


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
def test_every_allocation_and_free_equals_torchao(input_dtype):
    """The same tracker around torchao's linear_nf4 and around the stand-in, forward and
    backward: the same allocations and frees, in the same order (a bf16 weight under an fp32
    input adds the cast copy)."""
    linear, layer = _layer((256, 128))
    real = to_nf4(linear.weight.detach())

    def run(fn):
        x = torch.randn(2, 64, 128, dtype=input_dtype, requires_grad=True)  # its own .grad each time

        def step():
            fn(x).sum().backward()
        return _events(step)

    mine, theirs = run(layer), run(lambda t: linear_nf4(t, real))
    assert mine == theirs
    # get_original_weight's peak: two int64 code tensors, two looked-up halves, the two scaled halves
    # and the stacked weight (n elements, bf16) all live at once, as the closed form says
    n = 256 * 128
    live, peak = 0, 0
    for sign, size in mine:
        live += sign * size
        peak = max(peak, live)
    assert peak >= sum(round_allocation(b) for b in (4 * n, 4 * n, n, n, n, n, 2 * n))


def test_fake_trace_equals_real_cpu_run():
    """A tiny Llama whose attention and MLP weights torchao can quantize (multiples of 16384
    elements), LoRA on q and v with bf16 adapters and dropout, checkpointing on: the fake trace
    allocates what a real CPU run of the stand-ins (torchao's quantized tensors) allocates."""
    cfg = tiny_config("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=4)
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16", quantize="nf4-torchao", grad_checkpointing=True,
                  lora=LoraSpec(rank=4, dropout=0.1, adapter_dtype="base", target_modules=("q_proj", "v_proj")))
    fake, real = fake_and_real(cfg, wl)
    assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def test_only_decoder_linears_are_quantized_and_nothing_is_upcast():
    cfg = tiny_config("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=4)
    from llmem_plugin.models import modelbuild

    wl = Workload(seq_len=32, precision="bf16", quantize="nf4-torchao", lora=LoraSpec(rank=4))
    model = modelbuild.build_model(cfg, wl)
    quantized = [n for n, m in model.named_modules() if isinstance(m, nf4.NF4LinearStandIn)]
    # q, k, v, o and the three MLP projections of each layer; the LM head stays a plain linear
    assert len(quantized) == 7 * cfg.num_hidden_layers and not any("lm_head" in n for n in quantized)
    floats = {p.dtype for n, p in model.named_parameters() if "lora_" not in n and p.is_floating_point()}
    assert floats == {torch.bfloat16}  # no k-bit preparation
    assert wl.kbit_prepare == "off" and wl.bnb_version is None


@pytest.mark.parametrize("extra, fragment", [
    ({"double_quant": True}, "--double-quant"),
    ({"kbit_prepare": "on"}, "--kbit-prepare on"),
    ({"quantize_lm_head": True}, "--quantize-lm-head"),
    ({"quantized_from": "fp16"}, "--quantized-from fp16"),
    ({"bnb_version": "0.42.0"}, "--bnb-version 0.42.0"),
])
def test_bitsandbytes_options_are_refused(extra, fragment):
    with pytest.raises(ConfigError, match="nf4-torchao") as e:
        Workload(quantize="nf4-torchao", lora=LoraSpec(rank=4), **extra)
    assert fragment in str(e.value) and "HINT" in str(e.value)


def test_shapes_torchao_cannot_quantize_are_refused():
    with pytest.raises(ConfigError, match="divide by 16384"):
        nf4.NF4LinearStandIn(64, 64, dtype=torch.bfloat16, device="meta", name="q_proj")


def test_the_cli_gives_torchtune_adapters_the_model_dtype(capsys):
    """torchtune builds its LoRALinear in the model's dtype: under --quantize nf4-torchao the CLI's
    adapter dtype defaults to base (bf16 here); an explicit fp32 stays fp32."""
    import json

    from llmem_plugin.cli.app import main

    argv = ["estimate", "--model", "llama-3.2-1b", "--seq-len", "64", "--precision", "bf16", "--lora-rank", "8",
            "--quantize", "nf4-torchao", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["lora"]["adapter_dtype"] == "base"
    assert main([*argv, "--lora-adapter-dtype", "fp32"]) == 0
    assert json.loads(capsys.readouterr().out)["workload"]["lora"]["adapter_dtype"] == "fp32"


def test_only_one_gpu_is_modelled():
    wl = Workload(quantize="nf4-torchao", lora=LoraSpec(rank=4))
    assert quant.unsupported("single", wl) is None
    assert "FSDP2" in quant.unsupported("ddp", wl) and "HINT" in quant.unsupported("fsdp", wl)
