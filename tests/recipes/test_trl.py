"""TRL SFT configs: the mapping checked against TRL 1.16.0's own parser (``TrlParser``, as ``trl sft`` runs it)."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from llmem_plugin.cli import app as cli
from llmem_plugin.cli.options import EXIT_BAD_INPUT
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.recipes import read_recipe
from llmem_plugin.recipes._hf import HF_OPTIMIZERS
from tests.recipes.conftest import EXAMPLES, run_probe

CONFIGS = sorted((EXAMPLES / "trl").glob("*.yaml"))
_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def test_three_examples():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_mapping_matches_trl_parser(path):
    dpo = "dpo" in path.stem  # `trl dpo --config` for those, `trl sft --config` for the rest
    t = run_probe("trl_args.py", path, *(["--dpo"] if dpo else []))
    recipe = read_recipe(str(path))
    o = recipe.options
    assert recipe.framework.endswith("(DPOTrainer)" if dpo else "(SFTTrainer)")
    assert o["--model"] == t["model"] and o["--loss"] == "trl-fused" and o["--runner"] == "hf-trainer"
    # DPO: each pair's chosen and rejected rows are one batch (DataCollatorForPreference), scored again by the
    # reference unless its log-probs were precomputed
    rows = 2 * t["batch"] if dpo else t["batch"]
    assert (o["--seq-len"], o["--batch-size"], o["--grad-accum"]) == (t["max_length"], rows, t["accum"])
    assert o.get("--reference-model", False) == (dpo and not t["precompute_ref_log_probs"])
    assert o["--optimizer"] == HF_OPTIMIZERS[t["optim"]]
    assert o.get("--grad-checkpointing", False) == bool(t["gc"])
    assert o.get("--checkpoint-reentrant", False) == bool((t["gc_kwargs"] or {}).get("use_reentrant"))
    weights = _DTYPES[t["dtype"]]
    assert o["--precision"] == (weights if weights == "bf16" else "bf16-mixed" if t["bf16"] else "fp32")
    assert o.get("--attn") == t["attn"]
    # sft_trainer.py: padding-free is on with packing under the bfd strategies
    assert ("--packed-boundaries" in o) == bool(t["packing"] and t["packing_strategy"] in ("bfd", "bfd_split"))
    if t["use_peft"]:
        assert (o["--lora-rank"], o["--lora-alpha"]) == (t["lora_r"], t["lora_alpha"])
        # DPOConfig.disable_dropout sets every dropout's p to 0 (trl's disable_dropout_in_model)
        assert o.get("--lora-dropout", 0.0) == (0.0 if t["disable_dropout"] else t["lora_dropout"])
        targets = t["lora_target_modules"]
        assert o["--lora-targets"] == (targets if isinstance(targets, str) else ",".join(targets))
    else:
        assert "--lora-rank" not in o
    if t["load_in_4bit"]:
        assert o["--quantize"] == t["quant_type"] and o.get("--double-quant", False) == t["nested"]
        assert o["--kbit-prepare"] == "off" and o["--lora-adapter-dtype"] == "base"  # bf16 adapters
    assert not t["rest"]  # every key was a dataclass field (none left for accelerate)


def test_schema_keys_and_defaults_match_the_wheel():
    shipped = json.loads(resources.files("llmem_plugin.recipes").joinpath("trl_keys.json").read_text())
    assert shipped["defaults"] == run_probe("trl_args.py", "--keys")
    assert shipped["dpo_defaults"] == run_probe("trl_args.py", "--dpo-keys")
    assert shipped["other_keys"] == run_probe("trl_args.py", "--other-keys")


def _write(tmp_path, text):
    p = tmp_path / "sft.yaml"
    p.write_text(text)
    return str(p)


_BASE = "model_name_or_path: meta-llama/Llama-3.2-1B\ndataset_name: x\n"


def test_defaults(tmp_path):
    """TRL's defaults: fp32 weights under bf16 autocast, checkpointing on, max_length 1024, batch 8."""
    o = read_recipe(_write(tmp_path, _BASE)).options
    assert (o["--precision"], o["--grad-checkpointing"], o["--seq-len"], o["--batch-size"]) == \
        ("bf16-mixed", True, 1024, 8)


def test_peft_default_targets(tmp_path):
    """peft's per-model targets when lora_target_modules is unset: q_proj and v_proj for llama."""
    o = read_recipe(_write(tmp_path, _BASE + "use_peft: true\n")).options
    assert (o["--lora-rank"], o["--lora-alpha"], o["--lora-targets"]) == (16, 32, "q_proj,v_proj")


@pytest.mark.parametrize("extra, exc, needle", [
    ("use_liger_kernel: true\n", UnsupportedError, "use_liger_kernel"),
    ("label_smoothing_factor: 0.1\n", UnsupportedError, "label_smoothing_factor"),
    ("use_peft: true\nload_in_4bit: true\n", UnsupportedError, "dtype=float32"),  # fp32 compute, bf16 adapters
    ("padding_free: true\n", ConfigError, "padding_free"),
    ("use_peft: true\nlora_target_modules: [q_proj, lm_head]\n", ConfigError, "lm_head"),
    ("beta: 0.1\nprecompute_ref_log_probs: true\n", UnsupportedError, "precompute_ref_log_probs"),
    ("beta: 0.1\nuse_weighting: true\n", UnsupportedError, "use_weighting"),
    ("loss_type: [sigmoid, dpop]\n", ConfigError, "dpop"),
])
def test_refusals(tmp_path, extra, exc, needle):
    with pytest.raises(exc, match=needle):
        read_recipe(_write(tmp_path, _BASE + extra))


def test_packing_needs_documents(tmp_path, capsys):
    path = _write(tmp_path, _BASE + "packing: true\nattn_implementation: flash_attention_2\n")
    assert cli.main(["estimate", "--config", path]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--packed-docs" in err[0]


def test_a_saved_sftconfig_json(tmp_path):
    """SFTConfig.to_json_string(): every TrainingArguments field; those at their defaults are not listed, the
    model comes from the command line."""
    path = tmp_path / "args.json"
    run_probe("trl_args.py", "--dump", path)
    r = read_recipe(str(path))
    assert r.format == "trl" and "--model" in r.required
    assert (r.options["--batch-size"], r.options["--seq-len"], r.options["--precision"]) == (4, 512, "bf16-mixed")
    assert [n.key for n in r.not_modelled] == []


def test_a_dpo_config_is_told_from_its_keys(tmp_path):
    """A DPOConfig key (or a DPO loss type) makes the file DPOTrainer's: pairs double the rows, the reference
    forward is on; without one it is SFT."""
    for extra, dpo in (("beta: 0.1\n", True), ("loss_type: [sigmoid, sft]\n", True), ("", False)):
        recipe = read_recipe(_write(tmp_path, _BASE + "per_device_train_batch_size: 3\n" + extra))
        o = recipe.options
        assert (o["--batch-size"], o.get("--reference-model", False)) == ((6, True) if dpo else (3, False)), extra


def test_another_trainers_config_is_refused(tmp_path):
    """GRPO shares beta with DPO; its num_generations is its own: refused, not estimated as DPO."""
    with pytest.raises(UnsupportedError, match="num_generations is a GRPOConfig key.*HINT"):
        read_recipe(_write(tmp_path, _BASE + "beta: 0.04\nnum_generations: 8\n"))


def test_config_format_names_the_trl_command(tmp_path):
    path = _write(tmp_path, _BASE + "per_device_train_batch_size: 2\n")
    auto = read_recipe(path)
    assert auto.framework.endswith("(SFTTrainer)") and any("--config-format trl-dpo" in n for n in auto.notes)
    dpo = read_recipe(path, "trl-dpo")
    assert dpo.framework.endswith("(DPOTrainer)") and dpo.options["--batch-size"] == 4
    assert dpo.options["--reference-model"] is True
    assert read_recipe(str(tmp_path / "sft.yaml"), "trl-sft").options["--batch-size"] == 2
