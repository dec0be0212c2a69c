"""The DPO-style reference model: its weights, its forward's transient, fake equals real."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin.models import modelbuild
from llmem_plugin.cli.app import main
from llmem_plugin.trace.emulation import autocast_region, cuda_emulation
from llmem_plugin.errors import ConfigError
from llmem_plugin.techniques.reference import build_reference, selective_log_softmax, unsupported
from llmem_plugin.trace.step import trace_step
from llmem_plugin.techniques import check_supported
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, round_allocation
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config

_CFG = tiny_config("llama")


def _trace(wl: Workload, *, real: bool):
    tracker = MemoryTracker()
    if real:
        torch.manual_seed(0)
        model, mode = modelbuild.build_model(_CFG, wl, device="cpu"), None
    else:
        model, mode = modelbuild.build_model(_CFG, wl, device="meta"), FakeTensorMode()
    ref = build_reference(model, wl, tracker=tracker, fake_mode=mode) if wl.reference_model else None
    if not real:
        modelbuild.fakeify(model, mode)
    return trace_step(model, wl, vocab_size=_CFG.vocab_size, fake_mode=mode, tracker=tracker, reference=ref)


def _weight_bytes(dtype: torch.dtype) -> int:
    """Closed form: every parameter and buffer storage of the model, once, 512-B rounded."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(_CFG).to(dtype)
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    return sum(round_allocation(t.numel() * t.element_size()) for t in tensors)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_full_finetuning_reference_adds_the_model_weights_in_the_parameter_dtype(precision):
    wl = Workload(seq_len=32, micro_batch_size=2, precision=precision)
    plain = _trace(wl, real=False)
    with_ref = _trace(Workload(**{**wl.__dict__, "reference_model": True}), real=False)
    added = with_ref.breakdown[MemoryCategory.PARAMETER] - plain.breakdown[MemoryCategory.PARAMETER]
    assert added == _weight_bytes(wl.precision.param_dtype)


def test_lora_reference_is_the_policy_with_adapters_disabled_and_adds_no_weights():
    wl = Workload(seq_len=32, micro_batch_size=2, lora=LoraSpec(rank=4))
    plain = _trace(wl, real=False)
    with_ref = _trace(Workload(**{**wl.__dict__, "reference_model": True}), real=False)
    assert with_ref.breakdown[MemoryCategory.PARAMETER] == plain.breakdown[MemoryCategory.PARAMETER]


@pytest.mark.parametrize("loss", ["hf", "trl-fused"])
@pytest.mark.parametrize("lora", [None, LoraSpec(rank=4)], ids=["full", "lora"])
def test_fake_trace_equals_real_cpu_run(lora, loss):
    wl = Workload(seq_len=32, micro_batch_size=2, lora=lora, reference_model=True, loss=loss)
    fake, real = _trace(wl, real=False), _trace(wl, real=True)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.breakdown == real.breakdown
    assert fake.phase_peaks == real.phase_peaks
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_reference_forward_transient_is_no_larger_than_the_policy_forward(precision):
    wl = Workload(seq_len=64, micro_batch_size=2, precision=precision, reference_model=True)
    torch.manual_seed(0)
    model = modelbuild.build_model(_CFG, wl, device="cpu")
    input_ids = torch.randint(0, _CFG.vocab_size, (2, 64))
    peaks = {}
    for name in ("reference", "policy"):
        tracker = MemoryTracker()
        with cuda_emulation(autocast_dtype=wl.precision.autocast_dtype), tracker:
            if name == "reference":
                out = build_reference(model, wl, tracker=tracker)(input_ids)
                assert out.shape == (2,) and not out.requires_grad
            else:
                with autocast_region(wl.precision.autocast_dtype):
                    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
                assert loss.requires_grad
        # The frozen copy's weights are registered, so count above them.
        peaks[name] = tracker.result().peak_bytes - tracker.result().breakdown.get(MemoryCategory.PARAMETER, 0)
    assert 0 < peaks["reference"] <= peaks["policy"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_equals_log_softmax_gather(dtype):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17).to(dtype)
    index = torch.randint(0, 17, (3, 5))
    naive = torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, index), naive)


def test_unsupported_names_the_method_and_hints():
    wl = Workload(reference_model=True)
    assert unsupported("single", wl) is None and unsupported("ddp", wl) is None
    assert unsupported("zero3", Workload()) is None
    reason = unsupported("zero3", wl)
    assert "zero3" in reason and "HINT:" in reason
    with pytest.raises(ConfigError, match="fsdp"):
        check_supported("fsdp", wl)


def test_cli_reference_model_doubles_full_finetuning_parameters(capsys):
    args = ["estimate", "--model", "gpt2", "--fast", "--seq-len", "128", "--json"]
    rows = []
    for extra in ([], ["--reference-model"]):
        assert main(args + extra) == 0
        rows.append(json.loads(capsys.readouterr().out))
    plain, with_ref = (r["breakdown"]["parameters"] for r in rows)
    assert with_ref == 2 * plain
    assert rows[1]["workload"]["reference_model"] is True


def test_ddp_reference_adds_the_same_weights_as_on_one_gpu():
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods import Layout, estimate_method

    wl = Workload(seq_len=32, micro_batch_size=2)
    ranks = [estimate_method("ddp", _CFG, w, layout=Layout(num_gpus=2), gpu=get_gpu("h100-sxm")).ranks[0]
             for w in (wl, Workload(**{**wl.__dict__, "reference_model": True}))]
    added = ranks[1].breakdown["parameters"] - ranks[0].breakdown["parameters"]
    assert added == _weight_bytes(wl.precision.param_dtype)


@pytest.mark.parametrize("precision,tile_bytes", [("fp32", 4), ("bf16", 2)])
def test_trl_fused_dpo_scores_policy_and_reference_through_tiles_never_the_logits(precision, tile_bytes):
    """trl 1.16 DPOTrainer (trl/kernels/chunked_logprob.py): the policy's fused forward, the reference's
    no_grad fused forward and the policy's backward each allocate one [min(N, 4096), 32768] tile buffer in
    the compute dtype, N the scored labels (b x (s - 1) here), and nothing holds [b, s, V] logits."""
    b, s = 2, 48  # the logits (b x s x V) then outsize every weight (V x H, H = 64)
    wl = Workload(seq_len=s, micro_batch_size=b, precision=precision, lora=LoraSpec(rank=4), loss="trl-fused")
    tile = round_allocation(min(b * (s - 1), 4096) * 32768 * tile_bytes)
    logits = round_allocation(b * s * _CFG.vocab_size * 4)
    for reference, tiles_per_step in ((False, 2), (True, 3)):
        trace = _trace(Workload(**{**wl.__dict__, "reference_model": reference}), real=False)
        sizes = [n for sign, _, n in trace.events if sign > 0]
        assert sizes.count(tile) == tiles_per_step * 2, reference  # the step is traced twice
        assert max(n for n in sizes if n != tile) < logits


def test_trl_fused_dpo_needs_whole_pairs():
    from llmem_plugin.errors import ConfigError

    with pytest.raises(ConfigError, match="--batch-size 3 is odd.*HINT: pass --batch-size 2 x pairs"):
        Workload(micro_batch_size=3, reference_model=True, loss="trl-fused")
    Workload(micro_batch_size=3, reference_model=True)  # full logits: any rows


def test_trl_fused_backward_upcasts_16_bit_operands_before_torch_2_8(monkeypatch):
    """chunked_logprob.py _addmm_fp32: without addmm(out_dtype) (torch < 2.8) each 16-bit accumulation upcasts
    both operands: for the input gradient an fp32 copy of the [n, vocabulary chunk] tile and of the weight
    chunk (the tiny vocabulary is one chunk)."""
    from llmem_plugin.techniques import trl_head

    b, s = 2, 48
    wl = Workload(seq_len=s, micro_batch_size=b, precision="bf16", lora=LoraSpec(rank=4), loss="trl-fused")
    n = b * (s - 1)
    tile32 = round_allocation(n * min(_CFG.vocab_size, 32768) * 4)
    weight32 = round_allocation(_CFG.vocab_size * _CFG.hidden_size * 4)
    counts = {}
    for out_dtype in (True, False):
        monkeypatch.setattr(trl_head, "_MM_OUT_DTYPE", out_dtype)
        sizes = [n_ for sign, _, n_ in _trace(wl, real=False).events if sign > 0]
        counts[out_dtype] = (sizes.count(tile32), sizes.count(weight32))
    # two traced steps; the LoRA'd model's lm_head is frozen, so only the input gradient accumulates
    assert counts[False][0] - counts[True][0] == 2 and counts[False][1] - counts[True][1] == 2
