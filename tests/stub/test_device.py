"""The stub CUDA device itself: what it reports, and what torch's own CUDA code
allocates on it (cuBLAS workspaces, OOM, expandable segments).

Expected values come from the GPU catalog and from llmem_plugin.device.overheads,
whose constants cite torch's CublasHandlePool.cpp; the stub runs that code.
"""
import json

import pytest

from llmem_plugin.device import overheads
from llmem_plugin.device.allocator import replay
from llmem_plugin.device.allocator_config import AllocatorConfig
from llmem_plugin.device.gpus import get_gpu

_PROPS = """
import json, torch
p = torch.cuda.get_device_properties(0)
free, total = torch.cuda.mem_get_info()
print(json.dumps({"name": p.name, "total": p.total_memory, "cc": [p.major, p.minor],
                  "sms": p.multi_processor_count, "free": free, "mem_total": total}))
"""


@pytest.mark.parametrize("gpu", ["h100-sxm", "a100-40gb", "h200"])
def test_device_reports_the_catalog_gpu(stub, gpu):
    got = stub.run_json(["-c", _PROPS + stub.EXIT], gpu=gpu)
    spec = json.loads((stub.ROOT / "llmem_plugin/device/gpus.json").read_text())["gpus"][gpu]
    total = spec["driver_memory_bytes"] or spec["memory_bytes"]
    assert got == {"name": spec["display_name"], "total": total, "cc": spec["compute_capability"],
                   "sms": spec["num_sms"], "free": total, "mem_total": total}


_WORKSPACES = """
import json, torch
a = torch.empty(64, 64, device="cuda", requires_grad=True)
base = torch.cuda.memory_allocated()
with torch.no_grad():
    y = a @ a                                   # main thread's cuBLAS handle
fwd = torch.cuda.memory_allocated() - base - y.untyped_storage().nbytes()
del y
base = torch.cuda.memory_allocated()
(a @ a).sum().backward()                        # backward matmuls: autograd's device thread
bwd = torch.cuda.memory_allocated() - base - a.grad.untyped_storage().nbytes()
print(json.dumps({"forward": fwd, "backward": bwd}))
"""


@pytest.mark.parametrize("gpu", ["h100-sxm", "a100-80gb"])
def test_cublas_workspaces_one_per_thread(stub, gpu):
    """docs/allocator.md: one workspace for the forward thread and one for the
    autograd engine's device thread, of parseChosenWorkspaceSize's size."""
    got = stub.run_json(["-c", _WORKSPACES + stub.EXIT], gpu=gpu)
    ws = overheads.cublas_workspace_bytes(get_gpu(gpu).compute_capability, "2.13.0", env="")
    assert got == {"forward": ws, "backward": ws}


_OOM = """
import json, torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
try:
    y = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    print(json.dumps({"oom": False}))
except torch.OutOfMemoryError:
    print(json.dumps({"oom": True, "reserved": torch.cuda.memory_reserved()}))
"""


def test_capacity_refuses_past_the_cap(stub):
    got = stub.run_json(["-c", _OOM + stub.EXIT], capacity=(2 << 30) + (512 << 20))
    assert got == {"oom": True, "reserved": 1 << 30}


_SIZES_MIB = (3, 30, 300)
_EXPANDABLE = """
import json, torch
xs = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in SIZES]
r = torch.cuda.memory_reserved()
segs = torch.cuda.memory_snapshot()
print(json.dumps({"reserved": r, "segments": len(segs)}))
"""


def test_expandable_segments_map_in_2mib_pages(stub):
    """Expandable segments go through cuMemCreate/cuMemMap and NVML's fabric
    query; large requests share one segment grown in 2 MiB pages."""
    conf = "expandable_segments:True"
    got = stub.run_json(["-c", _EXPANDABLE.replace("SIZES", repr(_SIZES_MIB)) + stub.EXIT], env={"PYTORCH_CUDA_ALLOC_CONF": conf})
    sim = replay([(1, i, n << 20) for i, n in enumerate(_SIZES_MIB)], AllocatorConfig.from_env(conf))
    assert got == {"reserved": sim.peak_reserved_bytes, "segments": 1}


_SUM_PROMOTED = """
import json, torch
out = {}
for name, x, kw in [("bool", torch.zeros(3000, dtype=torch.bool, device="cuda"), {}),
                    ("int32", torch.zeros(5000, dtype=torch.int32, device="cuda"), {}),
                    ("bf16->fp32", torch.zeros(4096, dtype=torch.bfloat16, device="cuda"), {"dtype": torch.float32})]:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    s = x.sum(**kw)
    out[name] = [torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base]
    del s
print(json.dumps(out))
"""


def test_a_sum_into_a_wider_dtype_copies_its_input_as_the_emulation_does(stub):
    """A bool or int32 ``sum`` reduces an int64 copy of its input, made after
    the output and freed when the op returns (ReduceOpsUtils.h); fp16/bf16 into
    fp32 reads the input as it is. The emulation's trace has the same peak."""
    import torch

    from llmem_plugin.trace.emulation import cuda_emulation
    from llmem_plugin.trace.tracker import MemoryTracker

    got = stub.run_json(["-c", _SUM_PROMOTED + stub.EXIT])
    cases = {"bool": (torch.bool, 3000, {}), "int32": (torch.int32, 5000, {}),
             "bf16->fp32": (torch.bfloat16, 4096, {"dtype": torch.float32})}
    for name, (dtype, n, kw) in cases.items():
        tracker = MemoryTracker()
        x = torch.zeros(n, dtype=dtype)
        with tracker, cuda_emulation(autocast_dtype=None, compute_capability=(9, 0), num_sms=132):
            s = x.sum(**kw)
        peak, live = tracker.result().peak_bytes, s.untyped_storage().nbytes()
        assert got[name] == [peak, 512], (name, got[name], peak, live)
