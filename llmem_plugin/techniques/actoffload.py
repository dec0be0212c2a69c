"""Activation offloading: saved activations held in host memory between forward and backward.

Both modes are ``torch.autograd.graph.saved_tensors_hooks``: every tensor
autograd saves for backward goes through ``pack`` in the forward and comes
back through ``unpack`` in the backward. In the trace every tensor is a CPU
tensor standing for a CUDA one, so the host side is a copy the tracker labels
:attr:`MemoryCategory.HOST` (off the device, counted in the host peak), and
bringing it back is a new tracked allocation. Values stay correct, so a real
CPU run trains.

SAVE_ON_CPU reproduces ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
(torch/autograd/graph.py, 2.13): ``pack_to_cpu`` copies every saved tensor,
parameters included, into ``torch.empty(tensor.size(), ...)`` (contiguous,
``numel * element_size`` bytes); ``unpack_from_cpu`` returns
``tensor.to(device)``, a new contiguous device tensor, which lives while the
backward node that asked for it runs.

STREAMED reproduces TRL's ``OffloadActivations`` as
``get_act_offloading_ctx_manager(model)`` builds it for
``SFTConfig(activation_offloading=True)`` (trl/models/activation_offloading.py,
trl 1.16, from torchtune): see :class:`_Streamed` for the rules.

With non-reentrant gradient checkpointing the checkpoint's own hooks are the
innermost ones inside each checkpointed layer, so nothing saved inside a layer
reaches these hooks; what does is what ``torch.utils.checkpoint`` saves itself
(the layer's tensor inputs, through ``_NoopSaveInputs``) and the tensors saved
outside checkpointed regions. The real hooks run, so this needs no special case.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker
from llmem_plugin.workload import ActivationOffload, Workload

__all__ = ["SUPPORTED_METHODS", "offload_context", "unsupported"]

# trl/models/activation_offloading.py (trl 1.16), OffloadActivations.__init__
# and get_act_offloading_ctx_manager defaults: tensors under 1024 bytes
# (element_size * nelement) stay on the device; an offloaded tensor's device
# copy stays alive until 5 more tensors have been packed.
_MIN_OFFLOAD_BYTES = 1024
_MAX_FWD_STASH = 5
# get_act_offloading_ctx_manager wraps the output head (``lm_head`` on HF
# causal LMs) and every module whose name contains "liger" in a NoOpManager:
# tensors saved while they run bypass offloading and stay on the device.
_HEAD_NAME = "lm_head"
_LIGER_MARK = "liger"

# Methods whose traced step runs these hooks as the real job would.
SUPPORTED_METHODS = ("single", "ddp")


def unsupported(method: str, workload: Workload) -> str | None:
    """Why ``method`` cannot run ``workload.offload_activations``, or None.

    Args:
        method: ``"single"`` or a name from ``llmem_plugin.methods.method_names()``.
        workload: The workload.

    Returns:
        One sentence naming the combination, with a HINT; None if supported.
    """
    mode = workload.offload_activations
    if mode is None or method in SUPPORTED_METHODS:
        return None
    return (
        f"--offload-activations {mode.value} is not modelled with method '{method}' (only with "
        f"{', '.join(SUPPORTED_METHODS)}). HINT: drop --offload-activations or estimate with --method ddp"
    )


def offload_context(mode: ActivationOffload, tracker: MemoryTracker) -> contextlib.AbstractContextManager:
    """The saved-tensor hooks of ``mode`` for one micro-batch's forward and backward.

    Args:
        mode: :class:`ActivationOffload` mode.
        tracker: The tracker recording the step (labels host copies, tells
            parameters apart, gives the running module).

    Returns:
        A context manager; enter a fresh one per micro-batch.
    """
    if mode is ActivationOffload.SAVE_ON_CPU:
        return _SaveOnCpu(tracker)
    if mode is ActivationOffload.STREAMED:
        return _Streamed(tracker)
    raise AssertionError(mode)


def _to_host(t: torch.Tensor, tracker: MemoryTracker, size: tuple[int, ...] | None = None) -> torch.Tensor:
    """A contiguous host copy of ``t`` (or of its first ``size`` storage elements)."""
    if size is None:
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)
        host.copy_(t)
    else:
        host = torch.empty(size, dtype=t.dtype)
        host.copy_(torch.as_strided(t, size, (1,), 0))
    tracker.label([host], MemoryCategory.HOST)
    return host


def _to_device(host: torch.Tensor) -> torch.Tensor:
    """``host.to(device)``: a new contiguous device tensor with its values."""
    return host.clone(memory_format=torch.contiguous_format)


class _SaveOnCpu(saved_tensors_hooks):
    """``save_on_cpu(pin_memory=True)``: every saved tensor goes to the host."""

    def __init__(self, tracker: MemoryTracker) -> None:
        def pack(t: torch.Tensor) -> tuple[bool, torch.Tensor]:
            # A tensor already on the host is copied too; ``.to(cpu)`` then
            # hands the copy back without a new allocation.
            on_host = tracker.category_of(t) is MemoryCategory.HOST
            return on_host, _to_host(t, tracker)

        def unpack(packed: tuple[bool, torch.Tensor]) -> torch.Tensor:
            on_host, host = packed
            return host if on_host else _to_device(host)

        super().__init__(pack, unpack)


class _Streamed(saved_tensors_hooks):
    """TRL ``OffloadActivations(use_pin_memory=True, use_streams=True)``.

    Forward (``pack_tensor``), in TRL's order of checks; a kept tensor stays
    referenced on the device until backward unpacks it:

    * a storage (pointer + offset, dtype) already tracked in this forward is
      kept, and stays tracked under the new id, so later saves of it are kept too;
    * tensors on the host, smaller than ``_MIN_OFFLOAD_BYTES``, parameters
      (``nn.Parameter`` or a parameter's storage) are kept;
    * anything saved inside the output head or a liger module is not seen at
      all (the NoOpManager's hooks are innermost there);
    * otherwise a view with a storage offset is cloned (contiguous) on the
      device first, a broadcast view (a zero stride) copies its whole storage,
      and the host copy is made; the device tensor stays in the forward stash
      until ``_MAX_FWD_STASH`` more ids have been handed out.

    Backward (``unpack_tensor_with_streams``): a tensor still in the forward
    stash is returned as is; otherwise a device copy is made and kept in the
    backward stash until the next autograd node that unpacks an offloaded
    tensor has run. The forward stash is emptied after the first such node.

    Stream timing modelled as a rule: TRL frees stashed tensors only after
    waiting on the copy stream's events, so the Python references above are
    the earliest frees; a copy freed by ``record_stream`` (when a view of it
    outlives its node) is kept in the stash here, which frees no earlier.

    Known limitations: a freed storage whose address the caching allocator
    hands to a later saved tensor makes TRL treat that tensor as already
    offloaded (its key is the data pointer); here a freed storage never
    matches. Buffers saved for backward are offloaded here (TRL
    skips only parameters by storage; buffers it skips only as ``nn.Buffer``,
    which ``register_buffer`` does not keep); the per-stream pools of the
    caching allocator (copies back are allocated on the side stream) are not
    simulated.
    """

    def __init__(self, tracker: MemoryTracker) -> None:
        self._tracker = tracker
        self._next_id = 0
        self._saved: dict[int, tuple] = {}  # id -> (tensor, offloaded, stride, offset, shape)
        self._key_to_id: dict[tuple, int] = {}
        self._id_to_key: dict[int, tuple] = {}
        self._fwd_stash: dict[int, torch.Tensor] = {}
        self._bwd_stash: dict[int, torch.Tensor] = {}
        self._graph_id: int | None = None
        self._node = None
        self._first_backward = True
        super().__init__(self._pack, self._unpack)

    def __exit__(self, *exc) -> None:
        # TRL's __exit__ syncs the streams and clears the stashes.
        self._fwd_stash.clear()
        self._bwd_stash.clear()
        super().__exit__(*exc)

    def _release_key(self, tid: int) -> None:
        key = self._id_to_key.pop(tid, None)
        if key is not None and self._key_to_id.get(key) == tid:
            del self._key_to_id[key]

    def _track_key(self, key: tuple, tid: int) -> None:
        self._key_to_id[key] = tid
        self._id_to_key[tid] = key

    def _in_noop_module(self) -> bool:
        parts = self._tracker.current_module.split(".")
        return _HEAD_NAME in parts or any(_LIGER_MARK in p.lower() for p in parts)

    def _keep(self, t: torch.Tensor) -> bool:
        if self._tracker.category_of(t) in (MemoryCategory.HOST, MemoryCategory.PARAMETER):
            return True
        return isinstance(t, nn.Parameter) or t.element_size() * t.nelement() < _MIN_OFFLOAD_BYTES

    def _pack(self, t: torch.Tensor):
        if self._in_noop_module():
            return ("noop", t)
        self._next_id += 1
        tid = self._next_id
        # TRL keys storages by data pointer; a weak reference keys the live
        # storage object the same way without colliding with a freed one.
        key = (weakref.ref(t.untyped_storage()), t.storage_offset(), t.dtype)
        if key in self._key_to_id:
            self._saved[tid] = (t, False, None, None, None)
            self._track_key(key, tid)
            return tid
        if self._keep(t):
            self._saved[tid] = (t, False, None, None, None)
            return tid
        broadcast = 0 in t.stride()
        if not broadcast and t.storage_offset() != 0:
            t = t.clone(memory_format=torch.contiguous_format)
        elif not broadcast and not t.is_contiguous():
            t = t.contiguous()
        for old in list(self._fwd_stash):
            if old > tid - _MAX_FWD_STASH:
                break
            del self._fwd_stash[old]
            self._release_key(old)
        stride, offset, shape = t.stride(), t.storage_offset(), t.size()
        if broadcast:
            host = _to_host(t, self._tracker, (t.untyped_storage().nbytes() // t.element_size(),))
        else:
            host = _to_host(t, self._tracker)
        self._saved[tid] = (host, True, stride, offset, shape)
        self._fwd_stash[tid] = t
        self._track_key(key, tid)
        return tid

    def _unpack(self, packed) -> torch.Tensor:
        if isinstance(packed, tuple):  # saved under the NoOpManager
            return packed[1]
        tid = packed
        if self._first_backward:
            self._first_backward = False
            self._graph_id = torch._C._current_graph_task_id()
            # TRL queues the release of what is left at the end of backward.
            torch.autograd.Variable._execution_engine.queue_callback(self._bwd_stash.clear)
        tensor, offloaded, stride, offset, shape = self._saved.pop(tid)
        self._release_key(tid)
        if not offloaded:
            return tensor
        node = torch._C._current_autograd_node()
        prev: list[int] = []
        if torch._C._current_graph_task_id() == self._graph_id and node is not self._node:
            self._node = node
            prev = list(self._bwd_stash)
        if tid in self._fwd_stash:
            dev = self._fwd_stash[tid]
        else:
            dev = torch.as_strided(_to_device(tensor), shape, stride, offset)
            self._bwd_stash[tid] = dev
        if node is not None:
            node.register_hook(self._after_node(prev))
        return dev

    def _after_node(self, prev: list[int]):
        def hook(outputs, inputs):
            # "we're in bwd now": the forward stash goes after the first node.
            for old in list(self._fwd_stash):
                del self._fwd_stash[old]
                self._release_key(old)
            for old in prev:
                self._bwd_stash.pop(old, None)
            return outputs

        return hook
