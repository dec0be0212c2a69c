"""The pipeline methods' microbatch composition against tracing every microbatch, and the time of each.

For each case, estimate every pipeline rank with ``compose=False`` (every microbatch traced), with the
composition from real stand-in runs (each rank replayed from a small pipeline's runs at two small microbatch
counts: llmem_plugin.methods.pp.compose; ``placeholders=False``) and with the default composition from
synthesised stand-in runs (placeholder stages through the stand-in's schedule, one small real run per kind of
rank: llmem_plugin.methods.pp.synth), all in fast mode (stages at 1 and 2 layers, extrapolated), and record per
rank the tensor, allocated and reserved peaks of both and the wall time of each, with the machine and
versions. A case with ``full: false`` times the composition alone (tracing every microbatch there takes
too long to repeat).

    python benchmarks/pp_compose.py > benchmarks/results/pp-compose-<date>.jsonl
"""

from __future__ import annotations

import json
import os
import platform
import time

CASES = [
    # (model, gpus, nodes, pipeline degree, microbatches, seq_len, precision, checkpointing, full)
    ("llama-3.1-8b", 4, 1, 4, 32, 2048, "bf16", False, True),
    ("llama-3.1-405b", 512, 64, 16, 64, 2048, "bf16-mixed", True, False),
]


def main() -> None:
    import torch
    import transformers

    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods import Layout, estimate_method
    from llmem_plugin.workload import Workload

    env = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    gpu = get_gpu("h100-sxm")
    for model, gpus, nodes, pp, m, seq, precision, ckpt, full in CASES:
        wl = Workload(seq_len=seq, precision=precision, grad_checkpointing=ckpt)
        out = {"model": model, "method": "pp", "gpus": gpus, "nodes": nodes, "pp": pp, "microbatches": m,
               "seq_len": seq, "precision": precision, "grad_checkpointing": ckpt, "fast": True, **env}
        runs = {}
        modes = {"synthesised": (True, True), "composed": (True, False)}
        if full:
            modes["every_microbatch"] = (False, False)
        for name, (compose, placeholders) in modes.items():
            t = time.perf_counter()
            est = estimate_method("pp", model, wl, layout=Layout(num_gpus=gpus, num_nodes=nodes), gpu=gpu,
                                  pipeline_degree=pp, microbatches=m, fast=True, compose=compose,
                                  placeholders=placeholders)
            runs[name] = (est, time.perf_counter() - t)
        for name, (est, seconds) in runs.items():
            out[f"{name}_seconds"] = round(seconds, 2)
            out[f"{name}_ranks"] = [{"rank": r.rank, "tensor": r.peak_tensor_bytes,
                                     "allocated": r.peak_allocated_bytes, "reserved": r.peak_reserved_bytes}
                                    for r in est.ranks]
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
