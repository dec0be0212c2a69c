"""Time of a variable-length estimate (``llmem estimate --seq-lens``) on this machine.

What it costs against the one-shape estimate it extends: the lengths it
traces to derive every step's event stream (``llmem_plugin.techniques.varlen``), and the
replay of the run through the simulated allocator until reserved settles.
Each case runs in a fresh process after one warm-up estimate of a tiny model.

    python benchmarks/varlen_speed.py     # writes benchmarks/results/varlen-speed-<date>.json
"""

from __future__ import annotations

import resource
import time

CASES = [
    # The example of docs/techniques/variable-length.md.
    {"model": "llama-3.2-1b", "seq_len": 4096, "batch_size": 4, "lengths": "64:4096:900", "fast": True},
    {"model": "llama-3.2-1b", "seq_len": 2048, "batch_size": 2, "lengths": "128:2048", "fast": True,
     "attn": "eager"},
    {"model": "llama-3.1-8b", "seq_len": 2048, "batch_size": 1, "lengths": "256:2048:700", "fast": True},
]


def _one(case: dict) -> dict:
    t0 = time.perf_counter()
    import llmem_plugin
    from llmem_plugin.techniques.varlen import estimate_variable_length
    from llmem_plugin.workload import Workload

    llmem_plugin.estimate("llama-3.2-1b", seq_len=64, fast=True)  # warm-up: imports, first calls
    cold = time.perf_counter() - t0
    wl = Workload(seq_len=case["seq_len"], micro_batch_size=case["batch_size"],
                  attn_implementation=case.get("attn", "auto"))
    t = time.perf_counter()
    llmem_plugin.estimate(case["model"], wl, fast=case["fast"])  # the one-shape estimate, timed
    fixed_s = time.perf_counter() - t
    t = time.perf_counter()
    est = estimate_variable_length(case["model"], wl, case["lengths"], fast=case["fast"])
    varlen_s = time.perf_counter() - t
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**case, "fixed_shape_s": round(fixed_s, 3), "varlen_s": round(varlen_s, 3), "cold_s": round(cold, 3),
            "max_rss_mb": round(rss_mb, 1), "steps": est.steps, "warmup_steps": est.warmup_steps,
            "lengths_traced": est.derivation.traces, "regimes": len(est.derivation.regimes), "peak_reserved_bytes": est.peak_reserved_bytes,
            "fixed_reserved_bytes": est.fixed_reserved_bytes,
            "reserved_vs_fixed_pct": round(100 * (est.peak_reserved_bytes / est.fixed_reserved_bytes - 1), 3)}


def main() -> None:
    from _common import run_cases, write

    rows = run_cases(__file__, CASES, _one)
    if rows is None:
        return
    write("varlen-speed", {"rows": rows})


if __name__ == "__main__":
    main()
