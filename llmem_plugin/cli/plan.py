"""``llmem plan``: the fastest fine-tuning method, micro-batch, checkpointing and offload that fit the GPUs.

The options become :func:`llmem_plugin.planner.search.plan`'s arguments; the
plan is printed as a table of candidates (or JSON), and exits
``EXIT_WONT_FIT`` when nothing fits.
"""

from __future__ import annotations

import argparse
import sys

from llmem_plugin.cli.config import add_config_args, emit_json, show_recipe
from llmem_plugin.cli.options import (
    add_cache_arg,
    EFFICIENCY,
    EXIT_WONT_FIT,
    GLOBAL_BATCH,
    GPUS,
    INTER_NODE_GBPS,
    MARGIN,
    MAX_PIPELINES,
    MICRO_BATCH,
    NODES,
    SEQ_LEN,
    TP,
    add_gpu_args,
    add_host_arg,
    add_step_args,
    choose_precision,
    csv_list,
    lora_spec,
    optimizer_name,
    technique_fields,
)

__all__ = ["plan_command", "plan_parser"]


def plan_parser(sub) -> None:
    """``llmem plan``: the model and batch, the cluster, what is searched, and the step-time model."""
    p = sub.add_parser("plan", help="pick the fastest fine-tuning method that fits the GPUs, or say why none does")
    add_config_args(p)
    g = p.add_argument_group("model and batch")
    g.add_argument("--model", required=True, help="catalog name, config.json path, or cached Hub id")
    g.add_argument("--seq-len", type=SEQ_LEN, default=2048, help="tokens per sequence (default 2048)")
    g.add_argument("--global-batch", type=GLOBAL_BATCH, default=None,
                   help="sequences per optimizer step over all GPUs (default 8 per GPU; with --config, the file's "
                        "micro-batch x accumulation per GPU)")
    g.add_argument("--runner", default="torch", choices=("torch", "hf-trainer", "lightning", "plain-loop"),
                   help="the training loop (as for estimate; default torch)")
    g = p.add_argument_group("cluster", "the GPUs the job gets")
    g.add_argument("--gpus", type=GPUS, default=None, help="GPUs over all nodes (default: this machine's)")
    g.add_argument("--nodes", type=NODES, default=1, help="nodes (default 1)")
    add_host_arg(g)
    add_cache_arg(g)
    add_gpu_args(p)
    g = p.add_argument_group("search", "what the planner tries; a pinned setting is not searched")
    g.add_argument("--margin", type=MARGIN, default=None,
                   help="fraction of GPU memory kept free (default 0.05)")
    g.add_argument("--methods", default=None,
                   help="comma-separated methods to consider (default: all but pp-interleaved, searched only when "
                        "named)")
    g.add_argument("--tp", default=None, help="comma-separated tensor-parallel degrees (default: all that fit a node)")
    g.add_argument("--micro-batch", type=MICRO_BATCH, default=None, help="pin the micro-batch (default: searched)")
    g.add_argument("--grad-checkpointing", choices=("auto", "on", "off"), default="auto",
                   help="search checkpointing (auto, default) or pin it")
    g.add_argument("--no-verify", action="store_true", help="skip the full trace of the choice (screen only)")
    g.add_argument("--no-prune", action="store_true",
                   help="screen every candidate, also those whose step-time bound cannot win (the full table)")
    g.add_argument("--max-pipelines", type=MAX_PIPELINES, default=None,
                   help="pipeline configurations to trace at most, best step-time bounds first (default 1; each "
                        "costs minutes on a large model; --no-prune traces all)")
    add_step_args(p)
    g = p.add_argument_group("allocator")
    g.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF to simulate (default: the environment's)")
    g = p.add_argument_group("step-time model", "how candidates are ranked")
    g.add_argument("--efficiency", type=EFFICIENCY, default=None,
                   help="model FLOPs utilisation of the step-time model (default 0.40)")
    g.add_argument("--inter-node-gbps", type=INTER_NODE_GBPS,
                   default=None, help="network GB/s per GPU between nodes (default 50: 400 Gb/s InfiniBand)")
    g = p.add_argument_group("output")
    g.add_argument("--all", action="store_true", help="list every candidate")
    g.add_argument("--plot", default=None, metavar="FILE", help="draw the candidates' memory to FILE (png, svg, pdf)")
    g.add_argument("--html", default=None, metavar="FILE",
                   help="write a self-contained report (the verdict, each candidate's memory per GPU, the sortable "
                        "candidates table) to FILE; needs the [report] extra")
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=plan_command)


def _plan_target(args: argparse.Namespace) -> tuple[str | None, int]:
    """(GPU name, GPU count): the flags', else this machine's."""
    from llmem_plugin.planner.search import gpus_on_this_machine

    if args.gpu is None and args.gpus is None:
        return gpus_on_this_machine()
    gpus = args.gpus if args.gpus is not None else 1
    return args.gpu, gpus


def plan_command(args: argparse.Namespace) -> int:
    """Search the methods, micro-batch, checkpointing and offload for the fastest plan that fits, and print it.

    Returns:
        0 when a plan fits, ``EXIT_WONT_FIT`` when none does (the plan is still printed).
    """
    from llmem_plugin.errors import WontFitError
    from llmem_plugin.planner.search import plan

    kw = _plan_kwargs(args)
    try:
        result, code = plan(args.model, **kw), 0
    except WontFitError as e:
        result, code = e.plan, EXIT_WONT_FIT
        if not args.json:
            print(f"llmem: {e}", file=sys.stderr)
    if args.plot:
        _plot_plan(result, args.plot, show_all=args.all)
    if args.html:
        from llmem_plugin.cli.html import plan_page, write_page

        write_page(plan_page(result), args.html)
        print(f"wrote the report to {args.html}", file=sys.stderr)
    if args.json:
        emit_json(args, result.to_dict())
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_plan

        console = Console()
        show_recipe(args, console)
        render_plan(result, console, show_all=args.all)
    return code


def _plan_kwargs(args: argparse.Namespace) -> dict:
    """:func:`~llmem_plugin.planner.search.plan`'s keyword arguments from the options, after refusing those
    that contradict each other or the cluster."""
    from llmem_plugin.device.gpus import parse_memory
    from llmem_plugin.errors import ConfigError
    from llmem_plugin.planner.search import DEFAULT_MARGIN
    from llmem_plugin.workload import Workload

    gpu_memory = parse_memory(args.gpu_memory) if args.gpu_memory else None
    methods, tps = csv_list(args.methods), csv_list(args.tp, TP)
    if args.reference_model and args.loss == "trl-fused":
        from llmem_plugin.errors import UnsupportedError
        from llmem_plugin.planner.search import DPO_NOT_SEARCHED

        raise UnsupportedError(DPO_NOT_SEARCHED)
    choose_precision(args)
    wl = Workload(seq_len=args.seq_len, precision=args.precision, optimizer=optimizer_name(args), lora=lora_spec(args),
                  attn_implementation=args.attn, runner=args.runner, **technique_fields(args))
    gpu, n = _plan_target(args)
    if args.global_batch is None and args.recipe is not None:
        from llmem_plugin.recipes import global_batch

        args.global_batch = global_batch(args.recipe, n)
    if n % args.nodes:
        raise ConfigError(f"--nodes {args.nodes} must divide the {n} GPUs (every node holds as many). "
                          "HINT: pass a --gpus that is a multiple of --nodes")
    bad_tps = [t for t in tps or () if (n // args.nodes) % t]
    if bad_tps:
        raise ConfigError(f"--tp {','.join(map(str, bad_tps))} must divide the {n // args.nodes} GPUs of a node: a "
                          "tensor-parallel group stays inside one node. HINT: pass degrees that divide it")
    kw = {}
    if args.efficiency is not None:
        kw["efficiency"] = args.efficiency
    if args.max_pipelines is not None:
        kw["max_pipelines"] = args.max_pipelines
    if sys.stderr.isatty():  # a terminal sees what a long search is doing; pipes and logs keep one line
        kw["progress"] = lambda line: print(f"llmem: {line}", file=sys.stderr, flush=True)
    gc = {"auto": None, "on": True, "off": False}[args.grad_checkpointing]
    return dict(
        gpu=gpu or "h100-sxm", num_gpus=n, num_nodes=args.nodes, workload=wl,
        global_batch=args.global_batch, margin=DEFAULT_MARGIN if args.margin is None else args.margin,
        methods=methods, tps=tps, micro_batch=args.micro_batch,
        grad_checkpointing=gc, gpu_memory=gpu_memory,
        alloc_conf=args.alloc_conf, inter_node_gbps=args.inter_node_gbps, verify=not args.no_verify,
        prune=not args.no_prune, host_memory=args.host_memory, **kw,
    )


def _plot_plan(result, path: str, *, show_all: bool) -> None:
    """The rows the table lists, each one bar of its memory by segment (framed: the choice)."""
    from llmem_plugin.cli.plot import plot_plan
    from llmem_plugin.cli.report import plan_rows

    rows = plan_rows(result, show_all)
    chosen = next((i for i, c in enumerate(rows) if c is result.choice), None)
    plot_plan([(c.label(), c.segments) for c in rows], capacity_bytes=result.capacity_bytes,
              margin=result.margin, chosen=chosen, path=path,
              title=f"{result.model} on {result.layout.num_gpus} x {result.gpu.name}")
