"""llmem_plugin: the peak GPU memory of a fine-tuning step, before it runs."""

from llmem_plugin.allocator_config import AllocatorConfig
from llmem_plugin.errors import ConfigError, LLMemError, TraceError, UnsupportedError, WontFitError
from llmem_plugin.estimate import Estimate, estimate
from llmem_plugin.gpus import GPU, get_gpu
from llmem_plugin.planner import Candidate, Plan, plan
from llmem_plugin.tracker import MemoryCategory, Phase
from llmem_plugin.workload import AttentionImpl, LoraSpec, OptimizerKind, Precision, Workload

__all__ = [
    "estimate",
    "Estimate",
    "plan",
    "Plan",
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
