"""Axolotl configs: the mapping checked against Axolotl 0.19.0's own validation (``validate_config``)."""

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

CONFIGS = sorted((EXAMPLES / "axolotl").glob("*.yaml"))


def test_three_examples():
    assert len(CONFIGS) >= 3


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda p: p.stem)
def validated(request):
    return request.param, run_probe("axolotl_config.py", request.param)


def test_mapping_matches_axolotl_validation(validated):
    """Every memory key as Axolotl's validation leaves it (defaults filled, legacy switches rewritten, LoRA kernels
    auto-enabled) is the option the reader chose."""
    path, out = validated
    ax = out["cfg"]
    r = read_recipe(str(path))
    o = r.options
    assert o["--seq-len"] == ax["sequence_len"]
    assert o["--batch-size"] == ax["micro_batch_size"]
    assert o["--grad-accum"] == ax["gradient_accumulation_steps"]
    assert o["--optimizer"] == HF_OPTIMIZERS[ax["optimizer"]]
    assert o.get("--grad-checkpointing", False) == bool(ax.get("gradient_checkpointing"))
    assert o.get("--attn", None) == ax.get("attn_implementation")
    assert o["--precision"] == ("bf16" if ax.get("bf16") else "fp32")
    if ax.get("adapter"):
        assert o["--lora-rank"] == ax["lora_r"] and o["--lora-alpha"] == ax["lora_alpha"]
        assert (o.get("--lora-dropout") or 0.0) == ax["lora_dropout"]
        targets = "all-linear" if ax.get("lora_target_linear") else ",".join(ax["lora_target_modules"])
        assert o["--lora-targets"] == targets
        assert ("--quantize" in o) == bool(ax["adapter"] == "qlora" and ax.get("load_in_4bit"))
    else:
        assert "--lora-rank" not in o
    kernels = {k for k in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel") if ax.get(k)}
    assert kernels == {n.key for n in r.not_modelled if n.key.endswith("_kernel")}
    assert ("--packed-boundaries" in o) == bool(ax.get("sample_packing"))
    assert ("--deepspeed-config" in o) == bool(ax.get("deepspeed"))


def test_schema_keys_match_the_wheel(validated):
    _, out = validated
    shipped = json.loads(resources.files("llmem_plugin.recipes").joinpath("axolotl_keys.json").read_text())["keys"]
    plugin_keys = {k for k in shipped if k.startswith("liger_")} | {"cut_cross_entropy"}
    assert set(shipped) - plugin_keys == set(out["schema_keys"])


def _write(tmp_path, text):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return str(p)


_BASE = """
base_model: meta-llama/Llama-3.2-1B
adapter: lora
lora_r: 8
lora_target_modules: [q_proj, v_proj]
sequence_len: 1024
learning_rate: 0.0002
datasets: [{path: x, type: alpaca}]
"""


def test_schema_defaults(tmp_path):
    """Unset keys take the schema's defaults: micro-batch 1, accumulation 1, adamw_torch_fused, bf16 auto,
    no checkpointing; peft's lora_alpha 8."""
    r = read_recipe(_write(tmp_path, _BASE))
    o = r.options
    assert (o["--batch-size"], o["--grad-accum"], o["--optimizer"], o["--precision"]) == (1, 1, "adamw-fused", "bf16")
    assert "--grad-checkpointing" not in o and o["--lora-alpha"] == 8
    assert r.bf16_key == "bf16=auto"


@pytest.mark.parametrize("extra, exc, needle", [
    ("rl: dpo\n", UnsupportedError, "rl=dpo"),
    ("peft_use_dora: true\n", UnsupportedError, "peft_use_dora"),
    ("sample_packing: true\n", UnsupportedError, "sample_packing"),  # under sdpa
    ("plugins: [axolotl.integrations.foo.FooPlugin]\n", UnsupportedError, "FooPlugin"),
])
def test_refusals(tmp_path, extra, exc, needle):
    with pytest.raises(exc, match=needle):
        read_recipe(_write(tmp_path, _BASE + extra))


def test_reentrant_checkpointing(tmp_path):
    o = read_recipe(_write(tmp_path, _BASE + "gradient_checkpointing: true\n"
                                              "gradient_checkpointing_kwargs: {use_reentrant: true}\n")).options
    assert o["--grad-checkpointing"] and o["--checkpoint-reentrant"]


def test_fp16_turns_bf16_auto_off(tmp_path):
    """utils/config resolve_dtype: fp16 with bf16 auto loads fp16 weights, which are refused."""
    with pytest.raises(UnsupportedError, match="fp16 weights"):
        read_recipe(_write(tmp_path, _BASE + "fp16: true\n"))


@pytest.mark.parametrize("extra, key", [
    ("gradient_checkpointing_kwargs: [x]\n", "gradient_checkpointing_kwargs"),
    ("lora_target_modules: [1, 2]\n", "lora_target_modules"),
    ("sequence_len: '1024'\n", "sequence_len"),
    ("attn_implementation: [sdpa]\n", "attn_implementation"),
    ("fsdp_config: [a]\n", "fsdp_config"),
    ("plugins: axolotl.integrations.liger.LigerPlugin\n", "plugins"),
])
def test_wrong_types_are_one_line(tmp_path, capsys, extra, key):
    from tests.cli._run import run

    text = _BASE.replace("lora_target_modules: [q_proj, v_proj]\n", "") if "lora_target" in extra else _BASE
    text = text.replace("sequence_len: 1024\n", "") if "sequence_len" in extra else text
    code, _, err = run(capsys, "estimate", "--config", _write(tmp_path, text + extra))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and key in lines[0], err


def test_qlora_needs_4bit(tmp_path):
    """utils/schemas/peft.py: qlora requires load_in_4bit."""
    with pytest.raises(ConfigError, match="adapter=qlora"):
        read_recipe(_write(tmp_path, _BASE.replace("adapter: lora", "adapter: qlora")))


def test_full_finetune_under_sdpa_refused(tmp_path):
    """Axolotl keeps norms, embeddings and head in fp32 for a bf16 full fine-tune under sdpa (mixed dtypes)."""
    text = _BASE.replace("adapter: lora\nlora_r: 8\nlora_target_modules: [q_proj, v_proj]\n", "")
    with pytest.raises(UnsupportedError, match="mixed-dtype"):
        read_recipe(_write(tmp_path, text))
    r = read_recipe(_write(tmp_path, text + "attn_implementation: flash_attention_2\n"))
    assert r.options["--precision"] == "bf16"


def test_unknown_key_listed(tmp_path):
    r = read_recipe(_write(tmp_path, _BASE + "my_typo_key: 3\nsave_steps: 10\n"))
    listed = {n.key: n.why for n in r.not_modelled}
    assert "my_typo_key" in listed and "Axolotl drops it" in listed["my_typo_key"]
    assert "save_steps" not in listed


def test_bf16_on_a_gpu_without_it(tmp_path, capsys):
    path = _write(tmp_path, _BASE)
    assert cli.main(["estimate", "--config", path, "--gpu", "v100-32gb"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bf16=auto" in err[0] and "lacks" in err[0]


def test_packing_needs_documents(tmp_path, capsys):
    path = _write(tmp_path, _BASE + "sample_packing: true\nattn_implementation: flash_attention_2\n")
    assert cli.main(["estimate", "--config", path]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--packed-docs" in err[0]
