"""Device memory a training step needs beyond its tensors.

Three kinds, told apart by whether PyTorch's allocator sees them:

* **cuBLAS / cuBLASLt workspaces** go through the caching allocator, so they
  count in ``torch.cuda.memory_allocated`` and ``memory_reserved``. They are
  fed to the allocator simulation as allocations that are never freed
  (:func:`workspace_allocations`).
* **The CUDA context** (driver state, loaded kernel modules) lies outside the
  allocator; it shows only in NVML / nvidia-smi.
* **NCCL buffers** are allocated by NCCL itself (src/allocator.cc, cuMemCreate),
  also outside the allocator; one set per communicator.

Sources are cited beside each rule. Where a figure is measured in a PR rather
than documented, the comment says so.

Known limitations:
    * The CUDA context figure (context and the kernel modules a step loads)
      was measured on one stack (H200, driver 580, CUDA 13.0); other drivers
      and cards differ by tens of MiB. The driver's own reservation (NVML v2
      "reserved", 615 MiB on that H200) is not the process's and is not added.
    * cuBLASLt's per-call workspace of torch 2.6-2.9 (freed after each call,
      1 MiB) is not modelled.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from llmem_plugin.device.versions import torch_minor

__all__ = [
    "DeviceOverheads",
    "cublas_workspace_bytes",
    "device_overheads",
    "nccl_buffer_bytes",
    "workspace_allocations",
]

_MiB = 1024 * 1024

# What a training process holds outside the allocator once a step has run:
# the CUDA context plus the kernel modules lazy loading brings in on first use
# (cuBLAS for the forward's and the backward thread's handles, SDPA, the
# optimizer kernels). Measured by benchmarks/groundtruth/context_probe.py on an
# H200 (driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130, 2026-11-27; data in
# benchmarks/groundtruth/data/h200-context-2026-11-27.json): NVML used minus
# the driver's own reservation (NVML v2 "reserved", 615 MiB, there before the
# process starts) minus memory_reserved, after the last stage. 33 real steps
# there measured 748-764 MiB (h200-2026-11-27.jsonl), below this figure
# because not every step loads every kernel family. PyTorch PR #86509 had
# measured 287,047,680 B with lazy loading on CUDA 11.7, far below what
# today's stack holds.
CUDA_CONTEXT_BYTES = 804_061_184

# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize(): the
# default cuBLAS workspace is ":4096:8" (32 MiB) on the listed architectures
# and ":4096:2:16:8" (8 MiB + 128 KiB) elsewhere. torch 2.6-2.11 list only
# sm90 (major 9, minor 0); 2.12-2.13 list majors 9, 10 and 12.
_CUBLAS_LARGE = 4096 * 8 * 1024
_CUBLAS_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
# CUDABlas.cpp / CublasHandlePool.cpp: the cuBLASLt workspace defaults to
# CUBLASLT_WORKSPACE_SIZE = 1024 KiB. Persistent per (handle, stream) and
# separate from the cuBLAS one in torch 2.10-2.11; shared with it
# ("unified workspaces", on by default) from 2.12.
_CUBLASLT_DEFAULT = 1024 * 1024

# NCCL src/init.cc computeBuffSizes(): per connection and channel the
# receiver holds the Simple buffer (NCCL_BUFFSIZE, default 4 MiB), the LL
# buffer (8 x 512 x 8 x 16 B = 512 KiB) and the LL128 buffer
# (120 x 640 x 8 x 8 B = 4,915,200 B).
_NCCL_PER_CONNECTION = (1 << 22) + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8
# Channels NCCL opens on an 8-GPU NVLink node: 16 in the NCCL log of
# NVIDIA/nccl issue #892 (8x H800). Topology-dependent; pass the real count.
DEFAULT_NCCL_CHANNELS = 16


def cublas_workspace_bytes(
    compute_capability: tuple[int, int], torch_version: str | None = None, *, env: str | None = None
) -> int:
    """Size of one cuBLAS workspace (CublasHandlePool.cpp, parseChosenWorkspaceSize).

    Args:
        compute_capability: The GPU's (major, minor).
        torch_version: e.g. "2.11.0"; the installed torch if None.
        env: A ``CUBLAS_WORKSPACE_CONFIG`` value (``:SIZE_KiB:COUNT`` pairs);
            the environment's if None.
    """
    if env is None:
        env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if env:
        pairs = re.findall(r":([0-9]+):([0-9]+)", env)
        if pairs:  # unmatched text: torch warns and uses the default
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    major, minor = compute_capability
    large = (major, minor) == (9, 0) if torch_minor(torch_version) < (2, 12) else major in (9, 10, 12)
    return _CUBLAS_LARGE if large else _CUBLAS_DEFAULT


def nccl_buffer_bytes(world_size: int, *, num_channels: int = DEFAULT_NCCL_CHANNELS) -> int:
    """Device memory of one NCCL communicator's ring buffers on one rank.

    A ring connects each rank to one receiving peer per channel; the receiver
    holds the three protocol buffers (see ``_NCCL_PER_CONNECTION``). One rank
    alone opens no connections.
    """
    if world_size <= 1:
        return 0
    return num_channels * _NCCL_PER_CONNECTION


@dataclass(frozen=True, kw_only=True)
class DeviceOverheads:
    """Per-GPU memory besides the step's tensors.

    Attributes:
        cuda_context_bytes: CUDA context, outside the allocator.
        cublas_workspace_bytes: One cuBLAS workspace (inside the allocator).
        num_cublas_workspaces: Workspaces a training step creates: one per
            (cuBLAS handle, stream); handles are per thread, and backward runs
            on the autograd engine's device thread (engine.cpp, "a thread per
            CUDA device"), so forward and backward hold one each.
        cublaslt_workspace_bytes: Separate persistent cuBLASLt workspace
            (torch 2.10-2.11, when a Linear with bias runs); 0 otherwise.
        nccl_bytes: NCCL communicator buffers, outside the allocator.
    """

    cuda_context_bytes: int
    cublas_workspace_bytes: int
    num_cublas_workspaces: int
    cublaslt_workspace_bytes: int
    nccl_bytes: int

    @property
    def outside_allocator_bytes(self) -> int:
        """What nvidia-smi shows on top of the allocator's reserved bytes."""
        return self.cuda_context_bytes + self.nccl_bytes

    def to_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def device_overheads(
    compute_capability: tuple[int, int],
    *,
    torch_version: str | None = None,
    uses_cublaslt: bool = False,
    nccl_world_sizes: tuple[int, ...] = (),
) -> DeviceOverheads:
    """The overheads of a training step on one GPU.

    Args:
        compute_capability: The GPU's (major, minor).
        torch_version: Torch the job runs ("2.11.0"); the installed one if None.
        uses_cublaslt: Whether the model runs a Linear with bias (addmm's
            cuBLASLt path, native/cuda/Blas.cpp isInputCompliesAddmmCudaLt).
        nccl_world_sizes: Size of each NCCL communicator this rank joins.
    """
    v = torch_minor(torch_version)
    lt = _CUBLASLT_DEFAULT if uses_cublaslt and (2, 10) <= v < (2, 12) else 0
    return DeviceOverheads(
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
        cublas_workspace_bytes=cublas_workspace_bytes(compute_capability, torch_version),
        num_cublas_workspaces=2,
        cublaslt_workspace_bytes=lt,
        nccl_bytes=sum(nccl_buffer_bytes(n) for n in nccl_world_sizes),
    )


def workspace_allocations(overheads: DeviceOverheads) -> dict[str, list[int]]:
    """The never-freed allocator requests, by the phase whose first matmul makes them.

    Returns:
        ``{"forward": [...], "backward": [...]}`` request sizes in bytes.
    """
    fwd = [overheads.cublas_workspace_bytes]
    if overheads.cublaslt_workspace_bytes:
        fwd.append(overheads.cublaslt_workspace_bytes)
    bwd = [overheads.cublas_workspace_bytes] if overheads.num_cublas_workspaces > 1 else []
    return {"forward": fwd, "backward": bwd}
