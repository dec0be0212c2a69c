"""Rank: the candidates fastest first under the step-time model, the runner-up, and why the choice wins.

Every candidate carries its step time from :mod:`llmem_plugin.planner.cost` (the screen computes it). The
order is by tokens per second over the cluster; on a tie (the compute term dominates and the rest is hidden),
the one that communicates less, then the one with more headroom. The runner-up is the fastest other fitting
candidate of a different method, tensor-parallel or pipeline degree.
"""

from __future__ import annotations

from llmem_plugin.planner.candidates import Candidate, _Run

__all__ = ["order", "rank"]


def order(candidates: list[Candidate]) -> None:
    """Sort ``candidates`` in place, fastest first (ties: less communication, then more headroom)."""
    # Fastest first; on a tie (the compute term dominates and the rest is
    # hidden), the one that communicates less, then the one with more headroom.
    candidates.sort(key=lambda c: (-round(c.tokens_per_s, 6), c.time.comm_s, c.device_total_bytes))


def rank(run: _Run, choice: Candidate | None) -> tuple[Candidate | None, str]:
    """The runner-up of ``choice`` among the ordered ``run.candidates`` and the line on why the choice beats
    it (with how many units the bound left untraced, if any).

    Returns:
        (runner-up or None, why); ("" for why when there is no choice).
    """
    runner = None
    if choice is not None:
        runner = next((c for c in run.candidates if c.fits and c is not choice
                       and (c.method, c.tp, c.pp) != (choice.method, choice.tp, choice.pp)), None)
    why = _why(choice, runner) if choice is not None else ""
    if choice is not None and run.pending:
        why += (f"; {len(run.pending)} other (method, checkpointing) pairs were not traced: under the model none "
                f"can beat it (their lower bounds start at {min(run.bound[u] for u in run.pending):.3g} s per step)")
    return runner, why


def _best_time(candidates: list[Candidate], rejected: set[int]) -> float:
    """The step time of the fastest fitting candidate not verified to miss (inf: none)."""
    return min((c.step_time_s for c in candidates if c.fits and id(c) not in rejected), default=float("inf"))


def _why(choice: Candidate, runner: Candidate | None) -> str:
    if runner is None:
        return f"{choice.label()} is the only method that fits"
    a, b = choice.time, runner.time
    if b.total_s - a.total_s <= 1e-3 * a.total_s:
        return (f"{choice.label()} ties with {runner.label()} at {a.total_s:.3g} s per step (communication hidden "
                f"behind compute); it sends less ({a.comm_s:.3g} s vs {b.comm_s:.3g} s of link time)")
    parts = {"compute": (a.compute_s, b.compute_s), "exposed communication": (a.exposed_comm_s, b.exposed_comm_s),
             "optimizer step": (a.optimizer_s, b.optimizer_s), "offload": (a.offload_s, b.offload_s),
             "pipeline bubble": (a.bubble_s, b.bubble_s)}
    name, (x, y) = max(parts.items(), key=lambda kv: kv[1][1] - kv[1][0])
    return (f"{choice.label()} beats {runner.label()}: {a.total_s:.3g} s vs {b.total_s:.3g} s per step, "
            f"mostly {name} ({x:.3g} s vs {y:.3g} s)")
