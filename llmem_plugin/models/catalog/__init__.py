"""The bundled catalog of model architectures, usable without the Hugging Face Hub.

Each model is one HF-style ``config.json`` under ``configs/<name>.json`` holding
only architecture facts, copied from the model's published ``config.json``
(no tokenizer, no weights). ``index.json`` maps each catalog name to its Hub
id, the aliases users type (other spellings and the Hub ids of instruct
variants with the same architecture), its family, and the published total
parameter count with where that figure comes from. The tests build every
model on the meta device (:func:`llmem_plugin.models.config.count_parameters`)
and check that count, which is the independent check that the configs are
right.

Both files are package data read through :mod:`importlib.resources`, so the
catalog works from a wheel and offline. ``transformers`` is imported only by
:func:`load_config`, so listing and resolving names stays cheap.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
from importlib import resources
from typing import TYPE_CHECKING, Any

from llmem_plugin.errors import ConfigError

if TYPE_CHECKING:
    import transformers

__all__ = [
    "CatalogEntry",
    "names",
    "lookup",
    "entry",
    "config_dict",
    "load_config",
]

_HINT = "HINT: run 'llmem models' for the catalog, or pass a path to a config.json"
# At most this many "did you mean" suggestions; difflib's default cutoff (0.6).
_NUM_SUGGESTIONS = 3
_SUGGESTION_CUTOFF = 0.6


@dataclasses.dataclass(frozen=True, kw_only=True)
class CatalogEntry:
    """One catalog model: its names and its published size.

    Attributes:
        name: Catalog name, lowercase; also the stem of its config file.
        hub_id: Hugging Face Hub id of the checkpoint the config was copied from.
        family: Model family slug (``"llama3.1"``, ``"qwen2.5"``, ...).
        aliases: Other accepted spellings, including instruct variants' Hub ids.
        published_params: Total parameter count as published (tied weights
            counted once), or ``None`` where no exact figure is published.
        published_params_source: Where ``published_params`` comes from.
        note: Which variant this is where that is ambiguous; may be empty.

    Known limitations:
        Aliases are matched exactly (case-insensitively); other spellings get a
        "did you mean" suggestion rather than a guess.
    """

    name: str
    hub_id: str
    family: str
    aliases: tuple[str, ...]
    published_params: int | None
    published_params_source: str | None
    note: str = ""

    def __post_init__(self) -> None:
        if self.name != self.name.lower():
            raise ValueError(f"catalog name {self.name!r} must be lowercase")
        if self.published_params is not None and self.published_params_source is None:
            raise ValueError(f"catalog entry {self.name!r} gives published_params without a source")

    def to_dict(self) -> dict[str, Any]:
        """Return the entry as plain JSON-serialisable data."""
        d = dataclasses.asdict(self)
        d["aliases"] = list(self.aliases)
        return d


@functools.cache
def _index() -> dict[str, CatalogEntry]:
    raw = json.loads(resources.files(__name__).joinpath("index.json").read_text(encoding="utf-8"))
    return {
        name: CatalogEntry(
            name=name,
            hub_id=e["hub_id"],
            family=e["family"],
            aliases=tuple(e["aliases"]),
            published_params=e["published_params"],
            published_params_source=e["published_params_source"],
            note=e.get("note", ""),
        )
        for name, e in raw["models"].items()
    }


@functools.cache
def _keys() -> dict[str, str]:
    """Lowercased name, Hub id and alias -> catalog name."""
    keys: dict[str, str] = {}
    for name, e in _index().items():
        for key in (name, e.hub_id, *e.aliases):
            other = keys.setdefault(key.lower(), name)
            assert other == name, f"catalog key {key!r} names both {other!r} and {name!r}"
    return keys


@functools.cache
def _raw_config(name: str) -> dict[str, Any]:
    path = resources.files(__name__).joinpath("configs", f"{name}.json")
    return json.loads(path.read_text(encoding="utf-8"))


_MAX_NAME_SHOWN = 80


def _unknown(name: str) -> ConfigError:
    keys = _keys()
    suggestions: list[str] = []
    for key in difflib.get_close_matches(name.lower(), keys, n=len(keys), cutoff=_SUGGESTION_CUTOFF):
        if keys[key] not in suggestions:
            suggestions.append(keys[key])
    suggestions = suggestions[:_NUM_SUGGESTIONS]
    did_you_mean = f"; did you mean {', '.join(repr(s) for s in suggestions)}?" if suggestions else ";"
    # The message stays one readable line whatever was typed.
    shown = name if len(name) <= _MAX_NAME_SHOWN else f"{name[:_MAX_NAME_SHOWN]}... ({len(name)} characters)"
    return ConfigError(f"unknown model {shown!r}{did_you_mean} {_HINT}")


def _resolve(name: str) -> str:
    resolved = lookup(name)
    if resolved is None:
        raise _unknown(name)
    return resolved


def names() -> list[str]:
    """List the catalog's model names.

    Returns:
        The catalog names, sorted.
    """
    return sorted(_index())


def lookup(name: str) -> str | None:
    """Resolve a catalog name, an alias or a Hub id to its catalog name.

    Matching is exact up to case and surrounding whitespace. This is the one
    function that answers "not in the catalog" with ``None`` rather than an
    error, because callers use it to decide whether ``name`` is a catalog
    model or a path / Hub id to load some other way.

    Args:
        name: What the user typed, e.g. ``"llama3.1-8b"`` or
            ``"meta-llama/Llama-3.1-8B-Instruct"``.

    Returns:
        The catalog name, or ``None`` if ``name`` is not in the catalog.
    """
    return _keys().get(name.strip().lower())


def entry(name: str) -> CatalogEntry:
    """Return the catalog entry of a model.

    Args:
        name: A catalog name, alias or Hub id (case-insensitive).

    Returns:
        The model's :class:`CatalogEntry`.

    Raises:
        ConfigError: ``name`` is not in the catalog; the message suggests close names.
    """
    return _index()[_resolve(name)]


def config_dict(name: str) -> dict[str, Any]:
    """Return a model's bundled ``config.json`` as a dict.

    Args:
        name: A catalog name, alias or Hub id (case-insensitive).

    Returns:
        A deep copy of the raw JSON, safe to mutate.

    Raises:
        ConfigError: ``name`` is not in the catalog; the message suggests close names.
    """
    return copy.deepcopy(_raw_config(_resolve(name)))


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def load_config(name: str, overrides: dict[str, Any] | None = None) -> transformers.PretrainedConfig:
    """Build the ``transformers`` config of a catalog model, offline.

    Args:
        name: A catalog name, alias or Hub id (case-insensitive).
        overrides: Config fields to replace before the config is built, so
            derived fields (``head_dim``) follow them; a smaller layer count
            also cuts ``layer_types`` to match.

    Returns:
        The config built by ``AutoConfig.for_model(model_type, **fields)``;
        nothing is fetched from the Hub.

    Raises:
        ConfigError: ``name`` is not in the catalog; the message suggests close names.
    """
    import transformers

    fields = config_dict(name)
    if overrides:
        fields.update(overrides)
        depth = next((overrides[k] for k in _LAYER_KEYS if k in overrides), None)
        if depth is not None and isinstance(fields.get("layer_types"), list):
            fields["layer_types"] = fields["layer_types"][:depth]
    model_type = fields.pop("model_type")
    # The published files say "torch_dtype"; transformers 5 renamed it "dtype" and
    # warns on the old key (transformers/configuration_utils.py).
    if "torch_dtype" in fields:
        fields["dtype"] = fields.pop("torch_dtype")
    return transformers.AutoConfig.for_model(model_type, **fields)

