"""Speed of `llmem plan` on this machine, by stage.

Targets: Llama-3.1-70B on 64 GPUs (8 nodes of 8 H100s), over the full space
of methods, TP degrees, micro-batches, checkpointing and offload, in under
15 s on a 2-core CPU (issue "Planner"); Llama-3.1-405B on 512 GPUs (64 nodes),
pipeline x TP x FSDP2 candidates among them, in under 30 s (issue "Pipeline
parallelism").

Each case runs in a fresh process after a warm-up (imports and first calls,
reported as `cold_s`); one timed plan per case, with the planner's own
split: `profile` (single-GPU traces), `screen` (fast-mode traces of every
method, on all cores), `verify` (the full trace of the choice).

    python benchmarks/plan_speed.py [MODEL ...]   # writes benchmarks/results/plan-speed-<date>.json
                                                  # (only the cases of those models when named)
"""

from __future__ import annotations

import resource
import time

CASES = [
    {"model": "llama-3.1-405b", "num_gpus": 512, "num_nodes": 64},
    {"model": "llama-3.1-70b", "num_gpus": 64, "num_nodes": 8},
    {"model": "llama-3.1-8b", "num_gpus": 8, "num_nodes": 1},
    {"model": "llama-3.1-8b", "num_gpus": 1, "num_nodes": 1},
]


def _one(case: dict) -> dict:
    t0 = time.perf_counter()
    import llmem_plugin
    from llmem_plugin.workload import Workload

    llmem_plugin.estimate("llama-3.2-1b", seq_len=64, fast=True)  # warm-up: imports, first calls
    cold = time.perf_counter() - t0
    t = time.perf_counter()
    p = llmem_plugin.plan(case["model"], gpu="h100-sxm", num_gpus=case["num_gpus"], num_nodes=case["num_nodes"],
                          workload=Workload(seq_len=2048))
    wall = time.perf_counter() - t
    c = p.choice
    return {**case, "seq_len": 2048, "global_batch": p.global_batch, "wall_s": round(wall, 3),
            "timings_s": {k: round(v, 3) for k, v in p.timings.items()}, "cold_s": round(cold, 3),
            "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "candidates": len(p.candidates), "skipped": len(p.skipped),
            "pipeline_configurations": sorted({label for label, _ in p.skipped if label.startswith("pp")}
                                              | {c.label() for c in p.candidates if c.pp > 1}),
            "choice": c.label(), "choice_device_total_bytes": c.device_total_bytes,
            "choice_step_time_s": round(c.step_time_s, 4), "why": p.why}


def main() -> None:
    from _common import run_cases, write

    import sys

    named = [a for a in sys.argv[1:] if not a.startswith("-")] if sys.argv[1:2] != ["--case"] else []
    cases = [c for c in CASES if not named or c["model"] in named]
    rows = run_cases(__file__, cases, _one)
    if rows is not None:
        write("plan-speed", {"rows": rows})


if __name__ == "__main__":
    main()
