"""A tracker that tags every allocation and free with the decoder layer it belongs to.

Fast mode (:mod:`llmem_plugin.trace.fastsynth`) builds the full model's event stream
from a shortened copy's by repeating one layer's events. For that it needs to
know, for every record (a storage), which layer it belongs to, and for every
event, which layer's code runs it (its *segment*):

- forward: the layer of the innermost module running (module hooks);
- backward: the layer whose output-gradient hook fired last, or the
  recomputed forward under gradient checkpointing;
- setup: parameters and buffers by their name;
- optimizer: an output of a ``_foreach_*`` op takes the layer of the element
  at the same index of the op's input list (parameters, gradients and states
  are lists in parameter order); a single-tensor op's output the layer of its
  inputs when they agree (``zeros_like(p)`` for a state), else none; an
  output of an op without tensor inputs (``torch.zeros(())`` for a state's
  step counter, made just before the parameter's other states in
  ``torch.optim``'s ``_init_group``) the layer of the next single-tensor op;
- an allocation runs in its record's layer; a free in the running layer
  (forward, backward; in the optimizer the layer of the last single-tensor op,
  for ``foreach=False`` loops where a temporary is freed when its variable is
  rebound); between two layers of the forward (the decoder loop rebinding its
  hidden states frees the output of the layer before the last) in the layer
  that ran last; and where no model code runs (the autocast weight cache freed
  at the end of the forward, foreach lists dropped, ``zero_grad``), in its
  record's layer.

The layers are the decoder's ``ModuleList``: the one module list of the model
whose length is the config's layer count
(:func:`llmem_plugin.models.config.decoder_layers`).
"""

from __future__ import annotations

import contextlib

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmem_plugin.models.config import decoder_layers
from llmem_plugin.trace import _pause
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, Phase, TraceResult, _tensors_in

__all__ = ["LayerTags", "LayerTaggingTracker"]

_UNSET = object()


@dataclass(frozen=True)
class LayerTags:
    """Layer of every record and event of a :class:`TraceResult`.

    Attributes:
        event_layer: Per event of ``TraceResult.events``, the layer running it
            (None: outside the decoder layers).
        record_layer: Per record index (the second field of an event), the
            layer it belongs to (None: embeddings, head, loss, inputs, ...).
        record_role: Per record index, what it is within its layer: the module
            path below the layer, the phase it was made in, its bytes.
        record_requested: Per record index, the bytes its storage asked for
            before the allocator's rounding (a buffer that grows with depth
            grows by a constant in these, not in the rounded ones).
        prefix: The decoder layer list's module path (``model.layers``).
    """

    event_layer: list[int | None]
    record_layer: list[int | None]
    record_role: list[tuple[str, str, int]]
    record_requested: list[int] | None = None
    prefix: str | None = None


def _flat(args: tuple, kwargs: dict | None) -> list[Any]:
    return [x for a in (*args, *(kwargs or {}).values()) for x in (a if isinstance(a, (list, tuple)) else (a,))]


class LayerTaggingTracker(MemoryTracker):
    """:class:`MemoryTracker` that also tags records and events with a layer.

    Known limitations:
        * Modules outside the watched model (a DPO reference model) are not
          seen: their records count as outside the layers.
    """

    def __init__(self) -> None:
        super().__init__()
        self._prefix: str | None = None
        self._record_layer: list[int | None] = []
        self._record_requested: list[int] = []
        self._event_layer: list[int | None] = []
        self._tensor_layer: dict[int, int | None] = {}  # id(parameter or buffer) -> layer
        self._override: Any = _UNSET
        self._optimizer_layer: int | None = None
        self._last_layer: int | None = None  # the layer that started last in the forward
        self._pending: list[tuple[int, int]] = []  # optimizer records made from no tensor: (record, event)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        super()._pre_forward(module, args)
        if self._module_stack:
            layer = self.layer_of(self._module_stack[-1])
            if layer is not None:
                self._last_layer = layer

    def set_phase(self, phase: Phase) -> None:
        super().set_phase(phase)
        self._last_layer = None
        self._pending = []

    def watch_modules(self, model: nn.Module) -> None:
        super().watch_modules(model)
        self._prefix = decoder_layers(model)
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            self._tensor_layer[id(t)] = self.layer_of(name)

    def layer_of(self, name: str) -> int | None:
        """The decoder layer a module, parameter or buffer name lies in."""
        p = self._prefix
        if not p or not name.startswith(p + "."):
            return None
        head = name[len(p) + 1:].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def _role(self, module: str) -> str:
        layer = self.layer_of(module)
        if layer is None:
            return module
        rest = module[len(self._prefix) + 1 + len(str(layer)):]
        return "#" + rest

    # ---------------------------------------------------------------- tagging
    def register(self, tensors: list[torch.Tensor], category: MemoryCategory) -> None:
        self._op = None
        for t in tensors:
            self._override = self._tensor_layer.get(id(t))
            self._see(t.untyped_storage(), category)
        self._override = _UNSET
        self.label(tensors, category)

    @contextlib.contextmanager
    def owned_by(self, tensor: torch.Tensor):
        previous, self._override = self._override, self._tensor_layer.get(id(tensor))
        try:
            yield
        finally:
            self._override = previous

    def _layer_of_tensor(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return _UNSET
        idx = self._live.get(id(t.untyped_storage()))
        return None if idx is None else self._record_layer[idx]

    def _optimizer_tags(self, args: tuple, kwargs: dict | None, outs: list[torch.Tensor], out: Any) -> list[Any]:
        flat = [*args, *(kwargs or {}).values()]
        if isinstance(out, (list, tuple)) and len(out) == len(outs):
            for a in flat:
                if isinstance(a, (list, tuple)) and len(a) == len(outs) and all(isinstance(x, torch.Tensor) for x in a):
                    return [self._layer_of_tensor(x) for x in a]
        tags = set()
        for a in flat:
            for x in a if isinstance(a, (list, tuple)) else (a,):
                tag = self._layer_of_tensor(x)
                if tag is not _UNSET:
                    tags.add(tag)
        one = tags.pop() if len(tags) == 1 else None
        return [one] * len(outs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = self._run(func, args, kwargs)
        if _pause.is_paused():
            return out
        outs = list(_tensors_in(out))
        optimizer = self.phase is Phase.OPTIMIZER
        tags = self._optimizer_tags(args, kwargs, outs, out) if optimizer else [_UNSET] * len(outs)
        single = len(outs) == 1 and not isinstance(out, (list, tuple))
        self._optimizer_layer = tags[0] if optimizer and single else None
        if self._pending and self._optimizer_layer is not None:
            for idx, event in self._pending:
                self._record_layer[idx] = self._event_layer[event] = self._optimizer_layer
            self._pending = []
        orphan = optimizer and single and not any(isinstance(x, torch.Tensor) for x in _flat(args, kwargs))
        outer = self._override  # an owned_by block around the op: its parameter's layer wins
        self._op = func
        for t, tag in zip(outs, tags):
            self._override = tag if outer is _UNSET else outer
            n = len(self._records)
            self._see(t.untyped_storage(), MemoryCategory.TEMPORARY)
            if orphan and outer is _UNSET and len(self._records) > n:
                self._pending.append((n, len(self._events) - 1))
        self._override = outer
        return out

    def _see(self, storage: torch.UntypedStorage, category: MemoryCategory) -> None:
        n = len(self._records)
        super()._see(storage, category)
        if len(self._records) > n:
            tag = self.layer_of(self.current_module) if self._override is _UNSET else self._override
            self._record_layer.append(tag)
            self._event_layer.append(tag)
            self._record_requested.append(int(storage.nbytes()))

    def _free(self, key: int) -> None:
        idx = self._live[key]
        if self.phase in (Phase.FORWARD, Phase.BACKWARD):
            running = self.layer_of(self.current_module)
            if running is None and self.phase is Phase.FORWARD and self._module_stack:
                running = self._last_layer
        else:
            running = self._optimizer_layer if self.phase is Phase.OPTIMIZER else None
        super()._free(key)
        self._event_layer.append(self._record_layer[idx] if running is None else running)

    def result(self) -> TraceResult:
        res = super().result()
        device = [layer for (_, idx), layer in zip(self._events, self._event_layer)
                  if self._records[idx].category is not MemoryCategory.HOST]
        assert len(device) == len(res.events), "one layer per device event"
        roles = [(self._role(r.module), r.phase.value, r.nbytes) for r in self._records]
        tags = LayerTags(event_layer=device, record_layer=list(self._record_layer), record_role=roles,
                         record_requested=list(self._record_requested), prefix=self._prefix)
        return dataclasses.replace(res, layer_tags=tags if self._prefix else None)
