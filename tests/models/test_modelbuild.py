"""Reading and checking model configs before anything is built."""

from __future__ import annotations

import json

import pytest
import transformers

from llmem_plugin.models import catalog
from llmem_plugin.errors import ConfigError
from llmem_plugin.models.config import check_config, num_layers, resolve_config, set_num_layers
from llmem_plugin.models.modelbuild import build_model, default_precision
from llmem_plugin.workload import Workload

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def write(tmp_path, fields, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(fields))
    return str(path)


@pytest.mark.parametrize("config_class", [transformers.Mamba2Config, transformers.FalconH1Config])
def test_tagged_infinity_reads_as_transformers_reads_it(tmp_path, config_class):
    # transformers 5 saves time_step_limit's upper bound as {"__float__": "Infinity"}
    # (configuration_utils._encode_special_floats); its own reader is the reference.
    config_class().save_pretrained(tmp_path)
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    ours = resolve_config(str(tmp_path))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert tuple(ours.time_step_limit) == tuple(theirs.time_step_limit) == (0.0, float("inf"))


@pytest.mark.parametrize("name", catalog.names())
def test_every_catalog_config_saved_by_transformers_is_accepted(tmp_path, name):
    # No false alarm: a complete config as save_pretrained writes it passes every check.
    catalog.load_config(name).save_pretrained(tmp_path)
    config = resolve_config(str(tmp_path))
    assert num_layers(config) == num_layers(catalog.load_config(name))


def test_config_with_only_model_type_is_refused_not_filled_with_defaults(tmp_path):
    # transformers would build LlamaConfig's defaults: Llama-2-7B's 6.74B parameters.
    with pytest.raises(ConfigError) as info:
        resolve_config(write(tmp_path, {"model_type": "llama"}))
    msg = str(info.value)
    assert "has no hidden_size, num_hidden_layers, vocab_size, num_attention_heads" in msg
    assert "hidden_size=4096" in msg and "HINT" in msg and "\n" not in msg


def test_missing_field_under_its_attribute_map_name(tmp_path):
    # GPT-2 names its layer count n_layer (GPT2Config.attribute_map).
    fields = {"model_type": "gpt2", "n_embd": 64, "n_head": 2, "vocab_size": 256}
    with pytest.raises(ConfigError, match="has no num_hidden_layers"):
        resolve_config(write(tmp_path, fields))
    assert resolve_config(write(tmp_path, {**fields, "n_layer": 3})).num_hidden_layers == 3


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("num_hidden_layers", -2, "num_hidden_layers must be an integer in [1, 1024], got -2"),
    ("num_hidden_layers", "2", "num_hidden_layers must be an integer in [1, 1024], got '2'"),
    ("num_hidden_layers", 100000, "num_hidden_layers must be an integer in [1, 1024], got 100000"),
    ("hidden_size", 0, "hidden_size must be an integer in [1, 262144], got 0"),
    ("hidden_size", 64.0, "hidden_size must be an integer in [1, 262144], got 64.0"),
    ("hidden_size", None, "hidden_size must be an integer in [1, 262144], got None"),
    ("hidden_size", True, "hidden_size must be an integer in [1, 262144], got True"),
    ("hidden_size", [64], "hidden_size must be an integer in [1, 262144], got [64]"),
    ("hidden_size", {"__float__": "Infinity"}, "hidden_size must be an integer in [1, 262144], got inf"),
    ("num_attention_heads", 0, "num_attention_heads must be an integer in [1, 16384], got 0"),
    ("num_key_value_heads", 0, "num_key_value_heads must be an integer in [1, 16384], got 0"),
    ("num_attention_heads", 5, "num_attention_heads 5 does not divide hidden_size 64"),
    ("num_key_value_heads", 3, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ("torch_dtype", "float33", "torch_dtype 'float33' is not a torch dtype"),
    ("vocab_size", 10**12, "vocab_size must be an integer in [1, 16777216]"),
])
def test_bad_field_is_named_before_building(tmp_path, field, value, fragment):
    with pytest.raises(ConfigError) as info:
        resolve_config(write(tmp_path, {**TINY, field: value}))
    msg = str(info.value)
    assert fragment in msg and "HINT" in msg and "\n" not in msg


def test_deeply_nested_json_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "llama", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}")
    with pytest.raises(ConfigError, match="nested too deeply"):
        resolve_config(str(path))


def test_check_config_on_a_pretrained_config():
    config = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    check_config(config)
    config.num_hidden_layers = -2
    with pytest.raises(ConfigError, match="num_hidden_layers must be an integer"):
        resolve_config(config)


def test_head_dim_given_lets_heads_not_divide_the_width(tmp_path):
    # Qwen3/Gemma set head_dim explicitly; then heads x head_dim need not equal hidden_size.
    config = resolve_config(write(tmp_path, {**TINY, "model_type": "qwen3", "num_attention_heads": 6,
                                             "num_key_value_heads": 2, "head_dim": 16}))
    assert config.head_dim == 16


@pytest.mark.parametrize(("name", "expected"), [
    ("qwen3-30b-a3b", "bf16"), ("mixtral-8x7b", "bf16"), ("llama-3.2-1b", "bf16-mixed"), ("gpt2", "bf16-mixed"),
])
def test_default_precision_works_for_the_model(name, expected):
    precision, why = default_precision(name)
    assert precision == expected
    assert (why is None) == (expected == "bf16-mixed")
    # The builder's own check (grouped_mm takes bf16 weights on CUDA) accepts the default.
    one_layer = set_num_layers(catalog.load_config(name), 1)
    build_model(one_layer, Workload(precision=precision, seq_len=1024))  # GPT-2 learns 1,024 positions
    if expected == "bf16":
        with pytest.raises(ConfigError, match="grouped_mm"):
            build_model(one_layer, Workload(precision="bf16-mixed"))


def test_a_validator_of_transformers_is_one_config_error(tmp_path):
    # LlamaConfig's own validate_architecture (a huggingface_hub strict-dataclass
    # validator) rejects heads that do not divide the width even with head_dim.
    with pytest.raises(ConfigError, match="malformed config .*not a multiple of the number of attention heads"):
        resolve_config(write(tmp_path, {**TINY, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16}))


@pytest.mark.parametrize("text", ["/nonexistent/config.json", "nonexistent_dir/", "a/b/c", "./config.json"])
def test_missing_path_is_named_as_a_path_not_an_unknown_model(tmp_path, monkeypatch, text):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"model path '{text}' does not exist"):
        resolve_config(text)


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="holds no config.json"):
        resolve_config(str(tmp_path))


def test_home_relative_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path, TINY)
    assert resolve_config("~/config.json").hidden_size == 64


@pytest.mark.parametrize(("name", "limit", "table"), [
    # Each published config's position table: GPT-2 n_positions 1024 (wpe); OPT max_position_embeddings 2048 in a
    # table of 2050 rows (OPTLearnedPositionalEmbedding's offset 2); BART 1024 (offset 2); BERT 512; RoBERTa 514
    # rows whose ids start after padding_idx 1 (create_position_ids_from_input_ids).
    ("gpt2", 1024, "wpe"), ("opt-125m", 2048, "embed_positions"), ("bart-base", 1024, "embed_positions"),
    ("bert-base-uncased", 512, "position_embeddings"), ("roberta-base", 512, "position_embeddings"),
])
def test_a_sequence_longer_than_the_learned_positions_is_refused(name, limit, table):
    one_layer = set_num_layers(catalog.load_config(name), 1)
    build_model(one_layer, Workload(seq_len=limit))
    with pytest.raises(ConfigError, match=rf"seq_len {limit + 1} is longer than the {limit} positions .*{table}.*"
                                          rf"HINT: use --seq-len {limit} or less"):
        build_model(one_layer, Workload(seq_len=limit + 1))


def test_rotary_positions_set_no_limit():
    one_layer = set_num_layers(catalog.load_config("llama-3.2-1b"), 1)
    build_model(one_layer, Workload(seq_len=4 * catalog.load_config("llama-3.2-1b").max_position_embeddings))


def test_a_packed_row_counts_its_longest_document():
    """Packed rows restart the position ids at each document (techniques.packing.packed_batch)."""
    one_layer = set_num_layers(catalog.load_config("gpt2"), 1)
    build_model(one_layer, Workload(seq_len=2048, packed_docs=2))  # two documents of 1,024
    with pytest.raises(ConfigError, match="a packed document of 2048 tokens is longer than the 1024 positions"):
        build_model(one_layer, Workload(seq_len=2048, packed_docs=1))
