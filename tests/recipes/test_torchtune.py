"""torchtune recipe configs: the mapping checked against torchtune 0.6.1's own loader and builders."""

from __future__ import annotations

import pytest

from llmem_plugin.cli import app as cli
from llmem_plugin.cli import options
from llmem_plugin.errors import ConfigError, UnsupportedError
from llmem_plugin.models.modelbuild import build_model
from llmem_plugin.recipes import read_recipe
from tests.recipes.conftest import EXAMPLES, run_probe

CONFIGS = sorted((EXAMPLES / "torchtune").glob("*.yaml"))


def _workload(recipe):
    args = cli.build_parser().parse_args(["estimate", *recipe.argv()])
    options.choose_precision(args)
    return args, options.build_workload(args)


def test_three_examples():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_mapping_matches_torchtune_builders(path):
    """torchtune's instantiate builds the model, loss and optimizer the file names; the estimate's model has the
    same trainable parameters in the same dtype, the same LoRA'd layers and NF4 weights, and the same loss and
    optimizer."""
    tt = run_probe("torchtune_model.py", path)
    recipe = read_recipe(str(path))
    args, wl = _workload(recipe)
    model = build_model(args.model, wl)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in trainable) == tt["trainable"]
    assert sorted({str(p.dtype) for p in trainable}) == (tt["adapter_dtypes"] or sorted({str(p.dtype)
                                                                                         for p in trainable}))
    if wl.lora is not None:
        assert tt["adapter_dtypes"] == [str(wl.precision.param_dtype)]  # torchtune builds adapters in dtype
        names = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj",
                 "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj", "output": "lm_head"}
        ours = {n.rsplit(".", 4)[-4] for n, _ in model.named_parameters() if n.endswith("lora_A.default.weight")}
        assert ours == {names[n] for n in tt["lora_layers"]}
    else:
        assert sum(p.numel() for p in model.parameters()) == tt["params"]
    assert sum(type(m).__name__ == "NF4LinearStandIn" for m in model.modules()) == tt["nf4_weights"]
    assert (wl.loss.value == "chunked") == (tt["loss"] == "CEWithChunkedOutputLoss")
    if tt["loss_chunks"]:
        assert wl.loss_chunks == tt["loss_chunks"]
    expected = {"torch.optim.adamw.AdamW": "adamw-fused" if tt["fused"] else "adamw",
                "bitsandbytes.optim.adamw.PagedAdamW8bit": "paged-adamw8bit"}[tt["optimizer"]]
    assert wl.optimizer.value == expected


def _write(tmp_path, text):
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return str(p)


_BASE = """
model:
  _component_: torchtune.models.llama3_2.lora_llama3_2_1b
  lora_attn_modules: ['q_proj', 'v_proj']
tokenizer:
  max_seq_len: 1024
batch_size: 2
gradient_accumulation_steps: 1
optimizer:
  _component_: torch.optim.AdamW
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
dtype: bf16
"""


def test_builder_defaults_apply(tmp_path):
    """Keys the YAML leaves out take lora_llama3_2_1b's signature defaults: rank 8, alpha 16, no MLP."""
    r = read_recipe(_write(tmp_path, _BASE))
    assert r.options["--lora-rank"] == 8 and r.options["--lora-alpha"] == 16
    assert r.options["--lora-targets"] == "q_proj,v_proj"
    assert r.options["--optimizer"] == "adamw"  # torch's AdamW without fused: foreach


@pytest.mark.parametrize("extra, exc, needle", [
    ("dataset:\n  packed: True\n", UnsupportedError, "dataset.packed"),
    ("compile: True\n", None, "compile"),
    ("optimizer_in_bwd: True\n", None, "optimizer_in_bwd"),
    ("my_typo: 3\n", None, "my_typo"),
    ("fsdp_reshard_after_forward: False\n", UnsupportedError, "fsdp_reshard_after_forward"),
])
def test_unmodelled_keys(tmp_path, extra, exc, needle):
    path = _write(tmp_path, _BASE + extra)
    if exc is not None:
        with pytest.raises(exc, match=needle):
            read_recipe(path)
    else:
        assert needle in {n.key for n in read_recipe(path).not_modelled}


def test_fp16_refused(tmp_path):
    with pytest.raises(ConfigError, match="dtype=fp16"):
        read_recipe(_write(tmp_path, _BASE.replace("dtype: bf16", "dtype: fp16")))


def test_null_max_seq_len_needs_seq_len(tmp_path, capsys):
    path = _write(tmp_path, _BASE.replace("max_seq_len: 1024", "max_seq_len: null"))
    assert cli.main(["estimate", "--config", path]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_seq_len is null" in err[0] and "--seq-len" in err[0]
