"""llmem_plugin: the peak GPU memory of a fine-tuning step, before it runs."""

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from llmem_plugin.errors import ConfigError, LLMemError, TraceError, UnsupportedError, WontFitError

if TYPE_CHECKING:
    from llmem_plugin.device.allocator_config import AllocatorConfig
    from llmem_plugin.estimate import Estimate, estimate
    from llmem_plugin.device.gpus import GPU, get_gpu
    from llmem_plugin.planner.candidates import Candidate, Plan
    from llmem_plugin.planner.largest import MaxResult, max_batch_size, max_seq_len
    from llmem_plugin.planner.search import plan
    from llmem_plugin.trace.tracker import MemoryCategory, Phase
    from llmem_plugin.workload import AttentionImpl, LoraSpec, OptimizerKind, Precision, Workload

# The names below load their module on first use (PEP 562), so that importing
# the package, as `llmem --help` does, does not import torch.
_LAZY = {
    "AllocatorConfig": "device.allocator_config",
    "Estimate": "estimate",
    "estimate": "estimate",
    "GPU": "device.gpus",
    "get_gpu": "device.gpus",
    "Candidate": "planner.candidates",
    "Plan": "planner.candidates",
    "plan": "planner.search",
    "MaxResult": "planner.largest",
    "max_batch_size": "planner.largest",
    "max_seq_len": "planner.largest",
    "MemoryCategory": "trace.tracker",
    "Phase": "trace.tracker",
    "AttentionImpl": "workload",
    "LoraSpec": "workload",
    "OptimizerKind": "workload",
    "Precision": "workload",
    "Workload": "workload",
}


class _Package(types.ModuleType):
    """The package module: importing the submodule ``llmem_plugin.estimate``
    must not replace the ``estimate`` function the package exports."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "estimate" and isinstance(value, types.ModuleType):
            value = value.estimate
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmem_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"llmem_plugin.{module}"), name)
    globals()[name] = value
    return value

__all__ = [
    "estimate",
    "Estimate",
    "plan",
    "Plan",
    "max_batch_size",
    "max_seq_len",
    "MaxResult",
    "Candidate",
    "GPU",
    "get_gpu",
    "AllocatorConfig",
    "Workload",
    "LoraSpec",
    "Precision",
    "OptimizerKind",
    "AttentionImpl",
    "MemoryCategory",
    "Phase",
    "LLMemError",
    "ConfigError",
    "UnsupportedError",
    "TraceError",
    "WontFitError",
]

__version__ = "0.1.0"

# Lightning has no entry point for strategies: register "llmem-auto" in its
# StrategyRegistry now if it is loaded, else right after it is imported. No
# Lightning package is imported here (integrations/lightning.py, install_import_hook).
from llmem_plugin.integrations import lightning as _lightning

_lightning.install_import_hook()
del _lightning
