"""The pipeline methods' fast mode against their full trace, and the time of each.

For each case, estimate every pipeline rank with the full trace (every stage
at its depth, every microbatch) and with ``fast=True`` (each rank's stages at
1 and 2 layers, extrapolated part by part: llmem_plugin.methods.pp), and
record per rank the tensor, allocated and reserved peaks of both and the
wall time of each estimate, with the machine and versions.

    python benchmarks/pp_fast.py [CASE ...] > benchmarks/results/pp-fast-<date>.jsonl
"""

from __future__ import annotations

import json
import os
import platform
import time

CASES = [
    # (model, method, gpus, pipeline degree, microbatches, seq_len, precision[, schedule steps, checkpointing])
    ("llama-3.1-8b", "pp", 4, 4, 8, 2048, "bf16"),
    ("llama-3.1-8b", "pp-gpipe", 4, 4, 8, 2048, "bf16"),
    ("qwen2.5-0.5b", "pp-zbv", 4, 4, 8, 1024, "bf16"),
    # FSDP2 inside the stages (mixed precision), as the planner's candidates run, with and without
    # gradient accumulation (schedule steps per optimizer step: the last field) and checkpointing.
    ("llama-3.1-8b", "pp", 8, 4, 8, 2048, "bf16-mixed", 1, False),
    ("llama-3.1-8b", "pp", 8, 2, 8, 2048, "bf16-mixed", 3, True),
]


def main() -> None:
    import torch
    import transformers

    from llmem_plugin.gpus import get_gpu
    from llmem_plugin.methods import Layout, estimate_method
    from llmem_plugin.workload import Workload

    env = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    gpu = get_gpu("h100-sxm")
    import sys

    named = sys.argv[1:]  # case numbers to run (default: all)
    for i, (model, method, gpus, pp, m, seq, precision, *rest) in enumerate(CASES):
        if named and str(i) not in named:
            continue
        steps, ckpt = rest or (1, False)
        wl = Workload(seq_len=seq, precision=precision, grad_accum_steps=steps, grad_checkpointing=ckpt)
        out = {"model": model, "method": method, "gpus": gpus, "pp": pp, "microbatches": m, "seq_len": seq,
               "precision": precision, "schedule_steps": steps, "grad_checkpointing": ckpt, "env": env}
        for fast in (False, True):
            t = time.perf_counter()
            est = estimate_method(method, model, wl, layout=Layout(num_gpus=gpus), gpu=gpu, pipeline_degree=pp,
                                  microbatches=m, fast=fast)
            key = "fast" if fast else "full"
            out[f"{key}_seconds"] = round(time.perf_counter() - t, 2)
            out[key] = [[r.rank, r.peak_tensor_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes]
                        for r in est.ranks]
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
