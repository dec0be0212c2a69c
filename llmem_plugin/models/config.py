"""A model's config: found from its source, checked, and read.

A model source is a catalog name, a path to a ``config.json`` (or a folder
holding one), a Hub id already in the local cache or a ``PretrainedConfig``
(:func:`resolve_config`); ``litgpt:NAME`` names a litgpt model, built by
:mod:`llmem_plugin.models.litgpt`. The fields the model builder reads are
checked here (:func:`check_config`), and so are the facts read from a config
before any model is built: its layer count, its parameter count, whether its
task is one a feature models.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.models import catalog
from llmem_plugin.models.tasks import auto_class, config_task, model_task
from llmem_plugin.workload import Task

if TYPE_CHECKING:
    import transformers

__all__ = ["LITGPT_PREFIX", "ModelSource", "check_config", "count_parameters", "decoder_layers", "is_litgpt_source",
           "num_layers", "require_causal_lm", "resolve_config", "set_num_layers"]

ModelSource = Any  # str | os.PathLike | PretrainedConfig | nn.Module
# A litgpt model source: litgpt:NAME (its config table) or litgpt:DIR (a checkpoint directory),
# built by llmem_plugin.models.litgpt.
LITGPT_PREFIX = "litgpt:"


def is_litgpt_source(source: Any) -> bool:
    """Whether ``source`` names a litgpt model (``litgpt:NAME`` or ``litgpt:DIR``)."""
    return isinstance(source, str) and source.startswith(LITGPT_PREFIX)


def _quiet_transformers():
    """Keep transformers' own warnings about the configs and models built here off the user's screen."""
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def resolve_config(source: ModelSource):
    """Return the ``PretrainedConfig`` named by ``source``.

    Args:
        source: Catalog name or alias, path to a config.json or its folder, a
            Hub id present in the local cache, or a ``PretrainedConfig``.

    Raises:
        ConfigError: Unknown name, unreadable or malformed config.
    """
    import transformers

    _quiet_transformers()
    if is_litgpt_source(source):
        raise UnsupportedError(f"{source!r} is a litgpt model, which is modelled on one GPU only: `llmem estimate "
                               "--model litgpt:NAME` (no --method, no plan). HINT: for other methods "
                               "estimate the transformers model of the same architecture")
    if isinstance(source, transformers.PretrainedConfig):
        check_config(source)
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            f"model source of type {type(source).__name__} is not supported. "
            "HINT: pass a catalog name, a config.json path, a PretrainedConfig or an nn.Module"
        )
    text = os.fspath(source)
    name = catalog.lookup(text)
    if name is not None:
        return catalog.load_config(name)
    path = os.path.expanduser(text)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"folder {text!r} holds no config.json. HINT: pass the folder a transformers model "
                              "was saved to, or the config.json itself")
    if os.path.isfile(path):
        return _config_from_file(path)
    if _looks_like_path(text):
        raise ConfigError(f"model path {text!r} does not exist. HINT: pass an existing config.json (or its "
                          "folder), or a catalog name from `llmem models`")
    if "/" in text and not text.startswith((".", "/")) and text.count("/") == 1:
        try:
            return transformers.AutoConfig.from_pretrained(text, local_files_only=True)
        except (OSError, ValueError):
            pass
    # Raises the catalog's "unknown model ... did you mean" error.
    catalog.entry(text)
    raise AssertionError("catalog.entry must raise for an unknown name")


# transformers 5 saves the floats JSON cannot hold (Mamba2's and Falcon-H1's
# time_step_limit upper bound) as {"__float__": "Infinity"}
# (configuration_utils.py, _encode_special_floats / _decode_special_floats).
_FLOAT_TAG_KEY = "__float__"
_FLOAT_TAG_VALUES = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _decode_special_floats(obj: Any) -> Any:
    """Decode ``{"__float__": "Infinity"}`` as transformers' ``_decode_special_floats`` does."""
    if isinstance(obj, dict):
        if set(obj) == {_FLOAT_TAG_KEY} and isinstance(obj[_FLOAT_TAG_KEY], str):
            return _FLOAT_TAG_VALUES.get(obj[_FLOAT_TAG_KEY], obj)
        return {k: _decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_special_floats(v) for v in obj]
    return obj


# The size fields the model builder reads, with upper bounds. Each bound is
# far above every released model and keeps every traced tensor's byte size
# inside torch's int64 sizes together with the CLI's token bound (2**24):
# the widest released model (llama-3.1-405b) has hidden_size 16384,
# intermediate_size 53248 and 126 layers; the largest vocabularies are about
# 262k (Gemma 3); the most experts about 384 (Kimi K2). The layer bound also
# keeps the build and trace time bounded (every layer is built and traced).
_SIZE_FIELDS: dict[str, int] = {
    "hidden_size": 2**18,
    "num_hidden_layers": 1024,
    "num_attention_heads": 2**14,
    "num_key_value_heads": 2**14,
    "intermediate_size": 2**20,
    "vocab_size": 2**24,
    "head_dim": 2**14,
    "moe_intermediate_size": 2**20,
    "max_position_embeddings": 2**24,
}
# Expert counts: 0 is valid (a dense model of an MoE family).
_EXPERT_FIELDS: dict[str, int] = {
    "num_experts": 2**14,
    "num_local_experts": 2**14,
    "n_routed_experts": 2**14,
    "num_experts_per_tok": 2**14,
}
# Fields an estimate cannot do without: transformers fills a missing one with
# its class default, which describes another model (a config holding only
# model_type "llama" builds Llama-2-7B's 6.74B parameters).
_REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
_HINT_CONFIG = "HINT: pass the model's complete config.json as saved by transformers"


def _looks_like_path(text: str) -> bool:
    """A file path rather than a catalog name or a Hub id ("org/name")."""
    return (text.endswith((".json", "/", os.sep)) or text.startswith((".", "/", "~", os.sep))
            or text.count("/") > 1 or "\\" in text)


def _config_from_file(path: str):
    import transformers

    try:
        with open(path, encoding="utf-8") as f:
            fields = _decode_special_floats(json.load(f))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise ConfigError(f"malformed config {path}: {e}. HINT: pass a valid HF config.json") from None
    except RecursionError:
        raise ConfigError(f"malformed config {path}: JSON nested too deeply to read. {_HINT_CONFIG}") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ConfigError(
            f"malformed config {path}: no 'model_type' field. HINT: a transformers config.json names its model_type"
        )
    model_type = fields.pop("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"malformed config {path}: model_type {model_type!r} is not a string. {_HINT_CONFIG}")
    try:
        config_class = transformers.CONFIG_MAPPING[model_type]
    except KeyError:
        config_class = None  # for_model below names the valid model types
    if config_class is not None:
        required = _check_present(fields, config_class, path)
        alias = getattr(config_class, "attribute_map", {})
        _check_values(lambda name: _raw_field(fields, config_class, name), where=f"config {path}", required=required,
                      label=lambda name: name if name in fields or alias.get(name) not in fields else alias[name])
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, _StrictDataclassError) as e:
        cause = e.__cause__ if isinstance(e, _StrictDataclassError) and e.__cause__ is not None else e
        msg = " ".join(str(cause).split()) or type(cause).__name__
        raise ConfigError(f"malformed config {path}: {msg}. HINT: check model_type and field values") from None
    check_config(config, where=f"config {path}")
    return config


_MISSING = object()

try:  # transformers 5 configs are huggingface_hub strict dataclasses; their validators raise this
    from huggingface_hub.errors import StrictDataclassError as _StrictDataclassError
except ImportError:  # older huggingface_hub: no strict dataclasses
    class _StrictDataclassError(Exception):
        pass


def _raw_field(fields: dict, config_class, name: str) -> Any:
    """``fields[name]``, under its canonical name or the one ``attribute_map`` gives it (GPT-2's n_embd)."""
    if name in fields:
        return fields[name]
    alias = getattr(config_class, "attribute_map", {}).get(name)
    return fields.get(alias, _MISSING) if alias else _MISSING


def _check_present(fields: dict, config_class, path: str) -> tuple[str, ...]:
    """Refuse a config that leaves a field the estimate needs to the class default.

    Returns:
        The required fields this config class has (those to refuse as null).
    """
    try:
        defaults = config_class()
    except Exception:  # a class without defaults for every field: nothing to fill in silently
        return ()
    if _nested_text_config(fields):
        return ()
    required = tuple(name for name in _REQUIRED_FIELDS if getattr(defaults, name, None) is not None)
    missing = [
        name for name in required if _raw_field(fields, config_class, name) is _MISSING
    ]
    if missing:
        raise ConfigError(
            f"config {path} has no {', '.join(missing)}; transformers would fill in "
            f"{config_class.__name__}'s defaults ({', '.join(f'{n}={getattr(defaults, n)}' for n in missing)}), "
            f"which describe another model. {_HINT_CONFIG}"
        )
    return required


def _nested_text_config(fields: dict) -> bool:
    return isinstance(fields.get("text_config"), dict)


def _check_values(get, *, where: str, required: tuple[str, ...] = (), label=lambda name: name) -> None:
    """Check the size fields ``get(name)`` returns; ``_MISSING`` or None skips a
    field, except None for a ``required`` one. ``label(name)`` is the field's
    name in the message (the config file's own key)."""
    for bounds, low in ((_SIZE_FIELDS, 1), (_EXPERT_FIELDS, 0)):
        for name, high in bounds.items():
            value = get(name)
            if value is _MISSING or (value is None and name not in required):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(
                    f"{where}: {label(name)} must be an integer in [{low}, {high}], got {value!r}. {_HINT_CONFIG}"
                )
    heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads")
    hidden, head_dim = get("hidden_size"), get("head_dim")
    if isinstance(heads, int) and isinstance(hidden, int) and head_dim in (None, _MISSING) and hidden % heads:
        raise ConfigError(
            f"{where}: num_attention_heads {heads} does not divide hidden_size {hidden}. "
            "HINT: set head_dim, or a head count that divides hidden_size"
        )
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ConfigError(
            f"{where}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads} "
            "(grouped-query attention repeats each KV head). HINT: use a divisor of num_attention_heads"
        )
    for name in ("torch_dtype", "dtype"):
        value = get(name)
        if value in (_MISSING, None, "auto") or isinstance(value, torch.dtype):
            continue
        if not isinstance(value, str) or not isinstance(getattr(torch, value.removeprefix("torch."), None),
                                                         torch.dtype):
            raise ConfigError(f"{where}: {name} {value!r} is not a torch dtype. HINT: e.g. \"bfloat16\"")


def check_config(config, *, where: str = "config") -> None:
    """Check the fields the model builder reads: sizes are positive, bounded
    integers, heads divide the width, the dtype is a torch dtype.

    Args:
        config: A ``PretrainedConfig``; for a composite one, its text config
            is checked too.
        where: What to call the config in the message (its path).

    Raises:
        ConfigError: The first bad field, named, with its value.
    """
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            text = get_text()
        except Exception:  # a config whose text part cannot be located: check the top level only
            text = config
        if text is not config:
            configs.append(text)
    for cfg in configs:
        _check_values(lambda name, cfg=cfg: _safe_getattr(cfg, name), where=where)


def _safe_getattr(config, name: str) -> Any:
    try:
        return getattr(config, name, _MISSING)
    except Exception:  # a property that computes from a bad field
        return _MISSING


def num_layers(config) -> int:
    """Number of transformer layers in ``config`` (a composite vision-language
    config's text model's)."""
    for cfg in (config, config.get_text_config() if hasattr(config, "get_text_config") else None):
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if cfg is not None and getattr(cfg, key, None):
                return int(getattr(cfg, key))
    raise ConfigError(f"config of type {type(config).__name__} names no layer count")


def set_num_layers(config, n: int):
    """A copy of ``config`` with ``n`` layers (and per-layer lists cut to match)."""
    cfg = copy.deepcopy(config)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if getattr(cfg, key, None):
            setattr(cfg, key, n)
            break
    # A stored per-layer list only: some configs (MambaConfig) derive
    # ``layer_types`` in a read-only property from the layer count.
    layer_types = vars(cfg).get("layer_types")
    if isinstance(layer_types, (list, tuple)) and len(layer_types) >= n:
        cfg.layer_types = list(layer_types[:n])
    return cfg


def decoder_layers(model: nn.Module) -> str | None:
    """Qualified name of ``model``'s decoder layer list, or None when no one
    module list has the config's layer count."""
    try:
        depth = num_layers(getattr(model, "config", None))
    except Exception:  # no config, or no layer count in it
        return None
    names = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth]
    return names[0] if len(names) == 1 else None


def count_parameters(config: transformers.PretrainedConfig) -> tuple[int, int]:
    """Count a model's parameters by building it on the meta device.

    The model is the class its ``architectures`` names
    (:func:`llmem_plugin.models.tasks.config_task`; a causal LM by default), e.g.
    ``AutoModelForCausalLM.from_config(config)``, built under
    ``torch.device("meta")``, so no weights are allocated; a 70B model takes
    well under a second once ``transformers`` is imported.

    Args:
        config: A ``transformers`` config, e.g. from :func:`llmem_plugin.models.catalog.load_config`.

    Returns:
        ``(num_params, num_layers)``: the number of parameter elements with
        tied weights counted once (unique ``Parameter`` objects), and the
        number of transformer layers (``config.num_hidden_layers``).

    Raises:
        ConfigError: ``config`` is not an architecture known to
            ``transformers``, or does not say how many layers it has.
        UnsupportedError: Its class's task is not modelled.
    """
    import transformers

    try:
        with torch.device("meta"):
            model = auto_class(config_task(config)).from_config(config)
    except ValueError as e:
        raise ConfigError(
            f"model_type {config.model_type!r} has no causal-LM class in transformers "
            f"{transformers.__version__}: {str(e).splitlines()[0]} "
            "HINT: pass a decoder-only (causal LM) config"
        ) from e
    try:
        depth = num_layers(config)  # a vision-language config's text model's
    except ConfigError:
        depth = None
    if not isinstance(depth, int):
        raise ConfigError(
            f"config of model_type {config.model_type!r} has no integer num_hidden_layers "
            f"(got {depth!r}) HINT: set num_hidden_layers in the config.json"
        )
    # Tied weights (e.g. lm_head and the embedding) are one Parameter object
    # shared by two modules; count each object once.
    unique = {id(p): p for _, p in model.named_parameters(remove_duplicate=False)}
    return sum(p.numel() for p in unique.values()), depth


def require_causal_lm(source: Any, what: str, override: str | None = None) -> None:
    """Refuse, in one line, a sequence classifier where only causal LMs are modelled.

    Args:
        source: A model source (config, name, path) or a built module.
        what: The feature asked for (``"--method fsdp"``, ``"llmem plan"``).
        override: The workload's task, if given.

    Raises:
        UnsupportedError: ``source`` is a sequence classifier (or names a
            class that is not modelled at all).
    """
    if isinstance(source, nn.Module):
        task = model_task(source)
        if override is not None:
            task = Task(override)
    else:
        task = config_task(resolve_config(source), override)
    if task is not Task.CAUSAL_LM:
        raise UnsupportedError(
            f"{what}: {task.value} models are estimated on one GPU only; the distributed engines' steps are "
            "modelled for causal LMs. HINT: llmem estimate without --method/--gpus (method single)")
