"""torchao's own ``to_nf4`` on the stub CUDA device (PyTorch's caching allocator) against the
setup phase's replay of it (llmem_plugin.techniques.nf4_setup) through the simulated allocator:
the same allocated and reserved peaks, to the byte, with and without the chunks the trace skips."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llmem_plugin.device.allocator import replay
from llmem_plugin.techniques import nf4_setup
from llmem_plugin.trace.tracker import MemoryTracker

# Llama-2-7B's attention and MLP shapes, then a smaller one that reuses the cache.
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (1024, 4096)]

_SCRIPT = f"""
import importlib, json, torch
nf4 = importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
kept = []
for shape in {SHAPES!r}:
    w = torch.empty(shape, dtype=torch.bfloat16, device="cuda")  # LoRALinear's 16-bit weight
    kept.append(nf4.to_nf4(w, 64, 256))
    del w
print(json.dumps({{"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}}))
"""


def _replayed(every_chunk: bool) -> dict:
    tracker = MemoryTracker()
    kept = []
    with FakeTensorMode(), tracker:
        for shape in SHAPES:
            w = torch.empty(shape, dtype=torch.bfloat16)
            kept.append(nf4_setup.from_tensor(w, every_chunk=every_chunk))
            del w
    res = replay(tracker.result().events)
    return {"allocated": res.peak_allocated_bytes, "reserved": res.peak_reserved_bytes}


@pytest.mark.parametrize("every_chunk", [True, False])
def test_to_nf4_on_the_stub_equals_the_replay(stub, every_chunk):
    got = stub.run_json(["-c", _SCRIPT + stub.EXIT])
    assert _replayed(every_chunk) == got  # 2026-12-06: 327,630,848 allocated, 385,875,968 reserved


def test_torchtune_setup_on_the_stub_equals_the_estimate(stub):
    """torchtune 0.6.1's own QLoRA builder and load_state_dict (torchao 0.18.0) on the stub device
    against the estimate's setup phase for transformers' Llama of the same shapes
    (benchmarks/torchtune_setup_stub.py): the same allocated and reserved peaks; at the end the
    estimate holds transformers' two rotary buffers (512 B blocks) that torchtune's model lacks."""
    import pathlib

    from benchmarks import torchtune_setup_stub

    if not (pathlib.Path(stub.ROOT) / ".frameworks" / "torchtune").is_dir():
        pytest.skip("torchtune is not installed in .frameworks")
    got = torchtune_setup_stub.compare()
    assert got["diff"] == {"allocated": 0, "reserved": 0, "final": -1024}, got
