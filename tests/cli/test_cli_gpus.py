"""`llmem gpus`: the GPU catalog as a table and as JSON, and its exit codes."""

from __future__ import annotations

import json

import pytest

from llmem_plugin.cli.options import EXIT_BAD_INPUT
from llmem_plugin.device.gpus import gpu_names

from ._run import run

REQUIRED = {
    "a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "l4",
    "a10g", "l40s", "v100-16gb", "v100-32gb", "rtx-3090", "rtx-4090",
}




def test_gpus_json_lists_the_catalog(capsys):
    code, out, err = run(capsys, "gpus", "--json")
    assert code == 0 and err == ""
    rows = json.loads(out)
    names = [r["name"] for r in rows]
    assert REQUIRED <= set(names) and names == gpu_names()
    h100 = next(r for r in rows if r["name"] == "h100-sxm")
    assert h100["memory_bytes"] == 80 * 2**30
    assert h100["compute_capability"] == [9, 0]
    assert h100["display_name"] == "NVIDIA H100 80GB HBM3"


def test_gpus_json_selects_by_name_or_device_name(capsys):
    code, out, _ = run(capsys, "gpus", "a100-40gb", "NVIDIA GeForce RTX 4090", "--json")
    assert code == 0
    assert [r["name"] for r in json.loads(out)] == ["a100-40gb", "rtx-4090"]


def test_gpus_table_labels_gib(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")
    code, out, _ = run(capsys, "gpus")
    assert code == 0
    assert "memory GiB" in out and "dense" in out
    for name in REQUIRED:
        assert name in out
    assert "141.00" in out  # H200, in GiB


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["gpus", "h10"], "did you mean 'h100-pcie', 'h100-sxm'?"),
        (["gpus", "tpu-v5", "--json"], "unknown GPU 'tpu-v5'"),
    ],
)
def test_unknown_gpu_exits_2_with_one_line(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == EXIT_BAD_INPUT
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("llmem: error: ") and fragment in err
    assert "valid: " in err and "HINT: run 'llmem gpus'" in err
    assert "Traceback" not in err
