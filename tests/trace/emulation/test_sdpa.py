"""Tests for llmem_plugin.trace.emulation.sdpa.

Selection cases follow sdp_utils.cpp; values are checked against the CPU
``F.scaled_dot_product_attention``; allocation sizes against closed forms read
off the CUDA sources (flash_api.cpp, attention.cu, attention_backward.cu,
kernel_backward.h, MHA.cpp), on real tensors and under FakeTensorMode alike.
"""

from __future__ import annotations

import gc
import math
import weakref
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from llmem_plugin.trace import _pause
from llmem_plugin.trace.emulation import sdpa
from llmem_plugin.trace.emulation.sdpa import CudaSdpaTarget, emulated_sdpa, patch_sdpa, select_backend
from llmem_plugin.errors import ConfigError, UnsupportedError

BF16, F32 = torch.bfloat16, torch.float32
FLASH, EFF, CUDNN, MATH = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                           SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)


def r(x: int, m: int) -> int:
    return -(-x // m) * m


def qkv(b, h, s, d, dtype, *, hk=None, s_k=None, layout="bshd", grad=True):
    """q/k/v as transformers builds them: [b, s, h, d] projections viewed as [b, h, s, d]."""
    def one(heads, seq):
        if layout == "bshd":
            t = torch.randn(b, seq, heads, d, dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(b, heads, seq, d, dtype=dtype)
        return t.detach().requires_grad_(grad)
    return one(h, s), one(hk or h, s_k or s), one(hk or h, s_k or s)


# ----------------------------------------------------------------------------- selection


@pytest.mark.parametrize(
    "cc, dtype, kwargs, expected",
    [
        ((8, 0), BF16, {}, FLASH),                      # bf16, no mask: flash on A100
        ((9, 0), BF16, {}, CUDNN),                      # cuDNN 9.20 > 9.15 on sm90: cuDNN first
        ((8, 0), F32, {}, EFF),                         # flash and cuDNN are half-only
        ((9, 0), F32, {}, EFF),
        ((8, 0), BF16, {"mask": (16, 16)}, EFF),        # flash takes no mask
        ((9, 0), BF16, {"mask": (16, 16)}, CUDNN),      # cuDNN takes 2-D/4-D masks
        ((9, 0), BF16, {"mask": (2, 16, 16)}, EFF),     # ... but not 3-D ones
        ((8, 0), BF16, {"d": 288}, EFF),                # head_dim > 256: flash out, mem-eff has no cap
        ((9, 0), BF16, {"d": 200}, FLASH),              # > 128: cuDNN 9.20 out, flash <= 256
        ((8, 0), BF16, {"d": 20}, FLASH),               # flash pads to a multiple of 8
        ((8, 0), F32, {"d": 18}, MATH),                 # mem-eff needs d % 4 == 0 for fp32
        ((8, 6), BF16, {"d": 224}, EFF),                # sm86 training with 192 < d <= 224
        ((8, 0), BF16, {"causal": True, "s_k": 32}, EFF),  # flash: causal needs s_q == s_k
        ((9, 0), BF16, {"dropout": 0.1}, FLASH),        # cuDNN dropout resolution is 1/16
        ((9, 0), BF16, {"dropout": 0.125}, CUDNN),
        ((7, 5), torch.float16, {}, EFF),               # flash needs sm80+
        # GQA
        ((8, 0), BF16, {"hk": 2, "gqa": True}, FLASH),
        ((9, 0), BF16, {"hk": 2, "gqa": True}, CUDNN),
        ((8, 0), BF16, {"hk": 2, "gqa": False}, MATH),  # no implicit GQA/MQA in 2.13
        ((8, 0), BF16, {"hk": 1, "gqa": False}, MATH),
        ((8, 0), BF16, {"hk": 2, "gqa": True, "mask": (16, 16)}, MATH),  # mem-eff has no GQA in 2.13
        ((8, 0), F32, {"hk": 2, "gqa": True}, MATH),
    ],
)
def test_select_backend(cc, dtype, kwargs, expected):
    d = kwargs.get("d", 64)
    q, k, v = qkv(2, 4, 16, d, dtype, hk=kwargs.get("hk"), s_k=kwargs.get("s_k"))
    mask = torch.randn(*kwargs["mask"], dtype=dtype) if "mask" in kwargs else None
    got = select_backend(q, k, v, mask, kwargs.get("dropout", 0.0), kwargs.get("causal", False),
                         enable_gqa=kwargs.get("gqa", False), compute_capability=cc)
    assert got == expected


def test_select_backend_cudnn_preference_depends_on_versions():
    q, k, v = qkv(2, 4, 16, 64, BF16)
    # cuDNN <= 9.15.0 is not preferred; CUDA < 13 builds prefer it only on minor 0/3.
    assert select_backend(q, k, v, compute_capability=(9, 0), cudnn_version=91500) == FLASH
    assert select_backend(q, k, v, compute_capability=(10, 3), cuda_version=12090) == CUDNN
    assert select_backend(q, k, v, compute_capability=(10, 1), cuda_version=12090) == FLASH
    assert select_backend(q, k, v, compute_capability=(10, 1), cuda_version=13000) == CUDNN
    assert select_backend(q, k, v, compute_capability=(12, 0)) == FLASH


def test_select_backend_honours_runtime_switches():
    q, k, v = qkv(2, 4, 16, 64, BF16)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        assert select_backend(q, k, v, compute_capability=(9, 0)) == EFF
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION], set_priority=True):
        assert select_backend(q, k, v, compute_capability=(9, 0)) == FLASH
    with torch.no_grad():  # no grad: sm86 may use flash with 192 < d <= 224
        q2, k2, v2 = qkv(2, 4, 16, 224, BF16, grad=False)
        assert select_backend(q2, k2, v2, compute_capability=(8, 6)) == FLASH
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError, match="No available kernel"):
        select_backend(*qkv(2, 4, 16, 64, F32), compute_capability=(9, 0))


def test_target_validates_itself():
    assert CudaSdpaTarget(compute_capability=(8, 0)).num_sms == 108
    with pytest.raises(ConfigError, match="num_sms"):
        CudaSdpaTarget(compute_capability=(8, 9))
    assert CudaSdpaTarget(compute_capability=(8, 9), num_sms=128).num_sms == 128


# ----------------------------------------------------------------------------- values


CASES = {
    # name: (cc, dtype, b, h, s, d, hk, mask, causal, expected backend)
    "flash": ((8, 0), BF16, 2, 4, 24, 32, None, False, True, FLASH),
    "flash_gqa": ((8, 0), BF16, 2, 4, 24, 32, 2, False, True, FLASH),
    "flash_pad": ((8, 0), BF16, 2, 4, 24, 20, None, False, False, FLASH),
    "efficient": ((9, 0), F32, 2, 4, 24, 32, None, False, True, EFF),
    "efficient_mask": ((8, 0), BF16, 2, 4, 24, 32, None, True, False, EFF),
    "cudnn": ((9, 0), BF16, 2, 4, 24, 32, None, False, True, CUDNN),
    "cudnn_gqa_mask": ((9, 0), BF16, 2, 4, 24, 32, 2, True, False, CUDNN),
    "math_gqa_mask": ((9, 0), F32, 2, 4, 24, 32, 2, True, False, MATH),
    "math_bf16_mask": ((9, 0), BF16, 2, 4, 24, 18, None, True, False, MATH),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_match_cpu_sdpa(name):
    cc, dtype, b, h, s, d, hk, use_mask, causal, backend = CASES[name]
    torch.manual_seed(0)
    q, k, v = qkv(b, h, s, d, dtype, hk=hk)
    mask = torch.rand(s, s) > 0.3 if use_mask else None
    if mask is not None:
        mask[:, 0] = True  # no fully masked row
    gqa = hk is not None
    assert select_backend(q, k, v, mask, 0.0, causal, enable_gqa=gqa, compute_capability=cc) == backend
    with patch_sdpa(compute_capability=cc):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    tol = 2e-2 if dtype == BF16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), atol=5 * tol, rtol=5 * tol)


def test_dropout_runs_and_is_random():
    q, k, v = qkv(2, 4, 16, 32, BF16)
    with patch_sdpa(compute_capability=(8, 0)):
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        b = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert not torch.equal(a, b)
    grads = torch.autograd.grad(a, (q, k, v), torch.ones_like(a))
    assert all(torch.isfinite(g).all() for g in grads)


def test_patch_reaches_transformers_and_restores():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    original = F.scaled_dot_product_attention
    q, k, v = qkv(1, 4, 8, 16, BF16)
    module = torch.nn.Module()
    module.is_causal = True
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with patch_sdpa(compute_capability=(8, 0)) as target, Ops():
        assert F.scaled_dot_product_attention is emulated_sdpa and target.num_sms == 108
        out, _ = sdpa_attention_forward(module, q, k, v, None)
    assert F.scaled_dot_product_attention is original
    assert out.shape == (1, 8, 4, 16)
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in seen


def test_efficient_off_sm80_sm90_is_unsupported():
    q, k, v = qkv(1, 2, 8, 16, F32)
    with patch_sdpa(compute_capability=(8, 9), num_sms=128), pytest.raises(UnsupportedError, match="sm80"):
        F.scaled_dot_product_attention(q, k, v)


# ----------------------------------------------------------------------------- allocations


class Recorder(TorchDispatchMode):
    """Records the storages each op creates (nbytes), per phase; skips untracked()."""

    def __init__(self, *existing: torch.Tensor):
        super().__init__()
        self.phase = "fwd"
        self.allocs = {"fwd": [], "bwd": []}
        self.paused = []
        self._keep = {}
        for t in existing:
            if t is not None:
                self._keep[t.untyped_storage()._cdata] = t.untyped_storage()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st._cdata in self._keep:
                continue
            if _pause.is_paused():
                self.paused.append(weakref.ref(st))
            else:
                self._keep[st._cdata] = st  # kept alive: no address reuse
                self.allocs[self.phase].append(st.nbytes())
        return out


def record(cc, make, *, causal=False, mask_fn=None, gqa=False, dropout=0.0, fake=False, only=None):
    """Allocations (bytes) of one forward and one backward through the emulation."""
    mode = FakeTensorMode() if fake else None
    with mode if mode is not None else _null(), sdpa_kernel([only]) if only else _null():
        torch.manual_seed(0)
        q, k, v = make()
        mask = mask_fn() if mask_fn else None
        with patch_sdpa(compute_capability=cc):
            out = emulated_sdpa(q, k, v, mask, dropout, causal, enable_gqa=gqa)
            grad = torch.randn_like(out)
            rec = Recorder(q, k, v, mask, out, grad)
            with rec:
                out = emulated_sdpa(q, k, v, mask, dropout, causal, enable_gqa=gqa)
                rec.phase = "bwd"
                torch.autograd.grad(out, (q, k, v), grad)
    return Counter(rec.allocs["fwd"]), Counter(rec.allocs["bwd"]), rec


def _null():
    import contextlib

    return contextlib.nullcontext()


def check(cc, make, fwd, bwd, **kw):
    for fake in (False, True):
        got_fwd, got_bwd, _ = record(cc, make, fake=fake, **kw)
        assert got_fwd == Counter(fwd), (fake, got_fwd)
        assert got_bwd == Counter(bwd), (fake, got_bwd)


def test_flash_allocations():
    b, h, s, d = 2, 4, 64, 64
    # mha_fwd: out [b,s,h,d] bf16, softmax_lse [b,h,s] fp32, rng_state uint64[2], _unused uint64[]
    fwd = [b * s * h * d * 2, b * h * s * 4, 16, 8]
    # mha_bwd: dq/dk/dv, softmax_d [b,h,r128(s)], dq_accum [b,r128(s),h,r32(d)] fp32
    bwd = [b * s * h * d * 2] * 3 + [b * h * r(s, 128) * 4, b * r(s, 128) * h * r(d, 32) * 4]
    check((8, 0), lambda: qkv(b, h, s, d, BF16), fwd, bwd, causal=True)


def test_flash_gqa_allocations():
    b, h, hk, s, d = 2, 8, 2, 64, 64
    fwd = [b * s * h * d * 2, b * h * s * 4, 16, 8]
    bwd = ([b * s * h * d * 2, b * s * hk * d * 2, b * s * hk * d * 2]
           + [b * h * r(s, 128) * 4, b * r(s, 128) * h * r(d, 32) * 4]
           + [b * s * h * d * 2] * 2)  # dk_expanded, dv_expanded [b, s_k, h, d]
    check((8, 0), lambda: qkv(b, h, s, d, BF16, hk=hk), fwd, bwd, causal=True, gqa=True)


def test_flash_split_kv_and_contiguity_copies():
    b, h, s, d = 1, 2, 512, 128
    # A100: b*h*ceil(s/64) = 16 < 0.8*2*108 and 4 key blocks of 128: the heuristic picks 4 splits.
    n = 4
    fwd = [b * s * h * d * 2, b * h * s * 4, 16, 8, n * b * h * s * 4, n * b * h * s * r(d, 32) * 4]
    # [b,h,s,d]-contiguous inputs: out and grad_out are non-contiguous as [b,s,h,d] views,
    # so _flash_attention_backward copies both (.contiguous()).
    bwd = [b * s * h * d * 2] * 3 + [b * h * r(s, 128) * 4, b * r(s, 128) * h * r(d, 32) * 4]
    bwd += [b * s * h * d * 2] * 2
    check((8, 0), lambda: qkv(b, h, s, d, BF16, layout="bhsd"), fwd, bwd)
    assert sdpa._flash_num_splits(16, 216, 4, 128) == 4
    assert sdpa._flash_num_splits(b * 8 * 64, 264, 32, 128) == 1


def test_flash_head_dim_padding_allocations():
    b, h, s, d, dp = 2, 4, 64, 20, 24
    # composite pads q/k/v (saved for backward) and slices the output;
    # backward of the slice and of the three pads allocates the unpadded/padded grads.
    fwd = [b * h * s * dp * 2] * 3 + [b * s * h * dp * 2, b * h * s * 4, 16, 8]
    bwd = [b * h * s * dp * 2]  # slice_backward: zero-filled padded grad_out
    bwd += [b * s * h * dp * 2] * 3 + [b * h * r(s, 128) * 4, b * r(s, 128) * h * r(dp, 32) * 4]
    # padding made q/k/v (hence out) [b,h,s,d]-contiguous: the [b,s,h,d] views of
    # grad_out and out are copied by .contiguous()
    bwd += [b * h * s * dp * 2] * 2
    bwd += [b * h * s * d * 2] * 3  # constant_pad_nd backward
    check((8, 0), lambda: qkv(b, h, s, d, BF16), fwd, bwd)


def test_efficient_fp32_allocations():
    b, h, s, d = 2, 4, 64, 64
    # _efficient_attention_forward: res [b,s,h,d], logsumexp [b,h,r32(s)] fp32
    fwd = [b * s * h * d * 4, b * h * r(s, 32) * 4]
    # backward, f32 kernel 64x64 k64: grads, delta via (gO*out).sum(-1).transpose().contiguous(),
    # workspace b*h*align4(gq)*4 with gq = ceil(s/64)*ceil(d/64)*(4 + 64*64) (no gK/gV in fp32)
    gq = math.ceil(s / 64) * math.ceil(d / 64) * (4 + 64 * 64)
    bwd = [b * s * h * d * 4] * 3 + [b * s * h * d * 4, b * s * h * 4, b * h * s * 4] + [b * h * r(gq, 4) * 4]
    check((9, 0), lambda: qkv(b, h, s, d, F32), fwd, bwd, causal=True)


def test_efficient_bf16_mask_allocations():
    b, h, s, d = 2, 4, 64, 64
    mask_fn = lambda: torch.randn(s, s, dtype=BF16)  # noqa: E731 - aligned, so only expanded
    fwd = [b * s * h * d * 2, b * h * r(s, 32) * 4]
    # half kernel 64x64 k64 (seq-aligned): dK/dV in registers, delta [b,h,s] computed in-kernel
    gq = math.ceil(s / 64) * math.ceil(d / 64) * (4 + 64 * 64)
    bwd = [b * s * h * d * 2] * 3 + [b * h * s * 4, b * h * r(gq, 4) * 4]
    check((8, 0), lambda: qkv(b, h, s, d, BF16), fwd, bwd, mask_fn=mask_fn)


def test_efficient_half_large_head_dim_uses_gk_gv_workspace():
    b, h, s, d = 1, 2, 64, 320  # flash caps head_dim at 256, cuDNN 9.20 at 128
    fwd = [b * s * h * d * 2, b * h * r(s, 32) * 4, b * s * h * d * 4]  # + output_accum (kMaxK 65536)
    bi, bj = 128, 64  # first fitting kernel: 128x64 k65536
    splits = min(math.ceil(s / bj), 200 // (b * h))
    gk = gv = splits * bj * r(d, bi)
    gq = math.ceil(s / bi) * math.ceil(d / bj) * (4 + bi * bj)
    bwd = [b * s * h * d * 2] * 3 + [b * h * s * 4, b * h * r(gk + gv + gq, 4) * 4]
    check((9, 0), lambda: qkv(b, h, s, d, BF16), fwd, bwd)


def test_cudnn_allocations():
    b, h, s, d = 2, 4, 64, 64
    # cudnn_seed, cudnn_offset int64[], o in q's layout, softmaxstats [b,h,s,1] fp32
    fwd = [8, 8, b * h * s * d * 2, b * h * s * 4]
    # dq/dk/dv, frontend workspace dQ_accum [b,h,s,d] + softmax_sum [b,h,s,1] fp32
    bwd = [b * h * s * d * 2] * 3 + [b * h * s * d * 4 + b * h * s * 4]
    check((9, 0), lambda: qkv(b, h, s, d, BF16), fwd, bwd, causal=True)


def test_math_allocations():
    b, h, s, d = 2, 4, 16, 8
    bhss = b * h * s * s
    # q*sqrt(scale), k^T*sqrt(scale), bmm, then _safe_softmax: softmax, isneginf (bool),
    # all (bool [b,h,s,1]), scalar 0, dead rows zeroed in place (no where output: the
    # stub CUDA device, benchmarks/results/stub-wholestep-2026-11-25.md); final bmm.
    # fp32: the casts are no-ops. matmul's reshape to [b*h, s, d] copies the scaled
    # query, which keeps the [b,s,h,d] layout of transformers' q (at::matmul ->
    # expand().reshape()).
    fwd = [b * h * s * d * 4, b * h * d * s * 4, bhss * 4, bhss * 4, bhss, b * h * s, 4, b * h * s * d * 4]
    fwd += [b * h * s * d * 4]
    got_fwd, _, _ = record((9, 0), lambda: qkv(b, h, s, d, F32, hk=2), gqa=True)
    fake_fwd, _, _ = record((9, 0), lambda: qkv(b, h, s, d, F32, hk=2), gqa=True, fake=True)
    # GQA: repeat_interleave clones k and v to h heads
    assert got_fwd == fake_fwd == Counter(fwd + [b * h * s * d * 4] * 2)


def test_math_bf16_causal_real_equals_fake():
    make = lambda: qkv(2, 4, 16, 18, BF16)  # noqa: E731
    real = record((8, 0), make, causal=True, only=MATH)
    fake = record((8, 0), make, causal=True, fake=True, only=MATH)
    assert real[0] == fake[0] and real[1] == fake[1]
    b, h, s, d = 2, 4, 16, 18
    # upcasts to fp32 (3), the [b,h,s,s] bf16 cast of the discarded second output
    assert real[0][b * h * s * d * 4] >= 3 and real[0][b * h * s * s * 2] == 1


def test_dropout_allocations_real_equal_fake():
    for cc, dtype in (((8, 0), BF16), ((9, 0), F32), ((9, 0), BF16)):
        make = lambda: qkv(2, 4, 32, 32, dtype)  # noqa: E731
        real = record(cc, make, dropout=0.25)
        fake = record(cc, make, dropout=0.25, fake=True)
        assert real[0] == fake[0] and real[1] == fake[1]


def test_untracked_storages_do_not_survive():
    _, _, rec = record((8, 0), lambda: qkv(2, 4, 32, 32, BF16, hk=2), causal=True, gqa=True)
    gc.collect()
    assert rec.paused and all(ref() is None for ref in rec.paused)
