"""``llmem validate`` on a fixture JSONL.

tests/fixtures/groundtruth-cpu.jsonl was written by the ground-truth harness's
CPU path (``python -m benchmarks.groundtruth.run --device cpu``): real tensors
measured by the tracker. A fake trace equals such a run byte for byte, so every
allocated error must be exactly zero.

The CUDA rows below are synthetic: their "measured" numbers are set from the
prediction by known factors, so the expected errors, under-estimates and
fits/OOM scores follow by arithmetic. They test the plumbing, not accuracy
(that needs GPU rows in benchmarks/groundtruth/data).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from llmem_plugin.models import catalog
from llmem_plugin.cli.app import main
from llmem_plugin.cli.options import EXIT_BAD_INPUT
from llmem_plugin.errors import ConfigError
from llmem_plugin.estimate import estimate
from llmem_plugin.verify.validate import check_row, load_rows, validate_rows
from llmem_plugin.workload import Workload

FIXTURE = Path(__file__).parent.parent / "fixtures" / "groundtruth-cpu.jsonl"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
H100 = "NVIDIA H100 80GB HBM3"
GiB = 2**30


def test_cpu_fixture_rows_match_exactly():
    rows = load_rows(FIXTURE)
    assert len(rows) >= 6
    report = validate_rows(rows)
    assert [c.id for c in report.rows] == [r["id"] for r in rows]
    for c in report.rows:
        assert c.status == "ok" and c.note == ""
        assert c.predicted["allocated"] == c.measured["allocated"]
        assert c.error_pct["allocated"] == 0.0
    s = report.summary
    assert s["allocated"].num_rows == len(rows) and s["allocated"].max_abs_pct == 0.0
    assert s["reserved"].num_rows == 0 and s["device_total"].num_rows == 0  # CPU has no caching allocator
    assert report.fits_accuracy is None


def _cuda_row(row_id: str, *, status: str = "ok", edge: bool = False, gpu: str = H100, memory: int = 81559 * 2**20,
              idle: int = 0, scale: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> dict:
    wl = Workload(seq_len=64, micro_batch_size=2, precision="bf16-mixed", attn_implementation="sdpa")
    cfg = catalog.load_config("llama-3.2-1b", TINY)
    est = estimate(cfg, wl, gpu="h100-sxm", gpu_memory=memory - idle, alloc_conf="", torch_version="2.11.0")
    pred = (est.peak_allocated_bytes, est.peak_reserved_bytes, est.device_total_bytes)
    meas = [round(p * k) for p, k in zip(pred, scale, strict=True)]
    return {
        "id": row_id, "model": "llama-3.2-1b", "config_overrides": TINY, "runner": "torch", "device": "cuda",
        "edge": edge, "workload": wl.to_dict(), "status": status, "error": None, "steps": [],
        "measured": {"allocated_bytes": meas[0], "reserved_bytes": meas[1], "device_total_bytes": meas[2] + idle},
        "gpu": {"name": gpu, "memory_bytes": memory, "compute_capability": [9, 0], "idle_used_bytes": idle},
        "env": {"torch": "2.11.0+cu128", "PYTORCH_CUDA_ALLOC_CONF": ""}, "seconds": 1.0,
    }


def test_signed_errors_under_estimates_and_idle_memory():
    exact = _cuda_row("exact", idle=500 * 2**20)  # idle memory is not the run's
    under = _cuda_row("under", scale=(1.25, 0.8, 1.0))  # predicted 1/1.25 = -20%, 1/0.8 = +25%
    report = validate_rows([exact, under])
    e, u = report.rows
    assert e.error_pct == {"allocated": 0.0, "reserved": 0.0, "device_total": 0.0}
    assert u.error_pct["allocated"] == pytest.approx(-20.0, abs=1e-6)
    assert u.error_pct["reserved"] == pytest.approx(25.0, abs=1e-6)
    s = report.summary["allocated"]
    assert (s.num_rows, s.num_under) == (2, 1)
    assert s.max_under_pct == pytest.approx(20.0) and s.max_abs_pct == pytest.approx(20.0)
    assert s.mean_abs_pct == pytest.approx(10.0) and s.mean_signed_pct == pytest.approx(-10.0)
    assert report.summary["reserved"].max_under_pct == 0.0  # over-estimates are not under-estimates


def test_fits_verdict_is_scored_on_edge_rows_only():
    tiny_gpu = 300 * 2**20  # below the CUDA context alone: predicted not to fit
    rows = [
        _cuda_row("fits-right", edge=True),
        _cuda_row("oom-right", edge=True, status="oom", memory=tiny_gpu),
        _cuda_row("oom-wrong", edge=True, status="oom"),  # predicted to fit, yet it OOMed
        _cuda_row("not-edge", status="oom"),
    ]
    report = validate_rows(rows)
    verdicts = {c.id: (c.fits_measured, c.fits_predicted) for c in report.rows}
    assert verdicts == {"fits-right": (True, True), "oom-right": (False, False),
                        "oom-wrong": (False, True), "not-edge": (False, True)}
    assert report.num_edge_rows == 3 and report.fits_accuracy == pytest.approx(2 / 3)
    # OOM rows' partial peaks are not scored as errors.
    assert report.summary["allocated"].num_rows == 1


def test_failed_and_unknown_rows_are_reported_not_fatal():
    failed = _cuda_row("failed")
    failed["status"], failed["error"] = "error", "TimeoutExpired: 240 s"
    unknown = copy.deepcopy(_cuda_row("unknown"))
    unknown["gpu"]["name"] = "NVIDIA B200"
    report = validate_rows([failed, unknown])
    assert "TimeoutExpired" in report.rows[0].note and "not in the catalog" in report.rows[1].note
    assert report.skipped == ["failed", "unknown"]
    # --gpu predicts it for a catalog GPU instead.
    assert check_row(unknown, gpu_name="h100-sxm").error_pct["allocated"] == 0.0


def test_cli_json_has_the_documented_keys(capsys):
    assert main(["validate", str(FIXTURE), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["rows"]) == len(load_rows(FIXTURE))
    for metric in ("allocated", "reserved", "device_total"):
        assert {"mean_abs_pct", "max_abs_pct", "max_under_pct"} <= set(d["summary"][metric])
    assert "fits_accuracy" in d["summary"]
    assert main(["validate", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "allocated" in out and "max under" in out and "fits/OOM verdict" in out


def test_bad_files_exit_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    assert main(["validate", str(bad)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.jsonl:1 lacks" in err and "HINT" in err
    bad.write_text("not json\n")
    assert main(["validate", str(bad)]) == EXIT_BAD_INPUT
    assert main(["validate", str(tmp_path / "missing.jsonl")]) == EXIT_BAD_INPUT
    with pytest.raises(ConfigError):
        load_rows(tmp_path / "missing.jsonl")


def test_skipped_rows_are_reported_not_scored():
    # The harness writes "skipped" when a case needs a library the GPU machine lacks.
    skipped = _cuda_row("no-flash")
    skipped["status"], skipped["error"] = "skipped", "flash_attn is not importable. HINT: carry its wheel"
    report = validate_rows([skipped])
    assert report.rows[0].note.startswith("run skipped: flash_attn is not importable")
    assert report.rows[0].error_pct == {m: None for m in report.rows[0].error_pct}
    assert report.skipped == ["no-flash"]
