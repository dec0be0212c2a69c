"""The reserved peak when the cache is emptied after setup (methods/_setup_cache.py)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.device.overheads import device_overheads
from llmem_plugin.methods._setup_cache import reserved_if_emptied
from llmem_plugin.trace.tracker import MemoryTracker, Phase

MiB = 2**20
_OVERHEADS = device_overheads((9, 0), torch_version="2.13.0")


def _trace(setup_frees: bool):
    tracker = MemoryTracker()
    with FakeTensorMode(), tracker:
        tracker.set_phase(Phase.SETUP)
        kept = torch.empty(8 * MiB, dtype=torch.uint8)
        copy = torch.empty(100 * MiB, dtype=torch.uint8)
        if setup_frees:
            del copy  # what a wrapper's setup copies and drops
        tracker.set_phase(Phase.FORWARD)
        step = torch.empty(12 * MiB, dtype=torch.uint8)
        del step, kept
    return tracker.result()


def test_the_setup_s_free_segments_are_released_before_the_step():
    # Emptied, the cached 100 MiB segment goes; the 8 MiB kept holds its 20 MiB segment (kLargeBuffer),
    # whose free 12 MiB takes the step's tensor; the forward's cuBLAS workspace takes its own segment.
    got = reserved_if_emptied(_trace(True), None, AllocatorConfig(), _OVERHEADS, None)
    assert got == 20 * MiB + _OVERHEADS.cublas_workspace_bytes


def test_nothing_to_release_when_the_setup_frees_nothing():
    assert reserved_if_emptied(_trace(False), None, AllocatorConfig(), _OVERHEADS, None) is None


def test_capped_at_what_the_gpu_can_reserve():
    cap = 30 * MiB + _OVERHEADS.outside_allocator_bytes  # under the emptied replay's 52 MiB
    assert reserved_if_emptied(_trace(True), None, AllocatorConfig(), _OVERHEADS, cap) == 30 * MiB
