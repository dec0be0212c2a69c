"""Render estimates and the catalog as terminal tables (the only printing besides the CLI)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console

from llmem_plugin.cli.columns import Column, print_fitted
from llmem_plugin.summary import adapter_dtype as _adapter_dtype, checkpointing_policy, gib, qlora_path
from llmem_plugin.summary import host_line as _host_line
from llmem_plugin.verify.validate import METRICS, ValidationReport

__all__ = [
    "plan_rows",
    "render_gpus",
    "render_methods",
    "render_models",
    "render_plan",
    "render_published",
    "render_recipe",
    "render_validation",
    "render_varlen",
]

_GIB = 1024**3  # sizes are printed in GiB (2^30 bytes) and labelled so


def render_models(rows: Sequence[dict], console: Console) -> None:
    """Print the catalog: one row per model with its exact parameter count."""
    # The Hub ids and families are in --json.
    print_fitted(console, [
        Column(header="name", cells=[r["name"] for r in rows]),
        Column(header="task", cells=[r["task"] for r in rows]),
        Column(header="layers", cells=[str(r["num_layers"]) for r in rows], justify="right", drop=1),
        Column(header="params", cells=[f"{r['params']:,}" for r in rows], justify="right"),
    ], title="bundled model catalog (configs only, no weights; Hub ids: --json)", title_justify="left")


def _tflops(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def render_gpus(rows: Sequence[dict], console: Console) -> None:
    """Print the GPU catalog: one row per GPU, memory in GiB, dense peaks.

    At narrow widths the columns a sizing needs least go first: fp32 peak, compute capability, architecture,
    link, link bandwidth, memory bandwidth, fp16 peak (the names, memory and bf16 peak always stay).
    """
    def col(header: str, cells: list[str], drop: int = 0, justify: str = "right") -> Column:
        return Column(header=header, cells=cells, drop=drop, justify=justify)

    cc = [f"{r['compute_capability'][0]}.{r['compute_capability'][1]}" for r in rows]
    print_fitted(console, [
        col("name", [r["name"] for r in rows], justify="left"),
        col("device name", [r["display_name"] for r in rows], justify="left"),
        col("arch", [r["architecture"] for r in rows], drop=5, justify="left"),
        col("cc", cc, drop=6),
        col("memory GiB", [gib(r["memory_bytes"]) for r in rows]),
        col("bf16 TFLOP/s", [_tflops(r["bf16_tflops"]) for r in rows]),
        col("fp16 TFLOP/s", [_tflops(r["fp16_tflops"]) for r in rows], drop=1),
        col("fp32 TFLOP/s", [_tflops(r["fp32_tflops"]) for r in rows], drop=7),
        col("mem GB/s", [f"{r['memory_bandwidth_gbps']:,.0f}" for r in rows], drop=2),
        col("link", [r["link"] for r in rows], drop=4, justify="left"),
        col("link GB/s", [f"{r['link_bandwidth_gbps']:,.0f}" for r in rows], drop=3),
    ], title="bundled GPU catalog (dense peaks, no sparsity; bf16/fp16 tensor cores with fp32 accumulate)",
        title_justify="left")


def _signed(v: float | None) -> str:
    return "" if v is None else f"{v:+.2f}%"


def _metric_cell(r, m: str, div: int, *, stub: bool) -> str:
    """One row's measured / predicted size of metric ``m`` and its signed error."""
    meas, pred = r.measured[m], r.predicted[m]
    if meas is None and pred is None:
        return ""
    if stub and m == "device_total":
        return "not measured" + ("" if pred is None else f" / {pred / div:,.2f}")
    text = " / ".join("-" if v is None else f"{v / div:,.2f}" for v in (meas, pred))
    return f"{text} {_signed(r.error_pct[m])}".strip()


def _validation_columns(checks: Sequence, div: int, *, stub: bool) -> list[Column]:
    """The rows' table: the row ids and the sizes wrap at narrow widths; the last column goes first."""
    if stub:
        last = ["" if r.diff_bytes["allocated"] is None else f"{r.diff_bytes['allocated']:+,} / " + (
            "-" if r.diff_bytes["reserved"] is None else f"{r.diff_bytes['reserved']:+,}") for r in checks]
    else:
        last = ["" if r.fits_measured is None else f"{r.fits_measured}/{r.fits_predicted}" for r in checks]
    return [
        Column(header="row", cells=[r.id + (" (edge)" if r.edge else "") for r in checks], wrap=True),
        Column(header="status", cells=[r.status for r in checks]),
        *(Column(header=m.replace("_", " "), cells=[_metric_cell(r, m, div, stub=stub) for r in checks],
                 justify="right", wrap=True) for m in METRICS),
        Column(header="pred - meas bytes (alloc / reserved)" if stub else "fits meas/pred", cells=last,
               justify="right" if stub else "left", drop=1),
    ]


def _summary_columns(summary: dict) -> list[Column]:
    def pct(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}%"

    def col(header: str, cells: list[str]) -> Column:
        return Column(header=header, cells=cells, justify="right")

    stats = list(summary.values())
    return [
        Column(header="metric", cells=[m.replace("_", " ") for m in summary]),
        col("rows", [str(st.num_rows) for st in stats]),
        col("mean |err|", [pct(st.mean_abs_pct) for st in stats]),
        col("max |err|", [pct(st.max_abs_pct) for st in stats]),
        col("max under", [pct(st.max_under_pct) for st in stats]),
        col("mean signed", [_signed(st.mean_signed_pct) for st in stats]),
        col("rows under", [str(st.num_under) for st in stats]),
    ]


def render_validation(report: ValidationReport, console: Console) -> None:
    """Print each row's measured / predicted size and signed % error, then the summary.

    Stub-device rows (``kind`` "stub") come in a table and summary of their
    own, after the measurements: they are not GPU truth.
    """
    sizes = [v for r in report.rows for d in (r.measured, r.predicted) for v in d.values() if v]
    unit, div = ("GiB", _GIB) if sizes and max(sizes) >= _GIB else ("MiB", 2**20)
    measured = [r for r in report.rows if r.kind != "stub"]
    stub = report.stub_rows
    if measured or not stub:
        print_fitted(console, _validation_columns(measured, div, stub=False), title_justify="left",
                     title=f"measured / predicted {unit}, error = (predicted - measured) / measured")
        for r in measured:
            if r.note:
                console.print(f"{r.id}: {r.note}")
        print_fitted(console, _summary_columns(report.summary), title_justify="left",
                     title="summary (under = under-estimate, the direction that causes OOM)")
        acc = "no edge rows" if report.fits_accuracy is None else (
            f"{100 * report.fits_accuracy:.0f}% of {report.num_edge_rows} edge rows")
        console.print(f"fits/OOM verdict: {acc}")
    if stub:
        print_fitted(console, _validation_columns(stub, div, stub=True), title_justify="left",
                     title=f"stub device (stubcuda: torch's caching allocator, no GPU; not GPU measurements): "
                           f"stub / predicted {unit}")
        for r in stub:
            if r.note:
                console.print(f"{r.id}: {r.note}")
        print_fitted(console, _summary_columns(report.stub_summary), title_justify="left",
                     title="stub summary (device total not measured on the stub)")
        console.print(f"stub rows equal to the estimate byte for byte (allocated and reserved): "
                      f"{report.num_stub_exact} of {len(stub)}")



def render_published(result: dict, console: Console) -> None:
    """Print ``llmem validate --published``: per metric, each modelled row's measured and predicted GiB and the
    signed error, then the pooled reserved summary, the refused rows and the count not modelled."""
    def stats(what: str, s: dict) -> str:
        return (f"{what}: {s['rows']} rows, mean |err| {s['mean_abs_pct']:.1f}%, mean signed "
                f"{s['mean_signed_pct']:+.1f}%, max |err| {s['max_abs_pct']:.1f}%")

    for metric, s in result["summary"].items():
        rows = [r for r in result["rows"] if r["metric"] == metric and r["error_pct"] is not None]
        print_fitted(console, [
            Column(header="id", cells=[r["id"] for r in rows], wrap=True),
            Column(header="measured GiB", cells=[f"{r['measured'] / 2**30:.2f}" for r in rows]),
            Column(header="predicted GiB", cells=[f"{r['predicted'] / 2**30:.2f}" for r in rows]),
            Column(header="error", cells=[f"{r['error_pct']:+.1f}%" for r in rows]),
        ], title=stats(metric, s))
    if result["reserved_pooled"]:
        console.print(stats("reserved memory, both metrics", result["reserved_pooled"]))
    refused = [r for r in result["rows"] if r["status"] == "modelled" and r["error"]]
    for r in refused:
        console.print(f"refused: {r['id']}: {r['error']}")
    console.print(f"{result['unsupported']} rows not modelled (their reasons: --json, or the file's 'why')")


def _method_host(est, host) -> str:
    """One method's host RAM per node, by part, against the node's RAM."""
    w = max(est.ranks, key=lambda r: r.host_total_bytes)
    parts = [f"{gib(w.host_bytes)} offloaded/pinned"] if w.host_bytes else []
    parts += [f"{gib(v)} {k.replace('_', ' ')}" for k, v in w.host_overheads.items()]
    n = est.layout.gpus_per_node
    what = (f"{est.method}: host (CPU) RAM {gib(est.host_total_bytes_per_node)} GiB per node "
            f"({n} process{'es' if n > 1 else ''} x {gib(w.host_total_bytes)} GiB: {', '.join(parts)})")
    return _host_line(est.host_total_bytes_per_node, host.node_bytes if host else 0, host.source if host else "",
                      what=what)


def render_methods(rows: Sequence, skipped: Sequence[tuple[str, str]], gpu, console: Console, host=None) -> None:
    """Print one row per distributed method: the worst rank's three numbers and the verdict.

    Args:
        host: The node's :class:`llmem_plugin.device.host.HostCapacity` to check each
            method's host RAM per node against (None: shown, not checked).
    """
    fits = [all(r.fits for r in est.ranks) for est in rows]

    def col(header: str, cells: list[str], drop: int = 0) -> Column:
        return Column(header=header, cells=cells, justify="right", drop=drop)

    # At narrow widths the communication volumes go first, then the GPU count and the worst rank's index.
    print_fitted(console, [
        Column(header="method", cells=[est.method for est in rows]),
        col("gpus", [str(est.layout.num_gpus) for est in rows], drop=1),
        col("tp", [str(est.layout.tp) for est in rows]),
        col("rank", [str(est.worst.rank) for est in rows], drop=1),
        col("allocated", [gib(est.worst.peak_allocated_bytes) for est in rows]),
        col("reserved", [gib(est.worst.peak_reserved_bytes) for est in rows]),
        col("device total", [gib(est.worst.device_total_bytes) for est in rows]),
        Column(header="fits", cells=["yes" if f else "NO" for f in fits]),
        col("comm/step intra", [gib(est.comm_intra_node_bytes) for est in rows], drop=2),
        col("inter", [gib(est.comm_inter_node_bytes) for est in rows], drop=2),
    ], row_styles=[None if f else "red" for f in fits],
        title=f"per rank on {gpu.name} ({gib(gpu.capacity_bytes)} GiB); GiB", title_justify="left")
    for est in rows:
        console.print(_method_host(est, host))
        for note in est.notes:
            console.print(f"{est.method}: {note}", markup=False)  # notes quote TOML sections, "[parallelism]"
    for name, why in skipped:
        console.print(f"{name}: not applicable ({why})", markup=False)


def plan_rows(plan, show_all: bool) -> list:
    """Fitting candidates fastest first, then the closest that do not fit."""
    fit = [c for c in plan.candidates if c.fits]
    over = plan.closest(len(plan.candidates) if show_all else 5)
    if not show_all:
        fit = fit[:15]
        if plan.choice is not None and plan.choice not in fit:
            fit = [plan.choice, *fit]
    return fit + over


def _print_candidates(rows: Sequence, choice, console: Console) -> None:
    """The plan's table. At narrow widths the columns that follow from others go first: how screened,
    the host RAM, the headroom, the step time (tokens/s ranks them), then tokens/s; then checkpointing and
    offload (empty ones before any other)."""
    def col(header: str, cells: list[str], drop: int = 0, justify: str = "right") -> Column:
        return Column(header=header, cells=cells, justify=justify, drop=drop)

    print_fitted(console, [
        col("", ["*" if c is choice else ("" if c.fits else "x") for c in rows], justify="left"),
        col("method", [c.method_label for c in rows], justify="left"),
        col("tp", [str(c.tp) for c in rows]),
        col("micro", [str(c.micro_batch) for c in rows]),
        # A pipeline's accumulation: its microbatches per schedule step, x its schedule steps.
        col("accum", [str(c.grad_accum) + (f"x{c.schedule_steps}" if c.pp > 1 and c.schedule_steps > 1 else "")
                      for c in rows]),
        col("ckpt", ["yes" if c.grad_checkpointing else "" for c in rows], drop=1, justify="left"),
        col("offload", [c.offload or "" for c in rows], drop=1, justify="left"),
        col("GiB/GPU", [gib(c.device_total_bytes) for c in rows]),
        col("free GiB", [gib(c.headroom_bytes) for c in rows], drop=5),
        col("host GiB/node", [gib(c.host_bytes_per_node) + ("" if c.host_fits else " (over)") for c in rows],
            drop=6),
        col("step s", [f"{c.step_time_s:.3g}" for c in rows], drop=4),
        col("tokens/s", [f"{c.tokens_per_s:,.0f}" for c in rows], drop=3),
        col("memory", ["traced" if c.verified else "screened" for c in rows], drop=7, justify="left"),
    ], row_styles=["bold green" if c is choice else (None if c.fits else "dim") for c in rows])


def render_plan(plan, console: Console, *, show_all: bool = False) -> None:
    """Print the candidate table with the choice highlighted, and why it wins."""
    wl = plan.workload
    lora = f", LoRA r={wl.lora.rank}{_adapter_dtype(wl)}" if wl.lora else ""
    console.print(
        f"{plan.model} on {plan.layout.num_gpus} x {plan.gpu.name} ({plan.layout.num_nodes} node"
        f"{'s' if plan.layout.num_nodes > 1 else ''}): seq {wl.seq_len}, global batch {plan.global_batch}, "
        f"{wl.precision.value}, {wl.optimizer.value}{lora}; limit {gib(plan.limit_bytes)} GiB per GPU "
        f"({gib(plan.capacity_bytes)} GiB less a {100 * plan.margin:g}% margin)"
    )
    host = getattr(plan, "host_memory", None)
    if host is not None:
        console.print(f"host (CPU) RAM: {gib(host.node_bytes)} GiB per node ({host.source}); limit "
                      f"{gib(plan.host_limit_bytes)} GiB per node")
    rows = plan_rows(plan, show_all)
    if rows:  # none when every method was skipped before a trace
        _print_candidates(rows, plan.choice, console)
    if plan.choice is not None:
        console.print(f"choice: {plan.why}")
        if host is not None:
            c = plan.choice
            console.print(f"host memory of the choice: {gib(c.host_bytes_per_node)} GiB per node "
                          f"({plan.layout.gpus_per_node} process{'es' if plan.layout.gpus_per_node > 1 else ''}: "
                          f"offloaded states, pinned buffers, framework and CUDA context) of the "
                          f"{gib(plan.host_limit_bytes)} GiB host limit")
    else:
        console.print("nothing fits.")
        if getattr(plan, "host_refused_bytes", 0):
            console.print(f"  host memory: the plans refused for it need at least {gib(plan.host_refused_bytes)} GiB "
                          f"per node, over the {gib(plan.host_limit_bytes)} GiB host limit; give the node's RAM with "
                          "--host-memory, use more nodes, or a method without offload")
        for s in plan.suggestions:
            c = s.choice
            console.print(f"  fits with {s.change}: {c.label()}, {gib(c.device_total_bytes)} GiB per GPU, "
                          f"{c.tokens_per_s:,.0f} tokens/s")
        if plan.fixed_bytes > plan.limit_bytes:
            console.print(f"  the CUDA context, cuBLAS workspace and NCCL buffers alone take {gib(plan.fixed_bytes)} "
                          f"GiB per GPU: no change of the job on {plan.layout.num_gpus} GPU(s) can fit; use a smaller "
                          "--margin or a GPU with more memory")
        elif not plan.suggestions:
            console.print("  no change tried (more GPUs, offload, LoRA, a shorter sequence) made it fit")
    for name, why in plan.skipped:
        console.print(f"[dim]skipped {name}: {why}[/dim]")
    console.print(f"[dim]memory 'screened': from fast-mode traces of each method; 'traced': the method's full "
                  f"trace at exactly that configuration. Planned in {plan.seconds:.1f} s.[/dim]")


def render_varlen(v, wl, gpu_name: str, console: Console) -> None:
    """Print a variable-length run (:class:`llmem_plugin.techniques.varlen.VarLenEstimate`)."""
    d = v.derivation
    console.print(f"variable-length batches: {v.lengths.source} (mean {v.lengths.mean:.0f} tokens), micro-batch "
                  f"{wl.micro_batch_size} padded to its longest sample, truncated at {wl.seq_len}; "
                  f"{v.steps} steps replayed on the {gpu_name}")
    labels = (f"whole run (worst step {v.worst_step + 1})", f"after warm-up (step {v.warmup_steps})",
              f"fixed shape at the longest micro-batch ({v.longest} tokens)")
    print_fitted(console, [
        Column(header="", cells=labels, wrap=True, style="bold"),
        Column(header="allocated GiB", justify="right",
               cells=[gib(v.peak_allocated_bytes), "", gib(v.fixed_allocated_bytes)]),
        Column(header="reserved GiB", justify="right",
               cells=[gib(v.peak_reserved_bytes), gib(v.reserved_after_warmup_bytes), gib(v.fixed_reserved_bytes)]),
    ])
    verdict = "fits" if v.fits else "does NOT fit"
    console.print(f"device total {gib(v.device_total_bytes)} GiB of {gib(v.capacity_bytes)} GiB: {verdict}")
    if v.alloc_retries:
        console.print(f"at this capacity the allocator frees its cached blocks and retries {v.alloc_retries} time(s) "
                      "over the run: reserved is the replay capped at the GPU's memory")
    switches = f"; the allocations change structure at {', '.join(map(str, d.switches))} tokens" if d.switches else ""
    console.print(f"sizes derived per allocation from {d.traces} traced lengths{switches}")
    console.print(f"activation checkpointing: {checkpointing_policy(wl)}")
    if wl.quantize is not None:
        console.print(f"QLoRA: {qlora_path(wl)}")


def render_recipe(recipe, console: Console) -> None:
    """The ``--config`` file as read: each memory key and the option it became, the keys not modelled, the notes."""
    print_fitted(console, [
        Column(header="key", cells=[m.key for m in recipe.mapped]),
        Column(header="value", cells=[m.value for m in recipe.mapped], wrap=True),
        Column(header="llmem option", cells=[m.option or "(default)" for m in recipe.mapped], wrap=True),
    ], title=f"{recipe.path} ({recipe.framework})", title_justify="left")
    for n in recipe.not_modelled:
        console.print(f"not modelled: {n.key}={n.value} ({n.why})", markup=False)
    for note in recipe.notes:
        console.print(f"note: {note}", markup=False)
