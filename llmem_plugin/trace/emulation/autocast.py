"""Run CPU autocast under the CUDA autocast op policy.

The trace runs on (fake) CPU tensors, so ``torch.autocast("cpu")`` would apply
the CPU op policy, which differs from the CUDA one: on CUDA ``softmax``, ``exp``,
``pow``, ``rsqrt``, ``layer_norm``, ``rms_norm``, ``cumsum``, ``sum`` and the
losses run in fp32, while CPU autocast leaves most of them in bf16 and instead
casts ``cat``/``stack`` (promote), the linalg and FFT ops (fp32) and some convs.
Dtypes decide activation memory, so the trace must follow the CUDA policy.

:func:`cuda_autocast` enables ``torch.autocast("cpu", dtype=...)`` and, for its
duration only, registers Python kernels on the ``AutocastCPU`` dispatch key:

* every op of :data:`CUDA_CAST_POLICIES` gets a kernel that applies the CUDA
  cast policy, as the C++ ``WrapFunction_`` wrappers do;
* every other aten op that has a C++ ``AutocastCPU`` kernel gets a fallthrough,
  so it runs uncast, as it does on CUDA (which has no kernel for it).

Source of the table, for the installed torch 2.13.0+cpu
(git ``cf30153c4c131c8164ee7798e5022d810682e2cb``):

* ``aten/src/ATen/autocast_mode.h`` as shipped in that wheel
  (``torch/include/ATen/autocast_mode.h``): the op lists
  ``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
  ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``
  and ``AT_FORALL_PROMOTE``, and the wrapper semantics (``cached_cast``,
  ``is_eligible``, ``prioritize``, ``set_opt_dtype``, ``type_from_firstarg``).
* ``aten/src/ATen/autocast_mode.cpp``, ``TORCH_LIBRARY_IMPL(aten, Autocast, m)``
  (pytorch/pytorch commit ``008ec6b1840c94ff6d0f685bc10fbf585167c673``, the
  newest copy reachable here; the .cpp is not shipped in the wheel). It
  registers those lists for CUDA, adds ``cudnn_convolution`` and
  ``cudnn_convolution_transpose`` as lower_precision_fp, bans
  ``binary_cross_entropy``, and defines the cast cache (``cached_cast``).

The table is checked against the binary on first use: its keys must equal the
aten ops for which ``torch._C._dispatch_has_kernel_for_dispatch_key(name,
"AutocastCUDA")`` is true (a CPU-only build still registers them).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any

import torch

from llmem_plugin.errors import ConfigError, UnsupportedError

__all__ = [
    "CUDA_CAST_POLICIES",
    "CastPolicy",
    "cuda_autocast",
    "cuda_autocast_policy",
]


class CastPolicy(str, Enum):
    """Cast policies of ``at::autocast::CastPolicy`` (autocast_mode.h), plus the banned op."""

    LOWER_PRECISION_FP = "lower_precision_fp"  # cast floating inputs to the autocast dtype
    FP32 = "fp32"  # cast floating inputs to fp32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # set the optional dtype= to fp32 when not given
    FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatch to the overload that takes a dtype
    PROMOTE = "promote"  # cast to the widest floating type among the inputs
    BANNED = "banned"  # raises under autocast (autocast_mode.cpp: binary_cross_entropy_banned)


def _names(*entries: str) -> tuple[str, ...]:
    # "pow.Tensor_Scalar" is the header's _(pow, Tensor_Scalar); no overload means ".default".
    return tuple(f"aten::{e}" for e in entries)


# autocast_mode.h AT_FORALL_LOWER_PRECISION_FP, then the two cudnn ops that
# autocast_mode.cpp adds for CUDA only.
_LOWER_PRECISION_FP = _names(
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
)  # fmt: skip

# autocast_mode.h AT_FORALL_FP32
_FP32 = _names(
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor",
    "pow.Scalar", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm",
    "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
    "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)  # fmt: skip

# autocast_mode.h AT_FORALL_FP32_SET_OPT_DTYPE
_FP32_SET_OPT_DTYPE = _names(
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)  # fmt: skip

# autocast_mode.h AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: registered overload ->
# the overload it redispatches to with dtype appended (at::norm's signatures).
_FP32_APPEND_DTYPE_TARGETS: Mapping[str, str] = MappingProxyType(
    {
        "aten::norm.Scalar": "aten::norm.ScalarOpt_dtype",
        "aten::norm.ScalarOpt_dim": "aten::norm.ScalarOpt_dim_dtype",
    }
)

# autocast_mode.h AT_FORALL_PROMOTE
_PROMOTE = _names(
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)  # fmt: skip

# autocast_mode.cpp: m.impl("aten::binary_cross_entropy", binary_cross_entropy_banned)
_BANNED = _names("binary_cross_entropy")

CUDA_CAST_POLICIES: Mapping[str, CastPolicy] = MappingProxyType(
    {
        **dict.fromkeys(_LOWER_PRECISION_FP, CastPolicy.LOWER_PRECISION_FP),
        **dict.fromkeys(_FP32, CastPolicy.FP32),
        **dict.fromkeys(_FP32_SET_OPT_DTYPE, CastPolicy.FP32_SET_OPT_DTYPE),
        **dict.fromkeys(_FP32_APPEND_DTYPE_TARGETS, CastPolicy.FP32_APPEND_DTYPE),
        **dict.fromkeys(_PROMOTE, CastPolicy.PROMOTE),
        **dict.fromkeys(_BANNED, CastPolicy.BANNED),
    }
)
"""CUDA autocast policy of torch 2.13: dispatcher op name -> :class:`CastPolicy`."""

# torch.amp.autocast accepts only these for CUDA (autocast_mode.py, device_supported_dtypes).
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)

# The torch release CUDA_CAST_POLICIES was read from; _Registration checks the binary.
_TABLE_TORCH_VERSION = "2.13"

# autocast_mode.cpp binary_cross_entropy_banned, verbatim.
_BCE_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using "
    "torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)

# c10 OperatorEntry::registerKernel warns (once per process) when a kernel is overridden.
_OVERRIDE_WARNING = "(?s).*Overriding a previously registered kernel"

_EXCLUDE_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _op(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


@functools.cache
def _aten_ops_with_kernel(dispatch_key: str) -> frozenset[str]:
    # Called before any of our registrations exist, so it sees only the binary's kernels.
    return frozenset(
        name
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key)
    )


class _CastCache:
    """The autocast cast cache (autocast_mode.cpp ``cached_cast``), for our kernels.

    C++ keys the cache by the source ``TensorImpl*`` and holds a weak reference to
    the source and a strong one to the cast; it is cleared when the outermost
    autocast region exits. Here the key is ``id(source)`` checked through a
    weakref; a cast whose source died stays held until the clear, as in C++.
    """

    def __init__(self) -> None:
        self._casts: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self._orphans: list[torch.Tensor] = []
        self._lock = threading.Lock()  # autocast_mode.cpp cached_casts_mutex

    def __len__(self) -> int:
        return len(self._casts) + len(self._orphans)

    def clear(self) -> None:
        with self._lock:
            self._casts.clear()
            self._orphans.clear()

    def cast(self, arg: torch.Tensor, to_type: torch.dtype) -> torch.Tensor:
        with self._lock:
            entry = self._casts.get(id(arg))
            if entry is not None:
                if entry[0]() is arg:
                    return entry[1]
                self._orphans.append(entry[1])
            casted = arg.to(to_type)
            self._casts[id(arg)] = (weakref.ref(arg), casted)
            return casted


_CACHE = _CastCache()


def _is_eligible(arg: torch.Tensor) -> bool:
    # autocast_mode.h is_eligible + is_autocast_eligible(CUDA), with the CPU standing in
    # for the GPU: defined, on the autocast device, floating point, and not double.
    return arg.device.type == "cpu" and arg.is_floating_point() and arg.dtype != torch.float64


def _cached_cast(to_type: torch.dtype, arg: Any, lower: torch.dtype) -> Any:
    # autocast_mode.cpp cached_cast: only lower-precision casts of fp32 leaves that
    # require grad (model weights) are cached, and only while the cache is enabled.
    if arg is None:
        return None
    if isinstance(arg, (list, tuple)):
        return [_cached_cast(to_type, t, lower) for t in arg]
    if not (_is_eligible(arg) and arg.dtype != to_type):
        return arg
    if (
        to_type == lower
        and arg.dtype == torch.float32
        and arg.requires_grad
        and arg.is_leaf
        and not arg._is_view()
        and torch.is_autocast_cache_enabled()
        and not torch._C._is_cached_tensor(arg)
    ):
        return _CACHE.cast(arg, to_type)
    return arg.to(to_type)


def _prioritize(current: torch.dtype, arg: Any, lower: torch.dtype) -> torch.dtype:
    # autocast_mode.h prioritize: Tensor and Tensor[] count; Tensor? does not (it falls to
    # the no-op template overload), nor does Tensor?[].
    if isinstance(arg, (list, tuple)):
        for t in arg:
            current = _prioritize(current, t, lower)
        return current
    if not (arg.device.type == "cpu" and arg.is_floating_point()):
        return current
    if arg.dtype == torch.float64:
        return current  # ignores double tensors
    if current == torch.float32 or arg.dtype == torch.float32:
        return torch.float32
    if current == lower and arg.dtype == lower:
        return lower
    raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")


class _Signature:
    """Where an op's tensor and dtype arguments sit, read from its schema."""

    def __init__(self, op: torch._ops.OpOverload) -> None:
        self.args = op._schema.arguments
        self.num_positional = sum(not a.kwarg_only for a in self.args)
        # (index, name, kwarg_only, counts_for_promote); Tensor?[] is left alone because
        # cached_cast has no overload for c10::List<optional<Tensor>>.
        self.tensors: list[tuple[int, str, bool, bool]] = []
        self.dtype_arg: tuple[int, str, bool] | None = None
        for i, a in enumerate(self.args):
            kind = str(a.type)
            if kind in ("Tensor", "List[Tensor]"):
                self.tensors.append((i, a.name, a.kwarg_only, True))
            elif kind == "Optional[Tensor]":
                self.tensors.append((i, a.name, a.kwarg_only, False))
            elif a.name == "dtype" and kind == "Optional[int]":
                self.dtype_arg = (i, a.name, a.kwarg_only)

    def get(self, args: tuple, kwargs: dict, index: int, name: str, kwarg_only: bool) -> Any:
        if not kwarg_only and index < len(args):
            return args[index]
        return kwargs.get(name)

    def map_tensors(self, args: tuple, kwargs: dict, fn: Callable[[Any], Any]) -> tuple[list, dict]:
        new_args, new_kwargs = list(args), dict(kwargs)
        # Last argument first: WrapFunction_ casts in a pack expansion,
        # ``(*F)(cached_cast(to_type, args, device_type)...)``, whose evaluation
        # order C++ leaves unspecified and GCC (torch's Linux wheels) makes
        # right to left. On the stub CUDA device a Linear's weight copy is
        # allocated before its input's (benchmarks/results/stub-wholestep-2026-11-25.md).
        for index, name, kwarg_only, _ in reversed(self.tensors):
            if not kwarg_only and index < len(new_args):
                new_args[index] = fn(new_args[index])
            elif name in new_kwargs:
                new_kwargs[name] = fn(new_kwargs[name])
        return new_args, new_kwargs

    def padded(self, args: tuple, upto: int) -> list:
        # The dispatcher drops trailing defaulted arguments; put them back.
        new_args = list(args)
        for a in self.args[len(new_args) : upto]:
            new_args.append(a.default_value)
        return new_args


def _make_kernel(name: str, policy: CastPolicy) -> Callable[..., Any]:
    """A Python ``AutocastCPU`` kernel applying ``policy`` like the C++ ``WrapFunction_``."""
    op = _op(name)
    sig = _Signature(op)

    if policy is CastPolicy.BANNED:

        def banned(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(_BCE_BANNED_MESSAGE)

        return banned

    if policy in (CastPolicy.LOWER_PRECISION_FP, CastPolicy.FP32, CastPolicy.PROMOTE):

        def cast_inputs(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST_CPU):
                lower = torch.get_autocast_dtype("cpu")
                if policy is CastPolicy.LOWER_PRECISION_FP:
                    to_type = lower
                elif policy is CastPolicy.FP32:
                    to_type = torch.float32
                else:
                    to_type = lower
                    for index, arg_name, kwarg_only, counts in sig.tensors:
                        arg = sig.get(args, kwargs, index, arg_name, kwarg_only)
                        if counts and arg is not None:
                            to_type = _prioritize(to_type, arg, lower)
                new_args, new_kwargs = sig.map_tensors(
                    args, kwargs, lambda t: _cached_cast(to_type, t, lower)
                )
                out = op(*new_args, **new_kwargs)
                # The casts were made last argument first, so C++ destroys them first argument first.
                for i in range(len(new_args)):
                    new_args[i] = None
                for name in list(new_kwargs):
                    new_kwargs[name] = None
                return out

        return cast_inputs

    if policy is CastPolicy.FP32_SET_OPT_DTYPE:
        assert sig.dtype_arg is not None, f"{name} has no optional dtype argument"
        dtype_index, dtype_name, dtype_kwarg_only = sig.dtype_arg

        def set_opt_dtype(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST_CPU):
                # firstarg_is_eligible; an ineligible call runs with its args unaltered.
                if not _is_eligible(args[0]):
                    return op(*args, **kwargs)
                if sig.get(args, kwargs, dtype_index, dtype_name, dtype_kwarg_only) is not None:
                    return op(*args, **kwargs)
                if dtype_kwarg_only:
                    return op(*args, **{**kwargs, dtype_name: torch.float32})
                new_args = sig.padded(args, dtype_index + 1)
                new_args[dtype_index] = torch.float32
                return op(*new_args, **kwargs)

        return set_opt_dtype

    assert policy is CastPolicy.FP32_APPEND_DTYPE, policy
    target = _op(_FP32_APPEND_DTYPE_TARGETS[name])

    def append_dtype(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE_AUTOCAST_CPU):
            # type_from_firstarg: fp32 if the first arg is eligible, else its own dtype.
            out_type = torch.float32 if _is_eligible(args[0]) else args[0].dtype
            return target(*sig.padded(args, sig.num_positional), dtype=out_type, **kwargs)

    return append_dtype


class _Registration:
    """Installs the CUDA-policy kernels once, however deeply the contexts nest.

    Registrations are process-wide (the dispatcher has no per-thread kernels), so
    one reference count covers every thread; the last exit removes them all.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._lock = threading.Lock()
        self._library: torch.library.Library | None = None
        self._saved_clear: Callable[[], None] | None = None

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._install()
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._uninstall()

    def _install(self) -> None:
        cuda_ops = _aten_ops_with_kernel("AutocastCUDA")
        cpu_ops = _aten_ops_with_kernel("AutocastCPU")
        table = set(CUDA_CAST_POLICIES)
        if cuda_ops != table:
            raise UnsupportedError(
                "the CUDA autocast table of llmem_plugin.trace.emulation.autocast was taken from "
                f"torch {_TABLE_TORCH_VERSION} and does not match torch {torch.__version__}: "
                f"ops with an AutocastCUDA kernel but no entry: {sorted(cuda_ops - table)}; "
                f"entries with no kernel: {sorted(table - cuda_ops)}. HINT: update "
                "CUDA_CAST_POLICIES from aten/src/ATen/autocast_mode.h of that version."
            )
        library = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                # Overriding the C++ AutocastCPU kernels is the point; the dispatcher warns once.
                warnings.filterwarnings("ignore", message=_OVERRIDE_WARNING)
                for name, policy in CUDA_CAST_POLICIES.items():
                    library.impl(name, _make_kernel(name, policy), "AutocastCPU")
                for name in sorted(cpu_ops - cuda_ops):
                    # No CUDA kernel: skip autocast, exactly as the CUDA fallthrough fallback does.
                    library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        except BaseException:
            library._destroy()
            raise
        self._library = library
        # torch.autocast.__exit__ calls torch.clear_autocast_cache() when the outermost
        # region exits (torch/amp/autocast_mode.py); clear our cache at the same moment.
        saved_clear = torch.clear_autocast_cache
        self._saved_clear = saved_clear

        def clear_autocast_cache() -> None:
            saved_clear()
            _CACHE.clear()

        torch.clear_autocast_cache = clear_autocast_cache

    def _uninstall(self) -> None:
        assert self._library is not None and self._saved_clear is not None
        torch.clear_autocast_cache = self._saved_clear
        self._saved_clear = None
        self._library._destroy()
        self._library = None
        _CACHE.clear()


_REGISTRATION = _Registration()


@contextlib.contextmanager
def cuda_autocast_policy() -> Iterator[None]:
    """Make every CPU autocast region follow the CUDA op policy while inside.

    It enables no autocast by itself. Wrap the whole traced step in it (forward
    and backward) when the backward runs outside :func:`cuda_autocast`: the
    recomputation of ``torch.utils.checkpoint`` re-enters ``torch.autocast("cpu")``
    during backward and must see the CUDA policy too.

    Raises:
        UnsupportedError: the installed torch registers a different CUDA autocast
            op set than :data:`CUDA_CAST_POLICIES`.
    """
    _REGISTRATION.enter()
    try:
        yield
    finally:
        _REGISTRATION.exit()


@contextlib.contextmanager
def cuda_autocast(
    dtype: torch.dtype,
    *,
    enabled: bool = True,
    cache_enabled: bool | None = None,
) -> Iterator[None]:
    """``torch.autocast("cuda", dtype)`` emulated on (fake) CPU tensors.

    Enables ``torch.autocast("cpu", dtype=dtype)`` under :func:`cuda_autocast_policy`,
    so ops cast as CUDA autocast casts them, including the cast cache of fp32
    leaf weights (one low-precision copy per weight per region, freed when the
    outermost region exits).

    Args:
        dtype: the lower-precision dtype, ``torch.bfloat16`` or ``torch.float16``.
        enabled: as in ``torch.autocast``.
        cache_enabled: as in ``torch.autocast``; ``None`` keeps the current setting.

    Raises:
        ConfigError: ``dtype`` is not one CUDA autocast supports.
        UnsupportedError: see :func:`cuda_autocast_policy`.

    Known limitations:
        * The kernels are process-wide: while installed, CPU autocast in every
          thread follows the CUDA policy.
        * Only aten ops are covered; other namespaces keep their CPU autocast kernels.
        * Composite kernels that branch on ``is_cuda()`` below autocast are not
          emulated: on CUDA ``softmax``/``log_softmax`` of an fp16 input with
          ``dtype=float32`` (what fp16 autocast produces) run a fused
          half-to-float kernel, while on CPU they first make an fp32 copy of the
          input (aten/src/ATen/native/SoftMax.cpp). bf16 takes the copy on both.
        * The cast cache is keyed by the Python tensor object, not the
          ``TensorImpl``: a source whose Python object is dropped and recreated
          while the region is open is cast again (C++ would hit the cache).
    """
    if dtype not in _SUPPORTED_DTYPES:
        raise ConfigError(
            f"cuda_autocast dtype={dtype} is not supported; valid: "
            f"{', '.join(map(str, _SUPPORTED_DTYPES))}. HINT: use torch.bfloat16 on "
            "Ampere or newer GPUs, torch.float16 otherwise."
        )
    with cuda_autocast_policy(), torch.autocast(
        "cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled
    ):
        yield
