"""`llmem` command line: offline estimates for the whole catalog, JSON shape, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from llmem_plugin import catalog
from llmem_plugin.cli import EXIT_BAD_INPUT, EXIT_WONT_FIT, main

MOE = {"mixtral-8x7b", "qwen3-30b-a3b"}


def run(capsys, *argv: str):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


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
    params, _ = catalog.count_parameters(catalog.load_config(name))
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
        (["estimate", "--model", "gpt2", "--lora-rank", "4", "--lora-targets", "q_proj"], "match no module"),
        (["estimate", "--model", "gpt2", "--lora-targets", "c_attn"], "LoRA is off. HINT: add --lora-rank 16"),
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
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "llmem_plugin.cli"]
    proc = subprocess.run(cmd + ["estimate", "--model", "llama-3.2-1b", "--seq-len", "128", "--fast", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["params"] == 1_235_814_400
    bad = subprocess.run(cmd + ["estimate", "--model", "nope"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == EXIT_BAD_INPUT and "Traceback" not in bad.stderr
