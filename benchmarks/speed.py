"""Speed of the estimator on this machine: full traces and fast mode.

Targets (issue "Core estimator"): a full trace of Llama-3.1-8B (seq 2048,
batch 1) under 3 s on a 2-core CPU, a 70B model under 10 s, resident memory
under 1.5 GB; fast mode under 1 s at any depth and within 0.1% of the full
trace.

Each case runs in a fresh process (so resident memory is that case's own) after
one warm-up estimate of a tiny model in the same process (import and
first-call costs are reported separately as `cold_s`).

    python benchmarks/speed.py            # writes benchmarks/results/speed-<date>.json
"""

from __future__ import annotations

import resource
import time

CASES = [
    {"model": "llama-3.1-8b", "fast": False},
    {"model": "llama-3.1-8b", "fast": True},
    {"model": "llama-3.1-70b", "fast": False},
    {"model": "llama-3.1-70b", "fast": True},
    {"model": "qwen2.5-72b", "fast": True},
    {"model": "llama-3.1-8b", "fast": False, "grad_checkpointing": True},
    {"model": "llama-3.1-8b", "fast": True, "grad_checkpointing": True},
]


def _one(case: dict) -> dict:
    t0 = time.perf_counter()
    import llmem_plugin

    llmem_plugin.estimate("llama-3.2-1b", seq_len=64, fast=True)  # warm-up: imports, first calls
    cold = time.perf_counter() - t0
    kw = {k: v for k, v in case.items() if k not in ("model", "fast")}
    times = []
    for _ in range(3):
        t = time.perf_counter()
        est = llmem_plugin.estimate(case["model"], seq_len=2048, batch_size=1, fast=case["fast"], **kw)
        times.append(time.perf_counter() - t)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**case, "seq_len": 2048, "batch_size": 1, "precision": est.workload.precision.value,
            "best_s": round(min(times), 3), "times_s": [round(x, 3) for x in times], "cold_s": round(cold, 3),
            "max_rss_mb": round(rss_mb, 1), "peak_tensor_bytes": est.peak_tensor_bytes,
            "peak_allocated_bytes": est.peak_allocated_bytes, "peak_reserved_bytes": est.peak_reserved_bytes,
            "device_total_bytes": est.device_total_bytes, "peak_phase": est.peak_phase.value}


def main() -> None:
    from _common import run_cases, write

    rows = run_cases(__file__, CASES, _one)
    if rows is None:
        return
    full = {(r["model"], r.get("grad_checkpointing", False)): r for r in rows if not r["fast"]}
    for r in rows:
        ref = full.get((r["model"], r.get("grad_checkpointing", False)))
        if r["fast"] and ref:
            for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
                name = key.removeprefix("peak_").removesuffix("_bytes")
                r[f"fast_vs_full_{name}_pct"] = round(100 * (r[key] / ref[key] - 1), 5)
    write("speed", {"rows": rows})


if __name__ == "__main__":
    main()
