"""How far the planner's screen is from the full trace, per candidate.

The planner screens every candidate from fast-mode traces (shortened models,
extrapolated per layer) and a single-GPU profile, then traces the fastest
fitting one in full. This script traces a sample of candidates in full
(micro-batch 1 and 2, checkpointing on and off, every method) and records
the screen's device total against the full trace's, so the screen's error,
and its sign, are known.

    python benchmarks/plan_screen.py      # writes benchmarks/results/plan-screen-<date>.json
"""

from __future__ import annotations

import dataclasses
import json
import sys

CASES = [
    {"model": "llama-3.1-8b", "num_gpus": 8, "num_nodes": 1, "global_batch": 16},
]


def main() -> None:
    from llmem_plugin.errors import LLMemError, WontFitError
    from llmem_plugin.planner.candidates import _Config, _registry_call
    from llmem_plugin.planner.search import plan
    from llmem_plugin.workload import Workload

    rows = []
    for case in CASES:
        try:
            p = plan(case["model"], gpu="h100-sxm", num_gpus=case["num_gpus"], num_nodes=case["num_nodes"],
                     workload=Workload(seq_len=2048), global_batch=case["global_batch"], verify=False,
                     prune=False)
        except WontFitError as e:
            p = e.plan
        for c in p.candidates:
            if c.micro_batch > 2:
                continue
            wl = dataclasses.replace(p.workload, micro_batch_size=c.micro_batch,
                                     grad_accum_steps=min(c.grad_accum, 2), grad_checkpointing=c.grad_checkpointing)
            try:
                full = _registry_call(_Config(c.method, c.tp), case["model"], wl, p.layout, p.gpu, None,
                                      fast=False).worst
            except LLMemError as e:
                print("skip", c.label(), e, file=sys.stderr)
                continue
            row = {**case, "candidate": c.label(), "method": c.method, "tp": c.tp, "micro_batch": c.micro_batch,
                   "grad_accum": c.grad_accum, "grad_checkpointing": c.grad_checkpointing,
                   "screen_device_total_bytes": c.device_total_bytes, "full_device_total_bytes": full.device_total_bytes,
                   "screen_allocated_bytes": c.peak_allocated_bytes, "full_allocated_bytes": full.peak_allocated_bytes,
                   "error_pct": round(100 * (c.device_total_bytes / full.device_total_bytes - 1), 2),
                   "allocated_error_pct": round(100 * (c.peak_allocated_bytes / full.peak_allocated_bytes - 1), 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    errs = [r["error_pct"] for r in rows]
    from _common import write

    write("plan-screen", {"summary": {"n": len(errs), "min_error_pct": min(errs), "max_error_pct": max(errs),
                                      "mean_abs_error_pct": round(sum(abs(e) for e in errs) / len(errs), 2),
                                      "under_estimates": sum(e < 0 for e in errs)},
                          "rows": rows})


if __name__ == "__main__":
    main()
