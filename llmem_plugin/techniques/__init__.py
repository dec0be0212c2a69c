"""Techniques: what QLoRA, a chunked loss, an 8-bit optimizer or activation offload allocate, built into the model and step.

In: a workload and a built model. Out: the model and step as the technique changes them; here, which methods can run which.

Each technique module answers for itself (``unsupported(method, workload)``
returns the reason a combination cannot run, or None); :func:`check_supported`
asks them all and raises one clear error naming the combination.
"""

from __future__ import annotations

import importlib

from llmem_plugin.errors import ConfigError
from llmem_plugin.workload import Workload

__all__ = ["check_supported"]

# Modules with an ``unsupported(method: str, workload: Workload) -> str | None``.
_TECHNIQUES = (
    "llmem_plugin.techniques.quant",
    "llmem_plugin.techniques.optim",
    "llmem_plugin.techniques.loss",
    "llmem_plugin.trace.emulation.flash",
    "llmem_plugin.techniques.actoffload",
    "llmem_plugin.techniques.reference",
    "llmem_plugin.techniques.packing",
)


def check_supported(method: str, workload: Workload) -> None:
    """Raise :class:`ConfigError` if ``workload`` uses a technique that
    ``method`` (a ``method_names()`` entry, or ``"single"``) cannot run."""
    for name in _TECHNIQUES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        reason = mod.unsupported(method, workload)
        if reason:
            raise ConfigError(reason)
