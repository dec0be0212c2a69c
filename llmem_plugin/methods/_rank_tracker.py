"""A tracker that records one rank of a distributed step.

Shared by the methods traced under a fake process group (``fsdp``, ``tp``):
it sees DTensors through their local shards, skips DTensor's sharding
propagation, fixes the fake ``wait_tensor`` and can log the collectives the
step issues (for the communication volume).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from llmem_plugin.trace import _pause
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker

__all__ = ["Collective", "RankTracker", "StreamTracker", "local", "nbytes"]


@dataclass(frozen=True, slots=True)
class Collective:
    op: str
    group_name: str
    group_size: int
    payload_bytes: int  # all-reduce / reduce-scatter input, all-gather output


_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
_PRIM_DEVICE = torch.ops.prim.device.default
_FAKE_MODE_KEY = torch._C._TorchDispatchModeKey.FAKE


class StreamTracker(MemoryTracker):
    """A :class:`MemoryTracker` that also records the stream each allocation is made on.

    A wrapper written for CUDA (FSDP2, ColossalAI's LowLevelZero) allocates
    some buffers inside ``device_handle.stream(side_stream)``; on the CPU the
    same code switches ``torch.cpu``'s current stream (torch/cpu/__init__.py,
    ``StreamContext``). ``stream_of`` maps the record index of every
    allocation made off the default stream to a stream number (1, 2, ...),
    for :func:`llmem_plugin.methods._streams.simulate_streams`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stream_of: dict[int, int] = {}
        self._default_stream = torch.cpu.current_stream()
        self._streams: dict[int, tuple[Any, int]] = {}  # id(stream) -> (stream, number); holds the stream

    def _see(self, storage: torch.UntypedStorage, category: MemoryCategory) -> None:
        before = self.num_records
        super()._see(storage, category)
        if self.num_records > before:
            stream = torch.cpu.current_stream()
            if stream is not self._default_stream:
                known = self._streams.get(id(stream))
                if known is None:
                    known = self._streams[id(stream)] = (stream, len(self._streams) + 1)
                self.stream_of[before] = known[1]


class RankTracker(StreamTracker):
    """A :class:`MemoryTracker` that records one rank: DTensors' local shards.

    A dispatch mode sees an op on DTensors before DTensor unwraps it, and a
    wrapper subclass's own storage is no memory (a DTensor's reports the
    *global* size). Returning ``NotImplemented`` for ops on wrapper
    subclasses (DTensor, and the AsyncCollectiveTensor that functional
    collectives return in a real run) hands them to the subclass, which runs
    the inner ops with this mode still active: the tracker sees exactly the
    shards and temporaries this rank allocates. A wrapper an op returns
    counts as its inner tensors. Ops run under another fake mode (DTensor's
    sharding propagation on global shapes, isolated by
    :func:`isolated_sharding_propagation`) allocate nothing on the device.
    Also counts the collectives the step issues, and records side streams
    as :class:`StreamTracker`.

    Known limitations:
        * ``register``/``label`` map a DTensor to its local tensor; other
          wrapper subclasses are taken as they are.
        * The fake mode DTensor's sharding propagation runs under (see
          ``_fakepg.isolated_sharding_propagation``) is an infra mode beneath
          this one, so its ops reach this tracker first; the check on the
          active fake mode drops them.
    """

    def __init__(self, fake_mode: Any) -> None:
        super().__init__()
        self._fake_mode = fake_mode
        self.record_collectives = False
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in types:
            if _is_wrapper_type(t):
                return NotImplemented
        if func is _PRIM_DEVICE:  # answered without dispatch, allocates nothing (MemoryTracker._run)
            return self._run(func, args, kwargs)
        active = torch._C._get_dispatch_mode(_FAKE_MODE_KEY)
        if active is not None and active is not self._fake_mode:
            with _pause.untracked():
                return self._run(func, args, kwargs)
        if func is _WAIT_TENSOR and is_fake(args[0]):
            # The real kernel returns its input (torch/csrc/distributed/c10d/
            # Functional.cpp, wait_tensor); the fake kernel would return a
            # fresh tensor, a second copy of every collective's output.
            return args[0]
        if self.record_collectives and func.namespace in ("_c10d_functional", "c10d"):
            c = collective(func, args, kwargs or {})
            if c is not None:
                self.collectives.append(c)
        seeing = not _pause.is_paused()
        with _pause.untracked():  # seen below, through wrapper subclasses
            out = self._run(func, args, kwargs)
        if seeing:
            self._op = func
            for t in _inner_tensors(out):
                self._see(t.untyped_storage(), MemoryCategory.TEMPORARY)
        return out

    def register(self, tensors, category: MemoryCategory) -> None:
        super().register([local(t) for t in tensors], category)

    def label(self, tensors: Iterable[torch.Tensor], category: MemoryCategory) -> None:
        super().label([local(t) for t in tensors], category)

    def resized(self, tensors: list[torch.Tensor], category: MemoryCategory) -> None:
        """Record storages resized in place. FSDP2 frees and re-allocates
        unsharded parameters with ``UntypedStorage.resize_`` (keeping the
        tensors autograd saved), which no ATen op reports."""
        if _pause.is_paused():
            return
        self._op = torch.ops.aten.resize_.default  # what the storage's re-allocation is (no op dispatched it)
        for t in tensors:
            self._see(local(t).untyped_storage(), category)
        self.label(tensors, category)


def _inner_tensors(out: Any) -> Iterator[torch.Tensor]:
    """The plain tensors in an op's output, wrapper subclasses unwrapped."""
    if isinstance(out, (tuple, list)):
        for o in out:
            yield from _inner_tensors(o)
    elif isinstance(out, torch.Tensor):
        if _is_wrapper_type(type(out)):
            names, _ = out.__tensor_flatten__()
            for name in names:
                yield from _inner_tensors(getattr(out, name))
        else:
            yield out


# Tensor type -> whether it is a traceable wrapper subclass (DTensor,
# AsyncCollectiveTensor): asked for every op's argument types, and fixed per type.
_WRAPPER_TYPES: dict[type, bool] = {}


def _is_wrapper_type(t: type) -> bool:
    known = _WRAPPER_TYPES.get(t)
    if known is None:
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

        known = _WRAPPER_TYPES[t] = is_traceable_wrapper_subclass_type(t)
    return known


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def nbytes(ts: Any) -> int:
    """Bytes of a tensor or a (nested) list of tensors."""
    if isinstance(ts, torch.Tensor):
        return ts.numel() * ts.element_size()
    return sum(nbytes(t) for t in ts)


# Collective ops the traced step can issue: op name (trailing "_" dropped) ->
# (kind, index of the argument whose bytes are the payload). Functional
# collectives (torch/distributed/_functional_collectives.py) take a group
# name; c10d ops (torch/csrc/distributed/c10d/Ops.cpp) take the ProcessGroup.
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", 0),  # input: times the group size
    "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
}
_C10D = {
    "allreduce": ("all_reduce", 0),
    "allreduce_coalesced": ("all_reduce", 0),
    "allgather": ("all_gather", 0),  # outputs
    "_allgather_base": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter": ("reduce_scatter", 1),  # inputs
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "alltoall_base": ("all_to_all", 1),
}


def collective(func, args, kwargs) -> Collective | None:
    """The collective ``func`` issues, or None for waits and other ops.

    The payload is the size NCCL's bus-bandwidth formulas start from
    (nccl-tests doc/PERFORMANCE.md): the buffer of an all-reduce, the
    gathered output of an all-gather, the input of a reduce-scatter or
    all-to-all.
    """
    import torch.distributed.distributed_c10d as c10d

    name = func._opname.rstrip("_")
    if func.namespace == "_c10d_functional":
        if name not in _FUNCTIONAL:
            return None
        kind, at = _FUNCTIONAL[name]
        pg = c10d._resolve_process_group(args[-1] if isinstance(args[-1], str) else kwargs["group_name"])
        payload = nbytes(args[at]) * (pg.size() if kind == "all_gather" else 1)
    else:
        boxed = [a for a in args if isinstance(a, torch.ScriptObject)]
        if name not in _C10D or not boxed:
            return None
        kind, at = _C10D[name]
        pg = torch.distributed.ProcessGroup.unbox(boxed[0])
        payload = nbytes(args[at])
    return Collective(kind, pg.group_name, pg.size(), payload)
