"""Host (CPU) RAM: what a training process needs on its node, and what the node has.

Every rank is one process on its node, and holds on the host:

- the method's copies (``RankMemory.host_bytes``): offloaded master weights,
  gradients and optimizer states, pinned staging buffers (DeepSpeed ZeRO
  offload, FSDP2 ``CPUOffloadPolicy``, Gemini's pinned shards), and the
  pinned copies of offloaded activations (:mod:`llmem_plugin.techniques.actoffload`);
- the rounding of its pinned allocations: PyTorch's caching host allocator
  rounds every pinned request up to a power of two
  (aten/src/ATen/core/CachingHostAllocator.h, torch 2.13, ``allocate``:
  ``c10::llvm::PowerOf2Ceil(size)`` below ``pinned_max_round_threshold``,
  unbounded by default), so a pinned buffer holds :func:`pinned_bytes`;
- the process' own baseline (:func:`process_baseline_bytes`): the
  framework's resident memory, measured, plus the host side of the CUDA
  context, cited.

A node holds ``gpus_per_node`` such processes. Its capacity is the
``--host-memory`` given, else a default: the local machine's RAM
(:func:`local_host_memory`, what the adapters use: they run on the training
machine) or the catalog's instance for the GPU (:func:`catalog_host_memory`,
what the CLI uses: it plans for another machine).

Known limitations:
    * Loading a checkpoint is not counted: it is a transient before the
      first step whose size depends on the loader (``from_pretrained`` maps
      safetensors shards; DeepSpeed's estimators assume a full fp32 copy per
      process, ``4 * params * gpus_per_node``, without ``zero.Init``).
    * Data loader workers, the page cache and other processes on the node are
      not counted: keep headroom, as the GPU margin does.
    * The CUDA context's host side is cited, not measured here (no GPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


__all__ = [
    "CUDA_CONTEXT_HOST_BYTES",
    "FRAMEWORK_RSS_BYTES",
    "HostCapacity",
    "catalog_host_memory",
    "local_host_memory",
    "parse_host_memory",
    "pinned_bytes",
    "process_baseline_bytes",
    "resolve_host_memory",
]

# Resident memory of a CPU training process before its model states: psutil
# RSS after `import torch, transformers`, a 148K-parameter Llama built and
# two AdamW steps (benchmarks/host_baseline.py,
# benchmarks/results/host-baseline-2026-11-25.json: 424,333,312 B with torch
# 2.13.0+cpu, transformers 5.24; `import torch` alone 230 MB).
FRAMEWORK_RSS_BYTES = 424_333_312

# Host RSS a CUDA context adds to a PyTorch process: pytorch/pytorch#113326
# (torch 2.2 + CUDA 11.8, lazy module loading, RTX 3090, /usr/bin/time -v
# maximum RSS): `import torch` 322,040 kB; after `torch._C._cuda_getDeviceCount()`
# (which `torch.cuda.is_available()` and every trainer call) and a first CUDA
# tensor, 2,056,600 kB. The difference, 1,734,560 kB (1.65 GiB), is taken: the
# larger of the two CUDA figures (a tensor without the device-count
# query added only 116,592 kB), so the estimate errs on the safe side. It
# includes the CUDA build's libraries (cuBLAS, cuDNN, NCCL) paged in.
CUDA_CONTEXT_HOST_BYTES = (2_056_600 - 322_040) * 1024

def pinned_bytes(nbytes: int) -> int:
    """Host bytes a pinned allocation of ``nbytes`` takes: the next power of
    two (torch's CachingHostAllocator, module docstring); 0 for 0."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def process_baseline_bytes() -> int:
    """Host RAM one training process holds before any model state: the
    framework's measured RSS plus the CUDA context's host side (cited)."""
    return FRAMEWORK_RSS_BYTES + CUDA_CONTEXT_HOST_BYTES


@dataclass(frozen=True, kw_only=True)
class HostCapacity:
    """Host RAM of one node and where the figure comes from.

    Attributes:
        node_bytes: RAM per node in bytes.
        source: ``--host-memory``, the local machine, or the catalog
            instance with its provider page.
    """

    node_bytes: int
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"node_bytes": self.node_bytes, "source": self.source}


def parse_host_memory(value: int | str) -> int:
    """Host RAM per node in bytes, from an int of bytes or a size string.

    Args:
        value: Bytes (an int of at least 1 MiB), or a size with units as
            ``--gpu-memory`` takes them ("2TiB", "512GiB", "1152GB"; a bare
            number is GiB).

    Raises:
        ConfigError: Not a size, not positive, or a bare int under 1 MiB
            (almost surely GiB meant).
    """
    from llmem_plugin.device.gpus import size_bytes

    return size_bytes(value, name="host_memory", what="host memory", example="512GiB")


def local_host_memory() -> HostCapacity:
    """This machine's physical RAM (``os.sysconf`` pages, else psutil)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        import psutil

        total = psutil.virtual_memory().total
    return HostCapacity(node_bytes=int(total), source="this machine's RAM")


def catalog_host_memory(gpu: Any, gpus_per_node: int) -> HostCapacity:
    """The catalog's host RAM for a node of ``gpus_per_node`` of ``gpu``
    (:func:`llmem_plugin.device.gpus.host_memory_default`)."""
    from llmem_plugin.device.gpus import host_memory_default

    nbytes, source = host_memory_default(gpu.name if hasattr(gpu, "name") else str(gpu), gpus_per_node)
    return HostCapacity(node_bytes=nbytes, source=source)


def resolve_host_memory(value: int | str | None, *, gpu: Any, gpus_per_node: int,
                        default: str = "catalog") -> HostCapacity:
    """The node's host RAM: ``value`` if given, else the default.

    Args:
        value: ``--host-memory`` / ``host_memory=`` (see :func:`parse_host_memory`),
            "local" for this machine's RAM, or None.
        gpu: The catalog GPU (for the catalog default).
        gpus_per_node: GPUs on a node.
        default: "catalog" (the GPU's cloud instance; the CLI and the Python
            API) or "local" (this machine; the adapters).

    Raises:
        ConfigError: A value that is not a size.
    """
    if isinstance(value, str) and value.strip().lower() == "local":
        return local_host_memory()
    if value is not None:
        return HostCapacity(node_bytes=parse_host_memory(value), source="--host-memory")
    if default == "local":
        return local_host_memory()
    return catalog_host_memory(gpu, gpus_per_node)
