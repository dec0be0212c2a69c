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

import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
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

    from llmem_plugin.gpus import get_gpu
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
    if len(sys.argv) > 1 and sys.argv[1] == "--case":
        print(json.dumps(_one(json.loads(sys.argv[2]))))
        return
    import torch
    import transformers

    rows = []
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True,
                             text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    date = dt.date.today().isoformat()
    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=here).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--", "../llmem_plugin"], capture_output=True, text=True,
                      cwd=here).stdout.strip():
        commit += "-dirty"  # the package differs from the commit
    record = {
        "date": date,
        "commit": commit,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__},
        "rows": rows,
    }
    path = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--out" else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"method-speed-{date}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
