"""``llmem estimate``: one step on one GPU, a run of variable-length steps, or the methods on a cluster.

Without ``--method``, ``--gpus``, ``--tp``, ``--nodes`` or ``--offload`` the
step is traced for one GPU (:func:`llmem_plugin.estimate.estimate`); with
``--seq-lens`` a run of steps of varying length is replayed; otherwise each
distributed method's ranks are estimated
(:func:`llmem_plugin.methods.estimate_method`).
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

from llmem_plugin.cli.config import add_config_args, emit_json, show_recipe
from llmem_plugin.cli.options import (
    add_cache_arg,
    EXIT_WONT_FIT,
    GPUS,
    MAX_TP,
    MICROBATCHES,
    NODES,
    PP,
    STAGES_PER_RANK,
    TP,
    add_host_arg,
    add_target_args,
    add_workload_args,
    build_workload,
    choose_precision,
    target_gpu,
)

__all__ = ["add_method_args", "estimate_command", "estimate_parser"]


def estimate_parser(sub) -> None:
    """``llmem estimate``: the workload, the GPU, the distributed method and the output options."""
    p = sub.add_parser("estimate", help="peak GPU memory of one fine-tuning step on one GPU")
    add_config_args(p)
    add_workload_args(p)
    add_target_args(p)
    add_method_args(p)
    g = p.add_argument_group("output")
    g.add_argument("--fast", action="store_true", help="trace a few layers and extrapolate to full depth")
    g.add_argument("--full", action="store_true",
                   help="trace the whole model (default: the step's stream is built from two shortened copies "
                        "where that is exact and cheaper: on one GPU, and for --method zero3 where DeepSpeed's "
                        "windows stay inside a layer; the report names the path)")
    add_cache_arg(g)
    g.add_argument("--plot", default=None, metavar="FILE",
                   help="draw allocated and reserved memory over the traced step to FILE (png, svg, pdf)")
    g.add_argument("--snapshot", default=None, metavar="FILE",
                   help="write the predicted allocator history to FILE in PyTorch's memory-snapshot format "
                        "(pickle; .json for JSON): `python -m torch.cuda._memory_viz` and MemoryViz read it, "
                        "`llmem compare` sets it against a real run's")
    g.add_argument("--html", default=None, metavar="FILE",
                   help="write a self-contained report (timeline by category, reserved vs allocated, the verdict) "
                        "to FILE; needs the [report] extra")
    g.add_argument("--json", action="store_true", help="print the estimate as JSON")
    add_host_arg(p)
    p.set_defaults(func=estimate_command)


def add_method_args(p: argparse.ArgumentParser, *, one: bool = False) -> None:
    """The distributed method and its cluster (``llmem estimate``, ``llmem max``); ``one``: a single method
    (``all`` is not offered)."""
    g = p.add_argument_group("distributed method")
    g.add_argument("--method", default=None,
                   help="distributed method (`--method help` lists them)" + ("; default: one GPU" if one else
                        ", or 'all' for every one that applies (the default when --gpus/--tp/--nodes/--offload "
                        "is given); default: one GPU"))
    g.add_argument("--gpus", type=GPUS, default=None, help="world size: GPUs over all nodes (default 1)")
    g.add_argument("--nodes", type=NODES, default=1, help="nodes (default 1)")
    g.add_argument("--tp", type=TP, default=None, help="tensor-parallel degree, inside a node (default 1)")
    g.add_argument("--offload", choices=("optimizer", "params"), default=None,
                   help="CPU offload: optimizer states, or parameters too (ZeRO, FSDP)")
    g.add_argument("--deepspeed-config", default=None, metavar="JSON",
                   help="a DeepSpeed config (file or inline JSON): its zero_optimization stage and offload pick "
                        "the method (zero1/2/3, --offload) and its bucket sizes the buffers; HF's 'auto' values "
                        "are filled as the Trainer fills them")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallel for the tensor-parallel methods (tp, dp-tp, fsdp-tp)")
    g.add_argument("--pp", type=PP, default=None,
                   help="pipeline methods (pp*): pipeline degree (default: --gpus); below --gpus, each stage is "
                        "FSDP2-sharded over the remaining ranks, as torchtitan composes them")
    g.add_argument("--microbatches", type=MICROBATCHES, default=None,
                   help="pipeline methods (pp*): microbatches per step, each of --batch-size rows (default: "
                        "the pipeline degree)")
    g.add_argument("--stages-per-rank", type=STAGES_PER_RANK, default=None,
                   help="pipeline methods: stages per rank (interleaved schedules; default 2, the V schedules 2)")
    g.add_argument("--no-return-outputs", dest="return_outputs", action="store_false", default=None,
                   help="pipeline methods: step the schedule with return_outputs=False, as torchtitan's trainer "
                        "does (the last stage keeps no microbatch's logits; torch's default keeps them all)")
    g.add_argument("--pp-split", default=None, metavar="SPLIT",
                   help="pipeline methods: decoder layers per stage, 'torchtitan' (default), 'colossalai', or "
                        "counts such as 8,9,8,7")


def estimate_command(args: argparse.Namespace) -> int:
    """One step on one GPU, a run of variable-length steps (``--seq-lens``), or the methods on a cluster.

    Returns:
        0 when it fits, ``EXIT_WONT_FIT`` when the GPU or the node's host RAM is too small.
    """
    from llmem_plugin.errors import ConfigError, UnsupportedError

    if args.deepspeed_config is not None:
        _deepspeed_args(args)
    if args.method is not None or args.gpus not in (None, 1) or args.tp not in (None, 1) or args.nodes != 1 \
            or args.offload:
        if args.plot and args.method in (None, "all"):
            raise ConfigError("--plot draws the single-GPU step, or each rank of one --method. HINT: name one "
                              "--method, drop --gpus/--tp/--nodes/--offload, or use `llmem plan --plot`")
        if args.html:
            raise ConfigError("--html draws the single-GPU step. HINT: use `llmem plan --html` for the methods' "
                              "ranks, or drop --method/--gpus/--tp/--nodes/--offload")
        if args.snapshot and args.method in (None, "all"):
            raise ConfigError("--snapshot writes one method's ranks. HINT: name one --method (ddp, zero3, ...)")
        if args.snapshot and args.method.startswith("pp"):
            raise UnsupportedError(f"--snapshot with --method {args.method}: a pipeline schedule's stages are not "
                                   "written as snapshots yet. HINT: drop --snapshot, or use `llmem plan --html`")
        if args.method is None:  # a cluster without a method: compare them all
            args.method = "all"
        return _methods_command(args)
    if args.sequence_parallel:
        raise ConfigError("--sequence-parallel needs a tensor-parallel method. HINT: add --method tp --gpus 2 --tp 2, "
                          "or drop --sequence-parallel")
    from llmem_plugin.estimate import estimate

    choose_precision(args)
    gpu, wl = target_gpu(args), build_workload(args)
    if args.steps is not None and args.seq_lens is None:
        raise ConfigError(f"--steps {args.steps} sets how many steps of varying length are replayed. HINT: add "
                          "--seq-lens (the sample lengths), or drop --steps")
    if args.seq_lens is not None:
        return _varlen_command(args, gpu, wl)
    keep = bool(args.snapshot or args.html)
    est = estimate(args.model, wl, fast=args.fast, full=args.full, gpu=gpu, alloc_conf=args.alloc_conf,
                   torch_version=args.torch_version, host_memory=args.host_memory, keep_trace=keep)
    if keep:
        _write_views(est, args)
    if args.plot:
        from llmem_plugin.cli.plot import plot_estimate

        plot_estimate(est, args.plot)
    if args.json:
        emit_json(args, est.to_dict())
    else:
        from rich.console import Console

        from llmem_plugin.summary import render_estimate

        console = Console()
        show_recipe(args, console)
        render_estimate(est, console)
    if not est.fits:
        print(f"llmem: the step does not fit the {gpu.name} ({_size(est.capacity_bytes)}); exit code "
              f"{EXIT_WONT_FIT}. HINT: `llmem plan` searches methods, micro-batch, checkpointing and offload for "
              "a fit", file=sys.stderr)
        return EXIT_WONT_FIT
    if not est.host_fits:
        print(_host_misfit(est.host_bytes, est.host_capacity_bytes, est.host_memory_source), file=sys.stderr)
        return EXIT_WONT_FIT
    return 0


def _varlen_command(args: argparse.Namespace, gpu, wl) -> int:
    """``--seq-lens``: a run of steps of varying length replayed through the allocator."""
    from llmem_plugin.errors import ConfigError
    from llmem_plugin.techniques.varlen import estimate_variable_length

    if args.plot or args.snapshot or args.html:
        raise ConfigError("--plot, --snapshot and --html show one fixed-shape step. HINT: drop them with --seq-lens")
    v = estimate_variable_length(args.model, wl, args.seq_lens, steps=args.steps, fast=args.fast, gpu=gpu,
                                 alloc_conf=args.alloc_conf, torch_version=args.torch_version)
    if args.json:
        emit_json(args, v.to_dict())
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_varlen

        console = Console()
        show_recipe(args, console)
        render_varlen(v, wl, gpu.name, console)
    if not v.fits:
        print(f"llmem: the run does not fit the {gpu.name} ({_size(v.capacity_bytes)}); exit code "
              f"{EXIT_WONT_FIT}. HINT: lower --batch-size or --seq-len (truncation), or add --grad-checkpointing",
              file=sys.stderr)
        return EXIT_WONT_FIT
    return 0


def _deepspeed_args(args: argparse.Namespace) -> None:
    """``--deepspeed-config``: read it, and take its method and offload unless the flags name them."""
    from llmem_plugin.errors import ConfigError, LLMemError
    from llmem_plugin.methods.zero import deepspeed_method, read_deepspeed_config

    args.deepspeed_config = read_deepspeed_config(args.deepspeed_config)
    method, off_opt, off_par = deepspeed_method(args.deepspeed_config)
    from llmem_plugin.methods.zero import ZeroConfig

    try:  # its values, checked now (the method reads them again with the model's hidden size)
        ZeroConfig.from_deepspeed(args.deepspeed_config, stage=int(method[-1]), offload_optimizer=off_opt,
                                  offload_param=off_par, hidden_size=1)
    except (TypeError, ValueError) as e:
        if isinstance(e, LLMemError):
            raise
        raise ConfigError(f"--deepspeed-config: a zero_optimization value is not a number or switch "
                          f"({' '.join(str(e).split())[:120]}). HINT: check the file against DeepSpeed's config "
                          "docs") from None
    if args.method is None:
        args.method = method
    elif not args.method.startswith(method):
        raise ConfigError(f"--deepspeed-config is ZeRO {method[-1]}, --method is {args.method}. HINT: drop --method, "
                          "or pass a config of that stage")
    if args.offload is None and off_opt:
        args.offload = "params" if off_par else "optimizer"


_TP_METHODS = ("tp", "dp-tp", "fsdp-tp")

# Methods whose layout has a tensor-parallel degree of 2 or more: with
# --method all and no --tp, each is tried at every degree that divides a node.
_TP_DEGREE_METHODS = (*_TP_METHODS, "hybrid")

# Methods that model CPU offload (ZeRO's offload_optimizer/offload_param, FSDP2's CPUOffloadPolicy).
_OFFLOAD_METHODS = ("fsdp", "hsdp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload")


def _methods_command(args: argparse.Namespace) -> int:
    """``llmem estimate`` on a cluster (``--method``, ``--gpus``, ``--tp``, ``--nodes``, ``--offload``):
    each method's worst rank, or every method's with ``--method all``."""
    from llmem_plugin.errors import ConfigError
    from llmem_plugin.methods import Layout, method_names

    names = method_names()
    if args.method == "help":
        print("methods: " + ", ".join([*names, "all"]))
        return 0
    if args.method != "all" and args.method not in names:
        raise ConfigError(f"unknown method '{args.method}'; valid: {', '.join([*names, 'all'])}. "
                          "HINT: pass --method with one of them")
    num_gpus = 1 if args.gpus is None else args.gpus
    layout = Layout(num_gpus=num_gpus, num_nodes=args.nodes, tp=1 if args.tp is None else args.tp)
    options, pipeline = _method_options(args, names)
    choose_precision(args)
    gpu, wl = target_gpu(args), build_workload(args)
    if args.method != "single":
        from llmem_plugin.models.config import require_causal_lm

        # Said once for the command, not as every method's skip reason.
        require_causal_lm(args.model, f"--method {args.method}" if args.method != "all" else f"--gpus {num_gpus}",
                          wl.task)
    from llmem_plugin.device.host import resolve_host_memory

    host = resolve_host_memory(args.host_memory, gpu=gpu, gpus_per_node=layout.gpus_per_node)
    rows, skipped = _estimate_methods(args, _method_layouts(args, names, layout), wl, gpu, options, pipeline)
    if getattr(args, "plot", None) and rows:
        _plot_ranks(rows[0], gpu, args.plot)
    if getattr(args, "snapshot", None) and rows:
        _write_rank_snapshots(args, layout, wl, gpu, options)
    if not rows:
        # On several GPUs, 'single' refuses for the GPU count alone: another method's reason says more.
        name, why = next((x for x in skipped if x[0] != "single" or num_gpus == 1), skipped[0])
        raise ConfigError(f"no method applies to {num_gpus} GPU(s): {name}: {why}. "
                          "HINT: see `llmem estimate --method help`, or change --gpus/--tp/--offload")
    if args.json:
        emit_json(args, {"gpu": gpu.name, "capacity_bytes": gpu.capacity_bytes, "layout": layout.to_dict(),
                         "host_memory": host.to_dict(),
                         "methods": [r.to_dict() for r in rows],
                         "skipped": [{"method": n, "reason": why} for n, why in skipped]})
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_methods

        console = Console()
        show_recipe(args, console)
        render_methods(rows, skipped, gpu, console, host=host)
    return _methods_exit_code(args, rows, gpu, host, num_gpus)


def _method_options(args: argparse.Namespace, names: list[str]) -> tuple[dict, dict]:
    """(the methods' offload and DeepSpeed options, the pipeline methods' options), after refusing the
    options the named method does not take."""
    from llmem_plugin.errors import ConfigError

    options = {}
    if args.offload:
        options = {"offload_optimizer": True, "offload_param": args.offload == "params", "cpu_offload": True}
    if getattr(args, "deepspeed_config", None) is not None:
        options["config"] = args.deepspeed_config
    if args.sequence_parallel and args.method not in (*_TP_METHODS, "all"):
        raise ConfigError(f"--sequence-parallel needs a tensor-parallel method, not --method {args.method}. "
                          f"HINT: use one of {', '.join(_TP_METHODS)}")
    pipeline = {k: v for k, v in (("pipeline_degree", getattr(args, "pp", None)),
                                  ("microbatches", getattr(args, "microbatches", None)),
                                  ("stages_per_rank", getattr(args, "stages_per_rank", None)),
                                  ("split", _pp_split(getattr(args, "pp_split", None))),
                                  ("return_outputs", getattr(args, "return_outputs", None))) if v is not None}
    if pipeline and not args.method.startswith("pp"):
        flag = {"pipeline_degree": "--pp", "microbatches": "--microbatches", "stages_per_rank": "--stages-per-rank",
                "split": "--pp-split", "return_outputs": "--no-return-outputs"}
        raise ConfigError(f"{flag[next(iter(pipeline))]} applies to the pipeline methods, not --method "
                          f"{args.method}. HINT: use --method pp (or pp-gpipe, pp-interleaved, pp-zbv, pp-dualpipev, "
                          "pp-interleaved-zb)")
    if args.offload and args.method != "all" and args.method not in _OFFLOAD_METHODS:
        raise ConfigError(f"--offload is not modelled for --method {args.method}. HINT: use one of "
                          f"{', '.join(sorted(set(_OFFLOAD_METHODS) & set(names)))}")
    return options, pipeline


def _estimate_methods(args: argparse.Namespace, pairs, wl, gpu, options: dict, pipeline: dict):
    """(estimates, skipped (name, reason)) of each (method, layout) pair, run side by side over the cores
    (:mod:`llmem_plugin.methods.parallel`); with ``--method all`` a method that refuses is skipped with its
    reason, a named one's refusal is raised."""
    from llmem_plugin import errors
    from llmem_plugin.methods.parallel import cores, forked_map

    tasks, labels, skipped = [], [], []
    for name, lay in pairs:
        if args.offload and name not in _OFFLOAD_METHODS:
            skipped.append((name, "no CPU offload"))
            continue
        extra = {"sequence_parallel": True} if args.sequence_parallel and name in _TP_METHODS else {}
        if name.startswith("pp"):
            extra.update(pipeline)
            extra["fast"] = args.fast  # per-stage depth extrapolation (llmem_plugin.methods.pp.method)
        elif not args.fast:  # the full trace's figures, from built streams where the method proves them exact
            extra["stream_synthesis"] = not args.full
        tasks.append((name, args.model, wl, lay, gpu, args.alloc_conf, args.torch_version, {**options, **extra}))
        labels.append(name if lay.tp == 1 else f"{name} tp{lay.tp}")
    rows = []
    for label, out in zip(labels, forked_map(_method_task, tasks, workers=cores()), strict=True):
        if isinstance(out, _Refusal):
            if args.method != "all":
                raise getattr(errors, out.kind, errors.ConfigError)(out.message)
            skipped.append((label, out.message.split(". HINT")[0]))
            continue
        rows.append(out)
    return rows, skipped


class _Refusal(NamedTuple):
    """A method's refusal (an :class:`~llmem_plugin.errors.LLMemError`), as a value that crosses processes."""

    kind: str
    message: str


def _method_task(task: tuple):
    """One method's estimate, or its refusal (in a forked worker, or here)."""
    from llmem_plugin.errors import LLMemError
    from llmem_plugin.methods import estimate_method

    name, model, wl, lay, gpu, alloc_conf, torch_version, kwargs = task
    try:
        return estimate_method(name, model, wl, layout=lay, gpu=gpu, alloc_conf=alloc_conf,
                               torch_version=torch_version, **kwargs)
    except LLMemError as e:
        return _Refusal(type(e).__name__, str(e))


def _methods_exit_code(args: argparse.Namespace, rows, gpu, host, num_gpus: int) -> int:
    """0 when some method fits both the GPUs and the node's host RAM; else ``EXIT_WONT_FIT``, said on stderr."""
    if not any(all(r.fits for r in est.ranks) for est in rows):
        what = f"--method {args.method} does not fit" if args.method != "all" else "no method fits"
        print(f"llmem: {what} {num_gpus} x {gpu.name} ({_size(gpu.capacity_bytes)} each); exit code "
              f"{EXIT_WONT_FIT}. HINT: `llmem plan` searches micro-batch, checkpointing and offload for a fit",
              file=sys.stderr)
        return EXIT_WONT_FIT
    on_gpu = [est for est in rows if all(r.fits for r in est.ranks)]  # not empty here
    if not any(est.host_total_bytes_per_node <= host.node_bytes for est in on_gpu):
        print(_host_misfit(min(est.host_total_bytes_per_node for est in on_gpu), host.node_bytes, host.source),
              file=sys.stderr)
        return EXIT_WONT_FIT
    return 0


def _pp_split(text: str | None) -> str | list[int] | None:
    """``--pp-split``: a framework's name, or comma-separated layers per stage."""
    from llmem_plugin.errors import ConfigError

    if text is None or text in ("torchtitan", "colossalai"):
        return text
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--pp-split {text!r} is not 'torchtitan', 'colossalai' or layers per stage. HINT: pass "
                          "e.g. --pp-split 8,9,8,7") from None
    return counts


def _method_layouts(args: argparse.Namespace, names: list[str], layout):
    """(method, layout) pairs to estimate: the user's --tp, or for 'all' without
    --tp every tensor-parallel degree > 1 that divides a node's GPUs for the TP methods."""
    import dataclasses

    if args.method != "all":
        return [(args.method, layout)]
    if args.tp is not None:
        return [(name, layout) for name in names]
    degrees = [d for d in range(2, min(layout.gpus_per_node, MAX_TP) + 1) if layout.gpus_per_node % d == 0]
    pairs = []
    for name in names:
        if name.startswith("pp"):
            continue  # the pipeline methods trace many microbatches per rank: named with --method only
        if name in _TP_DEGREE_METHODS:
            pairs += [(name, dataclasses.replace(layout, tp=d)) for d in degrees]
            if not degrees:
                pairs.append((name, layout))  # refused with its reason (one GPU per node)
        else:
            pairs.append((name, layout))
    return pairs


def _write_views(est, args: argparse.Namespace) -> None:
    """``--snapshot`` and ``--html``: the predicted snapshot, and the report made from it."""
    from llmem_plugin.snapshot.predict import snapshot_of, write_snapshot

    snap = snapshot_of(est)
    if args.snapshot:
        write_snapshot(snap, args.snapshot)
        print(f"wrote the predicted snapshot to {args.snapshot}", file=sys.stderr)
    if args.html:
        from llmem_plugin.cli.html import estimate_page, write_page

        write_page(estimate_page(est, snap), args.html)
        print(f"wrote the report to {args.html}", file=sys.stderr)


def _write_rank_snapshots(args: argparse.Namespace, layout, wl, gpu, options: dict) -> None:
    """``--snapshot FILE`` with one ``--method``: ``FILE`` with ``-rank{R}`` before its suffix, per traced rank
    (the method's full trace, run again for its allocator history)."""
    from pathlib import Path

    from llmem_plugin.snapshot.predict import method_snapshots, write_snapshot

    extra = {"sequence_parallel": True} if args.sequence_parallel and args.method in _TP_METHODS else {}
    path = Path(args.snapshot)
    snaps = method_snapshots(args.method, args.model, wl, layout=layout, gpu=gpu, alloc_conf=args.alloc_conf,
                             torch_version=args.torch_version, **options, **extra)
    for rank, snap in sorted(snaps.items()):
        out = write_snapshot(snap, path.with_name(f"{path.stem}-rank{rank}{path.suffix}"))
        print(f"wrote rank {rank}'s predicted snapshot to {out}", file=sys.stderr)


def _plot_ranks(est, gpu, path: str) -> None:
    """One bar per reported rank of one method's estimate (a pipeline's ranks differ), by segment."""
    from llmem_plugin.cli.plot import plot_plan
    from llmem_plugin.planner.candidates import rank_segments

    worst = max(range(len(est.ranks)), key=lambda i: est.ranks[i].device_total_bytes)
    plot_plan([(f"rank {r.rank}", rank_segments(r)) for r in est.ranks], capacity_bytes=gpu.capacity_bytes,
              margin=0.0, chosen=worst, path=path,
              title=f"{est.method} on {est.layout.num_gpus} x {gpu.name}: each rank's peak (framed: the worst)")


def _host_misfit(need: int, capacity: int, source: str) -> str:
    """The stderr line for a job whose host (CPU) RAM per node is over the node's."""
    return (f"llmem: host memory does not fit: {need / 2**30:.1f} GiB of host (CPU) RAM per node needed, "
            f"{capacity / 2**30:.1f} GiB there ({source}); exit code {EXIT_WONT_FIT}. HINT: give the node's RAM "
            "with --host-memory, spread the job over more nodes, or drop CPU offload")


def _size(nbytes: int) -> str:
    """``nbytes`` in GiB, or in MiB below one GiB, for the one-line verdicts."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
