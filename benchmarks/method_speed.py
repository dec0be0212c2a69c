"""Speed of the traced distributed methods (fake process group) on this machine.

Each case runs in a fresh process: the first ``estimate_method`` call (what
one CLI invocation pays, imports of the model classes included) and then a
second identical call in the same process, which finds DTensor's sharding
caches warm. Every case is seq 2048, batch 1, bf16 autocast, AdamW
(foreach), H100 SXM target. ``estimate_sha`` hashes the estimate's
``to_dict()``: equal hashes across runs of different code mean equal
estimates.

    python benchmarks/method_speed.py [--out PATH]   # default results/method-speed-<date>.json
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

CASES = [
    {"method": "fsdp", "model": "llama-3.1-70b", "num_gpus": 64, "num_nodes": 8, "tp": 1, "grad_checkpointing": True},
    {"method": "fsdp-tp", "model": "llama-3.1-70b", "num_gpus": 64, "num_nodes": 8, "tp": 8,
     "grad_checkpointing": True},
    {"method": "dp-tp", "model": "llama-3.1-70b", "num_gpus": 64, "num_nodes": 8, "tp": 8,
     "grad_checkpointing": True},
    {"method": "tp", "model": "llama-3.1-70b", "num_gpus": 8, "num_nodes": 1, "tp": 8, "grad_checkpointing": True},
    {"method": "fsdp", "model": "llama-3.1-8b", "num_gpus": 8, "num_nodes": 1, "tp": 1, "grad_checkpointing": False},
]


def _one(case: dict) -> dict:
    import torch  # noqa: F401  (imported before timing, as any caller has it)
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods import Layout, estimate_method
    from llmem_plugin.workload import Workload

    layout = Layout(num_gpus=case["num_gpus"], num_nodes=case["num_nodes"], tp=case["tp"])
    workload = Workload(seq_len=2048, grad_checkpointing=case["grad_checkpointing"])
    times, shas = [], []
    for _ in range(2):
        t = time.perf_counter()
        est = estimate_method(case["method"], case["model"], workload, layout=layout, gpu=get_gpu("h100-sxm"))
        times.append(time.perf_counter() - t)
        shas.append(hashlib.sha256(json.dumps(est.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16])
    assert shas[0] == shas[1], shas
    rank = est.ranks[0]
    return {**case, "first_s": round(times[0], 2), "second_s": round(times[1], 2),
            "peak_tensor_bytes": rank.peak_tensor_bytes, "peak_reserved_bytes": rank.peak_reserved_bytes,
            "estimate_sha": shas[0]}


def main() -> None:
    from _common import run_cases, write

    rows = run_cases(__file__, CASES, _one)
    if rows is not None:
        write("method-speed", {"rows": rows}, sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--out" else None)


if __name__ == "__main__":
    main()
