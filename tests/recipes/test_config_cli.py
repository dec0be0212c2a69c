"""``llmem estimate/plan --config``: the file's options, the user's overrides, and one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest

from tests.cli._run import run
from tests.recipes.conftest import EXAMPLES

TORCHTUNE = str(EXAMPLES / "torchtune" / "llama3_2_1b_qlora_single_device.yaml")
_SMALL = """
base_model: {model}
adapter: lora
lora_r: 8
lora_alpha: 16
lora_target_modules: [q_proj, v_proj]
sequence_len: 128
micro_batch_size: 2
gradient_accumulation_steps: 3
learning_rate: 0.0002
datasets: [{{path: x, type: alpaca}}]
"""


def _write(tmp_path, text, name="job.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _one_error(code, err):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("text, needle", [
    (None, "no such file"),
    ("a: [1, 2\n", "cannot be read as YAML"),
    ("- 1\n- 2\n", "holds no mapping"),
    ("learning_rate: 3\n", "no Axolotl"),
])
def test_bad_files(tmp_path, capsys, text, needle):
    path = str(tmp_path / "missing.yaml") if text is None else _write(tmp_path, text)
    line = _one_error(*run(capsys, "estimate", "--config", path)[::2])
    assert needle in line


def test_model_not_in_the_catalog(tmp_path, capsys):
    path = _write(tmp_path, _SMALL.format(model="someone/finetune-7b"))
    line = _one_error(*run(capsys, "estimate", "--config", path)[::2])
    assert "base_model=someone/finetune-7b" in line and "--model-config" in line


def test_model_config_and_overrides(tmp_path, capsys):
    """--model-config names the file's model; flags after --config override the file (here the micro-batch)."""
    from llmem_plugin.models import catalog

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(catalog.config_dict("qwen2.5-0.5b")))
    path = _write(tmp_path, _SMALL.format(model="someone/qwen-copy"))
    code, out, err = run(capsys, "estimate", "--config", path, "--model-config", str(cfg), "--batch-size", "1",
                         "--fast", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["workload"]["micro_batch_size"] == 1 and d["workload"]["grad_accum_steps"] == 3
    assert d["config"]["format"] == "axolotl" and d["config"]["options"]["--batch-size"] == 2


def test_config_format_forced(tmp_path, capsys):
    line = _one_error(*run(capsys, "estimate", "--config", TORCHTUNE, "--config-format", "axolotl")[::2])
    assert "base_model" in line  # read as Axolotl, the file lacks Axolotl's model key


def test_model_config_without_config(capsys):
    line = _one_error(*run(capsys, "estimate", "--model-config", "x.json", "--model", "gpt2")[::2])
    assert "--model-config" in line


def test_plan_takes_the_global_batch(tmp_path, capsys):
    """plan searches micro-batch and checkpointing; the file's micro-batch x accumulation x GPUs is the global
    batch."""
    path = _write(tmp_path, _SMALL.format(model="qwen2.5-0.5b"))
    code, out, err = run(capsys, "plan", "--config", path, "--gpus", "2", "--gpu", "a100-80gb", "--no-verify",
                         "--methods", "ddp", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["global_batch"] == 2 * 3 * 2 and d["config"]["format"] == "axolotl"


def test_plan_refuses_what_it_does_not_search(tmp_path, capsys):
    path = _write(tmp_path, _SMALL.format(model="qwen2.5-0.5b").replace("adapter: lora", "adapter: lora\n"
                  "sample_packing: true\nattn_implementation: flash_attention_2"))
    line = _one_error(*run(capsys, "plan", "--config", path, "--packed-docs", "4")[::2])
    assert "does not search" in line or "--packed-docs" in line


def test_a_bad_value_names_its_key(tmp_path, capsys):
    path = _write(tmp_path, _SMALL.format(model="qwen2.5-0.5b").replace("micro_batch_size: 2", "micro_batch_size: 0"))
    line = _one_error(*run(capsys, "estimate", "--config", path)[::2])
    assert "--batch-size" in line and "job.yaml: micro_batch_size" in line


def test_plan_refuses_a_dpo_config_in_one_line(capsys):
    # the planner's profiles are 1 and 2 rows; DPO's rows come in chosen/rejected pairs
    dpo = str(EXAMPLES / "trl" / "qwen2_5_0_5b_dpo_lora.yaml")
    line = _one_error(*run(capsys, "plan", "--config", dpo, "--gpus", "1", "--gpu", "h100-sxm")[::2])
    assert "does not search TRL DPO's paired rows" in line and "HINT" in line
