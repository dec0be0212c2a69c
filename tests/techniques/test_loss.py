"""Loss heads (llmem_plugin.techniques.loss): values against torch, memory against closed forms and real runs.

Closed forms are written from the layouts the module cites: transformers 5.23
``ForCausalLMLoss`` (bf16 logits from lm_head under autocast, their fp32 upcast,
and log_softmax's fp32 output saved for backward: 2 + 4 + 4 bytes per logit),
torchtune's ``CEWithChunkedOutputLoss`` (one fp32 chunk upcast at a time) and
liger-kernel 0.8.5's ``fused_linear_cross_entropy_forward`` (its buffers listed
per test). Every allocation is rounded to the CUDA allocator's 512-byte blocks.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin.models import modelbuild
from llmem_plugin.cli.app import main
from llmem_plugin.trace.emulation import autocast_region, cuda_emulation
from llmem_plugin.errors import ConfigError
from llmem_plugin.techniques.loss import (
    IGNORE_INDEX,
    forward_with_loss,
    liger_chunk_size,
    liger_fused_linear_cross_entropy,
    unsupported,
)
from llmem_plugin.trace.step import trace_step
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, Phase
from llmem_plugin.trace.tracker import round_allocation as r
from llmem_plugin.workload import LoraSpec, Workload

from tests.conftest import tiny_config

# A vocabulary large enough that the loss dominates the tiny model's step, and
# N = b*s = 256 > 2*H, so a full bf16 logits tensor (N*V*2) is larger than any
# parameter-sized tensor (V*H*4).
V, H, B, S = 4096, 64, 2, 128
N = B * S


# Two more architectures, for the loss heads only (the shared fixtures' set stays small):
# Gemma 2 softcaps its final logits; Phi-3 fuses q/k/v.
_MORE = {
    "gemma2": lambda: __import__("transformers").Gemma2Config(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, final_logit_softcapping=5.0),
    "phi3": lambda: __import__("transformers").Phi3Config(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=0, bos_token_id=0),
}


def any_config(arch: str):
    return _MORE[arch]() if arch in _MORE else tiny_config(arch)


def llama(**overrides):
    return tiny_config("llama", vocab_size=V, **overrides)


def fake_trace(cfg, wl: Workload):
    model = modelbuild.build_model(cfg, wl, device="meta")
    mode = FakeTensorMode()
    modelbuild.fakeify(model, mode)
    return trace_step(model, wl, vocab_size=cfg.vocab_size, fake_mode=mode)


def real_trace(cfg, wl: Workload):
    torch.manual_seed(0)
    return trace_step(modelbuild.build_model(cfg, wl, device="cpu"), wl, vocab_size=cfg.vocab_size)


def forward_peak(cfg, **kw) -> int:
    return fake_trace(cfg, Workload(seq_len=S, micro_batch_size=B, **kw)).phase_peaks[Phase.FORWARD]


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("frozen_weight", [False, True])
def test_liger_emulation_matches_torch_cross_entropy(frozen_weight):
    torch.manual_seed(0)
    x = torch.randn(100, 16, requires_grad=True)
    w = torch.randn(200, 16, requires_grad=not frozen_weight)
    t = torch.randint(0, 200, (100,))
    t[::7] = IGNORE_INDEX
    # liger_chunk_size(100, 16, 200) = 8 rows: 13 chunks, the last one short.
    assert liger_chunk_size(100, 16, 200) == 8
    loss = liger_fused_linear_cross_entropy(x, w, t)
    (loss * 0.5).backward()  # a scale != 1 takes liger's in-place scaling path
    got = (loss.detach(), x.grad, None if frozen_weight else w.grad)
    x.grad = None
    w.grad = None
    ref = F.cross_entropy(x @ w.t(), t)
    (ref * 0.5).backward()
    torch.testing.assert_close(got[0], ref.detach())
    torch.testing.assert_close(got[1], x.grad)
    if frozen_weight:
        assert w.grad is None
    else:
        torch.testing.assert_close(got[2], w.grad)


def _loss_and_grads(model, wl: Workload, input_ids):
    model.zero_grad(set_to_none=True)
    if wl.loss.value == "hf" and not wl.logits_to_keep:
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False)["loss"]
    else:
        loss = forward_with_loss(model, input_ids, input_ids, wl)["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's tiny config ties lm_head to the embeddings
def test_chunked_and_liger_give_the_models_own_loss_and_gradients(arch):
    cfg = tiny_config(arch)
    wl = Workload(seq_len=32, micro_batch_size=2, precision="fp32")
    torch.manual_seed(0)
    model = modelbuild.build_model(cfg, wl, device="cpu")
    input_ids = torch.randint(0, cfg.vocab_size, (2, 32))
    ref_loss, ref_grads = _loss_and_grads(model, wl, input_ids)
    for loss in ("chunked", "liger"):
        got_loss, got_grads = _loss_and_grads(model, Workload(**{**wl.__dict__, "loss": loss}), input_ids)
        torch.testing.assert_close(got_loss, ref_loss)
        assert got_grads.keys() == ref_grads.keys()
        for name, g in got_grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-4, msg=f"{loss}: {name}")


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])  # gemma2: final-logit softcapping on every chunk
def test_no_upcast_and_chunked_give_the_models_own_loss(arch):
    cfg = any_config(arch)  # gemma2: a softcap of 5, which the random logits reach, so it matters
    wl = Workload(seq_len=32, micro_batch_size=2, precision="fp32")
    torch.manual_seed(0)
    model = modelbuild.build_model(cfg, wl, device="cpu")
    input_ids = torch.randint(0, cfg.vocab_size, (2, 32))
    ref_loss, ref_grads = _loss_and_grads(model, wl, input_ids)
    for kw in ({"loss": "no-upcast"}, {"loss": "chunked"}, {"loss": "chunked", "loss_chunk_upcast": False}):
        got_loss, got_grads = _loss_and_grads(model, Workload(**{**wl.__dict__, **kw}), input_ids)
        torch.testing.assert_close(got_loss, ref_loss, msg=str(kw))
        for name, g in got_grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-4, msg=f"{kw}: {name}")


def test_logits_to_keep_is_the_loss_of_the_last_positions():
    cfg = llama()
    wl = Workload(seq_len=32, micro_batch_size=2, precision="fp32", logits_to_keep=8)
    torch.manual_seed(0)
    model = modelbuild.build_model(cfg, wl, device="cpu")
    input_ids = torch.randint(0, V, (2, 32))
    loss = forward_with_loss(model, input_ids, input_ids, wl)["loss"]
    logits = model(input_ids=input_ids, use_cache=False).logits
    # Positions 24..30 predict tokens 25..31; position 31 has no next token.
    ref = F.cross_entropy(logits[:, 24:31].reshape(-1, V), input_ids[:, 25:32].reshape(-1))
    torch.testing.assert_close(loss, ref)


# ----------------------------------------------------------------------------- closed forms


def test_logits_to_keep_scales_the_logits_terms():
    cfg = llama()
    k1, k2 = 128, 32
    # Per kept token: bf16 logits + fp32 upcast + fp32 log_softmax (2+4+4 bytes
    # per vocab entry), lm_head's bf16 copy of its input (2*H) saved for
    # backward, and ForCausalLMLoss's int64 labels: padded (b, k+1) and shifted (b, k).
    expected = (10 * B * (k1 - k2) * V + 2 * B * (k1 - k2) * H
                + r(8 * B * (k1 + 1)) + r(8 * B * k1) - r(8 * B * (k2 + 1)) - r(8 * B * k2))
    assert forward_peak(cfg, logits_to_keep=k1) - forward_peak(cfg, logits_to_keep=k2) == expected


@pytest.mark.parametrize("chunks", [4, 8])
def test_chunked_keeps_one_fp32_chunk_transient(chunks):
    cfg = llama()
    saved = 4 * N * V - 4 * N * V // chunks  # the fp32 upcast of all but one chunk
    # The model's own forward keeps its last hidden state (fp32 under autocast: the final RMSNorm's
    # weight is fp32) through its loss; a model that returns its chunk logits has released it before
    # the chunked loss runs (torchtune's TransformerDecoder.chunked_output).
    saved += 4 * N * H
    got = forward_peak(cfg) - forward_peak(cfg, loss="chunked", loss_chunks=chunks)
    # Each chunk's cross_entropy keeps two fp32 scalars (nll_loss's output and
    # total_weight), one 512-byte block each; the full loss keeps three.
    assert saved - 512 * (2 * chunks + 3) <= got <= saved


def test_no_upcast_drops_the_fp32_copy_and_its_log_softmax():
    cfg = llama()
    # Pure bf16: ForCausalLMLoss holds the bf16 logits, their fp32 upcast and
    # log_softmax's fp32 output (2+4+4 B per logit); without the upcast,
    # log_softmax's output is bf16 (2+2 B per logit).
    got = forward_peak(cfg, precision="bf16") - forward_peak(cfg, precision="bf16", loss="no-upcast")
    # Both peaks come at nll_loss's two scalars. ForCausalLMLoss still holds its padded labels there
    # (``labels = pad(labels, (0, 1))``, int64, alive until it returns); the no-upcast loss has freed its.
    assert got == 6 * N * V + r(B * (S + 1) * 8)


def test_chunked_without_upcast_keeps_no_fp32_chunk():
    cfg = llama()
    up = forward_peak(cfg, precision="bf16", loss="chunked", loss_chunks=4)
    down = forward_peak(cfg, precision="bf16", loss="chunked", loss_chunks=4, loss_chunk_upcast=False)
    # Per chunk, log_softmax's saved output is bf16 (2 B/logit) instead of fp32
    # (4 B/logit), and the one live fp32 upcast (4 B/logit of a chunk) is gone.
    assert up - down == 2 * N * V + 4 * N * V // 4


def test_chunked_refuses_a_forward_it_cannot_read():
    from llmem_plugin.techniques.loss import logit_transform

    model = modelbuild.build_model(tiny_config("gpt2"), Workload(seq_len=16, precision="fp32"), device="cpu")
    assert logit_transform(model)(torch.ones(2)).tolist() == [1.0, 1.0]  # GPT-2: the projection alone

    class Odd(type(model)):
        def forward(self, input_ids=None, **kwargs):
            hidden_states = self.transformer(input_ids)[0]
            logits = self.lm_head(hidden_states)
            logits = logits.clamp(-1, 1)
            loss = None
            return logits, loss

    model.__class__ = Odd
    with pytest.raises(ConfigError, match="Odd.*clamp.*HINT"):
        logit_transform(model)

    class Scaled(type(model)):  # a multiplier on the projection's own line (FalconH1's lm_head_multiplier)
        def forward(self, input_ids=None, **kwargs):
            hidden_states = self.transformer(input_ids)[0]
            logits = self.lm_head(hidden_states) * 2.0
            loss = None
            return logits, loss

    model.__class__ = Scaled
    with pytest.raises(ConfigError, match="Scaled.*HINT"):
        logit_transform(model)
    # MiniCPM3 scales the hidden states before its projection (transformers' own source).
    import transformers

    minicpm = transformers.MiniCPM3ForCausalLM.__new__(transformers.MiniCPM3ForCausalLM)
    with pytest.raises(ConfigError, match="MiniCPM3ForCausalLM.*hidden_states / self.config.logits_scaling"):
        logit_transform(minicpm)


def test_no_upcast_refuses_the_router_loss():
    cfg = tiny_config("mixtral", output_router_logits=True)
    wl = Workload(seq_len=16, micro_batch_size=1, precision="bf16", loss="no-upcast")
    model = modelbuild.build_model(cfg, wl, device="cpu")
    ids = torch.zeros(1, 16, dtype=torch.long)
    with pytest.raises(ConfigError, match="output_router_logits.*HINT"):
        forward_with_loss(model, ids, ids, wl)


LIGER_CASES = {
    # precision: (param dtype, autocast dtype, closed form of liger's forward peak)
    # bf16-mixed: grad_input (N*H*4) and grad_weight (V*H*4) in the parameter
    # dtype, loss_1d fp32; per chunk bf16 logits and the bf16 cast of the input
    # chunk; autocast casts weight.t() (a view, not cached) for every chunk
    # and caches the cast of weight used by the grad_input matmul: 2 x V*H*2.
    "bf16-mixed": (torch.float32, torch.bfloat16, lambda c: N * H * 4 + V * H * 4 + r(4 * N) + 2 * V * H * 2
                   + r(c * V * 2) + r(c * H * 2)),
    # bf16: torch.mm(out=) into one preallocated (chunk, V) buffer; nothing per chunk.
    "bf16": (torch.bfloat16, None, lambda c: N * H * 2 + V * H * 2 + r(4 * N) + r(c * V * 2)),
    # fp32: the legacy grad_weight path adds a (V, H) fp32 product per chunk.
    "fp32": (torch.float32, None, lambda c: N * H * 4 + V * H * 4 + r(4 * N) + r(c * V * 4) + V * H * 4),
}


@pytest.mark.parametrize("precision", sorted(LIGER_CASES))
def test_liger_forward_allocates_its_buffers(precision):
    dtype, autocast, closed_form = LIGER_CASES[precision]
    chunk = liger_chunk_size(N, H, V)
    assert chunk == 4  # next_power_of_2(cdiv(256, cdiv(4096, 64)))
    x = torch.randn(N, H, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, dtype=dtype, requires_grad=True)
    t = torch.randint(0, V, (N,))
    with cuda_emulation(autocast_dtype=autocast), MemoryTracker() as tracker:
        tracker.register([x, w, t], MemoryCategory.INPUT)
        base = tracker.live_bytes()
        tracker.set_phase(Phase.FORWARD)
        with autocast_region(autocast):
            loss = liger_fused_linear_cross_entropy(x, w, t)
        tracker.set_phase(Phase.BACKWARD)
        (loss / 2).backward()
        del loss
    res = tracker.result()
    assert res.phase_peaks[Phase.FORWARD] - base == closed_form(chunk)
    # Backward only scales the stored gradients in place: it adds no buffer.
    assert res.phase_peaks[Phase.BACKWARD] <= res.phase_peaks[Phase.FORWARD]


def test_liger_step_never_materializes_full_logits():
    cfg = llama()
    res = fake_trace(cfg, Workload(seq_len=S, micro_batch_size=B, loss="liger"))
    sizes = {nbytes for _, _, nbytes in res.events}
    assert max(sizes) < N * V * 2
    assert liger_chunk_size(N, H, V) * V * 2 in sizes  # one chunk of bf16 logits
    hf = fake_trace(cfg, Workload(seq_len=S, micro_batch_size=B))
    assert N * V * 4 in {nbytes for _, _, nbytes in hf.events}  # the model's own fp32 logits
    assert res.peak_bytes < hf.peak_bytes


# ----------------------------------------------------------------------------- fake equals real


FAKE_REAL = {
    "chunked": ("llama", Workload(seq_len=32, micro_batch_size=2, loss="chunked", loss_chunks=4)),
    "chunked-gc-lora": ("llama", Workload(seq_len=16, micro_batch_size=1, loss="chunked", grad_checkpointing=True,
                                          lora=LoraSpec(rank=4))),
    "keep": ("llama", Workload(seq_len=32, micro_batch_size=2, logits_to_keep=8)),
    "no-upcast-bf16": ("llama", Workload(seq_len=32, micro_batch_size=2, loss="no-upcast", precision="bf16")),
    "no-upcast-keep": ("qwen2", Workload(seq_len=32, micro_batch_size=2, loss="no-upcast", logits_to_keep=8)),
    "chunked-noup-gemma2": ("gemma2", Workload(seq_len=32, micro_batch_size=2, loss="chunked", loss_chunks=4,
                                               loss_chunk_upcast=False, precision="bf16")),
    "keep-hf-trainer": ("gpt2", Workload(seq_len=32, micro_batch_size=1, logits_to_keep=8, runner="hf-trainer")),
    "liger": ("llama", Workload(seq_len=32, micro_batch_size=1, loss="liger", grad_accum_steps=2)),
    "liger-bf16-tied": ("qwen2", Workload(seq_len=32, micro_batch_size=2, loss="liger", precision="bf16")),
    "liger-lora-gc": ("llama", Workload(seq_len=16, micro_batch_size=1, loss="liger", lora=LoraSpec(rank=4),
                                        grad_checkpointing=True)),
}


@pytest.mark.parametrize("name", sorted(FAKE_REAL))
def test_fake_trace_equals_real_cpu_run(name):
    arch, wl = FAKE_REAL[name]
    cfg = any_config(arch)
    fake, real = fake_trace(cfg, wl), real_trace(cfg, wl)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.phase_peaks == real.phase_peaks
    assert fake.breakdown == real.breakdown
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


# ----------------------------------------------------------------------------- support and errors


def test_unsupported_names_the_combination():
    assert unsupported("fsdp", Workload()) is None
    assert unsupported("tp", Workload(logits_to_keep=4)) is None
    assert unsupported("ddp", Workload(loss="liger")) is None
    for method in ("fsdp", "zero3", "tp"):
        reason = unsupported(method, Workload(loss="liger"))
        assert f"'{method}'" in reason and "HINT" in reason
    reason = unsupported("single", Workload(loss="chunked", logits_to_keep=4))
    assert "--logits-to-keep 4" in reason and "HINT" in reason


def test_unmodelled_architecture_raises():
    assert unsupported("zero3", Workload(loss="no-upcast")) is None  # the model's own forward: any method
    cfg = tiny_config("gpt2")
    wl = Workload(seq_len=16, micro_batch_size=1, precision="fp32", loss="liger")
    model = modelbuild.build_model(cfg, wl, device="cpu")
    ids = torch.zeros(1, 16, dtype=torch.long)
    with pytest.raises(ConfigError, match="architecture 'gpt2'.*HINT"):
        forward_with_loss(model, ids, ids, wl)


def test_cli_liger_and_chunked_report_less_than_hf(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    peaks = {}
    for loss in ("hf", "liger", "chunked"):
        code = main(["estimate", "--model", "llama-3.2-1b", "--seq-len", "4096", "--loss", loss, "--fast", "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        peaks[loss] = json.loads(out)["peak_allocated_bytes"]
    # At 4096 tokens the model's own loss holds 4096 * 128256 logits in fp32
    # (about 2 GiB each copy); the fused and chunked losses do not.
    assert peaks["liger"] < peaks["hf"]
    assert peaks["chunked"] < peaks["hf"]
