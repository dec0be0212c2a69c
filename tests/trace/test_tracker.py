"""The tracker on hand-made programs whose allocations follow from the ops' definitions."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin.trace import _pause
from llmem_plugin.trace.tracker import MemoryCategory, MemoryTracker, Phase, round_allocation


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


def test_backward_under_checkpointing_is_attributed_to_the_running_layer():
    """torch.utils.checkpoint stops a recomputation early once it has the
    tensors it needs, so the recomputed modules' forward hooks never pop them;
    the backward's allocations must still be attributed layer by layer, from
    the last layer down (a stale module stack named a layer already done)."""
    import re

    from llmem_plugin.models import modelbuild
    from llmem_plugin.estimate import _trace
    from llmem_plugin.trace.tracker import Phase
    from llmem_plugin.workload import Workload

    from tests.conftest import tiny_config

    class Recording(MemoryTracker):
        seen: list = []

        def _see(self, storage, category):
            if self.phase is Phase.BACKWARD:
                m = re.search(r"layers\.(\d+)", self.current_module)
                if m:
                    self.seen.append(int(m.group(1)))
            super()._see(storage, category)

    wl = Workload(seq_len=32, grad_checkpointing=True)
    model = modelbuild.build_model(tiny_config("llama", num_hidden_layers=4), wl)
    Recording.seen = []
    _trace(model, wl, tracker=Recording())
    layers = Recording.seen
    assert set(layers) == {0, 1, 2, 3}
    # Each traced step's backward runs layer 3 down to 0; the only step up is
    # from one step's layer 0 to the next step's layer 3.
    ups = [(a, b) for a, b in zip(layers, layers[1:]) if a < b]
    assert ups and all(up == (0, 3) for up in ups), ups
