"""The full model's allocation event stream, built from a shortened copy's.

Fast mode traces two copies of the model with fewer layers
(:mod:`llmem_plugin.trace.fast`). Tensor and allocated bytes grow by a constant per
layer, but the caching allocator's reserved bytes do not (blocks are split,
cached and reused depending on everything allocated before), so they cannot
be extrapolated. Instead the full model's event stream is built from the
longer copy's and replayed through the allocator simulation like a full trace.

Layers are grouped into *units*: each prefix and suffix layer is a unit of its
own, and each period of the body is one (:class:`LayerPlan`). With the layer
tags of :mod:`llmem_plugin.trace.layertags`:

1. A record of unit ``u`` is keyed by ``u`` and its role in the unit: its
   module path below the layer (with the layer's place in the unit), the
   phase it was made in, its bytes, and how many records of that unit had
   these before it. Records outside the layers keep their own key.
2. Every maximal run of events whose segment is the template unit ``k`` (a
   body unit with body units on both sides) gets ``d`` copies: after the run
   where units ascend (forward, optimizer, setup), before it where they
   descend (backward; the direction comes from the neighbouring runs). In
   copy ``j`` a record of unit ``u`` becomes unit ``j + u - k``. Outside the
   copies, a record referenced from a run of unit ``s`` keeps its distance to
   ``s``: unit ``k + 1``'s free of unit ``k``'s residual becomes the free, by
   unit ``k + 1 + d``, of the last copy's. ``d = -1`` takes the template's
   runs out instead.
3. Guard: the longer copy with its template taken out must be the shorter
   copy event for event (sign, bytes, and which allocation a free releases:
   equal streams replay identically); when the shorter copy has a template
   too, it is grown into the longer one and compared as well. Only then is
   the longer copy grown to the full depth. A model whose layers reference
   more than their neighbours, or whose step makes a layer's records outside
   its runs, fails the guard; fast mode then says why and extrapolates.

Prototype and measurements: ``benchmarks/fast_stream_synthesis.py``,
``benchmarks/results/fast-stream-synthesis-2026-11-25.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmem_plugin.models.layerkinds import LayerPlan
from llmem_plugin.trace.tracker import Phase, RecordTable, TraceResult, round_allocation

__all__ = ["SynthesisError", "full_depth_trace", "synthesize"]


class SynthesisError(Exception):
    """The stream cannot be built from the shortened copies (the message says why)."""


@dataclass(frozen=True)
class _Stream:
    events: list[tuple[int, int, int]]  # (sign, record, bytes)
    seg: list[int | None]  # unit running each event
    phase: list[Phase]
    marks: dict[str, int]
    unit: dict[int, int | None]  # record -> unit
    role: dict[int, tuple]  # record -> role within its unit (with occurrence)
    requested: dict[int, int]  # record -> bytes asked for, before rounding


def _stream(trace: TraceResult, plan: LayerPlan, units: int) -> _Stream:
    """``trace``'s events with layers grouped into units (``units`` body periods)."""
    tags = trace.layer_tags
    if tags is None:
        raise SynthesisError("no decoder layer list was found to tag")
    body_end = plan.prefix + units * plan.period

    def unit_of(layer: int | None) -> tuple[int | None, int]:
        if layer is None:
            return None, 0
        if layer < plan.prefix:
            return layer, 0
        if layer < body_end:
            return plan.prefix + (layer - plan.prefix) // plan.period, (layer - plan.prefix) % plan.period
        return plan.prefix + units + (layer - body_end), 0

    unit: dict[int, int | None] = {}
    role: dict[int, tuple] = {}
    seen: dict[tuple, int] = {}
    for _, r, _ in trace.events:
        if r in unit:
            continue
        u, place = unit_of(tags.record_layer[r])
        module, phase, nbytes = tags.record_role[r]
        sig = (u, f"{place}{module}" if u is not None else module, phase, nbytes)
        unit[r] = u
        role[r] = (*sig[1:], seen.get(sig, 0))
        seen[sig] = seen.get(sig, 0) + 1
    return _Stream(
        events=list(trace.events),
        seg=[unit_of(layer)[0] for layer in tags.event_layer],
        phase=[p for _, p, _ in trace.timeline],
        marks=dict(trace.marks),
        unit=unit,
        role=role,
        requested={r: tags.record_requested[r] if tags.record_requested else role[r][2] for r in unit},
    )


def synthesize(s: _Stream, k: int, d: int, growth: dict[int, int] | None = None
               ) -> tuple[list[tuple[int, int, int]], list[Phase], dict[str, int], list[tuple[int, int]]]:
    """``s`` with ``d`` copies of unit ``k``'s runs added (``d = -1``: its runs taken out).

    ``growth``: requested bytes per unit of records outside the layers that
    grow with depth (a flat buffer over all parameters), by record; they get
    ``d`` units more, rounded as the allocator rounds the request.

    Returns:
        The events (``(sign, key, bytes)``, keys numbered from 0), each
        event's phase, the marks moved to the new positions, and per key the
        record of ``s`` it copies with the units it moved by.
    """
    assert d >= -1, "a unit can be added any number of times, or taken out once"
    ev, seg = s.events, s.seg

    def full_unit(u: int) -> int:
        return u if u <= k else u + d

    def key(r: int, copy_of: int | None, at: int | None) -> tuple:
        u = s.unit[r]
        if u is None:
            return ("g", r)
        if copy_of is not None:
            return (copy_of + u - k, s.role[r])
        if at is None:
            return (full_unit(u), s.role[r])
        return (full_unit(at) + u - at, s.role[r])

    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ev):
        j = i
        while j < len(ev) and seg[j] == seg[i]:
            j += 1
        runs.append((i, j))
        i = j
    out: list[tuple[int, tuple, int]] = []
    out_phase: list[Phase] = []
    pos: dict[int, int] = {}
    origin: dict[tuple, int] = {}  # key -> the record of s it copies

    def emit(a: int, b: int, copy_of: int | None, deferred: list[int] | None, *, keep_global_only: bool = False) -> None:
        for e in range(a, b):
            sign, r, nbytes = ev[e]
            if copy_of is None:
                pos.setdefault(e, len(out))
            is_global = s.unit[r] is None
            if keep_global_only and not is_global:
                continue
            if is_global and copy_of is not None:
                continue  # made and freed once, by the template itself
            if is_global and sign < 0 and deferred is not None:
                deferred.append(e)  # freed after the last copy
                continue
            if is_global and growth and r in growth:
                nbytes = round_allocation(s.requested[r] + d * growth[r])
            out.append((sign, key(r, copy_of, seg[e]), nbytes))
            out_phase.append(s.phase[e])
            origin.setdefault(out[-1][1], r)

    previous: int | None = None  # the last layer unit that ran
    for n, (a, b) in enumerate(runs):
        if seg[a] != k:
            emit(a, b, None, None)
            previous = seg[a] if seg[a] is not None else previous
            continue
        if d < 0:
            emit(a, b, None, None, keep_global_only=True)
            previous = k
            continue
        following = next((seg[x] for x, _ in runs[n + 1:] if seg[x] is not None and seg[x] != k), None)
        descending = previous == k + 1 or (previous != k - 1 and following == k - 1)
        deferred: list[int] = []
        if descending:
            for j in range(k + d, k, -1):
                emit(a, b, j, None)
            emit(a, b, None, deferred)
        else:
            emit(a, b, None, deferred)
            for j in range(k + 1, k + d + 1):
                emit(a, b, j, None)
        for e in deferred:
            sign, r, nbytes = ev[e]
            if growth and r in growth:
                nbytes = round_allocation(s.requested[r] + d * growth[r])
            out.append((sign, key(r, None, None), nbytes))
            out_phase.append(s.phase[e])
            origin.setdefault(out[-1][1], r)
        previous = k
    ids: dict[tuple, int] = {}
    events = [(sign, ids.setdefault(kk, len(ids)), nbytes) for sign, kk, nbytes in out]
    marks = {name: pos.get(p, len(out)) for name, p in s.marks.items()}
    sources = [(origin[kk], 0 if s.unit[origin[kk]] is None else kk[0] - s.unit[origin[kk]]) for kk in ids]
    return events, out_phase, marks, sources


def _canonical(events: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(sign, bytes, position of the allocation a free releases): equal forms replay identically."""
    born: dict[int, int] = {}
    out = []
    for i, (sign, key, nbytes) in enumerate(events):
        if sign > 0:
            born[key] = i
            out.append((1, nbytes, i))
        else:
            out.append((-1, nbytes, born.get(key, -1)))
    return out


def _check(made: tuple, want: _Stream, what: str) -> None:
    events, phases, marks, _ = made
    a, b = _canonical(events), _canonical(want.events)
    if a != b:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        where = want.phase[i].value if i < len(want.phase) else "the end"
        raise SynthesisError(f"{what} differs from the traced copy at event {i} of {len(b)} (in the {where})")
    if phases != want.phase or marks != want.marks:
        raise SynthesisError(f"{what} has the traced copy's events but not its phases or marks")


def _paired(s_short: _Stream, s_long: _Stream) -> list[tuple[int, int]]:
    """The records outside the layers of the two copies, paired in the order
    of their first event (the guard checks the pairing); [] when they differ
    in number (the guard then says where the streams part)."""
    def order(s: _Stream) -> list[int]:
        seen: dict[int, None] = {}
        for _, r, _ in s.events:
            if s.unit[r] is None:
                seen.setdefault(r)
        return list(seen)

    a, b = order(s_short), order(s_long)
    return list(zip(a, b)) if len(a) == len(b) else []


def full_depth_trace(short: TraceResult, long: TraceResult, plan: LayerPlan, result: TraceResult | None,
                     *, growing_buffers: bool = False) -> TraceResult:
    """The full model's trace from the two copies fast mode traced.

    Args:
        short: Trace of the copy with ``plan.traced`` body periods.
        long: Trace of the copy with one period more.
        plan: The layer structure.
        result: The extrapolated trace (peaks and breakdowns; they are affine
            in depth, and exact); its peak is checked against the stream's.
            None: ``long`` with the built stream (and the stream's peak).
        growing_buffers: Records outside the layers may grow by a constant per
            unit (a distributed method's flat buffers over all parameters, whose
            caller has checked that the full model has the same buffers); their
            bytes are then extrapolated. Otherwise such a record fails the guard.

    Returns:
        ``result`` with the full model's events, timeline and marks.

    Raises:
        SynthesisError: A trace without layer tags, or a guard that failed.
    """
    k = plan.prefix + 1  # a body unit with body units on both sides in the longer copy
    s_short, s_long = _stream(short, plan, plan.traced), _stream(long, plan, plan.traced + 1)
    pairs = _paired(s_short, s_long)
    if growing_buffers:  # requested bytes per unit, by each copy's record
        by_long = {y: s_long.requested[y] - s_short.requested[x] for x, y in pairs
                   if s_long.requested[y] != s_short.requested[x]}
        by_short = {x: by_long[y] for x, y in pairs if y in by_long}
    else:  # as the allocator sees them: a request that grows inside its rounding block is the same block
        by_long = by_short = {}
        grown = [y for x, y in pairs if s_long.role[y][2] != s_short.role[x][2]]
        if grown:
            module, phase, nbytes, _ = s_long.role[grown[0]]
            raise SynthesisError(f"a tensor outside the layers ({module or 'the step'}, made in the {phase}, "
                                 f"{nbytes} B) grows with depth")
    _check(synthesize(s_long, k, -1, by_long), s_short, "the longer copy with one period taken out")
    if plan.traced >= 3:
        _check(synthesize(s_short, k, 1, by_short), s_long, "the shorter copy with one period added")
    events, phases, marks, sources = synthesize(s_long, k, plan.repeats - plan.traced - 1, by_long)
    timeline: list[tuple[int, Phase, int]] = []
    cur = peak = 0
    for i, ((sign, _, nbytes), phase) in enumerate(zip(events, phases)):
        cur += sign * nbytes
        peak = max(peak, cur)
        timeline.append((i, phase, cur))
    if result is None:
        result = dataclasses.replace(long, peak_bytes=peak, layer_tags=None)
    elif peak != result.peak_bytes:
        raise SynthesisError(f"the built stream peaks at {peak} B of tensors, the per-layer extrapolation "
                             f"at {result.peak_bytes} B")
    return dataclasses.replace(result, events=events, timeline=timeline, marks=marks, num_events=len(events),
                               records=_moved_records(long, sources, plan.period))


def _moved_records(long: TraceResult, sources: list[tuple[int, int]], period: int) -> RecordTable | None:
    """The records of the built stream: each key's record of ``long``, its module path moved by the units
    (``period`` layers each) its copy moved."""
    table, prefix = long.records, long.layer_tags.prefix
    if table is None:
        return None
    modules = []
    for r, units in sources:
        module = table.module[r]
        if units and prefix and module.startswith(prefix + "."):
            head, _, rest = module[len(prefix) + 1:].partition(".")
            if head.isdigit():
                module = f"{prefix}.{int(head) + units * period}" + (f".{rest}" if rest else "")
        modules.append(module)
    return table.take([r for r, _ in sources], modules)
