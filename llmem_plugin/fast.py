"""Fast mode: trace two shortened models and extrapolate to the full depth.

A decoder stack repeats one layer (or one group of layers, e.g. Gemma-2's
alternating sliding/global attention). Every quantity the trace reports at a
phase's peak (parameters, gradients, states, saved activations, the live
temporaries) then grows by the same amount per repeated group, while the
first and last layer and everything outside the stack (embeddings, LM head,
loss) stay as they are. So two traces, with ``n1`` and ``n1 + period`` layers,
both keeping a distinct first and last layer, give every phase's peak and its
breakdown as an affine function of depth, evaluated at the real depth. Shared
FACTS ("Layer extrapolation") records that per-phase totals can break when a
phase's peak moves between layers; extrapolating each category of each
phase's breakdown and checking the result against full traces on the test
matrix guards against that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmem_plugin import modelbuild
from llmem_plugin.tracker import MemoryCategory, Phase, TraceResult
from llmem_plugin.workload import Workload

__all__ = ["Extrapolation", "layer_period", "extrapolated_trace"]


def layer_period(config: Any) -> int:
    """Smallest number of layers after which the layer types repeat."""
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
        result: Per-phase peaks and breakdowns at the full depth.
        short: Trace with ``n1`` layers (None when the full model was traced).
        long: Trace with ``n1 + period`` layers (None likewise).
        scale: Layer groups between ``short`` and the full depth.
    """

    result: TraceResult
    short: TraceResult | None = None
    long: TraceResult | None = None
    scale: float = 0.0

    def extrapolate(self, f: Callable[[TraceResult], int]) -> int:
        """Any per-trace quantity (e.g. a simulated reserved peak), taken as
        affine in depth like the breakdown."""
        if self.short is None or self.long is None:
            return f(self.result)
        v1, v2 = f(self.short), f(self.long)
        return v1 + round(self.scale * (v2 - v1))


def extrapolated_trace(
    source: Any, workload: Workload, *, depth: int, trace: Callable[[Any, Workload], TraceResult]
) -> Extrapolation:
    """Peak of the ``depth``-layer model, from traces of two shortened copies.

    Args:
        source: Model source accepted by :func:`modelbuild.resolve_config`.
        workload: The workload.
        depth: Layers of the real model.
        trace: Traces a built meta model (``estimate._trace``).

    Returns:
        The :class:`Extrapolation`; its result's timeline and event list are empty.
    """
    config = modelbuild.resolve_config(source)
    period = layer_period(config)
    n1 = max(2, period)
    n2 = n1 + period
    if depth <= n2:
        return Extrapolation(trace(modelbuild.build_model(config, workload), workload))
    r1 = trace(modelbuild.build_model(modelbuild.set_num_layers(config, n1), workload), workload)
    r2 = trace(modelbuild.build_model(modelbuild.set_num_layers(config, n2), workload), workload)
    scale = (depth - n1) / period

    phase_breakdowns: dict[Phase, dict[MemoryCategory, int]] = {}
    phase_peaks: dict[Phase, int] = {}
    for phase in r2.phase_breakdowns:
        if phase not in r1.phase_breakdowns:
            continue
        b1, b2 = r1.phase_breakdowns[phase], r2.phase_breakdowns[phase]
        bd = {c: b1.get(c, 0) + round(scale * (b2.get(c, 0) - b1.get(c, 0))) for c in b2}
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
    return Extrapolation(result, r1, r2, scale)
