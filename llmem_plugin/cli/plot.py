"""Pictures of an estimate: the memory over the traced step, and a plan's options.

Rendering only: both functions take finished results and write one image.
matplotlib is the optional ``plot`` extra, imported on first use. Figures are
built with ``matplotlib.figure.Figure`` on an Agg canvas, never through
``pyplot``, so no global backend is chosen and no figure outlives the call;
the same input gives the same bytes (SVG ids are salted with a constant and
the SVG/PDF creation dates are left out).

Known limitations:
    * The step timeline is the one the Estimate carries: a few hundred points
      of the allocator replay (each window's lowest and highest allocated
      point, the phase boundaries and both peaks), not every event.
    * The contributors at the peak are those of the tensor peak
      (``Estimate.breakdown``); the allocated peak it is drawn at usually
      falls on the same event, but block rounding and the cuBLAS workspaces
      can move it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmem_plugin.errors import ConfigError
from llmem_plugin.estimate import Estimate
from llmem_plugin.trace.tracker import MemoryCategory

__all__ = ["PLAN_SEGMENTS", "plot_estimate", "plot_plan"]

# The parts a plan row's bar is stacked from, bottom (left) first.
PLAN_SEGMENTS = (
    "parameters",
    "gradients",
    "optimizer_states",
    "activations",
    "temporaries",
    "allocator_slack",
    "context_nccl",
)
# Legend names of the segments.
_SEGMENT_NAMES = {"optimizer_states": "optimizer states", "allocator_slack": "allocator slack",
                  "context_nccl": "CUDA context + NCCL"}
_GiB = 1 << 30
_MiB = 1 << 20
_DPI = 120
_FORMATS = ("png", "svg", "pdf")
# Inches; the estimate figure has a fixed size, a plan's grows with its rows.
_ESTIMATE_SIZE_IN = (11.0, 5.5)
_PLAN_WIDTH_IN = 11.0
_PLAN_ROW_IN = 0.32
_PLAN_MIN_HEIGHT_IN = 3.5
# Colours (matplotlib's tab10/tab20 values, fixed here so images do not depend on rcParams).
_PHASE_COLORS = {"forward": "#aec7e8", "backward": "#ffbb78", "optimizer": "#98df8a"}
_SEGMENT_COLORS = dict(
    zip(PLAN_SEGMENTS, ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#7f7f7f"), strict=True)
)
_ALLOCATED_COLOR, _RESERVED_COLOR, _CAPACITY_COLOR = "#1f77b4", "#ff7f0e", "#d62728"
_RC = {"font.size": 9, "svg.hashsalt": "llmem_plugin", "svg.fonttype": "path"}


def _mpl() -> tuple[Any, Any, Any]:
    """matplotlib's Figure, Agg canvas and rc_context, or a ConfigError saying what to install."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plotting needs matplotlib. HINT: pip install 'llmem_plugin[plot]'") from None
    return Figure, FigureCanvasAgg, matplotlib.rc_context


def _format_of(path: str | os.PathLike[str]) -> str:
    fmt = Path(path).suffix.lstrip(".").lower()
    if fmt not in _FORMATS:
        raise ConfigError(
            f"cannot tell the image format of {str(path)!r}: the suffix must be one of {', '.join(_FORMATS)}. "
            "HINT: e.g. step.png"
        )
    return fmt


def _render(size_in: tuple[float, float], draw: Any, path: str | os.PathLike[str], fmt: str) -> None:
    """Build a figure off pyplot on an Agg canvas, let ``draw(ax)`` fill it, write it."""
    Figure, FigureCanvasAgg, rc_context = _mpl()
    with rc_context(_RC):
        fig = Figure(figsize=size_in, dpi=_DPI, layout="constrained")
        FigureCanvasAgg(fig)
        draw(fig.add_subplot())
        # Creation dates would make every SVG/PDF differ; PNG carries none.
        metadata = {"png": None, "svg": {"Date": None}, "pdf": {"CreationDate": None}}[fmt]
        fig.savefig(path, dpi=_DPI, format=fmt, metadata=metadata)


def _plan_height_in(num_rows: int) -> float:
    """A plan figure's height: a fixed part for title, axis and legend, plus one band per row."""
    return max(_PLAN_MIN_HEIGHT_IN, 1.9 + _PLAN_ROW_IN * num_rows)


def _size(nbytes: int) -> str:
    return f"{nbytes / _GiB:.2f} GiB" if nbytes >= _GiB else f"{nbytes / _MiB:.1f} MiB"


def _runs(labels: Sequence[str]) -> list[tuple[int, int, str]]:
    """``(first, last, label)`` positions of each run of equal labels."""
    out: list[tuple[int, int, str]] = []
    for i, lab in enumerate(labels):
        if out and out[-1][2] == lab:
            out[-1] = (out[-1][0], i, lab)
        else:
            out.append((i, i, lab))
    return out


def plot_estimate(est: Estimate, path: str | os.PathLike[str]) -> None:
    """Draw allocated and reserved memory over the traced step of ``est``.

    The step's phases are shaded, the GPU's capacity is drawn when it is
    within 1.5x of the reserved peak, and the allocated peak is annotated
    with the three largest categories at the tensor peak.

    Args:
        est: An estimate with a ``memory_timeline`` (a full trace, or fast mode
            with its full event stream built), which is drawn.
        path: Where to write the image; the suffix (png, svg, pdf) sets the format.

    Raises:
        ConfigError: ``est`` has no timeline (fast mode that extrapolated its
            allocator peaks, see its notes), the suffix is not a
            known format, or matplotlib is missing.
    """
    fmt = _format_of(path)
    if not est.memory_timeline:
        raise ConfigError(
            f"the estimate of {est.model} has no memory timeline to plot: fast mode extrapolated its peaks "
            "(its notes say why). HINT: drop --fast (fast=False)"
        )
    _render(_ESTIMATE_SIZE_IN, lambda ax: _draw_estimate(ax, est), path, fmt)


def _draw_estimate(ax: Any, est: Estimate) -> None:
    xs = [p[0] for p in est.memory_timeline]
    labels = [p[1] for p in est.memory_timeline]
    alloc = [p[2] / _GiB for p in est.memory_timeline]
    reserved = [p[3] / _GiB for p in est.memory_timeline]
    top = max(reserved)
    handles: list[Any] = []

    (line,) = ax.plot(xs, alloc, color=_ALLOCATED_COLOR, lw=1.2, label="allocated", zorder=3)
    ax.fill_between(xs, alloc, color=_ALLOCATED_COLOR, alpha=0.15, lw=0, zorder=2)
    handles.append(line)
    (line,) = ax.plot(xs, reserved, color=_RESERVED_COLOR, lw=1.4, label="reserved", zorder=3)
    handles.append(line)
    capacity = est.capacity_bytes / _GiB
    ceiling = max(top, 1 / 1024)  # the highest line drawn (1 MiB for an empty step)
    if capacity <= 1.5 * top:
        line = ax.axhline(capacity, color=_CAPACITY_COLOR, lw=1.2, ls="--", zorder=3,
                          label=f"capacity ({est.gpu}, {_size(est.capacity_bytes)})")
        handles.append(line)
        ceiling = max(ceiling, capacity)
    # Leave the top third free for the peak's note and the phase names.
    ylim = ceiling / 0.64
    ax.set_ylim(0, ylim)
    ax.set_xlim(xs[0], max(xs[-1], xs[0] + 1))

    # Phase spans: from a run's first event to the next run's first event.
    # Each optimizer run ends an iteration; the second is the steady state.
    runs = _runs(labels)
    iteration, shaded = 1, {}
    for k, (first, last, lab) in enumerate(runs):
        x0 = xs[first]
        x1 = xs[runs[k + 1][0]] if k + 1 < len(runs) else xs[last]
        if lab in _PHASE_COLORS:
            span = ax.axvspan(x0, x1, color=_PHASE_COLORS[lab], alpha=0.45, lw=0, label=lab, zorder=0)
            shaded.setdefault(lab, span)
            if (x1 - x0) >= 0.06 * (xs[-1] - xs[0]):
                ax.text((x0 + x1) / 2, 0.985, f"{lab} {iteration}", transform=ax.get_xaxis_transform(),
                        ha="center", va="top", fontsize=8, color="#444444")
        if lab == "optimizer" and k + 1 < len(runs):
            iteration += 1
            ax.axvline(x1, color="#555555", lw=0.8, ls=":", zorder=1)
    handles += [shaded[p] for p in _PHASE_COLORS if p in shaded]

    # The allocated peak, with what the tensor peak holds; the note sits
    # above every line (all of them are at most ``ceiling``).
    ipk = max(range(len(alloc)), key=lambda i: alloc[i])
    ax.plot([xs[ipk]], [alloc[ipk]], marker="o", ms=5, color=_ALLOCATED_COLOR, zorder=4)
    top3 = sorted(
        ((c, v) for c, v in est.breakdown.items() if v > 0 and c is not MemoryCategory.HOST),
        key=lambda cv: -cv[1],
    )[:3]
    where = est.peak_phase.value + (f", {est.peak_module}" if est.peak_module else "")
    names = [c.value.replace("_", " ") for c, _ in top3]
    width = max(map(len, names), default=0)
    lines = [f"peak allocated {_size(est.peak_allocated_bytes)}", f"at the tensor peak ({where}):"]
    lines += [f"  {n:<{width}}  {_size(v):>10}" for n, (_, v) in zip(names, top3, strict=True)]
    frac = (xs[ipk] - xs[0]) / max(xs[-1] - xs[0], 1)
    ha = "left" if frac < 0.25 else "right" if frac > 0.75 else "center"
    ax.annotate(
        "\n".join(lines), xy=(xs[ipk], alloc[ipk]), xycoords="data",
        xytext=(xs[ipk], ceiling / ylim + 0.05), textcoords=ax.get_xaxis_transform(),
        ha=ha, va="bottom", multialignment="left", fontsize=8, family="monospace",
        bbox={"boxstyle": "round,pad=0.4", "fc": "white", "ec": "#999999"},
        arrowprops={"arrowstyle": "->", "color": "#333333", "lw": 0.8, "shrinkB": 4},
        zorder=5,
    )

    wl = est.workload
    accum = f", grad accum {wl.grad_accum_steps}" if wl.grad_accum_steps > 1 else ""
    ax.set_title(
        f"{est.model} on {est.gpu}: seq len {wl.seq_len}, micro-batch {wl.micro_batch_size}{accum}\n"
        f"reserved peak {_size(est.peak_reserved_bytes)}; device total (+ CUDA context) "
        f"{_size(est.device_total_bytes)} of {_size(est.capacity_bytes)}: {'fits' if est.fits else 'does not fit'}",
        fontsize=10,
    )
    ax.set_xlabel("allocator event (two traced iterations; the second is the steady state)")
    ax.set_ylabel("GiB")
    ax.grid(axis="y", color="#dddddd", lw=0.6)
    ax.figure.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=8)


def plot_plan(
    rows: Sequence[tuple[str, dict[str, int]]],
    *,
    capacity_bytes: int,
    margin: float,
    chosen: int | None,
    path: str | os.PathLike[str],
    title: str = "",
) -> None:
    """Draw one stacked bar per plan option, with the capacity and its margin.

    Args:
        rows: ``(label, segments)`` per option, top to bottom; ``segments``
            maps names of :data:`PLAN_SEGMENTS` to bytes (missing = 0).
        capacity_bytes: The GPU's capacity.
        margin: Fraction of the capacity kept free (0 <= margin < 1); a dashed
            line marks ``capacity * (1 - margin)``.
        chosen: Index in ``rows`` of the option chosen, or None.
        path: Where to write the image; the suffix (png, svg, pdf) sets the format.
        title: Figure title.

    Raises:
        ConfigError: No rows, a capacity or margin out of range, an unknown
            suffix, or matplotlib is missing.
    """
    fmt = _format_of(path)
    if not rows:
        raise ConfigError("plot_plan got no rows to draw. HINT: pass at least one (label, segments) row")
    if capacity_bytes <= 0:
        raise ConfigError(f"capacity_bytes must be positive, got {capacity_bytes!r}. HINT: e.g. 80 * 2**30")
    if not 0.0 <= margin < 1.0:
        raise ConfigError(f"margin must be in [0, 1), got {margin!r}. HINT: e.g. 0.1 keeps 10% free")
    for label, segments in rows:
        unknown = set(segments) - set(PLAN_SEGMENTS)
        assert not unknown, f"plan row {label!r} has segments {sorted(unknown)} outside PLAN_SEGMENTS"
    assert chosen is None or 0 <= chosen < len(rows), f"chosen={chosen} is not a row index (0..{len(rows) - 1})"

    def draw(ax: Any) -> None:
        _draw_plan(ax, rows, capacity_bytes=capacity_bytes, margin=margin, chosen=chosen)
        if title:
            ax.set_title(title, fontsize=10)

    _render((_PLAN_WIDTH_IN, _plan_height_in(len(rows))), draw, path, fmt)


def _draw_plan(
    ax: Any, rows: Sequence[tuple[str, dict[str, int]]], *, capacity_bytes: int, margin: float, chosen: int | None
) -> None:
    ys = range(len(rows))
    lefts = [0.0] * len(rows)
    handles: list[Any] = []
    used = [s for s in PLAN_SEGMENTS if any(seg.get(s, 0) > 0 for _, seg in rows)]
    for name in used:
        widths = [seg.get(name, 0) / _GiB for _, seg in rows]
        bars = ax.barh(ys, widths, left=lefts, height=0.7, color=_SEGMENT_COLORS[name],
                       label=_SEGMENT_NAMES.get(name, name), edgecolor="white", linewidth=0.4)
        handles.append(bars)
        lefts = [a + b for a, b in zip(lefts, widths, strict=True)]

    capacity = capacity_bytes / _GiB
    limit = capacity * (1.0 - margin)
    fontsize = 8 if len(rows) <= 30 else 6.5
    for y, total in zip(ys, lefts, strict=True):
        over = total > limit
        ax.text(total + capacity * 0.01, y, f"{total:.1f}", va="center", ha="left", fontsize=fontsize,
                color=_CAPACITY_COLOR if over else "#333333")
    if chosen is not None:
        ax.barh([chosen], [lefts[chosen]], height=0.86, fill=False, edgecolor="black", linewidth=1.6, zorder=3)

    handles.append(ax.axvline(capacity, color=_CAPACITY_COLOR, lw=1.4, label=f"capacity {capacity:.1f} GiB", zorder=2))
    if margin > 0:
        handles.append(ax.axvline(limit, color=_CAPACITY_COLOR, lw=1.2, ls="--", zorder=2,
                                  label=f"capacity - {margin:.0%} margin ({limit:.1f} GiB)"))
    if chosen is not None:
        (star,) = ax.plot([lefts[chosen] + capacity * 0.075], [chosen], marker="*", ms=11, color="black", zorder=4,
                          ls="none", label="chosen")
        handles.append(star)

    ax.set_yticks(list(ys), [label for label, _ in rows], fontsize=fontsize)
    if chosen is not None:
        ax.get_yticklabels()[chosen].set_fontweight("bold")
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top
    ax.set_xlim(0, max(max(lefts), capacity) * 1.12)
    ax.set_xlabel(f"GiB per GPU (bar totals at their ends; red: over {'the margin' if margin > 0 else 'capacity'})")
    ax.grid(axis="x", color="#dddddd", lw=0.6)
    ax.set_axisbelow(True)
    ax.figure.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5), frameon=False,
                     fontsize=8)


def plot_curve(results: Sequence[Any], path: str | os.PathLike[str]) -> None:
    """Draw ``llmem max``'s memory curve: the device total at each value estimated, the limit, the answer.

    Args:
        results: :class:`~llmem_plugin.planner.largest.MaxResult` s of one search, or of a table (one line
            per sequence length).
        path: Where to write the image; the suffix (png, svg, pdf) sets the format.

    Raises:
        ConfigError: No results, an unknown suffix, or matplotlib is missing.
    """
    fmt = _format_of(path)
    if not results:
        raise ConfigError("plot_curve got no results to draw. HINT: pass the MaxResult of a search")

    def draw(ax: Any) -> None:
        first = results[0]
        for r in results:
            exact = [p for p in r.points if p.exact]
            label = f"seq-len {r.fixed}" if len(results) > 1 else "device total (the full trace's figures)"
            line = ax.plot([p.value for p in exact], [p.device_total_bytes / _GiB for p in exact], "o-",
                           label=label)[0]
            fast = [p for p in r.points if not p.exact]
            if fast:
                ax.plot([p.value for p in fast], [p.device_total_bytes / _GiB for p in fast], "x",
                        color=line.get_color(), label="fast mode (bracket only)" if r is first else None)
            if r.value:
                ax.axvline(r.value, color=line.get_color(), linestyle=":", linewidth=1)
        ax.axhline(first.limit_bytes / _GiB, color=_CAPACITY_COLOR, linestyle="--",
                   label=f"limit {_size(first.limit_bytes)} ({_size(first.headroom_bytes)} headroom)")
        ax.axhline(first.capacity_bytes / _GiB, color=_CAPACITY_COLOR, linewidth=1, label="capacity")
        what = "micro-batch" if first.what == "batch_size" else "sequence length"
        ax.set_xlabel(what)
        ax.set_ylabel("GiB per GPU")
        where = first.gpu if first.method == "single" else f"{first.method} worst rank, {first.num_gpus} x {first.gpu}"
        answers = ", ".join(str(r.value) for r in results)
        ax.set_title(f"largest {what} that fits ({where}): {answers}", fontsize=10)
        ax.legend(loc="upper left", fontsize=8)

    _render((_PLAN_WIDTH_IN * 0.7, 4.2), draw, path, fmt)
