"""Tests for llmem_plugin.trace.emulation.autocast.

Independent sources: the installed binary (which aten ops carry an
``AutocastCUDA`` / ``AutocastCPU`` kernel, and the dispatcher dump), the C++
header shipped in the wheel (the policy op lists), and the C++ CPU autocast
itself (its cast cache), against which the Python kernels are compared.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError, checkpoint

from llmem_plugin.trace.emulation import autocast as ac
from llmem_plugin.trace.emulation.autocast import (
    CUDA_CAST_POLICIES,
    CastPolicy,
    cuda_autocast,
    cuda_autocast_policy,
)
from llmem_plugin.errors import ConfigError

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# Ops of CUDA_CAST_POLICIES registered in autocast_mode.cpp rather than through the
# header's AT_FORALL_* lists, so the header check cannot see them.
_CPP_ONLY = {
    "aten::cudnn_convolution": CastPolicy.LOWER_PRECISION_FP,
    "aten::cudnn_convolution_transpose": CastPolicy.LOWER_PRECISION_FP,
    "aten::binary_cross_entropy": CastPolicy.BANNED,
}


def _aten_ops_with_kernel(key: str) -> set[str]:
    return {
        n
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)
    }


def _autocast_cpu_line(op: str) -> str | None:
    for line in torch._C._dispatch_dump(op).splitlines():
        if line.startswith("AutocastCPU:"):
            return line
    return None


class _OpLog(TorchDispatchMode):
    """Records (op, input dtypes, output dtype) below autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        self.calls.append((str(func), dtypes, getattr(out, "dtype", None)))
        return out

    def count(self, name: str, src: torch.dtype, dst: torch.dtype) -> int:
        return sum(1 for f, i, o in self.calls if f == name and i[:1] == (src,) and o == dst)


# ---------------------------------------------------------------------------
# The table against the binary and the header


def test_table_equals_binary_autocast_cuda_kernels():
    # No exceptions: every op with an AutocastCUDA kernel in torch 2.13 is in the table.
    assert set(CUDA_CAST_POLICIES) == _aten_ops_with_kernel("AutocastCUDA")


def test_table_policies_match_installed_header():
    header = Path(torch.__file__).parent / "include/ATen/autocast_mode.h"
    if not header.exists():
        pytest.skip("this torch wheel ships no C++ headers")
    text = header.read_text()
    macros = {
        "AT_FORALL_LOWER_PRECISION_FP": CastPolicy.LOWER_PRECISION_FP,
        "AT_FORALL_FP32": CastPolicy.FP32,
        "AT_FORALL_FP32_SET_OPT_DTYPE": CastPolicy.FP32_SET_OPT_DTYPE,
        "AT_FORALL_PROMOTE": CastPolicy.PROMOTE,
    }
    expected = dict(_CPP_ONLY)
    for macro, policy in macros.items():
        body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S).group(1)
        for op, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body):
            expected[f"aten::{op}.{overload}" if overload else f"aten::{op}"] = policy
    body = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)\n\n", text, re.S)
    for name in re.findall(r'"(norm\.\w+)"', body.group(1)):
        expected[f"aten::{name}"] = CastPolicy.FP32_APPEND_DTYPE
    assert dict(CUDA_CAST_POLICIES) == expected


def test_policy_counts():
    counts = {p: sum(v is p for v in CUDA_CAST_POLICIES.values()) for p in CastPolicy}
    assert counts == {
        CastPolicy.LOWER_PRECISION_FP: 35,
        CastPolicy.FP32: 59,
        CastPolicy.FP32_SET_OPT_DTYPE: 11,
        CastPolicy.FP32_APPEND_DTYPE: 2,
        CastPolicy.PROMOTE: 11,
        CastPolicy.BANNED: 1,
    }


def test_bad_dtype_names_valid_ones():
    with pytest.raises(ConfigError, match="valid: torch.bfloat16, torch.float16"):
        with cuda_autocast(torch.float32):
            pass


# ---------------------------------------------------------------------------
# Behaviour under the CUDA policy


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_lower_precision_ops(dtype):
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    with cuda_autocast(dtype):
        assert F.linear(x, w).dtype == dtype
        assert torch.matmul(x, w.T).dtype == dtype
        assert torch.einsum("ij,kj->ik", x, w).dtype == dtype  # not cast by CPU autocast
        assert torch.addmv(torch.randn(16), w, x[0]).dtype == dtype  # idem
        assert F.linear(x.double(), w.double()).dtype == torch.float64  # double is not cast


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_fp32_ops(dtype):
    x = torch.randn(4, 8).to(dtype)
    target = torch.randint(0, 8, (4,))
    with cuda_autocast(dtype):
        assert torch.softmax(x, -1).dtype == FP32
        assert torch.log_softmax(x, -1).dtype == FP32
        assert x.exp().dtype == FP32
        assert x.pow(2).dtype == FP32
        assert x.rsqrt().dtype == FP32
        assert F.layer_norm(x, (8,)).dtype == FP32
        assert F.rms_norm(x, (8,)).dtype == FP32
        assert F.nll_loss(x, target).dtype == FP32
        assert F.cross_entropy(x, target).dtype == FP32
        assert x.cumsum(0).dtype == FP32
        assert x.sum().dtype == FP32
        assert torch.ops.aten.norm.Scalar(x).dtype == FP32  # fp32_append_dtype
        assert torch.ops.aten.norm.ScalarOpt_dim(x, 2, [0]).dtype == FP32


def test_set_opt_dtype_respects_explicit_dtype_and_ineligible_inputs():
    x = torch.randn(4, 8).to(BF16)
    with cuda_autocast(BF16):
        assert torch.softmax(x, -1, dtype=BF16).dtype == BF16
        assert torch.arange(4).sum().dtype == torch.int64
        assert torch.arange(4).cumsum(0).dtype == torch.int64


def test_ops_cast_by_cpu_autocast_but_not_cuda_keep_their_dtype():
    x = torch.randn(2, 3, 8).to(BF16)
    calls = {
        "reflection_pad1d": lambda: F.pad(x, (2, 2), mode="reflect"),
        "trace": lambda: torch.trace(x[0]),
        "max_pool3d": lambda: F.max_pool3d(x[None], 1),
    }
    with torch.autocast("cpu", dtype=BF16):  # the CPU policy casts these to fp32
        assert {k: f().dtype for k, f in calls.items()} == dict.fromkeys(calls, FP32)
    with cuda_autocast(BF16):
        assert {k: f().dtype for k, f in calls.items()} == dict.fromkeys(calls, BF16)


def test_cat_is_not_cast_before_running():
    a, b = torch.randn(2, 4).to(BF16), torch.randn(2, 4)
    with _OpLog() as log, torch.autocast("cpu", dtype=BF16):
        torch.cat([a, b])
    assert log.count("aten._to_copy.default", BF16, FP32) == 1  # CPU promote casts a
    with cuda_autocast(BF16), _OpLog() as log:
        assert torch.cat([a, b]).dtype == FP32  # cat's own type promotion, no copy
    assert [c[0] for c in log.calls] == ["aten.cat.default"]


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_promote_ops(dtype):
    low, high = torch.randn(4).to(dtype), torch.randn(4)
    with cuda_autocast(dtype):
        assert torch.addcmul(low, low, low).dtype == dtype
        assert torch.addcmul(low, high, low).dtype == FP32
        assert torch.dot(low, high).dtype == FP32
        assert torch.atan2(low, low).dtype == dtype
        other = torch.randn(4).to(FP16 if dtype == BF16 else BF16)
        with pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
            torch.addcmul(low, low, other)


def test_binary_cross_entropy_is_banned():
    p, t = torch.rand(4), torch.rand(4)
    with cuda_autocast(BF16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(p, t)


def test_convolution_with_padding_string_reaches_the_cast_convolution():
    # conv1d.padding has a CPU kernel only; on CUDA its decomposition hits `convolution`.
    x, w = torch.randn(1, 2, 8), torch.randn(3, 2, 3)
    with cuda_autocast(BF16):
        assert F.conv1d(x, w, padding="same").dtype == BF16


# ---------------------------------------------------------------------------
# The cast cache


def test_weight_used_twice_is_cast_once_like_the_cpp_cache():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(2, 8)

    def twice():
        return F.linear(F.linear(x, w), w)

    with torch.autocast("cpu", dtype=BF16), _OpLog() as cpp:  # C++ CPU kernel and cache
        twice()
    with cuda_autocast(BF16), _OpLog() as ours:
        twice()
        assert len(ac._CACHE) == 1
    assert len(ac._CACHE) == 0
    assert ours.count("aten._to_copy.default", FP32, BF16) == 2  # w once, x once
    assert ours.calls == cpp.calls


def test_cache_rules():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(2, 8)
    with cuda_autocast(BF16, cache_enabled=False), _OpLog() as log:
        F.linear(x, w), F.linear(x, w)
    assert log.count("aten._to_copy.default", FP32, BF16) == 4
    with cuda_autocast(BF16), _OpLog() as log:
        torch.matmul(x, w.T), torch.matmul(x, w.T)  # w.T is a view: not cached
        torch.exp(w), torch.exp(w)  # fp32 casts are never cached
        assert len(ac._CACHE) == 0
        F.linear(x, w)
        assert len(ac._CACHE) == 1


def test_cache_survives_inner_exit_and_clears_at_outermost():
    w = torch.randn(8, 8, requires_grad=True)
    with cuda_autocast(BF16):
        with cuda_autocast(BF16):
            F.linear(torch.randn(2, 8), w)
        assert len(ac._CACHE) == 1
    assert len(ac._CACHE) == 0


# ---------------------------------------------------------------------------
# Autograd, fake tensors, checkpoint


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.softmax(self.up(x), -1))


def _step(model: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype) -> list[torch.dtype]:
    saved: list[torch.dtype] = []

    def pack(t):
        saved.append(t.dtype)
        return t

    with cuda_autocast(dtype), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    assert out.dtype == dtype
    F.mse_loss(out.float(), torch.zeros_like(out, dtype=FP32)).backward()
    return saved


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_backward_real(dtype):
    model = _MLP()
    saved = _step(model, torch.randn(2, 8), dtype)
    assert all(p.grad is not None and p.grad.dtype == FP32 for p in model.parameters())
    assert FP32 in saved and dtype in saved  # softmax output in fp32, matmul inputs cast


def test_backward_fake_matches_real():
    real_model = _MLP()
    real_saved = _step(real_model, torch.randn(2, 8), BF16)
    with FakeTensorMode():
        model = _MLP()
        fake_saved = _step(model, torch.randn(2, 8), BF16)
        assert all(isinstance(p.grad, FakeTensor) for p in model.parameters())
        grads = [(p.grad.dtype, p.grad.shape) for p in model.parameters()]
    assert fake_saved == real_saved
    assert grads == [(FP32, p.shape) for p in real_model.parameters()]


def _checkpointed_step(wrap_backward: bool) -> None:
    model = _MLP()
    x = torch.randn(2, 8, requires_grad=True)
    with cuda_autocast_policy() if wrap_backward else contextlib.nullcontext():
        with cuda_autocast(BF16):
            out = checkpoint(model, x, use_reentrant=False)
        out.float().sum().backward()  # recomputes under torch.autocast("cpu")
    assert x.grad.dtype == FP32


def test_checkpoint_recompute_follows_cuda_policy():
    _checkpointed_step(wrap_backward=True)
    # Backward outside both contexts recomputes under the CPU policy: softmax then
    # saves a bf16 output instead of fp32, which checkpoint detects.
    with pytest.raises(CheckpointError):
        _checkpointed_step(wrap_backward=False)


def test_checkpoint_inside_region_with_backward_inside():
    model = _MLP()
    x = torch.randn(2, 8, requires_grad=True)
    with cuda_autocast(BF16):
        checkpoint(model, x, use_reentrant=False).float().sum().backward()
    assert x.grad.dtype == FP32


def test_region_inside_checkpointed_function():
    # The recomputation re-enters cuda_autocast itself, so backward may run outside.
    model = _MLP()
    x = torch.randn(2, 8, requires_grad=True)

    def block(inp):
        with cuda_autocast(BF16):
            return model(inp)

    out = checkpoint(block, x, use_reentrant=False)
    assert out.dtype == BF16
    out.float().sum().backward()
    assert x.grad.dtype == FP32
    assert ac._REGISTRATION._depth == 0


# ---------------------------------------------------------------------------
# Exit restores the CPU policy


def test_exit_restores_cpu_policy_and_reenters():
    original_clear = torch.clear_autocast_cache
    before = {op: _autocast_cpu_line(op) for op in ("aten::softmax.int", "aten::mm", "aten::cat")}
    x = torch.randn(4, 8).to(BF16)
    for _ in range(2):
        with cuda_autocast(BF16):
            assert torch.softmax(x, -1).dtype == FP32
            assert _autocast_cpu_line("aten::softmax.int") is not None
        assert {op: _autocast_cpu_line(op) for op in before} == before
        assert before["aten::softmax.int"] is None
        assert "autocast_mode.cpp" in before["aten::mm"]
        assert torch.clear_autocast_cache is original_clear
        with torch.autocast("cpu", dtype=BF16):
            assert torch.softmax(x, -1).dtype == BF16  # CPU policy: not upcast
            assert F.pad(x[None], (1, 1), mode="reflect").dtype == FP32


def test_exit_after_exception_removes_registrations():
    with pytest.raises(ValueError), cuda_autocast(BF16):
        raise ValueError("boom")
    assert _autocast_cpu_line("aten::softmax.int") is None
    assert ac._REGISTRATION._depth == 0
