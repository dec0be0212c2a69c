"""The pipeline methods' fast mode against their full trace, and the time of each.

For each case, estimate every pipeline rank with the full trace (every stage
at its depth, every microbatch) and with ``fast=True`` (each rank's stages at
1 and 2 layers, extrapolated part by part: llmem_plugin.methods.pp.method), and
record per rank the tensor, allocated and reserved peaks of both and the
wall time of each estimate, with the machine and versions, and for each rank
fast mode extrapolated, its two shortened runs' peaks.

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
    # The planner's first pipeline configuration for Llama-3.1-405B on 512 GPUs (64 nodes): pipeline 16 x TP 4
    # x FSDP2 8, 64 microbatches in each of 8 schedule steps, checkpointing, stepped as torchtitan's trainer
    # steps it; ranks 0, 1, 14 and 15 of the pipeline (their stand-ins, methods/pp_compose.py).
    ("llama-3.1-405b", "pp", 512, 16, 64, 2048, "bf16-mixed", 8, True,
     {"tp": 4, "nodes": 64, "ranks": [0, 32, 448, 480], "return_outputs": False}),
]


def main() -> None:
    import torch
    import transformers

    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods import Layout, estimate_method
    from llmem_plugin.methods.pp import method as pp_method
    from llmem_plugin.workload import Workload

    env = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    gpu = get_gpu("h100-sxm")
    import sys

    named = sys.argv[1:]  # case numbers to run (default: all)
    for i, (model, method, gpus, pp, m, seq, precision, *rest) in enumerate(CASES):
        if named and str(i) not in named:
            continue
        steps, ckpt, extra = (list(rest) + [1, False, {}][len(rest):])
        wl = Workload(seq_len=seq, precision=precision, grad_accum_steps=steps, grad_checkpointing=ckpt)
        out = {"model": model, "method": method, "gpus": gpus, "pp": pp, "microbatches": m, "seq_len": seq,
               "precision": precision, "schedule_steps": steps, "grad_checkpointing": ckpt, **extra, "env": env}
        layout = Layout(num_gpus=gpus, num_nodes=extra.get("nodes", 1), tp=extra.get("tp", 1))
        options = {k: extra[k] for k in ("ranks", "return_outputs") if k in extra}
        shortened = []  # fast mode's two runs per extrapolated rank: (depth, [tensor, allocated, reserved] x 2)

        def spy(one, two, depth, capacity, _inner=pp_method._extrapolated):
            shortened.append([depth] + [[r.peak_tensor_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes]
                                        for r, _ in (one, two)])
            return _inner(one, two, depth, capacity)

        pp_method._extrapolated = spy
        for fast in (False, True):
            t = time.perf_counter()
            est = estimate_method(method, model, wl, layout=layout, gpu=gpu, pipeline_degree=pp, microbatches=m,
                                  fast=fast, **options)
            key = "fast" if fast else "full"
            out[f"{key}_seconds"] = round(time.perf_counter() - t, 2)
            out[key] = [[r.rank, r.peak_tensor_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes]
                        for r in est.ranks]
        pp_method._extrapolated = spy.__defaults__[0]
        out["fast_shortened_runs"] = shortened  # in the order of the fast estimate's extrapolated ranks
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
