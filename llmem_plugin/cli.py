"""The ``llmem`` command line.

Each command is a parser function plus a command function. Exit codes: 0 on
success, 2 for bad input (one line on stderr, no traceback), 3 when nothing
fits (``llmem plan``: the report is still printed).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["EXIT_BAD_INPUT", "EXIT_WONT_FIT", "main"]

EXIT_BAD_INPUT = 2
EXIT_WONT_FIT = 3


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="catalog name, config.json path, or cached Hub id")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--batch-size", type=int, default=1, help="micro-batch size per GPU (default 1)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default 1)")
    p.add_argument("--grad-checkpointing", action="store_true", help="non-reentrant gradient checkpointing")
    _add_step_args(p)


def _add_step_args(p: argparse.ArgumentParser) -> None:
    """Workload settings the planner keeps as the user set them."""
    p.add_argument("--precision", default="bf16-mixed", help="fp32, bf16-mixed (default), fp16-mixed or bf16")
    p.add_argument("--optimizer", default="adamw",
                   help="adamw (foreach, default), adamw-fused, adamw-forloop, sgd, adafactor, and bitsandbytes' "
                        "adamw8bit, paged-adamw or paged-adamw8bit")
    p.add_argument("--attn", default="auto",
                   help="attention implementation: auto (transformers' default: sdpa where supported), sdpa, eager "
                        "or flash_attention_2")
    p.add_argument("--quantize", default=None, metavar="{nf4,fp4,int8}",
                   help="bitsandbytes weights for the frozen base model (QLoRA; needs --lora-rank)")
    p.add_argument("--double-quant", action="store_true", help="quantize the 4-bit statistics too (nf4/fp4)")
    p.add_argument("--loss", default="hf", metavar="{hf,liger,chunked}",
                   help="loss: hf (the model's own, fp32 logits; default), liger (fused linear cross-entropy) "
                        "or chunked (torchtune's chunked-output cross-entropy)")
    p.add_argument("--loss-chunks", type=int, default=8, help="chunks for --loss chunked (default 8)")
    p.add_argument("--logits-to-keep", type=int, default=0,
                   help="compute logits and loss for only the last N tokens (default 0: all)")
    p.add_argument("--offload-activations", nargs="?", const="streamed", default=None,
                   metavar="{streamed,save-on-cpu}",
                   help="offload saved activations to pinned host memory: streamed (TRL/torchtune "
                        "OffloadActivations, the default when given bare) or save-on-cpu (torch.autograd.graph)")
    p.add_argument("--reference-model", action="store_true",
                   help="also run a frozen reference model's forward each step, as DPO does")
    p.add_argument("--lora-rank", type=int, default=None, help="enable LoRA with this rank")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    p.add_argument("--lora-targets", default=None,
                   help="comma-separated module names (default q_proj,k_proj,v_proj,o_proj), or all-linear")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout (default 0)")


def _add_gpu_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default=None, help="GPU from `llmem gpus` (default h100-sxm)")
    p.add_argument("--gpu-memory", default=None,
                   help="override the GPU's capacity, e.g. 80GiB, 40GB, 81920MiB, or a number of GiB")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    _add_gpu_args(p)
    p.add_argument("--alloc-conf", default=None,
                   help="PYTORCH_CUDA_ALLOC_CONF to simulate (default: the environment's)")
    p.add_argument("--torch-version", default=None,
                   help="torch version the job runs, for version-dependent overheads (default: installed)")


def _gpu(args: argparse.Namespace):
    from llmem_plugin.gpus import resolve_gpu

    return resolve_gpu(args.gpu, args.gpu_memory)


def _lora(args: argparse.Namespace):
    from llmem_plugin.workload import LoraSpec

    lora = None
    if args.lora_rank is not None:
        kw = {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout}
        if args.lora_targets:
            kw["target_modules"] = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        lora = LoraSpec(**kw)
    elif args.lora_targets or args.lora_alpha is not None:
        from llmem_plugin.errors import ConfigError

        raise ConfigError("--lora-targets/--lora-alpha need --lora-rank. HINT: add --lora-rank 16")
    return lora


def _workload(args: argparse.Namespace):
    from llmem_plugin.workload import Workload

    lora = _lora(args)
    return Workload(
        seq_len=args.seq_len,
        micro_batch_size=args.batch_size,
        grad_accum_steps=args.grad_accum,
        precision=args.precision,
        optimizer=args.optimizer,
        grad_checkpointing=args.grad_checkpointing,
        lora=lora,
        attn_implementation=args.attn,
        **_technique_fields(args),
    )


def _technique_fields(args: argparse.Namespace) -> dict:
    """The low-memory technique settings (``_add_step_args``) as Workload fields."""
    return {
        "quantize": args.quantize,
        "double_quant": args.double_quant,
        "loss": args.loss,
        "loss_chunks": args.loss_chunks,
        "logits_to_keep": args.logits_to_keep,
        "offload_activations": args.offload_activations,
        "reference_model": args.reference_model,
    }


def _parser_estimate(sub) -> None:
    p = sub.add_parser("estimate", help="peak GPU memory of one fine-tuning step on one GPU")
    _add_workload_args(p)
    _add_target_args(p)
    p.add_argument("--method", default=None,
                   help="distributed method (`--method help` lists them), or 'all' for every one that "
                        "applies (the default when --gpus/--tp/--nodes/--offload is given); default: one GPU")
    p.add_argument("--gpus", type=int, default=None, help="world size: GPUs over all nodes (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree, inside a node (default 1)")
    p.add_argument("--offload", choices=("optimizer", "params"), default=None,
                   help="CPU offload: optimizer states, or parameters too (ZeRO, FSDP)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallel for the tensor-parallel methods (tp, dp-tp, fsdp-tp)")
    p.add_argument("--fast", action="store_true", help="trace a few layers and extrapolate to full depth")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="draw allocated and reserved memory over the traced step to FILE (png, svg, pdf)")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(func=_cmd_estimate)


def _cmd_methods(args: argparse.Namespace) -> int:
    from llmem_plugin.errors import ConfigError, LLMemError
    from llmem_plugin.methods import Layout, estimate_method, method_names

    layout = Layout(num_gpus=1 if args.gpus is None else args.gpus, num_nodes=args.nodes, tp=args.tp)
    names = method_names()
    if args.method == "help":
        print("methods: " + ", ".join([*names, "all"]))
        return 0
    if args.method != "all" and args.method not in names:
        raise ConfigError(f"unknown method '{args.method}'; valid: {', '.join([*names, 'all'])}. "
                          "HINT: pass --method with one of them")
    options = {}
    if args.offload:
        options = {"offload_optimizer": True, "offload_param": args.offload == "params", "cpu_offload": True}
    if args.sequence_parallel and args.method not in (*_TP_METHODS, "all"):
        raise ConfigError(f"--sequence-parallel needs a tensor-parallel method, not --method {args.method}. "
                          f"HINT: use one of {', '.join(_TP_METHODS)}")
    gpu, wl = _gpu(args), _workload(args)
    rows, skipped = [], []
    for name in names if args.method == "all" else [args.method]:
        if args.offload and name not in _OFFLOAD_METHODS:
            if args.method != "all":
                raise ConfigError(f"--offload is not modelled for --method {name}. HINT: use one of "
                                  f"{', '.join(sorted(set(_OFFLOAD_METHODS) & set(names)))}")
            skipped.append((name, "no CPU offload"))
            continue
        extra = {"sequence_parallel": True} if args.sequence_parallel and name in _TP_METHODS else {}
        try:
            est = estimate_method(name, args.model, wl, layout=layout, gpu=gpu, alloc_conf=args.alloc_conf,
                                  torch_version=args.torch_version, **options, **extra)
        except LLMemError as e:
            if args.method != "all":
                raise
            skipped.append((name, str(e).split(". HINT")[0]))
            continue
        rows.append(est)
    if args.json:
        print(json.dumps({"gpu": gpu.name, "capacity_bytes": gpu.capacity_bytes, "layout": layout.to_dict(),
                          "methods": [r.to_dict() for r in rows],
                          "skipped": [{"method": n, "reason": why} for n, why in skipped]}))
    else:
        from rich.console import Console

        from llmem_plugin.report import render_methods

        render_methods(rows, skipped, gpu, Console())
    return 0


_TP_METHODS = ("tp", "dp-tp", "fsdp-tp")
# Methods that model CPU offload (ZeRO's offload_optimizer/offload_param, FSDP2's CPUOffloadPolicy).
_OFFLOAD_METHODS = ("fsdp", "hsdp", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload")


def _cmd_estimate(args: argparse.Namespace) -> int:
    from llmem_plugin.estimate import estimate

    if args.method is not None or args.gpus not in (None, 1) or args.tp != 1 or args.nodes != 1 or args.offload:
        if args.plot:
            from llmem_plugin.errors import ConfigError

            raise ConfigError("--plot draws the single-GPU step. HINT: drop --method/--gpus/--tp/--nodes/--offload, "
                              "or use `llmem plan --plot` for the methods")
        if args.method is None:  # a cluster without a method: compare them all
            args.method = "all"
        return _cmd_methods(args)

    if args.plot and args.fast:
        from llmem_plugin.errors import ConfigError

        raise ConfigError("--plot needs the full trace's timeline, which --fast does not keep. HINT: drop --fast")
    est = estimate(args.model, _workload(args), fast=args.fast, gpu=_gpu(args), alloc_conf=args.alloc_conf,
                   torch_version=args.torch_version)
    if args.plot:
        from llmem_plugin.plot import plot_estimate

        plot_estimate(est, args.plot)
    if args.json:
        print(json.dumps(est.to_dict()))
    else:
        from rich.console import Console

        from llmem_plugin.report import render_estimate

        render_estimate(est, Console())
    return 0


def _parser_plan(sub) -> None:
    p = sub.add_parser("plan", help="pick the fastest fine-tuning method that fits the GPUs, or say why none does")
    p.add_argument("--model", required=True, help="catalog name, config.json path, or cached Hub id")
    p.add_argument("--gpus", type=int, default=None, help="GPUs over all nodes (default: this machine's)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    _add_gpu_args(p)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step over all GPUs (default 8 per GPU)")
    p.add_argument("--margin", type=float, default=None, help="fraction of GPU memory kept free (default 0.05)")
    p.add_argument("--methods", default=None, help="comma-separated methods to consider (default: all)")
    p.add_argument("--tp", default=None, help="comma-separated tensor-parallel degrees (default: all that fit a node)")
    p.add_argument("--micro-batch", type=int, default=None, help="pin the micro-batch (default: searched)")
    p.add_argument("--grad-checkpointing", choices=("auto", "on", "off"), default="auto",
                   help="search checkpointing (auto, default) or pin it")
    _add_step_args(p)
    p.add_argument("--alloc-conf", default=None, help="PYTORCH_CUDA_ALLOC_CONF to simulate (default: the environment's)")
    p.add_argument("--efficiency", type=float, default=None,
                   help="model FLOPs utilisation of the step-time model (default 0.40)")
    p.add_argument("--inter-node-gbps", type=float, default=None,
                   help="network GB/s per GPU between nodes (default 50: 400 Gb/s InfiniBand)")
    p.add_argument("--no-verify", action="store_true", help="skip the full trace of the choice (screen only)")
    p.add_argument("--no-prune", action="store_true",
                   help="screen every candidate, also those whose step-time bound cannot win (the full table)")
    p.add_argument("--all", action="store_true", help="list every candidate")
    p.add_argument("--plot", default=None, metavar="FILE", help="draw the candidates' memory to FILE (png, svg, pdf)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)


def _plan_target(args: argparse.Namespace) -> tuple[str | None, int]:
    """(GPU name, GPU count): the flags', else this machine's."""
    from llmem_plugin.planner import gpus_on_this_machine

    if args.gpu is None and args.gpus is None:
        return gpus_on_this_machine()
    gpus = args.gpus if args.gpus is not None else 1
    return args.gpu, gpus


def _csv(value: str | None, cast=str) -> list | None:
    from llmem_plugin.errors import ConfigError

    if value is None:
        return None
    try:
        items = [cast(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"cannot read '{value}' as a comma-separated list. HINT: e.g. 2,4,8") from None
    if not items:
        raise ConfigError(f"empty list '{value}'. HINT: e.g. fsdp,zero3")
    return items


def _cmd_plan(args: argparse.Namespace) -> int:
    from llmem_plugin.errors import WontFitError
    from llmem_plugin.gpus import parse_memory
    from llmem_plugin.planner import DEFAULT_MARGIN, plan
    from llmem_plugin.workload import Workload

    gpu, n = _plan_target(args)
    wl = Workload(seq_len=args.seq_len, precision=args.precision, optimizer=args.optimizer, lora=_lora(args),
                  attn_implementation=args.attn, **_technique_fields(args))
    kw = {}
    if args.efficiency is not None:
        kw["efficiency"] = args.efficiency
    gc = {"auto": None, "on": True, "off": False}[args.grad_checkpointing]
    try:
        result, code = plan(
            args.model, gpu=gpu or "h100-sxm", num_gpus=n, num_nodes=args.nodes, workload=wl,
            global_batch=args.global_batch, margin=DEFAULT_MARGIN if args.margin is None else args.margin,
            methods=_csv(args.methods), tps=_csv(args.tp, int), micro_batch=args.micro_batch,
            grad_checkpointing=gc, gpu_memory=parse_memory(args.gpu_memory) if args.gpu_memory else None,
            alloc_conf=args.alloc_conf, inter_node_gbps=args.inter_node_gbps, verify=not args.no_verify,
            prune=not args.no_prune, **kw,
        ), 0
    except WontFitError as e:
        result, code = e.plan, EXIT_WONT_FIT
        if not args.json:
            print(f"llmem: {e}", file=sys.stderr)
    if args.plot:
        from llmem_plugin.plot import plot_plan
        from llmem_plugin.report import _plan_rows

        rows = _plan_rows(result, args.all)
        chosen = next((i for i, c in enumerate(rows) if c is result.choice), None)
        plot_plan([(c.label(), c.segments) for c in rows], capacity_bytes=result.capacity_bytes,
                  margin=result.margin, chosen=chosen, path=args.plot,
                  title=f"{result.model} on {result.layout.num_gpus} x {result.gpu.name}")
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        from rich.console import Console

        from llmem_plugin.report import render_plan

        console = Console()
        render_plan(result, Console(width=max(console.width, 130)), show_all=args.all)
    return code


def _parser_models(sub) -> None:
    p = sub.add_parser("models", help="list the bundled model catalog with exact parameter counts")
    _add_gpu_args(p)
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    p.set_defaults(func=_cmd_models)


def _cmd_models(args: argparse.Namespace) -> int:
    from llmem_plugin import catalog

    gpu = _gpu(args) if args.gpu or args.gpu_memory else None
    rows = []
    for name in catalog.names():
        e = catalog.entry(name)
        params, layers = catalog.count_parameters(catalog.load_config(name))
        row = {"name": name, "hub_id": e.hub_id, "family": e.family, "num_layers": layers, "params": params}
        if gpu is not None:
            # bf16 weights alone (2 bytes per parameter): a first filter, not an estimate.
            row["gpu"] = gpu.name
            row["bf16_weights_pct_of_gpu"] = round(100 * 2 * params / gpu.capacity_bytes, 1)
        rows.append(row)
    if args.json:
        print(json.dumps(rows))
    else:
        from rich.console import Console

        from llmem_plugin.report import render_models

        render_models(rows, Console())
    return 0


def _parser_gpus(sub) -> None:
    p = sub.add_parser("gpus", help="list the bundled GPU catalog: memory, dense peak TFLOP/s, interconnect")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="show only these GPUs (catalog name, alias, or the device name torch reports)")
    _add_gpu_args(p)
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    p.set_defaults(func=_cmd_gpus)


def _cmd_gpus(args: argparse.Namespace) -> int:
    from llmem_plugin import gpus

    names = list(args.names) + ([args.gpu] if args.gpu else [])
    if args.gpu_memory is not None:
        rows = [gpus.resolve_gpu(n, args.gpu_memory).to_dict() for n in names or [None]]
    else:
        rows = [gpus.get_gpu(n).to_dict() for n in names or gpus.gpu_names()]
    if args.json:
        print(json.dumps(rows))
    else:
        from rich.console import Console

        from llmem_plugin.report import render_gpus

        render_gpus(rows, Console())
    return 0


def _parser_validate(sub) -> None:
    p = sub.add_parser("validate", help="re-predict measured runs (ground-truth JSONL) and report the % error")
    p.add_argument("file", metavar="FILE.jsonl", help="rows written by benchmarks/groundtruth")
    p.add_argument("--gpu", default=None, help="predict CUDA rows for this catalog GPU instead of each row's own")
    p.add_argument("--fast", action="store_true", help="predict with the layer-extrapolating fast mode")
    p.add_argument("--json", action="store_true", help="print rows and summary as JSON")
    p.set_defaults(func=_cmd_validate)


def _cmd_validate(args: argparse.Namespace) -> int:
    from llmem_plugin.validate import load_rows, validate_rows

    rows = load_rows(args.file)
    if args.gpu:
        from llmem_plugin.gpus import get_gpu

        get_gpu(args.gpu)  # a bad name is bad input, not a per-row failure
    report = validate_rows(rows, fast=args.fast, gpu=args.gpu)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        from rich.console import Console

        from llmem_plugin.report import render_validation

        render_validation(report, Console())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmem", description="Peak GPU memory of LLM fine-tuning, predicted before the job starts."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _parser_estimate(sub)
    _parser_plan(sub)
    _parser_models(sub)
    _parser_validate(sub)
    _parser_gpus(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``llmem``; returns the exit code."""
    args = build_parser().parse_args(argv)
    from llmem_plugin.errors import LLMemError

    try:
        return args.func(args)
    except LLMemError as e:
        print(f"llmem: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ImportError as e:
        print(f"llmem: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
