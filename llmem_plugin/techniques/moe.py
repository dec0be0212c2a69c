"""Mixture-of-experts layers: how their memory depends on token routing.

transformers 5.23 runs the experts of its MoE models (Mixtral, Qwen3-MoE, ...)
through one of several implementations, chosen by
``config._experts_implementation`` (transformers/integrations/moe.py,
``ExpertsInterface``). A model whose experts class carries
``@use_experts_implementation`` defaults to ``"grouped_mm"``
(transformers/modeling_utils.py, ``get_correct_experts_implementation``: None
becomes "grouped_mm"), on CUDA as on the CPU; that is what a training run uses
unless it asks for another one.

Whether the step's memory depends on the routing follows from each one's code:

* ``grouped_mm`` sorts the ``tokens x top_k`` (token, expert) pairs by expert
  and runs two grouped matmuls over all of them; every tensor it allocates has
  ``tokens x top_k`` rows (or one entry per expert), whatever the routing.
* ``batched_mm`` gathers one weight matrix per pair (``weight[expert_ids]``)
  and runs batched matmuls: again ``tokens x top_k`` rows, routing-free.
* ``eager`` (the experts class's own ``forward``) loops over the experts that
  received tokens and gathers each one's tokens with ``nonzero``: the number
  of rows of each expert's temporaries is data dependent. Fake tensors have
  no values, so ``nonzero`` cannot run (``DynamicOutputShapeException``), and
  the tracker's placeholder for a fake ``.item()`` (1, i.e. True) would make
  the loop's ``expert_idx == num_experts`` test skip every expert: an
  under-estimate. :func:`bound_eager_routing` instead gives the loop a legal
  worst case: the first ``top_k`` experts each receive every token (the most
  one expert can get, as a token picks ``top_k`` distinct experts), which
  keeps the ``tokens x top_k`` rows that the saved activations are linear in,
  and every other expert one row (so that all experts are hit).

The router's auxiliary loss (``output_router_logits``, off in both models'
configs, and never turned on by ``transformers.Trainer``: trainer.py 5.23 does
not mention it) keeps every layer's router logits until the loss; when a
config turns it on, the traced forward runs it, so it is in the trace.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode

from llmem_plugin.workload import Workload

__all__ = [
    "ROUTING_FREE_IMPLEMENTATIONS",
    "bound_eager_routing",
    "experts_implementation",
    "routing_note",
    "unsupported",
]

# transformers/integrations/moe.py (5.23): the implementations whose tensors
# all have tokens x top_k rows (sort/gather dispatch), so routing-independent.
ROUTING_FREE_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
# transformers/modeling_utils.py (5.23), get_correct_experts_implementation:
# no request means grouped_mm for classes that support setting it.
_DEFAULT_IMPLEMENTATION = "grouped_mm"

_NONZERO = torch.ops.aten.nonzero.default
_LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default


# Experts classes that run their own per-expert loop without transformers'
# @use_experts_implementation (so no _experts_implementation applies):
# modeling_dbrx.py (5.24) DbrxExperts.forward, nonzero over the experts hit
# and torch.where per expert, as the eager loop.
_UNDECORATED_EAGER_EXPERTS = ("DbrxExperts",)


def _routing_fields(config: Any) -> tuple[int, int] | None:
    """(num_experts, top_k) of an MoE config, or None for a dense model."""
    ffn = getattr(config, "ffn_config", None)  # DBRX: DbrxFFNConfig.moe_num_experts / moe_top_k
    if getattr(ffn, "moe_num_experts", None) and getattr(ffn, "moe_top_k", None):
        return int(ffn.moe_num_experts), int(ffn.moe_top_k)
    top_k = getattr(config, "num_experts_per_tok", None)
    # Mixtral names the expert count num_local_experts, Qwen3-MoE num_experts.
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not top_k or not experts:
        return None
    return int(experts), int(top_k)


def experts_implementation(config: Any) -> str | None:
    """The experts implementation a run of ``config`` uses, or None for a dense model.

    Args:
        config: A transformers ``PretrainedConfig``.

    Returns:
        ``"grouped_mm"``, ``"batched_mm"``, ``"eager"`` or another registered
        name; None when the config has no routed experts.
    """
    if _routing_fields(config) is None:
        return None
    if getattr(config, "model_type", None) == "dbrx":
        return "eager"  # DbrxExperts: see _UNDECORATED_EAGER_EXPERTS
    impl = getattr(config, "_experts_implementation", None)
    return impl or _DEFAULT_IMPLEMENTATION


def routing_note(model_config: Any, workload: Workload) -> str | None:
    """One line saying how the estimate treats token routing, or None for a dense model.

    Args:
        model_config: The model's ``PretrainedConfig`` (None: no note).
        workload: The workload estimated (its tokens per micro-batch).

    Returns:
        The note, naming the implementation and the rows its experts process.
    """
    fields = _routing_fields(model_config) if model_config is not None else None
    if fields is None:
        return None
    num_experts, top_k = fields
    impl = experts_implementation(model_config)
    tokens = workload.seq_len * workload.micro_batch_size
    rows = tokens * top_k
    if impl in ROUTING_FREE_IMPLEMENTATIONS:
        note = (f"MoE: experts run {impl}, which dispatches all {tokens} tokens x top-{top_k} = {rows} rows "
                f"at once, so memory does not depend on how tokens are routed among the {num_experts} experts")
    else:
        note = (f"MoE: experts run the {impl} per-expert loop, whose temporaries depend on routing; "
                f"estimated for the worst case, every one of the {tokens} tokens routed to the same "
                f"{top_k} experts ({tokens} rows per expert) and one row to each other expert")
    if getattr(model_config, "output_router_logits", False):
        layers = getattr(model_config, "num_hidden_layers", 0)
        note += (f"; router aux loss on: {layers} layers' router logits ({tokens} x {num_experts}) "
                 "kept until the loss, as traced")
    return note


class _WorstCaseRouting(TorchDispatchMode):
    """Answers the eager experts loop's data-dependent ops on fake tensors.

    The loop (transformers/models/*/modeling_*.py, ``*Experts.forward``)
    asks ``nonzero`` twice over: once for the experts hit (a 1-D mask over
    ``num_experts + 1``) and once per hit expert for its (top-k slot, token)
    pairs (a 2-D ``top_k x tokens`` mask); then it reads
    ``expert_idx == num_experts`` (a bool ``.item()``) to skip the sentinel
    expert. Here the first ``top_k`` experts are hit (at least two, so that
    the weight gradients of two experts still accumulate as under any spread
    routing), the first ``top_k`` of them with every token and any other with
    one, and no expert is the sentinel. Integer ``.item()`` calls (the expert
    index used to select its weights) fall through to the tracker's
    placeholder: every expert's weights have the same size.
    """

    def __init__(self, num_experts: int, top_k: int) -> None:
        super().__init__()
        self._hit = num_experts
        self._top_k = top_k
        self._served = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _NONZERO and is_fake(args[0]):
            mask = args[0]
            if mask.dim() == 1:
                rows = self._hit
            else:
                rows = mask.shape[-1] if self._served < self._top_k else 1
                self._served += 1
            # Allocated through the modes below (tracker, fake mode): the same
            # int64 (rows, dims) tensor the real nonzero returns.
            return torch.empty((rows, mask.dim()), dtype=torch.int64, device=mask.device)
        if func is _LOCAL_SCALAR_DENSE and is_fake(args[0]) and args[0].dtype is torch.bool:
            return False
        return func(*args, **kwargs)


def _is_experts_module(module: nn.Module) -> bool:
    # transformers/integrations/moe.py, use_experts_implementation: the
    # decorated __init__ sets these on every experts module.
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "config")


def bound_eager_routing(model: nn.Module) -> int:
    """Make the eager experts loops of ``model`` traceable under fake tensors, at their worst case.

    Each experts module whose implementation is the eager loop gets an
    instance ``forward`` that runs the original under :class:`_WorstCaseRouting`
    when its inputs are fake; real inputs run it untouched.

    Args:
        model: The model about to be traced (meta or fake parameters).

    Returns:
        How many experts modules were wrapped.
    """
    wrapped = 0
    model_fields = _routing_fields(getattr(model, "config", None))
    for module in model.modules():
        if "forward" in vars(module):
            continue
        if type(module).__name__ in _UNDECORATED_EAGER_EXPERTS:
            fields = model_fields
        elif _is_experts_module(module):
            impl = getattr(module.config, "_experts_implementation", None)
            fields = _routing_fields(module.config) if impl in (None, "eager") else None
        else:
            continue
        if fields is None:
            continue

        def forward(*args: Any, _orig=module.forward, _fields=fields, **kwargs: Any) -> Any:
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor) and is_fake(hidden):
                with _WorstCaseRouting(*_fields):
                    return _orig(*args, **kwargs)
            return _orig(*args, **kwargs)

        module.forward = functools.wraps(module.forward)(forward)
        wrapped += 1
    return wrapped


def unsupported(method: str, workload: Workload) -> str | None:
    """No workload setting is refused for MoE models: routing is bounded per
    implementation (see the module docstring), under every method.

    Args:
        method: ``"single"`` or a name from ``llmem_plugin.methods.method_names()``.
        workload: The workload.

    Returns:
        None.
    """
    del method, workload
    return None
