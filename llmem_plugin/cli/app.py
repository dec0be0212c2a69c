"""The ``llmem`` command line: the parser and the entry point.

Each command is a parser function plus a command function, in a module of its
own: :mod:`~llmem_plugin.cli.estimate`, :mod:`~llmem_plugin.cli.plan`, :mod:`~llmem_plugin.cli.largest` (``max``),
:mod:`~llmem_plugin.cli.catalog` (``models``, ``gpus``) and
:mod:`~llmem_plugin.cli.validate`; the options they share are in
:mod:`~llmem_plugin.cli.options`, ``--config`` in :mod:`~llmem_plugin.cli.config`.
Exit codes: 0 on success, 2 for bad input (one line on stderr, no traceback),
3 when nothing fits (``llmem plan``: the report is still printed).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence

from llmem_plugin.cli.catalog import gpus_parser, models_parser
from llmem_plugin.cli.compare import compare_parser
from llmem_plugin.cli.config import check_config, with_config
from llmem_plugin.cli.estimate import estimate_parser
from llmem_plugin.cli.largest import max_parser
from llmem_plugin.cli.options import EXIT_BAD_INPUT, EXIT_WONT_FIT, Parser, check_args
from llmem_plugin.cli.plan import plan_parser
from llmem_plugin.cli.validate import validate_parser

__all__ = ["build_parser", "main"]

_EXIT_CODES = (
    "exit codes: 0 success (estimate: the step fits); 2 bad input, one line on stderr naming the value and the "
    "fix; 3 does not fit (estimate: the step or no method fits the GPU; plan: no method fits; max: not even the "
    "smallest value fits), the report is still printed"
)


def build_parser() -> argparse.ArgumentParser:
    """The ``llmem`` parser: one subcommand per command module, each with the exit codes as its epilog."""
    parser = Parser(
        prog="llmem", description="Peak GPU memory of LLM fine-tuning, predicted before the job starts.",
        epilog=_EXIT_CODES,
    )
    from importlib.metadata import PackageNotFoundError, version

    try:
        own_version = version("llmem_plugin")
    except PackageNotFoundError:  # run from a source tree that is not installed
        own_version = "unknown"
    parser.add_argument("--version", action="version", version=f"llmem {own_version}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    estimate_parser(sub)
    plan_parser(sub)
    max_parser(sub)
    models_parser(sub)
    validate_parser(sub)
    compare_parser(sub)
    gpus_parser(sub)
    for p in sub.choices.values():
        p.epilog = _EXIT_CODES
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``llmem``.

    Parses ``argv`` (``sys.argv[1:]`` if None), refuses bad options before any
    model is built, and runs the command. torch is imported only once the
    options are valid, so ``--help`` and option errors are quick. An
    ``estimate`` or ``plan`` run before with the same options, inputs and
    versions is answered from :mod:`~llmem_plugin.cli.resultcache` before
    torch is imported.

    Returns:
        The exit code: 0, ``EXIT_BAD_INPUT`` (2) or ``EXIT_WONT_FIT`` (3);
        ``--help`` returns 0.
    """
    from llmem_plugin.errors import LLMemError

    raw_argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, recipe = with_config(raw_argv)
    except LLMemError as e:  # the --config file cannot be read or mapped
        print(f"llmem: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or an option argparse refused (its one line is printed)
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    args.recipe = recipe
    from llmem_plugin.cli import resultcache

    try:
        key = resultcache.result_key(raw_argv, argv, args)
    except LLMemError as e:  # LLMEM_CACHE_SIZE is not a size
        print(f"llmem: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if key is None:
        return _run(args)
    kept = resultcache.lookup(key)
    if kept is not None:
        return resultcache.replay(kept)
    started, before = time.time(), resultcache.inputs_digest(raw_argv, argv)
    with resultcache.capture() as printed:
        code = _run(args)
    if resultcache.inputs_digest(raw_argv, argv) == before:  # no input file changed while the command ran
        resultcache.store(key, resultcache.Answer(printed[0], printed[1], code, started))
    return code


def _run(args: argparse.Namespace) -> int:
    """Check the options and run the command; the exit code (errors printed as one line)."""
    from llmem_plugin.errors import LLMemError, WontFitError

    try:
        check_args(args)
        check_config(args)
        from llmem_plugin.trace.cache import disabled

        with disabled() if getattr(args, "no_cache", False) else contextlib.nullcontext():
            return args.func(args)
    except WontFitError as e:
        print(f"llmem: {_one_line(e)}", file=sys.stderr)
        return EXIT_WONT_FIT
    except LLMemError as e:
        print(f"llmem: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ImportError as e:
        print(f"llmem: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _one_line(e: BaseException) -> str:
    """An error's message on one line (its own type's name where it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
