"""``llmem models`` and ``llmem gpus``: the bundled catalogs, as tables or JSON."""

from __future__ import annotations

import argparse
import json

from llmem_plugin.cli.options import add_gpu_args, target_gpu

__all__ = ["gpus_command", "gpus_parser", "models_command", "models_parser"]


def models_parser(sub) -> None:
    """``llmem models``: the bundled model catalog."""
    p = sub.add_parser("models", help="list the bundled model catalog with exact parameter counts")
    add_gpu_args(p)
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    p.set_defaults(func=models_command)


def models_command(args: argparse.Namespace) -> int:
    """Print every catalog model with its task, layers and exact parameter count (and, with ``--gpu``, the
    share of the GPU its bf16 weights alone take)."""
    from llmem_plugin.models import catalog
    from llmem_plugin.models.config import count_parameters
    from llmem_plugin.models.tasks import config_task

    gpu = target_gpu(args) if args.gpu or args.gpu_memory else None
    rows = []
    for name in catalog.names():
        e = catalog.entry(name)
        config = catalog.load_config(name)
        params, layers = count_parameters(config)
        row = {"name": name, "hub_id": e.hub_id, "family": e.family, "task": config_task(config).value,
               "num_layers": layers, "params": params}
        if gpu is not None:
            # bf16 weights alone (2 bytes per parameter): a first filter, not an estimate.
            row["gpu"] = gpu.name
            row["bf16_weights_pct_of_gpu"] = round(100 * 2 * params / gpu.capacity_bytes, 1)
        rows.append(row)
    if args.json:
        print(json.dumps(rows))
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_models

        render_models(rows, Console())
    return 0


def gpus_parser(sub) -> None:
    """``llmem gpus``: the bundled GPU catalog."""
    p = sub.add_parser("gpus", help="list the bundled GPU catalog: memory, dense peak TFLOP/s, interconnect")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="show only these GPUs (catalog name, alias, or the device name torch reports)")
    add_gpu_args(p)
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    p.set_defaults(func=gpus_command)


def gpus_command(args: argparse.Namespace) -> int:
    """Print the named GPUs (default: all): memory, dense peak TFLOP/s, memory and link bandwidth."""
    from llmem_plugin.device import gpus

    names = list(args.names) + ([args.gpu] if args.gpu else [])
    if args.gpu_memory is not None:
        rows = [gpus.resolve_gpu(n, args.gpu_memory).to_dict() for n in names or [None]]
    else:
        rows = [gpus.get_gpu(n).to_dict() for n in names or gpus.gpu_names()]
    if args.json:
        print(json.dumps(rows))
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_gpus

        render_gpus(rows, Console())
    return 0
