"""torchtune's QLoRA setup (llmem_plugin.techniques.nf4_setup): the replay of torchao's
``NF4Tensor.from_tensor`` against torchao 0.18.0's own conversion and torchao 0.1's (its source
vendored in tests/fixtures) on real CPU tensors, event for event; torchao 0.1's unchunked
conversion against its closed form; the stored bytes against
NF4's layout; the setup traced on fake tensors against a real CPU run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmem_plugin.errors import ConfigError
from llmem_plugin.models import modelbuild
from llmem_plugin.techniques import nf4, nf4_setup
from llmem_plugin.trace import loading
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, round_allocation
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config
from tests.trace.test_fake_equals_real import fake_and_real

nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

# 2048 x 1024 is two of torchao's 1024**2-element chunks; 1536 x 1024 ends on a partial one.
SHAPES = [(128, 128), (2048, 1024), (1536, 1024)]


def _traced(w, fn):
    """``fn()`` through the tracker, the weight ``w`` registered first (live throughout)."""
    tracker = MemoryTracker()
    with tracker:
        tracker.register([w], MemoryCategory.PARAMETER)
        fn()
    return tracker


def _events(w, fn):
    """(sign, bytes) of every allocation and free ``fn`` makes, through the tracker."""
    tracker = _traced(w, fn)
    return [(sign, tracker._records[idx].nbytes) for sign, idx in tracker._events]


def _weight(shape, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return torch.randn(shape, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_from_tensor_allocates_what_torchao_allocates(shape, dtype):
    """torchao 0.18.0's own from_tensor on a real CPU weight: the same allocations and frees,
    in order, and the same stored tensors."""
    w = _weight(shape, dtype)
    kept = {}

    def ours():
        kept["ours"] = nf4_setup.from_tensor(w)

    def theirs():
        kept["theirs"] = nf4_tensor.NF4Tensor.from_tensor(w, nf4.BLOCK_SIZE, nf4.SCALER_BLOCK_SIZE)

    assert _events(w, ours) == _events(w, theirs)
    for name in nf4_setup.STORED:
        a, b = kept["ours"][name], getattr(kept["theirs"], name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.untyped_storage().nbytes() == \
            b.untyped_storage().nbytes(), name
        assert torch.equal(a, b), name


def _torchao_01():
    """torchao v0.1's nf4tensor.py, vendored verbatim in tests/fixtures (torchtune 0.1 pins it)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "fixtures" / "torchao_v0_1_nf4tensor.py"
    spec = importlib.util.spec_from_file_location("torchao_v0_1_nf4tensor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shape", SHAPES)
def test_legacy_replay_allocates_what_torchao_01_allocates(shape):
    """torchao 0.1's own from_tensor (no chunks, the factor a view) and get_original_weight (what
    torchtune 0.1's clone dequantizes) on a real CPU weight: the same allocations and frees, in
    order, and the same stored tensors and storages."""
    ao01 = _torchao_01()
    w = _weight(shape)
    kept = {}
    ours = _events(w, lambda: kept.update(ours=nf4_setup.from_tensor(w, legacy=True)))
    theirs = _events(w, lambda: kept.update(theirs=ao01.NF4Tensor.from_tensor(w, nf4.BLOCK_SIZE,
                                                                              nf4.SCALER_BLOCK_SIZE)))
    assert ours == theirs
    real = kept["theirs"]
    for name in nf4_setup.STORED:
        a, b = kept["ours"][name], getattr(real, name)
        assert torch.equal(a, b) and a.untyped_storage().nbytes() == b.untyped_storage().nbytes(), name
    layer = SimpleNamespace(weight=real.quantized_data, dtype=torch.bfloat16, out_features=shape[0],
                            in_features=shape[1], **{n: getattr(real, n) for n in nf4_setup.STORED
                                                     if n != "quantized_data"})
    got = {}
    assert _events(w, lambda: got.update(ours=nf4.original_weight(layer))) == \
        _events(w, lambda: got.update(theirs=real.get_original_weight()))
    assert torch.equal(got["ours"], got["theirs"])


@pytest.mark.parametrize("shape", SHAPES)
def test_torchao_01_conversion_peak_is_its_closed_form(shape):
    """torchao 0.1 compares every element with the 16 NF4 values at once: at its peak the scaled
    weight (2 B/element), ``value - nf4`` and its ``abs()`` (16 x 2 B/element each) are live, beside
    what is kept so far: the table, the int8 scalers, the per-block factor (a view of all n/64 of
    them in 0.1), the mean and the per-block absmax (n/64 bf16)."""
    w = _weight(shape)
    n = w.numel()
    stored = {}
    peak = _traced(w, lambda: stored.update(nf4_setup.from_tensor(w, legacy=True))).result().peak_bytes
    r = round_allocation
    kept = r(16 * 2) + r(n // 64) + r(n // 64 * 2) + r(2) + r(n // 64 * 2)
    assert peak == r(2 * n) + r(2 * n) + 2 * r(32 * n) + kept  # the weight, the scaled weight, the pair
    # the values equal torchao 0.18.0's chunked conversion; only the factor's storage differs
    ref = nf4_tensor.NF4Tensor.from_tensor(w, nf4.BLOCK_SIZE, nf4.SCALER_BLOCK_SIZE)
    for name in ("quantized_scalers", "quantization_factor", "scaler_mean", "quantized_data"):
        assert torch.equal(stored[name], getattr(ref, name)), name
    assert stored["quantization_factor"].untyped_storage().nbytes() == n // 64 * 2  # [A01]: no contiguous()


def test_chunked_conversion_peak_is_its_closed_form():
    """torchao 0.18.0 compares 1024**2 elements at a time: the peak holds two chunk-sized
    ``numel x 16`` temporaries (32 MiB each in bf16), not two weight-sized ones."""
    w = _weight((2048, 1024))
    n = w.numel()
    tracker = _traced(w, lambda: nf4_setup.from_tensor(w))
    r, c = round_allocation, nf4_setup.CHUNK_SIZE
    kept = r(16 * 2) + r(n // 64) + r(n // 64 // 256 * 2) + r(2) + r(n // 64 * 2)
    # the weight, the scaled weight, the uint8 codes, then the chunk's difference and its abs
    assert tracker.result().peak_bytes == r(2 * n) + r(2 * n) + r(n) + 2 * r(32 * c) + kept


def test_skipped_chunks_change_no_allocator_peak():
    """The setup's trace runs only the chunks that can change the caching allocator's state
    (the first full one and a partial last one): replaying a weight's conversion with every chunk
    and with those gives the same allocated and reserved peaks, here after a 16-bit weight and
    with a second weight converted behind it."""
    from llmem_plugin.device.allocator import replay
    from torch._subclasses.fake_tensor import FakeTensorMode

    def peaks(every_chunk):
        tracker = MemoryTracker()
        with FakeTensorMode(), tracker:
            for shape in ((4096, 1024), (2560, 1024)):  # 4 chunks, then 2.5
                w = torch.empty(shape, dtype=torch.bfloat16)
                kept = nf4_setup.from_tensor(w, every_chunk=every_chunk)
                del w
        trace = tracker.result()
        res = replay(trace.events)
        del kept
        return res.peak_allocated_bytes, res.peak_reserved_bytes, trace.num_events

    full, short = peaks(True), peaks(False)
    assert full[:2] == short[:2] and short[2] < full[2]


def _cfg():
    return tiny_config("llama", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=4)


def _workload(load):
    return Workload(seq_len=64, micro_batch_size=2, precision="bf16", quantize="nf4-torchao", grad_checkpointing=True,
                    load=load, lora=LoraSpec(rank=4, adapter_dtype="base"))


@pytest.mark.parametrize("load", ["direct", "torchtune-0.1"])
def test_setup_ends_with_the_nf4_layout(load):
    """After the setup only the model's tensors are live: per NF4 weight of n elements, n/2 code
    bytes, n/64 int8 scalers, the factor (n/64/256 values; torchao 0.1: a view of n/64), the mean
    and the 16-entry table, all in the allocator's 512-byte blocks; and per layer torchtune's RoPE
    buffers (theta, head_dim/2 fp32; the cos/sin cache, positions x head_dim/2 x 2 fp32)."""
    cfg, wl = _cfg(), _workload(load)
    model = modelbuild.build_model(cfg, wl, device="meta")
    trace = loading.load_trace(model, wl)
    r = round_allocation
    expected = 0
    for m in model.modules():
        if isinstance(m, nf4.NF4LinearStandIn):
            n = m.in_features * m.out_features
            factor = n // 64 if load == "torchtune-0.1" else n // 64 // 256
            expected += r(n // 2) + r(n // 64) + r(factor * 2) + r(2) + r(16 * 2)
    expected += sum(r(p.numel() * p.element_size()) for n_, p in model.named_parameters()
                    if not isinstance(p, torch.nn.Parameter) or p.dtype != torch.uint8)
    expected += sum(r(b.numel() * b.element_size()) for n_, b in model.named_buffers()
                    if not any(n_.endswith(s) for s in nf4_setup.STORED))
    head_dim = cfg.hidden_size // cfg.num_attention_heads  # torchtune's RoPE buffers, one module per layer
    expected += cfg.num_hidden_layers * (r(head_dim // 2 * 4) + r(cfg.max_position_embeddings * head_dim * 4))
    mark = trace.marks[f"{loading.LOADED_MARK}:setup"]
    assert trace.timeline[mark - 1][2] == expected
    assert trace.breakdown[MemoryCategory.TEMPORARY] > 0  # the peak is a conversion's


@pytest.mark.parametrize("load", ["direct", "torchtune-0.1"])
def test_setup_fake_trace_equals_real_cpu_run(load):
    """The whole step with torchtune's setup, traced on fake tensors and run for real on the CPU."""
    fake, real = fake_and_real(_cfg(), _workload(load))
    assert fake.peak_bytes == real.peak_bytes and fake.breakdown == real.breakdown
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def test_torchtune_01_load_needs_torchao_nf4():
    with pytest.raises(ConfigError, match="torchtune-0.1"):
        Workload(load="torchtune-0.1", lora=LoraSpec(rank=4))


def test_torchtune_qlora_tutorial_setup_and_verdict(capsys, monkeypatch):
    """torchtune's QLoRA tutorial (torchtune at 0914d5cf, torchao 0.1; Llama-2-7B, LoRA r8 on every
    attention and MLP projection, batch 2 x 512, checkpointing) logs 9.13 GB reserved after model
    init and 9.29 GB reserved in training (docs/source/tutorials/qlora_finetune.rst there;
    benchmarks/published/measurements.jsonl rows tt-qlora-tut-*): the setup phase is within 5% of
    the first, and an 8 GB card does not fit it (exit 3)."""
    import json

    from llmem_plugin.cli.app import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["estimate", "--model", "llama-2-7b", "--quantize", "nf4-torchao", "--load", "torchtune-0.1",
                 "--lora-rank", "8", "--lora-alpha", "16", "--lora-targets",
                 "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--seq-len", "512", "--batch-size", "2",
                 "--grad-checkpointing", "--precision", "bf16", "--gpu-memory", "8GB", "--fast", "--json"])
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert code == 3 and not data["fits"], err
    assert abs(data["setup_reserved_bytes"] / 9.13e9 - 1) < 0.05  # torchtune logs GB = 1e9 bytes (utils/memory.py)
    assert data["peak_phase"] == "setup"
    assert abs(data["peak_reserved_bytes"] / 9.29e9 - 1) < 0.05
