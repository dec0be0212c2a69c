"""Fast mode: trace two shortened models and extrapolate to the full depth.

A decoder stack repeats one layer, or one group of layers (a period: Gemma-3's
five sliding and one global layer, Jamba's eight mamba/attention and
dense/expert layers), possibly after a few distinct leading layers
(DeepSeek-V3's three dense layers before the expert layers) and before a
partial period. :mod:`llmem_plugin.models.layerkinds` reads each layer's kind from
the config and cuts the sequence as ``prefix + m periods + suffix``.

Every quantity the trace reports at a phase's peak (parameters, gradients,
states, saved activations, the live temporaries) then grows by the same
amount per period, while the prefix, the suffix and everything outside the
stack (embeddings, LM head, loss) stay as they are. The position of a phase's
peak inside the stack depends on the layer order (a layer's activations are
held until its backward, its gradients from then on), so both traced copies
keep the model's own order: the whole prefix, ``a`` or ``a + 1`` periods, the
whole suffix. A phase's peak then sits at the same place relative to the
stack's ends in both copies and in the full model, and every category of
every phase's breakdown is affine in the number of periods; evaluated at
``m`` it is the full model's. The copies hold at least three layers of the
body, from where the allocator's reserved bytes grow by a constant per layer
too (see ``layerkinds._units_traced``).

Where the kinds cannot be told apart from the config (a model type without a
rule, a per-layer field no rule reads) the full model is traced instead, and
:attr:`Extrapolation.note` says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmem_plugin.models import modelbuild
from llmem_plugin.models.config import resolve_config
from llmem_plugin.errors import UnsupportedError
from llmem_plugin.models.layerkinds import LayerPlan, layer_kinds, plan_layers, shortened_config
from llmem_plugin.trace.tracker import MemoryCategory, Phase, TraceResult
from llmem_plugin.workload import Workload

__all__ = ["Extrapolation", "extrapolated_trace", "fallback_note", "layer_period"]


def layer_period(config: Any) -> int:
    """Smallest number of layers after which ``layer_types`` repeats (the
    distributed methods' fast mode, :func:`llmem_plugin.methods.extrapolated`)."""
    types = list(getattr(config, "layer_types", None) or [])
    if not types:
        return 1
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return p
    return len(types)


@dataclass(frozen=True)
class Extrapolation:
    """The extrapolated trace plus the two traces it came from.

    Attributes:
        result: Per-phase peaks and breakdowns at the full depth; None when
            fast mode could not tell the layer kinds apart (``note`` says why)
            and the caller is to trace the full model.
        short: Trace with the shorter copy (None when the full model was traced).
        long: Trace with one period more (None likewise).
        scale: Periods between ``short`` and the full depth.
        plan: The layer structure used (None without extrapolation).
        note: One line on why the full model is to be traced ("" otherwise).
    """

    result: TraceResult | None
    short: TraceResult | None = None
    long: TraceResult | None = None
    scale: float = 0.0
    plan: LayerPlan | None = None
    note: str = ""

    def extrapolate(self, f: Callable[[TraceResult], int]) -> int:
        """Any per-trace quantity (e.g. a simulated reserved peak), taken as
        affine in depth like the breakdown."""
        if self.short is None or self.long is None:
            assert self.result is not None, "no trace to read"
            return f(self.result)
        v1, v2 = f(self.short), f(self.long)
        return v1 + round(self.scale * (v2 - v1))


def fallback_note(reason: str) -> str:
    """The one line an estimate carries when fast mode traced in full."""
    return f"fast mode traced the full model: {reason} (layer kinds cannot be told apart)"


def extrapolated_trace(
    source: Any, workload: Workload, *, depth: int, trace: Callable[[Any, Workload], TraceResult],
    trace_full: Callable[[Any, Workload], TraceResult] | None = None, cheaper_only: bool = False,
) -> Extrapolation:
    """Peak of the ``depth``-layer model, from traces of two shortened copies.

    Args:
        source: Model source accepted by :func:`resolve_config`.
        workload: The workload.
        depth: Layers of the real model.
        trace: Traces a built meta model (``estimate._trace``).
        trace_full: Traces the model itself where no shorter copy exists
            (default: ``trace``; the copies may need more, e.g. layer tags).
        cheaper_only: Trace the copies only where together they hold fewer
            layers than the model, and never the model itself (else no trace,
            no note: the caller traces the model, which costs less; e.g.
            Jamba's 8-layer period in 32 layers, whose copies took 116 s
            where the model took 80 s, benchmarks/results/fast-vs-full-2026-11-27.jsonl).

    Returns:
        The :class:`Extrapolation`; its result's timeline and event list are
        empty. Without a repetition shorter than the model, the full model's
        trace; where the layer kinds are unknown, no trace and a ``note``.
    """
    config = resolve_config(source)
    kinds, reason = layer_kinds(config)
    if kinds is None:
        return Extrapolation(None, note=fallback_note(reason))
    if len(kinds) != depth:
        return Extrapolation(None, note=fallback_note(f"the config lists {len(kinds)} layers, the model {depth}"))
    k = workload.checkpoint_every if workload.grad_checkpointing else 1
    # Checkpointing every k-th layer makes the checkpointed layers a kind of
    # their own (modelbuild checkpoints a copy's layers by their position).
    plan = plan_layers([(kind, i % k == k - 1) for i, kind in enumerate(kinds)] if k > 1 else kinds)
    if plan is None:
        if cheaper_only:  # no shorter copy: the caller traces the model
            return Extrapolation(None)
        return Extrapolation((trace_full or trace)(modelbuild.build_model(config, workload), workload))
    for n in (plan.traced, plan.traced + 1):
        if any((j % k == k - 1) != (i % k == k - 1) for j, i in enumerate(plan.indices(n))):
            return Extrapolation(None, note=fallback_note(f"a {len(plan.indices(n))}-layer copy would checkpoint "
                                                          f"other layers than every {k}-th of the model"))
    if cheaper_only and plan.short_layers + plan.long_layers >= depth:
        return Extrapolation(None)
    try:
        c1 = shortened_config(config, plan.indices(plan.traced), kinds)
        c2 = shortened_config(config, plan.indices(plan.traced + 1), kinds)
    except UnsupportedError as e:
        return Extrapolation(None, note=fallback_note(str(e)))
    r1 = trace(modelbuild.build_model(c1, workload), workload)
    r2 = trace(modelbuild.build_model(c2, workload), workload)
    scale = plan.repeats - plan.traced

    phase_breakdowns: dict[Phase, dict[MemoryCategory, int]] = {}
    phase_peaks: dict[Phase, int] = {}
    for phase in r2.phase_breakdowns:
        if phase not in r1.phase_breakdowns:
            continue
        b1, b2 = r1.phase_breakdowns[phase], r2.phase_breakdowns[phase]
        bd = {c: b1.get(c, 0) + scale * (b2.get(c, 0) - b1.get(c, 0)) for c in b2}
        phase_breakdowns[phase] = bd
        phase_peaks[phase] = sum(bd.values())
    peak_phase = max(phase_peaks, key=phase_peaks.__getitem__)
    result = TraceResult(
        peak_bytes=phase_peaks[peak_phase],
        peak_phase=peak_phase,
        peak_module=r2.peak_module,
        breakdown=phase_breakdowns[peak_phase],
        phase_peaks=phase_peaks,
        phase_breakdowns=phase_breakdowns,
        timeline=[],
        num_events=r1.num_events + r2.num_events,
    )
    return Extrapolation(result, r1, r2, scale, plan)
