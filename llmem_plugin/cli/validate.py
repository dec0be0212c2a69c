"""``llmem validate``: re-predict measured runs, or third-party published figures, and report the error."""

from __future__ import annotations

import argparse
import json

from llmem_plugin.cli.options import add_cache_arg

__all__ = ["validate_command", "validate_parser"]


def validate_parser(sub) -> None:
    """``llmem validate``: a ground-truth file, or ``--published``."""
    p = sub.add_parser("validate", help="re-predict measured runs (ground-truth JSONL) and report the %% error")
    p.add_argument("file", metavar="FILE.jsonl", nargs="?", default=None,
                   help="rows written by benchmarks/groundtruth (not with --published)")
    p.add_argument("--published", nargs="?", const="", default=None, metavar="FILE",
                   help="re-predict third-party published figures (default: benchmarks/published/measurements.jsonl "
                        "of a source checkout) and print the signed error per metric")
    p.add_argument("--gpu", default=None, help="predict CUDA rows for this catalog GPU instead of each row's own")
    p.add_argument("--fast", action="store_true", help="predict with the layer-extrapolating fast mode")
    add_cache_arg(p)
    p.add_argument("--json", action="store_true", help="print rows and summary as JSON")
    p.set_defaults(func=validate_command)


def validate_command(args: argparse.Namespace) -> int:
    """Re-predict each measured row and print measured, predicted and the signed error, then the summary."""
    from llmem_plugin.errors import ConfigError
    from llmem_plugin.verify.validate import load_rows, validate_rows

    if args.published is not None:
        if args.gpu or args.fast:
            raise ConfigError("--published predicts each row for its own GPU, in fast mode (equal to the full "
                              "trace); --gpu and --fast do not apply. HINT: drop them")
        if args.file:
            raise ConfigError(f"validate takes a ground-truth FILE or --published, not both (got {args.file}). "
                              "HINT: pass the published set as --published FILE")
        return _published(args)
    if not args.file:
        raise ConfigError("validate needs a ground-truth FILE.jsonl. HINT: llmem validate ROWS.jsonl, "
                          "or llmem validate --published")
    rows = load_rows(args.file)
    if args.gpu:
        from llmem_plugin.device.gpus import get_gpu

        get_gpu(args.gpu)  # a bad name is bad input, not a per-row failure
    report = validate_rows(rows, fast=args.fast, gpu=args.gpu)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        from rich.console import Console

        from llmem_plugin.cli.report import render_validation

        render_validation(report, Console())
    return 0


def _published(args: argparse.Namespace) -> int:
    """``--published``: re-predict the third-party figures and print the signed error per metric."""
    from llmem_plugin.verify.published import load_published, validate_published

    result = validate_published(load_published(args.published or None))
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console

    from llmem_plugin.cli.report import render_published

    render_published(result, Console())
    return 0
