"""Recipes: a fine-tuning job read from the config file its framework runs.

In: an Axolotl, LLaMA-Factory, torchtune or TRL file. Out: the ``llmem`` options it sets, and what is not modelled.

``llmem estimate --config FILE`` and ``llmem plan --config FILE`` take an
Axolotl YAML, a LLaMA-Factory YAML, a torchtune recipe YAML or a TRL
``SFTConfig``/``TrainingArguments`` file (JSON or YAML). Each reader maps the
keys that change memory to the ``llmem estimate`` options, so every check and
refusal of those options applies to the file too, and reports:

- ``mapped``: each memory key, its value and the option it became (a key at the
  framework's default is listed with that default);
- ``not_modelled``: keys that change memory in a way the estimate bounds from
  above (listed as ``not modelled: KEY=VALUE`` with the bound) or that are
  unknown to the framework's schema;
- a refusal (:class:`~llmem_plugin.errors.UnsupportedError`, exit 2) for a key
  whose effect cannot be bounded, such as Unsloth's patched kernels.

Options given on the command line after ``--config`` override the file's.
Hub model ids resolve through the bundled catalog's aliases; nothing is
downloaded (``--model-config`` names a local config.json instead).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from llmem_plugin.errors import ConfigError, LLMemError, UnsupportedError

__all__ = ["FORMATS", "Recipe", "read_recipe"]

FORMATS = ("axolotl", "llamafactory", "torchtune", "trl", "trl-sft", "trl-dpo")


@dataclass(frozen=True)
class Mapped:
    """A memory key of the file and the ``llmem estimate`` option it became ('' when it is the option's default)."""

    key: str
    value: str
    option: str

    def to_dict(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "option": self.option}


@dataclass(frozen=True)
class NotModelled:
    """A key the estimate does not model, with what that means for the figure."""

    key: str
    value: str
    why: str

    def to_dict(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "why": self.why}


@dataclass
class Recipe:
    """A framework config file read as ``llmem estimate`` options.

    Attributes:
        format: One of :data:`FORMATS`.
        path: The file.
        framework: The framework and the version whose schema was read, e.g. "torchtune 0.6.1".
        options: ``llmem estimate`` flag -> value (``True`` for a switch), in the order set.
        mapped: The memory keys read, each with the option it became.
        not_modelled: Keys not modelled (the estimate is an upper bound for them) or unknown to the schema.
        notes: What the estimate assumes about the job beyond the file (one line each).
        required: Options the file leaves to the command line (flag -> why), refused when not given there.
        bf16_key: The key that asks for bf16 (checked against the target GPU), if any.
    """

    format: str
    path: str
    framework: str
    options: dict[str, Any] = field(default_factory=dict)
    mapped: list[Mapped] = field(default_factory=list)
    not_modelled: list[NotModelled] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    required: dict[str, str] = field(default_factory=dict)
    bf16_key: str | None = None

    def argv(self) -> list[str]:
        """The options as command-line arguments."""
        out: list[str] = []
        for flag, value in self.options.items():
            if value is True:
                out.append(flag)
            elif value is not None and value is not False:
                out += [flag, str(value)]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "path": self.path, "framework": self.framework,
                "options": {k: v for k, v in self.options.items() if v is not None and v is not False},
                "mapped": [m.to_dict() for m in self.mapped],
                "not_modelled": [n.to_dict() for n in self.not_modelled], "notes": list(self.notes)}


class Reader:
    """What a format's reader fills: the options, the mapping table and the keys left out.

    Every key of the file must be accounted for: :meth:`take` (read, mapped),
    :meth:`skip` (not modelled, with the bound), :meth:`ignore` (known to the
    framework and not memory-relevant) or refused. :meth:`finish` lists the
    rest as unknown keys.
    """

    def __init__(self, recipe: Recipe, raw: dict[str, Any]):
        self.recipe = recipe
        self.raw = raw
        self.seen: set[str] = set()

    def where(self, key: str) -> str:
        return f"{os.path.basename(self.recipe.path)}: {key}"

    def get(self, key: str, default: Any = None, kind: type | tuple[type, ...] | None = None) -> Any:
        """The value at a dotted ``key`` (``None`` counts as absent), marking it seen.

        Raises:
            ConfigError: ``kind`` is given and the value is not of it (a bool is not an int here).
        """
        self.seen.add(key)
        node: Any = self.raw
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        if node is None:
            return default
        if kind is not None and (not isinstance(node, kind) or (isinstance(node, bool) and bool not in
                                                                 (kind if isinstance(kind, tuple) else (kind,)))):
            names = " or ".join(_KINDS.get(k, k.__name__) for k in (kind if isinstance(kind, tuple) else (kind,)))
            self.bad(key, node, f"must be {names}", f"fix {key} in the file")
        return node

    def has(self, key: str) -> bool:
        return self.get(key, _ABSENT) is not _ABSENT

    def set(self, key: str, value: Any, flag: str | None = None, flag_value: Any = True) -> None:
        """Record ``key`` = ``value`` as option ``flag`` (``None``: the option's default is the same)."""
        self.seen.add(key)
        option = ""
        if flag is not None and flag_value is not None and flag_value is not False:
            self.recipe.options[flag] = flag_value
            option = flag if flag_value is True else f"{flag} {flag_value}"
        self.recipe.mapped.append(Mapped(key, _text(value), option))

    def skip(self, key: str, value: Any, why: str) -> None:
        self.seen.add(key)
        self.recipe.not_modelled.append(NotModelled(key, _text(value), why))

    def ignore(self, *keys: str) -> None:
        self.seen.update(keys)

    def refuse_set(self, refused: dict[str, str]) -> None:
        """Refuse the first key of ``refused`` (key -> why) the file sets to a true value."""
        for key, why in refused.items():
            if self.raw.get(key):
                self.refuse(key, self.raw[key], why, f"drop {key} to estimate the rest")

    def refuse(self, key: str, value: Any, why: str, hint: str) -> None:
        raise UnsupportedError(f"{self.where(key)}={_text(value)}: {why}. HINT: {hint}")

    def bad(self, key: str, value: Any, why: str, hint: str) -> None:
        raise ConfigError(f"{self.where(key)}={_text(value)}: {why}. HINT: {hint}")

    def note(self, text: str) -> None:
        self.recipe.notes.append(text)

    def require(self, flag: str, why: str) -> None:
        """``flag`` must come from the command line: the file leaves it open (``why``)."""
        self.recipe.required[flag] = why

    def finish(self, ignored: set[str], *, schema: str, schema_keys: set[str] | dict[str, Any] | None = None
               ) -> Recipe:
        """List the keys left: set ones of the schema as not read, others as unknown to it.

        Args:
            ignored: Keys known not to change the step's GPU memory (data, logging, schedules).
            schema: The schema's name, for the message.
            schema_keys: Every key of the schema, or a mapping of each to its default (a key at its default is
                not listed); ``None``: only ``ignored`` and the keys read are known.
        """
        defaults = schema_keys if isinstance(schema_keys, dict) else {}
        for key, value in self.raw.items():
            if key in ignored or any(s == key or s.startswith(key + ".") for s in self.seen):
                continue
            if value is None or value is False or value == "" or value == [] or value == {}:
                continue  # unset: the framework's default, which the keys read already assume
            if key in defaults and value == defaults[key]:
                continue
            why = "not read by the estimate" if schema_keys is not None and key in schema_keys else \
                f"not a key of {schema}"
            self.recipe.not_modelled.append(NotModelled(key, _text(value), why))
        return self.recipe


_ABSENT = object()
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
          dict: "a mapping"}


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def load_file(path: str) -> dict[str, Any]:
    """The file's top-level mapping (YAML or JSON).

    Raises:
        ConfigError: The file is missing, unreadable, not YAML/JSON, or not a mapping.
    """
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config {path!r}: no such file. HINT: pass the path of the framework's YAML or JSON "
                          "config")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = json.loads(text) if path.lower().endswith(".json") else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
        first = " ".join(str(e).split())[:160]
        raise ConfigError(f"--config {path!r} cannot be read as {'JSON' if path.endswith('.json') else 'YAML'}: "
                          f"{first}. HINT: check the file's syntax") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"--config {path!r} holds no mapping of keys. HINT: pass an Axolotl, LLaMA-Factory, "
                          "torchtune or TRL config file")
    return data


def detect(raw: dict[str, Any], path: str) -> str:
    """The format of a config mapping, from the keys only one framework uses.

    Raises:
        ConfigError: No framework's keys are there.
    """
    model = raw.get("model")
    if isinstance(model, dict) and "_component_" in model:
        return "torchtune"  # torchtune instantiates every block from its _component_ (config/_instantiate.py)
    if "base_model" in raw:
        return "axolotl"  # its one required model key (utils/schemas/model.py)
    if {"stage", "finetuning_type", "cutoff_len", "template", "quantization_bit"} & raw.keys():
        return "llamafactory"  # FinetuningArguments/DataArguments/ModelArguments names
    if {"model_name_or_path", "per_device_train_batch_size", "output_dir", "max_length"} & raw.keys():
        return "trl"  # ModelConfig/TrainingArguments names
    raise ConfigError(f"--config {path!r}: no Axolotl (base_model), LLaMA-Factory (stage, finetuning_type), "
                      "torchtune (model._component_) or TRL (model_name_or_path) keys found. HINT: pass one of "
                      "those frameworks' config files, or name the format with --config-format")


def read_recipe(path: str, fmt: str | None = None) -> Recipe:
    """Read ``path`` as a job of ``fmt`` (default: detected from its keys).

    Raises:
        ConfigError: The file cannot be read, or a value is invalid for its framework.
        UnsupportedError: A key changes memory in a way the estimate cannot bound.
    """
    raw = load_file(path)
    fmt = fmt or detect(raw, path)
    if fmt not in FORMATS:
        raise ConfigError(f"--config-format {fmt!r} is not one of {', '.join(FORMATS)}. HINT: pass one of them")
    from importlib import import_module

    module, _, trainer = fmt.partition("-")  # trl-sft, trl-dpo: the trainer `trl sft|dpo` runs
    try:
        return import_module(f"llmem_plugin.recipes.{module}").read(raw, path, *([trainer] if trainer else []))
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        if isinstance(e, LLMemError):  # ours (a ValueError), already one line with its fix
            raise
        # A value of a type the reader does not check for (a list where a mapping goes, ...)
        raise ConfigError(f"--config {path!r}: a value has a type {fmt} does not take ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:120]}). HINT: check the file against {fmt}'s documented "
                          "format") from None


# `llmem plan` takes the workload options of `_add_step_args` and searches the rest; these file options
# become plan's or are left to its search.
_PLAN_KEEPS = {
    "--model", "--seq-len", "--precision", "--optimizer", "--attn", "--quantize", "--double-quant", "--kbit-prepare",
    "--quantize-lm-head", "--quantized-from", "--bnb-version", "--loss", "--loss-chunks", "--loss-chunk-upcast",
    "--outputs-to-fp32", "--logits-to-keep", "--offload-activations", "--reference-model", "--lora-rank",
    "--lora-alpha", "--lora-targets", "--lora-dropout", "--lora-adapter-dtype", "--runner", "--gpus",
}
# plan searches these itself (its checkpointing is non-reentrant, its methods take their own buffers)
_PLAN_SEARCHES = {"--batch-size", "--grad-accum", "--grad-checkpointing", "--checkpoint-reentrant", "--method",
                  "--offload", "--deepspeed-config"}


def command_argv(recipe: Recipe, command: str, user_argv: list[str]) -> list[str]:
    """The file's options for ``command`` ("estimate" or "plan"), to go before the user's own.

    Raises:
        ConfigError: An option the file leaves open is not on the command line, or ``plan`` is asked for a
            setting it does not search (packing, variable lengths...).
    """
    given = {a.split("=", 1)[0] for a in user_argv if a.startswith("--")}
    if command == "estimate":
        for flag, why in recipe.required.items():
            if flag not in given:
                raise ConfigError(f"{os.path.basename(recipe.path)}: {why}")
        return recipe.argv()
    kept = Recipe(recipe.format, recipe.path, recipe.framework)
    for flag, value in recipe.options.items():
        if flag in _PLAN_KEEPS:
            kept.options[flag] = value
        elif flag not in _PLAN_SEARCHES and value is not None and value is not False:
            key = next((m.key for m in recipe.mapped if m.option.split(" ")[0] == flag), flag)
            raise ConfigError(f"{os.path.basename(recipe.path)}: {key} sets {flag}, which `llmem plan` does not "
                              f"search. HINT: run `llmem estimate --config {recipe.path}`")
    for flag, why in recipe.required.items():
        if flag in _PLAN_KEEPS and flag not in given:
            raise ConfigError(f"{os.path.basename(recipe.path)}: {why}")
    return kept.argv()


def global_batch(recipe: Recipe, num_gpus: int) -> int:
    """Sequences per optimizer step over ``num_gpus`` data-parallel GPUs: micro-batch x accumulation x GPUs."""
    return int(recipe.options.get("--batch-size", 1)) * int(recipe.options.get("--grad-accum", 1)) * num_gpus
