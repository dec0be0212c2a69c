"""The optimizer step of DTensor parameters, run on their local shards.

An elementwise optimizer (AdamW, SGD) on DTensors runs each foreach kernel on
the local shards once DTensor has propagated the shardings (torch 2.13,
torch/distributed/tensor/_dispatch.py): when a parameter and its gradient
have one sharding, nothing is redistributed, and the rank allocates exactly
what the same kernel allocates on the local tensors: the state shards
(``zeros_like`` the local shard) and the foreach outputs (``_foreach_sqrt``).
The DTensor layer adds no memory, only time: under a fake mode DTensor skips
its Python sharding cache (``_are_we_tracing``), and its foreach propagation
scans the whole tensor list once per element
(``_sharding_prop._propagate_use_strided_shard_flag``), quadratic in the
number of parameters: 9.5 s (``fsdp``) to 13 s (``dp-tp``, ``fsdp-tp``) of a
Llama-3.1-70B trace's first step on a 2-core CPU, against 0.3 s for its
second step, which hits DTensor's C++ cache (benchmarks/method_speed.py).

:class:`LocalShardStep` runs the step on a twin optimizer over the local
shards when that is what the DTensor step computes, and the DTensor step
itself otherwise. ``tests/methods/test_local_step.py`` checks that the two
record the same events.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["LocalShardStep"]

# Optimizers whose states and temporaries are elementwise in the parameter
# (torch/optim/adam.py, adamw.py, sgd.py), so a state of the local shard is
# the local shard of the state. Not Adafactor: its factored row and column
# states follow the parameter's global shape (torch/optim/_adafactor.py).
_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class LocalShardStep:
    """``optimizer.step()`` for DTensor parameters, run on their local shards.

    Call it in place of ``optimizer.step()``; it returns the optimizer whose
    states to label. The first eligible call builds a twin of ``optimizer``
    (same class, same hyperparameters per group) over the parameters' local
    tensors, which then keeps the states; each call hands it the local
    gradients for the step and takes them back afterwards, so the gradients
    are freed where ``optimizer.zero_grad`` drops the DTensors.

    Eligible: an elementwise optimizer (:data:`_ELEMENTWISE`) whose parameters
    are all DTensors on one device mesh, each gradient (where there is one) a
    DTensor with its parameter's placements and shapes. Otherwise DTensor
    would redistribute inside the step (TP's replicated embedding gradient
    against its vocabulary-sharded weight, a ``Partial`` gradient of a
    sequence-parallel norm), which the local step would not, so
    ``optimizer.step()`` runs as it is.

    Known limitations:
        * Eligibility is decided per call; once a twin holds states, a later
          ineligible step would leave them behind, so it raises instead.
        * The DTensor optimizer passed in never steps and keeps no state:
          read states from the returned optimizer.
    """

    def __init__(self) -> None:
        self._twin: torch.optim.Optimizer | None = None
        self._source: torch.optim.Optimizer | None = None
        self._views: list[torch.Tensor] = []

    def __call__(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not _eligible(optimizer):
            if self._twin is not None:
                raise AssertionError("the local-shard optimizer holds states, but this step needs DTensor's own")
            with _linear_strided_flag_check():
                optimizer.step()
            return optimizer
        if self._twin is None:
            self._build(optimizer)
        assert optimizer is self._source, "one LocalShardStep steps one optimizer"
        params = _params(optimizer)
        self._rebind([p._local_tensor for p in params])
        try:
            for p, view in zip(params, self._views, strict=True):
                view.grad = None if p.grad is None else p.grad._local_tensor
            self._twin.step()
        finally:
            for view in self._views:
                view.grad = None
        return self._twin

    def _build(self, optimizer: torch.optim.Optimizer) -> None:
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [p._local_tensor for p in g["params"]]} for g in optimizer.param_groups]
        self._twin = cls(groups, **defaults)
        self._source = optimizer
        self._views = [p for g in self._twin.param_groups for p in g["params"]]

    def _rebind(self, views: list[torch.Tensor]) -> None:
        """Point the twin at the current local tensors (a wrapper may have
        swapped a parameter's local tensor since the last step), states kept."""
        if all(a is b for a, b in zip(views, self._views, strict=True)):
            return
        twin = self._twin
        assert twin is not None
        new = iter(views)
        for group in twin.param_groups:
            group["params"] = [next(new) for _ in group["params"]]
        for old, view in zip(self._views, views, strict=True):
            if old is not view and old in twin.state:
                twin.state[view] = twin.state.pop(old)
        self._views = list(views)


def _params(optimizer: torch.optim.Optimizer) -> list[Any]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _eligible(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.tensor import DTensor

    if type(optimizer) not in _ELEMENTWISE:
        return False
    params = _params(optimizer)
    if not params or not all(isinstance(p, DTensor) for p in params):
        return False
    mesh = params[0].device_mesh
    for p in params:
        g = p.grad
        if p.device_mesh != mesh:
            return False
        if g is None:
            continue
        if not isinstance(g, DTensor) or g.device_mesh != mesh or g.placements != p.placements:
            return False
        if g.shape != p.shape or g._local_tensor.shape != p._local_tensor.shape:
            return False
    return True


@contextlib.contextmanager
def _linear_strided_flag_check() -> Iterator[None]:
    """Skip the per-element scans of DTensor's foreach sharding propagation
    that can have no effect.

    ``propagate_op_sharding_non_cached`` (torch 2.13,
    torch/distributed/tensor/_sharding_prop.py) calls
    ``_propagate_use_strided_shard_flag(strategy, op_schema)`` once per
    element of a foreach op, and each call scans every argument spec of the
    whole op for ``_StridedShard`` placements; with none it returns without
    touching anything. The scan's answer is computed once per op schema here
    (fix-ups change specs' flags, never their placements), and the original
    runs whenever it finds one. Without that function (another torch), nothing
    is patched.
    """
    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.tensor.placement_types import _StridedShard

    original = getattr(_sharding_prop, "_propagate_use_strided_shard_flag", None)
    if original is None:
        yield
        return
    last: list[Any] = [None, True]  # the op schema last scanned (held, so its id is not reused), its answer

    def propagate(op_strategy: Any, op_schema: Any) -> None:
        if last[0] is not op_schema:
            strided = any(isinstance(p, _StridedShard) for spec in op_schema.args_spec for p in spec.placements)
            last[:] = [op_schema, strided]
        if last[1]:
            original(op_strategy, op_schema)

    _sharding_prop._propagate_use_strided_shard_flag = propagate
    try:
        yield
    finally:
        _sharding_prop._propagate_use_strided_shard_flag = original
