"""bitsandbytes' QLoRA built as the ground-truth harness builds it, on the stub CUDA device
(PyTorch's caching allocator, bitsandbytes 0.50.2's own CUDA library), against the estimate's
setup phase for ``--load device-quantize`` (llmem_plugin.trace.loading) replayed through the
simulated allocator.

The harness (benchmarks/groundtruth/techniques.py ``_build_quantized``) materialises the whole
model on the device in bf16, quantizes each linear layer there, casts the rest to fp32 (peft's
k-bit preparation), adds LoRA and empties the cache. The 4-bit weights are carved out of the
freed bf16 weights' blocks, so after ``empty_cache`` the segments that still hold them keep
holes: what the device keeps reserved is more than the weights. At Llama-3.1-8B's widths that is
what put the H200 row ``llama-3.1-8b-bf16-mixed-s2048-b1-gc-lora-sdpa-nf4-dq`` 290 MiB under
before this flow was modelled (docs/accuracy.md).
"""

from __future__ import annotations

import dataclasses

import pytest

# Llama-3.1-8B's widths (4096 hidden, 14336 intermediate, 8 KV heads, 128256 vocabulary) with
# two decoder layers: 112 MiB bf16 MLP weights, 28 MiB packed ones, 2004 MiB fp32 embeddings.
CASE = "llama-3.1-8b-bf16-mixed-s2048-b1-gc-lora-sdpa-nf4-dq"
LAYERS = 2
_SMALL_BUFFER = 2 << 20  # kSmallBuffer, c10/cuda/CUDACachingAllocator.cpp

_SCRIPT = f"""
import dataclasses, json, torch
from benchmarks.groundtruth import techniques
from benchmarks.groundtruth.run import select_cases
(case,) = select_cases("stub", [{CASE!r}])
case = dataclasses.replace(case, config_overrides=case.config_overrides + (("num_hidden_layers", {LAYERS}),))
model = techniques.build_model(case, device="cuda")
torch.cuda.empty_cache()  # as the harness does again before step 1 (_Recorder.reset)
st = torch.cuda.memory_stats()
print(json.dumps({{pool: {{"allocated": st[f"allocated_bytes.{{pool}}_pool.current"],
                          "reserved": st[f"reserved_bytes.{{pool}}_pool.current"]}} for pool in ("large", "small")}}))
"""


def _estimated() -> dict:
    from benchmarks.groundtruth.run import select_cases
    from llmem_plugin.device.allocator import CachingAllocator
    from llmem_plugin.models import modelbuild
    from llmem_plugin.trace import loading

    (case,) = select_cases("stub", [CASE])
    case = dataclasses.replace(case, config_overrides=case.config_overrides + (("num_hidden_layers", LAYERS),))
    workload = dataclasses.replace(case.workload, load="device-quantize")
    model = modelbuild.build_model(case.config(), workload, device="meta")
    trace = loading.load_trace(model, workload)
    alloc = CachingAllocator(None)
    handles = {}
    for sign, key, nbytes in trace.events:
        if sign > 0:
            if nbytes > 0:
                handles[key] = alloc.malloc(nbytes)
        elif key in handles:
            alloc.free(handles.pop(key))
    alloc.empty_cache()
    out = {pool: {"allocated": 0, "reserved": 0} for pool in ("large", "small")}
    for seg in alloc.segments():  # small-pool segments are kSmallBuffer (2 MiB); no large one is
        pool = out["small" if sum(size for size, _ in seg) == _SMALL_BUFFER else "large"]
        pool["reserved"] += sum(size for size, _ in seg)
        pool["allocated"] += sum(size for size, live in seg if live)
    return out


def test_the_harness_qlora_build_on_the_stub_equals_the_device_quantize_setup(stub):
    pytest.importorskip("bitsandbytes")
    got = stub.run_json(["-c", _SCRIPT + stub.EXIT])
    est = _estimated()
    # What empty_cache cannot release: segments holding 4-bit weights between freed bf16 ranges.
    assert got["large"]["reserved"] - got["large"]["allocated"] > 64 * 2**20, got
    assert est["large"] == got["large"]
    # The small pool is not exact: bitsandbytes' per-call NF4 code tensors (get_4bit_type) and
    # peft's adapters made in bf16 before their fp32 cast are not traced; one 2 MiB segment at
    # two layers (docs/accuracy.md).
    assert 0 <= got["small"]["reserved"] - est["small"]["reserved"] <= _SMALL_BUFFER, (got, est)
