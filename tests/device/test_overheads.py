"""Device overheads follow their documented rules; workspaces enter the allocator stream."""

from __future__ import annotations

import pytest

from llmem_plugin.estimate import allocator_events, estimate
from llmem_plugin.device.overheads import (
    CUDA_CONTEXT_BYTES,
    cublas_workspace_bytes,
    device_overheads,
    nccl_buffer_bytes,
    workspace_allocations,
)
from llmem_plugin.trace.tracker import Phase

from tests.conftest import tiny_config

MiB = 2**20
# CublasHandlePool.cpp: ":4096:8" on the large-workspace architectures, ":4096:2:16:8" elsewhere.
LARGE, DEFAULT = 4096 * 1024 * 8, 4096 * 1024 * 2 + 16 * 1024 * 8


@pytest.mark.parametrize(
    "cc, version, expected",
    [
        ((9, 0), "2.11.0", LARGE),
        ((8, 0), "2.11.0", DEFAULT),
        ((8, 9), "2.13.0", DEFAULT),
        ((10, 0), "2.11.0", DEFAULT),  # sm100 joined the 32 MiB list in 2.12
        ((10, 0), "2.13.0+cu130", LARGE),
        ((12, 0), "2.12.1", LARGE),
        ((7, 0), "2.6.0", DEFAULT),
    ],
)
def test_cublas_workspace_by_architecture_and_version(cc, version, expected):
    assert cublas_workspace_bytes(cc, version, env="") == expected


def test_cublas_workspace_config_env_overrides():
    assert cublas_workspace_bytes((9, 0), "2.13.0", env=":16:8") == 16 * 1024 * 8
    assert cublas_workspace_bytes((8, 0), "2.13.0", env=":4096:2:16:8") == DEFAULT
    assert cublas_workspace_bytes((8, 0), "2.13.0", env="garbage") == DEFAULT  # torch warns, keeps the default


def test_cublaslt_workspace_only_where_separate():
    for version, expected in (("2.9.0", 0), ("2.10.0", MiB), ("2.11.0", MiB), ("2.12.0", 0), ("2.13.0", 0)):
        ov = device_overheads((9, 0), torch_version=version, uses_cublaslt=True)
        assert ov.cublaslt_workspace_bytes == expected, version
    assert device_overheads((9, 0), torch_version="2.11.0").cublaslt_workspace_bytes == 0


def test_nccl_buffers_per_communicator():
    per_channel = (1 << 22) + 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8  # Simple + LL + LL128
    assert nccl_buffer_bytes(1) == 0
    assert nccl_buffer_bytes(8, num_channels=2) == 2 * per_channel
    ov = device_overheads((9, 0), nccl_world_sizes=(8, 2))
    assert ov.nccl_bytes == 2 * 16 * per_channel
    assert ov.outside_allocator_bytes == CUDA_CONTEXT_BYTES + ov.nccl_bytes


def test_workspaces_are_inserted_after_the_first_cublas_call_of_forward_and_backward():
    ov = device_overheads((9, 0), torch_version="2.11.0", uses_cublaslt=True)
    assert workspace_allocations(ov) == {"forward": [LARGE, MiB], "backward": [LARGE]}
    from llmem_plugin.estimate import _trace
    from llmem_plugin.models.modelbuild import build_model
    from llmem_plugin.workload import Workload

    wl = Workload(seq_len=32, micro_batch_size=1)
    trace = _trace(build_model(tiny_config("llama"), wl), wl)
    events, phases = allocator_events(trace, ov)
    assert len(events) == len(trace.events) + 3 == len(phases)
    injected = [(i, e) for i, e in enumerate(events) if e[1] < 0]
    # The thread's first cuBLAS call (the emulation's mark) makes its workspace,
    # after that call's output; not the first event of the phase (the embedding).
    fwd, bwd = trace.marks["cublas:forward"], trace.marks["cublas:backward"]
    first = {p: phases.index(p.value) for p in (Phase.FORWARD, Phase.BACKWARD)}
    assert first[Phase.FORWARD] < fwd and first[Phase.BACKWARD] < bwd + 2
    assert [i for i, _ in injected] == [fwd, fwd + 1, bwd + 2]
    assert events[fwd - 1][0] == 1 and phases[fwd] == "forward" and phases[bwd + 2] == "backward"
    assert all(e[0] == 1 for _, e in injected)  # never freed


def test_estimate_adds_workspaces_and_context():
    est = estimate(tiny_config("llama"), seq_len=32, gpu="a100-80gb", torch_version="2.11.0")
    # Two 8.125 MiB workspaces (1 MiB < size < 10 MiB): both fit one 20 MiB large-pool
    # segment; the tiny model's tensors are all <= 1 MiB, so the rest is 2 MiB small segments.
    assert est.peak_allocated_bytes >= est.peak_tensor_bytes + 2 * DEFAULT
    small = est.peak_reserved_bytes - 20 * MiB
    assert small % (2 * MiB) == 0 and est.peak_tensor_bytes <= small < est.peak_tensor_bytes + 8 * MiB
    assert est.device_total_bytes == est.peak_reserved_bytes + CUDA_CONTEXT_BYTES


def test_context_figure_is_the_h200_measurement_and_on_the_safe_side_of_real_steps():
    """CUDA_CONTEXT_BYTES against the committed real-GPU data, not itself: the probe's last stage
    (NVML used minus the driver's idle reservation minus memory_reserved), and every measured
    step's device total minus its reserved peak minus the idle reservation is at most the figure."""
    import json
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "benchmarks" / "groundtruth" / "data"
    probe = json.loads((data / "h200-context-2026-11-27.json").read_text())
    assert probe["stages"][-1]["outside_allocator_minus_idle"] == CUDA_CONTEXT_BYTES
    rows = [json.loads(ln) for ln in (data / "h200-2026-11-27.jsonl").read_text().splitlines() if ln.strip()]
    # bitsandbytes' paged optimizers keep their states in CUDA unified memory, also outside the allocator
    # (the estimate's paged_bytes); those rows hold more than the context alone.
    outside = [r["measured"]["device_total_bytes"] - r["measured"]["reserved_bytes"] - r["gpu"]["idle_used_bytes"]
               for r in rows if r["status"] == "ok" and not r["workload"]["optimizer"].startswith("paged")]
    assert len(outside) == 32 and max(outside) <= CUDA_CONTEXT_BYTES
    assert min(outside) >= CUDA_CONTEXT_BYTES - 64 * 2**20  # within 64 MiB: the figure is not padded
    # The H200's driver total in the catalog is what NVML reported there.
    from llmem_plugin.device.gpus import get_gpu

    assert get_gpu("h200").driver_memory_bytes == probe["stages"][0]["v1_total"] == 143771 * 2**20
