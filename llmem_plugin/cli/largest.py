"""``llmem max``: the largest micro-batch, the longest sequence, or a table of both, that fit the GPU.

The job is given as ``llmem estimate`` takes it (flags or ``--config``); the
search is :mod:`llmem_plugin.planner.largest`'s. The points it estimated are
printed as the memory curve, with the answer and the next value up (which
does not fit). Exit codes as ``estimate``: 3 when even the smallest value
does not fit.
"""

from __future__ import annotations

import argparse
import sys

from llmem_plugin.cli.config import add_config_args, emit_json, show_recipe
from llmem_plugin.cli.estimate import _deepspeed_args, _method_options, _TP_METHODS, add_method_args
from llmem_plugin.cli.options import (
    EXIT_WONT_FIT,
    add_cache_arg,
    add_target_args,
    add_workload_args,
    build_workload,
    choose_precision,
    csv_list,
    target_gpu,
)

__all__ = ["max_command", "max_parser"]

_WHAT = {"batch-size": "batch_size", "seq-len": "seq_len", "table": "table"}
# The lengths of `llmem max table` without --at-lens: powers of two around the lengths the bundled recipes
# train at (examples/recipes: Axolotl's sequence_len, torchtune's max_seq_len, LLaMA-Factory's cutoff_len
# are 2048 and 4096).
_TABLE_LENS = (512, 1024, 2048, 4096, 8192)


def max_parser(sub) -> None:
    """``llmem max WHAT``: the job as ``estimate`` takes it, plus what to maximise and how much to keep free."""
    p = sub.add_parser("max", help="the largest micro-batch or the longest sequence that fits the GPU")
    p.add_argument("what", choices=tuple(_WHAT),
                   help="batch-size: the largest --batch-size at --seq-len; seq-len: the longest --seq-len at "
                        "--batch-size; table: the largest batch at each of --at-lens")
    add_config_args(p)
    add_workload_args(p)
    add_target_args(p)
    add_method_args(p, one=True)
    g = p.add_argument_group("search")
    g.add_argument("--headroom", default=None, metavar="FRACTION|SIZE",
                   help="memory kept free: a fraction of the GPU's (0.05) or a size (2GiB); default 0.04, the "
                        "largest device-total error the accuracy targets allow (docs/accuracy.md)")
    g.add_argument("--multiple-of", type=int, default=1, metavar="N",
                   help="search only multiples of N (e.g. 64 for sequence lengths; default 1)")
    g.add_argument("--limit", type=int, default=None, metavar="N",
                   help="the largest value searched (default: batch 65536; length: the model's context length)")
    g.add_argument("--at-lens", default=None, metavar="L1,L2,...",
                   help="table: the sequence lengths, each replacing --seq-len (default 512,1024,2048,4096,8192 "
                        "up to the model's context length)")
    g.add_argument("--json", action="store_true", help="print the result as JSON")
    add_cache_arg(g)
    g.add_argument("--plot", default=None, metavar="FILE",
                   help="draw the memory curve the search estimated to FILE (png, svg, pdf)")
    p.set_defaults(func=max_command)


def max_command(args: argparse.Namespace) -> int:
    """Search the largest value that fits and print the curve.

    Returns:
        0, or ``EXIT_WONT_FIT`` when even the smallest value does not fit.
    """
    from llmem_plugin.errors import ConfigError, WontFitError
    from llmem_plugin.planner import largest

    if args.headroom is not None:  # refused before anything is built: the GPU's capacity is the catalog's
        largest.headroom_bytes(args.headroom, target_gpu(args).capacity_bytes)
    if args.deepspeed_config is not None:
        _deepspeed_args(args)
    kwargs = _search_kwargs(args)
    what = _WHAT[args.what]
    try:
        if what == "table":
            if args.limit is not None:
                raise ConfigError("--limit bounds the value searched; `llmem max table` searches the batch at "
                                  "each of --at-lens. HINT: drop --limit, or use `llmem max batch-size`")
            wl = kwargs.pop("workload")
            results = largest.max_batch_table(args.model, wl, seq_lens=_table_lens(args, wl), **kwargs)
        else:
            fn = largest.max_batch_size if what == "batch_size" else largest.max_seq_len
            results = [fn(args.model, kwargs.pop("workload"), **kwargs)]
    except WontFitError as e:
        _show(args, [e.report])
        raise
    if args.plot:
        from llmem_plugin.cli.plot import plot_curve

        plot_curve(results, args.plot)
    _show(args, results)
    if all(r.value == 0 for r in results):
        print(f"llmem: even one row does not fit at any of the lengths; exit code {EXIT_WONT_FIT}. HINT: `llmem "
              "plan` searches methods, checkpointing and offload for a fit", file=sys.stderr)
        return EXIT_WONT_FIT
    return 0


def _search_kwargs(args: argparse.Namespace) -> dict:
    """The keywords of :func:`~llmem_plugin.planner.largest.max_batch_size` from the options."""
    from llmem_plugin.errors import ConfigError
    from llmem_plugin.methods import Layout, method_names
    from llmem_plugin.planner.largest import DEFAULT_HEADROOM

    cluster = args.gpus not in (None, 1) or args.tp not in (None, 1) or args.nodes != 1 or args.offload
    if args.method in ("all", "help") or (args.method is None and cluster):
        given = f"--method {args.method}" if args.method else "--gpus/--tp/--nodes/--offload without --method"
        raise ConfigError(f"`llmem max` searches one method's worst rank, and {given} names none. HINT: pass "
                          f"--method NAME, one of {', '.join(method_names())}")
    method = args.method or "single"
    if method not in method_names():
        raise ConfigError(f"unknown method '{method}'; valid: {', '.join(method_names())}. HINT: pass --method "
                          "with one of them")
    if args.multiple_of < 1:
        raise ConfigError(f"--multiple-of {args.multiple_of} must be 1 or more. HINT: pass --multiple-of 64")
    if args.steps is not None and args.seq_lens is None:
        raise ConfigError(f"--steps {args.steps} sets how many steps of varying length are replayed. HINT: add "
                          "--seq-lens (the sample lengths), or drop --steps")
    if method == "single" and cluster:
        raise ConfigError(f"--method single is one GPU, but --gpus {args.gpus or 1} --nodes {args.nodes} --tp "
                          f"{args.tp or 1}{' --offload ' + args.offload if args.offload else ''} name more. HINT: "
                          "name the distributed method (--method ddp, fsdp, zero3, ...), or drop them")
    if args.at_lens is not None and args.what != "table":
        raise ConfigError(f"--at-lens lists the lengths of `llmem max table`, not of `llmem max {args.what}`. HINT: "
                          "drop --at-lens, or run `llmem max table`")
    args.method = method
    options, pipeline = _method_options(args, method_names())
    if args.sequence_parallel and method in _TP_METHODS:
        options["sequence_parallel"] = True
    options.update(pipeline)
    choose_precision(args)
    layout = Layout(num_gpus=args.gpus or 1, num_nodes=args.nodes, tp=args.tp or 1)
    out = {"workload": build_workload(args), "gpu": target_gpu(args), "method": method, "layout": layout,
           "options": options, "lengths": args.seq_lens, "steps": args.steps, "multiple_of": args.multiple_of,
           "alloc_conf": args.alloc_conf, "torch_version": args.torch_version,
           "headroom": DEFAULT_HEADROOM if args.headroom is None else args.headroom}
    if args.limit is not None:
        out["limit"] = args.limit
    return out


def _table_lens(args: argparse.Namespace, workload) -> list[int]:
    """``--at-lens``, or :data:`_TABLE_LENS` up to the model's context length."""
    from llmem_plugin.errors import ConfigError

    if args.at_lens is None:
        from llmem_plugin.planner.largest import context_length

        longest, _ = context_length(args.model, workload)
        return [n for n in _TABLE_LENS if n <= longest] or [longest]
    lens = csv_list(args.at_lens, int)
    if not lens or any(n < 1 for n in lens):
        raise ConfigError(f"--at-lens {args.at_lens!r} must list positive lengths. HINT: --at-lens 1024,2048,4096")
    return lens


def _show(args: argparse.Namespace, results: list) -> None:
    """The results as JSON, or the curve of each and its answer."""
    if args.json:
        emit_json(args, {"results": [r.to_dict() for r in results]})
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    show_recipe(args, console)
    for r in results:
        flag = "--batch-size" if r.what == "batch_size" else "--seq-len"
        other = f"--seq-len {r.fixed}" if r.what == "batch_size" else f"--batch-size {r.fixed}"
        where = r.gpu if r.method == "single" else f"{r.method}'s worst rank on {r.num_gpus} x {r.gpu}"
        t = Table(title=f"{flag} at {other}: {where}, limit {_gib(r.limit_bytes)} "
                        f"({_gib(r.capacity_bytes)} less {_gib(r.headroom_bytes)} headroom)")
        for col in ("batch" if r.what == "batch_size" else "length", "allocated", "reserved", "device total",
                    "of limit", "fits", "path"):
            t.add_column(col, justify="right" if col not in ("fits", "path") else "left")
        for p in r.points:
            mark = " <" if p.exact and p.value == r.value else ""
            t.add_row(f"{p.value}{mark}", _gib(p.peak_allocated_bytes), _gib(p.peak_reserved_bytes),
                      _gib(p.device_total_bytes), f"{p.device_total_bytes / r.limit_bytes:.1%}",
                      "yes" if p.fits else "no", "exact" if p.exact else "fast")
        console.print(t)
        console.print(_verdict(r, flag))
        if any(not p.exact for p in r.points):
            console.print("path: exact = the full trace's figures; fast = per-layer extrapolation, used only to "
                          "bracket the answer")


def _verdict(r, flag: str) -> str:
    if r.value == 0:
        return f"nothing fits: even {flag} {r.multiple_of} needs more than the limit"
    if r.next_value is None:
        return f"largest {flag}: {r.value} (not searched further: {r.capped_by})"
    return f"largest {flag}: {r.value} ({r.next_value} does not fit); {len(r.points)} estimates, {r.seconds:.1f} s"


def _gib(nbytes: int) -> str:
    from llmem_plugin.summary import gib

    return f"{gib(nbytes)} GiB"
