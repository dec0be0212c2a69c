"""What a training process holds on the GPU outside PyTorch's allocator, stage by stage.

Run on a GPU machine (no other process on the GPU)::

    python -m benchmarks.groundtruth.context_probe OUT.json

It reads NVML before this process touches CUDA (the driver's own reservation:
``nvmlDeviceGetMemoryInfo`` v1 ``used``, and the v2 struct's ``reserved`` /
``used`` where the driver offers it), then after each stage a training step
goes through: CUDA context creation, the first allocation, a bf16 cuBLAS
matmul, SDPA forward and backward, an fp32 reduction and AdamW's foreach and
fused kernels. At each stage it records NVML used, ``memory_reserved`` and
their difference, which is what lies outside the allocator. The rows feed
:mod:`llmem_plugin.device.overheads`' device figures.
"""

from __future__ import annotations

import json
import sys
import time


def _nvml():
    import pynvml

    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)


def _memory(pynvml, handle) -> dict:
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    out = {"v1_total": int(info.total), "v1_used": int(info.used), "v1_free": int(info.free)}
    try:  # NVML >= 12: nvmlMemory_v2_t with a separate "reserved" (driver and firmware)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        out.update(v2_total=int(v2.total), v2_reserved=int(v2.reserved), v2_used=int(v2.used), v2_free=int(v2.free))
    except Exception as e:  # noqa: BLE001 - older bindings or drivers
        out["v2_error"] = repr(e)
    return out


def main(argv: list[str]) -> int:
    out_path = argv[0]
    pynvml, handle = _nvml()
    rows = [{"stage": "idle (before this process touches CUDA)", **_memory(pynvml, handle), "reserved": 0}]

    import torch

    def stage(name: str) -> None:
        torch.cuda.synchronize()
        rows.append({"stage": name, **_memory(pynvml, handle), "reserved": int(torch.cuda.memory_reserved()),
                     "allocated": int(torch.cuda.memory_allocated())})

    torch.cuda.init()
    stage("torch.cuda.init()")
    x = torch.zeros(1, device="cuda")
    stage("first allocation (context created)")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = a @ a
    stage("bf16 matmul (cuBLAS handle and workspace)")
    b.sum().backward()
    stage("matmul backward")
    q = torch.randn(2, 16, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    o = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    stage("SDPA forward (flash)")
    o.sum().backward()
    stage("SDPA backward")
    logits = torch.randn(4096, 32000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(logits.float(), torch.zeros(4096, dtype=torch.long, device="cuda"))
    loss.backward()
    stage("fp32 cross-entropy forward and backward")
    params = [torch.nn.Parameter(torch.randn(1024, 1024, device="cuda")) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    torch.optim.AdamW(params, foreach=True).step()
    stage("AdamW foreach step")
    torch.optim.AdamW(params, fused=True).step()
    stage("AdamW fused step")
    del x, a, b, q, o, logits, loss, params
    torch.cuda.empty_cache()
    stage("after empty_cache")
    idle = rows[0]["v1_used"]
    for r in rows:
        r["outside_allocator_minus_idle"] = r["v1_used"] - idle - r["reserved"]
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
           "driver": pynvml.nvmlSystemGetDriverVersion(), "date": time.strftime("%Y-%m-%d")}
    with open(out_path, "w") as f:
        json.dump({"env": env, "stages": rows}, f, indent=1)
    for r in rows:
        print(f"{r['stage']:45s} used {r['v1_used'] / 2**20:9.1f} MiB  reserved {r['reserved'] / 2**20:9.1f} MiB  "
              f"outside-allocator minus idle {r['outside_allocator_minus_idle'] / 2**20:8.1f} MiB  "
              f"v2 reserved {r.get('v2_reserved', 0) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
