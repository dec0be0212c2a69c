"""Workload settings of the low-memory techniques: validation, serialisation, CLI mapping."""

from __future__ import annotations

import dataclasses

import pytest

from llmem_plugin.cli.app import main
from llmem_plugin.cli.options import EXIT_BAD_INPUT
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.workload import (
    MAX_GRAD_ACCUM_STEPS,
    ActivationOffload,
    LoraSpec,
    LossImpl,
    OptimizerKind,
    Precision,
    Quantization,
    Runner,
    Workload,
    parse_precision,
)

LORA = LoraSpec(rank=8)


def test_defaults_change_nothing():
    wl = Workload()
    assert wl.quantize is None and not wl.double_quant and wl.loss is LossImpl.HF
    assert wl.logits_to_keep == 0 and wl.offload_activations is None and not wl.reference_model


def test_strings_become_enums():
    wl = Workload(quantize="NF4", double_quant=True, lora=LORA, loss="liger", offload_activations="save-on-cpu",
                  optimizer="paged-adamw8bit", runner="lightning", attn_implementation="flash_attention_2")
    assert wl.quantize is Quantization.NF4 and wl.loss is LossImpl.LIGER
    assert wl.offload_activations is ActivationOffload.SAVE_ON_CPU
    assert wl.optimizer is OptimizerKind.PAGED_ADAMW_8BIT and wl.optimizer.is_bitsandbytes
    assert wl.runner is Runner.LIGHTNING


@pytest.mark.parametrize("kwargs, message", [
    ({"quantize": "nf4"}, "trains LoRA adapters only. HINT: add --lora-rank"),
    ({"quantize": "int8", "double_quant": True, "lora": LORA}, "4-bit weights only. HINT: pass --quantize nf4"),
    ({"double_quant": True}, "4-bit weights only"),
    ({"quantize": "nf3", "lora": LORA}, "unsupported quantization 'nf3'; did you mean 'nf4'?"),
    ({"loss": "fused"}, "unsupported loss 'fused'"),
    ({"offload_activations": "disk"}, "unsupported activation offload 'disk'"),
    ({"logits_to_keep": -1}, "logits_to_keep must be an integer >= 0"),
    ({"loss_chunks": 0}, "loss_chunks must be an integer >= 1"),
    ({"seq_len": 64, "logits_to_keep": 65}, "logits_to_keep 65 exceeds seq_len 64"),
])
def test_bad_settings_name_the_value_and_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        Workload(**kwargs)


def test_to_dict_round_trips_through_the_constructor():
    wl = Workload(quantize="fp4", double_quant=True, lora=LORA, loss="chunked", loss_chunks=4, logits_to_keep=16,
                  offload_activations="streamed", reference_model=True, optimizer="adamw8bit")
    d = wl.to_dict()
    lora = d.pop("lora")
    back = Workload(**d, lora=LoraSpec(rank=lora["rank"], alpha=lora["alpha"],
                                       target_modules=tuple(lora["target_modules"]), dropout=lora["dropout"]))
    assert back.to_dict() == d | {"lora": lora} and back.quantize is wl.quantize
    assert set(d) | {"lora"} == {f.name for f in dataclasses.fields(Workload)}  # every field carried


def test_to_dict_carries_packing():
    wl = Workload(seq_len=64, packed_docs=4, packed_boundaries="positions", attn_implementation="flash_attention_2")
    assert Workload(**wl.to_dict()) == wl


def test_cli_flags_reach_the_workload(monkeypatch):
    from llmem_plugin.cli import app as cli

    seen = {}

    def fake_estimate(model, workload, **_):
        seen["wl"] = workload
        raise ConfigError("stop here")

    import importlib

    # The module, not the package's re-exported function of the same name.
    monkeypatch.setattr(importlib.import_module("llmem_plugin.estimate"), "estimate", fake_estimate)
    code = cli.main(["estimate", "--model", "gpt2", "--quantize", "nf4", "--double-quant", "--lora-rank", "4",
                     "--loss", "chunked", "--loss-chunks", "4", "--logits-to-keep", "8", "--offload-activations",
                     "--reference-model", "--optimizer", "paged-adamw"])
    assert code == EXIT_BAD_INPUT
    wl = seen["wl"]
    assert (wl.quantize, wl.double_quant, wl.loss, wl.loss_chunks, wl.logits_to_keep) == (
        Quantization.NF4, True, LossImpl.CHUNKED, 4, 8)
    # A bare --offload-activations means the streamed (TRL/torchtune) context.
    assert wl.offload_activations is ActivationOffload.STREAMED and wl.reference_model
    assert wl.optimizer is OptimizerKind.PAGED_ADAMW


def test_cli_bad_technique_is_one_line_exit_2(capsys):
    code = main(["estimate", "--model", "gpt2", "--quantize", "nf4"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT
    assert err.count("\n") == 1 and "HINT: add --lora-rank 16" in err and "Traceback" not in err


# Lightning's own table (lightning/fabric/plugins/precision/precision.py,
# _PRECISION_INPUT; aliases via connector.py _convert_precision_to_unified_args).
@pytest.mark.parametrize("given, expected", [
    ("bf16-true", Precision.BF16),  # HalfPrecision(bfloat16): the module is cast to bf16
    ("bf16-mixed", Precision.BF16_MIXED),
    ("16-mixed", Precision.FP16_MIXED),
    ("32-true", Precision.FP32),
    (16, Precision.FP16_MIXED),  # legacy alias "16" -> "16-mixed"
    (32, Precision.FP32),
    ("bf16", Precision.BF16),  # this project's name, not Lightning's legacy alias
])
def test_lightning_precisions_map_as_lightning_defines_them(given, expected):
    assert Workload(precision=given).precision is expected
    assert parse_precision(given) is expected


def test_lightning_table_is_covered():
    from typing import get_args

    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_INT, _PRECISION_INPUT_STR

    for value in (*get_args(_PRECISION_INPUT_STR), *get_args(_PRECISION_INPUT_INT)):
        try:
            parse_precision(value)
        except UnsupportedError as e:
            assert "is not modelled" in str(e) and "HINT" in str(e)


@pytest.mark.parametrize("given", ["16-true", "64-true", "transformer-engine", 64])
def test_unmodelled_lightning_precisions_are_refused(given):
    with pytest.raises(UnsupportedError, match="is not modelled. HINT"):
        Workload(precision=given)


def test_lora_dict_and_peft_config_map_onto_the_spec():
    import peft

    spec = LoraSpec(rank=8, alpha=16, target_modules=("q_proj",), dropout=0.1)
    assert Workload(lora={"rank": 8, "alpha": 16, "target_modules": ["q_proj"], "dropout": 0.1}).lora == spec
    assert Workload(lora={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "lora_dropout": 0.1}).lora == spec
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], lora_dropout=0.1)
    assert Workload(lora=cfg).lora == spec
    # A comma-separated string is a list of names, not of characters.
    assert LoraSpec(target_modules="q_proj, v_proj").target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize("lora, message", [
    ({"rank": 8, "bias": "none"}, r"lora keys \['bias'\] not understood"),
    ({"r": 8, "rank": 8}, "gives a field twice"),
    ("q_proj", "lora must be a LoraSpec, a dict or a peft LoraConfig, got str"),
    ({"rank": 8, "alpha": float("nan")}, "LoRA alpha must be a finite number > 0"),
    ({"rank": 8, "alpha": float("inf")}, "LoRA alpha must be a finite number > 0"),
    ({"rank": 8, "target_modules": [1, 2]}, "LoRA target modules must be module names"),
])
def test_bad_lora_is_one_config_error(lora, message):
    with pytest.raises(ConfigError, match=message):
        Workload(lora=lora)


def test_peft_config_resolved_per_model_is_refused():
    import peft

    with pytest.raises(ConfigError, match="resolved by peft per model"):
        Workload(lora=peft.LoraConfig(r=8))  # target_modules=None: peft's per-architecture table


def test_grad_accum_is_bounded_by_the_int64_scalar():
    assert Workload(grad_accum_steps=MAX_GRAD_ACCUM_STEPS).grad_accum_steps == 2**63 - 1
    with pytest.raises(ConfigError, match="exceeds 9,223,372,036,854,775,807"):
        Workload(grad_accum_steps=99999999999999999999)
