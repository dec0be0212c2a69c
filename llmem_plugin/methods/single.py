"""``single``: one GPU, no distribution: the core estimate as a method row."""

from __future__ import annotations

from typing import Any

from llmem_plugin.device.gpus import GPU
from llmem_plugin.methods.base import MethodEstimate, RankMemory, host_overheads
from llmem_plugin.methods.layout import Layout
from llmem_plugin.workload import Workload

__all__ = ["PRESETS", "estimate"]

PRESETS: dict[str, dict[str, Any]] = {"single": {}}


def estimate(
    model: Any, workload: Workload, *, layout: Layout, gpu: GPU, alloc_conf: Any = None,
    torch_version: str | None = None, preset: str = "single", **options: Any,
) -> MethodEstimate:
    """The single-GPU estimate; ``layout`` must be one GPU.

    Raises:
        ConfigError: A layout of more than one GPU.
    """
    from llmem_plugin.errors import ConfigError
    from llmem_plugin.estimate import estimate as estimate_one

    if layout.num_gpus != 1:
        raise ConfigError(
            f"--method single runs on one GPU, got --gpus {layout.num_gpus}. HINT: pick a distributed --method"
        )
    est = estimate_one(model, workload, gpu=gpu, alloc_conf=alloc_conf, torch_version=torch_version, **options)
    rank = RankMemory(
        rank=0,
        peak_tensor_bytes=est.peak_tensor_bytes,
        peak_allocated_bytes=est.peak_allocated_bytes,
        peak_reserved_bytes=est.peak_reserved_bytes,
        device_total_bytes=est.device_total_bytes,
        fits=est.fits,
        breakdown={c.value: v for c, v in est.breakdown.items()},
        # Pinned host copies of offloaded activations (llmem_plugin.techniques.actoffload), as ddp counts them.
        host_bytes=est.host_peak_bytes if workload.offload_activations is not None else 0,
        host_overheads=host_overheads(),
    )
    return MethodEstimate(method=preset, layout=layout, ranks=[rank])
