"""`llmem` command line: offline estimates for the whole catalog, JSON shape, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmem_plugin.models import catalog
from llmem_plugin.models.config import count_parameters
from llmem_plugin.cli.options import EXIT_BAD_INPUT, EXIT_WONT_FIT

from ._run import run

MOE = {"mixtral-8x7b", "qwen3-30b-a3b"}




@pytest.mark.parametrize("name", catalog.names())
def test_estimate_runs_offline_on_every_catalog_model(capsys, monkeypatch, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The default precision works for every catalog model: bf16 for the MoE
    # models (grouped_mm experts take bf16 weights only), said on stderr.
    precision = "bf16" if name in MOE else "bf16-mixed"
    code, out, err = run(capsys, "estimate", "--model", name, "--seq-len", "256", "--gpu-memory", "16TiB",
                         "--fast", "--json")
    assert code == 0, err
    assert ("precision bf16 (the default for this model" in err) == (name in MOE), err
    data = json.loads(out)
    params, _ = count_parameters(catalog.load_config(name))
    assert data["params"] == params == data["trainable_params"]
    assert data["peak_phase"] in {"forward", "backward", "optimizer"}
    assert sum(data["breakdown"].values()) == data["peak_tensor_bytes"]
    # Model states alone: weights + grads (+ two AdamW states in the param dtype).
    per_param = 2 + 2 + 4 if precision == "bf16" else 4 + 4 + 8
    assert data["peak_tensor_bytes"] >= per_param * params
    assert data["seconds"] > 0


def test_estimate_reports_three_numbers_per_gpu(capsys):
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "128", "--json")
    assert code == 0, err
    d = json.loads(out)
    ov = d["overheads"]
    # H100 (sm90): two 32 MiB cuBLAS workspaces through the allocator
    # (CublasHandlePool.cpp), each in its own 32 MiB segment (>= kMinLargeAlloc).
    assert ov["cublas_workspace_bytes"] == 32 * 2**20 and ov["num_cublas_workspaces"] == 2
    workspaces = 2 * ov["cublas_workspace_bytes"] + ov["cublaslt_workspace_bytes"]
    assert d["peak_allocated_bytes"] >= d["peak_tensor_bytes"] + workspaces
    assert d["peak_reserved_bytes"] >= d["peak_allocated_bytes"]
    assert d["peak_reserved_bytes"] % (2 * 2**20) == 0  # every segment is a multiple of 2 MiB
    assert d["device_total_bytes"] == d["peak_reserved_bytes"] + ov["cuda_context_bytes"] + ov["nccl_bytes"]
    assert d["gpu"] == "h100-sxm" and d["capacity_bytes"] == 81559 * 2**20 and d["fits"] is True
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "128", "--gpu", "a100-80gb", "--json")
    # Ampere under torch 2.13: the default 8 MiB + 128 KiB workspace.
    assert json.loads(out)["overheads"]["cublas_workspace_bytes"] == 4096 * 1024 * 2 + 16 * 1024 * 8


def test_lora_adapter_dtype_reaches_the_workload_and_the_report(capsys):
    """Adapters in the base dtype (peft's autocast_adapter_dtype=False) on a pure-bf16 GPT-2: the report
    names them, and the trainable state is half what peft's default fp32 adapters take."""
    argv = ["estimate", "--model", "gpt2", "--seq-len", "64", "--precision", "bf16", "--lora-rank", "8",
            "--lora-targets", "c_attn"]
    code, out, err = run(capsys, *argv, "--lora-adapter-dtype", "base")
    assert code == 0 and "LoRA r=8 (bfloat16 adapters)" in out, err
    base = json.loads(run(capsys, *argv, "--lora-adapter-dtype", "base", "--json")[1])
    fp32 = json.loads(run(capsys, *argv, "--json")[1])
    assert base["workload"]["lora"]["adapter_dtype"] == "base" and fp32["workload"]["lora"]["adapter_dtype"] == "fp32"
    assert base["trainable_params"] == fp32["trainable_params"]
    # AdamW's two states per adapter parameter: 2 x 2 bytes against 2 x 4 (each tensor rounded to 512 B)
    assert 2 * base["breakdown"]["optimizer_states"] == pytest.approx(fp32["breakdown"]["optimizer_states"], rel=0.02)


def test_estimate_does_not_fit_a_tiny_gpu(capsys):
    code, out, err = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "128", "--gpu-memory", "1GiB", "--json")
    assert code == EXIT_WONT_FIT  # documented: 3 when it does not fit; the report is still printed
    assert err.count("\n") == 1 and "does not fit the h100-sxm (1.0 GiB); exit code 3" in err
    d = json.loads(out)
    assert d["capacity_bytes"] == 2**30 and not d["fits"] and d["device_total_bytes"] > 2**30


def test_estimate_table_lists_every_category(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "gpt2", "--seq-len", "128")
    assert code == 0
    for label in ("parameters", "gradients", "optimizer_states", "activations", "temporaries",
                  "peak tensors", "peak phase", "GiB", "allocated", "reserved", "device total", "verdict"):
        assert label in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["estimate", "--model", "lama-3.1-8b"], "did you mean 'llama-3.1-8b'"),
        (["estimate", "--model", "gpt2", "--seq-len", "0"], "argument --seq-len: 0 is outside [1, 16777216]"),
        (["estimate", "--model", "gpt2", "--batch-size", "-1"], "argument --batch-size: -1 is outside [1, 65536]"),
        (["estimate", "--model", "gpt2", "--precision", "fp8"], "unsupported precision 'fp8'"),
        (["estimate", "--model", "gpt2", "--optimizer", "lion"], "unsupported optimizer 'lion'"),
        (["estimate", "--model", "gpt2", "--seq-len", "512", "--lora-rank", "4", "--lora-targets", "q_proj"],
         "match no module"),
        (["estimate", "--model", "gpt2", "--seq-len", "2048"], "longer than the 1024 positions GPT2LMHeadModel"),
        (["estimate", "--model", "gpt2", "--lora-targets", "c_attn"], "LoRA is off. HINT: add --lora-rank 16"),
        (["estimate", "--model", "gpt2", "--lora-adapter-dtype", "base"], "LoRA is off. HINT: add --lora-rank 16"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == EXIT_BAD_INPUT
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("llmem") and "error: " in err and fragment in err
    assert "HINT" in err and "Traceback" not in err


def test_malformed_config_file_exits_2(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text("{")
    code, _, err = run(capsys, "estimate", "--model", str(cfg))
    assert code == EXIT_BAD_INPUT and "malformed config" in err


def test_models_lists_exact_parameter_counts(capsys):
    code, out, _ = run(capsys, "models", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == set(catalog.names())
    for name, row in rows.items():
        published = catalog.entry(name).published_params
        if published is not None:
            assert row["params"] == published


def test_console_script_offline():
    """The installed `llmem` entry point works in a fresh process with the Hub unreachable."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    exe = os.path.join(os.path.dirname(sys.executable), "llmem")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "llmem_plugin.cli.app"]
    proc = subprocess.run(cmd + ["estimate", "--model", "llama-3.2-1b", "--seq-len", "128", "--fast", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["params"] == 1_235_814_400
    bad = subprocess.run(cmd + ["estimate", "--model", "nope"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == EXIT_BAD_INPUT and "Traceback" not in bad.stderr


TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def _llmem():
    exe = os.path.join(os.path.dirname(sys.executable), "llmem")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "llmem_plugin.cli.app"]


def test_help_and_bad_options_do_not_import_torch():
    # Help and option errors are answered before torch loads (it takes seconds).
    code = ("import sys; from llmem_plugin.cli.app import main; "
            "codes = [main(['--help']), main(['estimate', '--help']), main(['plan', '--help']), "
            "main(['estimate', '--model', 'gpt2', '--seq-len', 'x']), main(['estimate', '--model', 'gpt2', "
            "'--gpus', '99999999999999999999'])]; print(codes, 'torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "[0, 0, 0, 2, 2] False", proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_console_script_exit_codes_0_2_3(tmp_path):
    """Real processes: 0 fits, 2 bad input, 3 does not fit; --help documents them."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    base = [*_llmem(), "estimate", "--model", str(cfg), "--seq-len", "32"]
    fits = subprocess.run([*base, "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert fits.returncode == 0 and json.loads(fits.stdout)["fits"], fits.stderr
    # Two cuBLAS workspaces of 32 MiB on an H100 (overheads.py) alone exceed 8 MiB.
    tight = subprocess.run([*base, "--gpu-memory", "8MiB"], capture_output=True, text=True, env=env, timeout=300)
    assert tight.returncode == EXIT_WONT_FIT and "does NOT fit" in tight.stdout, tight.stderr
    assert tight.stderr.strip().splitlines()[-1].startswith("llmem: the step does not fit the h100-sxm")
    bad = subprocess.run([*base, "--lora-alpha", "nan"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == EXIT_BAD_INPUT and len(bad.stderr.strip().splitlines()) == 1
    assert "--lora-alpha" in bad.stderr and "HINT" in bad.stderr
    top = subprocess.run([*_llmem(), "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert top.returncode == 0 and "Traceback" not in top.stderr  # a '%' in a help string once crashed it
    assert "3 does not fit" in " ".join(top.stdout.split())


def test_every_flag_a_message_names_exists():
    """A HINT that names a flag the CLI does not have sends the user nowhere:
    every --flag in a string literal of the package is an option of some command."""
    import io
    import pathlib
    import re
    import tokenize

    import llmem_plugin
    from llmem_plugin.cli.app import build_parser

    parser = build_parser()
    options = set(parser._option_string_actions)
    for sub in parser._subparsers._group_actions[0].choices.values():
        options |= set(sub._option_string_actions)
    unknown = []
    for path in pathlib.Path(llmem_plugin.__file__).parent.rglob("*.py"):
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.STRING:
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", tok.string):
                    if flag not in options:
                        unknown.append(f"{path.name}:{tok.start[0]} {flag}")
    assert not unknown
