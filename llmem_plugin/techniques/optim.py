"""bitsandbytes optimizers (AdamW8bit, PagedAdamW, PagedAdamW8bit) on CPU tensors.

bitsandbytes' update kernels are CUDA kernels that cannot run on fake CPU
tensors, and its CPU fallback places states differently from a CUDA run
(no paging, no device copy of the quantization maps). So the optimizer used
here is bitsandbytes' own class (its ``init_state`` decides every state's
shape and dtype) with the three places where CUDA and CPU differ replaced:

* ``get_state_buffer``: on CUDA a paged optimizer puts a state of at least
  :data:`PAGED_MIN_NUMEL` elements in CUDA managed memory
  (``bitsandbytes.functional.get_paged`` -> ``cudaMallocManaged``), outside
  PyTorch's caching allocator; here it is allocated untracked and counted in
  ``paged_bytes`` instead (see :func:`paged_state_bytes`). Smaller states,
  and every state of a non-paged optimizer, are ``torch.zeros_like`` through
  the caching allocator, as on CUDA.
* the quantization maps (``qmap1``/``qmap2``, 256 fp32 values each): on CUDA
  ``init_state`` copies the host maps to the device once, at the first
  8-bit parameter (``name2qmap[...].to(p.device)``); on CPU that ``.to`` is a
  no-op. Here the device copies are allocated explicitly.
* ``update_step``: bitsandbytes' CUDA update kernels
  (``bitsandbytes/backends/cuda/ops.py``, ``_optimizer_update_32bit_impl``
  and ``_optimizer_update_8bit_blockwise_impl``, 0.50.2) update in place
  through raw pointers and allocate nothing. On fake tensors the update is
  skipped (values do not change memory); on real tensors bitsandbytes' CPU
  kernel runs untracked, so a real CPU run still trains.

Managed memory is resident on the device while bitsandbytes prefetches it
for the update (``Optimizer8bit.prefetch_state``), so it counts in the
device's used memory, but the driver evicts its pages to the host when the
device runs out (CUDA C++ Programming Guide 12.6, "Unified Memory
Programming": oversubscription with ``concurrentManagedAccess``): the
estimate reports it apart (``Estimate.paged_bytes``), in the device total
and outside the fits verdict.

The layout rules (bitsandbytes/optim/optimizer.py and adamw.py, 0.50.2):
parameters with fewer than ``min_8bit_size`` = 4096 elements keep two fp32
states; larger ones under an 8-bit optimizer keep two uint8 states plus one
fp32 ``absmax`` per block of 256 elements for each; ``step`` is a Python int.

Without bitsandbytes installed, :class:`_LayoutOptimizer` allocates the same
states in the same order from these rules alone (a memory model: it refuses
to update real tensors), so an estimate or a planner suggestion with an
8-bit or paged optimizer never needs the package. With bitsandbytes
installed its own class is used, and tests/techniques/test_optim.py checks that
both allocate the same events.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch._subclasses.fake_tensor import is_fake

from llmem_plugin.trace import _pause
from llmem_plugin.errors import ConfigError
from llmem_plugin.workload import OptimizerKind, Workload

__all__ = ["PAGED_MIN_NUMEL", "make_bnb_optimizer", "paged_state_bytes", "unsupported"]

# bitsandbytes/optim/optimizer.py (0.50.2), Optimizer8bit.get_state_buffer:
# `if not self.is_paged or p.numel() < 1e5: torch.zeros_like(...)`, else a
# paged (managed) buffer.
PAGED_MIN_NUMEL = 100_000
# bitsandbytes/optim/adamw.py (0.50.2): the default `min_8bit_size=4096` of
# AdamW8bit / PagedAdamW8bit; Optimizer2State.init_state keeps fp32 states
# for parameters with fewer elements.
_MIN_8BIT_SIZE = 4096
# bitsandbytes/optim/optimizer.py (0.50.2), Optimizer2State.init_state:
# `blocksize = 256`, one fp32 absmax per block of each 8-bit state.
_BLOCK_SIZE = 256
# bitsandbytes/functional.py (0.50.2), create_dynamic_map(total_bits=8):
# `assert len(data) == 2**total_bits`, `torch.tensor(data, dtype=torch.float32)`: 256 fp32 entries
# (one per uint8 code) in each quantization map.
_QMAP_ENTRIES = 256
# The bitsandbytes release whose internals (get_state_buffer, init_state,
# update_step, name2qmap) the class below overrides; checked at build time.
BNB_CHECKED_VERSION = "0.50.2"
_OVERRIDDEN = ("get_state_buffer", "init_state", "update_step")

# Methods whose engines build and partition their own optimizer states
# (DeepSpeed ZeRO, ColossalAI): a bitsandbytes optimizer is not modelled there.
_OWN_OPTIMIZER = {
    "zero1": "DeepSpeed ZeRO", "zero2": "DeepSpeed ZeRO", "zero3": "DeepSpeed ZeRO",
    "zero2-offload": "DeepSpeed ZeRO-Offload", "zero3-offload": "DeepSpeed ZeRO-Offload",
    "gemini": "ColossalAI Gemini", "lowlevel-zero1": "ColossalAI LowLevelZero",
    "lowlevel-zero2": "ColossalAI LowLevelZero", "hybrid": "ColossalAI HybridParallel",
}
# Methods whose parameters are DTensors (FSDP2 fully_shard, tensor parallel).
_DTENSOR = ("fsdp", "hsdp", "tp", "dp-tp", "fsdp-tp")

_BASES = {
    OptimizerKind.ADAMW_8BIT: "AdamW8bit",
    OptimizerKind.PAGED_ADAMW: "PagedAdamW",
    OptimizerKind.PAGED_ADAMW_8BIT: "PagedAdamW8bit",
}


def _is_8bit(kind: OptimizerKind, numel: int) -> bool:
    return kind in (OptimizerKind.ADAMW_8BIT, OptimizerKind.PAGED_ADAMW_8BIT) and numel >= _MIN_8BIT_SIZE


def paged_state_bytes(params: Iterable[torch.Tensor], kind: OptimizerKind) -> int:
    """Bytes a paged bitsandbytes optimizer keeps in CUDA managed memory.

    Each trainable parameter of at least :data:`PAGED_MIN_NUMEL` elements gets
    its two states (``state1``, ``state2``) from ``get_paged``: uint8 under an
    8-bit optimizer (every such parameter is above ``min_8bit_size``), fp32
    otherwise. ``absmax`` and the quantization maps stay in the caching
    allocator (``torch.zeros`` / ``.to(device)`` in ``init_state``).

    Args:
        params: The trainable parameters (each counted once).
        kind: The optimizer.

    Returns:
        Managed bytes, 0 for an optimizer that does not page.
    """
    if kind not in (OptimizerKind.PAGED_ADAMW, OptimizerKind.PAGED_ADAMW_8BIT):
        return 0
    total = 0
    for p in {id(p): p for p in params}.values():
        n = p.numel()
        if n >= PAGED_MIN_NUMEL:
            total += 2 * n * (1 if _is_8bit(kind, n) else 4)
    return total


class _CudaPlacement:
    """Mixin placed before a bitsandbytes optimizer class: its states are
    placed as a CUDA run places them (see the module docstring).

    Known limitations:
        * Managed memory is counted at its exact byte size; the driver's
          page granularity is not added.
        * ``GlobalOptimManager`` per-parameter overrides are honoured by
          bitsandbytes' own ``init_state`` but not by :func:`paged_state_bytes`.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.paged_bytes = 0
        self._qmaps_on_device = False

    def get_state_buffer(self, p: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.is_paged and p.numel() >= PAGED_MIN_NUMEL:
            # cudaMallocManaged: outside the caching allocator, so untracked.
            with _pause.untracked():
                buf = torch.zeros_like(p, dtype=dtype)
            self.paged_bytes += buf.numel() * buf.element_size()
            return buf
        return torch.zeros_like(p, dtype=dtype)

    def init_state(self, group: dict, p: torch.Tensor, gindex: int, pindex: int) -> None:
        config = self.get_config(gindex, pindex, group)
        eight_bit = config["optim_bits"] == 8 and p.numel() >= config["min_8bit_size"]
        if eight_bit and not self._qmaps_on_device:
            # The one host-to-device copy of each map that CUDA's `.to(p.device)` makes.
            for key in ("dynamic", "udynamic"):
                host = self.name2qmap[key]
                dev = torch.empty(host.shape, dtype=host.dtype)
                if not is_fake(dev):
                    dev.copy_(host)
                self.name2qmap[key] = dev
            self._qmaps_on_device = True
        super().init_state(group, p, gindex, pindex)

    def update_step(self, group: dict, p: torch.Tensor, gindex: int, pindex: int) -> None:
        if is_fake(p):
            # The CUDA kernel allocates nothing; only the host counter moves.
            self.state[p]["step"] += 1
            return
        with _pause.untracked():
            super().update_step(group, p, gindex, pindex)


class _LayoutOptimizer(torch.optim.Optimizer):
    """bitsandbytes' AdamW8bit / PagedAdamW / PagedAdamW8bit state layout,
    allocated without bitsandbytes (used when it is not installed).

    ``step()`` creates each parameter's states at its first step exactly as
    ``Optimizer2State.init_state`` followed by :class:`_CudaPlacement` does
    (bitsandbytes/optim/optimizer.py, 0.50.2): for the first 8-bit parameter
    the device copies of the two quantization maps (signed, then unsigned);
    then ``state1``, ``state2`` (uint8 for an 8-bit optimizer and a
    parameter of at least ``min_8bit_size`` elements, else fp32; paged ones
    untracked and counted in ``paged_bytes``), then ``absmax1``, ``absmax2``
    (fp32, one per block of 256 elements) for 8-bit states. The update itself
    allocates nothing on CUDA (see the module docstring), so on fake tensors
    only the step counter moves; real tensors are refused, since this class
    cannot train.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, name: str, lr: float) -> None:
        # bitsandbytes/optim/adamw.py (0.50.2) defaults; memory does not depend on them.
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2})
        self.name = name
        self.eight_bit = name.endswith("8bit")
        self.is_paged = name.startswith("Paged")
        self.paged_bytes = 0
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

    def _buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.is_paged and p.numel() >= PAGED_MIN_NUMEL:
            with _pause.untracked():  # cudaMallocManaged, outside the caching allocator
                buf = torch.zeros_like(p, dtype=dtype)
            self.paged_bytes += buf.numel() * buf.element_size()
            return buf
        return torch.zeros_like(p, dtype=dtype)

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        eight_bit = self.eight_bit and p.numel() >= _MIN_8BIT_SIZE
        if eight_bit and self._qmaps is None:
            self._qmaps = (torch.empty(_QMAP_ENTRIES, dtype=torch.float32),
                           torch.empty(_QMAP_ENTRIES, dtype=torch.float32))
        state["step"] = 0
        dtype = torch.uint8 if eight_bit else torch.float32
        state["state1"] = self._buffer(p, dtype)
        if eight_bit:
            state["qmap1"] = self._qmaps[0]
        state["state2"] = self._buffer(p, dtype)
        if eight_bit:
            state["qmap2"] = self._qmaps[1]
            blocks = -(-p.numel() // _BLOCK_SIZE)
            state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32)
            state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim.Optimizer's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not is_fake(p):
                    raise ImportError(
                        f"training with --optimizer {self.name} needs bitsandbytes (without it only its memory is "
                        "modelled, on fake tensors). HINT: pip install bitsandbytes"
                    )
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
        return loss


def _bitsandbytes_optim():
    """``bitsandbytes.optim``, or None when bitsandbytes cannot be imported."""
    try:
        import bitsandbytes.optim as bnb_optim
    except ImportError:
        return None
    return bnb_optim


@functools.cache
def _emulating_class(name: str) -> type:
    try:
        import bitsandbytes
        import bitsandbytes.optim as bnb_optim
    except ImportError as e:
        raise ImportError(
            f"--optimizer {name} needs bitsandbytes (>= {BNB_CHECKED_VERSION}). HINT: pip install bitsandbytes"
        ) from e
    base = getattr(bnb_optim, name)
    missing = [m for m in _OVERRIDDEN if not hasattr(base, m)]
    if missing:
        from llmem_plugin.errors import UnsupportedError

        raise UnsupportedError(
            f"bitsandbytes {bitsandbytes.__version__} has no {', '.join(missing)} on {name}; its state layout "
            f"is modelled from {BNB_CHECKED_VERSION}. HINT: pip install bitsandbytes=={BNB_CHECKED_VERSION}"
        )
    return type(f"Emulated{name}", (_CudaPlacement, base), {"__module__": __name__})


def make_bnb_optimizer(params: Iterable[torch.nn.Parameter], kind: OptimizerKind, *, lr: float) -> torch.optim.Optimizer:
    """The bitsandbytes optimizer for ``kind``, placing states as on CUDA.

    Args:
        params: Trainable parameters, fake or real CPU tensors.
        kind: One of the bitsandbytes kinds (``kind.is_bitsandbytes``).
        lr: Learning rate (memory does not depend on it).

    Returns:
        An instance of bitsandbytes' class with bitsandbytes' defaults
        (betas, eps, weight decay 1e-2, ``min_8bit_size`` 4096); without
        bitsandbytes, a :class:`_LayoutOptimizer` that allocates the same
        states (fake tensors only). After its first ``step()`` its
        ``paged_bytes`` holds the managed bytes.

    Raises:
        ConfigError: ``kind`` is not a bitsandbytes optimizer.
    """
    if kind not in _BASES:
        raise ConfigError(
            f"optimizer '{kind.value}' is not a bitsandbytes optimizer. "
            f"HINT: pass --optimizer with one of {', '.join(k.value for k in _BASES)}"
        )
    if _bitsandbytes_optim() is None:
        return _LayoutOptimizer(list(params), name=_BASES[kind], lr=lr)
    cls = _emulating_class(_BASES[kind])
    return cls(list(params), lr=lr)


def unsupported(method: str, workload: Workload) -> str | None:
    """Why ``method`` cannot run ``workload``'s optimizer, or None.

    Args:
        method: ``"single"`` or a name from ``llmem_plugin.methods.method_names()``.
        workload: The workload.

    Returns:
        One sentence with a HINT, or None when the combination is modelled.
    """
    kind = workload.optimizer
    if not kind.is_bitsandbytes:
        return None
    if method in _OWN_OPTIMIZER:
        return (
            f"--optimizer {kind.value} with --method {method} is not modelled: {_OWN_OPTIMIZER[method]} builds "
            "and partitions its own optimizer states, whose layout for a bitsandbytes optimizer is not traced. "
            f"HINT: use --optimizer adamw with --method {method}, or {kind.value} with --method single or ddp"
        )
    if method.startswith("pp"):
        return (
            f"--optimizer {kind.value} with --method {method} is not modelled: bitsandbytes' optimizers are "
            "not verified on pipeline stages (nor on the FSDP2 shards inside them). "
            f"HINT: use --optimizer adamw or adamw-fused with --method {method}"
        )
    if method in _DTENSOR:
        return (
            f"--optimizer {kind.value} with --method {method} is not modelled: its parameters are DTensors and "
            "bitsandbytes' kernels read raw local-tensor pointers, a combination not verified here. "
            f"HINT: use --optimizer adamw or adamw-fused with --method {method}"
        )
    if method != "single" and kind in (OptimizerKind.PAGED_ADAMW, OptimizerKind.PAGED_ADAMW_8BIT):
        return (
            f"--optimizer {kind.value} with --method {method} is not modelled: its states live in CUDA managed "
            "memory, which only the single-GPU estimate reports. "
            f"HINT: use --optimizer adamw8bit with --method {method}, or --method single"
        )
    return None
