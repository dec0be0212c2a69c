"""Tests of the bundled model-config catalog (llmem_plugin.models.catalog).

Building each model on the meta device and matching the published parameter
count is the independent check that each hand-copied config.json is right.
"""

from __future__ import annotations

import dataclasses
import json
import time
from importlib import resources

import pytest
import transformers

from llmem_plugin.models import catalog
from llmem_plugin.models.config import count_parameters
from llmem_plugin.errors import ConfigError
from llmem_plugin.models.tasks import config_task

EXPECTED_NAMES = {
    "gpt2",
    "gpt2-xl",
    "opt-125m",
    "opt-1.3b",
    "opt-6.7b",
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.1-405b",
    "llama-3.2-1b",
    "llama-3.2-3b",
    "mistral-7b",
    "mixtral-8x7b",
    "qwen2.5-0.5b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "qwen3-30b-a3b",
    "gemma-2-2b",
    "gemma-2-9b",
    "phi-3-mini",
    "t5-base",
    "bart-base",
    "distilbert-sst2",
    "llama-3.2-11b-vision",
    "bert-base-uncased",
    "roberta-base",
}
# The task each entry's architectures names (llmem_plugin.models.tasks); the rest are causal LMs.
TASKS = {"t5-base": "seq2seq", "bart-base": "seq2seq", "distilbert-sst2": "seq-cls",
         "llama-3.2-11b-vision": "image-text-to-text", "bert-base-uncased": "masked-lm", "roberta-base": "masked-lm"}

# Keys that are tokenizer, checkpoint or library metadata, not architecture.
_NON_ARCHITECTURE_KEYS = {"_name_or_path", "auto_map", "transformers_version", "tokenizer_class"}


def test_names_are_exactly_the_catalog() -> None:
    assert set(catalog.names()) == EXPECTED_NAMES
    assert catalog.names() == sorted(catalog.names())


def test_every_name_has_one_shipped_config() -> None:
    shipped = {
        p.name.removesuffix(".json")
        for p in resources.files("llmem_plugin.models.catalog").joinpath("configs").iterdir()
        if p.name.endswith(".json")
    }
    assert shipped == EXPECTED_NAMES


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_config_holds_architecture_facts_only(name: str) -> None:
    cfg = catalog.config_dict(name)
    assert isinstance(cfg["model_type"], str)
    assert len(cfg["architectures"]) == 1
    assert config_task(catalog.load_config(name)).value == TASKS.get(name, "causal-lm")
    assert cfg.get("text_config", cfg)["vocab_size"] > 0  # a vision-language config nests its text model
    assert not _NON_ARCHITECTURE_KEYS & cfg.keys()


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_meta_build_matches_published_params(name: str) -> None:
    config = catalog.load_config(name)
    assert isinstance(config, transformers.PretrainedConfig)
    assert type(config).__name__ != "PretrainedConfig"  # a model-specific class
    num_params, num_layers = count_parameters(config)
    raw = catalog.config_dict(name)
    text = raw.get("text_config", raw)
    assert num_layers == next(text[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in text)
    published = catalog.entry(name).published_params
    if published is not None:
        # If this fails, fix the config.json, never the published number.
        assert num_params == published, f"{name}: built {num_params:,}, published {published:,}"


def test_published_dtype_reaches_the_config() -> None:
    import torch

    assert catalog.load_config("llama-3.1-8b").dtype == torch.bfloat16
    assert catalog.load_config("gemma-2-2b").dtype == torch.float32


def test_count_parameters_is_fast_for_70b() -> None:
    config = catalog.load_config("llama-3.1-70b")
    count_parameters(config)  # warm up imports
    start = time.perf_counter()
    num_params, _ = count_parameters(config)
    elapsed_s = time.perf_counter() - start
    assert num_params == 70_553_706_496
    assert elapsed_s < 1.0, f"meta build of a 70B model took {elapsed_s:.2f} s"


@pytest.mark.parametrize(
    ("typed", "expected"),
    [
        ("gpt2-124m", "gpt2"),
        ("GPT2", "gpt2"),
        ("openai-community/gpt2", "gpt2"),
        ("llama3.1-8b", "llama-3.1-8b"),
        ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
        ("meta-llama/llama-3.1-8b-instruct", "llama-3.1-8b"),
        ("  Meta-Llama/Llama-3.1-70B-Instruct ", "llama-3.1-70b"),
        ("meta-llama/Llama-2-7b-chat-hf", "llama-2-7b"),
        ("mistralai/Mistral-7B-Instruct-v0.1", "mistral-7b"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("Qwen/Qwen3-30B-A3B-Base", "qwen3-30b-a3b"),
        ("google/gemma-2-9b-it", "gemma-2-9b"),
        ("microsoft/Phi-3-mini-4k-instruct", "phi-3-mini"),
    ],
)
def test_lookup_resolves_aliases_and_hub_ids(typed: str, expected: str) -> None:
    assert catalog.lookup(typed) == expected
    assert catalog.entry(typed).name == expected


def test_every_hub_id_and_alias_resolves_to_its_own_entry() -> None:
    for name in catalog.names():
        e = catalog.entry(name)
        for key in (e.hub_id, *e.aliases):
            assert catalog.lookup(key) == name
            assert catalog.lookup(key.upper()) == name


def test_lookup_of_unknown_is_none() -> None:
    assert catalog.lookup("mistralai/Mistral-7B-v0.3") is None


def test_unknown_name_suggests_close_names() -> None:
    with pytest.raises(ConfigError) as exc:
        catalog.config_dict("llama-3.1-8")
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("unknown model 'llama-3.1-8'; did you mean 'llama-3.1-8b'")
    assert message.endswith(
        "? HINT: run 'llmem models' for the catalog, or pass a path to a config.json"
    )


def test_unknown_name_without_close_match_omits_suggestion() -> None:
    with pytest.raises(ConfigError) as exc:
        catalog.entry("zzzzqqqq")
    assert str(exc.value) == (
        "unknown model 'zzzzqqqq'; HINT: run 'llmem models' for the catalog, "
        "or pass a path to a config.json"
    )


@pytest.mark.parametrize("fn", [catalog.entry, catalog.config_dict, catalog.load_config])
def test_every_accessor_rejects_unknown_names(fn) -> None:
    with pytest.raises(ConfigError, match="unknown model 'gtp2'; did you mean 'gpt2'"):
        fn("gtp2")


def test_config_dict_is_a_copy() -> None:
    cfg = catalog.config_dict("gpt2")
    cfg["n_layer"] = 1
    assert catalog.config_dict("gpt2")["n_layer"] == 12


def test_entry_is_frozen_and_serialisable() -> None:
    e = catalog.entry("mistral-7b")
    assert e.hub_id == "mistralai/Mistral-7B-v0.1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.hub_id = "x"  # type: ignore[misc]
    assert json.loads(json.dumps(e.to_dict()))["name"] == "mistral-7b"


def test_published_params_always_name_their_source() -> None:
    for name in catalog.names():
        e = catalog.entry(name)
        if e.published_params is not None:
            assert e.published_params_source


def test_a_very_long_unknown_name_is_cut_in_the_message():
    with pytest.raises(ConfigError) as e:
        catalog.load_config("x" * 5000)
    message = str(e.value)
    assert "x" * 80 + "... (5000 characters)" in message and "x" * 81 not in message
    assert len(message) < 300
