"""Render estimates and the catalog as terminal tables (the only printing besides the CLI)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

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
    table = Table(title="bundled model catalog (configs only, no weights; Hub ids: --json)", title_justify="left")
    # Fits 80 columns, nothing cut; the Hub ids and families are in --json.
    for col, just in (("name", "left"), ("task", "left"), ("layers", "right"), ("params", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    for r in rows:
        table.add_row(r["name"], r["task"], str(r["num_layers"]), f"{r['params']:,}")
    console.print(table)


def _tflops(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def render_gpus(rows: Sequence[dict], console: Console) -> None:
    """Print the GPU catalog: one row per GPU, memory in GiB, dense peaks."""
    table = Table(title="bundled GPU catalog (dense peaks, no sparsity; bf16/fp16 tensor cores with fp32 accumulate)",
                  title_justify="left")
    for col, just in (("name", "left"), ("device name", "left"), ("arch", "left"), ("cc", "right"),
                      ("memory GiB", "right"), ("bf16 TFLOP/s", "right"), ("fp16 TFLOP/s", "right"),
                      ("fp32 TFLOP/s", "right"), ("mem GB/s", "right"), ("link", "left"), ("link GB/s", "right")):
        table.add_column(col, justify=just)
    for r in rows:
        major, minor = r["compute_capability"]
        table.add_row(r["name"], r["display_name"], r["architecture"], f"{major}.{minor}", gib(r["memory_bytes"]),
                      _tflops(r["bf16_tflops"]), _tflops(r["fp16_tflops"]), _tflops(r["fp32_tflops"]),
                      f"{r['memory_bandwidth_gbps']:,.0f}", r["link"], f"{r['link_bandwidth_gbps']:,.0f}")
    console.print(table)


def _signed(v: float | None) -> str:
    return "" if v is None else f"{v:+.2f}%"


def _validation_table(title: str, checks: Sequence, div: int, *, stub: bool) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("row", overflow="fold")
    table.add_column("status")
    for m in METRICS:
        table.add_column(m.replace("_", " "), justify="right")
    table.add_column("pred - meas bytes (alloc / reserved)" if stub else "fits meas/pred",
                     justify="right" if stub else "left")
    for r in checks:
        cells = [r.id + (" (edge)" if r.edge else ""), r.status]
        for m in METRICS:
            meas, pred = r.measured[m], r.predicted[m]
            if meas is None and pred is None:
                cells.append("")
                continue
            if stub and m == "device_total":
                cells.append("not measured" + ("" if pred is None else f" / {pred / div:,.2f}"))
                continue
            text = " / ".join("-" if v is None else f"{v / div:,.2f}" for v in (meas, pred))
            cells.append(f"{text} {_signed(r.error_pct[m])}".strip())
        if stub:
            d = r.diff_bytes
            last = "" if d["allocated"] is None else f"{d['allocated']:+,} / " + (
                "-" if d["reserved"] is None else f"{d['reserved']:+,}")
        else:
            last = "" if r.fits_measured is None else f"{r.fits_measured}/{r.fits_predicted}"
        table.add_row(*cells, last)
    return table


def _summary_table(title: str, summary: dict) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("metric", "rows", "mean |err|", "max |err|", "max under", "mean signed", "rows under"):
        table.add_column(col, justify="left" if col == "metric" else "right")

    def pct(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}%"

    for m, st in summary.items():
        table.add_row(m.replace("_", " "), str(st.num_rows), pct(st.mean_abs_pct), pct(st.max_abs_pct),
                      pct(st.max_under_pct), _signed(st.mean_signed_pct), str(st.num_under))
    return table


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
        console.print(_validation_table(
            f"measured / predicted {unit}, error = (predicted - measured) / measured", measured, div, stub=False))
        for r in measured:
            if r.note:
                console.print(f"{r.id}: {r.note}")
        console.print(_summary_table("summary (under = under-estimate, the direction that causes OOM)",
                                     report.summary))
        acc = "no edge rows" if report.fits_accuracy is None else (
            f"{100 * report.fits_accuracy:.0f}% of {report.num_edge_rows} edge rows")
        console.print(f"fits/OOM verdict: {acc}")
    if stub:
        console.print(_validation_table(
            f"stub device (stubcuda: torch's caching allocator, no GPU; not GPU measurements): "
            f"stub / predicted {unit}", stub, div, stub=True))
        for r in stub:
            if r.note:
                console.print(f"{r.id}: {r.note}")
        console.print(_summary_table("stub summary (device total not measured on the stub)",
                                     report.stub_summary))
        console.print(f"stub rows equal to the estimate byte for byte (allocated and reserved): "
                      f"{report.num_stub_exact} of {len(stub)}")



def render_published(result: dict, console: Console) -> None:
    """Print ``llmem validate --published``: per metric, each modelled row's measured and predicted GiB and the
    signed error, then the pooled reserved summary, the refused rows and the count not modelled."""
    def stats(what: str, s: dict) -> str:
        return (f"{what}: {s['rows']} rows, mean |err| {s['mean_abs_pct']:.1f}%, mean signed "
                f"{s['mean_signed_pct']:+.1f}%, max |err| {s['max_abs_pct']:.1f}%")

    for metric, s in result["summary"].items():
        table = Table(title=stats(metric, s))
        for col in ("id", "measured GiB", "predicted GiB", "error"):
            table.add_column(col, overflow="fold")
        for r in result["rows"]:
            if r["metric"] == metric and r["error_pct"] is not None:
                table.add_row(r["id"], f"{r['measured'] / 2**30:.2f}", f"{r['predicted'] / 2**30:.2f}",
                              f"{r['error_pct']:+.1f}%")
        console.print(table)
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
    table = Table(title=f"per rank on {gpu.name} ({gib(gpu.capacity_bytes)} GiB); GiB", title_justify="left")
    for col in ("method", "gpus", "tp", "rank", "allocated", "reserved", "device total", "fits",
                "comm/step intra", "inter"):
        table.add_column(col, justify="left" if col in ("method", "fits") else "right")
    for est in rows:
        w = est.worst
        fits = all(r.fits for r in est.ranks)
        table.add_row(est.method, str(est.layout.num_gpus), str(est.layout.tp), str(w.rank),
                      gib(w.peak_allocated_bytes), gib(w.peak_reserved_bytes), gib(w.device_total_bytes),
                      "yes" if fits else "NO", gib(est.comm_intra_node_bytes), gib(est.comm_inter_node_bytes),
                      style=None if fits else "red")
    console.print(table)
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
    table = Table()
    for name, justify in (("", "left"), ("method", "left"), ("tp", "right"), ("micro", "right"),
                          ("accum", "right"), ("ckpt", "left"), ("offload", "left"),
                          ("GiB/GPU", "right"), ("free GiB", "right"), ("host GiB/node", "right"), ("step s", "right"),
                          ("tokens/s", "right"), ("memory", "left")):
        table.add_column(name, justify=justify)
    for c in plan_rows(plan, show_all):
        chosen = c is plan.choice
        table.add_row(
            "*" if chosen else ("" if c.fits else "x"),
            # A pipeline's accumulation: its microbatches per schedule step, x its schedule steps.
            c.method_label, str(c.tp), str(c.micro_batch),
            str(c.grad_accum) + (f"x{c.schedule_steps}" if c.pp > 1 and c.schedule_steps > 1 else ""),
            "yes" if c.grad_checkpointing else "",
            c.offload or "", gib(c.device_total_bytes), gib(c.headroom_bytes),
            gib(c.host_bytes_per_node) + ("" if c.host_fits else " (over)"), f"{c.step_time_s:.3g}",
            f"{c.tokens_per_s:,.0f}", "traced" if c.verified else "screened",
            style="bold green" if chosen else (None if c.fits else "dim"),
        )
    console.print(table)
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
        if not plan.suggestions:
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
    table = Table()
    table.add_column("", style="bold")
    table.add_column("allocated GiB", justify="right")
    table.add_column("reserved GiB", justify="right")
    table.add_row(f"whole run (worst step {v.worst_step + 1})", gib(v.peak_allocated_bytes), gib(v.peak_reserved_bytes))
    table.add_row(f"after warm-up (step {v.warmup_steps})", "", gib(v.reserved_after_warmup_bytes))
    table.add_row(f"fixed shape at the longest micro-batch ({v.longest} tokens)", gib(v.fixed_allocated_bytes),
                  gib(v.fixed_reserved_bytes))
    console.print(table)
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
    table = Table(title=f"{recipe.path} ({recipe.framework})", title_justify="left")
    for column in ("key", "value", "llmem option"):
        table.add_column(column, overflow="fold")
    for m in recipe.mapped:
        table.add_row(m.key, m.value, m.option or "(default)")
    console.print(table)
    for n in recipe.not_modelled:
        console.print(f"not modelled: {n.key}={n.value} ({n.why})", markup=False)
    for note in recipe.notes:
        console.print(f"note: {note}", markup=False)
