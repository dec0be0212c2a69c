"""``--config``: a framework's recipe file read into ``llmem`` options.

The file's options go before the user's, so that the user's win; an option
argparse refuses is named with the file key that set it. The recipe as read is
printed above the report, and added to the JSON under ``"config"``.
"""

from __future__ import annotations

import argparse
import json
import os

from llmem_plugin.cli.options import Parser

__all__ = ["add_config_args", "check_config", "emit_json", "show_recipe", "with_config"]


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config``, ``--config-format`` and ``--model-config``, in their own group."""
    g = p.add_argument_group("config file", "read the job from the file its framework runs (docs/recipes.md); "
                             "options given here override the file's")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="an Axolotl, LLaMA-Factory, torchtune or TRL (SFTConfig/DPOConfig) YAML or JSON file; its "
                        "memory keys become the options below, the rest are listed")
    g.add_argument("--config-format", default=None,  # llmem_plugin.recipes.FORMATS (imported on use)
                   choices=("axolotl", "llamafactory", "torchtune", "trl", "trl-sft", "trl-dpo"),
                   help="the file's framework (default: told from its keys); trl-sft/trl-dpo: the trl command")
    g.add_argument("--model-config", default=None, metavar="PATH",
                   help="with --config, the config.json of the file's model, for a model the catalog lacks "
                        "(nothing is downloaded)")


def with_config(argv: list[str]):
    """``argv`` with the ``--config`` file's options put before the user's (so the user's win), and the recipe."""
    Parser.origins = {}
    if not argv or argv[0] not in ("estimate", "plan", "max"):
        return argv, None
    path = fmt = None
    for i, a in enumerate(argv):
        for flag in ("--config", "--config-format"):
            if a == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(flag + "="):
                value = a.split("=", 1)[1]
            else:
                continue
            if flag == "--config":
                path = value
            else:
                fmt = value
    if path is None:
        return argv, None
    from llmem_plugin.recipes import command_argv, read_recipe

    recipe = read_recipe(path, fmt)
    typed = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")}  # the user's own, named as such
    Parser.origins = {m.option.split(" ")[0]: f"{os.path.basename(recipe.path)}: {m.key}"
                       for m in recipe.mapped if m.option and m.option.split(" ")[0] not in typed}
    # `llmem max` takes the job as `estimate` does.
    command = "estimate" if argv[0] == "max" else argv[0]
    return [argv[0], *command_argv(recipe, command, argv[1:]), *argv[1:]], recipe


def check_config(args: argparse.Namespace) -> None:
    """``--model-config`` replaces the file's model; a file's model must be in the catalog or a local path."""
    from llmem_plugin.errors import ConfigError

    recipe = args.recipe
    if recipe is not None and recipe.bf16_key and getattr(args, "gpu", None) is not None:
        from llmem_plugin.device.gpus import get_gpu

        gpu = get_gpu(args.gpu)
        if tuple(gpu.compute_capability) < (8, 0):  # bf16 tensor cores start with Ampere (sm_80)
            raise ConfigError(f"{os.path.basename(recipe.path)}: {recipe.bf16_key} needs bf16, which the {gpu.name} "
                              f"(compute capability {gpu.compute_capability[0]}.{gpu.compute_capability[1]}) lacks; "
                              "the framework would fail or train in fp16, which is not modelled. HINT: pass an "
                              "Ampere or later --gpu, or set fp32 in the file")
    if getattr(args, "model_config", None) is not None:
        if args.recipe is None:
            raise ConfigError(f"--model-config {args.model_config!r} names the model of a --config file. HINT: "
                              f"without --config pass --model {args.model_config}")
        if not os.path.exists(args.model_config):
            raise ConfigError(f"--model-config {args.model_config!r}: no such file. HINT: pass the model's "
                              "config.json")
        args.model = args.model_config
        return
    if args.recipe is not None and args.model == args.recipe.options.get("--model"):
        from llmem_plugin.models import catalog
        from llmem_plugin.models.config import is_litgpt_source

        if catalog.lookup(args.model) is None and not os.path.exists(args.model) and not is_litgpt_source(args.model):
            key = next((m.key for m in args.recipe.mapped if m.option.startswith("--model ")), "model")
            raise ConfigError(f"{os.path.basename(args.recipe.path)}: {key}={args.model} is not in the bundled "
                              "catalog, and nothing is downloaded. HINT: pass --model-config path/to/config.json "
                              "(the model's config), or --model with a catalog name from `llmem models`")


def emit_json(args: argparse.Namespace, result: dict) -> None:
    """Print ``result`` as one line of JSON, with the ``--config`` file as read under ``"config"``."""
    if getattr(args, "recipe", None) is not None:
        result = {**result, "config": args.recipe.to_dict()}
    print(json.dumps(result))


def show_recipe(args: argparse.Namespace, console) -> None:
    """Print the ``--config`` file as read (its keys, the options they became), if one was given."""
    if getattr(args, "recipe", None) is not None:
        from llmem_plugin.cli.report import render_recipe

        render_recipe(args.recipe, console)
