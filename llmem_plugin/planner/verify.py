"""Verify: trace the fastest fitting candidate in full, and walk the ranking until one fits.

The screen's numbers come from shortened runs; the choice is always a traced one. The fastest candidate under
the limit is traced by its method at exactly its micro-batch, checkpointing and accumulation (the estimate
``llmem estimate --method`` gives). If it does not fit, it is dropped, the units its time had pruned are
screened if they now could win, and the next is tried, up to ``max_verify`` of them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from llmem_plugin.errors import LLMemError
from llmem_plugin.planner.candidates import Candidate, _Config, _Context, _Options, _registry_call, _Run, _segments
from llmem_plugin.planner.rank import order

__all__ = ["verify_choice"]


def verify_choice(ctx: _Context, opts: _Options, run: _Run, *, rescreen: Callable[[], None]) -> Candidate | None:
    """The choice: the first candidate of the ordered ``run.candidates`` that fits once traced in full.

    Each one traced replaces its screened row (``run.candidates``); one found not to fit goes to
    ``run.rejected``, then ``rescreen`` screens what the rejected time had pruned, and the candidates are
    ordered again. Without ``opts.verify`` (or for a pipeline screened at full depth) the first fitting
    screened candidate is the choice.

    Returns:
        The choice, or None when no candidate fits (or ``opts.max_verify`` were traced and none did).
    """
    choice = None
    tried = 0
    while True:
        nxt = next((i for i, c in enumerate(run.candidates) if c.fits and id(c) not in run.rejected), None)
        if nxt is None:
            break
        c = run.candidates[nxt]
        if not opts.verify or c.verified:  # a pipeline screened at full depth is verified by its screen
            choice = c
            break
        if tried >= opts.max_verify:
            break
        tried += 1
        v = _traced(ctx, opts, run, c)
        if isinstance(v, LLMemError):
            run.failed.setdefault(c.label(), str(v).split(". HINT")[0])
            v = dataclasses.replace(c, fits=False, verified=True)
        run.candidates[nxt] = v
        if v.fits:
            choice = v
            break
        run.rejected.add(id(v))
        rescreen()  # units pruned against the rejected one may now be needed
        order(run.candidates)
    return choice


def _traced(ctx: _Context, opts: _Options, run: _Run, c: Candidate) -> Candidate | LLMemError:
    """``c`` traced in full, or the error of its trace: the one made beside a pipeline's screen if there was
    one, else traced now; the seconds go to ``run``."""
    if c.key in run.done_beside:  # verified beside a pipeline's screen
        v, seconds = run.done_beside.pop(c.key)
        run.beside_s += seconds
        return v
    opts.say(f"verifying {c.label()} at full depth")
    v, seconds = _timed_verify(ctx, c)
    run.verify_s += seconds
    return v


def _timed_verify(ctx: _Context, c: Candidate) -> tuple[Candidate | LLMemError, float]:
    """:func:`_verify` of ``c``, its error as a value, and the seconds it took."""
    t = time.perf_counter()
    try:
        v = _verify(ctx, c)
    except LLMemError as e:
        v = e
    return v, time.perf_counter() - t


def _verify(ctx: _Context, c: Candidate) -> Candidate:
    """The candidate's memory from the method's full trace at exactly its
    configuration. The single-GPU step takes the whole accumulation window:
    its trace stops once a micro-step leaves the simulated allocator as it
    found it (``estimate._steady_trace``). The distributed methods trace
    every micro-step they are given and get at most 2: from the second on,
    every micro-step repeats the same allocations on the same live state
    (not checked against the allocator for them). Where a method's rules
    carry no state further than a layer (``synthesis_blocker``), its ranks'
    full event streams are built from two shortened runs and replayed: the
    full trace's figures, without tracing every layer (methods.synthesized)."""
    # A pipeline's microbatches are its schedule: all of them, in all its schedule steps (composed from
    # shorter runs, pp_compose).
    accum = c.grad_accum if c.method == "single" else min(c.grad_accum, 2)
    wl = dataclasses.replace(ctx.workload, micro_batch_size=c.micro_batch, grad_accum_steps=accum,
                             grad_checkpointing=c.grad_checkpointing)
    est = _registry_call(_Config(c.method, c.tp, c.pp), ctx.model, wl, ctx.layout, ctx.gpu, ctx.alloc_conf,
                         fast=False, split=(c.grad_accum, c.schedule_steps) if c.pp > 1 else None,
                         stream_synthesis=True)
    w = est.worst
    act_delta = 0.0
    host = est.host_total_bytes_per_node
    host_fits = not ctx.host_limit or host <= ctx.host_limit
    return dataclasses.replace(
        c, device_total_bytes=w.device_total_bytes, peak_allocated_bytes=w.peak_allocated_bytes,
        peak_reserved_bytes=w.peak_reserved_bytes, fits=w.device_total_bytes <= ctx.limit and w.fits and host_fits,
        verified=True, segments=_segments(est, w.peak_allocated_bytes, w.peak_reserved_bytes, act_delta),
        host_bytes_per_node=host, host_limit_bytes=ctx.host_limit, host_fits=host_fits,
    )
