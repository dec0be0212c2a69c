"""`llmem max`: the answer and its curve, JSON, and the exit codes of bad input and of a job that never fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmem_plugin.cli.options import EXIT_BAD_INPUT, EXIT_WONT_FIT
from llmem_plugin.estimate import estimate

from ._run import run

_TINY = str(Path(__file__).resolve().parents[2] / "benchmarks" / "tiny-llama-2l.json")


def test_max_batch_prints_the_curve_and_the_answer_estimate_agrees_with(capsys):
    code, out, err = run(capsys, "max", "batch-size", "--model", "llama-3.2-1b", "--seq-len", "512",
                         "--gpu-memory", "40GiB", "--headroom", "0", "--json")
    assert code == 0, err
    (r,) = json.loads(out)["results"]
    assert r["next_value"] == r["value"] + 1
    # Independently, at the answer and one above (the CLI's default precision: bf16-mixed).
    fits = [estimate("llama-3.2-1b", gpu_memory="40GiB", seq_len=512, micro_batch_size=b,
                     precision="bf16-mixed").fits for b in (r["value"], r["value"] + 1)]
    assert fits == [True, False]


def test_a_job_that_never_fits_exits_3_with_one_line(capsys):
    code, out, err = run(capsys, "max", "batch-size", "--model", "llama-3.1-8b", "--seq-len", "512",
                         "--gpu", "a100-80gb")
    assert code == EXIT_WONT_FIT
    lines = [ln for ln in err.splitlines() if ln.startswith("llmem:")]
    assert len(lines) == 1 and "even --batch-size 1 does not fit" in lines[0] and "Traceback" not in err
    assert "nothing fits" in out


def test_bad_input_exits_2_naming_the_value(capsys):
    for argv, said in (
        (["--headroom", "1.5"], "headroom '1.5' has no unit"),
        (["--headroom", "90GiB"], "leaves nothing"),
        (["--method", "all"], "--method all names none"),
        (["--gpus", "2"], "without --method names none"),
        (["--method", "nope"], "unknown method 'nope'"),
        (["--multiple-of", "0"], "--multiple-of 0"),
        (["--method", "single", "--gpus", "4"], "--method single is one GPU"),
        (["--at-lens", "512"], "--at-lens lists the lengths of `llmem max table`"),
        (["--headroom", "5"], "has no unit"),
    ):
        code, out, err = run(capsys, "max", "batch-size", "--model", "llama-3.2-1b", *argv)
        assert code == EXIT_BAD_INPUT, (argv, err)
        assert said in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_plot_writes_the_curve(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curve.png"
    code, _, err = run(capsys, "max", "batch-size", "--model", _TINY, "--seq-len", "128",
                       "--gpu-memory", "1.2GiB", "--plot", str(out))
    assert code == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = run(capsys, "max", "batch-size", "--model", _TINY, "--plot", "x.bmp")
    assert code == 2 and "--plot" in err


def test_max_reads_the_job_from_a_config_file(capsys):
    # The file's micro-batch is where the search starts; its LoRA and length are the job's.
    recipe = str(Path(__file__).resolve().parents[2] / "examples" / "recipes" / "torchtune" / "qwen2_5_0_5b_full_single_device.yaml")
    code, out, err = run(capsys, "max", "batch-size", "--config", recipe, "--gpu", "h100-sxm", "--json")
    assert code == 0, err
    doc = json.loads(out)
    (r,) = doc["results"]
    assert doc["config"]["format"] == "torchtune" and r["fixed"] == 2048 and r["next_value"] == r["value"] + 1
