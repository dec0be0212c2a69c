"""Distributed fine-tuning methods: per-rank memory and communication.

One module per method family, all with the same signature::

    estimate(model, workload, *, layout, gpu, alloc_conf, torch_version,
             preset, **options) -> MethodEstimate

Each module's ``PRESETS`` maps the registry names it serves to their settings
(the Lightning style: ``zero3_offload`` -> ZeRO stage 3 + optimizer offload).
:func:`method_names` lists every name; an unknown one is an error that lists
them.
"""

from __future__ import annotations

import importlib
from typing import Any

from llmem_plugin.errors import ConfigError
from llmem_plugin.methods.base import MethodEstimate, RankMemory
from llmem_plugin.methods.layout import Layout

__all__ = ["Layout", "MethodEstimate", "RankMemory", "estimate_method", "method_names"]

# Method-family modules, in the order `--method all` reports them.
_MODULES = ("single", "ddp", "zero", "fsdp", "tp", "colossal", "colossal_hybrid")


def _registry() -> dict[str, tuple[str, dict[str, Any]]]:
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for mod in _MODULES:
        presets = importlib.import_module(f"llmem_plugin.methods.{mod}").PRESETS
        for name, settings in presets.items():
            assert name not in out, f"method {name} registered twice"
            out[name] = (mod, settings)
    return out


def method_names() -> list[str]:
    """Every registered method name."""
    return list(_registry())


def estimate_method(
    name: str,
    model: Any,
    workload: Any,
    *,
    layout: Layout,
    gpu: Any,
    alloc_conf: Any = None,
    torch_version: str | None = None,
    **options: Any,
) -> MethodEstimate:
    """Per-rank memory of ``model`` trained with method ``name`` on ``layout``.

    Raises:
        ConfigError: Unknown method (the message lists the valid ones), or a
            layout the method cannot run on.
    """
    reg = _registry()
    if name not in reg:
        raise ConfigError(f"unknown method '{name}'; valid: {', '.join(reg)}. HINT: pass --method with one of them")
    mod, settings = reg[name]
    fn = importlib.import_module(f"llmem_plugin.methods.{mod}").estimate
    return fn(model, workload, layout=layout, gpu=gpu, alloc_conf=alloc_conf, torch_version=torch_version,
              preset=name, **{**settings, **options})
