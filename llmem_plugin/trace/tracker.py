"""Record every storage allocation and free of a training step.

:class:`MemoryTracker` is a ``TorchDispatchMode``. After every ATen op it looks
at the storages of the op's outputs; a storage it has not seen is a new
allocation, and a weak reference on the storage object reports its free. This
works the same on real tensors and on fake tensors (a fake tensor's storage is
a real Python object with the right ``nbytes`` and no data), which is what lets
tests check a fake trace against a real CPU run byte for byte.

Accounting is done once, at the end, by replaying the ordered event stream:
categories are final by then (a storage allocated in backward becomes a
*gradient* only when AccumulateGrad stores it), and storages that a CUDA run
keeps on the host are dropped from the device totals.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from llmem_plugin.trace import _pause
from llmem_plugin.trace.foreign_kernels import pytorch_meta_kernels

__all__ = ["MemoryCategory", "Phase", "MemoryTracker", "RecordTable", "TraceResult", "round_allocation"]

# c10/cuda/CUDACachingAllocator.cpp (torch 2.6 - 2.13): kMinBlockSize = 512 and
# round_size() rounds every request up to a multiple of it (a 1-byte request
# takes 512 bytes). Zero-byte requests return a null pointer without a block.
_CUDA_MIN_BLOCK_BYTES = 512


# The matrix products whose CUDA (and CPU) kernels take operands of one dtype only.
_SAME_DTYPE_MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                                 torch.ops.aten.baddbmm.default})
_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
_LIFT_FRESH = torch.ops.aten.lift_fresh.default  # where `torch.tensor(data)` makes its constant
_PRIM_DEVICE = torch.ops.prim.device.default
_PLACEHOLDER_SCALAR = {True: 1.0, False: 1}


def round_allocation(nbytes: int) -> int:
    """Bytes the CUDA caching allocator hands out for an ``nbytes`` request."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // _CUDA_MIN_BLOCK_BYTES) * _CUDA_MIN_BLOCK_BYTES


class MemoryCategory(str, Enum):
    """What a storage holds. Values double as table headers."""

    PARAMETER = "parameters"
    GRADIENT = "gradients"
    OPTIMIZER_STATE = "optimizer_states"
    ACTIVATION = "activations"
    TEMPORARY = "temporaries"
    INPUT = "inputs"
    # Buffers a distributed engine keeps for communication (DDP gradient buckets).
    COMM_BUFFER = "comm_buffers"
    # Tensors that exist in the traced CPU program but live in host memory in a
    # CUDA run (e.g. AdamW's `step` counters). Not counted on the device.
    HOST = "host"


class Phase(str, Enum):
    """Part of the training step an event belongs to."""

    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


@dataclass(slots=True)
class _Storage:
    nbytes: int
    category: MemoryCategory
    phase: Phase
    module: str
    ref: Any = None  # weakref to the storage object
    requested: int = 0  # bytes the storage asked for, before the allocator's rounding
    op: Any = None  # the ATen op whose output it is (None: registered, e.g. a parameter)


@dataclass(frozen=True, slots=True)
class RecordTable:
    """What each record (the key of an event) is, for the predicted snapshot's frames.

    Attributes:
        category: Per record, its final :class:`MemoryCategory` value.
        module: Per record, the module running when it was made ("" outside the model).
        phase: Per record, the :class:`Phase` value it was made in.
        op: Per record, the ATen op that made it ("" for a registered tensor).
        requested: Per record, the bytes asked for before the allocator's rounding.
    """

    category: list[str]
    module: list[str]
    phase: list[str]
    op: list[str]
    requested: list[int]

    def __len__(self) -> int:
        return len(self.category)

    def joined(self, other: "RecordTable") -> "RecordTable":
        """This table, then ``other``'s records numbered after it."""
        return RecordTable(category=self.category + other.category, module=self.module + other.module,
                           phase=self.phase + other.phase, op=self.op + other.op,
                           requested=self.requested + other.requested)

    def take(self, order: list[int], module: list[str] | None = None) -> "RecordTable":
        """The records in ``order`` (new key i is old record ``order[i]``), modules replaced by ``module``."""
        return RecordTable(category=[self.category[r] for r in order],
                           module=module if module is not None else [self.module[r] for r in order],
                           phase=[self.phase[r] for r in order], op=[self.op[r] for r in order],
                           requested=[self.requested[r] for r in order])


@dataclass(frozen=True, slots=True)
class TraceResult:
    """Outcome of replaying a tracker's event stream.

    Attributes:
        peak_bytes: Highest device bytes live at once (rounded as CUDA rounds).
        peak_phase: Phase during which the peak was reached.
        peak_module: Module active when the peak was reached.
        breakdown: Bytes per category live at the peak.
        phase_peaks: Highest bytes reached in each phase.
        phase_breakdowns: Breakdown at each phase's own peak.
        timeline: (event index, phase, allocated bytes) after every event.
        num_events: Allocation plus free events recorded.
        host_peak_bytes: Highest host-resident (``HOST``) bytes live at once,
            e.g. offloaded activations in pinned memory.
        marks: ``"name:phase"`` -> position in ``events`` where
            :meth:`MemoryTracker.mark` was first called with that name in
            that phase (e.g. "cublas:backward", where a CUDA run creates the
            backward thread's cuBLAS workspace).
        layer_tags: The decoder layer of every record and event
            (:class:`llmem_plugin.trace.layertags.LayerTags`), from a
            :class:`~llmem_plugin.trace.layertags.LayerTaggingTracker` only.
        records: What each event key is (:class:`RecordTable`), or None
            where the stream was made without it (an extrapolation).
    """

    peak_bytes: int
    peak_phase: Phase
    peak_module: str
    breakdown: dict[MemoryCategory, int]
    phase_peaks: dict[Phase, int]
    phase_breakdowns: dict[Phase, dict[MemoryCategory, int]]
    timeline: list[tuple[int, Phase, int]] = field(repr=False)
    num_events: int = 0
    events: list[tuple[int, int, int]] = field(repr=False, default_factory=list)
    host_peak_bytes: int = 0
    marks: dict[str, int] = field(repr=False, default_factory=dict)
    layer_tags: Any = field(repr=False, default=None)
    records: RecordTable | None = field(repr=False, default=None)


class MemoryTracker(TorchDispatchMode):
    """Records every storage allocation and free made by ATen ops.

    Use as a context manager around the work to trace; register long-lived
    tensors made before entering (parameters, inputs) with :meth:`register`.
    The driver announces phases with :meth:`set_phase` and relabels storages
    with :meth:`label` once their role is known.

    Known limitations:
        * Allocations made by kernels internally (workspaces) are invisible
          unless an emulation allocates them as tensors.
        * Storages allocated inside :func:`llmem_plugin.trace._pause.untracked` are
          never seen, by design.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}  # id(storage object) -> record index
        self._records: list[_Storage] = []
        self._events: list[tuple[int, int]] = []  # (+1 alloc | -1 free, record index)
        self._phase_of_event: list[Phase] = []
        self.phase = Phase.SETUP
        self._module_stack: list[str] = []
        self._backward_module = ""
        self._hooks: list[Any] = []
        self._kernels: contextlib.ExitStack | None = None
        self._module_names: dict[int, str] = {}
        self._marks: dict[str, int] = {}  # "name:phase" -> index into _events
        self._op: Any = None  # the op whose outputs _see is looking at (None: a registered tensor)
        self._host_constants = False  # inside host_constants()

    # ------------------------------------------------------------------ setup
    def watch_modules(self, model: torch.nn.Module) -> None:
        """Attribute events to the modules of ``model`` while they run."""
        self._module_names = {id(m): name for name, m in model.named_modules()}

    def __enter__(self) -> "MemoryTracker":
        mods = torch.nn.modules.module
        self._hooks = [
            mods.register_module_forward_pre_hook(self._pre_forward),
            mods.register_module_forward_hook(self._post_forward),
        ]
        self._kernels = contextlib.ExitStack()
        self._kernels.enter_context(pytorch_meta_kernels())
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        try:
            super().__exit__(*exc)
        finally:
            if self._kernels is not None:
                self._kernels.close()
                self._kernels = None

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        name = self._module_names.get(id(module))
        if name is not None:
            self._module_stack.append(name)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        name = self._module_names.get(id(module))
        if name is None:
            return
        if self._module_stack and self._module_stack[-1] == name:
            self._module_stack.pop()
        if self.phase is Phase.FORWARD and torch.is_grad_enabled():
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                # Fires when the gradient of this module's output is ready, i.e.
                # when the module's own backward starts.
                out.register_hook(self._backward_hook(name))

    def _backward_hook(self, name: str):
        def hook(grad: torch.Tensor) -> None:
            self._backward_module = name
            if self.phase is Phase.BACKWARD:
                # torch.utils.checkpoint stops a recomputation early once it
                # has the tensors it needs (checkpoint.py, _StopRecomputationError
                # in the non-reentrant variant): the recomputed modules' forward
                # hooks never pop them, and those stale names would attribute
                # the next layers' backward to a layer already done.
                self._module_stack.clear()

        return hook

    @property
    def current_module(self) -> str:
        if self.phase is Phase.BACKWARD and not self._module_stack:
            return self._backward_module
        return self._module_stack[-1] if self._module_stack else ""

    def backward_returned(self) -> None:
        """``backward()`` has returned: what follows (the graph released with
        the loss) runs in no module's backward."""
        self._backward_module = ""
        self._module_stack.clear()

    def set_phase(self, phase: Phase) -> None:
        """Attribute the following events to ``phase``."""
        self.phase = phase
        if phase is not Phase.BACKWARD:
            self._backward_module = ""

    def register(self, tensors: list[torch.Tensor], category: MemoryCategory) -> None:
        """Record ``tensors`` (seen already or not) as allocated, under ``category``."""
        self._op = None
        for t in tensors:
            self._see(t.untyped_storage(), category)
        self.label(tensors, category)

    @contextlib.contextmanager
    def host_constants(self) -> Iterator[None]:
        """Inside the block, ``torch.tensor(...)`` constants are host memory (``HOST``).

        The trace runs on the CPU, so it cannot tell ``torch.tensor(1.0, device="cpu")`` from a
        constant a real run makes on the GPU. The steps of the optimizers the trace models (torch.optim
        2.13's AdamW, Adam, SGD and Adafactor) make host constants only: the step counters and their
        ``torch.tensor(1.0, device="cpu")`` increment (adam.py ``_multi_tensor_adam``, _adafactor.py),
        which the stub CUDA device never sees. (ASGD, say, makes device ones: not modelled.)
        """
        before, self._host_constants = self._host_constants, True
        try:
            yield
        finally:
            self._host_constants = before

    def owned_by(self, tensor: torch.Tensor) -> contextlib.AbstractContextManager:
        """Allocations inside the block belong with ``tensor`` (a parameter):
        a layer-tagging tracker tags them with its layer. Here: nothing."""
        return contextlib.nullcontext()

    def label(self, tensors: Iterable[torch.Tensor], category: MemoryCategory) -> None:
        """Give the storages of ``tensors`` their final ``category``."""
        for t in tensors:
            idx = self._live.get(id(t.untyped_storage()))
            if idx is not None:
                self._records[idx].category = category

    def label_live_since(self, start_record: int, old: MemoryCategory, new: MemoryCategory) -> None:
        """Relabel live storages allocated since record ``start_record`` from ``old`` to ``new``."""
        for idx in self._live.values():
            rec = self._records[idx]
            if idx >= start_record and rec.category is old:
                rec.category = new

    def category_of(self, tensor: torch.Tensor) -> MemoryCategory | None:
        """The category of ``tensor``'s storage, or None if it is not tracked."""
        idx = self._live.get(id(tensor.untyped_storage()))
        return None if idx is None else self._records[idx].category

    @property
    def num_records(self) -> int:
        return len(self._records)

    def mark(self, name: str) -> None:
        """Remember the current point of the event stream as ``name`` in this phase (first call only)."""
        self._marks.setdefault(f"{name}:{self.phase.value}", len(self._events))

    # --------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = self._run(func, args, kwargs)
        if not _pause.is_paused():
            self._op = func
            for t in _tensors_in(out):
                self._see(t.untyped_storage(), MemoryCategory.TEMPORARY)
        return out

    @staticmethod
    def _run(func, args, kwargs):
        """Run one op, recording nothing."""
        if func is _PRIM_DEVICE:
            # `tensor.device` queries (the autograd engine makes tens of
            # thousands per step) allocate nothing; answering them here skips
            # FakeTensorMode's dispatch, a third of the trace time on 8B.
            t = args[0]
            return t.fake_device if is_fake(t) else func(*args)
        if func in _SAME_DTYPE_MATMULS and is_fake(args[0]):
            # Fake kernels do not check what the real ones refuse: a matrix product of two dtypes (a
            # 16-bit layer fed fp32 hidden states) fails in the real run, so it fails the trace too.
            dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
            if len(dtypes) > 1:
                raise RuntimeError(f"{func}: expected the operands to have the same dtype, got "
                                   f"{sorted(str(d) for d in dtypes)} (a real run fails the same way)")
        if func is _LOCAL_SCALAR_DENSE and is_fake(args[0]):
            # `.item()` on a fake tensor has no value to read. Optimizers read
            # step counters and norms this way (torch/optim/_adafactor.py) to
            # compute python scalars; memory does not depend on them. A fixed
            # 1 stands in.
            return _PLACEHOLDER_SCALAR.get(args[0].dtype.is_floating_point, 1)
        return func(*args, **(kwargs or {}))

    def _see(self, storage: torch.UntypedStorage, category: MemoryCategory) -> None:
        key = id(storage)
        idx = self._live.get(key)
        requested = storage.nbytes()
        nbytes = round_allocation(requested)
        if idx is not None:
            rec = self._records[idx]
            if rec.nbytes == nbytes:
                return
            # resize_ / set_ changed the storage's size: CUDA frees and reallocates.
            self._free(key)
        if nbytes == 0:
            return
        if self._host_constants and self._op is _LIFT_FRESH:
            category = MemoryCategory.HOST
        rec = _Storage(nbytes, category, self.phase, self.current_module, None, int(requested), self._op)
        idx = len(self._records)
        self._records.append(rec)
        self._live[key] = idx
        rec.ref = weakref.ref(storage, lambda _r, key=key, idx=idx: self._on_collect(key, idx))
        self._events.append((1, idx))
        self._phase_of_event.append(self.phase)

    def _on_collect(self, key: int, idx: int) -> None:
        if self._live.get(key) == idx:
            self._free(key)

    def _free(self, key: int) -> None:
        idx = self._live.pop(key)
        self._events.append((-1, idx))
        self._phase_of_event.append(self.phase)

    # ------------------------------------------------------------- accounting
    def live_bytes(self) -> int:
        """Device bytes live now (host-resident storages excluded)."""
        return sum(
            self._records[i].nbytes
            for i in self._live.values()
            if self._records[i].category is not MemoryCategory.HOST
        )

    def result(self) -> TraceResult:
        """Replay the event stream and return peaks and breakdowns."""
        recs = self._records
        cur = 0
        peak, peak_at = -1, 0
        phase_peak: dict[Phase, tuple[int, int]] = {}
        timeline: list[tuple[int, Phase, int]] = []
        events: list[tuple[int, int, int]] = []
        host = host_peak = 0
        at_event: dict[int, list[str]] = {}
        for name, i in self._marks.items():
            at_event.setdefault(i, []).append(name)  # several marks can share a position
        marks: dict[str, int] = {}
        for i, ((sign, idx), phase) in enumerate(zip(self._events, self._phase_of_event)):
            for name in at_event.get(i, ()):
                marks[name] = len(events)
            rec = recs[idx]
            if rec.category is MemoryCategory.HOST:
                host += sign * rec.nbytes
                host_peak = max(host_peak, host)
                continue
            cur += sign * rec.nbytes
            events.append((sign, idx, rec.nbytes))
            timeline.append((i, phase, cur))
            if cur > peak:
                peak, peak_at = cur, i
            if cur > phase_peak.get(phase, (-1, 0))[0]:
                phase_peak[phase] = (cur, i)
        if peak < 0:
            peak = 0
        peak_phase = self._phase_of_event[peak_at] if self._events else Phase.SETUP
        peak_module = ""
        if self._events:
            peak_module = recs[self._events[peak_at][1]].module
        at = sorted({peak_at, *(i for _, i in phase_peak.values())})
        snapshots = self._breakdowns_at(at)
        return TraceResult(
            peak_bytes=peak,
            peak_phase=peak_phase,
            peak_module=peak_module,
            breakdown=snapshots.get(peak_at, {}),
            phase_peaks={p: v for p, (v, _) in phase_peak.items()},
            phase_breakdowns={p: snapshots[i] for p, (_, i) in phase_peak.items()},
            timeline=timeline,
            num_events=len(self._events),
            events=events,
            host_peak_bytes=host_peak,
            marks={**marks, **{n: len(events) for n, i in self._marks.items() if i >= len(self._events)}},
            records=self._record_table(),
        )

    def _record_table(self) -> RecordTable:
        names: dict[Any, str] = {None: ""}
        ops = []
        for r in self._records:
            name = names.get(r.op)
            if name is None:
                name = names[r.op] = str(r.op)
            ops.append(name)
        recs = self._records
        return RecordTable(category=[r.category.value for r in recs], module=[r.module for r in recs],
                           phase=[r.phase.value for r in recs], op=ops, requested=[r.requested for r in recs])

    def _breakdowns_at(self, indices: list[int]) -> dict[int, dict[MemoryCategory, int]]:
        """Bytes per category live right after each event index in ``indices``."""
        out: dict[int, dict[MemoryCategory, int]] = {}
        if not indices:
            return out
        by_cat = {c: 0 for c in MemoryCategory if c is not MemoryCategory.HOST}
        want = iter(indices)
        nxt = next(want)
        for i, (sign, idx) in enumerate(self._events):
            rec = self._records[idx]
            if rec.category is not MemoryCategory.HOST:
                by_cat[rec.category] += sign * rec.nbytes
            while nxt == i:
                out[i] = dict(by_cat)
                nxt = next(want, None)
            if nxt is None:
                break
        return out


def _tensors_in(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                yield o
            elif isinstance(o, (tuple, list)):
                yield from _tensors_in(o)
