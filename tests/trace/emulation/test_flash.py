"""Tests for llmem_plugin.trace.emulation.flash (flash_attention_2 through transformers).

Allocation sizes are checked against closed forms read off flash-attn 2.8.3
(``flash_attn/flash_attn_interface.py`` FlashAttnFunc, ``csrc/flash_attn/flash_api.cpp``
mha_fwd/mha_bwd), on real tensors and under FakeTensorMode alike; values
against the CPU ``F.scaled_dot_product_attention``; a whole tiny-Llama step
against the repo's SDPA emulation and against a real CPU run.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from llmem_plugin.trace import _pause
from llmem_plugin.models import modelbuild
from llmem_plugin.cli.app import main
from llmem_plugin.cli.options import EXIT_BAD_INPUT
from llmem_plugin.trace.emulation import flash
from llmem_plugin.trace.emulation.flash import (
    ATTN_NAME,
    attn_implementation_name,
    flash_attn_func,
)
from llmem_plugin.errors import ConfigError
from llmem_plugin.trace.step import trace_step
from llmem_plugin.techniques import check_supported
from llmem_plugin.trace.tracker import MemoryCategory, Phase
from llmem_plugin.workload import Workload
from tests.conftest import tiny_config

BF16 = torch.bfloat16


def r(x: int, m: int) -> int:
    return -(-x // m) * m


def bshd(b, s, h, d, *, grad=True, seed=0):
    """A [b, s, h, d] tensor as transformers hands it to flash-attn (after its transpose)."""
    torch.manual_seed(seed)
    return torch.randn(b, s, h, d, dtype=BF16).requires_grad_(grad)


class Recorder(TorchDispatchMode):
    """Bytes of every storage an op creates, per phase (skips untracked())."""

    def __init__(self, *existing):
        super().__init__()
        self.phase = "fwd"
        self.allocs = {"fwd": [], "bwd": []}
        self._keep = {t.untyped_storage()._cdata: t.untyped_storage() for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not _pause.is_paused():
                st = t.untyped_storage()
                if st._cdata not in self._keep and st.nbytes():
                    self._keep[st._cdata] = st  # kept alive: no address reuse
                    self.allocs[self.phase].append(st.nbytes())
        return out


def one_call(b, s, h, hk, d, *, fake, causal=True, deterministic=False):
    """Allocations of one forward and backward, and the bytes saved for backward."""
    mode = FakeTensorMode() if fake else None
    with mode if mode is not None else contextlib.nullcontext():
        q, k, v = bshd(b, s, h, d, seed=1), bshd(b, s, hk, d, seed=2), bshd(b, s, hk, d, seed=3)
        grad = torch.randn(b, s, h, d, dtype=BF16)
        saved = {}

        def pack(t):
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        rec = Recorder(q, k, v, grad)
        with rec:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)
            rec.phase = "bwd"
            torch.autograd.grad(out, (q, k, v), grad)
    return Counter(rec.allocs["fwd"]), Counter(rec.allocs["bwd"]), sum(saved.values())


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("b,s,h,hk,d", [(2, 256, 8, 8, 64), (2, 256, 8, 2, 64), (1, 200, 4, 2, 20)])
def test_one_call_allocations_equal_closed_form(fake, b, s, h, hk, d):
    dp = r(d, 8)  # FlashAttnFunc pads the head dim to a multiple of 8
    padded = dp != d
    q_b, kv_b = b * s * h * dp * 2, b * s * hk * dp * 2
    lse, rng = b * h * s * 4, 2 * 8  # softmax_lse [b, h, s] fp32, rng_state int64[2]
    # Saved: q, k, v (padded when d % 8), out_padded, softmax_lse, rng_state.
    want_saved = q_b + 2 * kv_b + q_b + lse + rng
    # Forward: pads, out = empty_like(q), softmax_lse, rng_state (head dim <= 64: the
    # split-KV blocks hold 256 keys, one block here, so no split and no accumulators).
    fwd = ([q_b, kv_b, kv_b] if padded else []) + [q_b, lse, rng]
    # Backward: dq/dk/dv = empty_like, dout padded, softmax_d [b, h, r128(s)],
    # dq_accum [b, r128(s), h, r32(d)] fp32, GQA: dk/dv_expanded [b, s, h, d].
    bwd = [q_b, kv_b, kv_b] + ([q_b] if padded else [])
    bwd += [b * h * r(s, 128) * 4, b * r(s, 128) * h * r(dp, 32) * 4]
    bwd += [q_b, q_b] if hk != h else []
    got_fwd, got_bwd, saved = one_call(b, s, h, hk, d, fake=fake)
    assert saved == want_saved
    assert got_fwd == Counter(fwd)
    assert got_bwd == Counter(bwd)


def test_split_kv_and_deterministic_workspaces():
    b, s, h, d = 1, 512, 2, 128
    # H100: b*h*ceil(s/64) = 16 < 0.8*264, 4 key blocks of 128: num_splits_heuristic picks 4,
    # adding softmax_lse_accum [4, b, h, s] and out_accum [4, b, h, s, r32(d)] fp32.
    fwd, bwd, _ = one_call(b, s, h, h, d, fake=True, deterministic=True)
    assert fwd == Counter([b * s * h * d * 2, b * h * s * 4, 16, 4 * b * h * s * 4, 4 * b * h * s * d * 4])
    # deterministic: dq_accum zeros [ceil(132 / (b*h)), b, r128(s), h, r32(d)]
    assert bwd == Counter([b * s * h * d * 2] * 3 + [b * h * s * 4, 66 * b * s * h * d * 4])


@pytest.mark.parametrize("hk,d", [(4, 32), (2, 32), (4, 20)])
def test_values_equal_torch_sdpa(hk, d):
    b, s, h = 2, 48, 4
    q, k, v = bshd(b, s, h, d, seed=1), bshd(b, s, hk, d, seed=2), bshd(b, s, hk, d, seed=3)
    out = flash_attn_func(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                         enable_gqa=hk != h).transpose(1, 2)
    assert out.shape == (b, s, h, d) and out.dtype == BF16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=1e-1, rtol=1e-1)


def test_registered_model_matches_sdpa_model_and_reports_flash(monkeypatch):
    cfg = tiny_config("llama")
    calls = []
    original = flash.flash_attn_func
    monkeypatch.setattr(flash, "flash_attn_func", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    logits = {}
    for attn in ("sdpa", "flash_attention_2"):
        wl = Workload(seq_len=32, micro_batch_size=2, precision="bf16", attn_implementation=attn)
        torch.manual_seed(0)
        model = modelbuild.build_model(cfg, wl, device="cpu")
        ids = torch.arange(64).reshape(2, 32) % cfg.vocab_size
        logits[attn] = model(input_ids=ids).logits.float()
    torch.testing.assert_close(logits["flash_attention_2"], logits["sdpa"], atol=5e-2, rtol=5e-2)
    # one kernel call per layer, causal, with the model's scaling (transformers' kwargs)
    assert [c["causal"] for c in calls] == [True] * cfg.num_hidden_layers
    assert calls[0]["softmax_scale"] == cfg.head_dim ** -0.5
    assert model.config._attn_implementation == ATTN_NAME
    from transformers.utils.generic import is_flash_attention_requested

    assert is_flash_attention_requested(model.config)  # the model takes its flash branches
    from transformers.masking_utils import create_causal_mask

    emb = torch.zeros(2, 32, cfg.hidden_size)
    assert create_causal_mask(model.config, emb, None, None, position_ids=None) is None


def step(cfg, attn, *, fake=True):
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed", attn_implementation=attn)
    if fake:
        model = modelbuild.build_model(cfg, wl, device="meta")
        mode = FakeTensorMode()
        modelbuild.fakeify(model, mode)
        return trace_step(model, wl, vocab_size=cfg.vocab_size, fake_mode=mode)
    torch.manual_seed(0)
    return trace_step(modelbuild.build_model(cfg, wl, device="cpu"), wl, vocab_size=cfg.vocab_size)


@pytest.mark.parametrize("overrides", [{}, {"head_dim": 20}])
def test_step_moves_activations_by_closed_form(overrides):
    cfg = tiny_config("llama", **overrides)
    sdpa_run, flash_run = step(cfg, "sdpa"), step(cfg, "flash_attention_2")
    # Both save q, k, v (autocast casts), the output (b*s*h*d*2) and an fp32 softmax
    # statistic of b*h*s*4 bytes per layer. The SDPA kernel (cuDNN on H100, torch's
    # flash for a head dim of 20) also keeps two RNG tensors, flash-attn one int64[2]
    # rng_state: one 512-byte block (CUDA caching allocator kMinBlockSize) less per layer.
    diff = cfg.num_hidden_layers * 512
    act = MemoryCategory.ACTIVATION
    assert sdpa_run.phase_breakdowns[Phase.FORWARD][act] - flash_run.phase_breakdowns[Phase.FORWARD][act] == diff
    assert sdpa_run.phase_peaks[Phase.FORWARD] - flash_run.phase_peaks[Phase.FORWARD] == diff


def test_fake_trace_equals_real_cpu_run():
    cfg = tiny_config("llama")
    fake, real = step(cfg, "flash_attention_2"), step(cfg, "flash_attention_2", fake=False)
    assert fake.peak_bytes == real.peak_bytes
    assert fake.breakdown == real.breakdown
    assert fake.phase_peaks == real.phase_peaks
    assert [e[2] for e in fake.events] == [e[2] for e in real.events]


def test_unsupported_settings_raise():
    wl = Workload(seq_len=64, micro_batch_size=1, precision="fp32", attn_implementation="flash_attention_2")
    reason = flash.unsupported("single", wl)
    assert "--precision fp32" in reason and "HINT" in reason
    with pytest.raises(ConfigError, match="flash_attention_2"):
        check_supported("fsdp", wl)
    ok = Workload(seq_len=64, micro_batch_size=1, precision="bf16-mixed", attn_implementation="flash_attention_2")
    assert flash.unsupported("single", ok) is None
    with pytest.raises(ConfigError, match="limit of 256"):
        modelbuild.build_model(tiny_config("llama", head_dim=320), ok)
    q = bshd(1, 8, 2, 16)
    with pytest.raises(ConfigError, match="fp16 or bf16"):
        flash_attn_func(q.float(), q.float(), q.float())
    assert attn_implementation_name() == ATTN_NAME


def test_architecture_without_flash_support_is_refused():
    import transformers

    model = transformers.LlamaForCausalLM(tiny_config("llama"))
    model._supports_flash_attn = False
    with pytest.raises(ConfigError, match="does not support --attn flash_attention_2"):
        flash.check_model(model)


def test_cli_estimate_runs(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["estimate", "--model", "llama-3.2-1b", "--attn", "flash_attention_2", "--fast", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["params"] == 1_235_814_400
    code = main(["estimate", "--model", "llama-3.2-1b", "--attn", "flash_attention_2", "--precision", "fp32",
                 "--fast"])
    assert code == EXIT_BAD_INPUT and "--precision" in capsys.readouterr().err
