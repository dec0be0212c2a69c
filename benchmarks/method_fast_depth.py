"""Which shortened depths the methods' fast mode may extrapolate from.

For each method, trace Llama-3.1-8B on 16 GPUs (2 nodes; TP methods at
tp=8) with 2, 3, 4 and all 32 layers, with and without checkpointing, and
record each run's allocated and reserved peaks, per phase. From these, the
per-layer extrapolation from (2, 3) and from (3, 4) layers can be compared
with the full trace (see docs/planner.md).

    python benchmarks/method_fast_depth.py > benchmarks/results/method-fast-depth-<date>.jsonl
"""

from __future__ import annotations

import json
import sys

METHODS = ["ddp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload", "fsdp", "hsdp", "dp-tp", "fsdp-tp",
           "gemini", "lowlevel-zero1", "lowlevel-zero2", "hybrid"]


def main() -> None:
    from llmem_plugin.models.config import num_layers, resolve_config, set_num_layers
    from llmem_plugin.device.gpus import get_gpu
    from llmem_plugin.methods import Layout, estimate_method
    from llmem_plugin.workload import Workload

    gpu = get_gpu("h100-sxm")
    cfg = resolve_config("llama-3.1-8b")
    depth = num_layers(cfg)
    for name in sys.argv[1:] or METHODS:
        layout = Layout(num_gpus=16, num_nodes=2, tp=8 if name in ("tp", "dp-tp", "fsdp-tp", "hybrid") else 1)
        for gc in (False, True):
            wl = Workload(seq_len=2048, grad_checkpointing=gc)
            rows = {}
            for n in (2, 3, 4, depth):
                w = estimate_method(name, set_num_layers(cfg, n), wl, layout=layout, gpu=gpu).worst
                rows[n] = (w.peak_allocated_bytes, w.peak_reserved_bytes, w.phase_allocated, w.phase_reserved)
            print(json.dumps({"m": name, "gc": gc, "D": depth, "rows": rows}), flush=True)


if __name__ == "__main__":
    main()
