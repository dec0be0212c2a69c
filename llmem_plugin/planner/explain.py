"""Explain: what the search left out and why, and, when nothing fits, the report and the changes that fit.

Every unit the search did not finish is listed in ``Plan.skipped`` with its reason (a trace that failed, a
step-time bound that cannot beat the choice). When nothing fits, :func:`explain` gives the
:class:`~llmem_plugin.errors.WontFitError` that carries the plan: one line with the closest candidate, the
host memory the refused plans need, and the changes a re-plan with each confirmed to fit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from llmem_plugin.errors import LLMemError, WontFitError
from llmem_plugin.planner.candidates import (
    _GIB,
    _TRAITS,
    Candidate,
    Plan,
    Suggestion,
    _Run,
    _unit_label,
    planner_methods,
)
from llmem_plugin.planner.bounds import FIXED_WHAT
from llmem_plugin.planner.rank import _best_time
from llmem_plugin.workload import LoraSpec, OptimizerKind, Quantization

__all__ = ["explain", "explain_skipped"]

# Largest node the planner assumes when suggesting more GPUs (DGX/HGX: 8).
_MAX_GPUS_PER_NODE = 8


def explain_skipped(run: _Run, choice: Candidate | None, gcs: list[bool]) -> None:
    """Add to ``run.skipped`` what the search did not finish: each unit or candidate whose trace failed, with
    the error's first line, then each unit the bound left untraced, with the step time it could not beat."""
    run.skipped += list(run.failed.items())
    if run.pending:
        floor = choice.step_time_s if choice is not None else _best_time(run.candidates, run.rejected)
        for cfg, g in run.pending:
            run.skipped.append((_unit_label(cfg, g, gcs),
                                f"cannot beat {floor:.3g} s per step (at least {run.bound[(cfg, g)]:.3g} s under "
                                "the model)"))


def explain(result: Plan, *, model: Any, same: dict[str, Any] | None, cache: dict,
            replan: Callable[..., Plan], t0: float, t_end: float) -> WontFitError:
    """The error for a plan without a choice: it carries ``result`` with the changes that make the job fit.

    Args:
        result: The plan, without a choice.
        model: What was planned for.
        same: The plan's arguments, for re-planning with one change (None: no changes are searched).
        cache: The single-GPU profiles, shared with the re-plans.
        replan: :func:`~llmem_plugin.planner.search.plan`.
        t0: When the plan started; t_end: when its search ended (``time.perf_counter()``).

    Returns:
        The :class:`WontFitError` to raise; its plan's ``timings`` add "suggest".
    """
    suggestions: list[Suggestion] = []
    search_note = None
    if same is not None:
        try:
            suggestions = _suggestions(model, result, same, cache, replan)
        except Exception as e:  # noqa: BLE001 - the verdict stands without them (an adapter must still stop)
            first = (str(e).strip().splitlines() or [""])[0][:200]
            search_note = f"the search for changes that fit failed ({type(e).__name__}: {first})"
            from llmem_plugin.trace.cache import answer_not_kept

            answer_not_kept()  # a repeated command searches again
    result = dataclasses.replace(result, suggestions=suggestions, seconds=time.perf_counter() - t0,
                                 timings={**result.timings, "suggest": time.perf_counter() - t_end})
    return WontFitError(_wont_fit_line(result, search_note) + _host_refusal(result), plan=result)


def _host_refusal(p: Plan) -> str:
    """The host-memory part of a won't-fit message: the smallest host need
    among the plans refused for it, the node's RAM, and the fixes."""
    if p.host_memory is None or not p.host_refused_bytes:
        return ""
    return (f"; host memory: the plans refused for it need at least {p.host_refused_bytes / _GIB:.1f} GiB of host RAM "
            f"per node, more than the {p.host_limit_bytes / _GIB:.1f} GiB limit ({p.host_memory.node_bytes / _GIB:.0f}"
            f" GiB per node: {p.host_memory.source}). HINT: give the node's RAM with --host-memory (e.g. "
            f"--host-memory 2TiB), spread the job over more nodes (--nodes), or use a method without offload")


def _wont_fit_line(p: Plan, search_note: str | None = None) -> str:
    head = (f"no method fits {p.model} on {p.layout.num_gpus} x {p.gpu.name} at seq {p.workload.seq_len} "
            f"within {p.limit_bytes / _GIB:.1f} GiB per GPU")
    close = p.closest(1)
    if close:
        c = close[0]
        head += (f"; closest: {c.label()} needs {c.device_total_bytes / _GIB:.1f} GiB "
                 f"(+{100 * (c.device_total_bytes / p.limit_bytes - 1):.0f}%)")
    unverified = sum(1 for c in p.candidates if c.fits and not c.verified)
    if unverified:
        traced = sum(1 for c in p.candidates if c.verified)
        head += (f"; {traced} candidates the screen put under the limit were traced and did not fit, "
                 f"{unverified} more were not traced (raise max_verify to try them)")
    if p.fixed_bytes > p.limit_bytes:
        head += (f"; {FIXED_WHAT} alone take {p.fixed_bytes / _GIB:.2f} GiB per GPU, so no change of the job on "
                 f"{p.layout.num_gpus} GPU{'s' if p.layout.num_gpus > 1 else ''} can fit: keep a smaller margin or "
                 "plan for a GPU with more memory")
    if p.suggestions:
        head += "; to fit: " + "; ".join(s.change for s in p.suggestions)
    if search_note:
        head += f"; {search_note}"
    return head


def _suggestions(model: Any, failed: Plan, kw: dict[str, Any], cache: dict, replan: Callable[..., Plan]
                 ) -> list[Suggestion]:
    """Changes that make the job fit, each confirmed by re-planning with it: ``replan``
    (:func:`~llmem_plugin.planner.search.plan`) with ``kw``, the change and no search for changes of its own."""
    out: list[Suggestion] = []
    wl, layout = failed.workload, failed.layout

    def attempt(change: str, **over: Any) -> bool:
        args = {**kw, **over}
        try:
            p = replan(model, num_gpus=args.pop("num_gpus", layout.num_gpus),
                     num_nodes=args.pop("num_nodes", layout.num_nodes), workload=args.pop("workload", wl),
                     suggest=False, _profiles=cache, **args)
        except WontFitError:
            return False
        except LLMemError:  # the change does not apply here (LoRA targets the model lacks, a method it refuses)
            return False
        except ImportError:  # a suggestion never needs an optional library: left out when it would
            return False
        out.append(Suggestion(change=change, choice=p.choice))
        return True

    # More GPUs, keeping the per-GPU batch: the smallest power-of-two multiple that fits.
    per_gpu = failed.global_batch / layout.num_gpus
    for factor in (2, 4, 8, 16, 32, 64):
        n = layout.num_gpus * factor
        if n > 4096:
            break
        per_node = min(max(layout.gpus_per_node, 1) * factor, _MAX_GPUS_PER_NODE) if layout.num_nodes == 1 \
            else layout.gpus_per_node
        nodes = max(n // per_node, 1)
        gb = max(int(per_gpu * n), n)
        if attempt(f"{n} GPUs ({nodes} node{'s' if nodes > 1 else ''})", num_gpus=n, num_nodes=nodes,
                   global_batch=gb):
            break
    if kw.get("methods"):
        offload = [m for m in planner_methods() if _TRAITS[m].offload]
        if not set(offload) & set(kw["methods"]):
            attempt("CPU offload (" + ", ".join(offload) + ")", methods=offload)
    if wl.lora is None:
        attempt("LoRA (rank 16 on q/k/v/o)", workload=dataclasses.replace(wl, lora=LoraSpec(rank=16)))
        if wl.optimizer in (OptimizerKind.ADAMW, OptimizerKind.ADAMW_FUSED, OptimizerKind.ADAMW_FORLOOP):
            attempt("8-bit AdamW (--optimizer adamw8bit)",
                    workload=dataclasses.replace(wl, optimizer=OptimizerKind.ADAMW_8BIT))
    elif wl.quantize is None:
        attempt("QLoRA (--quantize nf4 --double-quant)",
                workload=dataclasses.replace(wl, quantize=Quantization.NF4, double_quant=True))
    seq = wl.seq_len // 2
    while seq >= 128:
        if attempt(f"--seq-len {seq}", workload=dataclasses.replace(wl, seq_len=seq)):
            break
        seq //= 2
    if kw.get("micro_batch") not in (None, 1):
        attempt("--micro-batch 1", micro_batch=1)
    return out
