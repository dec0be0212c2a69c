"""The HF Trainer example and the pipeline guard run as documented (CPU, tiny models)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_hf_trainer_example_checks_and_compares(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--tiny", "--gpu", "h100-sxm",
                           "--steps", "3", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "single GPU:" in proc.stdout and "fits h100-sxm" in proc.stdout
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    row = json.loads((out / "llmem-verify.jsonl").read_text().splitlines()[0])
    assert metrics["llmem/actual_peak_gib"] * 2**30 == row["measured"]["allocated_bytes"]
    assert metrics["llmem/predicted_peak_gib"] * 2**30 == row["predicted"]["tensor_bytes"]


def test_hf_trainer_example_aborts_when_it_does_not_fit(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--tiny", "--gpu", "h100-sxm",
                           "--gpu-memory", "0.01GiB", "--output-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    assert "WontFitError" in proc.stderr and "does not fit" in proc.stderr


@pytest.mark.skipif(shutil.which("llmem") is None, reason="the llmem script is not installed (pip install -e .)")
def test_pipeline_guard_runs_the_job_only_when_it_fits(tmp_path):
    script = str(ROOT / "examples" / "pipeline_guard.sh")
    env = {**os.environ, "MODEL": "gpt2", "GPUS": "1", "GPU": "h100-sxm", "SEQ_LEN": "256", "GLOBAL_BATCH": "8",
           "PLAN": str(tmp_path / "plan.json")}
    ok = subprocess.run(["bash", script], capture_output=True, text=True, timeout=300, env=env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    choice = json.loads((tmp_path / "plan.json").read_text())["choice"]
    assert f"method={choice['method']} " in ok.stdout and choice["fits"]
    bad = subprocess.run(["bash", script], capture_output=True, text=True, timeout=120,
                         env={**env, "GPU": "no-such-gpu"})
    assert bad.returncode == 2 and "unknown GPU" in bad.stderr  # exit code of llmem plan passed on
    assert "method=" not in bad.stdout


@pytest.mark.skipif(shutil.which("llmem") is None, reason="the llmem script is not installed (pip install -e .)")
def test_pipeline_guard_leaves_no_file_behind_without_plan(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PLAN"}
    env.update({"MODEL": "gpt2", "GPUS": "1", "GPU": "h100-sxm", "SEQ_LEN": "128", "GLOBAL_BATCH": "1",
                "TMPDIR": str(tmp_path / "tmp")})
    (tmp_path / "tmp").mkdir()
    (tmp_path / "cwd").mkdir()
    ok = subprocess.run(["bash", str(ROOT / "examples" / "pipeline_guard.sh")], capture_output=True, text=True,
                        timeout=300, env=env, cwd=tmp_path / "cwd")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "method=" in ok.stdout
    assert list((tmp_path / "cwd").iterdir()) == []
    assert list((tmp_path / "tmp").glob("llmem-plan*")) == []  # the temporary plan is removed on exit


def test_hf_trainer_example_trains_unchecked_on_cpu_without_a_gpu_name(tmp_path):
    # A new user's first run: no CUDA, no --gpu. The callback warns once with
    # what to pass, and the job trains to the end.
    env = {k: v for k, v in os.environ.items() if k not in ("LLMEM_GPU", "LLMEM_GPU_MEMORY", "LLMEM_STRICT")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--tiny",
                           "--output-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("the job is not checked, training goes on") == 1
    assert "Traceback" not in proc.stderr
