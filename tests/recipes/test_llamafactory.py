"""LLaMA-Factory YAMLs: the mapping checked against LLaMA-Factory 0.9.5's own parser (``get_train_args``)."""

from __future__ import annotations

import math

import pytest
import yaml

from llmem_plugin.errors import UnsupportedError
from llmem_plugin.recipes import read_recipe
from llmem_plugin.recipes._hf import HF_OPTIMIZERS
from tests.recipes.conftest import EXAMPLES, run_probe

CONFIGS = sorted((EXAMPLES / "llamafactory").glob("*.yaml"))
_ATTN = {"auto": None, "sdpa": "sdpa", "disabled": "eager", "fa2": "flash_attention_2"}


def test_three_examples():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_mapping_matches_llamafactory_parser(path):
    lf = run_probe("llamafactory_args.py", path)
    o = read_recipe(str(path)).options
    seq = lf["cutoff_len"] if lf["stage"] == "pt" else 8 * math.ceil(lf["cutoff_len"] / 8)
    assert o["--seq-len"] == seq
    assert (o["--batch-size"], o["--grad-accum"]) == (lf["batch"], lf["accum"])
    assert o["--optimizer"] == HF_OPTIMIZERS[lf["optim"]]
    assert o.get("--grad-checkpointing", False) == lf["gradient_checkpointing"]
    assert o.get("--checkpoint-reentrant", False) == (lf["gradient_checkpointing"] and lf["use_reentrant_gc"])
    assert o.get("--attn") == _ATTN[lf["flash_attn"]]
    zero3 = "deepspeed" in yaml.safe_load(path.read_text())
    if lf["finetuning_type"] == "lora":
        assert (o["--lora-rank"], o["--lora-alpha"]) == (lf["lora_rank"], lf["lora_alpha"])
        assert (o.get("--lora-dropout") or 0.0) == lf["lora_dropout"]
        assert o["--lora-targets"] == ("all-linear" if lf["lora_target"] == ["all"] else ",".join(lf["lora_target"]))
        # model/adapter.py: trainable parameters to fp32 unless pure_bf16 or ZeRO-3 without quantization
        upcast = not lf["pure_bf16"] and not (zero3 and lf["quantization_bit"] is None)
        assert o["--lora-adapter-dtype"] == ("fp32" if upcast else "base")
        assert o["--precision"] == "bf16"  # the bf16 checkpoint's frozen weights
    else:
        assert "--lora-rank" not in o
        # full: every parameter upcast to fp32 (bf16 autocast over it), except under ZeRO-3
        assert o["--precision"] == ("bf16" if zero3 or lf["pure_bf16"] else "bf16-mixed" if lf["bf16"] else "fp32")
    if lf["quantization_bit"] == 4:
        assert o["--quantize"] == lf["quantization_type"]
        assert o.get("--double-quant", False) == lf["double_quantization"]
        assert o["--kbit-prepare"] == ("norms-only" if lf["upcast_layernorm"] else "off")
    else:
        assert "--quantize" not in o


def test_schema_keys_match_the_wheel():
    import json
    from importlib import resources

    shipped = json.loads(resources.files("llmem_plugin.recipes").joinpath("llamafactory_keys.json").read_text())
    assert shipped["keys"] == run_probe("llamafactory_args.py", "--keys")


def _write(tmp_path, text):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return str(p)


_BASE = "model_name_or_path: meta-llama/Llama-3.2-1B\nstage: sft\ncutoff_len: 1000\nbf16: true\n"


def test_defaults(tmp_path):
    """finetuning_type lora (rank 8, alpha 16, all linear layers), reentrant checkpointing on, batch 8 (HF)."""
    o = read_recipe(_write(tmp_path, _BASE)).options
    assert (o["--lora-rank"], o["--lora-alpha"], o["--lora-targets"]) == (8, 16, "all-linear")
    assert o["--grad-checkpointing"] and o["--checkpoint-reentrant"]
    assert (o["--batch-size"], o["--seq-len"]) == (8, 1000)


def test_packing_shortens_cutoff(tmp_path):
    """data_args.py: with packing, cutoff_len - 1, then padded to a multiple of 8."""
    o = read_recipe(_write(tmp_path, _BASE.replace("1000", "1001") + "packing: true\n")).options
    assert o["--seq-len"] == 1000


@pytest.mark.parametrize("extra, needle", [
    ("use_unsloth: true\n", "use_unsloth"),
    ("finetuning_type: freeze\n", "finetuning_type=freeze"),
    ("neat_packing: true\n", "neat_packing"),
    ("flash_attn: fa3\n", "flash_attn=fa3"),
])
def test_refusals(tmp_path, extra, needle):
    with pytest.raises(UnsupportedError, match=needle):
        read_recipe(_write(tmp_path, _BASE + extra))


def test_preference_stages_refused(tmp_path):
    with pytest.raises(UnsupportedError, match="stage=dpo"):
        read_recipe(_write(tmp_path, _BASE.replace("stage: sft", "stage: dpo")))


def test_unknown_key_listed(tmp_path):
    r = read_recipe(_write(tmp_path, _BASE + "lora_rnak: 8\nsave_steps: 10\n"))
    listed = {n.key: n.why for n in r.not_modelled}
    assert "rejects" in listed["lora_rnak"] and "save_steps" not in listed
