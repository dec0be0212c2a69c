"""QLoRA stand-ins: stored bytes against bitsandbytes' layout and real
quantize_4bit outputs, the matmul's CUDA allocations against MatMul4Bit's
source, and the fake trace against a real CPU run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from llmem_plugin.models import modelbuild
from llmem_plugin.techniques import quant
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.methods import method_names
from llmem_plugin.techniques import check_supported
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, Phase, round_allocation
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config
from tests.trace.test_fake_equals_real import fake_and_real

bnbf = pytest.importorskip("bitsandbytes.functional")

SHAPES = [(256, 128), (33, 7), (100, 3), (160, 64), (4096, 520)]


def closed_form_tensors(out_features: int, in_features: int, double_quant: bool) -> list[int]:
    """bitsandbytes 0.50.2 layout, bytes per stored tensor: two 4-bit values
    per uint8, one fp32 absmax per 64 values, a 16-entry fp32 code; double
    quant: uint8 absmax, fp32 absmax per 256 of them, a 256-entry fp32 code
    and an fp32 offset."""
    n = out_features * in_features
    blocks = math.ceil(n / 64)
    packed = [math.ceil(n / 2), 16 * 4]
    if not double_quant:
        return packed + [4 * blocks]
    return packed + [blocks, 4 * math.ceil(blocks / 256), 256 * 4, 4]


def closed_form_bytes(out_features: int, in_features: int, double_quant: bool) -> int:
    return sum(closed_form_tensors(out_features, in_features, double_quant))


def standin_bytes(m: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_stored_tensors_equal_bitsandbytes(shape, double_quant, quant_type):
    out_f, in_f = shape
    torch.manual_seed(0)
    linear = nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16)
    spec = quant.QuantSpec(quant_type=quant_type, double_quant=double_quant, compute_dtype=torch.bfloat16)
    layer = quant.Linear4bitStandIn.from_linear(linear, spec)
    packed, state = bnbf.quantize_4bit(linear.weight.detach(), blocksize=64, compress_statistics=double_quant,
                                       quant_type=quant_type)
    real = {"weight": packed, "quant_code": state.code, "absmax": state.absmax}
    if double_quant:
        real.update(nested_absmax=state.state2.absmax, nested_code=state.state2.code, absmax_offset=state.offset)
    mine = dict(layer.named_parameters()) | dict(layer.named_buffers())
    assert sorted(mine) == sorted(real)
    for name, t in real.items():
        assert (mine[name].shape, mine[name].dtype) == (t.shape, t.dtype), name
        assert torch.equal(mine[name], t), name
    assert standin_bytes(layer) == closed_form_bytes(out_f, in_f, double_quant)
    meta = quant.Linear4bitStandIn(in_f, out_f, bias=False, spec=spec, device="meta")
    assert standin_bytes(meta) == closed_form_bytes(out_f, in_f, double_quant)


@pytest.mark.parametrize(("double_quant", "bias"), [(False, False), (True, False), (True, True)])
def test_forward_values_equal_bitsandbytes_linear4bit(double_quant, bias):
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=bias, dtype=torch.bfloat16)
    ref = bnb.nn.Linear4bit(128, 96, bias=bias, compute_dtype=torch.bfloat16, compress_statistics=double_quant,
                            quant_type="nf4")
    ref.weight = bnb.nn.Params4bit(linear.weight.detach().clone(), requires_grad=False,
                                   compress_statistics=double_quant, quant_type="nf4")._quantize("cpu")
    if bias:
        ref.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    spec = quant.QuantSpec(quant_type="nf4", double_quant=double_quant, compute_dtype=torch.bfloat16)
    layer = quant.Linear4bitStandIn.from_linear(linear, spec)
    x = torch.randn(2, 8, 128, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    out, out_ref = layer(x), ref(x2)
    assert out.dtype == out_ref.dtype == torch.float32  # cast back to the input dtype
    torch.testing.assert_close(out, out_ref)
    out.sum().backward()
    out_ref.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def _allocations(fn) -> list[int]:
    tracker = MemoryTracker()
    with tracker:
        fn()
    return [e[2] for e in tracker.result().events if e[0] == 1]


def test_matmul_allocates_what_cuda_matmul4bit_allocates():
    """bitsandbytes 0.50.2, M = 2048 > 1536 rows: gemm_4bit's dequantize +
    F.linear fallback (backends/cuda/ops.py), then backward's dequantize_4bit
    and matmul (autograd/_functions.py MatMul4Bit)."""
    torch.manual_seed(0)
    n, k, m = 96, 128, 2048
    spec = quant.QuantSpec(quant_type="nf4", double_quant=True, compute_dtype=torch.bfloat16)
    layer = quant.Linear4bitStandIn.from_linear(nn.Linear(k, n, bias=False), spec)
    x = torch.randn(1, m, k, requires_grad=True)
    blocks = n * k // 64
    holder = {}

    def step():
        holder["out"] = layer(x)
        holder["out"].sum().backward()

    events = _allocations(step)
    forward = [m * k * 2,  # x.to(bf16)
               blocks * 4, blocks * 4,  # nested absmax in fp32, + offset
               n * k * 2,  # B_dq (N, K) bf16
               m * n * 2,  # F.linear output
               m * n * 4]  # .to(fp32)
    backward_matmul = [blocks * 4, n * k * 2, m * k * 2]  # nested absmax, dequantized weight, grad_A
    # The tracker rounds each request as the CUDA caching allocator does.
    forward, backward_matmul = ([round_allocation(b) for b in seq] for seq in (forward, backward_matmul))
    assert events[:len(forward)] == forward
    assert _subsequence(backward_matmul, events[len(forward):])


def _subsequence(needle: list[int], hay: list[int]) -> bool:
    return any(hay[i:i + len(needle)] == needle for i in range(len(hay)))


def test_kernel_choice_follows_bitsandbytes_tiers():
    h100 = {"compute_capability": (9, 0), "num_sms": 132}
    # Past 1536 rows always the fallback; up to 4 rows always the fused kernel.
    assert not quant.uses_fused_kernel(2048, 64, 64, torch.bfloat16, **h100)
    assert quant.uses_fused_kernel(4, 4096, 4096, torch.bfloat16, **h100)
    # Small weight, very short K (2K < N), low wave on sm90: fused up to 512 rows.
    assert quant.uses_fused_kernel(512, 160, 64, torch.bfloat16, **h100)
    assert not quant.uses_fused_kernel(513, 160, 64, torch.bfloat16, **h100)
    # Small square weight under a quarter wave: fused up to 32 rows.
    assert quant.uses_fused_kernel(32, 64, 64, torch.bfloat16, **h100)
    assert not quant.uses_fused_kernel(33, 64, 64, torch.bfloat16, **h100)
    # Large weights above 512 rows: the fallback; fp32 has no MMA kernel.
    assert not quant.uses_fused_kernel(513, 4096, 4096, torch.bfloat16, **h100)
    assert not quant.uses_fused_kernel(8, 4096, 4096, torch.float32, **h100)
    # Large weights at 8-512 rows on sm90: by waves of 64-column tiles over 132 SMs.
    assert quant.uses_fused_kernel(32, 14336, 4096, torch.bfloat16, **h100)  # 224 tiles: >= 1 wave, M <= 32
    assert not quant.uses_fused_kernel(33, 14336, 4096, torch.bfloat16, **h100)
    assert not quant.uses_fused_kernel(8, 4096, 4096, torch.bfloat16, **h100)  # 64 tiles: < half a wave
    assert quant.uses_fused_kernel(7, 4096, 4096, torch.bfloat16, **h100)  # 5-7 rows: SIMT
    with pytest.raises(UnsupportedError, match="not modelled"):
        quant.uses_fused_kernel(256, 4096, 4096, torch.bfloat16, compute_capability=(8, 6), num_sms=84)


QLORA = {
    "nf4-dq-bf16-mixed": {"seq_len": 64, "micro_batch_size": 2, "precision": "bf16-mixed", "quantize": "nf4",
                          "double_quant": True},
    "fp4-fp32": {"seq_len": 32, "micro_batch_size": 1, "precision": "fp32", "quantize": "fp4"},
    "nf4-bf16-gc": {"seq_len": 64, "micro_batch_size": 2, "precision": "bf16", "quantize": "nf4",
                    "grad_checkpointing": True},
}


@pytest.mark.parametrize("name", sorted(QLORA))
def test_fake_trace_equals_real_cpu_run(name):
    wl = Workload(lora=LoraSpec(rank=4), **QLORA[name])
    fake, real = fake_and_real(tiny_config("llama"), wl)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.breakdown == real.breakdown
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def test_skipped_kbit_preparation_equals_a_real_cpu_run():
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16", quantize="nf4", kbit_prepare="off",
                  lora=LoraSpec(rank=4))
    fake, real = fake_and_real(tiny_config("llama"), wl)
    assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def test_kbit_preparation_moves_parameters_and_activations_as_documented():
    """peft's preparation makes every 16-bit parameter fp32; an fp32 RMSNorm
    weight makes Llama's residual stream fp32 (LlamaRMSNorm returns
    ``weight * hidden.to(input_dtype)``: the product takes the fp32 weight's
    dtype), so the forward holds more."""
    from llmem_plugin.estimate import estimate

    cfg = tiny_config("llama")
    runs = {p: estimate(cfg, seq_len=64, batch_size=2, precision="bf16", quantize="nf4", kbit_prepare=p,
                        lora=LoraSpec(rank=4)) for p in ("on", "off")}
    param = MemoryCategory.PARAMETER
    h, vocab, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    norms = [h] * (2 * layers + 1)
    embeddings = [vocab * h] * 2  # the input embedding and the untied LM head
    upcast = lambda sizes: sum(round_allocation(4 * n) - round_allocation(2 * n) for n in sizes)  # noqa: E731
    assert runs["on"].breakdown[param] - runs["off"].breakdown[param] == upcast(norms + embeddings)
    forward = {p: e.phase_peaks[Phase.FORWARD] - e.breakdown[param] for p, e in runs.items()}
    assert forward["off"] < forward["on"]


def test_kbit_prepare_needs_quantization():
    with pytest.raises(ConfigError, match="add --quantize nf4"):
        Workload(kbit_prepare="off")
    with pytest.raises(ConfigError, match="valid: on, off"):
        Workload(kbit_prepare="partial", quantize="nf4", lora=LoraSpec(rank=4))


@pytest.mark.parametrize(("arch", "targets", "precision"), [
    ("qwen2", ("q_proj", "v_proj"), "bf16"),
    ("gpt2", ("c_attn",), "fp16-mixed"),  # transformers Conv1D, quantized transposed
])
def test_fake_trace_equals_real_cpu_run_with_biases(arch, targets, precision):
    """Biased projections (biases kept in the compute dtype)."""
    wl = Workload(seq_len=32, micro_batch_size=1, precision=precision,
                  lora=LoraSpec(rank=4, target_modules=targets), quantize="nf4")
    fake, real = fake_and_real(tiny_config(arch), wl)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.breakdown == real.breakdown
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_parameter_bytes_move_by_the_closed_form(precision):
    from llmem_plugin.estimate import estimate

    cfg = tiny_config("llama")
    lora = LoraSpec(rank=4)
    plain = estimate(cfg, Workload(seq_len=32, precision=precision, lora=lora))
    qlora = estimate(cfg, Workload(seq_len=32, precision=precision, lora=lora, quantize="nf4"))
    h, i, layers, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    linears = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)] * layers  # lm_head is not converted
    width = 2 if precision == "bf16" else 4
    # The trace rounds each tensor as the CUDA caching allocator does.
    delta = sum(sum(map(round_allocation, closed_form_tensors(o, n, False))) - round_allocation(o * n * width)
                for o, n in linears)
    if precision == "bf16":
        # prepare_model_for_kbit_training: every other bf16 parameter (embeddings,
        # lm_head, norms) becomes fp32.
        others = [vocab * h] * 2 + [h] * (2 * layers + 1)
        delta += sum(round_allocation(4 * p) - round_allocation(2 * p) for p in others)
    param = MemoryCategory.PARAMETER
    assert qlora.breakdown[param] - plain.breakdown[param] == delta


@pytest.mark.parametrize("method", ["single", *method_names()])
def test_unsupported_methods_name_the_combination(method):
    wl = Workload(seq_len=32, lora=LoraSpec(rank=4), quantize="nf4")
    if method in ("single", "ddp"):
        check_supported(method, wl)
        return
    with pytest.raises(ConfigError, match=rf"--quantize nf4 with --method {method} .*HINT"):
        check_supported(method, wl)


def test_int8_is_refused():
    wl = Workload(seq_len=32, lora=LoraSpec(rank=4), quantize="int8")
    with pytest.raises(ConfigError, match="int8.*HINT"):
        check_supported("single", wl)
    with pytest.raises(ConfigError, match="int8.*HINT"):
        modelbuild.build_model(tiny_config("llama"), wl)


def test_ddp_buckets_only_the_lora_gradients():
    from llmem_plugin.estimate import estimate
    from llmem_plugin.methods import Layout, estimate_method

    cfg = tiny_config("llama")
    wl = Workload(seq_len=32, lora=LoraSpec(rank=4), quantize="nf4")
    ddp = estimate_method("ddp", cfg, wl, layout=Layout(num_gpus=2), gpu="h100-sxm").ranks[0].breakdown
    single = estimate(cfg, wl).breakdown
    h, r, layers = cfg.hidden_size, 4, cfg.num_hidden_layers
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    # LoRA A (r x in) and B (out x r) on q, k, v, o, fp32: DDP's one bucket holds them all.
    lora_params = layers * r * sum(i + o for o, i in [(h, h), (kv, h), (kv, h), (h, h)])
    assert ddp[MemoryCategory.COMM_BUFFER] == round_allocation(4 * lora_params)
    assert ddp[MemoryCategory.PARAMETER] == single[MemoryCategory.PARAMETER]


def test_cli_estimates_an_8b_qlora_step(capsys, monkeypatch):
    import json

    from llmem_plugin.models import catalog
    from llmem_plugin.cli.app import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["estimate", "--model", "llama-3.1-8b", "--quantize", "nf4", "--lora-rank", "16",
                 "--seq-len", "256", "--fast", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    cfg = catalog.load_config("llama-3.1-8b")
    h, i, layers, vocab, r = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size, 16
    kv = h // cfg.num_attention_heads * cfg.num_key_value_heads
    attn = [(h, h), (kv, h), (kv, h), (h, h)]
    linears = [*attn, (i, h), (i, h), (h, i)]
    per_layer = sum(sum(map(round_allocation, closed_form_tensors(o, n, False))) for o, n in linears)
    per_layer += sum(round_allocation(4 * r * n) + round_allocation(4 * o * r) for o, n in attn)  # fp32 LoRA A, B
    per_layer += 2 * round_allocation(4 * h)  # the two RMSNorm weights
    # fp32 (bf16-mixed): embeddings, LM head, final norm; the rotary buffers
    # inv_freq and original_inv_freq (head_dim / 2 each).
    rotary = round_allocation(4 * (h // cfg.num_attention_heads // 2))
    rest = 2 * round_allocation(4 * vocab * h) + round_allocation(4 * h) + 2 * rotary
    assert data["breakdown"]["parameters"] == layers * per_layer + rest


# ----------------------------------------------------------------------------- bitsandbytes versions

def _live_bytes(tracker: MemoryTracker) -> int:
    return sum(e[2] if e[0] == 1 else -e[2] for e in tracker.result().events)


@pytest.mark.parametrize(("version", "holds"), [("0.41.1", True), ("0.42.0", True), ("0.43.1", True),
                                                ("0.43.2", False), ("0.50.2", False)])
def test_old_matmul_keeps_its_input_until_the_loss_is_freed(version, holds):
    """bitsandbytes before 0.43.2 (autograd/_functions.py at tag 0.42.0:
    ``ctx.tensors = (A, B)``; PR #1270 dropped A): the compute-dtype copy of
    the input outlives backward while the loss, the graph's root, lives."""
    spec = quant.QuantSpec(quant_type="nf4", double_quant=False, compute_dtype=torch.bfloat16, bnb_version=version)
    layer = quant.Linear4bitStandIn.from_linear(nn.Linear(128, 96, bias=False), spec)
    m, k = 64, 128
    x = torch.randn(1, m, k, requires_grad=True)  # fp32: the layer casts it to a new bf16 tensor
    tracker = MemoryTracker()
    with tracker:
        loss = layer(x).sum()
        after_forward = _live_bytes(tracker)
        loss.backward()
        after_backward = _live_bytes(tracker)
        del loss
        freed = _live_bytes(tracker)
    copy = round_allocation(m * k * 2)
    grad = round_allocation(m * k * 4)  # x.grad (fp32), created by backward and kept
    scalar = round_allocation(4)  # the loss
    # After the forward only the loss and (before 0.43.2) the copy are live; backward adds x.grad.
    held = copy if holds else 0
    assert (after_forward, after_backward, freed) == (scalar + held, scalar + held + grad, grad)


def test_old_matmul_dequantizes_for_every_training_matmul():
    """Before 0.50.0 there is no fused 4-bit GEMM: even 8 rows (which 0.50.2
    runs fused on an H100) dequantize the weight (tag 0.42.0
    ``MatMul4Bit.forward``: ``F.linear(A, F.dequantize_4bit(B, state).to(A.dtype).t(), bias)``;
    ``dequantize_4bit``: one fp32 nested absmax, ``+= offset`` in place)."""
    from llmem_plugin.trace.emulation import sdpa

    n, k, m = 96, 128, 8
    blocks = n * k // 64
    events = {}
    for version in ("0.42.0", "0.50.2"):
        spec = quant.QuantSpec(quant_type="nf4", double_quant=True, compute_dtype=torch.bfloat16,
                               bnb_version=version)
        layer = quant.Linear4bitStandIn.from_linear(nn.Linear(k, n, bias=False), spec)
        x = torch.randn(1, m, k, dtype=torch.bfloat16, requires_grad=True)
        with sdpa.patch_sdpa(compute_capability=(9, 0), num_sms=132):
            events[version] = _allocations(lambda: layer(x))
    old = [round_allocation(b) for b in (blocks * 4, n * k * 2, m * n * 2)]
    assert events["0.42.0"] == old
    assert events["0.50.2"] == [round_allocation(m * n * 2)]  # the fused kernel: its output only


@pytest.mark.parametrize("version", ["0.42.0", "0.43.2"])
def test_fake_trace_equals_real_cpu_run_for_older_bitsandbytes(version):
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16", quantize="nf4", kbit_prepare="off",
                  lora=LoraSpec(rank=4), bnb_version=version)
    fake, real = fake_and_real(tiny_config("llama"), wl)
    assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def test_bnb_version_is_checked_and_resolved():
    from importlib.metadata import version

    lora = LoraSpec(rank=4)
    # The default is the newest release read, on every machine; the adapters pass the installed one.
    assert Workload(quantize="nf4", lora=lora).bnb_version == "0.50.2"
    assert quant.installed_bnb_version() == version("bitsandbytes")
    assert Workload(quantize="nf4", lora=lora, bnb_version="0.45").bnb_version == "0.45.0"
    with pytest.raises(ConfigError, match="older than 0.41.0"):
        Workload(quantize="nf4", lora=lora, bnb_version="0.39.1")
    with pytest.raises(ConfigError, match="not a bitsandbytes version"):
        Workload(quantize="nf4", lora=lora, bnb_version="latest")
    assert Workload(bnb_version="0.42.0").bnb_version is None  # no 4-bit weights: no release to model
    import dataclasses

    assert dataclasses.replace(Workload(quantize="nf4", lora=lora), quantize=None, lora=None).bnb_version is None
    from llmem_plugin.cli.app import main

    assert main(["estimate", "--model", "llama-3.2-1b", "--bnb-version", "0.42.0"]) == 2
    assert quant.bnb_modelled_as("0.51.0") == "0.50.2" and quant.bnb_modelled_as("0.50.2") is None


# ----------------------------------------------------------------------------- the head and the preparation

def test_quantized_head_stores_the_closed_form_and_equals_a_real_cpu_run():
    cfg = tiny_config("llama")
    assert not cfg.tie_word_embeddings
    lora = LoraSpec(rank=4)
    base = dict(seq_len=64, micro_batch_size=2, precision="bf16", quantize="nf4", kbit_prepare="off", lora=lora)
    wl = Workload(quantize_lm_head=True, **base)
    fake, real = fake_and_real(cfg, wl)
    assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown
    plain, _ = fake_and_real(cfg, Workload(**base))
    v, h = cfg.vocab_size, cfg.hidden_size
    param = MemoryCategory.PARAMETER
    packed = sum(map(round_allocation, closed_form_tensors(v, h, False)))
    assert plain.breakdown[param] - fake.breakdown[param] == round_allocation(2 * v * h) - packed


def test_quantized_head_is_refused_where_it_cannot_be():
    lora = LoraSpec(rank=4)
    with pytest.raises(ConfigError, match="multiplies by lm_head.weight"):
        Workload(quantize="nf4", lora=lora, quantize_lm_head=True, loss="liger")
    from llmem_plugin.estimate import estimate

    cfg = tiny_config("llama")
    cfg.tie_word_embeddings = True
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        estimate(cfg, seq_len=32, batch_size=1, precision="bf16", quantize="nf4", lora=lora, quantize_lm_head=True)


def test_norms_only_preparation_upcasts_the_norm_weights_alone():
    """``norms-only``: every RMSNorm weight fp32 (2 per layer and the final
    one), embeddings and head 16-bit: the closed form between ``off`` and it."""
    from llmem_plugin.estimate import estimate

    cfg = tiny_config("llama")
    runs = {p: estimate(cfg, seq_len=64, batch_size=2, precision="bf16-mixed", quantize="nf4", kbit_prepare=p,
                        lora=LoraSpec(rank=4)) for p in ("off", "norms-only")}
    param = MemoryCategory.PARAMETER
    h = cfg.hidden_size
    norms = 2 * cfg.num_hidden_layers + 1
    assert runs["norms-only"].breakdown[param] - runs["off"].breakdown[param] == \
        norms * (round_allocation(4 * h) - round_allocation(2 * h))
    for precision, head in (("bf16-mixed", False), ("bf16", True)):
        wl = Workload(seq_len=64, micro_batch_size=2, precision=precision, quantize="nf4",
                      kbit_prepare="norms-only", quantize_lm_head=head, lora=LoraSpec(rank=4))
        fake, real = fake_and_real(cfg, wl)
        assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown
    # Pure bf16 with a 16-bit head: Llama's fp32 norm weight makes the last hidden state fp32, and the
    # bf16 head refuses it, in the real run as in the trace (no estimate of a job that cannot run).
    from llmem_plugin.errors import LLMemError
    from llmem_plugin.trace.step import trace_step

    wl = Workload(seq_len=16, precision="bf16", quantize="nf4", kbit_prepare="norms-only", lora=LoraSpec(rank=4))
    with pytest.raises(LLMemError, match="same dtype"):
        estimate(cfg, wl)
    real = modelbuild.build_model(cfg, wl, device="cpu")
    with pytest.raises(RuntimeError, match="same dtype"):
        trace_step(real, wl, vocab_size=cfg.vocab_size)


@pytest.mark.parametrize("version", ["0.42.0", "0.50.2"])
def test_weights_quantized_from_fp16_dequantize_then_cast(version):
    """Lightning's ``BitsandbytesPrecision`` quantizes from fp16
    (``_Linear4bit.quantize``: ``weight.to(device, dtype=torch.half)``), so
    ``QuantState.dtype`` is fp16 and ``F.dequantize_4bit(B, state).to(dtype)``
    (the backward in every version, the forward before 0.50.0) allocates the
    fp16 weight, then its bf16 copy, then releases the fp16 one."""
    n, k, m = 96, 128, 2048
    spec = quant.QuantSpec(quant_type="nf4", double_quant=False, compute_dtype=torch.bfloat16,
                           bnb_version=version, quant_dtype=torch.float16)
    layer = quant.Linear4bitStandIn.from_linear(nn.Linear(k, n, bias=False), spec)
    x = torch.randn(1, m, k, dtype=torch.bfloat16, requires_grad=True)
    holder = {}

    def step():
        holder["out"] = layer(x)
        holder["out"].sum().backward()

    tracker = MemoryTracker()
    with tracker:
        step()
    events = [(e[0], e[2]) for e in tracker.result().events]
    w16, out, grad_a = (round_allocation(b) for b in (n * k * 2, m * n * 2, m * k * 2))
    cast = [(1, w16), (1, w16), (-1, w16)]  # fp16 weight, bf16 copy, fp16 released
    if version == "0.42.0":
        assert events[:4] == [*cast, (1, out)]
    else:  # 0.50.2 past 1536 rows: the fallback dequantizes straight into A's dtype
        assert events[:2] == [(1, w16), (1, out)]
    assert _subsequence([(1, w16), (1, w16), (-1, w16)], events[3:])  # the backward's
    assert any(e == (1, grad_a) for e in events)
    # Values: the same as quantizing from the compute dtype's own weight, within fp16 rounding.
    torch.testing.assert_close(holder["out"].float(), (x @ quant._dequantized(layer).to(x.dtype).t()).float())


def _live_qlora(prepare: bool, double_quant: bool = False):
    """A tiny Llama as transformers + peft make a QLoRA model: every linear but
    the head replaced by a real bitsandbytes ``Linear4bit`` quantized on the
    CPU, optionally peft's k-bit preparation, then peft LoRA on q and v."""
    bnb = pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    cfg = tiny_config("llama")
    model = modelbuild.build_model(cfg, Workload(precision="bf16"), device="cpu")
    for name, m in list(model.named_modules()):
        if type(m) is nn.Linear and name != "lm_head":
            q = bnb.nn.Linear4bit(m.in_features, m.out_features, bias=False, compute_dtype=torch.bfloat16,
                                  compress_statistics=double_quant, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(m.weight.data.clone(), requires_grad=False, compress_statistics=double_quant,
                                         quant_type="nf4")._quantize("cpu")
            model.set_submodule(name, q)
    model.is_loaded_in_4bit = True
    if prepare:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return cfg, peft.get_peft_model(model, lora)


@pytest.mark.parametrize(("prepare", "double_quant"), [(False, False), (True, True)])
def test_a_live_qlora_model_is_estimated_as_its_recipe(prepare, double_quant):
    """The live model's quant states give the recipe (nf4, double quant, k-bit
    preparation), and its estimate equals the estimate of that recipe built
    from the config, event for event (the config path is the one checked
    against CUDA runs): the stand-ins hold what the quant states hold."""
    from integrations._common import live_model

    from llmem_plugin.estimate import estimate

    cfg, model = _live_qlora(prepare, double_quant)
    live = live_model(model)
    assert live.quant == {"quantize": "nf4", "double_quant": double_quant, "quantize_lm_head": False,
                          "quantized_from": None, "kbit_prepare": "on" if prepare else "off",
                          "bnb_version": quant.installed_bnb_version()}
    precision = "bf16-mixed" if prepare else "bf16"  # prepared: fp32 non-quantized weights under autocast
    wl = Workload(seq_len=32, micro_batch_size=2, precision=precision, lora=live.lora, **live.quant)
    from_live = estimate(model, wl)
    from_config = estimate(cfg, wl)
    assert from_live.peak_allocated_bytes == from_config.peak_allocated_bytes
    assert from_live.peak_reserved_bytes == from_config.peak_reserved_bytes
    assert from_live.breakdown == from_config.breakdown


def test_a_live_8bit_model_is_refused_not_estimated_as_another():
    """LLM.int8 weights (``Int8Params``) in a live model are refused in one line naming the layer."""
    bnb = pytest.importorskip("bitsandbytes")
    from llmem_plugin.estimate import estimate

    cfg = tiny_config("llama")
    model = modelbuild.build_model(cfg, Workload(precision="bf16"), device="cpu")
    linear = model.model.layers[0].mlp.down_proj
    model.model.layers[0].mlp.down_proj = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=False,
                                                              has_fp16_weights=False)
    with pytest.raises(UnsupportedError, match=r"8-bit weights \(model\.layers\.0\.mlp\.down_proj"):
        estimate(model, Workload(seq_len=16, precision="bf16"))


def test_a_live_model_whose_4bit_layers_are_not_given_to_the_workload_is_refused():
    """The stand-ins are made, but a workload without ``quantize`` would skip the method refusals and the
    loading that depend on it: refused, with the call that reads them."""
    from llmem_plugin.estimate import estimate

    _, model = _live_qlora(prepare=False)
    with pytest.raises(ConfigError, match="live_quantization"):
        estimate(model, Workload(seq_len=16, precision="bf16"))
    bnb = pytest.importorskip("bitsandbytes")
    cfg = tiny_config("llama")
    fresh = modelbuild.build_model(cfg, Workload(precision="bf16"), device="cpu")
    linear = fresh.model.layers[0].mlp.down_proj
    pending = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False, compute_dtype=torch.bfloat16)
    fresh.model.layers[0].mlp.down_proj = pending  # its Params4bit is quantized only on .cuda()
    with pytest.raises(UnsupportedError, match="not quantized yet"):
        estimate(fresh, Workload(seq_len=16, precision="bf16"))
