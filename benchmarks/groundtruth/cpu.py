"""The CPU runner: a real training step of a tiny model, measured by the project's tracker.

There is no caching allocator on the CPU, so the measurement is the tracker's
(``llmem_plugin.trace.step.trace_step`` on real tensors, as the real half of
tests/trace/test_fake_equals_real.py): ``allocated`` is the trace's peak of
live tensor bytes, rounded as the CUDA allocator rounds; ``reserved`` and
the device total are null. ``trace_step`` always runs
``llmem_plugin.trace.step.NUM_ITERATIONS`` steps, so ``--steps`` does not apply.
"""

from __future__ import annotations

import time

from benchmarks.groundtruth import rows
from benchmarks.groundtruth.matrix import Case

__all__ = ["RUNNER", "run_case"]

RUNNER = "tracker-cpu"


def _per_step_peaks(timeline) -> list[int]:
    """Running peak at the end of each step; a step ends where its optimizer phase does."""
    from llmem_plugin.trace.tracker import Phase

    peaks: list[int] = []
    running = 0
    prev = None
    for _, phase, cur in timeline:
        if prev is Phase.OPTIMIZER and phase is not Phase.OPTIMIZER:
            peaks.append(running)
        running = max(running, cur)
        prev = phase
    if prev is Phase.OPTIMIZER or not peaks:
        peaks.append(running)
    return peaks


def run_case(case: Case) -> dict:
    """Build ``case``'s model on the CPU, run and trace its step, and return the row.

    Never raises for a failing case: the row's status says "error".
    """
    import torch

    from llmem_plugin.models import modelbuild
    from llmem_plugin.trace.step import trace_step

    t0 = time.perf_counter()
    row = rows.new_row(case, device="cpu", runner=RUNNER, env=rows.environment())
    try:
        torch.manual_seed(0)
        model = modelbuild.build_model(case.config(), case.workload, device="cpu")
        vocab = model.get_input_embeddings().num_embeddings
        result = trace_step(model, case.workload, vocab_size=vocab)
        peaks = _per_step_peaks(result.timeline)
        assert peaks[-1] == result.peak_bytes, (peaks, result.peak_bytes)
        row["steps"] = [rows.step_record(i + 1, p, None, None) for i, p in enumerate(peaks)]
        return rows.finish(row, status="ok", error=None, seconds=time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - a failing case is a row, not a crash of the matrix
        return rows.finish(row, status="error", error=rows.error_text(e), seconds=time.perf_counter() - t0)
