"""The tracker on hand-made programs whose allocations follow from the ops' definitions."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin import _pause
from llmem_plugin.tracker import MemoryCategory, MemoryTracker, Phase, round_allocation


@pytest.mark.parametrize("nbytes, expected", [(0, 0), (1, 512), (512, 512), (513, 1024), (4096, 4096)])
def test_round_allocation_follows_cuda_min_block(nbytes, expected):
    # c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize = 512, round_size rounds up to it.
    assert round_allocation(nbytes) == expected


@pytest.mark.parametrize("fake", [False, True])
def test_peak_breakdown_and_frees(fake):
    mode = FakeTensorMode() if fake else None
    with (mode or torch.no_grad()):
        x = torch.ones(1000)  # 4000 B -> 4096
    tracker = MemoryTracker()
    with (mode or torch.no_grad()), tracker:
        tracker.register([x], MemoryCategory.INPUT)
        tracker.set_phase(Phase.FORWARD)
        y = x * 2  # +4096
        z = y + 1  # +4096 -> peak 12288
        del y  # -4096
        w = z.view(10, 100)  # a view allocates nothing
        with _pause.untracked():
            hidden = x * 3
        del hidden
        s = z.sum()  # +512 (4 B rounded)
        del w
    r = tracker.result()
    assert r.peak_bytes == 3 * 4096
    assert r.peak_phase is Phase.FORWARD
    assert r.breakdown[MemoryCategory.INPUT] == 4096 and r.breakdown[MemoryCategory.TEMPORARY] == 8192
    assert [e[2] for e in r.events] == [4096, 4096, 4096, 4096, 512]
    assert [e[0] for e in r.events] == [1, 1, 1, -1, 1]
    assert r.timeline[-1][2] == 4096 + 4096 + 512
    del s, z


def test_host_resident_storages_are_not_counted():
    tracker = MemoryTracker()
    with tracker:
        a = torch.zeros(256)  # 1024 B
        b = torch.zeros(())  # a 0-dim step counter
        tracker.label([b], MemoryCategory.HOST)
    assert tracker.result().peak_bytes == 1024
    del a, b
