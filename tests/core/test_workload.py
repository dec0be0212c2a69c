"""Workload settings of the low-memory techniques: validation, serialisation, CLI mapping."""

from __future__ import annotations

import pytest

from llmem_plugin.cli import EXIT_BAD_INPUT, main
from llmem_plugin.errors import ConfigError
from llmem_plugin.workload import (
    ActivationOffload,
    LoraSpec,
    LossImpl,
    OptimizerKind,
    Quantization,
    Runner,
    Workload,
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


def test_cli_flags_reach_the_workload(monkeypatch):
    from llmem_plugin import cli

    seen = {}

    def fake_estimate(model, workload, **_):
        seen["wl"] = workload
        raise ConfigError("stop here")

    import sys

    monkeypatch.setattr(sys.modules["llmem_plugin.estimate"], "estimate", fake_estimate)
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
