"""The shortened accumulation window against the trace of every micro-step.

``llmem_plugin.estimate`` traces micro-steps 1-3 and the last of a longer
window and checks that the rest repeat micro-step 3 exactly
(``docs/estimator.md``, "Gradient accumulation"). Each case runs in a fresh
process, once shortened and once with every micro-step traced
(``STEADY_MICRO_STEPS`` raised past the window), and records both wall times
and both allocated and reserved peaks, which must be equal.

    python benchmarks/grad_accum.py      # writes results/grad-accum-<date>.json
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import run_cases, write  # noqa: E402

CASES = [
    {"model": "opt-125m", "seq_len": 128, "grad_accum": 32, "mode": "shortened"},
    {"model": "opt-125m", "seq_len": 128, "grad_accum": 32, "mode": "every micro-step"},
    {"model": "llama-3.2-1b", "seq_len": 128, "grad_accum": 32, "mode": "shortened"},
    {"model": "llama-3.2-1b", "seq_len": 128, "grad_accum": 32, "mode": "every micro-step"},
]


def one(case: dict) -> dict:
    import importlib

    import llmem_plugin

    if case["mode"] != "shortened":
        importlib.import_module("llmem_plugin.estimate").STEADY_MICRO_STEPS = 10**9
    t0 = time.perf_counter()
    est = llmem_plugin.estimate(case["model"], seq_len=case["seq_len"], grad_accum_steps=case["grad_accum"])
    return {**case, "seconds": round(time.perf_counter() - t0, 2), "peak_allocated_bytes": est.peak_allocated_bytes,
            "peak_reserved_bytes": est.peak_reserved_bytes, "note": est.notes[-1] if est.notes else ""}


def main() -> None:
    rows = run_cases(os.path.abspath(__file__), CASES, one)
    if rows is None:
        return
    write("grad-accum", {"what": "single-GPU estimate (H100 SXM, bf16-mixed, AdamW), shortened accumulation window "
                                 "vs every micro-step traced; wall time on this CPU machine",
                         "rows": rows})


if __name__ == "__main__":
    main()
